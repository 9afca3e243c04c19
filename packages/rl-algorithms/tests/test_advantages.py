"""Advantage estimators against plain float64 loops over groups and tokens."""

import math
import statistics

import pytest
import torch

from rl_algorithms.advantages import (
    groups_with_signal,
    grpo_advantages,
    overlong_filter,
    overlong_penalty,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0, 0.0, 1.0, 1.0, 3.0])


def reference_grpo(rewards, G, leave_one_out, normalize_std, eps=1e-6):
    out = []
    values = [float(r) for r in rewards]
    for g in range(0, len(values), G):
        group = values[g : g + G]
        std = statistics.stdev(group)
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1 :]
            baseline = sum(others) / len(others) if leave_one_out else sum(group) / G
            adv = r - baseline
            if normalize_std:
                adv = adv / (std + eps) if std > eps else 0.0
            out.append(adv)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("normalize_std", [False, True])
def test_grpo_matches_the_reference(leave_one_out, normalize_std):
    got = grpo_advantages(REWARDS.double(), 4, leave_one_out, normalize_std)
    expected = reference_grpo(REWARDS, 4, leave_one_out, normalize_std)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("normalize_std", [False, True])
def test_unscored_samples_are_out_of_their_groups_statistics(leave_one_out, normalize_std):
    # Group 0 loses one sample, group 1 none, group 2 all but one (no signal left: 0).
    scored = torch.tensor([1, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 0], dtype=torch.bool)
    got = grpo_advantages(REWARDS.double(), 4, leave_one_out, normalize_std, scored=scored)
    expected = torch.zeros(12, dtype=torch.float64)
    for start in (0, 4):  # each group as if it held its scored samples only
        keep = [i for i in range(start, start + 4) if scored[i]]
        ref = reference_grpo(REWARDS[keep], len(keep), leave_one_out, normalize_std)
        expected[keep] = ref
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # A made-up reward in an unscored slot changes nothing.
    other = REWARDS.double().clone()
    other[1] = 100.0
    again = grpo_advantages(other, 4, leave_one_out, normalize_std, scored=scored)
    torch.testing.assert_close(again, got, rtol=0, atol=0)


def test_a_group_with_one_reward_has_zero_advantage():
    adv = grpo_advantages(REWARDS, 4)
    assert adv[4:8].abs().sum() == 0
    assert adv.dtype == REWARDS.dtype


def test_rloo_is_each_sample_against_the_rest():
    got = rloo_advantages(REWARDS.double(), 4)
    assert float(got[0]) == pytest.approx(1.0 - (0.0 + 0.5 + 0.5) / 3)
    torch.testing.assert_close(got, reference_grpo(REWARDS, 4, True, False))


def test_bad_group_size_names_the_config_key():
    with pytest.raises(ValueError, match="num_generations_per_prompt"):
        grpo_advantages(REWARDS, 5)


