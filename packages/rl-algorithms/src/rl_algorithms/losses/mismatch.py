"""Training-inference mismatch: the generator's importance weight, its truncations and masks,
the off-policy sequence mask, and diagnostics of the generator/trainer gap.

The generator (e.g. vLLM) and the trainer score the same sampled tokens with different numerics,
so ``log pi_old`` (the trainer's, ``prev_logprobs``) and ``log pi_gen`` (the generator's,
``generation_logprobs``) differ. The weight ``w = pi_old / pi_gen`` corrects for it; what is done
with an extreme ``w`` follows ``truncated_importance_sampling_type`` (the NeMo RL key):

- ``tis``: ``w`` clamped to ``[truncated_importance_sampling_ratio_min (default 0),
  truncated_importance_sampling_ratio]`` (TIS; the behaviour when the type is left out).
  As in NeMo RL, a given minimum is a floor;
- ``icepop``: tokens whose ``w`` is outside ``[min, max]`` get weight 0 (IcePop's token mask),
  the others keep their raw ``w``;
- ``seq-mask-tis``: sequences whose geometric-mean weight ``exp(mean_t log w)`` is outside
  ``[min, max]`` get weight 0; the kept ones keep their raw per-token ``w``.

``off_policy_sequence_mask_delta`` (DeepSeek-V3.2's off-policy sequence masking) drops the
negative-advantage tokens of every sequence whose mean ``log pi_gen - log pi`` (the current
policy, detached) over its loss tokens exceeds the bound: a stale sample that the policy has
moved far from is a poor estimate of what to push down. It needs no importance weight.

Every mask multiplies the policy-gradient term only (not the KL penalty) and leaves the global
token and sample counts alone, so micro-batches still add up to the whole batch.
"""

from __future__ import annotations

import torch

from rl_algorithms.losses.common import masked_extreme
from rl_models.interfaces import Max


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` on the loss tokens, 0 elsewhere (``where``: nothing there can become NaN)."""
    return torch.where(mask > 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


def per_sequence(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` -> each sequence's mean log-ratio over its loss tokens, broadcast back."""
    mean = (log_ratio * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return mean[:, None].expand_as(log_ratio)


def importance_weights(
    prev: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor, cfg
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The detached weight ``pi_old / pi_gen`` ``[B, S]`` after its truncation (module
    docstring), and where it was out of bounds: ``[B, S]`` for tis / icepop, ``[B]`` for
    seq-mask-tis, None when nothing bounds it."""
    token_log = masked(prev - gen, mask) * mask
    log_w = per_sequence(token_log, mask) if cfg.sequence_level_importance_ratios else token_log
    weight = torch.exp(log_w).detach()
    hi = cfg.truncated_importance_sampling_ratio
    if hi is None:
        return weight, None
    kind = cfg.truncated_importance_sampling_type or "tis"
    lo = cfg.truncated_importance_sampling_ratio_min
    if kind == "tis":
        lo = 0.0 if lo is None else lo
        outside = (weight > hi) | (weight < lo)
        return weight.clamp(min=lo, max=hi), outside
    if kind == "icepop":
        outside = (weight > hi) | (weight < lo)
        return torch.where(outside, torch.zeros_like(weight), weight), outside
    # seq-mask-tis: the mask is decided on the sequence's geometric mean, whatever the weight.
    seq = torch.exp(per_sequence(token_log, mask)[:, 0]).detach()
    outside = (seq > hi) | (seq < lo)
    return torch.where(outside[:, None], torch.zeros_like(weight), weight), outside


def off_policy_sequence_keep(
    logprobs: torch.Tensor,
    gen: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    delta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, S]`` keep-mask (1 kept, 0 dropped) of off-policy sequence masking, and ``[B]``
    which sequences had a token dropped. A per-token advantage is judged token by token; with
    one advantage per sequence that is the paper's per-sequence rule."""
    drift = per_sequence(masked(gen - logprobs.detach(), mask) * mask, mask)
    drop = (advantages < 0) & (drift > delta) & (mask > 0)
    return (~drop).to(logprobs), drop.any(dim=1)


# The keys ``mismatch_diagnostics`` returns.
MISMATCH_METRICS = frozenset(
    {"gen_train_kl_k1", "gen_train_kl_k1_max", "gen_train_kl_k3", "gen_train_kl_k3_max"}
)


def mismatch_diagnostics(
    prev: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor, toks: torch.Tensor
) -> dict[str, float]:
    """k1 and k3 estimates of KL(pi_gen || pi_old) per loss token from the sampled tokens (they
    come from the generator): with ``d = log pi_old - log pi_gen``, k1 = -d and k3 = exp(d) - d
    - 1. Means over the global token count (additive) and maxima (``Max``)."""
    d = masked(prev.detach() - gen.detach(), mask)
    k1 = -d
    k3 = torch.expm1(d) - d
    return {
        "gen_train_kl_k1": float(masked(k1, mask).sum() / toks),
        "gen_train_kl_k1_max": masked_extreme(k1, mask, Max),
        "gen_train_kl_k3": float(masked(k3, mask).sum() / toks),
        "gen_train_kl_k3_max": masked_extreme(k3, mask, Max),
    }
