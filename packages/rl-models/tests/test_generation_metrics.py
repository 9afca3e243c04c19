"""Generator/policy mismatch metrics against a hand computation in float64."""

import math

import pytest
import torch

from rl_models.generation.metrics import logprob_mismatch_metrics, response_mask


def test_metrics_match_a_hand_computation():
    gen = torch.tensor([[0.0, -1.0, -2.0, 0.0], [-0.5, -0.5, 0.0, 0.0]], dtype=torch.float32)
    pol = torch.tensor([[0.0, -1.5, -1.0, 9.0], [-0.5, -0.7, 0.0, 0.0]], dtype=torch.float32)
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0]])  # the 9.0 is padding: ignored
    m = logprob_mismatch_metrics(gen, pol, mask)
    tokens = [(-1.0, -1.5), (-2.0, -1.0), (-0.5, -0.5), (-0.5, -0.7)]
    mult = [math.exp(abs(g - p)) for g, p in tokens]
    assert m["token_mult_prob_error"] == pytest.approx(sum(mult) / 4, rel=1e-6)
    assert m["token_mult_prob_error_max_seq"] == pytest.approx((mult[0] + mult[1]) / 2, rel=1e-6)
    assert m["token_mult_prob_error_max_token"] == pytest.approx(math.exp(1.0), rel=1e-6)
    k3 = [math.exp(p - g) - 1 - (p - g) for g, p in tokens]
    assert m["gen_policy_kl"] == pytest.approx(sum(k3) / 4, rel=1e-6)


def test_k3_estimates_the_true_kl_on_samples_from_the_generator():
    """On many samples from q, mean k3 approaches KL(q || p) computed exactly."""
    q = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    p = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    exact = float((q * (q / p).log()).sum())
    tokens = torch.multinomial(
        q, 200_000, replacement=True, generator=torch.Generator().manual_seed(0)
    )
    gen, pol = q.log()[tokens][None], p.log()[tokens][None]
    m = logprob_mismatch_metrics(gen, pol, torch.ones_like(gen))
    assert m["gen_policy_kl"] == pytest.approx(exact, rel=0.05)


def test_equal_logprobs_give_one_and_zero_and_an_empty_mask_is_an_error():
    lp = torch.randn(3, 5)
    m = logprob_mismatch_metrics(lp, lp.clone(), torch.ones(3, 5))
    assert m["token_mult_prob_error"] == 1.0 and m["gen_policy_kl"] == 0.0
    with pytest.raises(ValueError, match="no valid tokens"):
        logprob_mismatch_metrics(lp, lp, torch.zeros(3, 5))


def test_response_mask_marks_generated_tokens():
    mask = response_mask(torch.tensor([2, 1]), torch.tensor([2, 3]), width=5)
    assert mask.int().tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 1, 0]]


def test_padding_values_never_reach_the_metrics():
    """-inf or huge log-probs on padding (a masked-out position) must not turn into nan."""
    gen = torch.tensor([[-1.0, 0.0, 0.0], [-0.5, -0.25, 0.0]])
    pol = torch.tensor([[-1.25, float("-inf"), 2000.0], [-0.5, -0.5, float("nan")]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 0]])
    m = logprob_mismatch_metrics(gen, pol, mask)
    mult = [math.exp(0.25), 1.0, math.exp(0.25)]
    assert m["token_mult_prob_error"] == pytest.approx(sum(mult) / 3, rel=1e-6)
    assert m["token_mult_prob_error_max_token"] == pytest.approx(math.exp(0.25), rel=1e-6)
    assert math.isfinite(m["gen_policy_kl"]) and m["gen_policy_kl"] > 0
