"""The supervised loop's bookkeeping, with a stand-in for the policy (no workers needed)."""

import json
from types import SimpleNamespace

from rl_algorithms.config import LoopConfig
from rl_algorithms.run import Run
from rl_algorithms.supervised import train_loop
from rl_algorithms.utils.checkpoint import CheckpointingConfig, CheckpointManager
from rl_algorithms.utils.logger import Logger, LoggerConfig
from rl_data.loader import StatefulDataLoader


class CountingPolicy:
    """Train loss 1/step; validation loss 10 + the number of optimiser steps taken."""

    def __init__(self):
        self.steps = 0

    def prepare_for_training(self):
        pass

    def train(self, batch, loss_fn, eval_mode=False, gbs=None, mbs=None):
        if eval_mode:
            return {"loss": [10.0 + self.steps]}
        self.steps += 1
        return {"loss": [1.0 / self.steps]}

    def save_checkpoint(self, path):
        pass


def test_a_checkpoint_carries_only_the_validation_of_its_own_weights(tmp_path):
    loop = LoopConfig(max_num_steps=4, val_period=2)
    policy = CountingPolicy()
    config = SimpleNamespace(
        policy=SimpleNamespace(train_global_batch_size=1, train_micro_batch_size=1)
    )
    run = Run(
        name="sft",
        config=config,
        clusters=[],
        total_steps=4,
        val_period=loop.val_period,
        policy=policy,
        tokenizer=None,
        template=None,
        train_loader=StatefulDataLoader(list(range(8)), 1, list),
        val_loader=StatefulDataLoader(list(range(2)), 1, list),
        logger=Logger(LoggerConfig(log_dir=str(tmp_path / "logs"), progress_bar=False)),
        checkpointer=CheckpointManager(
            CheckpointingConfig(
                checkpoint_dir=str(tmp_path / "ckpt"), save_period=1, keep_top_k=None
            )
        ),
    )
    config.model_dump = lambda mode: {}
    train_loop(run, loop, prepare_batch=lambda batch: batch)
    run.logger.close()

    def metrics(step):
        return json.loads((tmp_path / "ckpt" / f"step_{step}" / "info.json").read_text())["metrics"]

    assert metrics(2)["val/loss"] == 12.0 and metrics(4)["val/loss"] == 14.0
    # Steps 1 and 3 were not validated: step 2's result does not describe step 3's weights.
    assert "val/loss" not in metrics(1) and "val/loss" not in metrics(3)
    assert metrics(3)["train/loss"] == 1 / 3
