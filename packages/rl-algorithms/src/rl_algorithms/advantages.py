"""Advantage estimators and reward shaping for GRPO-style training.

Rewards come as ``[N]`` float tensors, ``N = prompts * G`` with the G samples of a prompt
**contiguous** (rows ``g*G .. g*G + G - 1`` are group ``g``: ``BatchedDataDict.repeat_interleave``
makes that layout). All estimators work in float64 and return the rewards' dtype when it is a
floating-point one, else torch's default float dtype (0/1 rewards given as integers must not
truncate the advantages to integers).

- ``grpo_advantages``: ``r - baseline``, the baseline the group mean (or, ``leave_one_out``, the
  mean of the *other* G-1 samples), optionally divided by the group's standard deviation.
- ``gdpo_advantages``: GDPO (group reward-decoupled normalisation), for a reward that is the
  weighted sum of K rewards ``r_k``: each reward gets its own GRPO advantage ``A_k``
  (``grpo_advantages`` of ``r_k`` alone, with the same baseline and std settings), the weighted
  sum ``A = sum_k w_k A_k`` is then whitened over the samples in the loss,
  ``(A - mean(A)) / (std(A) + eps)``, so that its scale does not grow with K.
- ``rloo_advantages``: REINFORCE leave-one-out, ``r_i - mean_{j != i} r_j`` (no scaling).
- ``reinforce_plus_plus_advantages``: per-token returns (with the KL-in-reward variant:
  ``G_t = r - kl_coef * sum_{s >= t} kl_s``, the ``kl`` / ``kl_coef`` arguments; a GRPO run
  turns it on with ``loss_fn.use_kl_in_reward``, ``kl_s`` then the per-token estimate of
  ``loss_fn.reference_policy_kl_type`` from pi_old's and the reference's log-probs and
  ``kl_coef`` = ``loss_fn.reference_policy_kl_penalty``), whitened
  over the response tokens of the samples in the loss (global, not per-group, normalisation;
  ``sample_mask`` 0 samples are left out and get 0); with ``group_size`` the group mean is
  subtracted from the rewards first (the "baseline" variant).
- DAPO: ``groups_with_signal`` (dynamic sampling keeps groups whose rewards differ),
  ``overlong_filter`` (truncated samples out of the loss), ``overlong_penalty`` (soft length
  penalty added to the reward).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"{rewards.numel()} rewards cannot be cut into groups of {group_size} "
            "(grpo.num_generations_per_prompt)"
        )
    return rewards.to(torch.float64).view(-1, group_size)


def _result_dtype(rewards: torch.Tensor) -> torch.dtype:
    return rewards.dtype if rewards.dtype.is_floating_point else torch.get_default_dtype()


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    leave_one_out: bool = False,
    normalize_std: bool = True,
    eps: float = 1e-6,
    scored: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[N]`` advantages against each group's baseline (module docstring).

    The std is the unbiased standard deviation of the whole group; a group whose rewards are
    all equal gets advantage 0 (there is nothing to learn from it), never a division by ~0.
    ``scored`` ``[N]`` bool (default: all) marks the samples whose reward is real: the others
    (an environment that timed out or could not score them) are left out of their group's
    baseline and std, and get advantage 0, so a made-up 0 moves no other sample's advantage.
    """
    if scored is not None and not bool(scored.all()):
        return _grpo_advantages_of_scored(
            rewards, group_size, leave_one_out, normalize_std, eps, scored
        )
    groups = _groups(rewards, group_size)
    if leave_one_out:
        if group_size < 2:
            raise ValueError("a leave-one-out baseline needs at least 2 samples per prompt")
        baseline = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    else:
        baseline = groups.mean(dim=1, keepdim=True)
    adv = groups - baseline
    if normalize_std and group_size > 1:
        std = groups.std(dim=1, keepdim=True)
        adv = torch.where(std > eps, adv / (std + eps), torch.zeros_like(adv))
    return adv.reshape(-1).to(_result_dtype(rewards))


