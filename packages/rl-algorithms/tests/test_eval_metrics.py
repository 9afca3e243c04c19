"""pass@k and majority vote of `rl eval`, against a brute-force count over k-subsets."""

import itertools
import math

import pytest

from rl_algorithms.eval import PromptOutcome, majority_vote_correct, summarize


def brute_force_pass_at_k(correct: list[bool], k: int) -> float:
    """The fraction of all k-subsets of the samples that hold a correct one (exact)."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


OUTCOMES = [
    PromptOutcome([True, False, False, True, False], ["4", "5", "5", "4", None]),
    PromptOutcome([False] * 5, ["1", "2", "3", None, "1"]),
    PromptOutcome([True] * 5, ["7"] * 5),
    PromptOutcome([False, False, True, False, False], ["9", "9", "8", "9", None]),
]


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_pass_at_k_is_the_mean_over_prompts_of_the_exact_subset_fraction(k):
    want = sum(brute_force_pass_at_k(o.correct, k) for o in OUTCOMES) / len(OUTCOMES)
    got = summarize(OUTCOMES, [k])[f"pass@{k}"]
    assert math.isclose(got, want, rel_tol=1e-12)


def test_pass_at_1_is_the_sample_accuracy():
    metrics = summarize(OUTCOMES, [1])
    assert metrics["pass@1"] == pytest.approx(metrics["sample_accuracy"]) == 8 / 20
    assert metrics["num_prompts"] == 4 and metrics["num_samples"] == 20


def test_majority_vote():
    # "4" and "5" tie at two votes: "4" was seen first, and it was right.
    assert majority_vote_correct(OUTCOMES[0])
    assert not majority_vote_correct(OUTCOMES[1])
    assert majority_vote_correct(OUTCOMES[2])
    # one sample was right ("8"), but the majority said "9"
    assert not majority_vote_correct(OUTCOMES[3])
    assert summarize(OUTCOMES, [1])["majority_vote_accuracy"] == 0.5
    assert not majority_vote_correct(PromptOutcome([True, False], [None, None]))
