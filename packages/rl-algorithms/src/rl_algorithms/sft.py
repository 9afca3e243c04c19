"""Supervised fine-tuning: next-token NLL on the assistant turns of conversations.

    rl sft --config examples/configs/sft.yaml sft.max_num_steps=100

Each step takes ``policy.train_global_batch_size`` conversations, trains one optimiser step
on them, logs ``train/*``; every ``sft.val_period`` steps it logs ``val/*``; every
``checkpointing.save_period`` steps (and at the end) it writes a checkpoint.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from rl_algorithms.config import LoopConfig, SupervisedRunConfig, recipe_path
from rl_algorithms.utils.run import (
    SupervisedRun,
    reduce_step_metrics,
    save_checkpoint,
    setup_supervised,
    validate,
    validation_batches,
)
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.policy.config import PolicyConfig

DEFAULT_RECIPE = recipe_path("sft")


class SFTConfig(LoopConfig):
    """The SFT loop (NeMo RL's ``sft.*`` keys)."""


class MasterConfig(SupervisedRunConfig):
    policy: PolicyConfig
    sft: SFTConfig = Field(default_factory=SFTConfig)


def setup(config: MasterConfig) -> SupervisedRun:
    from rl_data.collate import sft_collate

    return setup_supervised(config, config.sft, "sft", sft_collate, name="sft")


def sft_batch(batch: BatchedDataDict) -> BatchedDataDict:
    """The loss counts the assistant tokens (collate's ``loss_mask``), not every real token."""
    batch["token_mask"] = batch["loss_mask"]
    return batch


def sft_train(run: SupervisedRun) -> dict[str, float]:
    """Train until ``sft.max_num_steps`` or ``sft.max_num_epochs``; the last train metrics."""
    from rl_models.losses import NLLLoss

    loss_fn, loop, timer = NLLLoss(), run.loop, run.logger.timer
    policy_cfg = run.config.policy

    def evaluate(batch: BatchedDataDict) -> dict[str, Any]:
        return run.policy.train(
            sft_batch(batch),
            loss_fn,
            eval_mode=True,
            gbs=loop.val_global_batch_size,
            mbs=loop.val_micro_batch_size,
        )

    def run_validation() -> dict[str, float]:
        if run.val_loader is None:
            return {}
        with timer("validation"):
            metrics = validate(run, validation_batches(run), evaluate)
        run.logger.log_metrics(metrics, step=run.step, prefix="val")
        return {f"val/{k}": v for k, v in metrics.items()}

    run.logger.progress.start(run.total_steps, done=run.step, description="sft")
    last: dict[str, float] = {}
    val_metrics = run_validation() if loop.val_at_start and run.step == 0 else {}
    while run.step < run.total_steps:
        for batch in run.train_loader:  # the rest of this epoch
            with timer("data"):
                batch = sft_batch(batch)
            with timer("train"):
                run.policy.prepare_for_training()
                results = run.policy.train(batch, loss_fn, gbs=policy_cfg.train_global_batch_size)
            run.step += 1
            last = reduce_step_metrics(results)
            run.logger.log_metrics({**last, **timer.pop()}, step=run.step, prefix="train")

            done = run.step >= run.total_steps
            if loop.val_period and (run.step % loop.val_period == 0 or done):
                val_metrics = run_validation()
            if run.checkpointer.should_save(run.step, last_step=done):
                with timer("checkpoint"):
                    save_checkpoint(
                        run, {**{f"train/{k}": v for k, v in last.items()}, **val_metrics}
                    )
            if done:
                break
    run.logger.progress.stop()
    return last


def main(config: MasterConfig) -> dict[str, float]:
    run = setup(config)
    try:
        return sft_train(run)
    finally:
        run.shutdown()
