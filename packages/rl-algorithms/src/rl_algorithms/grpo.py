"""GRPO (and RLOO, REINFORCE++, DAPO-style variants): sample, score, compare, push.

    rl grpo --config examples/configs/grpo_math.yaml grpo.max_num_steps=100

One step, top to bottom (``grpo_train``)::

    prompts (num_prompts_per_step) -> repeat x num_generations_per_prompt
    -> refit the generator if its weights are stale -> roll out (generate, environment steps,
       possibly several turns) -> rewards (+ overlong shaping) -> advantages
    -> log-probs under the current policy (pi_old) and the reference
    -> clipped policy-gradient train step(s) -> metrics; validation every val_period steps;
       checkpoint every checkpointing.save_period steps

With ``generation.colocated`` the generator shares the policy's workers' resources and they
take turns; otherwise it gets ``generation.num_workers`` workers of its own. With
``grpo.use_dynamic_sampling`` (DAPO) groups whose rewards are all equal are dropped and more
prompts are rolled out, up to ``grpo.dynamic_sampling_max_gen_batches`` rounds.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from rl_algorithms.advantages import (
    groups_with_signal,
    grpo_advantages,
    overlong_filter,
    overlong_penalty,
    reinforce_plus_plus_advantages,
)
from rl_algorithms.async_config import AsyncGRPOConfig, check_async_config
from rl_algorithms.config import DataSection, RunConfig, TokenizerConfig, recipe_path, set_seed
from rl_algorithms.environments import EnvSection, start_environments, stop_environments
from rl_algorithms.losses import ClippedPGLossConfig, ClippedPGLossFn
from rl_algorithms.rollouts import RolloutResult, run_rollouts
from rl_algorithms.utils.checkpoint import CheckpointManager
from rl_algorithms.utils.logger import Logger
from rl_algorithms.utils.report import report_run
from rl_algorithms.utils.run import reduce_step_metrics, save_checkpoint
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_distributed.config import ConfigModel
from rl_models.generation.config import GenerationConfig
from rl_models.policy.config import DType, PolicyConfig

DEFAULT_RECIPE = recipe_path("grpo")
PHASES = ("refit", "generation", "rewards_and_advantages", "logprobs", "train")
# `rl grpo` with no --config: SmolLM2-135M-Instruct learns two-digit addition on a CPU.
MAIN_RECIPE = recipe_path("grpo_main")


class RewardShapingConfig(ConfigModel):
    """DAPO's soft overlong penalty, added to the reward (see ``advantages.overlong_penalty``)."""

    enabled: bool = False
    max_response_length: int = Field(512, ge=1)
    overlong_buffer_length: int = Field(128, ge=1)
    overlong_buffer_penalty: float = Field(1.0, ge=0)  # the penalty at full length

    @model_validator(mode="after")
    def _buffer_fits(self) -> RewardShapingConfig:
        if self.overlong_buffer_length > self.max_response_length:
            raise ValueError(
                f"grpo.reward_shaping.overlong_buffer_length ({self.overlong_buffer_length}) "
                f"must be <= grpo.reward_shaping.max_response_length ({self.max_response_length})"
            )
        return self


class GRPOConfig(ConfigModel):
    """The loop (NeMo RL's ``grpo.*`` keys)."""

    num_prompts_per_step: int = Field(ge=1)
    num_generations_per_prompt: int = Field(ge=1)
    max_num_steps: int = Field(ge=1)
    max_num_epochs: int = Field(1, ge=1)
    max_rollout_turns: int = Field(1, ge=1)
    advantage_estimator: Literal["grpo", "reinforce_plus_plus"] = "grpo"
    normalize_rewards: bool = True  # divide by the group's std (grpo)
    use_leave_one_out_baseline: bool = False  # grpo: RLOO baseline (normalize_rewards=false: RLOO)
    use_dynamic_sampling: bool = False
    dynamic_sampling_max_gen_batches: int = Field(10, ge=1)
    overlong_filtering: bool = False  # truncated responses out of the loss
    reward_shaping: RewardShapingConfig = Field(default_factory=RewardShapingConfig)
    val_period: int = Field(0, ge=0)  # 0: no validation during training
    val_at_start: bool = False
    val_batch_size: int = Field(8, ge=1)
    max_val_samples: int = Field(64, ge=1)
    seed: int = 42
    async_grpo: AsyncGRPOConfig = Field(default_factory=AsyncGRPOConfig)  # see async_grpo.py


