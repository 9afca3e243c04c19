"""The supervised loop's bookkeeping, with a stand-in for the policy (no workers needed)."""

import json
from types import SimpleNamespace

import pytest

from rl_algorithms.config import LoopConfig
from rl_algorithms.run import Run, reduce_step_metrics
from rl_algorithms.supervised import train_loop
from rl_algorithms.utils.checkpoint import CheckpointingConfig, CheckpointManager
from rl_algorithms.utils.logger import Logger, LoggerConfig
from rl_data.loader import StatefulDataLoader
from rl_distributed.launchers import CHECKPOINT_DEADLINE_ENV
from rl_models.interfaces import Max, Min, TrainResult


class CountingPolicy:
    """Train loss 1/step; validation loss 10 + the number of optimiser steps taken."""

    def __init__(self):
        self.steps = 0

    def prepare_for_training(self):
        pass

    def train(self, batch, loss_fn, eval_mode=False, gbs=None, mbs=None):
        if eval_mode:
            return TrainResult(0, {"loss": [10.0 + self.steps]})
        self.steps += 1
        return TrainResult(1, {"loss": [1.0 / self.steps]})

    def save_checkpoint(self, path, training_state_dir=None):
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


class ClockedPolicy(CountingPolicy):
    """Each training step takes 10 s on a clock the test owns."""

    def __init__(self, clock: list[float]):
        super().__init__()
        self.clock = clock

    def train(self, batch, loss_fn, eval_mode=False, gbs=None, mbs=None):
        self.clock[0] += 10.0
        return super().train(batch, loss_fn, eval_mode, gbs, mbs)


@pytest.mark.parametrize(
    ("must_save_by", "job_deadline", "stop_step"),
    [
        # 35 s from the start: after step 3 (30 s) a fourth 10-s step would end at 40 s.
        ("00:00:00:35", None, 3),
        # 15 s: the first step (10 s) is timed too, so a second would end past the limit.
        ("00:00:00:15", None, 1),
        # The Slurm job's end (rl-cluster slurm's script exports it) at 25 s comes first.
        ("00:00:00:35", 1_000_025, 2),
        (None, 1_000_025, 2),
    ],
)
def test_near_the_time_limit_the_run_saves_and_stops(
    tmp_path, monkeypatch, must_save_by, job_deadline, stop_step
):
    if job_deadline is None:
        monkeypatch.delenv(CHECKPOINT_DEADLINE_ENV, raising=False)
    else:
        monkeypatch.setenv(CHECKPOINT_DEADLINE_ENV, str(job_deadline))
    clock = [1_000_000.0]
    policy = ClockedPolicy(clock)
    config = SimpleNamespace(
        policy=SimpleNamespace(train_global_batch_size=1, train_micro_batch_size=1),
        model_dump=lambda mode: {},
    )
    checkpointing = CheckpointingConfig(
        checkpoint_dir=str(tmp_path / "ckpt"), save_period=100, checkpoint_must_save_by=must_save_by
    )
    run = Run(
        name="sft",
        config=config,
        clusters=[],
        total_steps=8,
        policy=policy,
        tokenizer=None,
        template=None,
        train_loader=StatefulDataLoader(list(range(8)), 1, list),
        val_loader=None,
        logger=Logger(LoggerConfig(log_dir=str(tmp_path / "logs"), progress_bar=False)),
        checkpointer=CheckpointManager(checkpointing, clock=lambda: clock[0]),
    )
    train_loop(run, LoopConfig(max_num_steps=8), prepare_batch=lambda batch: batch)
    run.logger.close()
    assert policy.steps == stop_step and run.step == stop_step
    # The only checkpoint is the one the limit forced (save_period is 100), of the last step.
    assert [p.name for p in run.checkpointer.checkpoints()] == [f"step_{stop_step}"]


def test_step_metrics_reduce_as_declared_not_as_named():
    steps = {"lo": [Min(3.0), Min(1.0)], "hi": [Max(1.0), Max(3.0)], "x_min": [1.0, 3.0]}
    reduced = reduce_step_metrics(steps)
    assert reduced == {"lo": 1.0, "hi": 3.0, "x_min": 2.0}  # a plain float: the mean
    assert all(type(v) is float for v in reduced.values())
