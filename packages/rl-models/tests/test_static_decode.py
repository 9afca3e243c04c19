"""The lean decoder (``generation/static_decode.py``) against uncached float64 forwards of the
Hugging Face model: the reference is the whole sequence run at once, not a decoding step."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rl_models.generation import static_decode
from rl_models.generation.config import GenerationConfig, SamplingConfig
from rl_models.generation.sampling import MIN_SHARED_PREFIX, sample, shared_prefix_length
from rl_models.generation.static_decode import unsupported_reason
from rl_models.modeling.attention_layout import mixed_attention_reason

from .conftest import TINY_LLAMA

# Qwen2 with its q/k/v biases; Llama with biases everywhere a Llama can have them.
FAMILIES = {
    "llama": {**TINY_LLAMA, "attention_bias": True, "mlp_bias": True},
    "qwen2": {**TINY_LLAMA, "model_type": "qwen2", "rope_theta": 1000.0},
}


def tiny_model(family: str, dtype=torch.float64, **extra) -> torch.nn.Module:
    hf = {**FAMILIES[family], **extra}
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():  # biases start at zero: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
        model.lm_head.weight.mul_(4)  # far from uniform: stop tokens come at varied steps
    return model


def right_padded(lengths: list[int], repeat: int = 1, vocab: int = 128):
    gen = torch.Generator().manual_seed(3)
    width = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), width), generator=gen)
    ids = ids * (torch.arange(width)[None] < torch.tensor(lengths)[:, None])
    return ids.repeat_interleave(repeat, 0), torch.tensor(lengths).repeat_interleave(repeat)


def sequence_logprobs(model, seq: torch.Tensor) -> torch.Tensor:
    """log p(token t | tokens < t) for t >= 1, from one uncached float64 forward."""
    with torch.no_grad():
        logits = model(seq[None]).logits[0].double()
    return torch.log_softmax(logits, -1)[:-1].gather(-1, seq[1:, None])[:, 0]


def assert_logprobs_are_the_float64_forwards(model, out, lengths) -> None:
    """Every sampled token's reported log-prob is the uncached float64 forward's (to 1e-6:
    they are stored in float32)."""
    pairs = zip(lengths.tolist(), out.generation_lengths.tolist(), strict=True)
    for row, (n, g) in enumerate(pairs):
        seq = out.output_ids[row, : n + g]
        expected = sequence_logprobs(model, seq)[n - 1 :]
        got = out.logprobs[row, n : n + g].double()
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sampled_logprobs_equal_an_uncached_float64_forward(family):
    """Prompts of different lengths (left padding in the cache), groups sharing a prefill,
    rows stopping at different steps (the static cache drops rows): every reported log-prob
    is the full forward's, and the tokens are those the model's own cached forward samples
    from the same row seeds."""
    model = tiny_model(family)
    assert unsupported_reason(model) is None
    ids, lengths = right_padded([3, 9, 1, 6], repeat=4)
    stops = list(range(1, 128, 9))  # 15 of 128 tokens: most rows stop before 12 steps
    sampling = SamplingConfig(max_new_tokens=12, stop_token_ids=stops)
    seeds = list(range(100, 100 + len(ids)))
    common = dict(stop_token_ids=stops, row_seeds=seeds)
    lean = sample(model, ids, lengths, sampling, static_kv=True, **common)
    plain = sample(model, ids, lengths, sampling, static_kv=False, **common)
    assert torch.equal(lean.output_ids, plain.output_ids)
    gen = lean.generation_lengths
    assert len(set(gen.tolist())) >= 3 and (gen < 12).sum() >= len(gen) // 2, gen
    assert_logprobs_are_the_float64_forwards(model, lean, lengths)


def test_a_cache_that_grows_while_rows_leave_keeps_every_logprob_exact(monkeypatch):
    """Room for 3 new tokens at first: the cache grows (and rows leave it) several times
    within 14 steps."""
    monkeypatch.setattr(static_decode, "GROWTH_TOKENS", 3)
    model = tiny_model("llama")
    ids, lengths = right_padded([2, 5, 4], repeat=3)
    stops = list(range(1, 128, 13))
    sampling = SamplingConfig(max_new_tokens=14, stop_token_ids=stops)
    out = sample(model, ids, lengths, sampling, stop_token_ids=stops, row_seeds=list(range(9)))
    gen = out.generation_lengths
    # 5 prompt columns + room for 3: full after 3 new tokens (8 columns, grown to 16), again
    # after 11 (grown to 19, the limit).
    assert gen.max() >= 12 and (gen < gen.max()).any(), gen
    assert_logprobs_are_the_float64_forwards(model, out, lengths)


def test_bfloat16_logprobs_are_the_bfloat16_models_and_near_float64():
    """In bf16 the decoder rounds a little differently from the model's own forward: its
    log-probs of the tokens it sampled are within 0.02 of that forward's (run on the whole
    sequence, in bf16) and within bf16 rounding of the float64 model's."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    exact = tiny_model("llama", dtype=torch.float64)
    exact.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    ids, lengths = right_padded([4, 8, 3], repeat=2)
    sampling = SamplingConfig(max_new_tokens=8, stop_token_ids=[])
    out = sample(model, ids, lengths, sampling, stop_token_ids=[], row_seeds=list(range(6)))
    worst = 0.0
    for row in range(len(ids)):
        n = int(lengths[row])
        seq = out.output_ids[row, : n + 8]
        got = out.logprobs[row, n : n + 8].double()
        with torch.no_grad():
            logits = model(seq[None]).logits[0].float()  # the bf16 model's own forward
        own = torch.log_softmax(logits, -1)[:-1].gather(-1, seq[1:, None])[n - 1 :, 0]
        worst = max(worst, float((got - own.double()).abs().max()))
        torch.testing.assert_close(got, sequence_logprobs(exact, seq)[n - 1 :], rtol=0, atol=0.1)
    assert worst < 0.02, worst  # ~0.004 for this model


