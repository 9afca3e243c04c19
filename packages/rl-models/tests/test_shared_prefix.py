"""Rows that share a prompt run it once: the same log-probs and training step as a plain
forward, checked against a float64 reference that runs every row alone."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rl_data.batch import TrainBatch
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.losses import NLLLoss
from rl_models.modeling.attention_layout import mixed_attention_reason
from rl_models.policy import forward, shared_prefix
from rl_models.policy.dtensor_worker import DTensorPolicyWorker
from rl_models.policy.shared_prefix import (
    prefix_lengths,
    shared_prefixes,
    sharing_pays,
    supports_shared_prefix,
)

from .conftest import TINY_LLAMA, grouped_batch, initial_model, tiny_config


def reference_step(data, temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """One SGD step (lr=1) of the loss-token NLL, every row run alone in float64."""
    model = initial_model()
    mask = TrainBatch.from_transport(data).loss_token_mask()
    total = torch.zeros((), dtype=torch.float64)
    for row, (ids, n) in enumerate(zip(data["input_ids"], data["input_lengths"], strict=True)):
        logits = model(ids[None, :n]).logits[0, : n - 1] / temperature
        logp = torch.log_softmax(logits, -1).gather(-1, ids[1:n, None])[:, 0]
        total = total - (logp * mask[row, 1:n]).sum()
    (total / mask.sum()).backward()
    with torch.no_grad():
        return {k: p - p.grad for k, p in model.named_parameters()}


def loss_token_logprobs(data) -> torch.Tensor:
    """``[B, S]`` float64 log-probs at the loss's tokens (0 elsewhere) of the initial model,
    every row run alone through plain Hugging Face."""
    model, mask = initial_model(), TrainBatch.from_transport(data).loss_token_mask()
    expected = torch.zeros(data["input_ids"].shape, dtype=torch.float64)
    with torch.no_grad():
        for row, (ids, n) in enumerate(zip(data["input_ids"], data["input_lengths"], strict=True)):
            logp = torch.log_softmax(model(ids[None, :n]).logits[0, : n - 1], -1)
            expected[row, 1:n] = logp.gather(-1, ids[1:n, None])[:, 0] * mask[row, 1:n]
    return expected


def test_the_prefix_is_what_comes_before_the_first_wanted_logprob():
    data = grouped_batch()
    wanted = TrainBatch.from_transport(data).loss_token_mask() > 0
    prefix = prefix_lengths(wanted, data["input_lengths"])
    assert prefix[:12].tolist() == [4, 4, 0, 4] + [8] * 4 + [11] * 4
    assert prefix[2] == 0 and prefix[12] == 0  # nothing wanted; loss from token 1
    firsts, group = shared_prefixes(data["input_ids"], prefix)
    assert firsts == [0, 4, 8] and group == [0, 0, -1, 0, 1, 1, 1, 1, 2, 2, 2, 2, -1]


@pytest.mark.parametrize("chunk", [None, 5], ids=["whole", "chunked"])
def test_shared_prefix_logprobs_equal_the_plain_forward(chunk):
    data = grouped_batch()
    model = initial_model()
    wanted = TrainBatch.from_transport(data).loss_token_mask() > 0
    with torch.no_grad():
        plain = forward.forward_logprobs(model, data, forward.ForwardOptions(temperature=0.7))
        options = forward.ForwardOptions(chunk_size=chunk, temperature=0.7, share_prefix=True)
        shared = forward.forward_logprobs(model, data, options, wanted=wanted)
    torch.testing.assert_close(shared, plain * wanted, rtol=0, atol=1e-12)
    assert (shared[wanted] != 0).all()


@pytest.mark.parametrize("chunk", [None, 5], ids=["whole", "chunked"])
def test_shared_prefix_entropy_and_its_gradient_equal_each_row_run_alone(float64_norms, chunk):
    # An entropy bonus reads each loss token's log-prob and entropy: with the prompt run once,
    # both and their gradients equal a float64 reference that runs every row alone.
    data = grouped_batch()
    wanted = TrainBatch.from_transport(data).loss_token_mask() > 0
    temperature, bonus = 0.7, 0.3
    model = initial_model()
    options = forward.ForwardOptions(chunk_size=chunk, temperature=temperature, share_prefix=True)
    out = forward.forward_logprobs(model, data, options, wanted=wanted, entropy=True)
    (out[..., 0].sum() + bonus * out[..., 1].sum()).backward()
    got = {k: p.grad for k, p in model.named_parameters()}

    reference = initial_model()
    expected = torch.zeros_like(out)
    total = torch.zeros((), dtype=torch.float64)
    for row, (ids, n) in enumerate(zip(data["input_ids"], data["input_lengths"], strict=True)):
        logp_all = torch.log_softmax(reference(ids[None, :n]).logits[0, : n - 1] / temperature, -1)
        logp = logp_all.gather(-1, ids[1:n, None])[:, 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        keep = wanted[row, 1:n]
        total = total + (logp * keep).sum() + bonus * (entropy * keep).sum()
        expected[row, 1:n] = torch.stack([logp * keep, entropy * keep], -1).detach()
    total.backward()
    torch.testing.assert_close(out.detach(), expected, rtol=0, atol=1e-10)
    assert (out[..., 1][wanted] > 0).all()  # entropies, not zeros, where the loss reads them
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=0, atol=1e-10, msg=name)


def test_an_entropy_forward_shares_the_prompts(monkeypatch):
    data = grouped_batch()
    wanted = TrainBatch.from_transport(data).loss_token_mask() > 0
    calls = []
    original = forward.shared_prefix_logprobs
    monkeypatch.setattr(
        forward,
        "shared_prefix_logprobs",
        lambda *args, **kwargs: calls.append(args[-1]) or original(*args, **kwargs),
    )
    options = forward.ForwardOptions(share_prefix=True)
    with torch.no_grad():
        forward.forward_logprobs(initial_model(), data, options, wanted=wanted, entropy=True)
    assert calls == [True]


@pytest.mark.parametrize("recompute", [False, True], ids=["by-segments", "checkpointed-dense"])
def test_a_step_with_shared_prompts_equals_the_float64_reference_and_runs_prompts_once(
    float64_norms, monkeypatch, recompute
):
    data = grouped_batch()
    worker = DTensorPolicyWorker(
        tiny_config(
            train_micro_batch_size=13,
            train_global_batch_size=13,
            activation_checkpointing=recompute,
        )
    )
    embedded, by_segments = [], []
    embed = worker.model.get_input_embeddings()
    embed.register_forward_pre_hook(lambda _m, args: embedded.append(int(args[0].numel())))
    original = shared_prefix.attention_by_segments

    def spy(model, layout):
        by_segments.append(len(layout.problems))
        return original(model, layout)

    monkeypatch.setattr(shared_prefix, "attention_by_segments", spy)
    worker.train(data, NLLLoss())
    # Attention by segments (prompts, and rows after a prompt: two shapes) unless a layer
    # recomputes in backward, where only the dense mask is right.
    assert by_segments == ([] if recompute else [2])
    got = {k: p.detach() for k, p in worker.model.named_parameters()}
    expected = reference_step(data)
    assert max(float((got[k] - expected[k]).abs().max()) for k in expected) < 1e-10
    # One pass: 5 packed rows (the three groups, each prompt once, and the two rows with an
    # empty prefix), padded to the longest, against 13 padded rows of the plain forward.
    groups = [[0, 1, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    lengths, prefix = data["input_lengths"].tolist(), [4, 8, 11]
    packed = [p + sum(lengths[i] - p for i in g) for p, g in zip(prefix, groups, strict=True)]
    packed += [lengths[2], lengths[12]]
    assert embedded == [5 * max(packed)]
    assert embedded[0] < data["input_ids"].numel()


def test_a_group_of_one_row_and_a_lone_row_share_nothing_wrongly():
    # Rows 3..7: row 3 is alone with its prompt (its group's other rows are cut off), then a
    # group of four; row 2, with nothing wanted, is appended from the front of the batch.
    data = grouped_batch()
    data = BatchedDataDict.from_batches([data.slice(3, 8), data.slice(2, 3)])
    wanted = TrainBatch.from_transport(data).loss_token_mask() > 0
    model = initial_model()
    with torch.no_grad():
        plain = forward.forward_logprobs(model, data, forward.ForwardOptions())
        shared = forward.forward_logprobs(
            model, data, forward.ForwardOptions(share_prefix=True), wanted=wanted
        )
    torch.testing.assert_close(shared, plain * wanted, rtol=0, atol=1e-12)
    prefix = prefix_lengths(wanted, data["input_lengths"])
    firsts, group = shared_prefixes(data["input_ids"], prefix)
    packed = shared_prefix._packed_rows(prefix, data["input_lengths"], firsts, group)
    layout = shared_prefix._segments(packed, max(map(len, packed)), torch.device("cpu"))
    # sharing_pays counts what the kernel computes.
    assert shared_prefix._segment_pairs(packed) == sum(p.pairs for p in layout.problems)


def test_under_bf16_autocast_sharing_is_as_close_to_float64_as_the_plain_forward():
    """The recipe's precision: a float32 model under bf16 autocast. Attention by segments
    (float32 inside on a CPU) is no further from a float64 forward than the plain bf16
    forward is."""
    data = grouped_batch()
    wanted = (TrainBatch.from_transport(data).loss_token_mask() > 0) & forward._padding_mask(data)
    model = initial_model()
    with torch.no_grad():
        truth = forward.forward_logprobs(model, data, forward.ForwardOptions()) * wanted
        model.float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain = forward.forward_logprobs(model, data, forward.ForwardOptions()) * wanted
            shared = forward.forward_logprobs(
                model, data, forward.ForwardOptions(share_prefix=True), wanted=wanted
            )
    plain_error = (plain.double() - truth).abs().max()
    shared_error = (shared.double() - truth).abs().max()
    assert 0 < shared_error <= 1.5 * plain_error + 1e-3, (float(shared_error), float(plain_error))


def test_sharing_runs_only_where_it_pays_and_where_the_mask_is_right():
    data = grouped_batch()
    wanted = TrainBatch.from_transport(data).loss_token_mask() > 0
    ids, lengths = data["input_ids"], data["input_lengths"]
    model = initial_model()
    assert sharing_pays(model, wanted, lengths, ids)
    assert supports_shared_prefix(model, "sdpa")
    # Eager attention adds a 4-D mask to its scores; sliding-window layers need their window.
    assert not supports_shared_prefix(model, "eager")
    mistral = AutoConfig.for_model(**{**TINY_LLAMA, "model_type": "mistral", "sliding_window": 4})
    sliding = AutoModelForCausalLM.from_config(mistral)
    assert not supports_shared_prefix(sliding, "sdpa")
    # ALiBi biases attention by distance, each family its own way: whole sequences.
    for alibi in (
        AutoConfig.for_model("bloom", n_layer=1, hidden_size=16, n_head=2),
        AutoConfig.for_model("falcon", alibi=True),
        AutoConfig.for_model("mpt"),
    ):
        assert "ALiBi" in (mixed_attention_reason(alibi) or ""), alibi.model_type
    assert mixed_attention_reason(AutoConfig.for_model("falcon")) is None  # rotary
    bloom = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("bloom", n_layer=1, hidden_size=16, n_head=2, vocab_size=128)
    )
    assert not supports_shared_prefix(bloom, "sdpa")
    # Long responses behind a short shared prompt: the dense packed attention costs more.
    long = BatchedDataDict(
        input_ids=torch.randint(1, 100, (8, 200)).index_fill(1, torch.arange(4), 7),
        input_lengths=torch.full((8,), 200),
    )
    long_wanted = torch.arange(200)[None, :].expand(8, -1) >= 4
    assert not sharing_pays(model, long_wanted, long["input_lengths"], long["input_ids"])
    # A long prompt and long responses: by segments the rows' attention costs what the plain
    # forward's does, less the prompt's repeats, so sharing pays; one dense square per group
    # (under activation checkpointing) would cost more than it saves.
    wanted_after_100 = torch.arange(250)[None, :].expand(8, -1) >= 100
    prompted = BatchedDataDict(
        input_ids=torch.randint(1, 100, (8, 250)).index_fill(1, torch.arange(100), 7),
        input_lengths=torch.full((8,), 250),
    )
    assert sharing_pays(model, wanted_after_100, prompted["input_lengths"], prompted["input_ids"])
    model.activation_checkpointing_enable()
    assert not sharing_pays(
        model, wanted_after_100, prompted["input_lengths"], prompted["input_ids"]
    )
    model.activation_checkpointing_disable()
    with torch.no_grad():
        for impl in ("eager", "sdpa"):
            model.config._attn_implementation = impl
            plain = forward.forward_logprobs(model, data, forward.ForwardOptions())
            options = forward.ForwardOptions(attn_implementation=impl, share_prefix=True)
            got = forward.forward_logprobs(model, data, options, wanted=wanted)
            torch.testing.assert_close(got, plain * wanted, rtol=0, atol=1e-12)


def test_sharing_can_be_turned_off():
    data = grouped_batch()
    worker = DTensorPolicyWorker(
        tiny_config(
            train_micro_batch_size=13, train_global_batch_size=13, share_prompt_prefix=False
        )
    )
    embedded = []
    worker.model.get_input_embeddings().register_forward_pre_hook(
        lambda _m, args: embedded.append(int(args[0].numel()))
    )
    worker.train(data, NLLLoss())
    assert embedded == [data["input_ids"].numel()]


def test_logprobs_at_loss_tokens_run_each_prompt_once_and_equal_each_row_run_alone(
    monkeypatch,
):
    # What GRPO's pi_old and reference log-probs ask for (``at_loss_tokens``): the prompt is
    # not an output the loss reads, so a group's prompt runs once.
    data = grouped_batch()
    config = tiny_config(train_micro_batch_size=13, reference_policy={"enabled": True})
    worker = DTensorPolicyWorker(config)
    calls = []
    original = forward.shared_prefix_logprobs
    monkeypatch.setattr(
        forward,
        "shared_prefix_logprobs",
        lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs),
    )
    got = worker.get_logprobs(data, at_loss_tokens=True)["logprobs"]
    reference = worker.get_reference_policy_logprobs(data, at_loss_tokens=True)
    assert len(calls) == 2  # both took the shared-prompt pass
    # Each row alone, in float64, through the plain Hugging Face model: zero off the loss.
    expected, mask = loss_token_logprobs(data), TrainBatch.from_transport(data).loss_token_mask()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    torch.testing.assert_close(reference["reference_logprobs"], expected, rtol=0, atol=1e-10)
    # Every position's log-probs, the default, are the plain forward's: no sharing.
    everywhere = worker.get_logprobs(data)["logprobs"]
    assert len(calls) == 2
    torch.testing.assert_close(everywhere * (mask > 0), got, rtol=0, atol=1e-10)
    assert bool((everywhere[mask == 0][1:] != 0).any())  # the prompts' are there too
