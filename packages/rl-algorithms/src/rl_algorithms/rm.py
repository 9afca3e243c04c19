"""Reward-model training: a sequence classifier scores chosen above rejected (Bradley-Terry).

    rl rm --config examples/configs/rm_cpu.yaml

The policy is a ``sequence_classification`` model (``policy.model.kind``) whose first score is
the reward. Each step takes ``policy.train_global_batch_size`` preference pairs (chosen and
rejected rows interleaved) and trains one optimiser step on ``-log sigmoid(r_chosen -
r_rejected)`` (``rl_algorithms.losses.BradleyTerryLoss``); validation reports the loss and the
share of pairs ranked right. The checkpoint is a Hugging Face sequence-classification model,
which rl-envs' reward-model environment can load.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from rl_algorithms.config import LoopConfig, SupervisedRunConfig, recipe_path
from rl_algorithms.run import Run
from rl_algorithms.supervised import setup_supervised, train_loop
from rl_models.policy.config import PolicyConfig

DEFAULT_RECIPE = recipe_path("rm")


class RMConfig(LoopConfig):
    """The reward-model loop (``rm.*`` keys, as ``sft.*``)."""


class MasterConfig(SupervisedRunConfig):
    policy: PolicyConfig
    rm: RMConfig = Field(default_factory=RMConfig)

    def loss_metrics(self) -> frozenset[str]:
        from rl_algorithms.losses.preference import BradleyTerryLoss

        return BradleyTerryLoss.METRICS

    @model_validator(mode="after")
    def _needs_a_classifier(self) -> MasterConfig:
        if self.policy.model.kind != "sequence_classification":
            raise ValueError(
                "reward-model training needs policy.model.kind: sequence_classification"
            )
        if self.policy.dynamic_batching.enabled == "auto":
            # Pairs must share a micro-batch, so `auto` (dynamic batching on CPU) means fixed
            # micro-batches here.
            self.policy.dynamic_batching.enabled = False
        if self.policy.sequence_packing.enabled or self.policy.dynamic_batching.enabled:
            raise ValueError(
                "the Bradley-Terry loss keeps each (chosen, rejected) pair in one micro-batch: "
                "disable policy.sequence_packing and policy.dynamic_batching"
            )
        return self


def setup(config: MasterConfig) -> Run:
    """Tokenizer, preference pairs, cluster, reward model, logger, checkpoints."""
    from rl_algorithms.losses.preference import BradleyTerryLoss
    from rl_data.collate import preference_collate

    loss_fn = BradleyTerryLoss()
    return setup_supervised(config, config.rm, "preference", preference_collate, "rm", loss_fn)


def rm_train(run: Run) -> dict[str, float]:
    """Train until ``rm.max_num_steps`` or ``rm.max_num_epochs``; the last train metrics."""
    return train_loop(run, run.config.rm, rows_per_sample=2)


def main(config: MasterConfig) -> dict[str, float]:
    run = setup(config)
    try:
        return rm_train(run)
    finally:
        run.shutdown()
