"""The config of a GRPO run (NeMo RL's key names): the loop (``grpo.*``), its asynchronous mode
(``grpo.async_grpo.*``), the policy, the generator, the loss, environments and data.

Every check that involves two sections lives in ``MasterConfig``'s validator, so a bad
combination fails before Ray starts, naming the keys.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from rl_algorithms.agent_loop import AgentLoopConfig
from rl_algorithms.agent_programs.config import AgentProgramConfig
from rl_algorithms.config import (
    POLICY_STEP_METRICS,
    CustomLossConfig,
    DataSection,
    RunConfig,
    TokenizerConfig,
    loss_section,
    prefixed,
    recipe_path,
)
from rl_algorithms.environments import EnvSection, environment_class, shares_main_cluster
from rl_algorithms.losses import ClippedPGLossConfig, ClippedPGLossFn
from rl_algorithms.run import GeneratorPlan
from rl_distributed.config import ConfigModel
from rl_models.generation.config import GenerationConfig
from rl_models.modeling.lora import LoraConfig
from rl_models.modeling.precision import generator_dtype
from rl_models.policy.config import DType, ModelConfig, PolicyConfig

DEFAULT_RECIPE = recipe_path("grpo")
# `rl grpo` with no --config: SmolLM2-135M-Instruct learns two-digit addition on a CPU.
MAIN_RECIPE = recipe_path("grpo_main")

# The metrics of every GRPO step, synchronous or not, besides the policy's and the loss's:
# steps.compute_advantages' reward metrics and the rollouts' lengths. The step logs more under
# some settings (refit sizes, per-turn counts, the async loop's buffer), not listed here.
STEP_METRICS = frozenset(
    {
        "reward_mean",
        "reward_std",
        "shaped_reward_mean",
        "advantages_mean",
        "advantages_abs_mean",
        "sample_mask_mean",
        "mean_generated_tokens",
        "truncated_fraction",
    }
)
# What steps.validate returns.
VALIDATION_METRICS = frozenset({"reward_mean", "accuracy", "mean_turns", "num_samples"})


class AsyncGRPOConfig(ConfigModel):
    """Generation overlaps training: rollouts for step n come from a policy up to
    ``max_trajectory_age_steps`` steps old, and importance sampling corrects for the lag."""

    # Asynchronous GRPO, generation for later steps overlaps training (needs
    # generation.vllm.async_engine).
    enabled: bool = False
    # A sample's age is the trainer's step minus the step of the oldest weights that sampled
    # any of its tokens. Bounded by admission: the collector starts a group only if, trained
    # after the groups already out (oldest first), it is at most this many steps old; a
    # running episode is never thrown away for its age (a refit in flight lets it go on).
    max_trajectory_age_steps: int = Field(1, ge=0)
    # The oldest a group may be when trained on: the trainer waits for a running group at the
    # last step it can be trained in; one older still (more due at a step than it takes) is
    # dropped, its prompt generated again and its tokens counted as discarded. Must be >=
    # max_trajectory_age_steps.
    max_trajectory_span_steps: int = Field(4, ge=0)
    # true: a refit pauses the engine between two decoding steps and the running generations
    # go on with the new weights; false: the collector lets them finish (drain) first.
    in_flight_weight_updates: bool = True
    # A group (G episodes of one prompt: their turns and environment steps) running longer
    # than this is cancelled and its prompt queued again. Set it well above a normal group's.
    max_group_seconds: float = Field(300.0, gt=0)
    # The trainer raises instead of waiting longer than this for one step's groups; a dead,
    # stalled or exhausted collector is reported within seconds regardless.
    max_wait_seconds: float = Field(900.0, gt=0)
    # One call of the collector on a generation engine (submit, poll, cancel); an engine that
    # takes longer is reported as wedged, naming its worker. A worker answers one call at a
    # time, so this must exceed the longest refit or validation generation it runs meanwhile.
    engine_call_seconds: float = Field(300.0, gt=0)
    # Most groups running or waiting in the buffer at once (None: what admission allows,
    # num_prompts_per_step times (max_trajectory_age_steps + 1)).
    max_groups_ahead: int | None = Field(None, ge=1)


class RewardShapingConfig(ConfigModel):
    """DAPO's soft overlong penalty, added to the reward (see ``advantages.overlong_penalty``)."""

    # Add DAPO's soft overlong penalty (negative past the buffer's start) to the reward.
    enabled: bool = False
    # Response length (tokens) at which the full penalty applies.
    max_response_length: int = Field(512, ge=1)
    # Tokens before max_response_length over which the penalty grows linearly from 0.
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