class GRPOPolicyConfig(PolicyConfig):
    max_total_sequence_length: int = Field(ge=2)  # prompt + all turns; longer samples stop

    def worker_config(self) -> PolicyConfig:
        return PolicyConfig.model_validate(self.model_dump(exclude={"max_total_sequence_length"}))


class GRPOGenerationConfig(GenerationConfig):
    num_workers: int = Field(1, ge=1)  # generation workers when not colocated
    # The generator's copy of the policy's model in another dtype (e.g. bfloat16 sampling for
    # a float32 policy: refit casts on the way); None: the policy's dtype.
    dtype: DType | None = None

    def engine_config(self) -> GenerationConfig:
        return GenerationConfig.model_validate(self.model_dump(exclude={"num_workers", "dtype"}))


class MasterConfig(RunConfig):
    policy: GRPOPolicyConfig
    tokenizer: TokenizerConfig
    generation: GRPOGenerationConfig = Field(default_factory=GRPOGenerationConfig)
    loss_fn: ClippedPGLossConfig = Field(default_factory=ClippedPGLossConfig)
    env: EnvSection
    data: DataSection
    grpo: GRPOConfig

    @model_validator(mode="after")
    def _consistent(self) -> MasterConfig:
        g = self.grpo
        rows = g.num_prompts_per_step * g.num_generations_per_prompt
        if rows % self.policy.train_global_batch_size:
            raise ValueError(
                f"policy.train_global_batch_size ({self.policy.train_global_batch_size}) must "
                f"divide grpo.num_prompts_per_step * grpo.num_generations_per_prompt ({rows})"
            )
        if (
            self.loss_fn.reference_policy_kl_penalty > 0
            and not self.policy.reference_policy.enabled
        ):
            raise ValueError(
                "loss_fn.reference_policy_kl_penalty > 0 needs policy.reference_policy.enabled: true"
            )
        if self.generation.backend == "vllm" and self.policy.model.path is None:
            raise ValueError(
                "generation.backend: vllm loads the model from disk: set policy.model.path "
                "(a model built from policy.model.hf_config needs generation.backend: hf)"
            )
        if not self.env:
            raise ValueError("env: configure at least one environment (task_name: {kind: ...})")
        check_async_config(self)
        # On-policy ratios are 1 only if the trainer scores tokens under the distribution the
        # generator sampled from: the same temperature.
        temperature = self.generation.sampling.temperature
        if self.policy.logprob_temperature not in (1.0, temperature):
            raise ValueError(
                f"policy.logprob_temperature ({self.policy.logprob_temperature}) must equal "
                f"generation.sampling.temperature ({temperature}) (or be left out)"
            )
        self.policy.logprob_temperature = temperature
        if self.generation.model is not None and self.generation.dtype is not None:
            raise ValueError("give generation.dtype or generation.model, not both")
        if self.generation.tokenizer is None and self.tokenizer.gguf_file is None:
            # Stop tokens and padding. A GGUF tokenizer is read from the model's converted
            # directory instead (rl_models.model_files), which holds its files.
            self.generation.tokenizer = self.tokenizer.path
        if "seed" not in self.generation.model_fields_set:
            # One seed for the run: grpo.seed orders the prompts and seeds the sampler.
            self.generation.seed = self.grpo.seed
        if self.policy.model.hf_config is not None:
            # A model built from a config is initialised from the seed: the same weights on
            # both sides, so the first step needs no refit.
            self.generation.seed = self.policy.seed
        return self


