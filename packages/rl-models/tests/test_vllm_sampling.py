"""The parts of the vLLM backend that run without vLLM: request settings and result layout."""

import os
import queue

import pytest
import torch

from rl_distributed import RayVirtualCluster
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.generation import SamplingConfig
from rl_models.generation.interfaces import IncompleteRefitError, RequestAbortedError
from rl_models.generation.vllm import VllmGeneration
from rl_models.generation.vllm.extension import bucket_from_wire, bucket_to_wire
from rl_models.generation.vllm.generation import _tensor_parallel_groups
from rl_models.generation.vllm.sampling import (
    Response,
    assemble,
    most_likely,
    prompts_of,
    sampled_versions,
    sampling_kwargs,
    stream_versions,
)
from rl_models.generation.vllm.worker import VllmGenerationWorker, _Stream
from rl_models.weight_transfer.buckets import pack_bucket, unpack_bucket


def test_sampling_settings_come_from_our_config_only():
    config = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=33)
    kw = sampling_kwargs(config, greedy=False, eos_token_ids=[2], extra_stop_strings=["\n\n"])
    assert kw["temperature"] == 0.7 and kw["top_p"] == 0.9 and kw["top_k"] == 20
    assert kw["max_tokens"] == 33 and kw["stop"] == ["\n\n"] and kw["detokenize"]
    # EOS only through our stop ids: vLLM would otherwise add generation_config.json's EOS ids.
    assert kw["ignore_eos"] and kw["stop_token_ids"] == [2]
    assert kw["logprobs"] == 0  # the sampled token's log-prob

    explicit = SamplingConfig(stop_token_ids=[7, 9], stop_strings=["</a>"])
    kw = sampling_kwargs(explicit, greedy=False, eos_token_ids=[2], extra_stop_strings=["</a>"])
    assert kw["stop_token_ids"] == [7, 9] and kw["stop"] == ["</a>"]
    assert kw["top_k"] == 0 and kw["top_p"] == 1.0  # whole distribution: vLLM's "off" values
    assert not sampling_kwargs(SamplingConfig(), False, [2])["detokenize"]

    greedy = sampling_kwargs(config, greedy=True, eos_token_ids=[2])
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 0 and greedy["top_p"] == 1.0


def test_results_are_laid_out_prompt_then_response_right_padded():
    ids = torch.tensor([[5, 6, 7], [8, 0, 0]])
    lengths = torch.tensor([3, 1])
    out = assemble(
        ids,
        lengths,
        [Response([1, 2], [-0.5, -0.25], truncated=True), Response([4], [-1.0], truncated=False)],
        pad_token_id=99,
    )
    assert out["output_ids"].tolist() == [[5, 6, 7, 1, 2], [8, 4, 99, 99, 99]]
    assert out["generation_lengths"].tolist() == [2, 1]
    assert out["unpadded_sequence_lengths"].tolist() == [5, 2]
    assert out["logprobs"].tolist() == [[0, 0, 0, -0.5, -0.25], [0, -1.0, 0, 0, 0]]
    assert out["truncated"].tolist() == [True, False]


def completion(token_ids, spans):
    """The fields of vLLM's ``CompletionOutput`` that ``sampled_versions`` reads, with its
    ``weight_versions`` spans as ``(label, start, end)``."""
    from types import SimpleNamespace

    spans = (
        None if spans is None else [SimpleNamespace(version=v, start=s, end=e) for v, s, e in spans]
    )
    return SimpleNamespace(token_ids=token_ids, weight_versions=spans)


def test_each_token_gets_the_version_of_the_span_vllm_reported_it_in():
    assert sampled_versions(completion([5, 6, 7, 8], [("3", 0, 2), ("4", 2, 4)])) == (3, 3, 4, 4)
    assert sampled_versions(completion([5], [("0", 0, 1)])) == (0,)
    assert sampled_versions(completion([], [])) == ()
    # Unknown, never where a wrong version could come out: no spans, a label that is not one
    # of the worker's numbers (vLLM's "default"), or tokens no span covers.
    assert sampled_versions(completion([5, 6], None)) is None
    assert sampled_versions(completion([5, 6], [("default", 0, 2)])) is None
    assert sampled_versions(completion([5, 6, 7], [("1", 0, 2)])) is None

    # A streamed sample's tags, laid out like its output_ids (-1 on the prompt and padding),
    # with the oldest and newest version; without vLLM's labels, every token gets the version
    # its request started on and the newest is the one it finished on.
    tagged = Response([5, 6, 7], [-0.1] * 3, False, versions=(1, 1, 2))
    found = stream_versions(6, 2, tagged, started=0, finished=3)
    assert found["generation_versions"].tolist() == [[-1, -1, 1, 1, 2, -1]]
    assert (int(found["weight_version_min"]), int(found["weight_version_max"])) == (1, 2)
    untagged = Response([5, 6], [-0.1] * 2, False)
    found = stream_versions(5, 2, untagged, started=0, finished=3)
    assert found["generation_versions"].tolist() == [[-1, -1, 0, 0, -1]]
    assert (int(found["weight_version_min"]), int(found["weight_version_max"])) == (0, 3)


