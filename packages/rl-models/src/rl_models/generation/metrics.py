"""How far the generator's log-probs are from the policy's on the same tokens.

Computed every step from the generator's returned ``logprobs`` and the policy's
``get_logprobs`` on the generated sequences; with matching weights and temperature they are
equal up to kernel rounding, and a growing gap means the generator samples from something
other than the policy being trained (stale weights, a dtype or temperature mismatch, a bug).
"""

from __future__ import annotations

import torch


def logprob_mismatch_metrics(
    generation_logprobs: torch.Tensor, policy_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Metrics over the valid (``mask``) tokens of ``[B, S]`` log-prob tensors.

    - ``token_mult_prob_error``: mean over valid tokens of ``exp|gen - policy|`` (1 = equal);
    - ``token_mult_prob_error_max_seq``: the largest per-sequence mean of the same;
    - ``token_mult_prob_error_max_token``: the largest single-token value;
    - ``gen_policy_kl``: KL(generator || policy) per token, estimated on the generator's own
      samples with the non-negative, unbiased ``k3`` estimator ``r - 1 - log r`` where
      ``r = p_policy / p_gen`` (Schulman, "Approximating KL divergence"), averaged over valid
      tokens.

    Computed in float64. Sequences without valid tokens are left out of the maximum.
    """
    valid = mask.bool()
    mask = valid.to(torch.float64)
    # Padding is zeroed before any exp: a -inf or huge log-prob there must not turn into
    # inf * 0 = nan.
    gen = torch.where(valid, generation_logprobs.to(torch.float64), 0.0)
    pol = torch.where(valid, policy_logprobs.to(torch.float64), 0.0)
    count = mask.sum()
    if count == 0:
        raise ValueError("no valid tokens to compare (the mask is all zero)")
    mult = torch.exp((gen - pol).abs()) * mask
    per_seq_tokens = mask.sum(dim=1)
    has_tokens = per_seq_tokens > 0
    per_seq = mult.sum(dim=1)[has_tokens] / per_seq_tokens[has_tokens]
    log_ratio = (pol - gen) * mask
    k3 = (torch.exp(log_ratio) - 1 - log_ratio) * mask
    return {
        "token_mult_prob_error": float(mult.sum() / count),
        "token_mult_prob_error_max_seq": float(per_seq.max()),
        "token_mult_prob_error_max_token": float(mult.max()),
        "gen_policy_kl": float(k3.sum() / count),
    }


def response_mask(input_lengths: torch.Tensor, generation_lengths: torch.Tensor, width: int):
    """``[B, width]`` True on each row's generated tokens (what ``generate`` returns)."""
    pos = torch.arange(width)[None, :]
    start = input_lengths.cpu()[:, None]
    return (pos >= start) & (pos < start + generation_lengths.cpu()[:, None])
