"""Direct preference optimisation, with an optional SFT term on the chosen responses.

Data layout (the ``TrainBatch`` ``rl_data.collate.preference_collate`` produces): 2P rows
for P pairs, **interleaved** — row ``2i`` is pair ``i``'s chosen response, row ``2i + 1`` its
rejected one — so that any even-sized contiguous cut of the batch keeps pairs whole.

- ``input_ids`` / ``input_lengths`` ``[2P, S]`` / ``[2P]``: prompt + response, right-padded;
- ``loss_mask`` ``[2P, S]``: 1 on response tokens (the log-ratio is summed over these);
- ``sample_mask`` ``[2P]``: the pair's loss multiplier, the same on both rows (checked: a pair
  masked on one side only is refused, naming it);
- ``reference_logprobs`` ``[2P, S]``: the frozen reference's next-token log-probs
  (``Policy.get_reference_policy_logprobs``);
- ``idx`` ``[2P]`` (optional): dataset index, equal on both rows of a pair (checked).

Per pair, with ``r(y) = sum_t (log pi(y_t) - log pi_ref(y_t))`` over response tokens (the mean
instead with ``preference_average_log_probs``), the preference loss is
``-log sigmoid(beta * (r(chosen) - r(rejected)))``; the SFT term is the chosen response's NLL
(summed, or averaged with ``sft_average_log_probs``). Both are averaged over the pairs of the
global batch (``global_valid_seqs / 2``), so gradients do not depend on the split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from rl_algorithms.losses.common import check_pairs, global_count
from rl_data.batch import TrainBatch
from rl_distributed.config import ConfigModel


class DPOLossConfig(ConfigModel):
    # beta: the strength of the implicit KL to the reference (NeMo RL's name for it)
    reference_policy_kl_penalty: float = Field(0.05, gt=0)
    # Weight of the DPO preference loss.
    preference_loss_weight: float = Field(1.0, ge=0)
    # Weight of an added NLL loss on the chosen replies (0, none).
    sft_loss_weight: float = Field(0.0, ge=0)
    preference_average_log_probs: bool = False  # mean (not sum) of the log-ratio over tokens
    sft_average_log_probs: bool = False  # mean (not sum) of the chosen NLL over tokens


class DPOLoss:
    """``loss_fn`` for ``Policy.train`` on interleaved (chosen, rejected) rows (module doc)."""

    # The names of the metrics __call__ returns (what a run may rank checkpoints by).
    METRICS = frozenset(
        {
            "loss",
            "preference_loss",
            "sft_loss",
            "accuracy",
            "rewards_chosen_mean",
            "rewards_rejected_mean",
            "num_valid_pairs",
        }
    )

    def __init__(self, config: DPOLossConfig | dict | None = None) -> None:
        self.config = DPOLossConfig.model_validate(config or {})

    def batch_fields(self) -> frozenset[str]:
        """The ``TrainBatch`` fields this loss reads besides the ids and masks."""
        return frozenset({"reference_logprobs"})

    def __call__(
        self,
        logprobs: torch.Tensor,
        batch: TrainBatch,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        check_pairs(batch, logprobs.shape[0], "DPOLoss")
        ref = batch.need("reference_logprobs", "DPOLoss", "[2P, S]")
        ref = ref[:, : logprobs.shape[1]].to(logprobs)
        mask = batch.loss_token_mask().to(logprobs)
        tokens = mask.sum(dim=1)
        log_ratio = ((logprobs - ref) * mask).sum(dim=1)
        if cfg.preference_average_log_probs:
            log_ratio = log_ratio / tokens.clamp(min=1)
        rewards = cfg.reference_policy_kl_penalty * log_ratio  # the implicit rewards
        chosen, rejected = rewards[0::2], rewards[1::2]
        # Only pairs whose both rows count; sample_mask is the pair's multiplier on both rows.
        pair_mask = batch.sample_valid_mask().to(logprobs)[0::2]
        pairs = global_count(global_valid_seqs, logprobs) / 2

        preference = -(F.logsigmoid(chosen - rejected) * pair_mask).sum() / pairs
        nll = -(logprobs * mask).sum(dim=1)[0::2]
        if cfg.sft_average_log_probs:
            nll = nll / tokens[0::2].clamp(min=1)
        sft = (nll * pair_mask).sum() / pairs
        loss = cfg.preference_loss_weight * preference + cfg.sft_loss_weight * sft

        def pair_mean(x: torch.Tensor) -> float:
            return float((x.detach() * pair_mask).sum() / pairs)

        return loss, {
            "loss": float(loss.detach()),
            "preference_loss": float(preference.detach()),
            "sft_loss": float(sft.detach()),
            "accuracy": pair_mean((chosen > rejected).to(logprobs)),
            "rewards_chosen_mean": pair_mean(chosen),
            "rewards_rejected_mean": pair_mean(rejected),
            "num_valid_pairs": float(pair_mask.sum()),
        }