def reference_reinforce_pp(rewards, mask, G, kl, kl_coef, eps=1e-8):
    N, S = mask.shape
    r = [float(x) for x in rewards]
    if G:
        r = [r[i] - sum(r[(i // G) * G : (i // G) * G + G]) / G for i in range(N)]
    returns = {}
    for b in range(N):
        for t in range(S):
            if mask[b, t]:
                to_go = sum(float(kl[b, s]) for s in range(t, S) if mask[b, s]) if kl_coef else 0
                returns[(b, t)] = r[b] - kl_coef * to_go
    values = list(returns.values())
    mean, std = statistics.fmean(values), statistics.stdev(values)
    out = torch.zeros(N, S, dtype=torch.float64)
    for (b, t), v in returns.items():
        out[b, t] = (v - mean) / (std + eps)
    return out


@pytest.mark.parametrize("group_size", [None, 4])
@pytest.mark.parametrize("kl_coef", [0.0, 0.2])
def test_reinforce_plus_plus_matches_the_reference(group_size, kl_coef):
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(12, 7, generator=g) > 0.3
    mask[3] = False  # a sample with no response tokens
    kl = torch.rand(12, 7, generator=g, dtype=torch.float64)
    got = reinforce_plus_plus_advantages(REWARDS.double(), mask, group_size, kl, kl_coef)
    expected = reference_reinforce_pp(REWARDS, mask, group_size, kl, kl_coef)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    # Whitened over the batch's tokens: mean 0, std 1.
    values = got[mask]
    assert float(values.mean()) == pytest.approx(0.0, abs=1e-12)
    assert float(values.std()) == pytest.approx(1.0, rel=1e-6)


def test_integer_rewards_give_floating_point_advantages():
    # 0/1 rewards from a verifier as int64: the advantages must not be truncated to 0.
    ints = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0])
    adv = grpo_advantages(ints, 4)
    assert adv.dtype == torch.get_default_dtype()
    torch.testing.assert_close(adv.double(), reference_grpo(ints, 4, False, True))
    assert float(adv[1]) == pytest.approx(0.5 / (statistics.stdev([0, 1, 1, 0]) + 1e-6))
    rloo = rloo_advantages(ints, 4)
    assert rloo.dtype.is_floating_point
    torch.testing.assert_close(rloo.double(), reference_grpo(ints, 4, True, False))
    mask = torch.ones(8, 3, dtype=torch.bool)
    rpp = reinforce_plus_plus_advantages(ints, mask, group_size=4)
    assert rpp.dtype.is_floating_point
    torch.testing.assert_close(
        rpp.double(), reference_reinforce_pp(ints, mask, 4, None, 0.0), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("group_size", [None, 4])
@pytest.mark.parametrize("kl_coef", [0.0, 0.2])
def test_reinforce_plus_plus_whitens_over_the_samples_in_the_loss_only(group_size, kl_coef):
    """Samples with ``sample_mask`` 0 (dynamic sampling's filler groups, truncated samples)
    neither move the whitening statistics nor get an advantage: the result on the samples in
    the loss is the reference computed without the others, and exactly 0 on the others."""
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(12, 7, generator=g) > 0.3
    kl = torch.rand(12, 7, generator=g, dtype=torch.float64)
    kl[~mask] = float("inf")  # whatever sits outside the response (a prompt's overflow) is unread
    sample_mask = torch.ones(12)
    sample_mask[4:8] = 0  # the group whose rewards are all 2.0: a filler group
    sample_mask[9] = 0  # and one truncated sample of a real group
    got = reinforce_plus_plus_advantages(
        REWARDS.double(), mask, group_size, kl, kl_coef, sample_mask=sample_mask
    )
    kept = sample_mask.bool()
    # The group baseline is still each full group's mean (a group's samples were drawn together);
    # only the whitening statistics and the output are restricted to the samples kept.
    r = REWARDS.double()
    if group_size:
        r = r - r.view(-1, group_size).mean(1).repeat_interleave(group_size)
    expected = reference_reinforce_pp(r[kept], mask[kept], None, kl[kept], kl_coef)
    torch.testing.assert_close(got[kept], expected, rtol=1e-10, atol=1e-12)
    assert torch.equal(got[~kept], torch.zeros_like(got[~kept]))
    # Whitened over the kept samples' tokens: mean 0, std 1.
    values = got[kept][mask[kept]]
    assert float(values.mean()) == pytest.approx(0.0, abs=1e-12)
    assert float(values.std()) == pytest.approx(1.0, rel=1e-6)


def test_grpo_filler_groups_have_zero_advantage_in_floating_point():
    # A filler group (all rewards equal) gets exactly 0 whatever its reward or dtype.
    rewards = torch.tensor([3, 3, 3, 3, 0, 1, 0, 0])
    adv = grpo_advantages(rewards, 4)
    assert adv.dtype.is_floating_point
    assert torch.equal(adv[:4], torch.zeros(4))
    assert float(adv[5]) > 0


def test_dynamic_sampling_keeps_groups_whose_rewards_differ():
    assert groups_with_signal(REWARDS, 4).tolist() == [True, False, True]
    assert groups_with_signal(torch.zeros(6), 2).tolist() == [False, False, False]


def test_overlong_filter_masks_truncated_samples_out():
    mask = overlong_filter(torch.tensor([False, True, False]), torch.tensor([1.0, 1.0, 0.0]))
    assert mask.tolist() == [1.0, 0.0, 0.0]


def test_overlong_penalty_is_dapos_soft_ramp():
    lengths = torch.tensor([10, 60, 61, 70, 80, 100, 120])
    got = overlong_penalty(lengths, max_response_length=100, buffer_length=40)
    expected = []
    for n in lengths.tolist():
        if n <= 60:
            expected.append(0.0)
        elif n <= 100:
            expected.append((60 - n) / 40)
        else:
            expected.append(-1.0)
    assert got.tolist() == pytest.approx(expected)
    assert math.isclose(float(got[3]), -0.25)
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(lengths, 100, 0)