class RewardScalingConfig(ConfigModel):
    """A linear map of the environments' rewards before anything else reads them: each reward
    is clamped to [source_min, source_max], then mapped onto [target_min, target_max] (NeMo
    RL's ``reward_scaling``). Reward components (GDPO) are mapped the same way, each alone."""

    enabled: bool = False  # map the rewards (off: they are used as the environments give them)
    source_min: float = 0.0  # rewards below are clamped up to it, then mapped to target_min
    source_max: float = 1.0  # rewards above are clamped down to it, then mapped to target_max
    target_min: float = 0.0  # what source_min becomes
    target_max: float = 1.0  # what source_max becomes

    @model_validator(mode="after")
    def _source_is_an_interval(self) -> RewardScalingConfig:
        if not self.source_max > self.source_min:
            raise ValueError(
                f"reward_scaling.source_max ({self.source_max}) must be greater than "
                f"reward_scaling.source_min ({self.source_min})"
            )
        return self


class RolloutLoopConfig(ConfigModel):
    """What every loop that samples from the policy and scores the samples shares (GRPO, PPO,
    distillation): the batch of prompts, the rollouts, the length of the run, validation."""

    num_prompts_per_step: int = Field(ge=1)  # prompts per step
    # Responses sampled per prompt (GRPO's group size).
    num_generations_per_prompt: int = Field(ge=1)
    # Training steps; the run stops at max_num_steps or max_num_epochs, whichever comes first.
    max_num_steps: int = Field(ge=1)
    max_num_epochs: int = Field(1, ge=1)  # passes over the prompts
    # Turns per rollout (1: single-turn; more for multi-turn environments).
    max_rollout_turns: int = Field(1, ge=1)
    # How episodes run: each at its own pace, its concurrency and per-episode limits.
    agent_loop: AgentLoopConfig = Field(default_factory=AgentLoopConfig)
    # Episodes played by an agent program of your own through an OpenAI-compatible endpoint
    # (rl_algorithms/agent_programs) instead of the agent loop; null: the agent loop.
    agent_program: AgentProgramConfig | None = None
    # DAPO's dynamic sampling: drop groups whose rewards are all equal, sample more prompts.
    use_dynamic_sampling: bool = False
    # Most generation rounds a step may take to fill its batch with dynamic sampling.
    dynamic_sampling_max_gen_batches: int = Field(10, ge=1)
    overlong_filtering: bool = False  # truncated responses out of the loss
    # Rewards mapped linearly (clamped to a source range) before shaping and advantages.
    reward_scaling: RewardScalingConfig = Field(default_factory=RewardScalingConfig)
    reward_shaping: RewardShapingConfig = Field(default_factory=RewardShapingConfig)
    val_period: int = Field(0, ge=0)  # 0: no validation during training
    # Validate after the last step too: null does when val_period > 0 (the last step ends a
    # period of its own), true always, false only when the last step ends a period.
    val_at_end: bool | None = None
    val_at_start: bool = False  # validate once before the first step
    val_batch_size: int = Field(8, ge=1)  # prompts per validation generation call
    # Most validation prompts used per validation (greedy, one response each).
    max_val_samples: int = Field(64, ge=1)
    seed: int = 42  # seeds the controller (prompt order, held-out rows) and the sampler
    # Warn when every reward of the batch has been the same for this many steps in a row (no
    # signal: nothing learns); 0: never.
    no_signal_warning_steps: int = Field(5, ge=0)
    # Warn once when the loss's gen_train_kl_k3 (the generator/trainer KL per token) exceeds
    # this, and count such steps in train/mismatch_kl_warn_steps; null: never (diagnostics.py).
    mismatch_kl_warn_threshold: float | None = Field(1e-2, gt=0)


