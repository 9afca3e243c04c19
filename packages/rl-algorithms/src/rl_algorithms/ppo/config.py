"""The config of a PPO run: GRPO's rollouts, policy, generator, environments and data, plus
a critic (``critic.*``), GAE (``ppo.adv_estimator.*``) and the value loss (``value_loss_fn.*``).

Key names follow NeMo RL's PPO recipes where it has them (``ppo.ppo_epochs``,
``ppo.critic_ppo_epochs``, ``ppo.policy_training_start_step``, ``ppo.adv_estimator.gae_gamma``
/ ``gae_lambda`` / ``normalize_advantages``, ``loss_fn.use_kl_in_reward``,
``value_loss_fn.cliprange``). NeMo RL's ``value:`` section is ``critic:`` here.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import AliasChoices, Field, model_validator

from rl_algorithms.config import (
    POLICY_STEP_METRICS,
    IdleOffloadConfig,
    loss_section,
    prefixed,
    recipe_path,
)
from rl_algorithms.grpo.config import (
    VALIDATION_METRICS,
    GRPOLossConfig,
    RLMasterConfig,
    RolloutLoopConfig,
    builtin_loss,
)
from rl_algorithms.losses import ClippedPGLossFn, ClippedValueLossFn
from rl_algorithms.losses.value import ValueLossConfig
from rl_distributed.config import ConfigModel
from rl_models.policy.config import ModelConfig, PolicyConfig

DEFAULT_RECIPE = recipe_path("ppo")
# `rl ppo` with no --config: the main job's task (SmolLM2-135M-Instruct, two-digit addition).
MAIN_RECIPE = recipe_path("ppo_main")

# What a PPO step logs besides the policy's and the losses' metrics.
STEP_METRICS = frozenset(
    {
        "reward_mean",
        "reward_std",
        "shaped_reward_mean",
        "advantages_mean",
        "advantages_abs_mean",
        "returns_mean",
        "values_mean",
        "explained_variance",
        "sample_mask_mean",
        "mean_generated_tokens",
        "truncated_fraction",
        "policy_trained",
    }
)


class GAEConfig(ConfigModel):
    """Generalised advantage estimation (``ppo.gae``), NeMo RL's ``ppo.adv_estimator``."""

    name: Literal["gae"] = "gae"  # the estimator (GAE is the one PPO has)
    gae_gamma: float = Field(1.0, ge=0, le=1)  # discount per action token
    gae_lambda: float = Field(0.95, ge=0, le=1)  # bias (0: one-step TD) vs variance (1: MC)
    # Whiten the advantages over the batch's loss tokens (mean 0, std 1).
    normalize_advantages: bool = True


class PPOConfig(RolloutLoopConfig):
    """The loop (``ppo.*``): GRPO's rollout keys plus PPO's."""

    # One sample per prompt is PPO's classic setting: the critic, not a group, is the baseline.
    num_generations_per_prompt: int = Field(1, ge=1)
    ppo_epochs: int = Field(1, ge=1)  # passes of the policy over each rollout batch
    critic_ppo_epochs: int | None = Field(None, ge=1)  # None: ppo_epochs
    # Steps in which only the critic trains (warm-up), before the policy starts to move.
    policy_training_start_step: int = Field(0, ge=0)
    adv_estimator: GAEConfig = Field(default_factory=GAEConfig)

    @property
    def critic_epochs(self) -> int:
        return self.critic_ppo_epochs or self.ppo_epochs


class PPOValueLossConfig(ValueLossConfig):
    """``value_loss_fn``: ``cliprange`` (NeMo RL's name) or ``value_clip``."""

    value_clip: float | None = Field(
        0.2, gt=0, validation_alias=AliasChoices("value_clip", "cliprange")
    )


class CriticConfig(PolicyConfig):
    """The critic's worker config: any policy key. ``model`` left out: the policy's model with
    a fresh value head (``model.kind: value``); batch sizes left out: the policy's."""

    model: ModelConfig | None = None  # type: ignore[assignment]
    train_global_batch_size: int | None = Field(None, ge=1)  # type: ignore[assignment]
    colocated: bool = True  # shares the policy's bundles (taking turns with it)
    num_workers: int = Field(1, ge=1)  # workers of its own when not colocated
    offload: IdleOffloadConfig = Field(default_factory=IdleOffloadConfig)

    def worker_config(self) -> PolicyConfig:
        exclude = {"colocated": True, "num_workers": True, "offload": {"when_idle"}}
        return PolicyConfig.model_validate(self.model_dump(exclude=exclude))


class MasterConfig(RLMasterConfig):
    # GRPO's: with use_kl_in_reward, -reference_policy_kl_penalty * kl at every action token
    # of the token rewards (the classic RLHF form), not in the loss. Or the policy's loss of
    # your own: {kind: module:Class, kwargs} (no KL penalty then).
    loss_fn: loss_section(GRPOLossConfig) = Field(default_factory=GRPOLossConfig)  # type: ignore[valid-type]
    value_loss_fn: PPOValueLossConfig = Field(default_factory=PPOValueLossConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    ppo: PPOConfig

    LOOP_SECTION: ClassVar[str] = "ppo"

    def logged_metrics(self) -> frozenset[str]:
        builtin = builtin_loss(self)
        loss = (
            self.loss_fn.metrics()
            if builtin is None
            else ClippedPGLossFn(builtin.policy_loss()).METRICS
        )
        policy = POLICY_STEP_METRICS | {"grad_norm"} | loss | STEP_METRICS
        critic = prefixed(
            "critic", POLICY_STEP_METRICS | {"grad_norm"} | ClippedValueLossFn.METRICS
        )
        return prefixed("train", policy | critic) | prefixed("val", VALIDATION_METRICS)

    @model_validator(mode="after")
    def _ppo_consistent(self) -> MasterConfig:
        p = self.ppo
        if p.use_dynamic_sampling:
            raise ValueError(
                "ppo.use_dynamic_sampling: dynamic sampling drops groups whose rewards are all "
                "equal, which carry no signal for GRPO only; a critic's baseline learns from "
                "them. Set it to false"
            )
        c = self.critic
        if c.lora.enabled:
            raise ValueError(
                "critic.lora.enabled: a critic trains its whole model (its value head is new); "
                "set critic.lora.enabled: false"
            )
        if c.model is None:
            c.model = self.policy.model.model_copy(update={"kind": "value"})
        elif c.model.kind != "value":
            raise ValueError(
                f"critic.model.kind is {c.model.kind!r}; a critic is a value model: set it "
                "to value (or leave critic.model out to start from the policy's model)"
            )
        if "seed" not in c.model_fields_set:
            # The policy's seed: a critic built from the policy's config gets its backbone.
            c.seed = self.policy.seed
        c.offload.resolve("critic", c.colocated, self.cluster.use_gpus)
        if c.train_global_batch_size is None:
            c.train_global_batch_size = self.policy.train_global_batch_size
        rows = p.num_prompts_per_step * p.num_generations_per_prompt
        if rows % c.train_global_batch_size:
            raise ValueError(
                f"critic.train_global_batch_size ({c.train_global_batch_size}) must divide "
                f"ppo.num_prompts_per_step * ppo.num_generations_per_prompt ({rows})"
            )
        PolicyConfig.model_validate(c.worker_config().model_dump())  # backend checks, named
        return self