@dataclass
class GRPORun:
    """Everything the loop works with; ``step`` counts GRPO steps done."""

    config: MasterConfig
    policy: Any  # rl_models Policy
    generation: Any  # a GenerationInterface
    clusters: list[Any]
    envs: dict[str, Any]
    tokenizer: Any
    template: Any
    train_loader: Any
    val_loader: Any
    logger: Logger
    checkpointer: CheckpointManager
    loss_fn: ClippedPGLossFn
    step: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    _prompts: Any = None

    def next_prompts(self) -> BatchedDataDict:
        """The next batch of prompts, going on into the next epoch when one ends."""
        if self._prompts is not None:
            batch = next(self._prompts, None)
            if batch is not None:
                return batch
        self._prompts = iter(self.train_loader)
        return next(self._prompts)

    def shutdown(self) -> None:
        self.logger.close()
        stop_environments(self.envs)
        self.generation.shutdown()
        self.policy.shutdown()
        for cluster in self.clusters:
            cluster.shutdown()


# -- setup ---------------------------------------------------------------------------------------


def make_generation(cluster: Any, config: MasterConfig) -> Any:
    """The generation backend ``generation.backend`` names, on ``cluster``."""
    engine = config.generation.engine_config()
    model = config.policy.model
    if config.generation.dtype is not None:
        model = model.model_copy(update={"dtype": config.generation.dtype})
    if engine.backend == "hf":
        from rl_models.generation.hf_generation import HfGeneration

        return HfGeneration(cluster, engine, model=model, name_prefix="grpo-generation")
    try:
        from rl_models.generation.vllm import VllmGeneration
    except ImportError as e:
        raise RuntimeError(
            f"generation.backend: vllm, but the vLLM backend cannot be imported ({e}); use "
            "generation.backend: hf or install rl-models with its vLLM backend"
        ) from e
    return VllmGeneration(cluster, engine, model=model, name_prefix="grpo-generation")


def setup(config: MasterConfig) -> GRPORun:
    """Tokenizer, prompts, cluster(s), policy, generator, environments, logger; resumes from
    the latest checkpoint in ``checkpointing.checkpoint_dir`` if there is one."""
    from rl_data.collate import rl_collate
    from rl_data.datasets import load_splits
    from rl_data.loader import StatefulDataLoader
    from rl_data.processors import ProcessedDataset
    from rl_data.templates import ChatTemplate
    from rl_data.tokenizers import load_tokenizer
    from rl_distributed.virtual_cluster import RayVirtualCluster, init_ray
    from rl_models.policy.lm_policy import Policy

    set_seed(config.grpo.seed)
    tokenizer = load_tokenizer(config.tokenizer)
    template = ChatTemplate.from_config(config.tokenizer.chat_template, tokenizer)
    splits = load_splits(config.data)
    collate = partial(rl_collate, pad_token_id=tokenizer.pad_token_id)

    def prompts(split: str) -> ProcessedDataset:
        return ProcessedDataset(
            splits[split], tokenizer, template, "prompt", max_seq_length=config.data.max_seq_length
        )

    g = config.grpo
    train_loader = StatefulDataLoader(
        prompts("train"), g.num_prompts_per_step, collate, shuffle=config.data.shuffle, seed=g.seed
    )
    val_loader = None
    if "validation" in splits:
        val_loader = StatefulDataLoader(
            prompts("validation"), g.val_batch_size, collate, shuffle=False, drop_last=False
        )

    checkpointer = CheckpointManager(config.checkpointing)
    latest = checkpointer.latest() if config.checkpointing.enabled else None
    if latest is not None:
        checkpointer.check_resumable(latest, config.model_dump(mode="json"))  # before workers

    cc = config.cluster
    init_ray(num_cpus=cc.ray_num_cpus)
    colocated = config.generation.colocated
    cluster = RayVirtualCluster(
        [cc.workers_per_node] * cc.num_nodes,
        use_gpus=cc.use_gpus,
        num_gpus_per_node=max(cc.gpus_per_node, 1),
        max_colocated_worker_groups=2 if colocated else 1,
        name="grpo-cluster",
    )
    clusters = [cluster]
    policy = Policy(cluster, config.policy.worker_config(), name_prefix="grpo-policy")
    gen_cluster = cluster
    if not colocated:
        gen_cluster = RayVirtualCluster(
            [config.generation.num_workers],
            use_gpus=cc.use_gpus,
            num_gpus_per_node=max(cc.gpus_per_node, 1),
            name="grpo-generation-cluster",
        )
        clusters.append(gen_cluster)
    generation = make_generation(gen_cluster, config)
    envs = start_environments(config.env)

    step, extra = 0, {}
    if latest is not None:
        state = checkpointer.load(latest, policy, dataloader=train_loader)
        step, extra = state["step"], state["extra"]
    logger = Logger(config.logger, config.model_dump(mode="json"), state=extra.get("logger"))
    if latest is not None:
        logger.log_metrics({"resumed_from_step": step}, step=step, prefix="run")
    return GRPORun(
        config=config,
        policy=policy,
        generation=generation,
        clusters=clusters,
        envs=envs,
        tokenizer=tokenizer,
        template=template,
        train_loader=train_loader,
        val_loader=val_loader,
        logger=logger,
        checkpointer=checkpointer,
        loss_fn=ClippedPGLossFn(config.loss_fn, pi_old_is_current=single_update_per_batch(config)),
        step=step,
        extra=extra,
    )