class GRPOConfig(RolloutLoopConfig):
    """The loop (NeMo RL's ``grpo.*`` keys)."""

    # grpo (group-normalised rewards), gdpo (each of the environment's reward components
    # group-normalised apart, then weighted and whitened over the batch: needs environments
    # that return them, e.g. kind: reward_functions) or reinforce_plus_plus (batch-normalised;
    # loss_fn.use_kl_in_reward puts the KL penalty into its returns).
    advantage_estimator: Literal["grpo", "gdpo", "reinforce_plus_plus"] = "grpo"
    normalize_rewards: bool = True  # divide by the group's std (grpo, gdpo: each reward's)
    # grpo, gdpo: RLOO baseline (grpo with normalize_rewards=false: RLOO)
    use_leave_one_out_baseline: bool = False
    async_grpo: AsyncGRPOConfig = Field(default_factory=AsyncGRPOConfig)  # see grpo/async_loop.py


class GRPOLossConfig(ClippedPGLossConfig):
    """``loss_fn`` of GRPO and PPO: the clipped policy gradient's keys, and where the KL penalty
    to the reference goes (NeMo RL's ``loss_fn.use_kl_in_reward``)."""

    # The KL penalty folded into the returns (reference_policy_kl_penalty * the per-token KL
    # estimate of reference_policy_kl_type) instead of added to the loss, whose own KL term is
    # then off: PPO's token rewards, REINFORCE++'s returns (grpo.advantage_estimator).
    use_kl_in_reward: bool = False

    @model_validator(mode="after")
    def _penalty_to_fold(self) -> GRPOLossConfig:
        if self.use_kl_in_reward and self.reference_policy_kl_penalty == 0:
            raise ValueError(
                "loss_fn.use_kl_in_reward: true folds loss_fn.reference_policy_kl_penalty into "
                "the rewards, but it is 0: set a penalty or use_kl_in_reward: false"
            )
        return self

    def policy_loss(self) -> ClippedPGLossConfig:
        """The clipped PG loss's own config: without the KL term when it is in the reward."""
        penalty = 0.0 if self.use_kl_in_reward else self.reference_policy_kl_penalty
        dumped = self.model_dump(exclude={"use_kl_in_reward"})
        return ClippedPGLossConfig.model_validate(
            {**dumped, "reference_policy_kl_penalty": penalty}
        )


class GRPOPolicyConfig(PolicyConfig):
    max_total_sequence_length: int = Field(ge=2)  # prompt + all turns; longer samples stop

    def worker_config(self) -> PolicyConfig:
        return PolicyConfig.model_validate(self.model_dump(exclude={"max_total_sequence_length"}))


class GRPOGenerationConfig(GenerationConfig):
    num_workers: int = Field(1, ge=1)  # generation workers when not colocated
    # The generator's copy of the policy's model in another dtype (e.g. bfloat16 sampling for
    # a float32 policy: refit casts on the way); None: the policy's dtype. "auto": bfloat16 on
    # GPUs and on CPUs that compute it natively, the policy's dtype elsewhere (vllm.dtype's
    # own "auto" is another setting: the dtype vLLM loads the model in).
    dtype: DType | Literal["auto"] | None = None

    def copy_dtype(self, use_gpus: bool) -> str | None:
        """The dtype the generator holds the policy in (None: the policy's own)."""
        return generator_dtype(self.dtype, use_gpus)

    @model_validator(mode="after")
    def _one_model_setting(self) -> GRPOGenerationConfig:
        if self.model is not None and self.dtype is not None:
            raise ValueError("give generation.dtype or generation.model, not both")
        return self

    def engine_config(self) -> GenerationConfig:
        return GenerationConfig.model_validate(self.model_dump(exclude={"num_workers", "dtype"}))

    def plan(
        self, model: ModelConfig, use_gpus: bool, lora: LoraConfig | None = None
    ) -> GeneratorPlan:
        """The generator sampling from ``model`` (the policy's, or the model evaluated), held
        in ``dtype``, on ``num_workers`` workers of its own unless colocated; set up to serve
        the adapters of a policy whose ``policy.lora`` is ``lora``, where refits send them."""
        dtype = self.copy_dtype(use_gpus)
        if dtype is not None:
            model = model.model_copy(update={"dtype": dtype})
        engine = self.engine_config().serving_lora(lora)
        return GeneratorPlan(engine, model, self.colocated, self.num_workers)


