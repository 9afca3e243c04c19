"""Token-level rewards, generalised advantage estimation and the statistics PPO needs.

Layout (as everywhere in training, see ``rl_models.interfaces``): ``[B, S]`` right-padded
tensors aligned like the log-probs, position ``t`` holding what concerns token ``t``. The
*action* tokens are those of ``action_mask > 0`` (``loss_token_mask(batch)``: the generated
tokens of samples in the loss); in a multi-turn rollout the environment's observation tokens
sit between assistant turns with mask 0. The critic's ``values[:, t]`` is V of the state that
chose token ``t``, and ``final_values`` ``[B]`` is V of the state after the row's last token.

Each row is an episode whose steps are its action tokens ``t_1 < ... < t_n``; observation,
prompt and padding positions are not steps: they hold no advantage and do not break the chain
(the next step's value is that of the next *action* token, however far away). With ``r`` the
token-level rewards (``token_level_rewards``)::

    delta_i = r[t_i] + gamma * V_next_i - values[t_i]
    V_next_i = values[t_{i+1}] for i < n;   V_next_n = final_values if truncated else 0
    A_i = delta_i + gamma * lam * A_{i+1}   (A_{n+1} = 0)
    returns[t_i] = A_i + values[t_i]

A finished response (it ended with EOS or the environment closed the episode) is terminal, so
nothing follows it; one cut at the length limit is bootstrapped with the critic's estimate of
the state it was cut in. All of it is computed in float64; results come back in the dtype of
``values`` (of ``scores`` for the rewards) when it is float32 or wider, in float32 when it is
a narrower float (a bfloat16 critic's), else in torch's default dtype.
"""

from __future__ import annotations

from typing import Literal

import torch

from rl_algorithms.advantages import check_shape, masked_moments, whiten, zero_off_mask
from rl_algorithms.losses.clipped_pg import ClippedPGLossConfig, masked_kl_estimate

__all__ = ["explained_variance", "gae", "token_level_rewards", "whiten"]


def _result_dtype(x: torch.Tensor) -> torch.dtype:
    # At least float32: a bfloat16 critic's returns rounded back to bfloat16 would differ by
    # a rounding unit of 1/128 of their size, which explained_variance cannot tell from
    # returns that do not vary.
    if not x.dtype.is_floating_point:
        return torch.get_default_dtype()
    return torch.promote_types(x.dtype, torch.float32)


