"""Loss functions (see ``interfaces.LossFunction``) and the token mask they share with workers."""

from __future__ import annotations

import torch

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.interfaces import Logits, LossTokenLogprobs


def loss_token_mask(data: BatchedDataDict) -> torch.Tensor:
    """``[B, S]`` float mask of the tokens a token-level loss counts.

    ``token_mask`` (default: every real token) times ``sample_mask``, without position 0, which
    has no log-prob, and without padding. Workers count ``global_valid_toks`` with this same
    mask, so a loss using it is normalised exactly.
    """
    ids = data["input_ids"]
    positions = torch.arange(ids.shape[1], device=ids.device)
    lengths = data["input_lengths"].to(ids.device)
    mask = (positions[None, :] < lengths[:, None]) & (positions[None, :] > 0)
    mask = mask.to(torch.float64)
    if "token_mask" in data:
        mask = mask * data["token_mask"][:, : ids.shape[1]].to(mask)
    if "sample_mask" in data:
        mask = mask * data["sample_mask"].to(mask)[:, None]
    return mask


def sample_valid_mask(data: BatchedDataDict) -> torch.Tensor:
    """``[B]`` float mask of the samples that count (``sample_mask``, default all)."""
    if "sample_mask" in data:
        return data["sample_mask"].to(torch.float64)
    return torch.ones(data["input_ids"].shape[0], dtype=torch.float64)


class NLLLoss:
    """Mean negative log-likelihood over the loss tokens of the global batch (SFT)."""

    input_type = LossTokenLogprobs  # reads log-probs at the loss tokens only
    # The names of the metrics __call__ returns (what a run may rank checkpoints by).
    METRICS = frozenset({"num_valid_tokens"})

    def __call__(
        self,
        logprobs: torch.Tensor,
        data: BatchedDataDict,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = loss_token_mask(data).to(logprobs)
        # Divide by the global count, not this micro-batch's: see interfaces.LossFunction.
        loss = -(logprobs * mask).sum() / global_valid_toks.clamp(min=1).to(logprobs)
        return loss, {"num_valid_tokens": float(mask.sum())}


class LabelSmoothedNLLLoss:
    """NLL against targets smoothed towards uniform: ``(1 - eps) * NLL + eps * mean_v(-log p_v)``.

    Needs the whole next-token distribution, so it asks the policy for logits
    (``input_type = Logits``); normalised by the global loss-token count like ``NLLLoss``.
    """

    input_type = Logits

    def __init__(self, smoothing: float = 0.1) -> None:
        if not 0.0 <= smoothing <= 1.0:
            raise ValueError(f"smoothing must be in [0, 1], got {smoothing}")
        self.smoothing = smoothing

    def __call__(
        self,
        logits: torch.Tensor,
        data: BatchedDataDict,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if logits.dim() != 3:
            raise ValueError(f"expected [B, S, V] logits, got shape {tuple(logits.shape)}")
        logp = torch.log_softmax(logits.float() if logits.dtype.itemsize < 4 else logits, dim=-1)
        target = logp.gather(-1, data["input_ids"].unsqueeze(-1)).squeeze(-1)
        per_token = -(1 - self.smoothing) * target - self.smoothing * logp.mean(dim=-1)
        mask = loss_token_mask(data).to(per_token)
        loss = (per_token * mask).sum() / global_valid_toks.clamp(min=1).to(per_token)
        return loss, {"num_valid_tokens": float(mask.sum())}
