"""What a worker group hands back: where each worker sits, the futures of a call, and the
errors that name the worker behind a failure (the dispatch itself is in ``worker_groups``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class WorkerGroupError(RuntimeError):
    """Base class for failures of a worker group's workers."""


class WorkerDiedError(WorkerGroupError):
    """A worker process ended (killed, crashed, out of memory) or never started."""


class WorkerCallError(WorkerGroupError):
    """A worker's method raised; the remote traceback is in the message and ``__cause__``."""


class WorkerTimeoutError(WorkerGroupError):
    """Workers did not answer within the deadline; the message names each one, the method it
    is running and its current Python stack.

    A deadline cannot tell a slow worker from a stuck one; the report (stack, process state)
    lets a human tell. ``ranks`` are the workers still busy and ``pending`` their calls, still
    running: ``group.get_all_worker_results(err.pending)`` keeps waiting for them.
    """

    def __init__(self, message: str, ranks: list[int | None], pending: WorkerFutures) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.pending = pending


@dataclass
class WorkerMetadata:
    """Where one worker sits: in the group, on the cluster and in its tied group."""

    rank: int
    name: str
    node_idx: int
    local_rank: int
    bundle_index: int
    tied_group: int
    placement: dict[str, Any] = field(default_factory=dict)  # pid, host, node id once started

    def describe(self) -> str:
        where = self.placement.get("hostname") or f"virtual node {self.node_idx}"
        pid = self.placement.get("pid")
        return f"worker {self.name!r} (rank {self.rank} on {where}" + (
            f", pid {pid})" if pid else ")"
        )


class WorkerFutures(list):
    """A list of ``ObjectRef`` that remembers which worker and method each came from.

    It is a plain list to Ray (``ray.get`` works on it); the group uses the extra fields to
    name the worker when a result turns out to be a failure.
    """

    def __init__(
        self,
        refs: Sequence,
        worker_ranks: Sequence[int],
        method: str,
        watched: Sequence[tuple[Any, int]] = (),
    ) -> None:
        super().__init__(refs)
        self.worker_ranks = list(worker_ranks)
        self.method = method
        # Calls whose results are dropped (replicated outputs) but whose failure still counts:
        # a dead tensor-parallel peer must be reported, not waited for behind its blocked
        # partners. ``(ref, rank)`` pairs.
        self.watched = list(watched)


def cpu_threads_env(use_gpus: bool, workers_on_node: int) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for a worker on a CPU-only cluster: the node's cores shared by
    the group's workers there.

    Ray would give a worker as many threads as CPUs it reserved, which is one (or a
    fraction, so one) for a CPU bundle: colocated groups, which take turns, would each use
    one core of the machine. A GPU worker keeps Ray's default (its CPU work is light).
    ``OMP_NUM_THREADS`` set for the driver wins, on every worker.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return {"OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]}
    if use_gpus:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"OMP_NUM_THREADS": str(max(1, (cores or 1) // max(1, workers_on_node)))}
