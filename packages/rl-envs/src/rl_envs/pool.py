"""A pool of Ray actors that run a verifier function over many samples, each under a timeout.

Each :class:`VerifierWorker` actor owns one verifier *process* (``python -m rl_envs._child``)
and feeds it one sample at a time. A sample that runs past its timeout gets its process group
killed (a signal-based timeout cannot interrupt C code such as a pathological regex, and
math-verify's own ``signal.alarm`` only works in a main thread); the next sample starts a fresh
process. A verifier that raises costs that sample an ``error`` outcome. Either way the batch goes
on: an environment must never be the reason a run stops.

Work goes to the actors in chunks, one RPC per chunk, so Ray's per-call cost (~1 ms) is paid
once per chunk rather than once per sample; an actor that finishes early gets the next chunk.
Several threads may map at once (an environment that serves concurrent steps): each chunk goes
to the actor with the fewest samples in flight, so that concurrent small maps run side by side
rather than queue on one actor.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_distributed.virtual_cluster import reserve_bundles
from rl_envs._child import HEADER, write_frame

logger = logging.getLogger(__name__)

Status = Literal["ok", "timeout", "error"]

#: How long a fresh verifier process may take to import its modules before it counts as broken.
STARTUP_TIMEOUT_S = 120.0
#: The most verifier workers a pool gets when its size is left to fit the free CPUs: two score
#: a step's samples in parallel, and more would take CPUs that the trainer and the generator
#: use on a small machine.
AUTO_MAX_WORKERS = 2


def fit_num_workers(
    asked: int | None, cpus_per_worker: float, free_cpus: float, key: str = "num_workers"
) -> int:
    """How many verifier workers to start: ``asked``, or when it is None as many as
    ``free_cpus`` (what Ray has free once the trainer's and generator's workers have their
    CPUs) holds, at most ``AUTO_MAX_WORKERS``. Raises ``ValueError`` naming ``key`` (the
    config key of ``asked``) when the workers cannot all be placed."""
    fits = (
        AUTO_MAX_WORKERS if cpus_per_worker <= 0 else math.floor(free_cpus / cpus_per_worker + 1e-9)
    )
    cpus_key = f"{key.rpartition('.')[0]}.num_cpus_per_worker".lstrip(".")
    if asked is None:
        if fits < 1:
            raise ValueError(
                f"{key}: no room for even one verifier worker of {cpus_per_worker:g} CPU "
                f"({cpus_key}): the Ray cluster has {free_cpus:g} CPUs free once the trainer's "
                "and generator's workers have theirs; give Ray more CPUs (cluster.ray_num_cpus) "
                f"or lower {cpus_key}"
            )
        return min(AUTO_MAX_WORKERS, fits)
    if asked > fits:
        raise ValueError(
            f"{key} is {asked}: {asked} verifier workers of {cpus_per_worker:g} CPU ({cpus_key}) "
            f"need {asked * cpus_per_worker:g} CPUs, and the Ray cluster has {free_cpus:g} free "
            "once the trainer's and generator's workers have theirs; lower it, or leave it out "
            "to fit what is free"
        )
    return asked


#: The fewest samples a call carries by default, when every worker can get that many: a call
#: costs about a millisecond of CPU on each side, more than a cheap verifier's sample. (A group
#: of 8 math answers sent one per call cost 15 ms of CPU; in two calls of four, 5 ms.)
MIN_CHUNK = 4


def chunk_ranges(n: int, num_workers: int, chunk_size: int | None = None) -> list[range]:
    """The chunks (ranges of sample indices, one call each) that ``n`` samples go out in:
    ``chunk_size`` samples each, or by default about four chunks a worker (so a slow chunk
    delays little), yet at least ``MIN_CHUNK`` samples a chunk unless that would leave a worker
    idle (so a small map, such as one group's answers, is not paid for a call a sample)."""
    if chunk_size is None:
        every_worker_busy = n // num_workers  # the largest size that still gives each a chunk
        chunk_size = max(1, math.ceil(n / (4 * num_workers)), min(MIN_CHUNK, every_worker_busy))
    return [range(i, min(i + chunk_size, n)) for i in range(0, n, chunk_size)]


@dataclass(frozen=True)
class Outcome:
    """What became of one sample: the verifier's return value, or why there is none."""

    status: Status
    value: Any = None
    error: str | None = None


# A call a verifier process makes as it starts, before any sample: a function path and its
# arguments (e.g. building a search index that every call then uses).
Warmup = tuple[str, tuple]


class VerifierProcess:
    """One long-lived verifier process; :meth:`call` runs one function call in it.

    Each time a process starts (the first call, and the call after one that killed it) it
    imports ``preload`` and runs the ``warmups`` calls, under the start-up timeout rather than
    a sample's: what they prepare is never paid for by a call, whose timeout may be shorter.
    """

    def __init__(self, preload: tuple[str, ...] = (), warmups: tuple[Warmup, ...] = ()) -> None:
        self._preload = preload
        self._warmups = warmups
        self._proc: subprocess.Popen[bytes] | None = None

    def _start(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rl_envs._child", *self._preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # Its own process group, so that a timeout kills whatever the verifier started too.
            start_new_session=True,
        )
        ready = False
        with contextlib.suppress(Exception):
            ready = self._receive(proc, STARTUP_TIMEOUT_S)[0] == "ready"
        if not ready:
            self._kill(proc)
            raise RuntimeError(f"the verifier process did not start (preloading {self._preload})")
        self._warm_up(proc)
        return proc

    def _warm_up(self, proc: subprocess.Popen[bytes]) -> None:
        for function, args in self._warmups:
            try:
                write_frame(proc.stdin, (function, args))
                status, value = self._receive(proc, STARTUP_TIMEOUT_S)
            except Exception as e:
                status, value = "error", repr(e)
            if status != "ok":
                self._kill(proc)
                raise RuntimeError(f"the verifier process's warm-up {function} failed: {value}")

    @staticmethod
    def _receive(proc: subprocess.Popen[bytes], timeout_s: float) -> Any:
        """One frame from the process, read from its pipe's descriptor directly (no buffering)
        and never past ``timeout_s``: a process that writes half a frame and hangs costs a
        timeout, one that dies mid-frame an ``EOFError``."""
        deadline = time.monotonic() + timeout_s
        fd = proc.stdout.fileno()

        def read_exactly(n: int) -> bytes:
            data = bytearray()
            while len(data) < n:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise TimeoutError
                chunk = os.read(fd, n - len(data))
                if not chunk:
                    raise EOFError(f"truncated frame: {len(data)} of {n} bytes")
                data += chunk
            return bytes(data)

        (size,) = HEADER.unpack(read_exactly(HEADER.size))
        return pickle.loads(read_exactly(size))

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()

    def call(self, function: str, args: tuple, timeout_s: float) -> Outcome:
        try:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
        except Exception as e:
            return Outcome("error", error=f"verifier process: {e}")
        proc = self._proc
        try:
            write_frame(proc.stdin, (function, args))
            status, value = self._receive(proc, timeout_s)
        except TimeoutError:
            self.close()
            return Outcome("timeout", error=f"no answer within {timeout_s:g} s")
        except (EOFError, OSError) as e:
            # The process died under the verifier (killed for memory, a segfault, os._exit).
            self.close()
            return Outcome("error", error=f"verifier process died: {e!r}")
        except Exception as e:
            # A garbled frame (UnpicklingError, a frame of the wrong shape): this sample's
            # error. The stream cannot be trusted past it, so the next sample gets a fresh one.
            self.close()
            return Outcome("error", error=f"bad result frame from the verifier: {e!r}")
        if status == "ok":
            return Outcome("ok", value=value)
        return Outcome("error", error=value)

    def close(self) -> None:
        if self._proc is not None:
            self._kill(self._proc)
            self._proc = None


@dataclass(frozen=True)
class _Sent:
    """A chunk in flight: the worker it went to (its index and handle, which a replacement
    changes) and when it counts as stuck."""

    index: int
    worker: ray.actor.ActorHandle
    chunk: range
    deadline: float


class VerifierWorker:
    """A Ray actor (see :class:`WorkerPool`) running ``function`` over chunks of samples."""

    def __init__(
        self,
        function: str,
        timeout_s: float,
        preload: tuple[str, ...] = (),
        warmups: tuple[Warmup, ...] = (),
    ) -> None:
        self._function = function
        self._timeout_s = timeout_s
        self._process = VerifierProcess(preload, warmups)

    def ready(self) -> Outcome:
        # Start the verifier process now, so that its imports are not paid by the first step
        # and a verifier that cannot even be imported is an error at setup, not a zero reward.
        return self._process.call("builtins:len", ((),), STARTUP_TIMEOUT_S)

    def run(self, items: list[tuple]) -> list[Outcome]:
        return [self._process.call(self._function, args, self._timeout_s) for args in items]

    def close(self) -> None:
        self._process.close()


class WorkerPool:
    """``num_workers`` :class:`VerifierWorker` actors sharing the samples of each :meth:`map`
    (None: as many as the CPUs Ray has free hold, at most two; see :func:`fit_num_workers`).

    ``function`` is an importable ``"module:function"`` path: the verifier processes import it
    themselves, so nothing unpicklable needs to cross a process boundary. ``preload`` names
    modules they import before the first sample (so that it does not pay for them), and
    ``warmups`` calls they make then (see :class:`VerifierProcess`).

    The workers' CPUs are reserved first, as one placement group: a pool the cluster has no
    room for fails within seconds, naming what it asked and what is free, rather than waiting
    forever for actors Ray cannot place. A worker that dies is replaced in its own reservation.

    :meth:`map` may be called from several threads at once.
    """

    def __init__(
        self,
        function: str,
        num_workers: int | None = None,
        timeout_s: float = 10.0,
        chunk_size: int | None = None,
        num_cpus_per_worker: float = 1.0,
        preload: tuple[str, ...] = (),
        warmups: tuple[Warmup, ...] = (),
    ) -> None:
        if num_workers is None:  # as many as the CPUs Ray has free now hold, at most two
            free = ray.available_resources().get("CPU", 0.0)
            num_workers = fit_num_workers(None, num_cpus_per_worker, free)
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.function = function
        self.timeout_s = timeout_s
        self.chunk_size = chunk_size
        self.preload = (function.partition(":")[0], *preload)
        self.warmups = warmups
        self._num_cpus_per_worker = num_cpus_per_worker
        self._reservation = None
        if num_cpus_per_worker > 0:
            self._reservation = reserve_bundles(
                [{"CPU": num_cpus_per_worker}] * num_workers, f"verifier pool of {function!r}"
            )
        # Guards the workers' list (a dead one's replacement) and their samples in flight.
        self._lock = threading.Lock()
        self._workers = [self._new_worker(i) for i in range(num_workers)]
        self._in_flight = [0] * num_workers
        try:
            # Placed, so only the verifier processes' imports remain: bounded by their timeout.
            ready = ray.get(
                [w.ready.remote() for w in self._workers], timeout=STARTUP_TIMEOUT_S + 60
            )
        except GetTimeoutError:
            self.shutdown()
            raise RuntimeError(
                f"verifier pool of {function!r}: its workers were not ready within "
                f"{STARTUP_TIMEOUT_S + 60:g}s"
            ) from None
        for outcome in ready:
            if outcome.status != "ok":
                self.shutdown()
                raise RuntimeError(f"cannot start verifier {function!r}: {outcome.error}")

    def _new_worker(self, index: int) -> ray.actor.ActorHandle:
        options: dict[str, Any] = {"num_cpus": self._num_cpus_per_worker}
        if self._reservation is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self._reservation, placement_group_bundle_index=index
            )
        actor_cls = ray.remote(VerifierWorker).options(**options)
        return actor_cls.remote(self.function, self.timeout_s, self.preload, self.warmups)

    def _chunks(self, n: int) -> list[range]:
        return chunk_ranges(n, len(self._workers), self.chunk_size)

    def _submit(self, items: list[tuple], chunk: range) -> tuple[ray.ObjectRef, _Sent]:
        """Send ``chunk`` of ``items`` to the least-loaded worker (the one with the fewest
        samples in flight, of every caller's maps)."""
        with self._lock:
            index = min(range(len(self._workers)), key=self._in_flight.__getitem__)
            worker, ahead = self._workers[index], self._in_flight[index]
            self._in_flight[index] += len(chunk)
        ref = worker.run.remote([items[i] for i in chunk])
        # Each sample has its own timeout inside the worker; this only catches a worker stuck
        # beyond all of them (its verifier process cannot even be restarted, say), counting
        # the samples queued on it before this chunk.
        stuck_after_s = STARTUP_TIMEOUT_S * 2 + self.timeout_s * (ahead + len(chunk))
        return ref, _Sent(index, worker, chunk, time.monotonic() + stuck_after_s)

    def _replace(self, index: int, dead: ray.actor.ActorHandle) -> None:
        """A new worker in place of ``dead``, unless another caller's map replaced it already
        (two maps that both had chunks on it see it die): one worker per reservation."""
        with self._lock:
            if self._workers[index] is dead:
                self._workers[index] = self._new_worker(index)

    def map(self, items: list[tuple]) -> list[Outcome]:
        """Run the verifier on every item (a tuple of arguments); outcomes in item order.

        Safe to call from several threads at once: each chunk goes to the worker with the
        fewest samples in flight at that moment, so concurrent small maps spread over the
        workers, and a single big map keeps every worker busy (at most one chunk of it on each
        worker at a time, the next chunk to whichever finishes first)."""
        outcomes: list[Outcome | None] = [None] * len(items)
        pending = list(reversed(self._chunks(len(items))))
        in_flight: dict[ray.ObjectRef, _Sent] = {}
        for _ in range(len(self._workers)):
            if pending:
                ref, sent = self._submit(items, pending.pop())
                in_flight[ref] = sent
        while in_flight:
            first = min(in_flight, key=lambda r: in_flight[r].deadline)
            timeout = max(0.0, in_flight[first].deadline - time.monotonic())
            done, _ = ray.wait(list(in_flight), num_returns=1, timeout=timeout)
            if not done:
                logger.error("a verifier worker is stuck past its samples' timeouts: restarting it")
                ray.kill(in_flight[first].worker)
                done = [first]
            ref = done[0]
            sent = in_flight.pop(ref)
            try:
                results = ray.get(ref)
            except RayActorError as e:
                results = [Outcome("error", error=f"verifier worker died: {e}")] * len(sent.chunk)
                self._replace(sent.index, sent.worker)
            except Exception as e:  # e.g. an argument that cannot be pickled
                results = [Outcome("error", error=f"verifier worker failed: {e!r}")] * len(
                    sent.chunk
                )
            finally:
                with self._lock:
                    self._in_flight[sent.index] -= len(sent.chunk)
            for i, outcome in zip(sent.chunk, results, strict=True):
                outcomes[i] = outcome
            if pending:
                ref, sent = self._submit(items, pending.pop())
                in_flight[ref] = sent
        return outcomes  # type: ignore[return-value]

    def shutdown(self) -> None:
        for w in self._workers:
            with contextlib.suppress(Exception):
                ray.get(w.close.remote(), timeout=10)
            ray.kill(w)
        self._workers = []
        if self._reservation is not None:
            with contextlib.suppress(Exception):  # Ray already gone: nothing left to release
                remove_placement_group(self._reservation)
            self._reservation = None
