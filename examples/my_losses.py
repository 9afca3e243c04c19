"""A loss of your own, named in a recipe like an environment of your own:

    loss_fn: {kind: my_losses:ClippedTokenPG, kwargs: {epsilon: 0.1}}

(``examples/`` on PYTHONPATH). At setup the run checks ``kwargs`` against the constructor and
the fields ``batch_fields()`` lists against what a step produces; ``METRICS`` are logged as
``train/<name>``."""

import torch

from rl_algorithms.losses.common import global_count
from rl_models.interfaces import LossTokenLogprobs


class ClippedTokenPG:
    """PPO's clipped objective, ``-min(r A, clip(r, 1 - epsilon, 1 + epsilon) A)`` per token
    with ``r = pi / pi_old``, summed over the loss tokens and divided by the global batch's
    count of them: micro-batches of any size add up to the same loss."""

    input_type = LossTokenLogprobs  # log-probs of the loss tokens, [B, S]
    METRICS = ("clip_fraction",)

    def __init__(self, epsilon: float = 0.2) -> None:
        if not 0 < epsilon < 1:
            raise ValueError(f"epsilon must be in (0, 1), got {epsilon}")
        self.epsilon = epsilon

    def batch_fields(self) -> frozenset[str]:
        return frozenset({"advantages", "prev_logprobs"})  # so the step computes pi_old

    def __call__(self, logprobs, batch, global_valid_seqs, global_valid_toks):
        width = logprobs.shape[1]
        mask = batch.loss_token_mask()[:, :width] > 0
        advantages = batch.advantages[:, :width].to(logprobs)
        old = batch.prev_logprobs[:, :width].to(logprobs)
        # where, not a product: a prompt position's log-prob may be -inf.
        ratio = torch.exp(torch.where(mask, logprobs - old, 0.0))
        clipped = ratio.clamp(1 - self.epsilon, 1 + self.epsilon)
        per_token = -torch.minimum(ratio * advantages, clipped * advantages)
        toks = global_count(global_valid_toks, logprobs)
        loss = torch.where(mask, per_token, 0.0).sum() / toks
        clip_fraction = ((clipped * advantages < ratio * advantages) & mask).sum() / toks
        return loss, {"clip_fraction": float(clip_fraction)}