def test_the_first_tokens_top_logprobs_are_asked_for_ranked_and_laid_out():
    assert sampling_kwargs(SamplingConfig(first_token_logprobs=3), False, [2])["logprobs"] == 3

    class Logprob:  # vLLM's per-token entry, as much of it as most_likely reads
        def __init__(self, logprob):
            self.logprob = logprob

    # vLLM's top 2 and the sampled token (7), which is not among them.
    step = {7: Logprob(-3.0), 4: Logprob(-0.5), 9: Logprob(-1.0)}
    assert most_likely(step, 2) == ((4, -0.5), (9, -1.0))
    responses = [
        Response([4], [-0.5], False, ((4, -0.5), (9, -1.0))),
        Response([5], [-2.0], False, ((5, -2.0),)),
    ]
    ids = torch.tensor([[11, 12], [13, 0]])
    out = assemble(ids, torch.tensor([2, 1]), responses, 0, first_token_logprobs=2)
    assert out["first_token_top_ids"].tolist() == [[4, 9], [5, -1]]
    assert out["first_token_top_logprobs"].tolist() == [[-0.5, -1.0], [-2.0, float("-inf")]]
    assert "first_token_top_ids" not in assemble(ids, torch.tensor([2, 1]), responses, 0)


def test_bad_prompts_are_named():
    with pytest.raises(KeyError, match="input_lengths"):
        prompts_of(BatchedDataDict(input_ids=torch.zeros(2, 3, dtype=torch.long)))
    bad = BatchedDataDict(
        input_ids=torch.zeros(2, 3, dtype=torch.long), input_lengths=torch.tensor([3, 0])
    )
    with pytest.raises(ValueError, match="row 1 has input_lengths 0"):
        prompts_of(bad)


def test_a_bucket_survives_the_trip_to_a_vllm_worker():
    tensors = [("a.weight", torch.randn(3, 5)), ("b.bias", torch.arange(7, dtype=torch.bfloat16))]
    bucket = pack_bucket(tensors)
    for other_process in (False, True):
        slots, buffer = bucket_to_wire(bucket, other_process)
        # What vLLM's RPC carries unchanged: text, and bytes to another process.
        assert isinstance(slots, str)
        assert isinstance(buffer, bytes) if other_process else buffer is bucket.buffer
        unpacked = unpack_bucket(bucket_from_wire(slots, buffer))
        for (name, t), (name2, t2) in zip(tensors, unpacked, strict=True):
            assert name == name2 and torch.equal(t, t2)


def test_only_computed_caches_reload_warnings_are_dropped():
    """vLLM's layerwise reload warns that a rotary embedding "failed to load" at every refit
    (its cache is computed, never in a checkpoint); the same warning for another layer, and
    any other message, must still show."""
    import logging

    from rl_models.generation.vllm.extension import quiet_computed_cache_warnings

    name = "rl.test.layerwise"  # (vLLM's logger is named by the module that warns)
    logger, seen = logging.getLogger(name), []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger.addHandler(Keep())
    logger.propagate = False
    quiet_computed_cache_warnings(name, {"RotaryEmbedding"})
    quiet_computed_cache_warnings(name, {"Llama3RotaryEmbedding"})  # at the next refit
    assert len(logger.filters) == 1  # one filter a process, however many refits
    for layer in ("RotaryEmbedding", "Llama3RotaryEmbedding", "QKVParallelLinear"):
        logger.warning("%s: Failed to load weights", layer)
    logger.warning("RotaryEmbedding: something else")
    assert seen == [
        "QKVParallelLinear: Failed to load weights",
        "RotaryEmbedding: something else",
    ]