def token_level_rewards(
    scores: torch.Tensor,
    action_mask: torch.Tensor,
    kl_penalty: float = 0.0,
    logprobs: torch.Tensor | None = None,
    reference_logprobs: torch.Tensor | None = None,
    kl_type: Literal["k1", "k2", "k3"] = "k1",
    kl_input_clamp_value: float | None = None,
    kl_output_clamp_value: float | None = None,
) -> torch.Tensor:
    """``[B, S]`` per-token rewards: each sequence's score at its last action token, and with
    ``kl_penalty > 0`` the classic RLHF penalty ``-kl_penalty * kl_t`` at every action token.

    ``kl_t`` is the per-token estimate of KL(pi || pi_ref) of ``losses.clipped_pg.kl_estimate``
    (k1 ``log pi - log pi_ref``, k2, k3) from ``logprobs`` (the policy that sampled the batch)
    and ``reference_logprobs``, with its optional clamps (off by default: the plain estimator).
    A row without action tokens gets no reward at all. 0 outside the action tokens.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [B], got shape {list(scores.shape)}")
    if action_mask.dim() != 2 or action_mask.shape[0] != scores.shape[0]:
        raise ValueError(
            f"action_mask must be [B, S] with B = {scores.shape[0]} (the scores), "
            f"got shape {list(action_mask.shape)}"
        )
    if kl_penalty < 0:
        raise ValueError(f"kl_penalty must be >= 0, got {kl_penalty}")
    mask = action_mask > 0
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, positions, -1).max(dim=1).values  # -1: no action token
    rewards = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    rows = (last >= 0).nonzero().flatten()
    rewards[rows, last[rows]] = scores.to(torch.float64)[rows]
    if kl_penalty > 0:
        if logprobs is None or reference_logprobs is None:
            raise ValueError("kl_penalty > 0 needs logprobs and reference_logprobs [B, S]")
        check_shape("logprobs", logprobs, tuple(mask.shape))
        check_shape("reference_logprobs", reference_logprobs, tuple(mask.shape))
        estimator = ClippedPGLossConfig(
            reference_policy_kl_type=kl_type,
            kl_input_clamp_value=kl_input_clamp_value,
            kl_output_clamp_value=kl_output_clamp_value,
        )
        kl = masked_kl_estimate(logprobs, reference_logprobs, mask, estimator)
        rewards = rewards - kl_penalty * kl
    return rewards.to(_result_dtype(scores))


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    final_values: torch.Tensor,
    truncated: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)``, both ``[B, S]`` and 0 outside the action tokens (module
    docstring). ``rewards`` and ``values`` are read at the action tokens only; ``final_values``
    only for ``truncated`` rows."""
    shape = tuple(values.shape)
    if len(shape) != 2:
        raise ValueError(f"values must be [B, S], got shape {list(shape)}")
    check_shape("rewards", rewards, shape)
    check_shape("action_mask", action_mask, shape)
    check_shape("final_values", final_values, (shape[0],))
    check_shape("truncated", truncated, (shape[0],))
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    mask = action_mask > 0
    r = zero_off_mask(rewards, mask)
    v = zero_off_mask(values, mask)
    # What follows a row's last step: the critic's estimate if the response was cut off, else
    # nothing (a finished response is a terminal state).
    next_value = zero_off_mask(final_values, truncated.bool().to(mask.device))
    next_advantage = torch.zeros_like(next_value)
    advantages = torch.zeros_like(v)
    # Backwards over the positions that hold a step in some row (the prompt columns never do);
    # a row without a step at t keeps its carried next value and advantage unchanged.
    for t in reversed(mask.any(dim=0).nonzero().flatten().tolist()):
        step = mask[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(step, a, 0.0)
        next_advantage = torch.where(step, a, next_advantage)
        next_value = torch.where(step, v[:, t], next_value)
    returns = torch.where(mask, advantages + v, 0.0)
    dtype = _result_dtype(values)
    return advantages.to(dtype), returns.to(dtype)


# How many rounding units of the returns' largest value their spread may be and still count as
# no spread at all (see explained_variance).
ROUNDING_UNITS = 64


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the entries where ``mask > 0``: 1 for a critic that
    predicts the returns exactly, 0 for one no better than their mean, negative for worse.

    NaN when it is undefined: fewer than two valid entries, or returns that do not vary (e.g.
    every response scored the same). A made-up number there would read as a critic that is (or
    is not) learning; NaN says there was nothing to explain. "Do not vary" allows for rounding:
    returns equal in exact arithmetic but computed in float (sums in another order, GAE's
    recursion) differ in their last bits, and dividing by that rounding noise would give an
    arbitrary, hugely negative number. So float returns count as constant when

        std(R) <= ROUNDING_UNITS * eps * max|R|

    with ``eps`` the machine epsilon of the returns' dtype (at least float32 when they come
    from :func:`gae`, whatever the critic's dtype): their spread is within
    ``ROUNDING_UNITS`` (64) rounding units of their largest value, room for the rounding of
    long sums, while a spread of a critic's concern (in float32, anything above about 1e-5 of
    the returns' size) is explained. Integer returns are exact: only equal ones are constant.
    The statistics themselves are taken in float64.
    """
    check_shape("returns", returns, tuple(values.shape))
    check_shape("mask", mask, tuple(values.shape))
    valid = mask > 0
    if int(valid.sum()) < 2:
        return float("nan")
    _, var_returns = masked_moments(returns, valid)
    if returns.is_floating_point():
        largest = float(zero_off_mask(returns, valid).abs().max())
        tolerance = ROUNDING_UNITS * torch.finfo(returns.dtype).eps * largest
    else:
        tolerance = 0.0
    if float(var_returns) <= tolerance**2:
        return float("nan")
    residual = zero_off_mask(returns, valid) - zero_off_mask(values, valid)
    _, var_residual = masked_moments(residual, valid)
    return float(1.0 - var_residual / var_returns)