class RLMasterConfig(RunConfig):
    """What a run that samples from its policy and scores the samples is configured with;
    an algorithm's ``MasterConfig`` adds its loop section (``rollout`` names it) and loss."""

    policy: GRPOPolicyConfig
    tokenizer: TokenizerConfig
    generation: GRPOGenerationConfig = Field(default_factory=GRPOGenerationConfig)
    # One environment per task name: env.<task>.kind (a built-in kind, default the task name, or
    # module:Class) and env.<task>.config.
    env: EnvSection
    data: DataSection

    #: The name of the algorithm's loop section (``grpo``, ``ppo``, ...).
    LOOP_SECTION: ClassVar[str]

    @property
    def rollout(self) -> RolloutLoopConfig:
        """The loop section the shared steps (``grpo.steps``) read."""
        return getattr(self, self.LOOP_SECTION)

    @model_validator(mode="after")
    def _rollouts_consistent(self) -> RLMasterConfig:
        g = self.rollout
        rows = g.num_prompts_per_step * g.num_generations_per_prompt
        if rows % self.policy.train_global_batch_size:
            section = self.LOOP_SECTION
            raise ValueError(
                f"policy.train_global_batch_size ({self.policy.train_global_batch_size}) must "
                f"divide {section}.num_prompts_per_step * {section}.num_generations_per_prompt "
                f"({rows})"
            )
        loss = getattr(self, "loss_fn", None)
        if not self.policy.reference_policy.enabled:
            if getattr(loss, "reference_policy_kl_penalty", 0) > 0:
                raise ValueError(
                    "loss_fn.reference_policy_kl_penalty > 0 needs "
                    "policy.reference_policy.enabled: true"
                )
            if isinstance(loss, CustomLossConfig) and "reference_logprobs" in loss.batch_fields():
                raise ValueError(
                    f"loss_fn.kind {loss.kind!r} reads reference_logprobs (its batch_fields()): "
                    "set policy.reference_policy.enabled: true"
                )
        if getattr(loss, "entropy_coef", 0) > 0 and not self.policy.supports_token_entropy:
            raise ValueError(
                f"loss_fn.entropy_coef > 0 reads the policy's token entropy, which "
                f"policy.backend: {self.policy.backend} does not give (dtensor and megatron "
                "do); set loss_fn.entropy_coef: 0 or change the backend"
            )
        self.generation.serving_lora(self.policy.lora)  # refit: adapters the generator can load
        if self.generation.loads_model_from_disk and self.policy.model.path is None:
            raise ValueError(
                f"generation.backend: {self.generation.backend} loads the model from disk: set "
                "policy.model.path (a model built from policy.model.hf_config needs "
                "generation.backend: hf)"
            )
        if not self.env:
            raise ValueError("env: configure at least one environment (task_name: {kind: ...})")
        if self.policy.router_replay:
            self._record_routes()
        # On-policy ratios are 1 only if the trainer scores tokens under the distribution the
        # generator sampled from: the same temperature.
        temperature = self.generation.sampling.temperature
        if self.policy.logprob_temperature not in (1.0, temperature):
            raise ValueError(
                f"policy.logprob_temperature ({self.policy.logprob_temperature}) must equal "
                f"generation.sampling.temperature ({temperature}) (or be left out)"
            )
        self.policy.logprob_temperature = temperature
        if self.generation.tokenizer is None and self.tokenizer.gguf_file is None:
            # Stop tokens and padding. A GGUF tokenizer is read from the model's converted
            # directory instead (rl_models.model_files), which holds its files.
            self.generation.tokenizer = self.tokenizer.path
        if "seed" not in self.generation.model_fields_set:
            # One seed for the run: the loop's seed orders the prompts and seeds the sampler.
            self.generation.seed = g.seed
        if self.policy.model.hf_config is not None:
            # A model built from a config is initialised from the seed: the same weights on
            # both sides, so the first step needs no refit.
            self.generation.seed = self.policy.seed
        return self

    def _record_routes(self) -> None:
        """``policy.router_replay`` replays the generator's routes: have it record them."""
        reason = self.generation.routed_experts_unsupported
        if reason is not None:
            raise ValueError(
                f"policy.router_replay: true needs the generator's routed experts, which "
                f"generation.backend: {self.generation.backend} does not give ({reason}); use "
                "generation.backend: hf"
            )
        if getattr(self.rollout, "agent_program", None) is not None:
            raise ValueError(
                f"policy.router_replay: true does not work with {self.LOOP_SECTION}."
                "agent_program (its endpoint's turns carry no routed experts)"
            )
        self.generation.record_routed_experts = True


