"""Direct preference optimisation against the frozen initial policy.

    rl dpo --config examples/configs/dpo_cpu.yaml dpo.reference_policy_kl_penalty=0.1

Each step takes ``policy.train_global_batch_size`` preference *pairs* (2x as many rows: chosen
and rejected interleaved, as ``preference_collate`` lays them out), scores both responses under
the reference policy (``policy.reference_policy.enabled``, a frozen copy of the initial
weights), and trains one optimiser step on the DPO loss (``rl_algorithms.losses.DPOLoss``),
optionally plus an SFT term on the chosen responses.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import Field, model_validator

from rl_algorithms.config import LoopConfig, SupervisedRunConfig, recipe_path
from rl_algorithms.losses.dpo import DPOLossConfig
from rl_algorithms.run import Run
from rl_algorithms.supervised import setup_supervised, train_loop
from rl_data.batch import TrainBatch
from rl_models.policy.config import PolicyConfig

DEFAULT_RECIPE = recipe_path("dpo")


class DPOConfig(LoopConfig, DPOLossConfig):
    """The DPO loop and its loss (NeMo RL's ``dpo.*`` keys)."""

    def loss_config(self) -> DPOLossConfig:
        return DPOLossConfig(**{k: getattr(self, k) for k in DPOLossConfig.model_fields})


class MasterConfig(SupervisedRunConfig):
    policy: PolicyConfig
    dpo: DPOConfig = Field(default_factory=DPOConfig)

    def loss_metrics(self) -> frozenset[str]:
        from rl_algorithms.losses.dpo import DPOLoss

        return DPOLoss.METRICS

    @model_validator(mode="after")
    def _needs_reference(self) -> MasterConfig:
        if not self.policy.reference_policy.enabled:
            raise ValueError("DPO needs policy.reference_policy.enabled: true")
        if self.policy.dynamic_batching.enabled == "auto":
            # Pairs must share a micro-batch, so `auto` (dynamic batching on CPU) means fixed
            # micro-batches here.
            self.policy.dynamic_batching.enabled = False
        if self.policy.sequence_packing.enabled or self.policy.dynamic_batching.enabled:
            raise ValueError(
                "DPO keeps each (chosen, rejected) pair in one micro-batch: disable "
                "policy.sequence_packing and policy.dynamic_batching"
            )
        return self


def setup(config: MasterConfig) -> Run:
    """Tokenizer, preference pairs, cluster, policy + reference, logger, checkpoints."""
    from rl_algorithms.losses.dpo import DPOLoss
    from rl_data.collate import preference_collate

    loss_fn = DPOLoss(config.dpo.loss_config())
    return setup_supervised(config, config.dpo, "preference", preference_collate, "dpo", loss_fn)


def with_reference_logprobs(run: Run) -> Callable[[TrainBatch], TrainBatch]:
    """Batch preparation: the reference policy's log-probs of both responses of each pair."""

    def prepare(batch: TrainBatch) -> TrainBatch:
        run.policy.prepare_for_lp_inference()
        reference = run.policy.get_reference_policy_logprobs(batch, at_loss_tokens=True)
        return batch.replace(reference_logprobs=reference["reference_logprobs"])

    return prepare


def dpo_train(run: Run) -> dict[str, float]:
    """Train until ``dpo.max_num_steps`` or ``dpo.max_num_epochs``; the last train metrics."""
    return train_loop(run, run.config.dpo, with_reference_logprobs(run), rows_per_sample=2)


def main(config: MasterConfig) -> dict[str, float]:
    run = setup(config)
    try:
        return dpo_train(run)
    finally:
        run.shutdown()
