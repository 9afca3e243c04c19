"""Supervised fine-tuning: next-token NLL on the assistant turns of conversations.

    rl sft --config examples/configs/sft_cpu.yaml sft.max_num_steps=100

Each step takes ``policy.train_global_batch_size`` conversations and trains one optimiser step
on them (``train/*`` metrics); every ``sft.val_period`` steps the validation set is scored
(``val/*``); every ``checkpointing.save_period`` steps, and at the end, a checkpoint is written.
Re-running with the same ``checkpointing.checkpoint_dir`` resumes from its latest checkpoint.
"""

from __future__ import annotations

from pydantic import Field

from rl_algorithms.config import LoopConfig, SupervisedRunConfig, recipe_path
from rl_algorithms.run import Run
from rl_algorithms.supervised import setup_supervised, train_loop
from rl_models.policy.config import PolicyConfig

DEFAULT_RECIPE = recipe_path("sft")


class SFTConfig(LoopConfig):
    """The SFT loop (NeMo RL's ``sft.*`` keys)."""


class MasterConfig(SupervisedRunConfig):
    policy: PolicyConfig
    sft: SFTConfig = Field(default_factory=SFTConfig)

    def loss_metrics(self) -> frozenset[str]:
        from rl_models.losses import NLLLoss

        return NLLLoss.METRICS


def setup(config: MasterConfig) -> Run:
    """Tokenizer, conversations, cluster, policy, logger, checkpoints (resumed if any)."""
    from rl_data.collate import sft_collate
    from rl_models.losses import NLLLoss

    return setup_supervised(config, config.sft, "sft", sft_collate, "sft", NLLLoss())


def sft_train(run: Run) -> dict[str, float]:
    """Train until ``sft.max_num_steps`` or ``sft.max_num_epochs``; the last train metrics."""
    return train_loop(run, run.config.sft)


def main(config: MasterConfig) -> dict[str, float]:
    run = setup(config)
    try:
        return sft_train(run)
    finally:
        run.shutdown()