# -- the steps -----------------------------------------------------------------------------------


def refit_if_stale(run: GRPORun) -> dict[str, float]:
    """Copy the policy's weights to the generator when it holds an older version."""
    if run.generation.weight_version == run.policy.weight_version:
        return {}
    from rl_models.generation.refit import refit

    # A generator that samples in a narrower dtype than the policy trains in gets its weights
    # cast on the way: half the bytes to move for a bf16 generator of an fp32 policy.
    gen = run.config.generation
    dtype = gen.dtype or (gen.model.dtype if gen.model is not None else None)
    dtype = dtype if dtype != run.config.policy.model.dtype else None
    stats = refit(run.policy, run.generation, dtype=dtype)
    return {"refit_bytes": float(stats.bytes), "refit_seconds": stats.seconds}


def rollout_prompts(run: GRPORun, prompts: BatchedDataDict, greedy: bool = False) -> RolloutResult:
    """Generation (and environment turns) for a batch whose rows are already repeated."""
    run.generation.prepare_for_generation()
    try:
        return run_rollouts(
            run.generation,
            prompts,
            run.tokenizer,
            run.template,
            run.envs,
            max_seq_len=run.config.policy.max_total_sequence_length,
            max_turns=run.config.grpo.max_rollout_turns,
            greedy=greedy,
            expected_weight_version=run.policy.weight_version,
        )
    finally:
        run.generation.finish_generation()


def generate_rollouts(run: GRPORun) -> tuple[RolloutResult, dict[str, float]]:
    """Roll out ``num_prompts_per_step`` prompts x G samples.

    With dynamic sampling, groups whose rewards are all equal are set aside and further prompts
    are rolled out until enough groups carry a signal or ``dynamic_sampling_max_gen_batches``
    rounds are spent; then the batch is filled up with set-aside groups (advantage 0: they add
    no gradient) so that its size stays what the train step expects.
    """
    g = run.config.grpo
    G = g.num_generations_per_prompt
    kept: list[RolloutResult] = []
    set_aside: list[RolloutResult] = []
    rounds = 0
    while True:
        rounds += 1
        prompts = run.next_prompts().repeat_interleave(G)
        result = rollout_prompts(run, prompts)
        if not g.use_dynamic_sampling:
            return result, {**result.metrics, "generation_rounds": 1.0}
        signal = groups_with_signal(shaped_rewards(run, result), G)
        for p, has_signal in enumerate(signal.tolist()):
            (kept if has_signal else set_aside).append(select_rows(result, range(p * G, p * G + G)))
        if len(kept) >= g.num_prompts_per_step or rounds >= g.dynamic_sampling_max_gen_batches:
            break
    groups = (kept + set_aside)[: g.num_prompts_per_step]
    merged = concat_rollouts(groups)
    return merged, {
        **result.metrics,
        "generation_rounds": float(rounds),
        "dynamic_sampling/groups_with_signal": float(min(len(kept), g.num_prompts_per_step)),
    }


