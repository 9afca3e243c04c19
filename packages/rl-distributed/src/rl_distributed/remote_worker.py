"""One worker of a group, callable from any process, and the errors that name it.

A ``RayWorkerGroup`` lives in the driver and tracks every call it makes, so a hang report can
say which method each stuck worker runs. Some callers are not the driver: async GRPO's
trajectory collector is a Ray actor of its own that talks to the generation engines directly.
It gets ``RemoteWorker``s (``group.remote_worker(rank)``): small, picklable, each call waited
for with a deadline, and every failure turned into an error that names the worker.

``failure(err, name, method, stderr_path)`` is the one place that turns a Ray error into such
an error; the group uses it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray

from rl_distributed.worker_types import (
    WorkerCallError,
    WorkerDiedError,
    WorkerFutures,
    WorkerTimeoutError,
)

_DEATHS = (
    ray.exceptions.RayActorError,
    ray.exceptions.WorkerCrashedError,
    ray.exceptions.OutOfMemoryError,
    ray.exceptions.NodeDiedError,
)


def death_cause(err: Exception) -> str:
    """The useful part of Ray's message on why an actor died."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if any("creation task" in line for line in lines):
        # The constructor raised: its exception is at the end of the remote traceback.
        return "its constructor raised: " + " ".join(lines[-2:])
    text = " ".join(lines)
    if "exit detail:" in text:
        text = text[text.index("exit detail:") :]
    return text[:600]


def log_tail(stderr_path: str | None, lines: int = 20) -> str:
    """The end of a dead worker's stderr log, when it is on this machine."""
    if not stderr_path:
        return ""
    try:
        with open(stderr_path, errors="replace") as log:
            tail = log.readlines()[-lines:]
    except OSError:
        return ""
    return f"\n--- last lines of {stderr_path} ---\n" + "".join(tail).rstrip()


def failure(err: Exception, name: str, method: str, stderr_path: str | None = None) -> Exception:
    """The error to raise for a failed call: which worker, how, and its own words."""
    if isinstance(err, _DEATHS):
        died = WorkerDiedError(
            f"{name} died during {method!r}: {death_cause(err)}" + log_tail(stderr_path)
        )
        died.__cause__ = err
        return died
    if isinstance(err, ray.exceptions.RayTaskError):
        raised = WorkerCallError(f"{name} raised in {method!r}: {err.cause!r}\n{err}")
        raised.__cause__ = err
        return raised
    return err


@dataclass(frozen=True)
class RemoteWorker:
    """A handle on one worker of a group: its actor, its name for error messages, and its
    rank. Pass it to another Ray actor freely (it pickles as the actor handle)."""

    actor: Any  # the WorkerHost actor handle
    name: str  # e.g. "worker 'grpo-generation-0' (rank 0 on host, pid 123)"
    rank: int
    stderr_path: str | None = None

    def call(
        self,
        method: str,
        *,
        timeout: float | None,
        expected_errors: tuple[type[BaseException], ...] = (),
        **kwargs: Any,
    ) -> Any:
        """``method(**kwargs)`` on the worker, waiting at most ``timeout`` seconds.

        An exception of a type in ``expected_errors`` raised by the method reaches the caller
        as itself (catch it with ``isinstance``); any other becomes ``WorkerCallError``, a dead
        worker ``WorkerDiedError``, and no answer in time ``WorkerTimeoutError`` (whose
        ``pending`` holds the call, still running), each naming the worker.
        """
        ref = self.actor.execute.remote(method, (), kwargs)
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError as err:
            raise WorkerTimeoutError(
                f"{self.name} did not answer {method!r} within {timeout:.0f} s",
                [self.rank],
                WorkerFutures([ref], [self.rank], method),
            ) from err
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, expected_errors):
                raise err.cause from err
            raise failure(err, self.name, method, self.stderr_path) from err
        except _DEATHS as err:
            raise failure(err, self.name, method, self.stderr_path) from err
