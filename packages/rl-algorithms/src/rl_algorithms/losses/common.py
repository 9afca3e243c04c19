"""Small helpers the losses share: masks, pair layout checks and metric conventions.

Metric convention: every metric a loss returns is either *additive* (a plain float, already
divided by the global count like the loss itself, so summing it over micro-batches and
data-parallel ranks gives the global-batch value) or an extreme declared ``Min`` / ``Max``
(``rl_models.interfaces``: combined by min / max). The policy worker reduces the metrics of a
step by that rule.
"""

from __future__ import annotations

import torch

from rl_data.batch import TrainBatch
from rl_models.interfaces import Max, Min


def check_pairs(batch: TrainBatch, rows: int, what: str) -> None:
    """Preference rows come as (chosen, rejected) pairs: row 2i and row 2i + 1.

    A micro-batch with an odd row count, or whose paired rows have different dataset ``idx``,
    means the batch was cut or reordered across a pair (e.g. by dynamic batching). The losses
    read a pair's ``sample_mask`` from its chosen row, so both rows must carry the same value.
    """
    if rows % 2:
        raise ValueError(
            f"{what}: a micro-batch of {rows} rows cannot hold whole (chosen, rejected) pairs; "
            "use even micro-batch and global batch sizes and no dynamic batching or packing"
        )
    idx = batch.idx
    if idx is not None and not torch.equal(idx[0::2], idx[1::2]):
        raise ValueError(
            f"{what}: rows 2i and 2i+1 must be the chosen and rejected response of the same "
            f"pair, but their idx differ ({idx.tolist()}); keep the order preference_collate "
            "gives"
        )
    if batch.sample_mask is not None:
        chosen, rejected = batch.sample_mask[0::2], batch.sample_mask[1::2]
        differ = (chosen != rejected).nonzero().flatten().tolist()
        if differ:
            i = differ[0]
            where = f"rows {2 * i} and {2 * i + 1}"
            if idx is not None:
                where += f", idx {int(idx[2 * i])}"
            raise ValueError(
                f"{what}: pair {i} ({where}) of this micro-batch has sample_mask "
                f"{float(chosen[i])} and {float(rejected[i])} on its chosen and rejected rows; "
                f"a pair is in or out of the loss as a whole, so both rows must be equal "
                f"({len(differ)} such pair(s) in the micro-batch)"
            )


def masked_extreme(values: torch.Tensor, mask: torch.Tensor, kind: type[Min | Max]) -> Min | Max:
    """``Min`` or ``Max`` of ``values`` where ``mask`` > 0 (+inf / -inf when nothing is masked
    in, so that an empty micro-batch does not win the reduction)."""
    picked = values.detach()[mask > 0]
    if picked.numel() == 0:
        return kind(float("inf") if kind is Min else float("-inf"))
    return kind(float(picked.min() if kind is Min else picked.max()))


def global_count(count: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A global count as a divisor of ``like``'s dtype (at least 1: an all-masked batch gives 0
    loss rather than NaN)."""
    return count.to(like).clamp(min=1)