def shaped_rewards(run: GRPORun, result: RolloutResult) -> torch.Tensor:
    """The environments' rewards plus the overlong penalty when reward shaping is on."""
    shaping = run.config.grpo.reward_shaping
    rewards = result.rewards.clone()
    if shaping.enabled:
        lengths = torch.tensor([response_length(log) for log in result.message_logs])
        penalty = overlong_penalty(
            lengths, shaping.max_response_length, shaping.overlong_buffer_length
        )
        rewards += (penalty * shaping.overlong_buffer_penalty).to(rewards.dtype)
    return rewards


def response_length(log: list[dict]) -> int:
    return sum(int(m["token_loss_mask"].sum()) for m in log if "token_loss_mask" in m)


def select_rows(result: RolloutResult, rows: Any) -> RolloutResult:
    rows = list(rows)
    return RolloutResult(
        message_logs=[result.message_logs[i] for i in rows],
        rewards=result.rewards[rows],
        truncated=result.truncated[rows],
        terminated=result.terminated[rows],
        turns=result.turns[rows],
        env_metadata=[result.env_metadata[i] for i in rows],
        answers=[result.answers[i] for i in rows],
    )


def concat_rollouts(parts: list[RolloutResult]) -> RolloutResult:
    return RolloutResult(
        message_logs=[log for p in parts for log in p.message_logs],
        rewards=torch.cat([p.rewards for p in parts]),
        truncated=torch.cat([p.truncated for p in parts]),
        terminated=torch.cat([p.terminated for p in parts]),
        turns=torch.cat([p.turns for p in parts]),
        env_metadata=[m for p in parts for m in p.env_metadata],
        answers=[a for p in parts for a in p.answers],
    )


def compute_advantages(
    run: GRPORun, result: RolloutResult, batch: BatchedDataDict
) -> dict[str, float]:
    """``advantages`` [B, S] and ``sample_mask`` into ``batch``; returns reward metrics."""
    g = run.config.grpo
    rewards = shaped_rewards(run, result)
    if g.advantage_estimator == "reinforce_plus_plus":
        advantages = reinforce_plus_plus_advantages(
            rewards, batch["token_mask"], group_size=g.num_generations_per_prompt
        )
    else:
        per_sample = grpo_advantages(
            rewards,
            g.num_generations_per_prompt,
            leave_one_out=g.use_leave_one_out_baseline,
            normalize_std=g.normalize_rewards,
        )
        advantages = per_sample[:, None] * batch["token_mask"]
    batch["advantages"] = advantages.to(torch.float32)
    sample_mask = torch.ones(len(rewards))
    if g.overlong_filtering:
        sample_mask = overlong_filter(result.truncated, sample_mask)
    batch["sample_mask"] = sample_mask
    on = batch["token_mask"] > 0
    return {
        "reward_mean": float(result.rewards.mean()),
        "reward_std": float(result.rewards.std()) if len(rewards) > 1 else 0.0,
        "shaped_reward_mean": float(rewards.mean()),
        "advantages_mean": float(advantages[on].mean()) if on.any() else 0.0,
        "advantages_abs_mean": float(advantages[on].abs().mean()) if on.any() else 0.0,
        "sample_mask_mean": float(sample_mask.mean()),
    }


def single_update_per_batch(config: MasterConfig) -> bool:
    """One optimiser step per rollout batch: the policy that trains on it is pi_old itself."""
    g = config.grpo
    return (
        config.policy.train_global_batch_size
        == g.num_prompts_per_step * g.num_generations_per_prompt
    )


def compute_logprobs(run: GRPORun, batch: BatchedDataDict) -> None:
    """``prev_logprobs`` (the policy before this step) and, for the KL penalty, the
    reference policy's log-probs, into ``batch``.

    With a single optimiser step per batch pi_old is the policy being trained, so its
    log-probs come out of the train step's own forward pass (see ``ClippedPGLossFn``).
    """
    need_reference = run.config.loss_fn.reference_policy_kl_penalty > 0
    if single_update_per_batch(run.config) and not need_reference:
        return
    run.policy.prepare_for_lp_inference()
    if not single_update_per_batch(run.config):
        batch["prev_logprobs"] = run.policy.get_logprobs(batch)["logprobs"]
    if need_reference:
        ref = run.policy.get_reference_policy_logprobs(batch)["reference_logprobs"]
        batch["reference_policy_logprobs"] = ref


