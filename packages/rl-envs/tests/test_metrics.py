import itertools
import math

import pytest
import torch

from rl_envs.metrics import OutcomeCounts, pass_at_k, reward_metrics


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (c correct) holding at least one correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    hits = sum(any(samples[i] for i in s) for s in subsets)
    return float(hits) / float(len(subsets))


@pytest.mark.parametrize("n", [1, 2, 5, 8, 10])
def test_pass_at_k_equals_the_fraction_of_k_subsets_with_a_correct_sample(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_stays_finite_where_binomials_are_astronomical():
    value = pass_at_k(2000, 3, 100)
    exact = 1 - math.comb(1997, 100) / math.comb(2000, 100)
    assert value == pytest.approx(exact, rel=1e-12)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_reward_metrics_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    groups = [0, 0, 0, 1, 1, 1]
    m = reward_metrics(rewards, groups, ks=(1, 2, 4))
    assert m["reward_mean"] == pytest.approx(0.5)
    assert m["accuracy"] == pytest.approx(0.5)
    assert m["pass@1"] == pytest.approx((1 / 3 + 2 / 3) / 2)
    assert m["pass@2"] == pytest.approx((pass_at_k(3, 1, 2) + pass_at_k(3, 2, 2)) / 2)
    assert "pass@4" not in m  # no group has four samples


def test_counts_are_taken_and_reset():
    counts = OutcomeCounts()
    for status in ["ok", "timeout", "error", "error"]:
        counts.add(status)
    assert counts.take() == {"samples": 4.0, "timeouts": 1.0, "verifier_errors": 2.0}
    assert counts.take() == {"samples": 0.0, "timeouts": 0.0, "verifier_errors": 0.0}