def _grpo_advantages_of_scored(
    rewards: torch.Tensor,
    group_size: int,
    leave_one_out: bool,
    normalize_std: bool,
    eps: float,
    scored: torch.Tensor,
) -> torch.Tensor:
    """``grpo_advantages`` with each group's statistics over its scored samples only (a
    group with fewer than two has no signal: advantage 0)."""
    check_shape("scored", scored, (rewards.numel(),))
    groups = _groups(rewards, group_size).to(torch.float64)
    on = _groups(scored.to(torch.float64), group_size)
    count = on.sum(dim=1, keepdim=True)
    total = (groups * on).sum(dim=1, keepdim=True)
    if leave_one_out:
        if group_size < 2:
            raise ValueError("a leave-one-out baseline needs at least 2 samples per prompt")
        baseline = (total - groups * on) / (count - on).clamp(min=1)
    else:
        baseline = total / count.clamp(min=1)
    adv = groups - baseline
    if normalize_std:
        mean = total / count.clamp(min=1)
        var = (((groups - mean) ** 2) * on).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
        std = var.sqrt()
        adv = torch.where(std > eps, adv / (std + eps), torch.zeros_like(adv))
    adv = torch.where((on > 0) & (count > 1), adv, torch.zeros_like(adv))
    return adv.reshape(-1).to(_result_dtype(rewards))


def gdpo_advantages(
    components: torch.Tensor,
    weights: Sequence[float],
    group_size: int,
    leave_one_out: bool = False,
    normalize_std: bool = True,
    sample_mask: torch.Tensor | None = None,
    eps: float = 1e-6,
    scored: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO's ``[N]`` advantages of the ``[N, K]`` rewards ``components`` (module docstring),
    and the ``[N, K]`` per-reward advantages ``A_k`` they combine (float64, for metrics).

    Each reward's group statistics are those of ``grpo_advantages`` (the whole group, samples
    out of the loss included, as in GRPO, but not the unscored ones: ``scored``); the batch whitening takes its mean and unbiased std
    over the samples with ``sample_mask`` > 0 (default: all), and the others get 0. A batch
    whose combined advantages are all equal gets 0, never a division by ~0.
    """
    if components.dim() != 2 or components.shape[1] != len(weights) or not len(weights):
        raise ValueError(
            f"components must be [N, K] with K = len(weights) = {len(weights)} >= 1, got shape "
            f"{tuple(components.shape)}"
        )
    n = components.shape[0]
    per_reward = torch.stack(
        [
            grpo_advantages(
                components[:, k].to(torch.float64),
                group_size,
                leave_one_out=leave_one_out,
                normalize_std=normalize_std,
                eps=eps,
                scored=scored,
            )
            for k in range(len(weights))
        ],
        dim=1,
    )
    combined = per_reward @ torch.tensor(list(weights), dtype=torch.float64)
    mask = torch.ones(n, dtype=torch.bool)
    if sample_mask is not None:
        check_shape("sample_mask", sample_mask, (n,))
        mask = sample_mask > 0
    mean, var = masked_moments(combined, mask)
    std = var.sqrt()
    whitened = torch.where(std > eps, (combined - mean) / (std + eps), 0.0)
    advantages = torch.where(mask, whitened, 0.0)
    return advantages.to(_result_dtype(components)), per_reward


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out: each sample against the mean of the rest of its group."""
    return grpo_advantages(rewards, group_size, leave_one_out=True, normalize_std=False)


