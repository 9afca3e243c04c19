"""The HF generation backend in one process: sampling rules, log-probs, stops, refit loads.

Every reference here is computed independently in float64 from the model's full forward pass
(no KV cache), never from the sampler itself.
"""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.generation.config import GenerationConfig
from rl_models.generation.hf_worker import HfGenerationWorker
from rl_models.generation.interfaces import IncompleteRefitError, StaleWeightsError
from rl_models.generation.sampling import draw, filter_logits
from rl_models.policy.dtensor_worker import DTensorPolicyWorker
from rl_models.policy.weight_export import DTensorWeightExporter
from rl_models.weight_transfer.buckets import PackedBucket, TensorSlot

from .conftest import TINY_LLAMA, response_mask, tiny_config

VOCAB = TINY_LLAMA["vocab_size"]


def peaky_model_dir(tmp_path, vocab=VOCAB, scale=25.0, generation_config=None) -> str:
    """A tiny float64 Llama whose next-token distributions are far from uniform."""
    torch.manual_seed(0)
    hf = {**TINY_LLAMA, "vocab_size": vocab}
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(tmp_path)
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return str(tmp_path)


def worker(path, **sampling) -> HfGenerationWorker:
    config = GenerationConfig(backend="hf", sampling=sampling)
    return HfGenerationWorker(config.model_dump(), {"path": path, "dtype": "float64"})


def prompts(lengths=(3, 7, 1, 5), seed=1) -> BatchedDataDict:
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=gen)
    ids = ids * (torch.arange(width)[None] < torch.tensor(lengths)[:, None])
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor(lengths))


def full_forward_logprobs(model, ids, temperature=1.0) -> torch.Tensor:
    """log_softmax(logits / T) of each next token, from one uncached forward in float64."""
    with torch.no_grad():
        logits = model(ids[None]).logits[0].double() / temperature
    return torch.log_softmax(logits, -1)


def generated(out: BatchedDataDict) -> torch.Tensor:
    """Where the response tokens are (from the lengths, not from non-zero log-probs, so a
    comparison can never be vacuous)."""
    prompt = out["unpadded_sequence_lengths"] - out["generation_lengths"]
    mask = response_mask(prompt, out["generation_lengths"], out["output_ids"].shape[1])
    assert mask.any()
    return mask


