"""Loss functions (see ``interfaces.LossFunction``) and the token mask they share with workers."""

from __future__ import annotations

import torch

from rl_data.batch import TrainBatch
from rl_models.interfaces import Logits, LossTokenLogprobs


class NLLLoss:
    """Mean negative log-likelihood over the loss tokens of the global batch (SFT)."""

    input_type = LossTokenLogprobs  # reads log-probs at the loss tokens only
    # The names of the metrics __call__ returns (what a run may rank checkpoints by).
    METRICS = frozenset({"num_valid_tokens"})

    def __call__(
        self,
        logprobs: torch.Tensor,
        batch: TrainBatch,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch.loss_token_mask().to(logprobs)
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
        batch: TrainBatch,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if logits.dim() != 3:
            raise ValueError(f"expected [B, S, V] logits, got shape {tuple(logits.shape)}")
        logp = torch.log_softmax(logits.float() if logits.dtype.itemsize < 4 else logits, dim=-1)
        target = logp.gather(-1, batch.input_ids.unsqueeze(-1)).squeeze(-1)
        per_token = -(1 - self.smoothing) * target - self.smoothing * logp.mean(dim=-1)
        mask = batch.loss_token_mask().to(per_token)
        loss = (per_token * mask).sum() / global_valid_toks.clamp(min=1).to(per_token)
        return loss, {"num_valid_tokens": float(mask.sum())}
