"""``dynamic_batching.enabled: auto`` (the default): dynamic batching on CPU, fixed on GPU.

``bench/train_step.py`` measured dynamic batching fastest on CPU (packing 0.84x of it), so it
is the CPU default; explicit settings win, the token budget comes from
``train_micro_batch_size`` unless one is configured, and the choice is announced.
"""

import pytest
import torch

from rl_models.losses import NLLLoss
from rl_models.policy.base_worker import batching_kind, describe_batching, microbatch_args
from rl_models.policy.dtensor_worker import DTensorPolicyWorker

from .conftest import skewed_batch, tiny_config


@pytest.mark.parametrize(
    "dynamic,packing,on_gpu,expected",
    [
        ("auto", False, False, "dynamic"),
        ("auto", False, True, "fixed"),
        ("auto", True, False, "packed"),
        (False, False, False, "fixed"),
        (True, False, True, "dynamic"),
    ],
)
def test_auto_resolves_by_hardware_and_explicit_settings_win(dynamic, packing, on_gpu, expected):
    config = tiny_config(
        dynamic_batching={"enabled": dynamic}, sequence_packing={"enabled": packing}
    )
    assert batching_kind(config, on_gpu) == expected


def test_the_default_is_auto_and_says_what_it_chose():
    config = tiny_config(train_micro_batch_size=2)
    assert config.dynamic_batching.enabled == "auto"
    line = describe_batching(config, on_gpu=False)
    assert "dynamic" in line and "train_micro_batch_size=2" in line
    assert "enabled=false" in line  # how to get fixed micro-batches back
    assert "fixed" in describe_batching(config, on_gpu=True)


def test_token_budget_comes_from_the_micro_batch_size_unless_configured():
    config = tiny_config(train_micro_batch_size=3, logprob_micro_batch_size=5)
    args = microbatch_args(config, True, on_gpu=False, width=50)["dynamic_batching_args"]
    assert args["max_tokens_per_microbatch"] == 3 * 50
    args = microbatch_args(config, False, on_gpu=False, width=50)["dynamic_batching_args"]
    assert args["max_tokens_per_microbatch"] == 5 * 50
    args = microbatch_args(config, True, on_gpu=False, width=50, rows=4)["dynamic_batching_args"]
    assert args["max_tokens_per_microbatch"] == 4 * 50  # train(mbs=4) overrides the config
    explicit = tiny_config(dynamic_batching={"train_mb_tokens": 64})
    for training in (True, False):
        args = microbatch_args(explicit, training, on_gpu=False, width=50)
        assert args["dynamic_batching_args"]["max_tokens_per_microbatch"] == 64
    assert microbatch_args(config, True, on_gpu=True, width=50) == {}


def test_packed_log_prob_micro_batches_may_have_a_budget_of_their_own():
    packed = {"enabled": True, "max_tokens_per_microbatch": 64}
    config = tiny_config(sequence_packing=packed)
    for training in (True, False):
        args = microbatch_args(config, training, on_gpu=True, width=50)
        assert args["sequence_packing_args"]["max_tokens_per_microbatch"] == 64
    config = tiny_config(sequence_packing={**packed, "logprob_max_tokens_per_microbatch": 128})
    budget = {
        training: microbatch_args(config, training, on_gpu=True, width=50)["sequence_packing_args"][
            "max_tokens_per_microbatch"
        ]
        for training in (True, False)
    }
    assert budget == {True: 64, False: 128}


def test_a_cpu_worker_uses_dynamic_micro_batches_by_default():
    data = skewed_batch()  # widths 2..61: fixed micro-batches of 2 rows waste most tokens
    seen: list[tuple[int, int]] = []

    class RecordingNLL(NLLLoss):
        def __call__(self, logprobs, mb, *counts):
            seen.append(tuple(mb.input_ids.shape))
            return super().__call__(logprobs, mb, *counts)

    auto = DTensorPolicyWorker(tiny_config(train_micro_batch_size=2))
    assert auto.batching == "dynamic"
    metrics = auto.train(data, RecordingNLL()).metrics
    # Rows sorted by length and cut at 2 x 61 padded tokens: the short rows share micro-batches
    # (more than 2 rows), so fewer passes than the 4 fixed micro-batches of 2 rows.
    assert all(rows * width <= 2 * 61 for rows, width in seen)
    assert max(rows for rows, _ in seen) > 2 and len(seen) < 4

    fixed = DTensorPolicyWorker(
        tiny_config(train_micro_batch_size=2, dynamic_batching={"enabled": False})
    )
    assert fixed.batching == "fixed"
    seen.clear()
    ref_metrics = fixed.train(data, RecordingNLL()).metrics
    assert [rows for rows, _ in seen] == [2, 2, 2, 2]
    # The same update either way (losses are normalised by global counts).
    assert metrics["loss"][0] == pytest.approx(ref_metrics["loss"][0], rel=1e-12)
    for a, b in zip(auto.model.parameters(), fixed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
