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

    cluster = start_cluster(config.cluster, name=f"{name}-cluster")
    policy = Policy(cluster, config.policy, name_prefix=f"{name}-policy")
    checkpointer = CheckpointManager(config.checkpointing)
    step, extra = 0, {}
    latest = checkpointer.latest() if config.checkpointing.enabled else None
    if latest is not None:
        state = checkpointer.load(latest, policy, dataloader=train_loader)
        step, extra = state["step"], state["extra"]
    run_config = config.model_dump(mode="json")
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


def save_checkpoint(run: SupervisedRun, metrics: Mapping[str, float]) -> None:
    run.checkpointer.save(
        run.step,
        run.policy,
        dataloader=run.train_loader,
        metrics=metrics,
        extra_state={**run.extra, "logger": run.logger.state_dict()},
    )
