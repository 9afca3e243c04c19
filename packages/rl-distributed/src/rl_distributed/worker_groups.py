"""Groups of Ray worker processes placed on a virtual cluster, and dispatch to them.

A worker group starts one process per bundle it is given, sets the torch.distributed
environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``…) in each, and calls methods on all of
them at once. Data can go to every worker, one item per worker, or be split along the named
axes of a :class:`NamedSharding` (data-parallel shards, replicated over tensor-parallel peers).

Failures are loud: a worker that dies (killed, segfault, out of memory) or raises surfaces in
the driver as an error naming the worker, its node and the cause, while its peers may still be
blocked in a collective waiting for it. A worker that is alive but stuck is reported when the
caller's deadline passes (``timeout=``, or the group's ``call_timeout``), with the method it is
running and its current Python stack.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray
from ray.util.placement_group import placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_distributed import hang_report, venvs
from rl_distributed._arguments import check_shard_shape, share_large_values
from rl_distributed.named_sharding import NamedSharding
from rl_distributed.remote_worker import RemoteWorker, failure
from rl_distributed.virtual_cluster import RayVirtualCluster
from rl_distributed.worker_host import WorkerHost
from rl_distributed.worker_types import (
    WorkerCallError,  # noqa: F401 (re-exported: callers import the errors from here)
    WorkerDiedError,  # noqa: F401
    WorkerFutures,
    WorkerGroupError,
    WorkerMetadata,
    WorkerTimeoutError,
    cpu_threads_env,
)

logger = logging.getLogger(__name__)

#: How often a waiting driver wakes up (to check its deadline) while no call finishes.
POLL_INTERVAL_S = 1.0
#: A deadline for every call of every group, in seconds (unset: wait as long as it takes).
CALL_TIMEOUT_ENV_VAR = "RL_WORKER_CALL_TIMEOUT_S"
#: Calls remembered per worker to say which one a stuck worker is running.
_TRACKED_CALLS = 256
#: How long shutdown waits for killed workers to be gone.
KILL_WAIT_S = 30.0
#: After a failure, how long to let the other calls finish before naming the failed worker.
GRACE_ON_FAILURE_S = 1.0
#: How long workers may take to start (import, build their model) before we give up.
STARTUP_TIMEOUT_S = float(os.environ.get("RL_WORKER_STARTUP_TIMEOUT_S", "600"))

_RemoteWorkerHost = ray.remote(WorkerHost)


class RayWorkerBuilder:
    """Names a worker class and its constructor arguments; builds actors from them.

    The class is given as a dotted path and imported only inside the worker process, so the
    driver needs none of the worker's dependencies (vLLM, Megatron, …).
    """

    def __init__(self, actor_class_fqn: str, *args: Any, **kwargs: Any) -> None:
        if not isinstance(actor_class_fqn, str) or "." not in actor_class_fqn:
            raise ValueError(
                f"RayWorkerBuilder needs a class path like 'pkg.module.Class', "
                f"got {actor_class_fqn!r}"
            )
        self.actor_class_fqn = actor_class_fqn
        self.args = args
        self.kwargs = kwargs
        self.python_env: str | None = None

    def with_python_env(self, name: str) -> RayWorkerBuilder:
        """Run this group in the named environment instead of the class's registered one."""
        venvs.registry.get(name)  # fail now, in the driver, on a typo
        self.python_env = name
        return self

    def resolve_python_env(self) -> venvs.PythonEnv:
        if self.python_env is not None:
            return venvs.registry.get(self.python_env)
        return venvs.registry.env_for(self.actor_class_fqn)

    def create_worker(
        self,
        *,
        placement_group,
        bundle_index: int,
        num_cpus: float,
        num_gpus: float,
        env_vars: dict[str, str],
        runtime_env: dict[str, Any] | None = None,
    ) -> ray.actor.ActorHandle:
        env = dict(runtime_env or {})
        env["env_vars"] = {**env.get("env_vars", {}), **env_vars}
        return _RemoteWorkerHost.options(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            runtime_env=env,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=placement_group,
                placement_group_bundle_index=bundle_index,
                placement_group_capture_child_tasks=True,
            ),
        ).remote(self.actor_class_fqn, self.args, self.kwargs)

    def __repr__(self) -> str:
        return f"RayWorkerBuilder({self.actor_class_fqn!r})"