def builtin_loss(config: Any) -> GRPOLossConfig | None:
    """``loss_fn`` when it is the clipped policy gradient's keys, None for a loss of your own
    (``loss_fn.kind``: no KL penalty, nothing folded into the rewards)."""
    return None if isinstance(config.loss_fn, CustomLossConfig) else config.loss_fn


class MasterConfig(RLMasterConfig):
    # The clipped policy gradient's keys, or a loss of your own: {kind: module:Class, kwargs}.
    loss_fn: loss_section(GRPOLossConfig) = Field(default_factory=GRPOLossConfig)  # type: ignore[valid-type]
    grpo: GRPOConfig

    LOOP_SECTION: ClassVar[str] = "grpo"

    def logged_metrics(self) -> frozenset[str]:
        loss = builtin_loss(self)
        loss_metrics = (
            ClippedPGLossFn(loss.policy_loss()).METRICS
            if loss is not None
            else self.loss_fn.metrics()
        )
        train = POLICY_STEP_METRICS | {"grad_norm"} | loss_metrics | STEP_METRICS
        return prefixed("train", train) | prefixed("val", VALIDATION_METRICS)

    @model_validator(mode="after")
    def _async_consistent(self) -> MasterConfig:
        check_async_config(self)
        loss = builtin_loss(self)
        if (
            loss is not None
            and loss.use_kl_in_reward
            and self.grpo.advantage_estimator != "reinforce_plus_plus"
        ):
            raise ValueError(
                "loss_fn.use_kl_in_reward: true needs grpo.advantage_estimator: "
                f"reinforce_plus_plus, not {self.grpo.advantage_estimator!r}: GRPO's advantage "
                "is one number per sample, with no per-token returns to fold the KL into (keep "
                "the KL in the loss: use_kl_in_reward: false)"
            )
        if self.grpo.advantage_estimator == "gdpo":
            check_gdpo_environments(self)
        return self


