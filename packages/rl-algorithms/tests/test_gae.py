"""ppo.gae against float64 references written per row from the GAE paper's definitions.

The GAE reference uses the *sum* form of Schulman et al. (2016), eq. 16,
``A_i = sum_l (gamma * lam)^l * delta_{i+l}``, over the list of a row's action positions,
not the backward recursion the implementation runs.
"""

import math

import pytest
import torch

from rl_algorithms.ppo.gae import (
    ROUNDING_UNITS,
    explained_variance,
    gae,
    token_level_rewards,
    whiten,
)

B, S = 6, 12


def multi_turn_batch(seed: int = 0):
    """Rows of every kind: padding, a two-turn row with an observation gap, a truncated row,
    a row without action tokens, a one-token response, a dropped sample (mask 0 everywhere).
    Values off the action tokens are garbage (NaN / inf) that must not leak anywhere."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, S)
    mask[0, 3:9] = 1  # finished, padded after position 9
    mask[1, 2:5] = 1  # turn 1, then observation tokens 5..7, then turn 2
    mask[1, 8:11] = 1
    mask[2, 4:12] = 1  # truncated at the right edge
    # row 3: no action tokens (e.g. a prompt that got an empty response, or sample_mask 0)
    mask[4, 11] = 1  # a one-token response
    mask[5, 1:3] = 1  # two turns, truncated, observation between them
    mask[5, 6:8] = 1
    values = torch.randn(B, S, generator=g, dtype=torch.float64)
    rewards = torch.randn(B, S, generator=g, dtype=torch.float64)
    values = torch.where(mask > 0, values, torch.nan)
    rewards = torch.where(mask > 0, rewards, torch.inf)
    final_values = torch.randn(B, generator=g, dtype=torch.float64)
    final_values[0] = torch.nan  # finished rows' final value is never read
    truncated = torch.tensor([False, False, True, False, False, True])
    return rewards, values, mask, final_values, truncated


def reference_gae(rewards, values, mask, final_values, truncated, gamma, lam):
    """Per row, over the list of action positions, with Python floats."""
    adv = torch.zeros(rewards.shape, dtype=torch.float64)
    ret = torch.zeros(rewards.shape, dtype=torch.float64)
    for b in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[b, t] > 0]
        n = len(steps)
        deltas = []
        for i, t in enumerate(steps):
            if i + 1 < n:
                v_next = float(values[b, steps[i + 1]])
            else:
                v_next = float(final_values[b]) if truncated[b] else 0.0
            deltas.append(float(rewards[b, t]) + gamma * v_next - float(values[b, t]))
        for i, t in enumerate(steps):
            a = sum((gamma * lam) ** k * deltas[i + k] for k in range(n - i))
            adv[b, t] = a
            ret[b, t] = a + float(values[b, t])
    return adv, ret


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 0.0), (1.0, 1.0)])
def test_gae_matches_the_sum_of_discounted_deltas(gamma, lam):
    rewards, values, mask, final_values, truncated = multi_turn_batch()
    adv, ret = gae(rewards, values, mask, final_values, truncated, gamma, lam)
    ref_adv, ref_ret = reference_gae(rewards, values, mask, final_values, truncated, gamma, lam)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    torch.testing.assert_close(adv, ref_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-12, atol=1e-12)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()
    assert (adv[3] == 0).all()  # the row without action tokens


def test_gamma_lam_one_returns_are_the_reward_to_go():
    """With gamma = lam = 1 the values telescope away: the return at a step is the sum of the
    rewards from it to the end, plus the bootstrap value for a truncated row."""
    rewards, values, mask, final_values, truncated = multi_turn_batch(seed=1)
    _, ret = gae(rewards, values, mask, final_values, truncated, 1.0, 1.0)
    for b in range(B):
        steps = [t for t in range(S) if mask[b, t] > 0]
        tail = float(final_values[b]) if truncated[b] else 0.0
        for i, t in enumerate(steps):
            to_go = sum(float(rewards[b, u]) for u in steps[i:]) + tail
            assert math.isclose(float(ret[b, t]), to_go, rel_tol=1e-12, abs_tol=1e-12)


def test_truncated_rows_bootstrap_and_finished_rows_do_not():
    rewards, values, mask, final_values, truncated = multi_turn_batch(seed=2)
    final_values[0] = 5.0
    a_fin, _ = gae(rewards, values, mask, final_values, truncated, 0.9, 0.95)
    cut = truncated.clone()
    cut[0] = True
    a_cut, _ = gae(rewards, values, mask, final_values, cut, 0.9, 0.95)
    assert torch.equal(a_fin[1:], a_cut[1:])  # other rows unchanged
    last = 8  # row 0's last action token
    # delta of the last step gains gamma * V_final, and every earlier step its discounted share
    assert math.isclose(float(a_cut[0, last] - a_fin[0, last]), 0.9 * 5.0, rel_tol=1e-12)
    assert math.isclose(
        float(a_cut[0, 3] - a_fin[0, 3]), (0.9 * 0.95) ** 5 * 0.9 * 5.0, rel_tol=1e-12
    )


def test_observation_tokens_neither_carry_advantage_nor_break_the_chain():
    """A two-turn row gives the same advantages at its action tokens as the same actions laid
    out contiguously: the observation tokens between the turns are not steps."""
    rewards, values, mask, final_values, truncated = multi_turn_batch(seed=3)
    steps = [t for t in range(S) if mask[1, t] > 0]
    packed = lambda x: torch.cat([x[1, steps], torch.zeros(S - len(steps), dtype=x.dtype)])  # noqa: E731
    packed_mask = torch.zeros(1, S)
    packed_mask[0, : len(steps)] = 1
    a_gap, r_gap = gae(rewards, values, mask, final_values, truncated, 0.95, 0.9)
    a_packed, r_packed = gae(
        packed(rewards)[None],
        packed(values)[None],
        packed_mask,
        final_values[1:2],
        truncated[1:2],
        0.95,
        0.9,
    )
    torch.testing.assert_close(a_gap[1, steps], a_packed[0, : len(steps)], rtol=0, atol=0)
    torch.testing.assert_close(r_gap[1, steps], r_packed[0, : len(steps)], rtol=0, atol=0)
    assert (a_gap[1, 5:8] == 0).all()


def test_gae_keeps_a_float32_dtype_and_checks_shapes():
    rewards, values, mask, final_values, truncated = multi_turn_batch()
    adv, ret = gae(rewards, values.float(), mask, final_values, truncated, 1.0, 0.95)
    assert adv.dtype == ret.dtype == torch.float32
    with pytest.raises(ValueError, match="final_values must have shape"):
        gae(rewards, values, mask, final_values[:-1], truncated, 1.0, 0.95)
    with pytest.raises(ValueError, match="action_mask must have shape"):
        gae(rewards, values, mask[:, :-1], final_values, truncated, 1.0, 0.95)
    with pytest.raises(ValueError, match="gamma and lam"):
        gae(rewards, values, mask, final_values, truncated, 1.0, 1.5)


def test_token_level_rewards_put_the_score_at_the_last_action_token():
    _, _, mask, _, _ = multi_turn_batch()
    scores = torch.tensor([1.0, -2.0, 0.5, 7.0, 3.0, -1.0], dtype=torch.float64)
    got = token_level_rewards(scores, mask)
    want = torch.zeros(B, S, dtype=torch.float64)
    for b, last in [(0, 8), (1, 10), (2, 11), (4, 11), (5, 7)]:  # row 3 has no action token
        want[b, last] = scores[b]
    assert torch.equal(got, want)


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_token_level_rewards_fold_the_kl_penalty_into_every_action_token(kl_type):
    g = torch.Generator().manual_seed(4)
    _, _, mask, _, _ = multi_turn_batch()
    scores = torch.randn(B, generator=g, dtype=torch.float64)
    logprobs = -torch.rand(B, S, generator=g, dtype=torch.float64) * 3
    reference = logprobs + torch.randn(B, S, generator=g, dtype=torch.float64) * 0.5
    logprobs = torch.where(mask > 0, logprobs, -torch.inf)  # garbage off the action tokens
    beta = 0.1
    got = token_level_rewards(scores, mask, beta, logprobs, reference, kl_type=kl_type)
    want = token_level_rewards(scores, mask)
    for b in range(B):
        for t in range(S):
            if mask[b, t] == 0:
                continue
            log_ratio = float(logprobs[b, t]) - float(reference[b, t])  # log pi / pi_ref
            kl = {
                "k1": log_ratio,
                "k2": 0.5 * log_ratio**2,
                "k3": math.exp(-log_ratio) + log_ratio - 1,
            }[kl_type]
            want[b, t] -= beta * kl
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert (got[mask == 0] == 0).all()


def test_token_level_rewards_errors():
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="needs logprobs and reference_logprobs"):
        token_level_rewards(torch.zeros(2), mask, kl_penalty=0.1)
    with pytest.raises(ValueError, match="action_mask must be"):
        token_level_rewards(torch.zeros(3), mask)


def test_whiten_uses_the_valid_tokens_only():
    g = torch.Generator().manual_seed(5)
    _, _, mask, _, _ = multi_turn_batch()
    x = torch.randn(B, S, generator=g, dtype=torch.float64) * 3 + 2
    x_padded = torch.where(mask > 0, x, 1e6)  # huge padding would dominate any unmasked mean
    picked = [float(x[b, t]) for b in range(B) for t in range(S) if mask[b, t] > 0]
    n = len(picked)
    mean = sum(picked) / n
    std = math.sqrt(sum((p - mean) ** 2 for p in picked) / (n - 1))
    want = torch.where(mask > 0, (x - mean) / (std + 1e-8), 0.0)
    torch.testing.assert_close(whiten(x_padded, mask), want, rtol=1e-12, atol=1e-12)
    kept = torch.where(mask > 0, (x - mean) / (std + 1e-8) + mean, 0.0)
    torch.testing.assert_close(whiten(x_padded, mask, shift_mean=False), kept)
    assert whiten(x.float(), mask).dtype == torch.float32


def test_explained_variance():
    g = torch.Generator().manual_seed(6)
    _, _, mask, _, _ = multi_turn_batch()
    returns = torch.randn(B, S, generator=g, dtype=torch.float64)
    values = returns + 0.5 * torch.randn(B, S, generator=g, dtype=torch.float64)
    garbage_v = torch.where(mask > 0, values, torch.nan)
    garbage_r = torch.where(mask > 0, returns, 1e9)
    r = [float(returns[b, t]) for b in range(B) for t in range(S) if mask[b, t] > 0]
    e = [float(returns[b, t] - values[b, t]) for b in range(B) for t in range(S) if mask[b, t]]

    def var(xs):
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)

    assert math.isclose(
        explained_variance(garbage_v, garbage_r, mask), 1 - var(e) / var(r), rel_tol=1e-12
    )
    assert explained_variance(returns, returns, mask) == 1.0
    assert math.isnan(explained_variance(values, torch.ones_like(returns), mask))


def reference_explained_variance(values, returns, mask) -> float:
    """Float64 in plain Python (exactly rounded sums), the valid entries only."""
    on = [
        (float(v), float(r))
        for v, r, m in zip(values.flatten(), returns.flatten(), mask.flatten(), strict=True)
        if m > 0
    ]
    r = [x for _, x in on]
    e = [x - v for v, x in on]

    def var(xs):
        m = math.fsum(xs) / len(xs)
        return math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1)

    return 1 - var(e) / var(r)


def test_returns_equal_but_for_rounding_count_as_constant():
    # Every row's return is the same 200 float32 numbers summed in float32, each row in
    # another order: equal in exact arithmetic, different in their last bits.
    g = torch.Generator().manual_seed(7)
    terms = (torch.randn(200, generator=g) * torch.logspace(-3, 2, 200)).float()
    rows = []
    for _ in range(B):
        total = torch.zeros((), dtype=torch.float32)
        for i in torch.randperm(200, generator=g):
            total = total + terms[i]
        rows.append(total)
    returns = torch.stack(rows)[:, None].expand(B, S).contiguous()
    mask = torch.ones(B, S)
    assert len(set(returns[:, 0].tolist())) > 1  # the rounding differs between rows
    values = returns + 0.01 * torch.randn(B, S, generator=g)
    # Dividing by the rounding noise: what the exact-zero test used to let through.
    assert reference_explained_variance(values, returns, mask) < -1e3
    assert math.isnan(explained_variance(values, returns, mask))
    # The same numbers handed over as float64 claim float64's precision, and are taken at it.
    assert not math.isnan(explained_variance(values, returns.double(), mask))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_explained_variance_against_a_float64_reference(dtype):
    g = torch.Generator().manual_seed(8)
    _, _, mask, _, _ = multi_turn_batch()
    unit = ROUNDING_UNITS * torch.finfo(dtype).eps  # the tolerance, relative to max|R|
    for spread in (1.0, 1e-2, 30 * unit):  # down to just above the tolerance
        returns = (5.0 + spread * torch.randn(B, S, generator=g, dtype=torch.float64)).to(dtype)
        values = (returns + 0.3 * spread * torch.randn(B, S, generator=g, dtype=dtype)).to(dtype)
        got = explained_variance(values, returns, mask)
        assert math.isclose(got, reference_explained_variance(values, returns, mask), rel_tol=1e-9)
    # A spread well within the tolerance of the returns' size is taken for rounding: NaN.
    flat = (5.0 + 0.01 * unit * torch.randn(B, S, generator=g, dtype=torch.float64)).to(dtype)
    assert math.isnan(explained_variance(flat, flat, mask))
    # A real spread far from zero is explained: the tolerance scales with the returns' size,
    # not with their mean square (100 +- 1e-3 is some 130 float32 rounding units of spread).
    offset = (100.0 + 1e-3 * torch.randn(B, S, generator=g, dtype=torch.float64)).to(dtype)
    near = (offset.double() + 1e-5 * torch.randn(B, S, generator=g, dtype=torch.float64)).to(dtype)
    got = explained_variance(near, offset, mask)
    assert math.isclose(got, reference_explained_variance(near, offset, mask), rel_tol=1e-6)
    assert got > 0.9
    # Integer returns: exact, so any spread counts.
    ints = torch.arange(B * S).reshape(B, S) % 3
    assert explained_variance(ints.double(), ints, mask) == 1.0
    assert math.isnan(explained_variance(ints.double(), torch.full((B, S), 7), mask))
    big = 10**9 + ints  # a spread of 1 in 1e9 is still a spread
    assert explained_variance(big.double(), big, mask) == 1.0


def test_a_bfloat16_critic_gets_float32_returns_and_a_defined_explained_variance():
    # A critic in bfloat16: GAE's results come back in float32, not rounded to bfloat16 (a
    # rounding unit of 1/128 of their size, which explained_variance would take for returns
    # that do not vary, and report NaN every step).
    rewards, values, mask, final_values, truncated = multi_turn_batch()
    g = torch.Generator().manual_seed(9)
    rewards = torch.rand(rewards.shape, generator=g, dtype=torch.float64)
    adv, ret = gae(rewards, values.bfloat16(), mask, final_values, truncated, 1.0, 0.95)
    assert adv.dtype == ret.dtype == torch.float32
    want_adv, want_ret = gae(
        rewards, values.bfloat16().double(), mask, final_values, truncated, 1.0, 0.95
    )
    torch.testing.assert_close(ret, want_ret.float())
    torch.testing.assert_close(adv, want_adv.float())
    critic = (
        ret.double() + 0.1 * torch.randn(ret.shape, generator=g, dtype=torch.float64)
    ).bfloat16()
    got = explained_variance(critic, ret, mask)
    assert math.isclose(got, reference_explained_variance(critic, ret, mask), rel_tol=1e-9)
    assert 0.5 < got < 1.0
