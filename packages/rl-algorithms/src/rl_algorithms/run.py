"""A run, built the same way for every algorithm, and the end of a step every loop shares.

``setup_run`` builds what a loop works with, in one order for all of them: seed, tokenizer
and chat template, data loaders, the checkpoint to resume (checked before any worker starts),
the cluster, the actors (``rl_algorithms.actors``: policy, generator, environments), the state
restored from the checkpoint, and the logger. ``end_step`` is how every loop, supervised or RL,
sync or async, finishes a step: log, validate when due, checkpoint when due (and, near the
job's time limit, checkpoint and stop).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from rl_algorithms import actors
from rl_algorithms.checks import check_inputs, check_rows_for_envs, refuse_finished_run
from rl_algorithms.config import RunConfig, set_seed
from rl_algorithms.environments import offered_tools, shares_main_cluster, stop_environments
from rl_algorithms.utils.checkpoint import CheckpointManager, read_info
from rl_algorithms.utils.logger import Logger
from rl_data.batch import TrainBatch
from rl_data.loader import StatefulDataLoader
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.generation.config import GenerationConfig
from rl_models.interfaces import combine_metric
from rl_models.policy.config import ModelConfig, PolicyConfig

if TYPE_CHECKING:  # the run's actors and tokenizer: heavy imports, for annotations only
    from ray.actor import ActorHandle
    from transformers import PreTrainedTokenizerBase

    from rl_algorithms.agent_programs.server import EndpointServer
    from rl_data.templates import ChatTemplate
    from rl_distributed.virtual_cluster import RayVirtualCluster
    from rl_models.generation.interfaces import GenerationInterface
    from rl_models.interfaces import LossFunction
    from rl_models.policy.lm_policy import Policy

log = logging.getLogger(__name__)

#: The algorithm's MasterConfig (``sft.MasterConfig``, ``grpo.MasterConfig``...).
ConfigT = TypeVar("ConfigT", bound=RunConfig)


@dataclass(frozen=True)
class DataPlan:
    """How an algorithm reads its data: which rl-data processor turns a row into a sample
    (``prompt``, ``sft``, ``preference``), how samples are collated, and batch sizes."""

    processor: str
    # Called with pad_token_id=...: a TrainBatch (SFT, DPO, RM) or RL prompts.
    collate: Callable[..., TrainBatch | BatchedDataDict]
    batch_size: int  # samples per train step
    val_batch_size: int
    shuffle: bool = True
    drop_last: bool = True
    val_drop_last: bool = True


@dataclass(frozen=True)
class GeneratorPlan:
    """The generator an algorithm samples with, and where it runs."""

    config: GenerationConfig
    model: ModelConfig | None  # None: the model named in ``config.model``
    colocated: bool = True  # shares the policy's bundles (taking turns with it)
    num_workers: int = 1  # workers of its own cluster, when not colocated


@dataclass(frozen=True)
class ModelPlan:
    """A model of its own beside the policy, a critic or a teacher, and where it runs."""

    config: PolicyConfig
    colocated: bool = True  # shares the policy's bundles (taking turns with it)
    num_workers: int = 1  # workers of its own cluster, when not colocated
    # Off the device between its turns (``Run.take_turns``): offloaded once built.
    offload_when_idle: bool = False


@dataclass
class Run(Generic[ConfigT]):
    """Everything a loop works with; ``step`` counts the steps done (restored on resume)."""

    name: str
    config: ConfigT
    tokenizer: PreTrainedTokenizerBase
    template: ChatTemplate
    train_loader: StatefulDataLoader
    val_loader: StatefulDataLoader | None
    logger: Logger
    checkpointer: CheckpointManager | None  # None: this run neither resumes nor saves
    clusters: list[RayVirtualCluster]
    total_steps: int  # lowered to ``step`` when ``end_step`` stops at the time limit
    val_period: int = 0  # validate every N steps (0: never during training)
    val_at_end: bool | None = None  # and after the last: None when val_period > 0
    policy: Policy | None = None
    generation: GenerationInterface | None = None
    envs: dict[str, ActorHandle] = field(default_factory=dict)  # task name -> its environment
    critic: Policy | None = None  # a value model (PPO), trained beside the policy
    teacher: Policy | None = None  # a frozen model (distillation)
    loss_fn: LossFunction | None = None
    # The OpenAI-compatible endpoint agent programs play through (``agent_programs.server``),
    # started by the first rollout that uses one.
    agent_endpoint: EndpointServer | None = None
    # The models beside the policy that leave the device between their turns (see take_turns).
    offloaded_when_idle: list[Policy] = field(default_factory=list)
    step: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # algorithm state saved with checkpoints
    # A few of the latest training step's samples as text, logged as ``train/samples`` at
    # each validation so that what the policy writes while it learns can be read beside it.
    recent_samples: list[dict[str, Any]] = field(default_factory=list)
    _batches: Iterator[TrainBatch | BatchedDataDict] | None = None

    def next_batch(self) -> TrainBatch | BatchedDataDict:
        """The next batch of the training data (a ``TrainBatch`` of SFT, DPO or RM samples, or RL
        prompts), going on into the next epoch when one ends."""
        if self._batches is not None:
            batch = next(self._batches, None)
            if batch is not None:
                return batch
        self._batches = iter(self.train_loader)
        return next(self._batches)

    def take_turns(self, model: Policy) -> None:
        """Offload ``model`` (a critic or teacher ``Policy``) now and from now on between its
        turns: a loop brings it back before using it (``prepare_for_lp_inference`` /
        ``prepare_for_training``) and offloads it after (``model.offload()``)."""
        model.offload()
        self.offloaded_when_idle.append(model)

    def is_taking_turns(self, model: Policy) -> bool:
        """Whether ``model`` leaves the device between its turns (``take_turns``)."""
        return any(m is model for m in self.offloaded_when_idle)

    def trained_models(self) -> dict[str, Policy]:
        """What a checkpoint holds besides the policy: the models trained beside it."""
        return {"critic": self.critic} if self.critic is not None else {}

    def shutdown(self) -> None:
        if self.logger is not None:
            self.logger.close()
        if self.agent_endpoint is not None:
            self.agent_endpoint.close()
        stop_environments(self.envs)
        for actor in (self.generation, self.teacher, self.critic, self.policy):
            if actor is not None:
                actor.shutdown()
        for cluster in self.clusters:
            cluster.shutdown()


#: The run this process set up last: where an interrupted ``rl`` command stopped.
_last_run: Run | None = None


def last_run() -> Run | None:
    """The run :func:`setup_run` built last in this process (None before any)."""
    return _last_run


def setup_run(
    config: ConfigT,
    *,
    name: str,
    seed: int,
    data: DataPlan,
    policy: PolicyConfig | None = None,
    generator: GeneratorPlan | None = None,
    critic: ModelPlan | None = None,
    teacher: ModelPlan | None = None,
    loss_fn: LossFunction | None = None,
    envs: Mapping[str, Any] | None = None,
    splits: Mapping[str, Any] | None = None,
    max_steps: int | None = None,
    max_epochs: int = 1,
    val_period: int = 0,
    val_at_end: bool | None = None,
) -> Run[ConfigT]:
    """Build a run of algorithm ``name`` (the ``rl`` command's) from its validated ``config``,
    training with ``loss_fn``.

    ``config`` has ``tokenizer``, ``data``, ``cluster`` and ``logger`` sections, and
    ``checkpointing`` when the run saves and resumes: then the latest complete checkpoint in
    ``checkpointing.checkpoint_dir`` is checked against the config, the algorithm and the
    loss before any worker starts (``open_checkpoints``),
    and restores the policy (and critic), the train loader's position, the RNGs, the step and
    ``extra``. Actors that are not colocated get a cluster of their own each.
    ``splits`` (default: ``load_splits(config.data)``) maps ``train`` / ``validation`` to rows.
    The run lasts ``max_steps`` steps or ``max_epochs`` epochs, whichever ends first.
    """
    from rl_data.datasets import load_splits
    from rl_data.processors import ProcessedDataset
    from rl_data.templates import ChatTemplate
    from rl_data.tokenizers import load_tokenizer

    # Another run's checkpoint is refused before anything else is said about it.
    checkpointer, latest = open_checkpoints(config, name, loss_fn)  # before any worker starts
    if latest is not None and max_steps is not None:
        refuse_finished_run(read_info(latest)["step"], max_steps, config, latest)
    # Seconds: the files the config points at, before they are loaded or Ray starts.
    check_inputs(config, data=splits is None)

    set_seed(seed)
    tokenizer = load_tokenizer(config.tokenizer)
    template = ChatTemplate.from_config(config.tokenizer.chat_template, tokenizer)
    splits = load_splits(config.data) if splits is None else splits
    default_tools = offered_tools(envs) if envs else {}
    if envs:
        for rows in splits.values():
            check_rows_for_envs(rows, envs)
    collate = partial(data.collate, pad_token_id=tokenizer.pad_token_id)

    def samples(split: str) -> ProcessedDataset:
        return ProcessedDataset(
            splits[split],
            tokenizer,
            template,
            data.processor,
            max_seq_length=config.data.max_seq_length,
            default_tools=default_tools,
        )

    train_loader = StatefulDataLoader(
        samples("train"),
        data.batch_size,
        collate,
        shuffle=data.shuffle,
        seed=seed,
        drop_last=data.drop_last,
    )
    val_loader = None
    if "validation" in splits:
        val_loader = StatefulDataLoader(
            samples("validation"),
            data.val_batch_size,
            collate,
            shuffle=False,
            drop_last=data.val_drop_last,
        )

    total_steps = min(max_steps or len(train_loader), max_epochs * len(train_loader))
    if latest is not None:  # finished by its epochs, which only the data's length tells
        limit = "max_num_steps" if total_steps == max_steps else "max_num_epochs"
        refuse_finished_run(read_info(latest)["step"], total_steps, config, latest, limit)

    cluster = actors.start_cluster(
        config.cluster,
        f"{name}-cluster",
        groups_per_bundle=groups_per_bundle(policy is not None, (generator, critic, teacher), envs),
    )
    run = Run(
        name=name,
        config=config,
        tokenizer=tokenizer,
        template=template,
        train_loader=train_loader,
        val_loader=val_loader,
        logger=None,  # type: ignore[arg-type]  (started last, once the state is restored)
        checkpointer=checkpointer,
        clusters=[cluster],
        total_steps=total_steps,
        val_period=val_period,
        val_at_end=val_at_end,
        loss_fn=loss_fn,
    )

    global _last_run
    _last_run = run

    def placed(plan: GeneratorPlan | ModelPlan, role: str) -> RayVirtualCluster:
        """The cluster an actor runs on: the main one (the policy's, shared in turns, or the
        only actor's), or one of its own."""
        if plan.colocated or policy is None:
            return cluster
        own = actors.start_cluster(
            config.cluster, f"{name}-{role}-cluster", bundles_per_node=[plan.num_workers]
        )
        run.clusters.append(own)
        return own

    try:
        if policy is not None:
            run.policy = actors.make_policy(cluster, policy, f"{name}-policy")

        if generator is not None:
            run.generation = actors.make_generator(
                placed(generator, "generation"),
                generator.config,
                generator.model,
                f"{name}-generation",
            )
        if critic is not None:
            run.critic = actors.make_critic(
                placed(critic, "critic"), critic.config, f"{name}-critic"
            )
        if teacher is not None:
            run.teacher = actors.make_teacher(
                placed(teacher, "teacher"), teacher.config, f"{name}-teacher"
            )
        if envs:
            run.envs = actors.start_environments(dict(envs), main_cluster=cluster)
        if latest is not None:
            state = checkpointer.load(
                latest, run.policy, dataloader=train_loader, models=run.trained_models()
            )
            run.step, run.extra = state["step"], state["extra"]
        for plan, model in ((critic, run.critic), (teacher, run.teacher)):
            if plan is not None and plan.offload_when_idle:
                run.take_turns(model)  # the first phases (refit, generation) do not use it
    except BaseException:
        run.shutdown()  # what did start, so a failed setup leaves no worker behind
        raise
    run_config = config.model_dump(mode="json")
    run.logger = Logger(config.logger, run_config, state=run.extra.get("logger"))
    if latest is not None:
        run.logger.log_metrics({"resumed_from_step": run.step}, step=run.step, prefix="run")
    return run


def groups_per_bundle(
    has_policy: bool,
    plans: tuple[GeneratorPlan | ModelPlan | None, ...],
    envs: Mapping[str, Any] | None,
) -> int:
    """How many worker groups share each bundle of the run's own cluster: the policy and the
    actors colocated with it, taking turns on it (with no policy, its only actor), and the
    environments' groups that sit there too (a colocated judge)."""
    sharing = sum(plan.colocated for plan in plans if plan is not None) if has_policy else 0
    return 1 + sharing + sum(shares_main_cluster(task, spec) for task, spec in (envs or {}).items())


def open_checkpoints(
    config: RunConfig, algorithm: str, loss_fn: LossFunction | None = None
) -> tuple[CheckpointManager | None, Path | None]:
    """The run's checkpoint manager (None without a ``checkpointing`` section) and the latest
    checkpoint to resume from (None: none, or checkpointing disabled).

    The latest checkpoint must have been written by this algorithm with this loss, model,
    tokenizer and data (``CheckpointManager.check_resumable``): otherwise this raises, before
    any worker starts, and the run never writes into the other run's folder."""
    checkpointing = getattr(config, "checkpointing", None)
    if checkpointing is None:
        return None, None
    checkpointer = CheckpointManager(checkpointing, algorithm=algorithm, loss=loss_fn)
    latest = checkpointer.latest() if checkpointing.enabled else None
    if latest is not None:
        checkpointer.check_resumable(latest, config.model_dump(mode="json"))
    return checkpointer, latest


def start_loop(run: Run, validate: Callable[[], dict[str, float]] | None, at_start: bool) -> None:
    """The progress display, and the validation before the first step if asked for."""
    run.logger.progress.start(run.total_steps, done=run.step, description=run.name)
    if at_start and validate is not None and run.step == 0 and run.val_loader is not None:
        with run.logger.timer("validation"):
            run.logger.log_metrics(validate(), step=0, prefix="val")


def end_step(
    run: Run,
    train_metrics: Mapping[str, float],
    validate: Callable[[], dict[str, float]] | None = None,
    before_checkpoint: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Log the step's metrics (with the phases' times), validate every ``val_period`` steps
    and after the last (as ``val_at_end`` says), checkpoint when ``checkpointing.save_period``
    says so. Returns the validation metrics (empty when none ran).

    A checkpoint is ranked by the validation of its own weights only, never an earlier step's
    (``val_period`` and ``save_period`` need not line up). ``before_checkpoint`` lets a loop
    put state of its own into ``run.extra`` just before it is saved.

    When the run's time is nearly up (``checkpointing.checkpoint_must_save_by``, or the Slurm
    job's end), the step is checkpointed and ``run.total_steps`` lowered to it: the loop ends,
    and running it again resumes from there.
    """
    logger = run.logger
    logger.log_metrics({**train_metrics, **logger.timer.pop()}, step=run.step, prefix="train")
    done = run.step >= run.total_steps
    out_of_time = run.checkpointer is not None and run.checkpointer.out_of_time()
    val_metrics: dict[str, float] = {}
    at_end = run.val_at_end if run.val_at_end is not None else bool(run.val_period)
    in_period = bool(run.val_period) and run.step % run.val_period == 0
    if validate is not None and (in_period or (done and at_end)):
        with logger.timer("validation"):
            val_metrics = validate()
        if val_metrics:
            logger.log_metrics(val_metrics, step=run.step, prefix="val")
        logger.log_samples(run.recent_samples, step=run.step, prefix="train")
    if run.checkpointer is not None and (
        out_of_time or run.checkpointer.should_save(run.step, last_step=done)
    ):
        with logger.timer("checkpoint"):
            if before_checkpoint is not None:
                before_checkpoint()
            named = {f"train/{k}": v for k, v in train_metrics.items() if math.isfinite(v)}
            named.update({f"val/{k}": v for k, v in val_metrics.items()})
            save_checkpoint(run, named)
    if out_of_time and not done:
        log.warning(
            "%s: stopping after step %d of %d, saved before the time limit; run it again to resume",
            run.name,
            run.step,
            run.total_steps,
        )
        run.total_steps = run.step
    return val_metrics


def save_checkpoint(run: Run, metrics: Mapping[str, float]) -> None:
    """Checkpoint the policy with the loader's position, the logger's state and ``extra``.

    A model offloaded between its turns is on the device while it is saved (gathering a
    sharded model's state runs the device's collectives), and offloaded again after."""
    assert run.checkpointer is not None
    away = [m for m in run.trained_models().values() if run.is_taking_turns(m)]
    for model in away:
        model.prepare_for_training()
    run.checkpointer.save(
        run.step,
        run.policy,
        dataloader=run.train_loader,
        models=run.trained_models(),
        metrics=metrics,
        extra_state={**run.extra, "logger": run.logger.state_dict()},
        run_config=run.config.model_dump(mode="json"),
        tokenizer=run.tokenizer,
    )
    for model in away:
        model.offload()


def reduce_step_metrics(results: Mapping[str, Any]) -> dict[str, float]:
    """``Policy.train``'s per-step metric lists (``TrainResult.metrics``) as one number each:
    min / max for ``Min`` / ``Max`` values, else the mean over the steps."""
    out: dict[str, float] = {}
    for key, values in results.items():
        values = values if isinstance(values, list | tuple) else [values]
        if values:
            out[key] = float(combine_metric(values, lambda v: sum(v) / len(v), key))
    return out