class RayWorkerGroup:
    """A group of workers, one per bundle it is given, addressed together.

    Placement: ``bundle_indices_list`` (a list of ``(node_idx, [bundle, …])``) places one worker
    per listed bundle and ties the workers of each entry together (e.g. the tensor-parallel
    ranks of one inference engine: ``tied_groups``). Otherwise ``workers_per_node`` (an int, a
    list per node, or None for one per bundle) fills each virtual node's bundles in order.

    ``call_timeout`` (seconds; default ``RL_WORKER_CALL_TIMEOUT_S``, else none) is the deadline
    ``get_all_worker_results`` uses when the caller gives none: a watchdog for every call, so a
    stuck worker is reported with its stack instead of hanging the driver.
    """

    def __init__(
        self,
        cluster: RayVirtualCluster,
        remote_worker_builder: RayWorkerBuilder,
        workers_per_node: int | list[int] | None = None,
        name_prefix: str = "",
        bundle_indices_list: list[tuple[int, list[int]]] | None = None,
        sharding_annotations: NamedSharding | None = None,
        env_vars: dict[str, str] | None = None,
        call_timeout: float | None = None,
    ) -> None:
        self.cluster = cluster
        if call_timeout is None and os.environ.get(CALL_TIMEOUT_ENV_VAR):
            call_timeout = float(os.environ[CALL_TIMEOUT_ENV_VAR])
        if call_timeout is not None and call_timeout <= 0:
            raise ValueError(f"call_timeout must be positive seconds, got {call_timeout}")
        self.call_timeout = call_timeout
        self.builder = remote_worker_builder
        self.name_prefix = name_prefix or remote_worker_builder.actor_class_fqn.rsplit(".")[-1]
        if bundle_indices_list is not None and workers_per_node is not None:
            raise ValueError("give either workers_per_node or bundle_indices_list, not both")
        placements = (
            self._check_bundle_indices(bundle_indices_list)
            if bundle_indices_list is not None
            else self._fill_nodes(workers_per_node)
        )
        world_size = sum(len(bundles) for _, bundles in placements)
        if world_size == 0:
            raise ValueError(
                f"worker group {self.name_prefix!r} places no worker: workers_per_node="
                f"{workers_per_node!r}, bundle_indices_list={bundle_indices_list!r}"
            )
        if sharding_annotations is None:
            sharding_annotations = NamedSharding(np.arange(world_size), ["data_parallel"])
        if sharding_annotations.size != world_size:
            raise ValueError(
                f"sharding_annotations cover {sharding_annotations.size} ranks but the group "
                f"has {world_size} workers"
            )
        self.sharding_annotations = sharding_annotations
        self.workers: list[ray.actor.ActorHandle] = []
        self.worker_metadata: list[WorkerMetadata] = []
        # Per worker, its recent calls in order: a worker runs them one at a time, so the
        # oldest unfinished one is what a stuck worker is running.
        self._calls: list[deque[tuple[ray.ObjectRef, str]]] = []
        self._owner = f"{self.name_prefix}@{id(self):x}"
        cluster.claim_bundles([(p, b) for p, bundles in placements for b in bundles], self._owner)
        try:
            self._start_workers(placements, world_size, env_vars or {})
        except BaseException:
            self.shutdown(timeout=0)  # kill what started and give the bundles back
            raise

    # -- placement ---------------------------------------------------------------------------

    def _nodes(self) -> list[int]:
        """Virtual node index of each placement group (nodes with zero bundles have none)."""
        return [i for i, n in enumerate(self.cluster.bundle_ct_per_node_list) if n > 0]

    def _fill_nodes(self, workers_per_node) -> list[tuple[int, list[int]]]:
        nodes = self._nodes()
        counts = [self.cluster.bundle_ct_per_node_list[i] for i in nodes]
        if workers_per_node is None:
            wanted = counts
        elif isinstance(workers_per_node, int):
            wanted = [workers_per_node] * len(nodes)
        else:
            wanted = list(workers_per_node)
            if len(wanted) != len(nodes):
                raise ValueError(
                    f"workers_per_node has {len(wanted)} entries but the cluster has "
                    f"{len(nodes)} nodes with bundles"
                )
        for node, want, have in zip(nodes, wanted, counts, strict=True):
            if want > have:
                raise ValueError(f"node {node} has {have} bundles, cannot place {want} workers")
        # Each worker is its own tied group when nothing ties them.
        return [(pg_idx, [b]) for pg_idx, w in enumerate(wanted) for b in range(w)]

    def _check_bundle_indices(self, bundle_indices_list) -> list[tuple[int, list[int]]]:
        nodes = self._nodes()
        seen = set()
        for node_idx, bundles in bundle_indices_list:
            if not bundles:
                raise ValueError(
                    f"bundle_indices_list entry for node {node_idx} lists no bundle; "
                    f"every tied group needs at least one"
                )
            if not 0 <= node_idx < len(nodes):
                raise ValueError(
                    f"bundle_indices_list names node {node_idx}; cluster has {len(nodes)}"
                )
            have = self.cluster.bundle_ct_per_node_list[nodes[node_idx]]
            for b in bundles:
                if not 0 <= b < have:
                    raise ValueError(f"node {node_idx} has {have} bundles; no bundle {b}")
                if (node_idx, b) in seen:
                    raise ValueError(f"bundle {b} of node {node_idx} is listed twice")
                seen.add((node_idx, b))
        return [(node_idx, list(bundles)) for node_idx, bundles in bundle_indices_list]

    def _start_workers(self, placements, world_size: int, extra_env: dict[str, str]) -> None:
        pgs = self.cluster.get_placement_groups()
        python_env = self.builder.resolve_python_env()
        pythons = {} if python_env.is_system else venvs.python_per_node(python_env, pgs)
        # The rendezvous is where rank 0 runs: its placement group and bundle, which is not
        # always the cluster's first (workers_per_node=[0, 2], bundle_indices_list=[(1, ...)]).
        rank0_pg, rank0_bundles = placements[0]
        master_addr, master_port = self.cluster.get_master_address_and_port(
            placement_group_index=rank0_pg, bundle_index=rank0_bundles[0]
        )
        res = self.cluster.resources
        node_ranks = {pg_idx: i for i, pg_idx in enumerate(dict.fromkeys(p for p, _ in placements))}
        workers_on_node = {p: sum(len(b) for q, b in placements if q == p) for p in node_ranks}
        local_counts: dict[int, int] = {}
        rank = 0
        for tied_group, (pg_idx, bundles) in enumerate(placements):
            for bundle in bundles:
                local_rank = local_counts.get(pg_idx, 0)
                local_counts[pg_idx] = local_rank + 1
                meta = WorkerMetadata(
                    rank=rank,
                    name=f"{self.name_prefix}-{rank}",
                    node_idx=pg_idx,
                    local_rank=local_rank,
                    bundle_index=bundle,
                    tied_group=tied_group,
                )
                env = {
                    "RANK": str(rank),
                    "LOCAL_RANK": str(local_rank),
                    "WORLD_SIZE": str(world_size),
                    "LOCAL_WORLD_SIZE": str(workers_on_node[pg_idx]),
                    "NODE_RANK": str(node_ranks[pg_idx]),
                    "MASTER_ADDR": master_addr,
                    "MASTER_PORT": str(master_port),
                    "RL_WORKER_NAME": meta.name,
                    **cpu_threads_env(self.cluster.use_gpus, workers_on_node[pg_idx]),
                    **extra_env,
                }
                runtime_env = {}
                if pythons:
                    node = placement_group_table(pgs[pg_idx])["bundles_to_node_id"][bundle]
                    runtime_env["py_executable"] = pythons[node]
                self.workers.append(
                    self.builder.create_worker(
                        placement_group=pgs[pg_idx],
                        bundle_index=bundle,
                        num_cpus=res.worker_cpus,
                        num_gpus=res.worker_gpus,
                        env_vars=env,
                        runtime_env=runtime_env,
                    )
                )
                self.worker_metadata.append(meta)
                self._calls.append(deque(maxlen=_TRACKED_CALLS))
                rank += 1
        started = WorkerFutures(
            [w.describe.remote() for w in self.workers], range(len(self.workers)), "__init__"
        )
        for calls, ref in zip(self._calls, started, strict=True):
            calls.append((ref, "__init__"))
        placements_info = self.get_all_worker_results(started, timeout=STARTUP_TIMEOUT_S)
        for meta, info in zip(self.worker_metadata, placements_info, strict=True):
            meta.placement = info

    # -- introspection -----------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def dp_size(self) -> int:
        """Number of data-parallel shards: the ``data_parallel`` axis, else every worker."""
        if "data_parallel" in self.sharding_annotations.names:
            return self.sharding_annotations.get_axis_size("data_parallel")
        return self.world_size

    @property
    def tied_groups(self) -> list[list[int]]:
        """Ranks of each tied group, in order; the first rank of each is its leader."""
        groups: dict[int, list[int]] = {}
        for meta in self.worker_metadata:
            groups.setdefault(meta.tied_group, []).append(meta.rank)
        return list(groups.values())

    # -- dispatch ----------------------------------------------------------------------------

    def _call(self, rank: int, method: str, kwargs: dict[str, Any]):
        ref = self.workers[rank].execute.remote(method, (), kwargs)
        self._forget_finished(rank)
        self._calls[rank].append((ref, method))
        return ref

    def _forget_finished(self, rank: int) -> None:
        """Drop worker ``rank``'s finished calls from the record: holding their refs would keep
        their results (batches, logprobs…) alive in the object store after the caller let go."""
        calls = self._calls[rank]
        if not calls:
            return
        refs = [ref for ref, _ in calls]
        _, unfinished = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        if len(unfinished) < len(refs):
            still_running = set(unfinished)
            kept = [(ref, method) for ref, method in calls if ref in still_running]
            calls.clear()
            calls.extend(kept)

    def _running_method(self, rank: int | None) -> str | None:
        """The method worker ``rank`` is busy with: its oldest call that has not finished."""
        if rank is None or not 0 <= rank < len(self._calls):
            return None
        calls = list(self._calls[rank])
        if not calls:
            return None
        refs = [ref for ref, _ in calls]
        _, unfinished = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        unfinished_set = set(unfinished)
        return next((method for ref, method in calls if ref in unfinished_set), None)

    def run_all_workers_single_data(self, method: str, **kwargs: Any) -> WorkerFutures:
        """Call ``method(**kwargs)`` on every worker; large arguments are shipped once."""
        kwargs = share_large_values(kwargs, copies=len(self.workers))
        ranks = range(len(self.workers))
        return WorkerFutures([self._call(r, method, kwargs) for r in ranks], ranks, method)

    def run_all_workers_multiple_data(self, method: str, **kwarg_lists: Sequence) -> WorkerFutures:
        """Call ``method`` on worker ``i`` with the ``i``-th item of every keyword list."""
        for key, values in kwarg_lists.items():
            if len(values) != len(self.workers):
                raise ValueError(
                    f"{method}: argument {key!r} has {len(values)} items for "
                    f"{len(self.workers)} workers"
                )
        ranks = range(len(self.workers))
        refs = [self._call(r, method, {k: v[r] for k, v in kwarg_lists.items()}) for r in ranks]
        return WorkerFutures(refs, ranks, method)

    def run_all_workers_sharded_data(
        self,
        method: str,
        in_sharded_axes: Sequence[str] = (),
        replicate_on_axes: Sequence[str] = (),
        output_is_replicated: Sequence[str] = (),
        common_kwargs: dict[str, Any] | None = None,
        **data: Any,
    ) -> WorkerFutures:
        """Call ``method`` on every worker with its slice of ``data``.

        Each value in ``data`` is a nested sequence indexed by the ``in_sharded_axes`` in order
        (``data[dp]`` for ``["data_parallel"]``). Workers along ``replicate_on_axes`` get the same
        slice. Along any other ("free") axis only coordinate 0 gets data and the rest are called
        with ``None`` (e.g. later pipeline stages, which take activations, not inputs).
        Results from workers off coordinate 0 of an ``output_is_replicated`` axis are dropped,
        so replicated outputs come back once, in rank order.
        """
        sharding = self.sharding_annotations
        axes = [*in_sharded_axes, *replicate_on_axes, *output_is_replicated]
        for axis in axes:
            if axis not in sharding.names:
                raise ValueError(f"{method}: unknown axis {axis!r}; axes are {sharding.names}")
        if set(in_sharded_axes) & set(replicate_on_axes):
            raise ValueError(f"{method}: an axis cannot be both sharded and replicated")
        for key, value in data.items():
            check_shard_shape(method, key, value, [sharding.shape[a] for a in in_sharded_axes])
        free_axes = [a for a in sharding.names if a not in (*in_sharded_axes, *replicate_on_axes)]
        common = share_large_values(common_kwargs or {}, copies=len(self.workers))

        refs, ranks, watched = [], [], []
        for rank in range(len(self.workers)):
            coords = sharding.get_worker_coords(rank)
            gets_data = all(coords[a] == 0 for a in free_axes)
            kwargs = dict(common)
            for key, value in data.items():
                for axis in in_sharded_axes:
                    value = value[coords[axis]]
                kwargs[key] = value if gets_data else None
            ref = self._call(rank, method, kwargs)
            if all(coords[a] == 0 for a in output_is_replicated):
                refs.append(ref)
                ranks.append(rank)
            else:
                watched.append((ref, rank))
        return WorkerFutures(refs, ranks, method, watched)

    def call_all(self, method: str, *, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """``method(**kwargs)`` on every worker, waited for (``get_all_worker_results``)."""
        futures = self.run_all_workers_single_data(method, **kwargs)
        return self.get_all_worker_results(futures, timeout=timeout)

    def run_one(self, rank: int, method: str, **kwargs: Any) -> WorkerFutures:
        """Start ``method(**kwargs)`` on worker ``rank`` alone, tracked like any call of the
        group; wait for it with ``get_all_worker_results``."""
        if not 0 <= rank < len(self.workers):
            raise IndexError(f"{method}: no worker of rank {rank} (world size {self.world_size})")
        return WorkerFutures([self._call(rank, method, kwargs)], [rank], method)

    def call_one(
        self, rank: int, method: str, *, timeout: float | None = None, **kwargs: Any
    ) -> Any:
        """``method(**kwargs)`` on worker ``rank`` alone, waited for (a hang report names the
        method it runs)."""
        return self.get_all_worker_results(self.run_one(rank, method, **kwargs), timeout=timeout)[0]

    def remote_worker(self, rank: int) -> RemoteWorker:
        """Worker ``rank`` as a handle another process (a Ray actor) can call."""
        meta = self.worker_metadata[rank]
        return RemoteWorker(self.workers[rank], meta.describe(), rank, meta.placement.get("stderr"))

    # -- results -----------------------------------------------------------------------------

    def get_all_worker_results(self, futures: Sequence, timeout: float | None = None) -> list[Any]:
        """Wait for ``futures`` and return their results in order.

        Fails fast: each call is checked once, as soon as it finishes, so a dead peer is
        reported at once even while the others are blocked in a collective waiting for it.
        ``timeout`` (default: the group's ``call_timeout``, else none) is a deadline: when it
        passes, ``WorkerTimeoutError`` names every worker still busy, the method it is
        running, and its current Python stack.
        """
        returned = len(futures)
        watched = list(getattr(futures, "watched", ()))
        refs = [*futures, *(ref for ref, _ in watched)]
        ranks = list(getattr(futures, "worker_ranks", None) or [None] * returned)
        ranks += [rank for _, rank in watched]
        method = getattr(futures, "method", "?")
        timeout = self.call_timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        positions: dict[Any, list[int]] = {}
        for i, ref in enumerate(refs):
            positions.setdefault(ref, []).append(i)
        results: list[Any] = [None] * len(refs)
        failures: dict[int, Exception] = {}
        pending = list(dict.fromkeys(refs))

        def collect(ready: list) -> None:
            # Each result is fetched once, when it is ready, never again on later polls.
            for ref in ready:
                try:
                    value = ray.get(ref)
                except Exception as err:
                    failures[positions[ref][0]] = err
                    continue
                for i in positions[ref]:
                    results[i] = value

        while pending:
            wait = POLL_INTERVAL_S
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - time.monotonic()))
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait)
            if ready and pending:  # take every call that is done, not just the first
                more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
                ready += more
            collect(ready)
            if failures:
                # Give the other calls a moment to finish, so the lowest failing rank is
                # named (usually the root cause: the others often fail because it did).
                if pending:
                    late, pending = ray.wait(
                        pending, num_returns=len(pending), timeout=GRACE_ON_FAILURE_S
                    )
                    collect(late)
                # By rank where known: watched calls sit after the returned ones.
                first = min(failures, key=lambda i: (ranks[i] is None, ranks[i] or 0, i))
                raise self._worker_error(failures[first], ranks[first], method)
            if pending and deadline is not None and time.monotonic() >= deadline:
                stuck = sorted(positions[ref][0] for ref in pending)
                stuck_ranks = [ranks[i] for i in stuck]
                still_running = WorkerFutures([refs[i] for i in stuck], stuck_ranks, method)
                raise self._hang_error(stuck_ranks, method, timeout, len(refs), still_running)
        for rank in dict.fromkeys(ranks):
            if rank is not None and 0 <= rank < len(self._calls):
                self._forget_finished(rank)
        return results[:returned]

    def _describe(self, rank: int | None) -> str:
        if rank is None or not 0 <= rank < len(self.worker_metadata):
            return "an unknown worker"
        return self.worker_metadata[rank].describe()

    def _worker_error(self, err: Exception, rank: int | None, method: str) -> Exception:
        """The error to raise for a failed call: which worker, how, and its own words."""
        stderr = self.worker_metadata[rank].placement.get("stderr") if rank is not None else None
        return failure(err, self._describe(rank), method, stderr)

    def _hang_error(
        self,
        ranks: list[int | None],
        method: str,
        timeout: float,
        total: int,
        pending: WorkerFutures,
    ) -> WorkerTimeoutError:
        """Name each stuck worker, the method it is running and its current Python stack."""
        known = [r for r in ranks if r is not None and 0 <= r < len(self.worker_metadata)]
        stacks = dict(
            zip(
                known,
                hang_report.collect_stacks([self.worker_metadata[r].placement for r in known]),
                strict=True,
            )
        )
        parts = [
            f"{method}: {len(ranks)} of {total} workers did not answer within {timeout}s: "
            + ", ".join(self._describe(r) for r in ranks)
        ]
        for rank in ranks:
            running = self._running_method(rank) or method
            stack = stacks.get(rank, "no Python stack: unknown worker")
            parts.append(f"--- {self._describe(rank)} is running {running!r}: {stack}".rstrip())
        return WorkerTimeoutError("\n".join(parts), ranks, pending)

    # -- teardown ----------------------------------------------------------------------------

    def shutdown(self, cleanup_method: str | None = None, timeout: float = 30) -> bool:
        """Run ``cleanup_method`` on every worker (up to ``timeout`` s), then kill them all.

        Returns True when the cleanup finished everywhere in time (or none was asked for).
        """
        clean = True
        if cleanup_method and self.workers:
            try:
                self.call_all(cleanup_method, timeout=timeout)
            except WorkerGroupError as err:
                logger.warning("cleanup %r did not finish cleanly: %s", cleanup_method, err)
                clean = False
        for worker in self.workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception as err:  # already dead: nothing to kill
                logger.debug("kill failed: %s", err)
        # ray.kill only asks; wait until the processes are gone, so their memory (and GPUs) is
        # free for whatever the caller starts next on the same bundles.
        _wait_until_dead(self.workers, timeout=KILL_WAIT_S)
        self.workers = []
        self.cluster.release_bundles(self._owner)
        return clean


def _wait_until_dead(workers: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    alive = list(workers)
    while alive and time.monotonic() < deadline:
        probes = [(w, w.__ray_ready__.remote()) for w in alive]
        alive = []
        for worker, probe in probes:
            try:
                ray.get(probe, timeout=max(0.1, deadline - time.monotonic()))
                alive.append(worker)  # the kill has not landed yet
            except ray.exceptions.GetTimeoutError:
                alive.append(worker)
            except ray.exceptions.RayActorError:
                pass
        if alive:
            time.sleep(0.05)
    if alive:
        logger.warning("%d killed workers were still alive after %.0f s", len(alive), timeout)
