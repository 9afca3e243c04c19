"""A slice of a Ray cluster, reserved with placement groups, that worker groups run on.

A *bundle* is the unit one worker runs on: one GPU (plus a CPU) on a GPU cluster, one CPU on a
CPU-only cluster. A *virtual node* is a placement group whose bundles are packed onto one
physical node, so that workers that talk over NVLink/shared memory really share a machine.
Colocated worker groups (policy training and generation taking turns on the same GPUs) share
bundles: each of up to ``max_colocated_worker_groups`` workers asks for that fraction of one.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import TextIO

import ray
from ray.util.placement_group import (
    NODE_ID_LABEL_KEY,
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

logger = logging.getLogger(__name__)

#: How long to wait for placement groups before explaining why they cannot be placed.
PLACEMENT_TIMEOUT_S = float(os.environ.get("RL_PLACEMENT_TIMEOUT_S", "120"))
#: Refuse at once a request this cluster's nodes can never hold ("0": wait, e.g. to autoscale).
FAIL_FAST = os.environ.get("RL_PLACEMENT_FAIL_FAST", "1") != "0"
#: How long a helper actor set (an environment's verifier pool) may wait to be placed. Helpers
#: start after the worker groups, so what is not free then will not come free by waiting.
HELPER_PLACEMENT_TIMEOUT_S = float(os.environ.get("RL_HELPER_PLACEMENT_TIMEOUT_S", "10"))


class ClusterError(RuntimeError):
    """The requested resources cannot be reserved on the Ray cluster."""


# Set for a run whose output is not a terminal (`rl grpo > log.txt`, a Slurm job): Ray's
# colour codes around each worker line and the workers' redrawn progress bars (tqdm's and
# the Hugging Face hub's `\r` lines) only clutter a log file. A value the user set is kept.
PLAIN_OUTPUT_ENV = {
    "RAY_COLOR_PREFIX": "0",
    "TQDM_DISABLE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


def use_plain_output(stream: TextIO) -> None:
    """``PLAIN_OUTPUT_ENV`` when ``stream`` is not a terminal, for this process and what it
    starts. A command line tool calls it before Ray starts (a local cluster's workers inherit
    the driver's environment); a library call leaves a notebook's progress bars alone."""
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        terminal = False
    if not terminal:
        for name, value in PLAIN_OUTPUT_ENV.items():
            os.environ.setdefault(name, value)


def init_ray(num_cpus: int | None = None, num_gpus: int | None = None, **kwargs) -> None:
    """Attach to the Ray cluster in ``RAY_ADDRESS`` or start a local one; no-op if connected.

    A local cluster gets ``num_cpus`` logical CPUs (default: the machine's cores). Logical CPUs
    may exceed physical ones: on a 2-core laptop a 4-worker CPU cluster still fits.
    """
    if ray.is_initialized():
        return
    # Under `uv run`, Ray would otherwise start every worker through `uv run` in an uploaded
    # copy of the working directory: slow, and it overrides the per-group environments. Ray
    # reads the flag when it is imported, so the module constant is switched off too.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    if os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] == "0":
        from ray._private import ray_constants

        ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    kwargs.setdefault("log_to_driver", True)
    kwargs.setdefault("include_dashboard", False)
    if os.environ.get("RAY_ADDRESS"):
        logger.info("attaching to the Ray cluster at %s", os.environ["RAY_ADDRESS"])
        ray.init(address=os.environ["RAY_ADDRESS"], **kwargs)
        return
    # address="local": always a new cluster, never one a stale /tmp/ray file points at.
    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, **kwargs)


def _cpus_and_gpus(resources: dict[str, float]) -> dict[str, float]:
    """CPUs and GPUs in ``resources``, zero where Ray leaves a used-up resource out."""
    return {k: resources.get(k, 0.0) for k in ("CPU", "GPU") if k in ray.cluster_resources()}


def reserve_bundles(
    bundles: list[dict[str, float]], what: str, timeout_s: float = HELPER_PLACEMENT_TIMEOUT_S
) -> PlacementGroup:
    """A placement group holding ``bundles`` for ``what`` (actors about to start), placed
    within ``timeout_s``; otherwise removed and refused, naming what was asked and what the
    cluster has free. An actor scheduled without a reservation would wait forever instead."""
    group = placement_group(bundles, strategy="PACK")
    if not ray.wait([group.ready()], timeout=timeout_s)[0]:
        remove_placement_group(group)
        asked: dict[str, float] = {}
        for bundle in bundles:
            for key, value in bundle.items():
                asked[key] = asked.get(key, 0.0) + value
        raise ClusterError(
            f"{what}: {len(bundles)} actors of {bundles[0]} ({asked} in all) could not be "
            f"placed within {timeout_s:g}s; the Ray cluster has "
            f"{_cpus_and_gpus(ray.available_resources())} free of "
            f"{_cpus_and_gpus(ray.cluster_resources())}. Ask for fewer or smaller actors, or "
            f"give Ray more (RL_HELPER_PLACEMENT_TIMEOUT_S sets the wait)."
        )
    return group


@dataclass(frozen=True)
class BundleResources:
    """What one bundle reserves and what each colocated worker on it asks for."""

    cpus: float
    gpus: float
    max_colocated: int

    def as_bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.cpus}
        if self.gpus:
            bundle["GPU"] = self.gpus
        return bundle

    @property
    def worker_cpus(self) -> float:
        return self.cpus / self.max_colocated

    @property
    def worker_gpus(self) -> float:
        return self.gpus / self.max_colocated


class RayVirtualCluster:
    """Reserves ``bundle_ct_per_node_list[i]`` bundles on virtual node ``i``.

    A virtual node's bundles always share one physical node when GPUs are used (NVLink peers
    must share a machine); CPU bundles are packed where they fit. ``placement_group_strategy``
    says how virtual nodes map to physical Ray nodes: ``"SPREAD"`` (default) puts them on
    distinct nodes when the Ray cluster has enough nodes, and lets them share otherwise (one
    laptop); ``"STRICT_SPREAD"`` insists on distinct nodes; ``"PACK"`` and ``"STRICT_PACK"``
    let them share.
    """

    def __init__(
        self,
        bundle_ct_per_node_list: list[int],
        use_gpus: bool = True,
        max_colocated_worker_groups: int = 1,
        num_gpus_per_node: int = 8,
        name: str = "",
        placement_group_strategy: str = "SPREAD",
    ) -> None:
        if not bundle_ct_per_node_list or any(
            not isinstance(n, int) or n < 0 for n in bundle_ct_per_node_list
        ):
            raise ValueError(
                f"bundle_ct_per_node_list must be a non-empty list of non-negative ints, "
                f"got {bundle_ct_per_node_list!r}"
            )
        if sum(bundle_ct_per_node_list) == 0:
            raise ValueError("bundle_ct_per_node_list reserves no bundle at all")
        if max_colocated_worker_groups < 1:
            raise ValueError(
                f"max_colocated_worker_groups must be >= 1, got {max_colocated_worker_groups}"
            )
        if use_gpus and max(bundle_ct_per_node_list) > num_gpus_per_node:
            raise ValueError(
                f"a node asks for {max(bundle_ct_per_node_list)} GPU bundles but "
                f"num_gpus_per_node={num_gpus_per_node}"
            )
        strategies = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")
        if placement_group_strategy not in strategies:
            raise ValueError(
                f"placement_group_strategy must be one of {strategies}, "
                f"got {placement_group_strategy!r}"
            )
        self.bundle_ct_per_node_list = list(bundle_ct_per_node_list)
        self.use_gpus = use_gpus
        self.max_colocated_worker_groups = max_colocated_worker_groups
        self.num_gpus_per_node = num_gpus_per_node
        self.name = name or "rl-cluster"
        self.placement_group_strategy = placement_group_strategy
        self.resources = BundleResources(
            cpus=1.0, gpus=1.0 if use_gpus else 0.0, max_colocated=max_colocated_worker_groups
        )
        self._used_ports: set[tuple[str, int]] = set()
        # Which worker groups occupy each (placement group, bundle): a group that would not fit
        # fails at once, instead of its actors waiting forever for a share of a full bundle.
        self._bundle_owners: dict[tuple[int, int], list[str]] = {}
        self._placement_groups: list[PlacementGroup] | None = None

        # A local CPU cluster gets enough logical CPUs for every bundle, so a 4-worker run
        # fits on a 2-core laptop (the workers then share cores, which is what the user asked).
        init_ray(num_cpus=None if use_gpus else max(os.cpu_count() or 1, self.world_size()))
        self._create_placement_groups()

    # -- placement ---------------------------------------------------------------------------

    def _node_capacities(self) -> list[dict]:
        """Each alive Ray node, its resources and how many of our bundles it can ever hold."""
        bundle = self.resources.as_bundle()
        nodes = []
        for node in ray.nodes():
            if not node["Alive"]:
                continue
            total = node["Resources"]
            fits = min(int(total.get(k, 0.0) / v + 1e-9) for k, v in bundle.items())
            nodes.append(
                {
                    "node": node.get("NodeManagerAddress", node["NodeID"][:8]),
                    "CPU": total.get("CPU", 0.0),
                    "GPU": total.get("GPU", 0.0),
                    "bundles": fits,
                }
            )
        return nodes

    def _distinct_nodes(self) -> bool:
        """Whether each virtual node gets a physical node of its own; fails fast when the
        request can never be placed on this cluster.

        Only nodes that can hold a virtual node's bundles count: a CPU-only head node does not
        count for GPU bundles. ``SPREAD`` spreads when every virtual node can get a node of its
        own (largest virtual node on the largest node, and so on) and shares nodes otherwise.
        """
        asked = sorted((n for n in self.bundle_ct_per_node_list if n > 0), reverse=True)
        nodes = self._node_capacities()
        can_hold = sorted((n["bundles"] for n in nodes), reverse=True)
        one_node_each = len(asked) <= len(can_hold) and all(
            a <= c for a, c in zip(asked, can_hold, strict=False)
        )
        # A GPU virtual node must fit on one physical node; CPU bundles may be split.
        never = sum(asked) > sum(can_hold) or (
            self.use_gpus and asked[0] > max(can_hold, default=0)
        )
        if self.placement_group_strategy == "STRICT_SPREAD" and not one_node_each:
            never = True
        if never and FAIL_FAST:
            self._refuse(asked, nodes)
        if self.placement_group_strategy == "STRICT_SPREAD":
            return True
        return self.placement_group_strategy == "SPREAD" and one_node_each

    def _refuse(self, asked: list[int], nodes: list[dict]) -> None:
        have = ", ".join(
            f"{n['node']} ({n['CPU']:g} CPU, {n['GPU']:g} GPU: {n['bundles']} bundles)"
            for n in nodes
        )
        how = (
            "each on a node of its own (STRICT_SPREAD)"
            if self.placement_group_strategy == "STRICT_SPREAD"
            else "each within one node"
            if self.use_gpus
            else "in total"
        )
        raise ClusterError(
            f"cluster {self.name!r} can never be placed: it asks for virtual nodes of "
            f"{self.bundle_ct_per_node_list} bundles of {self.resources.as_bundle()} {how}, "
            f"but the Ray cluster has {len(nodes)} alive nodes: {have or 'none'}. Ask for fewer "
            f"or smaller virtual nodes, another placement_group_strategy, or add nodes "
            f"(RL_PLACEMENT_FAIL_FAST=0 waits instead, for clusters that autoscale)."
        )

    def _create_placement_groups(self) -> None:
        bundle = self.resources.as_bundle()
        within_node = "STRICT_PACK" if self.use_gpus else "PACK"
        distinct = self._distinct_nodes() and self.node_count() > 1
        indices = [i for i, n in enumerate(self.bundle_ct_per_node_list) if n > 0]
        if distinct:
            # Largest first: any node that holds the largest remaining virtual node holds the
            # smaller ones too, so taking nodes greedily never strands a big virtual node.
            indices.sort(key=lambda i: -self.bundle_ct_per_node_list[i])
        placed: dict[int, PlacementGroup] = {}
        used_nodes: list[str] = []
        for node_idx in indices:
            count = self.bundle_ct_per_node_list[node_idx]
            # Placing one virtual node at a time lets the next one exclude the nodes taken.
            selector = (
                [{NODE_ID_LABEL_KEY: f"!in({','.join(used_nodes)})"}] * count
                if distinct and used_nodes
                else None
            )
            placed[node_idx] = placement_group(
                [dict(bundle) for _ in range(count)],
                strategy=within_node,
                name=f"{self.name}-node{node_idx}-{os.getpid()}-{id(self):x}",
                bundle_label_selector=selector,
            )
            # In virtual-node order, so shutdown() releases what was made if a wait fails.
            self._placement_groups = [placed[i] for i in sorted(placed)]
            if distinct:
                self._wait_until_placed([placed[node_idx]])
                table = placement_group_table(placed[node_idx])
                used_nodes.extend(set(table["bundles_to_node_id"].values()))
        self._wait_until_placed(list(placed.values()))

    def _wait_until_placed(self, groups: list[PlacementGroup]) -> None:
        _, pending = ray.wait(
            [pg.ready() for pg in groups], num_returns=len(groups), timeout=PLACEMENT_TIMEOUT_S
        )
        if pending:
            needed = {k: v * self.world_size() for k, v in self.resources.as_bundle().items()}
            available = ray.available_resources()
            self.shutdown()
            raise ClusterError(
                f"cluster {self.name!r}: {len(pending)} of {len(groups)} placement groups could "
                f"not be placed within {PLACEMENT_TIMEOUT_S:.0f}s. Bundles per node "
                f"{self.bundle_ct_per_node_list} need {needed} in total; Ray has "
                f"{ {k: v for k, v in available.items() if k in ('CPU', 'GPU')} } free. "
                f"Ask for fewer bundles or add nodes (RL_PLACEMENT_TIMEOUT_S sets the wait)."
            )

    def get_placement_groups(self) -> list[PlacementGroup]:
        """One placement group per virtual node that has at least one bundle."""
        if self._placement_groups is None:
            raise ClusterError(f"cluster {self.name!r} has been shut down")
        return self._placement_groups

    def world_size(self) -> int:
        return sum(self.bundle_ct_per_node_list)

    def node_count(self) -> int:
        return sum(1 for n in self.bundle_ct_per_node_list if n > 0)

    def claim_bundles(self, bundles: list[tuple[int, int]], owner: str) -> None:
        """Record that ``owner`` puts one worker on each ``(placement group, bundle)``.

        Raises ``ClusterError`` if a bundle already holds ``max_colocated_worker_groups``
        workers; nothing is claimed then.
        """
        for key in bundles:
            owners = self._bundle_owners.get(key, [])
            if len(owners) + bundles.count(key) > self.max_colocated_worker_groups:
                raise ClusterError(
                    f"cluster {self.name!r}: bundle {key[1]} of placement group {key[0]} is full "
                    f"(already used by {owners}); max_colocated_worker_groups="
                    f"{self.max_colocated_worker_groups}. Shut a group down or allow more "
                    f"colocated groups."
                )
        for key in bundles:
            self._bundle_owners.setdefault(key, []).append(owner)

    def release_bundles(self, owner: str) -> None:
        for owners in self._bundle_owners.values():
            while owner in owners:
                owners.remove(owner)

    # -- rendezvous --------------------------------------------------------------------------

    def get_master_address_and_port(
        self, placement_group_index: int = 0, bundle_index: int = 0
    ) -> tuple[str, int]:
        """The address of the node holding a bundle, and a port free there that was never
        handed out before.

        A worker group asks for the bundle of its rank 0, which runs the rendezvous
        (``torch.distributed`` ``env://``). Each call gives a new port, so every worker group
        gets its own rendezvous.
        """
        pgs = self.get_placement_groups()
        if not 0 <= placement_group_index < len(pgs):
            raise ValueError(
                f"cluster {self.name!r} has {len(pgs)} placement groups; "
                f"no placement group {placement_group_index}"
            )
        pg = pgs[placement_group_index]
        if not 0 <= bundle_index < pg.bundle_count:
            raise ValueError(
                f"placement group {placement_group_index} has {pg.bundle_count} bundles; "
                f"no bundle {bundle_index}"
            )
        probe = _find_free_port.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle_index
            )
        )
        for _ in range(64):
            address, port = ray.get(probe.remote())
            if (address, port) not in self._used_ports:
                self._used_ports.add((address, port))
                return address, port
        raise ClusterError(f"cluster {self.name!r}: no unused port found after 64 tries")

    # -- teardown ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Release the placement groups (killing nothing else). Safe to call twice."""
        for pg in self._placement_groups or []:
            try:
                remove_placement_group(pg)
            except Exception as err:  # Ray already gone: nothing left to release.
                logger.debug("removing placement group %s failed: %s", pg.id, err)
        self._placement_groups = None

    def __repr__(self) -> str:
        kind = "GPU" if self.use_gpus else "CPU"
        return (
            f"RayVirtualCluster(name={self.name!r}, bundles={self.bundle_ct_per_node_list}, "
            f"{kind}, colocated={self.max_colocated_worker_groups})"
        )


def _ephemeral_ports() -> range:
    """The ports the kernel hands to outgoing connections and to ``bind(0)`` (Linux's
    default where it does not say)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


@ray.remote(num_cpus=0)
def _find_free_port() -> tuple[str, int]:
    """A port free on this node, from below the ephemeral range where there is room.

    A port from ``bind(0)`` is ephemeral: between this probe and the rendezvous binding it
    (seconds, while the workers start), any outgoing connection on the node may be given it,
    and the rendezvous then fails with EADDRINUSE. Ports below that range are never handed
    out that way.
    """
    import random

    ephemeral = _ephemeral_ports()
    # From the OS's randomness: a run's seeding of ``random`` must not make two probes agree.
    candidates = random.SystemRandom().sample(
        range(20000, ephemeral.start), k=min(64, max(0, ephemeral.start - 20000))
    )
    for port in [*candidates, 0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return ray.util.get_node_ip_address(), sock.getsockname()[1]
    raise OSError("no free port on this node")
