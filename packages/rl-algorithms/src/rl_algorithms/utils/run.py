"""The parts of a supervised run (SFT, DPO, RM) that do not depend on the algorithm.

Each loop module reads top to bottom; what it shares with the others lives here: starting the
cluster and policy, building data loaders, resuming, validating, and logging a step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from rl_algorithms.config import ClusterConfig, LoopConfig, SupervisedRunConfig, set_seed
from rl_algorithms.utils.checkpoint import CheckpointManager
from rl_algorithms.utils.logger import Logger
from rl_data.loader import StatefulDataLoader
from rl_distributed.batched_data_dict import BatchedDataDict


@dataclass
class SupervisedRun:
    """Everything a supervised loop works with; ``step`` counts optimiser steps done."""

    config: SupervisedRunConfig
    loop: LoopConfig
    cluster: Any  # RayVirtualCluster
    policy: Any  # rl_models Policy
    tokenizer: Any
    train_loader: StatefulDataLoader
    val_loader: StatefulDataLoader | None
    logger: Logger
    checkpointer: CheckpointManager
    step: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_steps(self) -> int:
        return min(self.loop.max_num_steps, self.loop.max_num_epochs * len(self.train_loader))

    def shutdown(self) -> None:
        self.logger.close()
        self.policy.shutdown()
        self.cluster.shutdown()


def start_cluster(config: ClusterConfig, name: str) -> Any:
    """A Ray virtual cluster for the policy workers (starting or attaching to Ray)."""
    from rl_distributed.virtual_cluster import RayVirtualCluster, init_ray

    init_ray(num_cpus=config.ray_num_cpus)
    return RayVirtualCluster(
        [config.workers_per_node] * config.num_nodes,
        use_gpus=config.use_gpus,
        num_gpus_per_node=max(config.gpus_per_node, 1),
        name=name,
    )


def setup_supervised(
    config: SupervisedRunConfig,
    loop: LoopConfig,
    processor: str,
    collate: Callable[..., BatchedDataDict],
    name: str,
) -> SupervisedRun:
    """Tokenizer, data loaders, cluster, policy, logger and checkpoints; resumes if it can.

    The loaders yield ``policy.train_global_batch_size`` samples per step (pairs for
    preference data). Resuming restores the policy, the train loader's position, the RNGs and
    the step from the latest complete checkpoint in ``checkpointing.checkpoint_dir``.
    """
    from rl_data.datasets import load_splits
    from rl_data.processors import ProcessedDataset
    from rl_data.templates import ChatTemplate
    from rl_data.tokenizers import load_tokenizer
    from rl_models.policy.lm_policy import Policy

    set_seed(loop.seed)
    tokenizer = load_tokenizer(config.tokenizer)
    template = ChatTemplate.from_config(config.tokenizer.chat_template, tokenizer)
    splits = load_splits(config.data)
    collate_fn = partial(collate, pad_token_id=tokenizer.pad_token_id)

    def dataset(split: str) -> ProcessedDataset:
        return ProcessedDataset(
            splits[split], tokenizer, template, processor, max_seq_length=config.data.max_seq_length
        )

    train_loader = StatefulDataLoader(
        dataset("train"),
        config.policy.train_global_batch_size,
        collate_fn,
        shuffle=config.data.shuffle,
        seed=loop.seed,
    )
    val_loader = None
    if "validation" in splits:
        val_loader = StatefulDataLoader(
            dataset("validation"), loop.val_global_batch_size, collate_fn, shuffle=False
        )

    run_config = config.model_dump(mode="json")
    checkpointer = CheckpointManager(config.checkpointing)
    latest = checkpointer.latest() if config.checkpointing.enabled else None
    if latest is not None:
        checkpointer.check_resumable(latest, run_config)  # before any worker starts
    cluster = start_cluster(config.cluster, name=f"{name}-cluster")
    policy = Policy(cluster, config.policy, name_prefix=f"{name}-policy")
    step, extra = 0, {}
    if latest is not None:
        state = checkpointer.load(latest, policy, dataloader=train_loader)
        step, extra = state["step"], state["extra"]
    logger = Logger(config.logger, run_config=run_config, state=extra.get("logger"))
    if latest is not None:
        logger.log_metrics({"resumed_from_step": step}, step=step, prefix="run")
    return SupervisedRun(
        config=config,
        loop=loop,
        cluster=cluster,
        policy=policy,
        tokenizer=tokenizer,
        train_loader=train_loader,
        val_loader=val_loader,
        logger=logger,
        checkpointer=checkpointer,
        step=step,
        extra=extra,
    )


def reduce_step_metrics(results: Mapping[str, Any]) -> dict[str, float]:
    """``Policy.train``'s per-step lists as one number each (min/max for ``_min``/``_max``
    keys, else the mean over the steps)."""
    out: dict[str, float] = {}
    for key, values in results.items():
        values = values if isinstance(values, list | tuple) else [values]
        values = [float(v) for v in values]
        if not values:
            continue
        if key.endswith("_min"):
            out[key] = min(values)
        elif key.endswith("_max"):
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def validate(
    run: SupervisedRun,
    batches: Iterable[BatchedDataDict],
    evaluate: Callable[[BatchedDataDict], Mapping[str, Any]],
) -> dict[str, float]:
    """The mean over validation batches of ``evaluate(batch)``'s metrics."""
    totals: dict[str, float] = {}
    count = 0
    for n, batch in enumerate(batches):
        if run.loop.val_batches and n >= run.loop.val_batches:
            break
        for key, value in reduce_step_metrics(evaluate(batch)).items():
            totals[key] = totals.get(key, 0.0) + value
        count += 1
    return {key: value / count for key, value in totals.items()} if count else {}