def check_gdpo_environments(config: Any) -> None:
    """GDPO normalises each component of the reward apart: every environment must return them
    (its class's ``returns_reward_components``), else there is nothing to decouple. A batch's
    components are stacked across its tasks, so several tasks must return the same ones:
    the same reward functions with the same weights."""
    components: dict[str, Any] = {}
    for task, spec in config.env.items():
        cls, env_config = environment_class(task, spec)
        functions = getattr(env_config, "functions", None)
        components[task] = (
            None if functions is None else tuple((f.name, f.weight) for f in functions)
        )
        if not getattr(cls, "returns_reward_components", False):
            raise ValueError(
                f"grpo.advantage_estimator: gdpo normalises each of a reward's components "
                f"apart, but env.{task} ({cls.__name__}) returns a single reward, without "
                "components: use kind: reward_functions with one function per reward (an "
                "environment of your own sets returns_reward_components and returns "
                "EnvironmentReturn.reward_components), or grpo.advantage_estimator: grpo"
            )
    if len(components) > 1 and (None in components.values() or len(set(components.values())) > 1):
        shown = "; ".join(
            f"env.{task}: {'its own' if c is None else [f'{n} x{w:g}' for n, w in c]}"
            for task, c in components.items()
        )
        raise ValueError(
            "grpo.advantage_estimator: gdpo with several environments needs the same reward "
            f"functions, with the same weights, in each ({shown}): a batch's rewards are "
            "normalised one function at a time across its tasks; give every task the same "
            "functions, or train on one task"
        )


def check_async_config(config: Any) -> None:
    """The run config an asynchronous run needs (called from ``grpo.MasterConfig``'s
    validation, so a bad combination fails before Ray starts); errors name the key."""
    a: AsyncGRPOConfig = config.grpo.async_grpo
    if not a.enabled:
        return
    if a.max_wait_seconds <= a.max_group_seconds:
        raise ValueError(
            f"grpo.async_grpo.max_wait_seconds ({a.max_wait_seconds}) must exceed "
            f"grpo.async_grpo.max_group_seconds ({a.max_group_seconds}): a hung group is "
            "cancelled and generated again before the trainer gives up waiting"
        )
    program = config.grpo.agent_program
    if program is not None and program.max_episode_seconds >= a.max_group_seconds:
        raise ValueError(
            f"grpo.agent_program.max_episode_seconds ({program.max_episode_seconds:g}) must be "
            f"below grpo.async_grpo.max_group_seconds ({a.max_group_seconds:g}): a program that "
            "hangs must fail its own episode, not get its whole group cancelled and its prompt "
            "generated again (at each attempt, if it always hangs)"
        )
    loss = builtin_loss(config)
    if loss is not None and not loss.use_importance_sampling_correction:
        raise ValueError(
            "grpo.async_grpo.enabled: true trains on samples from older weights: set "
            "loss_fn.use_importance_sampling_correction: true (its ratios correct for the lag)"
        )
    if loss is None and "generation_logprobs" not in config.loss_fn.batch_fields():
        raise ValueError(
            f"grpo.async_grpo.enabled: true trains on samples from older weights: the loss "
            f"loss_fn.kind {config.loss_fn.kind!r} must correct for the lag and list "
            "generation_logprobs (the sampling policy's log-probs) in its batch_fields()"
        )
    gen = config.generation
    if gen.colocated:
        raise ValueError(
            "grpo.async_grpo.enabled: true needs generation.colocated: false (the generator "
            "runs beside the trainer on workers of its own)"
        )
    if not gen.streams_samples:
        raise ValueError(
            "grpo.async_grpo.enabled: true needs generation.backend: vllm with "
            "generation.vllm.async_engine: true (samples stream back as they finish)"
        )
    if a.max_trajectory_span_steps < a.max_trajectory_age_steps:
        raise ValueError(
            f"grpo.async_grpo.max_trajectory_span_steps ({a.max_trajectory_span_steps}) must be "
            f">= grpo.async_grpo.max_trajectory_age_steps ({a.max_trajectory_age_steps}): groups "
            "admitted in time would be dropped as too old"
        )
    for task, spec in (config.env or {}).items():
        if shares_main_cluster(task, spec):
            raise ValueError(
                f"grpo.async_grpo.enabled: true scores while the policy trains: env.{task}'s "
                "judge cannot take turns on the policy's devices (leave out "
                f"env.{task}.config.resources.colocated, or give it devices of its own)"
            )
