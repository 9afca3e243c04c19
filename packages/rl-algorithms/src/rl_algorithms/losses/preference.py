"""The Bradley-Terry loss of reward-model training.

Same row layout as DPO (``dpo.py``): row ``2i`` is pair ``i``'s chosen response, row ``2i + 1``
its rejected one. A sequence-classifier policy gives ``[2P, num_labels]`` scores; the first
label is the reward. The loss is ``-log sigmoid(s_chosen - s_rejected)`` averaged over the pairs
of the global batch (``global_valid_seqs / 2``); accuracy is the fraction of pairs ranked right.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rl_algorithms.losses.common import check_pairs, global_count
from rl_data.batch import TrainBatch
from rl_models.interfaces import Scores


class BradleyTerryLoss:
    """``loss_fn`` for ``Policy.train`` with a ``sequence_classification`` model."""

    input_type = Scores
    # The names of the metrics __call__ returns (what a run may rank checkpoints by).
    METRICS = frozenset({"loss", "accuracy", "margin_mean", "num_valid_pairs"})

    def __call__(
        self,
        scores: torch.Tensor,
        batch: TrainBatch,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if scores.dim() != 2:
            raise ValueError(
                f"BradleyTerryLoss takes [rows, num_labels] scores of a sequence classifier, got "
                f"shape {tuple(scores.shape)}: set policy.model.kind to sequence_classification"
            )
        check_pairs(batch, scores.shape[0], "BradleyTerryLoss")
        reward = scores[:, 0]
        chosen, rejected = reward[0::2], reward[1::2]
        pair_mask = batch.sample_valid_mask().to(scores)[0::2]
        pairs = global_count(global_valid_seqs, scores) / 2
        loss = -(F.logsigmoid(chosen - rejected) * pair_mask).sum() / pairs
        margin = (chosen - rejected).detach()
        return loss, {
            "loss": float(loss.detach()),
            "accuracy": float(((margin > 0).to(scores) * pair_mask).sum() / pairs),
            "margin_mean": float((margin * pair_mask).sum() / pairs),
            "num_valid_pairs": float(pair_mask.sum()),
        }