def validation_batches(run: SupervisedRun) -> Iterable[BatchedDataDict]:
    """One pass over the validation set from its start (it is never shuffled)."""
    assert run.val_loader is not None
    run.val_loader.epoch, run.val_loader.position = 0, 0
    return iter(run.val_loader)


def train_loop(
    run: SupervisedRun,
    loss_fn: Any,
    prepare_batch: Callable[[BatchedDataDict], BatchedDataDict],
    rows_per_sample: int = 1,
) -> dict[str, float]:
    """The supervised loop: one optimiser step per batch until the step or epoch limit.

    ``prepare_batch`` turns a collated batch into what ``loss_fn`` reads (masks, reference
    log-probs); ``rows_per_sample`` is 2 for preference pairs (a chosen and a rejected row).
    Logs ``train/*`` every step and ``val/*`` every ``val_period`` steps; checkpoints every
    ``checkpointing.save_period`` steps and at the end. Returns the last train metrics.
    """
    loop, timer, logger = run.loop, run.logger.timer, run.logger
    gbs = run.config.policy.train_global_batch_size * rows_per_sample
    mbs = run.config.policy.train_micro_batch_size * rows_per_sample

    def evaluate(batch: BatchedDataDict) -> Mapping[str, Any]:
        batch = prepare_batch(batch)
        return run.policy.train(
            batch,
            loss_fn,
            eval_mode=True,
            gbs=loop.val_global_batch_size * rows_per_sample,
            mbs=loop.val_micro_batch_size * rows_per_sample,
        )

    def run_validation() -> dict[str, float]:
        if run.val_loader is None:
            return {}
        with timer("validation"):
            metrics = validate(run, validation_batches(run), evaluate)
        logger.log_metrics(metrics, step=run.step, prefix="val")
        return {f"val/{k}": v for k, v in metrics.items()}

    logger.progress.start(run.total_steps, done=run.step)
    last: dict[str, float] = {}
    if loop.val_at_start and run.step == 0:
        run_validation()
    while run.step < run.total_steps:
        for batch in run.train_loader:  # the rest of this epoch
            with timer("prepare"):
                batch = prepare_batch(batch)
            with timer("train"):
                run.policy.prepare_for_training()
                results = run.policy.train(batch, loss_fn, gbs=gbs, mbs=mbs)
            run.step += 1
            last = reduce_step_metrics(results)
            logger.log_metrics({**last, **timer.pop()}, step=run.step, prefix="train")

            done = run.step >= run.total_steps
            # A checkpoint is ranked by the validation of its own weights only, never an
            # earlier step's (val_period and save_period need not line up).
            val_metrics = {}
            if loop.val_period and (run.step % loop.val_period == 0 or done):
                val_metrics = run_validation()
            if run.checkpointer.should_save(run.step, last_step=done):
                with timer("checkpoint"):
                    train_metrics = {f"train/{k}": v for k, v in last.items()}
                    save_checkpoint(run, {**train_metrics, **val_metrics})
            if done:
                break
    logger.progress.stop()
    return last


def save_checkpoint(run: Any, metrics: Mapping[str, float]) -> None:
    """Checkpoint a run (supervised or GRPO: both hold step, policy, train_loader, logger,
    checkpointer, extra and config) with its loader position and logger state."""
    run.checkpointer.save(
        run.step,
        run.policy,
        dataloader=run.train_loader,
        metrics=metrics,
        extra_state={**run.extra, "logger": run.logger.state_dict()},
        run_config=run.config.model_dump(mode="json"),
        tokenizer=getattr(run, "tokenizer", None),
    )