def reinforce_plus_plus_advantages(
    rewards: torch.Tensor,
    token_mask: torch.Tensor,
    group_size: int | None = None,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    eps: float = 1e-8,
    sample_mask: torch.Tensor | None = None,
    scored: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[N, S]`` per-token advantages of REINFORCE++ (module docstring).

    ``token_mask`` ``[N, S]`` marks the response tokens (the reward comes at the last one);
    ``kl`` ``[N, S]`` is a per-token KL estimate to the reference, e.g. ``log pi_old - log
    pi_ref`` (only read on the response tokens, when ``kl_coef > 0``). ``sample_mask`` ``[N]``
    (default: all 1) marks the samples that enter the loss: the whitening statistics are taken
    over their response tokens only, and the other samples get advantage 0, so that samples
    kept out of the loss (dynamic sampling's filler groups, truncated samples) change nothing.
    The group baseline is still the mean of the whole group, but for its unscored samples
    (``scored``, as in ``grpo_advantages``). Advantages are 0 outside the mask.
    """
    mask = token_mask.to(torch.float64)
    if sample_mask is not None:
        if sample_mask.shape != (rewards.numel(),):
            raise ValueError(
                f"sample_mask must be [N] = [{rewards.numel()}], got {tuple(sample_mask.shape)}"
            )
        mask = mask * (sample_mask.to(torch.float64) > 0)[:, None]
    r = rewards.to(torch.float64)
    if group_size is not None:
        r = grpo_advantages(rewards, group_size, normalize_std=False, scored=scored)
    returns = r[:, None] * mask
    if kl_coef:
        if kl is None:
            raise ValueError("kl_coef > 0 needs the per-token kl [N, S]")
        # where, not a product: a prompt position's estimate may be inf, and inf * 0 is NaN.
        penalty = torch.where(mask > 0, kl.to(torch.float64), 0.0)
        # Reward-to-go of the per-token penalties (gamma = 1): the sum from t to the end.
        to_go = penalty.flip(1).cumsum(1).flip(1)
        returns = returns - kl_coef * to_go * mask
    return whiten(returns, mask, eps=eps).to(_result_dtype(rewards))


def groups_with_signal(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[P]`` bool: which groups have rewards that are not all equal (DAPO dynamic sampling)."""
    groups = _groups(rewards, group_size)
    return (groups.max(dim=1).values - groups.min(dim=1).values) > 0


def overlong_filter(truncated: torch.Tensor, sample_mask: torch.Tensor) -> torch.Tensor:
    """``sample_mask`` with truncated samples switched off: a response cut at the length limit
    has no final answer, and its reward would punish length rather than the answer."""
    return sample_mask * (~truncated.bool()).to(sample_mask.dtype)


def overlong_penalty(
    response_lengths: torch.Tensor, max_response_length: int, buffer_length: int
) -> torch.Tensor:
    """DAPO's soft overlong penalty, ``[N]`` values in [-1, 0] to add to the rewards.

    0 up to ``max_response_length - buffer_length`` tokens, then falling linearly to -1 at
    ``max_response_length``, and -1 beyond it.
    """
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(
            f"overlong buffer_length must be in (0, max_response_length={max_response_length}], "
            f"got {buffer_length}"
        )
    lengths = response_lengths.to(torch.float64)
    start = max_response_length - buffer_length
    penalty = (start - lengths) / buffer_length
    return penalty.clamp(-1.0, 0.0)


def check_shape(name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")


def zero_off_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` in float64 where ``mask``, 0 elsewhere (``where``: a NaN or inf a backend left on
    padding or an observation token can reach neither the result nor a sum)."""
    return torch.where(mask, x.to(torch.float64), torch.zeros((), dtype=torch.float64))


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance of ``x`` over ``mask`` (float64; a variance of 0 for fewer
    than two entries)."""
    x = zero_off_mask(x, mask)
    count = mask.sum().to(torch.float64)
    mean = x.sum() / count.clamp(min=1)
    var = torch.where(mask, x - mean, 0.0).square().sum() / (count - 1).clamp(min=1)
    return mean, var


def whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` with the mean and unbiased std of the entries where
    ``mask > 0`` (the batch's valid tokens; padding, prompts and dropped samples do not weigh);
    with ``shift_mean=False`` the mean is added back (only the scale changes). 0 outside the
    mask; the dtype of ``values`` when floating."""
    check_shape("mask", mask, tuple(values.shape))
    valid = mask > 0
    mean, var = masked_moments(values, valid)
    whitened = (zero_off_mask(values, valid) - mean) / (var.sqrt() + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(valid, whitened, 0.0).to(_result_dtype(values))
