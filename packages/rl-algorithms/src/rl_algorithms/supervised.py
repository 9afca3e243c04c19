"""The loop of SFT, DPO and reward-model training: one optimiser step per batch of a dataset.

The three differ only in their data (``processor``, ``collate``), their loss and how a batch
is prepared for it (masks, reference log-probs); ``setup_supervised`` and ``train_loop`` are
the rest, on the shared run (``rl_algorithms.run``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rl_algorithms.config import LoopConfig, SupervisedRunConfig
from rl_algorithms.run import DataPlan, Run, end_step, reduce_step_metrics, setup_run, start_loop
from rl_data.batch import TrainBatch


def setup_supervised(
    config: SupervisedRunConfig,
    loop: LoopConfig,
    processor: str,
    collate: Callable[..., TrainBatch],
    name: str,
    loss_fn: Any,
) -> Run:
    """A run whose loaders yield ``policy.train_global_batch_size`` samples per step (pairs
    for preference data), resumed from the latest checkpoint if there is one."""
    data = DataPlan(
        processor,
        collate,
        batch_size=config.policy.train_global_batch_size,
        val_batch_size=loop.val_global_batch_size,
        shuffle=config.data.shuffle,
    )
    return setup_run(
        config,
        name=name,
        seed=loop.seed,
        data=data,
        policy=config.policy,
        loss_fn=loss_fn,
        max_steps=loop.max_num_steps,
        max_epochs=loop.max_num_epochs,
        val_period=loop.val_period,
        val_at_end=loop.val_at_end,
    )


def train_loop(
    run: Run,
    loop: LoopConfig,
    prepare_batch: Callable[[TrainBatch], TrainBatch] | None = None,
    rows_per_sample: int = 1,
) -> dict[str, float]:
    """Train until the step or epoch limit; returns the last train metrics.

    ``prepare_batch`` adds to a collated batch what ``run.loss_fn`` reads besides it (DPO: the
    reference log-probs); ``rows_per_sample`` is 2 for preference pairs (a chosen and a
    rejected row).
    """
    prepare_batch = prepare_batch or (lambda batch: batch)
    gbs = run.config.policy.train_global_batch_size * rows_per_sample
    mbs = run.config.policy.train_micro_batch_size * rows_per_sample
    timer = run.logger.timer

    def evaluate(batch: TrainBatch) -> Mapping[str, Any]:
        return run.policy.train(
            prepare_batch(batch),
            run.loss_fn,
            eval_mode=True,
            gbs=loop.val_global_batch_size * rows_per_sample,
            mbs=loop.val_micro_batch_size * rows_per_sample,
        ).metrics

    def validate() -> dict[str, float]:
        return validate_batches(run, loop, evaluate) if run.val_loader is not None else {}

    start_loop(run, validate, loop.val_at_start)
    last: dict[str, float] = {}
    while run.step < run.total_steps:
        batch = run.next_batch()
        with timer("prepare"):
            batch = prepare_batch(batch)
        with timer("train"):
            run.policy.prepare_for_training()
            last = reduce_step_metrics(
                run.policy.train(batch, run.loss_fn, gbs=gbs, mbs=mbs).metrics
            )
        run.step += 1
        end_step(run, last, validate)
    run.logger.progress.stop()
    return last


def validate_batches(
    run: Run, loop: LoopConfig, evaluate: Callable[[TrainBatch], Mapping[str, Any]]
) -> dict[str, float]:
    """The mean of ``evaluate(batch)``'s metrics over the validation set (from its start; it
    is never shuffled), or its first ``loop.val_batches`` batches."""
    assert run.val_loader is not None
    run.val_loader.epoch, run.val_loader.position = 0, 0
    totals: dict[str, float] = {}
    count = 0
    for n, batch in enumerate(run.val_loader):
        if loop.val_batches and n >= loop.val_batches:
            break
        for key, value in reduce_step_metrics(evaluate(batch)).items():
            totals[key] = totals.get(key, 0.0) + value
        count += 1
    return {key: value / count for key, value in totals.items()} if count else {}