def test_engine_placement_and_model_errors():
    class Cluster:  # only the bundle counts are read
        bundle_ct_per_node_list = [4, 0, 2]

    assert _tensor_parallel_groups(Cluster(), 2) == [(0, [0, 1]), (0, [2, 3]), (1, [0, 1])]
    assert _tensor_parallel_groups(Cluster(), 1)[-1] == (1, [1])
    with pytest.raises(ValueError, match="does not divide the 2 bundles of node 1"):
        _tensor_parallel_groups(Cluster(), 4)
    with pytest.raises(ValueError, match="loads the model from disk"):
        VllmGeneration(
            RayVirtualCluster.__new__(RayVirtualCluster),
            {"model": {"hf_config": {"model_type": "llama"}}},
        )


def test_a_vllm_worker_mid_update_refuses_to_generate():
    """Between prepare_for_weight_update and set_weight_version (a refit that failed midway
    stays there) the engine holds a mix of two versions: generate refuses, the old version
    included. (No engine here: the check runs before the engine is touched.)"""
    worker = VllmGenerationWorker("unused", "float32", {}, {})
    worker.updating = True  # what prepare_for_weight_update sets on a worker with an engine
    data = BatchedDataDict(
        input_ids=torch.ones(1, 2, dtype=torch.long), input_lengths=torch.tensor([2])
    )
    for expected in (0, None):
        with pytest.raises(IncompleteRefitError, match="mix of version 0"):
            worker.generate(data, expected_weight_version=expected)


def test_the_async_engine_runner_is_refused_without_the_async_engine():
    from pydantic import ValidationError

    from rl_models.generation.config import VllmConfig

    assert VllmConfig(async_engine=True, async_engine_runner="async_llm").async_engine
    with pytest.raises(ValidationError, match=r"vllm\.async_engine: true"):
        VllmConfig(async_engine_runner="in_process")


def test_a_stream_vllm_aborted_is_news_and_a_failed_or_unknown_one_raises():
    """``poll_streams`` on finished requests as the engine's callback queues them (no engine
    needed: errors are handed out before any sample is assembled)."""
    worker = VllmGenerationWorker("unused", "float32", {}, {})
    data = BatchedDataDict(
        input_ids=torch.ones(2, 2, dtype=torch.long), input_lengths=torch.tensor([2, 2])
    )

    def stream(*finished) -> _Stream:
        done: queue.Queue = queue.Queue()
        for row, result in finished:
            done.put((row, result, 0, 0))  # (row, result, weight version, cached tokens)
        return _Stream(done, data, data.size, 0, ["r0", "r1"])

    worker.streams = {"hit": stream((1, RequestAbortedError("r1", 1))), "quiet": stream()}
    news = worker.poll_streams(["hit", "quiet"])
    assert set(news) == {"hit"}  # nothing new on "quiet": left out
    assert isinstance(news["hit"].aborted, RequestAbortedError) and news["hit"].aborted.row == 1
    assert not news["hit"].done and not news["hit"].samples
    assert set(worker.streams) == {"quiet"}  # the aborted stream was cancelled and forgotten

    worker.streams["broken"] = stream((0, ValueError("a kernel failed")))
    with pytest.raises(RuntimeError, match="vLLM failed on row 0") as failed:
        worker.poll_streams(["quiet", "broken"])
    assert isinstance(failed.value.__cause__, ValueError) and "broken" not in worker.streams
    with pytest.raises(KeyError, match="no stream 'gone' here"):
        worker.poll_streams(["quiet", "gone"])


def test_a_vllm_worker_serves_adapters_only_from_an_engine_started_for_them():
    """``enable_lora_adapters`` checks the engine's LoRA set-up (``vllm.max_lora_rank``, which
    a run sets from ``policy.lora``) before any refit; the adapters' directory goes at
    shutdown. (No engine here: the checks read the worker's config.)"""
    lora = {"enabled": True, "rank": 4, "alpha": 8.0}
    worker = VllmGenerationWorker("unused", "float32", {}, {})
    with pytest.raises(ValueError, match=r"started without LoRA.*max_lora_rank >= 4"):
        worker.enable_lora_adapters(lora)
    low = VllmGenerationWorker("unused", "float32", {}, {"max_lora_rank": 2})
    with pytest.raises(ValueError, match=r"started with max_lora_rank 2"):
        low.enable_lora_adapters(lora)

    worker = VllmGenerationWorker("unused", "float32", {}, {"max_lora_rank": 4})
    worker.enable_lora_adapters(lora)
    worker.enable_lora_adapters(lora)  # the same policy again: nothing to do
    with pytest.raises(ValueError, match="already serves adapters"):
        worker.enable_lora_adapters({**lora, "rank": 2})
    directory = worker.adapters.directory
    assert os.path.isdir(directory)
    worker.shutdown()
    assert not os.path.exists(directory)