def prompts_opening_alike(prefix: int, tails: list[int], vocab: int = 128):
    """Right-padded prompts: the same ``prefix`` random tokens, then each its own tail."""
    gen = torch.Generator().manual_seed(5)
    head = torch.randint(1, vocab, (prefix,), generator=gen)
    rows = [torch.cat([head, torch.randint(1, vocab, (t,), generator=gen)]) for t in tails]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    return ids, torch.tensor([len(row) for row in rows])


def embedded_shapes(model: torch.nn.Module) -> list[tuple[int, ...]]:
    """The shape of every batch of tokens ``model`` embeds from now on (filled as it runs)."""
    fed: list[tuple[int, ...]] = []
    model.get_input_embeddings().register_forward_pre_hook(
        lambda module, args: fed.append(tuple(args[0].shape))
    )
    return fed


@pytest.mark.parametrize("static_kv", [True, False])
@pytest.mark.parametrize("tails", [[0, 9, 4, 6], [5, 5, 5]])
def test_a_long_prefix_of_distinct_prompts_is_prefilled_once_and_changes_no_sample(
    static_kv, tails
):
    """Distinct prompts open with the same 70 tokens, each sampled twice. With tails of
    different lengths (one empty, so 69 are shared: each prompt keeps its last token) there is
    padding between the prefix and a tail; with equal tails, none. The prefix runs once as a
    batch of one, then the tails as one batch. Every reported log-prob is the uncached float64
    forward's of that row's own sequence, and each row samples what it samples alone (a batch
    of one shares nothing)."""
    model = tiny_model("llama")
    ids, lengths = prompts_opening_alike(70, tails)
    ids, lengths = ids.repeat_interleave(2, 0), lengths.repeat_interleave(2)
    fed = embedded_shapes(model)
    stops = list(range(1, 128, 9))
    sampling = SamplingConfig(max_new_tokens=10, stop_token_ids=stops)
    seeds = list(range(40, 40 + len(ids)))
    common = dict(stop_token_ids=stops, static_kv=static_kv)
    out = sample(model, ids, lengths, sampling, row_seeds=seeds, **common)
    shared = 69 if 0 in tails else 70
    assert fed[:2] == [(1, shared), (len(tails), ids.shape[1] - shared)], fed[:3]
    assert_logprobs_are_the_float64_forwards(model, out, lengths)
    assert len(set(out.generation_lengths.tolist())) >= 2, out.generation_lengths
    for row in range(len(ids)):
        alone = sample(
            model,
            ids[row : row + 1],
            lengths[row : row + 1],
            sampling,
            row_seeds=seeds[row : row + 1],
            **common,
        )
        width = alone.output_ids.shape[1]
        assert torch.equal(out.output_ids[row, :width], alone.output_ids[0])
        torch.testing.assert_close(out.logprobs[row, :width], alone.logprobs[0], rtol=0, atol=1e-6)


def test_a_shared_prefix_is_split_off_from_its_minimum_length_and_not_when_asked_not_to():
    """63 shared tokens (a chat template's header, say) are not split off: the prompts are
    prefilled whole, in one batch; 64 are. ``share_prefix=False`` keeps them whole too."""
    sampling = SamplingConfig(max_new_tokens=2)
    for prefix, split in ((MIN_SHARED_PREFIX - 1, False), (MIN_SHARED_PREFIX, True)):
        model = tiny_model("llama")
        ids, lengths = prompts_opening_alike(prefix, [3, 5])
        fed = embedded_shapes(model)
        sample(model, ids, lengths, sampling, stop_token_ids=[])
        assert (fed[0] == (1, prefix)) is split and (fed[0] == tuple(ids.shape)) is not split
        fed.clear()
        sample(model, ids, lengths, sampling, stop_token_ids=[], share_prefix=False)
        assert fed[0] == tuple(ids.shape)