def word_tokenizer():
    """One word per token ("t0" .. "t127"), so every token decodes to clean text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="t0", pad_token="t0", eos_token="t1"
    )


def reference_filter(p: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """Top-k then nucleus truncation of probabilities ``p`` (float64, plain loops)."""
    order = sorted(range(len(p)), key=lambda i: -float(p[i]))
    keep = set(order[:top_k] if top_k else order)
    if top_p < 1:
        q = torch.zeros_like(p)
        q[list(keep)] = p[list(keep)]
        q /= q.sum()
        mass, nucleus = 0.0, set()
        for i in order:
            if i not in keep or mass >= top_p:
                continue
            nucleus.add(i)
            mass += float(q[i])
        keep = nucleus
    out = torch.zeros_like(p)
    out[list(keep)] = p[list(keep)]
    return out / out.sum()


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, None, 1.0), (0.7, None, 1.0), (1.3, 5, 1.0), (1.0, None, 0.8)]
)
def test_sampled_token_frequencies_follow_the_float64_distribution(
    tmp_path, temperature, top_k, top_p
):
    path = peaky_model_dir(tmp_path)
    gen = worker(path, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1)
    n = 4000
    prefix = torch.tensor([5, 17, 42])
    data = BatchedDataDict(input_ids=prefix.repeat(n, 1), input_lengths=torch.full((n,), 3))
    out = gen.generate(data)
    tokens = out["output_ids"][:, 3]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    logp = full_forward_logprobs(model, prefix, temperature)[-1]
    expected = reference_filter(logp.exp(), top_k, top_p)
    freq = torch.bincount(tokens, minlength=VOCAB).double() / n
    assert (freq[expected == 0] == 0).all(), "sampled a token outside the top-k/top-p set"
    # Each frequency within 5 standard errors of its probability.
    se = (expected * (1 - expected) / n).sqrt()
    assert ((freq - expected).abs() <= 5 * se + 1e-3).all()
    assert float(expected.max()) < 0.9  # the check is not trivially about one token
    # Reported log-probs: those of the distribution sampled from (temperature-scaled, then
    # truncated by top-k/top-p and renormalised), as vLLM's processed_logprobs reports them.
    sampled_from = expected.log()
    torch.testing.assert_close(
        out["logprobs"][:, 3].double(), sampled_from[tokens], rtol=0, atol=1e-6
    )


def test_draw_never_picks_a_token_of_probability_zero_even_when_rounding_hits_the_total(
    monkeypatch,
):
    probs = torch.tensor([[0.0, 0.2, 0.8, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0, 0.5]])
    # The largest uniform number there is, then one that rounds u * total up to the total.
    for u in (1 - 2**-53, 1.0):
        monkeypatch.setattr(torch, "rand", lambda *a, u=u, **k: torch.full(a[:2], u).double())
        assert draw(probs).tolist() == [2, 4]
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.zeros(a[:2]).double())
    assert draw(probs).tolist() == [1, 0]


@pytest.mark.parametrize("bad", [float("nan"), 0.0], ids=["nan", "all-zero"])
def test_draw_refuses_a_row_it_cannot_sample_from(bad):
    probs = torch.tensor([[0.3, 0.7], [bad, bad]])
    with pytest.raises(ValueError, match="NaN, infinite or all zero"):
        draw(probs)


def test_filter_logits_keeps_the_top_k_and_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept = torch.isfinite(filter_logits(logits, top_k=None, top_p=0.8))
    assert kept.tolist() == [[True, True, True, False, False]]  # 0.5+0.2 < 0.8 <= +0.15
    kept = torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0))
    assert kept.tolist() == [[True, True, False, False, False]]


@pytest.mark.parametrize("temperature,top_k", [(1.0, None), (0.5, 2)])
def test_greedy_generation_matches_an_uncached_float64_decode(tmp_path, temperature, top_k):
    """Greedy rows report the model's own log-probs (temperature 1, untruncated), whatever the
    configured sampling temperature / top-k (vLLM's convention for greedy requests)."""
    path = peaky_model_dir(tmp_path, scale=3.0)
    data = prompts()
    gen = worker(path, max_new_tokens=6, stop_token_ids=[], temperature=temperature, top_k=top_k)
    out = gen.generate(data, greedy=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    assert out["truncated"].all() and (out["generation_lengths"] == 6).all()
    for row, n in enumerate(data["input_lengths"].tolist()):
        seq = data["input_ids"][row, :n]
        for _ in range(6):  # argmax continuation, recomputed from scratch each step
            seq = torch.cat([seq, full_forward_logprobs(model, seq)[-1].argmax()[None]])
        assert torch.equal(out["output_ids"][row, : n + 6], seq)
        assert (out["output_ids"][row, n + 6 :] == 0).all()  # right padding
        expected = full_forward_logprobs(model, seq)[:-1].gather(-1, seq[1:, None])[:, 0]
        got = out["logprobs"][row]
        torch.testing.assert_close(got[n : n + 6].double(), expected[n - 1 :], rtol=0, atol=1e-6)
        assert (got[:n] == 0).all() and (got[n + 6 :] == 0).all()
    torch.testing.assert_close(out["unpadded_sequence_lengths"], data["input_lengths"] + 6)


def test_first_token_top_logprobs_are_the_float64_distribution_it_was_drawn_from(tmp_path):
    """``first_token_logprobs: k`` returns the k most likely first tokens and their log-probs:
    the model's own distribution for greedy rows, temperature and top-k applied otherwise (the
    distribution the token was drawn from); without it the keys are absent."""
    path = peaky_model_dir(tmp_path, scale=3.0)
    data = prompts()
    sampling = {"max_new_tokens": 2, "temperature": 0.7, "top_k": 50}
    gen = worker(path, first_token_logprobs=5, **sampling)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    for greedy in (True, False):
        out = gen.generate(data, greedy=greedy)
        for row, n in enumerate(data["input_lengths"].tolist()):
            logits = model(data["input_ids"][None, row, :n]).logits[0, -1].detach()
            if not greedy:  # temperature, then the top-50 truncation renormalises the rest
                logits = logits / 0.7
                logits = logits.masked_fill(logits < logits.topk(50).values[-1], float("-inf"))
            logprobs = torch.log_softmax(logits, -1)
            expected = logprobs.topk(5)
            assert out["first_token_top_ids"][row].tolist() == expected.indices.tolist()
            torch.testing.assert_close(
                out["first_token_top_logprobs"][row].double(), expected.values, rtol=0, atol=1e-6
            )
            # The same distribution as the first token's own log-prob.
            first = out["output_ids"][row, n]
            torch.testing.assert_close(
                out["logprobs"][row, n].double(), logprobs[first], rtol=0, atol=1e-6
            )
    assert "first_token_top_ids" not in worker(path, **sampling).generate(data, greedy=True)


def test_stop_token_ids_end_a_row_and_keep_the_stop_token(tmp_path):
    path = peaky_model_dir(tmp_path, scale=3.0)
    data = prompts()
    free = worker(path, max_new_tokens=8, stop_token_ids=[]).generate(data, greedy=True)
    n0 = int(data["input_lengths"][0])
    stop = int(free["output_ids"][0, n0 + 2])  # row 0's third response token
    first = (free["output_ids"][0, n0 : n0 + 8] == stop).nonzero()[0].item()
    out = worker(path, max_new_tokens=8, stop_token_ids=[stop]).generate(data, greedy=True)
    assert out["generation_lengths"][0] == first + 1 and not out["truncated"][0]
    assert out["output_ids"][0, n0 + first] == stop
    assert torch.equal(
        out["output_ids"][0, : n0 + first + 1], free["output_ids"][0, : n0 + first + 1]
    )


def test_groups_sharing_a_prompt_and_rows_leaving_the_batch_keep_every_logprob_exact(tmp_path):
    """Rows with the same prompt share one prefill (its KV cache copied per row) and stopped
    rows leave the decode batch; every sampled token's reported log-prob must still be the
    float64 full-forward value of that row's own sequence (a row reading another row's cache
    would not match), and every row must stop exactly at its first stop token."""
    path = peaky_model_dir(tmp_path, scale=3.0)
    base = prompts(lengths=(3, 7, 5))
    group = 6
    data = BatchedDataDict(
        input_ids=base["input_ids"].repeat_interleave(group, dim=0),
        input_lengths=base["input_lengths"].repeat_interleave(group),
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    # Stop tokens the prompts make likely: rows stop at varied steps.
    pairs = zip(base["input_ids"], base["input_lengths"].tolist(), strict=True)
    first = [full_forward_logprobs(model, ids[:n])[-1] for ids, n in pairs]
    stops = torch.stack(first).exp().mean(0).topk(8).indices.tolist()
    gen = worker(path, max_new_tokens=10, stop_token_ids=stops, temperature=1.0)
    out = gen.generate(data)
    lengths = out["generation_lengths"]
    assert len(set(lengths.tolist())) >= 3, "rows should stop at different steps"
    # Over half the rows stop early, so rows left the batch (a quarter gone triggers it).
    assert (lengths < 10).sum() > len(lengths) // 2 and (lengths == 10).any()
    for row in range(len(lengths)):
        n, g = int(data["input_lengths"][row]), int(lengths[row])
        seq = out["output_ids"][row, : n + g]
        assert torch.equal(seq[:n], data["input_ids"][row, :n])
        response = seq[n:].tolist()
        assert not set(stops) & set(response[:-1])
        assert (response[-1] in stops) != bool(out["truncated"][row])
        expected = full_forward_logprobs(model, seq)[:-1].gather(-1, seq[1:, None])[:, 0]
        got = out["logprobs"][row, n : n + g].double()
        torch.testing.assert_close(got, expected[n - 1 :], rtol=0, atol=1e-6)
        assert (out["output_ids"][row, n + g :] == 0).all()


def test_stop_strings_from_config_and_per_sample(tmp_path):
    tokenizer = word_tokenizer()
    path = peaky_model_dir(tmp_path, scale=3.0)
    tokenizer.save_pretrained(path)
    data = prompts(lengths=(4, 4))
    free = worker(path, max_new_tokens=10, stop_token_ids=[]).generate(data, greedy=True)
    response = free["output_ids"][0, 4:14].tolist()
    text = tokenizer.decode(response)
    # A stop string made of two consecutive response tokens, clean text, not seen before them.
    k, stop = next(
        (k, tokenizer.decode(response[k : k + 2]))
        for k in range(1, 8)
        if "\ufffd" not in tokenizer.decode(response[k : k + 2])
        and tokenizer.decode(response[k : k + 2]) not in tokenizer.decode(response[: k + 1])
    )
    per_sample = BatchedDataDict({**data, "stop_strings": [[stop], None]})
    out = worker(path, max_new_tokens=10, stop_token_ids=[]).generate(per_sample, greedy=True)
    assert out["generation_lengths"].tolist() == [k + 2, 10]
    assert out["truncated"].tolist() == [False, True]
    assert stop in tokenizer.decode(out["output_ids"][0, 4 : 4 + k + 2].tolist()) and stop in text
    # A bare string is refused (not split into one stop string per character), by name.
    bare = BatchedDataDict({**data, "stop_strings": [stop, None]})
    with pytest.raises(TypeError, match=f"stop_strings of row 0 must be a list.*got {stop!r}"):
        worker(path, max_new_tokens=10, stop_token_ids=[]).generate(bare, greedy=True)
    # The same string from the config applies to every row.
    both = worker(path, max_new_tokens=10, stop_token_ids=[], stop_strings=[stop])
    assert both.generate(data, greedy=True)["generation_lengths"][0] == k + 2


def test_generation_config_json_changes_nothing(tmp_path):
    plain = peaky_model_dir(tmp_path / "plain")
    hostile = peaky_model_dir(
        tmp_path / "hostile",
        generation_config={
            "temperature": 0.01,
            "top_k": 1,
            "top_p": 0.1,
            "max_new_tokens": 2,
            "eos_token_id": list(range(VOCAB)),
            "do_sample": False,
        },
    )
    data = prompts()
    outs = [worker(p, max_new_tokens=5, stop_token_ids=[]).generate(data) for p in (plain, hostile)]
    for key in ("output_ids", "logprobs", "generation_lengths"):
        assert torch.equal(outs[0][key], outs[1][key]), key
    assert (outs[1]["generation_lengths"] == 5).all()


def test_stale_weights_are_refused_and_a_refit_load_replaces_the_weights():
    config = tiny_config(model={"hf_config": TINY_LLAMA, "dtype": "float32"})
    policy = DTensorPolicyWorker(config)
    gen_config = GenerationConfig(
        backend="hf", sampling={"max_new_tokens": 4, "stop_token_ids": []}
    )
    gen = HfGenerationWorker(gen_config.model_dump(), config.model.model_dump())
    with torch.no_grad():  # the policy moves on
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    with pytest.raises(StaleWeightsError, match="holds weight version 0 but version 1"):
        gen.generate(prompts(), greedy=True, expected_weight_version=1)
    exporter = DTensorWeightExporter(policy.model, False, 0)
    for step in range(exporter.plan(bucket_bytes=20_000).steps):
        gen.load_weight_bucket(exporter.bucket(step))
    gen.set_weight_version(1)
    out = gen.generate(prompts(), greedy=True, expected_weight_version=1)
    lp = policy.get_logprobs(
        BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
    )["logprobs"]
    response = generated(out)
    torch.testing.assert_close(out["logprobs"][response], lp[response].float(), rtol=0, atol=1e-5)


def test_policy_logprob_temperature_makes_on_policy_ratios_one():
    """Sampled at temperature 0.7; the policy with logprob_temperature 0.7 gives the same
    log-probs on those tokens (ratio 1), and at temperature 1 it does not."""
    model = {"hf_config": TINY_LLAMA, "dtype": "float64"}
    sampling = {"temperature": 0.7, "max_new_tokens": 6, "stop_token_ids": []}
    gen = HfGenerationWorker(GenerationConfig(backend="hf", sampling=sampling).model_dump(), model)
    out = gen.generate(prompts())
    seqs = BatchedDataDict(
        input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"]
    )
    response = generated(out)
    for temperature, equal in ((0.7, True), (1.0, False)):
        policy = DTensorPolicyWorker(tiny_config(model=model, logprob_temperature=temperature))
        lp = policy.get_logprobs(seqs)["logprobs"].float()
        ratio = torch.exp(lp[response] - out["logprobs"][response])
        assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5) is equal


def test_a_refit_that_fails_midway_leaves_a_generator_that_refuses_to_sample():
    """Buckets loaded, then a failure: the model is a mix of two versions, so generate refuses
    whatever version it is asked for (the old one included) until a complete refit."""
    config = tiny_config(model={"hf_config": TINY_LLAMA, "dtype": "float32"})
    policy = DTensorPolicyWorker(config)
    gen_config = GenerationConfig(
        backend="hf", sampling={"max_new_tokens": 3, "stop_token_ids": []}
    )
    gen = HfGenerationWorker(gen_config.model_dump(), config.model.model_dump())
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    exporter = DTensorWeightExporter(policy.model, False, 0)
    steps = exporter.plan(bucket_bytes=20_000).steps
    assert steps >= 3
    gen.prepare_for_weight_update()
    gen.load_weight_bucket(exporter.bucket(0))
    good = exporter.bucket(1)
    renamed = tuple(
        TensorSlot("no." + s.name, s.dtype, s.shape, s.offset, s.nbytes) for s in good.slots
    )
    with pytest.raises(KeyError, match=r"'no\.model"):
        gen.load_weight_bucket(PackedBucket(renamed, good.buffer))
    for expected in (0, 1, None):
        with pytest.raises(IncompleteRefitError, match="mix of version 0 and a newer one"):
            gen.generate(prompts(), greedy=True, expected_weight_version=expected)
    gen.prepare_for_weight_update()
    for step in range(steps):
        gen.load_weight_bucket(exporter.bucket(step))
    gen.set_weight_version(1)
    out = gen.generate(prompts(), greedy=True, expected_weight_version=1)
    lp = policy.get_logprobs(
        BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
    )["logprobs"]
    response = generated(out)
    torch.testing.assert_close(out["logprobs"][response], lp[response].float(), rtol=0, atol=1e-5)


def test_malformed_batches_are_refused_naming_the_key_or_row(tmp_path):
    gen = worker(peaky_model_dir(tmp_path), max_new_tokens=2)
    ids = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(KeyError, match="no 'input_lengths'"):
        gen.generate(BatchedDataDict(input_ids=ids))
    too_long = BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([3, 4]))
    with pytest.raises(ValueError, match=r"row 1 has input_lengths 4, outside 1\.\.3"):
        gen.generate(too_long)