def train_step(run: GRPORun, batch: BatchedDataDict) -> dict[str, float]:
    run.policy.prepare_for_training()
    return reduce_step_metrics(run.policy.train(batch, run.loss_fn))


def validate(run: GRPORun) -> dict[str, float]:
    """Greedy rollouts over (up to ``max_val_samples`` of) the validation prompts."""
    if run.val_loader is None:
        return {}
    refit_if_stale(run)
    run.val_loader.epoch, run.val_loader.position = 0, 0
    rewards, turns, seen = [], [], 0
    for prompts in run.val_loader:
        if seen >= run.config.grpo.max_val_samples:
            break
        result = rollout_prompts(run, prompts, greedy=True)
        rewards.append(result.rewards)
        turns.append(result.turns.double())
        seen += prompts.size
    r = torch.cat(rewards)
    return {
        "reward_mean": float(r.mean()),
        "accuracy": float((r >= 1.0).double().mean()),
        "mean_turns": float(torch.cat(turns).mean()),
        "num_samples": float(len(r)),
    }


# -- the loop ------------------------------------------------------------------------------------


def grpo_train(run: GRPORun) -> dict[str, float]:
    """Train for ``grpo.max_num_steps`` steps (``max_num_epochs`` of prompts at most)."""
    g, timer, logger = run.config.grpo, run.logger.timer, run.logger
    total = min(g.max_num_steps, g.max_num_epochs * len(run.train_loader))
    logger.progress.start(total, done=run.step, description="grpo")
    if g.val_at_start and run.step == 0 and run.val_loader is not None:
        with timer("validation"):
            logger.log_metrics(validate(run), step=0, prefix="val")
    last: dict[str, float] = {}
    while run.step < total:
        step_start = time.perf_counter()
        with timer("refit"):
            refit_metrics = refit_if_stale(run)
        with timer("generation"):
            result, rollout_metrics = generate_rollouts(run)
        batch = result.training_batch(run.tokenizer.pad_token_id)
        with timer("rewards_and_advantages"):
            reward_metrics = compute_advantages(run, result, batch)
        with timer("logprobs"):
            compute_logprobs(run, batch)
        with timer("train"):
            train_metrics = train_step(run, batch)
        run.step += 1

        last = {**train_metrics, **reward_metrics, **rollout_metrics, **refit_metrics}
        last["step_seconds"] = time.perf_counter() - step_start  # wall clock, all phases
        logger.log_metrics({**last, **timer.pop()}, step=run.step, prefix="train")
        done = run.step >= total
        val_metrics: dict[str, float] = {}  # a checkpoint carries its own weights' validation
        if g.val_period and (run.step % g.val_period == 0 or done):
            with timer("validation"):
                val_metrics = validate(run)
            logger.log_metrics(val_metrics, step=run.step, prefix="val")
        if run.checkpointer.should_save(run.step, last_step=done):
            with timer("checkpoint"):
                named = {f"train/{k}": v for k, v in last.items() if math.isfinite(v)}
                save_checkpoint(run, {**named, **{f"val/{k}": v for k, v in val_metrics.items()}})
    logger.progress.stop()
    return last


def main(config: MasterConfig) -> dict[str, float]:
    run = setup(config)
    resumed_at = run.step
    try:
        if config.grpo.async_grpo.enabled:
            from rl_algorithms.async_grpo import async_grpo_train

            last = async_grpo_train(run)
        else:
            last = grpo_train(run)
    finally:
        run.shutdown()
    try:
        report_run(run, resumed_at, PHASES, title="GRPO run")
    except Exception as e:  # the run itself succeeded: a failed plot must not turn it red
        print(f"could not write the run's report: {e!r}")
    return last