@pytest.mark.parametrize(
    "family,extra",
    [
        ("qwen2", {"use_sliding_window": True, "sliding_window": 2, "max_window_layers": 0}),
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}),
    ],
    ids=["sliding-window", "dynamic-rope"],
)
def test_models_whose_layout_matters_prefill_prompts_opening_alike_whole(family, extra):
    """A window of 2 tokens would count the padding between a prefix and a short tail; a
    dynamic rotary embedding would rescale with the prefix's own length. Such models prefill
    whole prompts, and every log-prob is the float64 forward's."""
    model = tiny_model(family, **extra)
    assert mixed_attention_reason(model.config) is not None
    ids, lengths = prompts_opening_alike(70, [0, 9, 4, 6])
    fed = embedded_shapes(model)
    sampling = SamplingConfig(max_new_tokens=6, stop_token_ids=[])
    out = sample(model, ids, lengths, sampling, stop_token_ids=[], row_seeds=[1, 2, 3, 4])
    assert fed[0] == tuple(ids.shape)
    assert_logprobs_are_the_float64_forwards(model, out, lengths)


def test_shared_prefix_length_stops_at_the_first_difference_and_before_a_last_token():
    ids = torch.tensor([[5, 6, 7, 8, 0], [5, 6, 9, 8, 1], [5, 6, 7, 8, 2]])
    assert shared_prefix_length(ids, torch.tensor([4, 5, 5])) == 2
    same = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8]])
    assert shared_prefix_length(same, torch.tensor([3, 4])) == 2  # the short one keeps its 7
    assert shared_prefix_length(same[:1], torch.tensor([3])) == 0  # one prompt shares nothing


def test_models_it_does_not_mirror_are_named():
    sliding = tiny_model("qwen2", use_sliding_window=True, sliding_window=2, max_window_layers=0)
    assert "sliding window" in unsupported_reason(sliding)
    hooked = tiny_model("llama")
    hooked.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    assert "hooks" in unsupported_reason(hooked)
    adapted = tiny_model("llama")

    class Adapted(torch.nn.Linear):  # what an adapter or a quantised linear looks like here
        pass

    adapted.model.layers[0].mlp.up_proj.__class__ = Adapted
    assert unsupported_reason(adapted) == "up_proj is a Adapted, not a plain torch.nn.Linear"
    assert "training mode" in unsupported_reason(tiny_model("llama").train())
    config = AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=64)
    assert "gpt2" in unsupported_reason(AutoModelForCausalLM.from_config(config))


def test_a_model_it_does_not_mirror_is_decoded_by_the_model_itself():
    """A sliding window of 2 changes what the model computes: decoding it as if it attended to
    everything (what the lean decoder does) would give other log-probs. With static_kv on,
    its samples are exactly those of the model's own forward."""
    sliding = tiny_model("qwen2", use_sliding_window=True, sliding_window=2, max_window_layers=0)
    full = tiny_model("qwen2")
    ids, lengths = right_padded([5, 7])
    sampling = SamplingConfig(max_new_tokens=6, stop_token_ids=[])
    common = dict(stop_token_ids=[], row_seeds=[7, 8])
    on = sample(sliding, ids, lengths, sampling, static_kv=True, **common)
    off = sample(sliding, ids, lengths, sampling, static_kv=False, **common)
    assert torch.equal(on.output_ids, off.output_ids)
    assert torch.equal(on.logprobs, off.logprobs)
    # The window matters here: the same weights without it score the same tokens otherwise.
    seq = on.output_ids[1, :13]
    gap = (sequence_logprobs(sliding, seq) - sequence_logprobs(full, seq)).abs().max()
    assert gap > 1e-3, gap


def test_the_worker_passes_its_setting_to_the_sampler(monkeypatch, tmp_path):
    from rl_distributed.batched_data_dict import BatchedDataDict
    from rl_models.generation import hf_worker

    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    seen = []
    real = hf_worker.sample
    monkeypatch.setattr(
        hf_worker, "sample", lambda *a, **kw: seen.append(kw["static_kv"]) or real(*a, **kw)
    )
    ids, lengths = right_padded([3])
    for setting in (True, False):
        config = GenerationConfig(backend="hf", static_kv_decode=setting)
        config.sampling.max_new_tokens = 2
        worker = hf_worker.HfGenerationWorker(
            config.model_dump(), {"path": str(tmp_path), "dtype": "float64"}
        )
        worker.generate(BatchedDataDict(input_ids=ids, input_lengths=lengths))
    assert seen == [True, False]


def test_the_switch_belongs_to_the_hf_backend():
    assert not GenerationConfig(backend="hf", static_kv_decode=False).static_kv_decode
    with pytest.raises(ValueError, match=r"static_kv_decode applies to generation\.backend: hf"):
        GenerationConfig(backend="vllm", static_kv_decode=False)
