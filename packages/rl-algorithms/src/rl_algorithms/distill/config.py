"""The config of an on-policy distillation run: GRPO's rollouts, policy (the student),
generator, environments and data, plus a frozen teacher (``teacher.*``), the distillation
loss (``loss_fn.*``) and, optionally, GRPO's reward and loss beside it.

Key names follow NeMo RL's distillation recipes (``distillation.topk_logits_k``,
``loss_fn.kl_type`` / ``mixed_kl_weight`` / ``zero_outside_topk``, ``teacher:``).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from rl_algorithms.config import (
    POLICY_STEP_METRICS,
    IdleOffloadConfig,
    TokenizerConfig,
    prefixed,
    recipe_path,
)
from rl_algorithms.grpo.config import VALIDATION_METRICS, RLMasterConfig, RolloutLoopConfig
from rl_algorithms.losses import ClippedPGLossConfig, DistillationLossConfig
from rl_models.policy.config import ModelConfig, PolicyConfig

DEFAULT_RECIPE = recipe_path("distill")

STEP_METRICS = frozenset(
    {"reward_mean", "reward_std", "mean_generated_tokens", "truncated_fraction"}
)


class DistillationConfig(RolloutLoopConfig):
    """The loop (``distillation.*``, NeMo RL's keys)."""

    num_generations_per_prompt: int = Field(1, ge=1)
    # The teacher's k most likely tokens per position (loss_fn.estimator: topk).
    topk_logits_k: int = Field(64, ge=1)
    # Add GRPO's clipped policy gradient on the environments' rewards (group-normalised
    # advantages, grpo_loss_fn.*) to the distillation loss.
    grpo_reward: bool = False


class TeacherConfig(PolicyConfig):
    """The teacher's worker config (any policy key; it never trains, so optimiser settings are
    moot). ``tokenizer``: where its tokenizer lives, when ``model.path`` has none."""

    model: ModelConfig
    train_global_batch_size: int = Field(1, ge=1)
    tokenizer: TokenizerConfig | None = None
    colocated: bool = True  # shares the student's bundles (taking turns with it)
    num_workers: int = Field(1, ge=1)  # workers of its own when not colocated
    offload: IdleOffloadConfig = Field(default_factory=IdleOffloadConfig)

    def worker_config(self) -> PolicyConfig:
        exclude = {"tokenizer": True, "colocated": True, "num_workers": True}
        dumped = self.model_dump(exclude={**exclude, "offload": {"when_idle"}})
        return PolicyConfig.model_validate(dumped)


class MasterConfig(RLMasterConfig):
    loss_fn: DistillationLossConfig = Field(default_factory=DistillationLossConfig)
    grpo_loss_fn: ClippedPGLossConfig = Field(default_factory=ClippedPGLossConfig)
    teacher: TeacherConfig
    distillation: DistillationConfig

    LOOP_SECTION: ClassVar[str] = "distillation"

    def logged_metrics(self) -> frozenset[str]:
        from rl_algorithms.losses import DistillationLossFn

        train = POLICY_STEP_METRICS | {"grad_norm"} | STEP_METRICS
        train |= DistillationLossFn(self.loss_fn).METRICS
        return prefixed("train", train) | prefixed("val", VALIDATION_METRICS)

    @model_validator(mode="after")
    def _distillation_consistent(self) -> MasterConfig:
        d = self.distillation
        self.teacher.offload.resolve("teacher", self.teacher.colocated, self.cluster.use_gpus)
        if self.teacher.model.kind != "causal_lm":
            raise ValueError(
                f"teacher.model.kind is {self.teacher.model.kind!r}: a teacher is a causal_lm"
            )
        rows = d.num_prompts_per_step * d.num_generations_per_prompt
        if (
            self.loss_fn.estimator == "sampled_token"
            and self.policy.train_global_batch_size != rows
        ):
            raise ValueError(
                "loss_fn.estimator: sampled_token needs samples of the student being trained: "
                f"one optimiser step per batch, policy.train_global_batch_size = "
                f"distillation.num_prompts_per_step * num_generations_per_prompt ({rows})"
            )
        if self.grpo_loss_fn.entropy_coef > 0:
            # The distillation loss hands its policy-gradient part log-probs only.
            raise ValueError(
                "grpo_loss_fn.entropy_coef must be 0 in distillation: the entropy bonus is "
                "GRPO's loss_fn.entropy_coef, not available beside a distillation loss"
            )
        if d.grpo_reward and self.policy.train_global_batch_size != rows:
            raise ValueError(
                "distillation.grpo_reward: true trains on-policy, one optimiser step per batch: "
                f"set policy.train_global_batch_size to distillation.num_prompts_per_step * "
                f"num_generations_per_prompt ({rows})"
            )
        if (
            d.grpo_reward
            and self.grpo_loss_fn.reference_policy_kl_penalty > 0
            and not self.policy.reference_policy.enabled
        ):
            raise ValueError(
                "grpo_loss_fn.reference_policy_kl_penalty > 0 needs "
                "policy.reference_policy.enabled: true"
            )
        if self.loss_fn.estimator == "topk" and not self.policy.supports_gathered_logprobs:
            raise ValueError(
                f"loss_fn.estimator: topk reads the student's log-probs at the teacher's top-k "
                f"ids, which policy.backend: {self.policy.backend} does not give (dtensor does); "
                "use loss_fn.estimator: sampled_token"
            )
        if d.grpo_reward and d.num_generations_per_prompt < 2:
            raise ValueError(
                "distillation.grpo_reward: true compares each sample with its group: set "
                "distillation.num_generations_per_prompt >= 2"
            )
        if d.use_dynamic_sampling:
            raise ValueError("distillation.use_dynamic_sampling is not supported; set it to false")
        if self.loss_fn.estimator == "topk" and not self.teacher.supports_topk_logprobs:
            raise ValueError(
                f"loss_fn.estimator: topk reads the teacher's top-k log-probs, which "
                f"teacher.backend: {self.teacher.backend} does not give (dtensor does); use "
                "loss_fn.estimator: sampled_token (the sampled tokens' log-probs)"
            )
        return self
