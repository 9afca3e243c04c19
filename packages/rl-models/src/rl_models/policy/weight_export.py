"""Streaming a DTensor/FSDP2 policy's weights out as HF-named full tensors, bucket by bucket.

The plan (names, full shapes, dtypes) comes from the sharded parameters' metadata, with no
communication. Each export step then gathers the full tensors of one bucket, one parameter at a
time (``DTensor.full_tensor()``, an all-gather every rank takes part in), and rank 0 copies
each into the bucket's buffer before the next is gathered: a rank never holds more than one
bucket plus one full parameter, whatever the model's size.

LoRA (peft) models export, by the plan's ``lora_export`` (``lora.LoraExport``): the merged
weights ``W + scaling * B @ A`` under the plain HF names (``lora.merged_state_dict`` applied to
one adapted layer at a time), for a generator with no adapter support; or the adapters alone
(bytes proportional to the rank), or once, for a generator that just added adapters, the
unmerged base layers with them. Tied weights (embedding and LM head) are one parameter and are exported once,
under the first name (``model.embed_tokens.weight``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rl_models.modeling import lora
from rl_models.weight_transfer.buckets import ExportPlan, TensorSpec, pack_planned, plan_buckets

_PEFT_PREFIX = "base_model.model."

#: Makes one bucket from its planned specs and the full tensors (as they are gathered).
Packer = Callable[[list[TensorSpec], Iterator[torch.Tensor]], Any]


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a collective all-gather for a DTensor, the tensor itself otherwise."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _own_rows(t: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    """For a DTensor sharded by rows over a 1-D mesh (FSDP2's ``Shard(0)``): the first row this
    rank holds and its local rows; None for any other tensor (it must be gathered).

    ``Shard(0)`` splits like ``torch.chunk``: rank r holds rows ``[r*c, min((r+1)*c, n))`` with
    ``c = ceil(n / world)`` (possibly none). The decision depends only on placements and shapes,
    which every rank shares, so all ranks take the same path (collectives stay matched).
    """
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor) or t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        return None
    n, world = t.shape[0], t.device_mesh.size()
    chunk = -(-n // world)
    first = min(t.device_mesh.get_local_rank() * chunk, n)
    local = t.to_local()
    if tuple(local.shape) != (min(chunk, n - first), *t.shape[1:]):
        raise RuntimeError(
            f"a Shard(0) parameter of shape {tuple(t.shape)} has a local shard of shape "
            f"{tuple(local.shape)} on this rank; expected rows {first}..{first + chunk}"
        )
    return first, local


@dataclass(frozen=True)
class _Unit:
    """One exported tensor and the (possibly sharded) live tensors it is made of."""

    spec: TensorSpec
    sources: tuple[str, ...]  # state-dict keys: one, or W, A, B of a LoRA layer
    module: str = ""  # peft module name (LoRA units only), for its scaling


class DTensorWeightExporter:
    """Plans and produces the buckets of one rank's model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, lora_enabled: bool, rank: int) -> None:
        self.model = model
        self.lora_enabled = lora_enabled
        self.producer = rank == 0
        self._plan: list[list[_Unit]] | None = None
        self._dtype: torch.dtype | None = None
        self.peak_held_bytes = 0  # largest number of bytes of full tensors held at once

    def _live(self) -> dict[str, torch.Tensor]:
        """State-dict entries (parameters kept as objects, so tied ones dedupe by identity)."""
        seen: set[int] = set()
        out = {}
        for name, value in self.model.state_dict(keep_vars=True).items():
            if id(value) in seen:
                continue
            seen.add(id(value))
            out[name] = value
        return out

    def _model_state(self) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The live state-dict entries and the LoRA scalings (none without LoRA)."""
        return self._live(), lora.lora_scalings(self.model) if self.lora_enabled else {}

    def _units(self, dtype: torch.dtype | None, lora_export: lora.LoraExport) -> list[_Unit]:
        if lora_export != "merged" and not self.lora_enabled:
            raise ValueError(f"lora_export={lora_export!r} needs a policy with lora.enabled")
        merge = self.lora_enabled and lora_export == "merged"
        live = self._live()
        units = []
        for key, value in live.items():
            adapter = lora.is_adapter_key(key)
            if (merge and adapter) or (lora_export == "adapters" and not adapter):
                continue  # merged into its base layer's unit, or not sent at all
            name = key.removeprefix(_PEFT_PREFIX) if self.lora_enabled else key
            out_dtype = str(dtype or value.dtype).removeprefix("torch.")
            module, _, leaf = key.rpartition(".")
            if merge and module.endswith(".base_layer") and leaf == "weight":
                adapted = module.removesuffix(".base_layer")
                a = f"{adapted}.lora_A.{lora.ADAPTER_NAME}.weight"
                b = f"{adapted}.lora_B.{lora.ADAPTER_NAME}.weight"
                spec = TensorSpec(name.replace(".base_layer.", "."), out_dtype, tuple(value.shape))
                units.append(_Unit(spec, (key, a, b), adapted))
            else:
                units.append(_Unit(TensorSpec(name, out_dtype, tuple(value.shape)), (key,)))
        return units

    def plan(
        self, bucket_bytes: int, dtype: str | None = None, lora_export: lora.LoraExport = "merged"
    ) -> ExportPlan:
        self._dtype = getattr(torch, dtype) if dtype else None
        units = self._units(self._dtype, lora_export)
        by_name = {u.spec.name: u for u in units}
        specs = plan_buckets([u.spec for u in units], bucket_bytes)
        self._plan = [[by_name[s.name] for s in bucket] for bucket in specs]
        self.peak_held_bytes = 0
        if not self.producer:
            return ExportPlan(steps=len(specs), producer=False)
        nbytes = sum(s.nbytes for bucket in specs for s in bucket)
        return ExportPlan(len(specs), True, nbytes, tuple(tuple(b) for b in specs))

    def _tensors(
        self, units: list[_Unit], model_state: tuple[dict, dict] | None = None
    ) -> Iterator[torch.Tensor]:
        """The full tensors of ``units``; ``model_state`` is ``_model_state()``, looked up once
        by a caller that calls this per tensor (a state_dict walk costs ~0.5 ms)."""
        live, scalings = model_state or self._model_state()
        for unit in units:
            if len(unit.sources) == 1:
                full = _full(live[unit.sources[0]].detach())
            else:
                w, a, b = (_full(live[k].detach()) for k in unit.sources)
                mini = {unit.sources[0]: w, unit.sources[1]: a, unit.sources[2]: b}
                (full,) = lora.merged_state_dict(
                    mini, {unit.module: scalings[unit.module]}
                ).values()
            full = full.to(self._dtype) if self._dtype else full
            self.peak_held_bytes = max(self.peak_held_bytes, full.numel() * full.element_size())
            yield full

    def bucket(self, step: int, pack: Packer = pack_planned) -> Any:
        """Step ``step``'s bucket, made by ``pack(specs, tensors)`` (producer; else None)."""
        if self._plan is None:
            raise RuntimeError("export_weight_bucket before weight_export_plan")
        units = self._plan[step]
        with torch.no_grad():
            if self.producer:
                return pack([u.spec for u in units], self._tensors(units))
            for _ in self._tensors(units):  # take part in the all-gathers, keep nothing
                pass
        return None

    def write_region(self, views: Mapping[str, torch.Tensor], dtype: str | None = None) -> int:
        """Shared-memory channel: write every exported tensor into its view of the weight
        region (``weight_transfer.shared_memory``); returns the bytes this rank wrote.

        A row-sharded (FSDP2) parameter is written by every rank, each its own rows, with no
        communication; anything else (a LoRA merge, other placements) is gathered as for a
        bucket and written by the producer. Called on every rank.
        """
        self._dtype = getattr(torch, dtype) if dtype else None
        self.peak_held_bytes = 0
        units = self._units(self._dtype, "merged")
        for unit in units:
            view = views.get(unit.spec.name)
            if view is None or tuple(view.shape) != unit.spec.shape:
                raise ValueError(
                    f"the weight region has no slot for {unit.spec.name!r} of shape "
                    f"{unit.spec.shape} (it was laid out for another model)"
                )
        model_state = self._model_state()
        live = model_state[0]
        written = 0
        with torch.no_grad():
            for unit in units:
                view = views[unit.spec.name]
                own = _own_rows(live[unit.sources[0]]) if len(unit.sources) == 1 else None
                if own is not None:
                    first, local = own
                    view[first : first + local.shape[0]].copy_(local.detach())
                    written += local.numel() * view.element_size()
                    continue
                (full,) = self._tensors([unit], model_state)  # a collective on every rank
                if self.producer:
                    view.copy_(full)
                    written += view.numel() * view.element_size()
        return written

    def finish(self) -> dict[str, int]:
        self._plan = None
        return {"peak_held_bytes": self.peak_held_bytes}


@contextlib.contextmanager
def _copy_threads() -> Iterator[None]:
    """Intra-op threads for a refit's copies: this rank's share of the node's cores.

    A Ray worker runs torch with as many threads as CPUs it reserved (often 1), but a refit is
    a memory-bound copy during which the policy does not train and the generator does not
    sample, so the ranks on a node split its cores between them (``LOCAL_WORLD_SIZE``).
    """
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = max(1, (cores or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    torch.set_num_threads(max(before, share))
    try:
        yield
    finally:
        torch.set_num_threads(before)


class WeightExportMethods:
    """The ``WeightExportWorker`` methods of a policy worker, for every channel.

    The worker supplies ``_weight_exporter()`` (its backend's exporter) and ``device``.
    """

    device: torch.device
    _exporter: Any = None
    _ipc_buffers: Any = None  # the last IPC buffers, alive while consumers may read them
    _channel: Any = None
    _regions: dict[str, Any] | None = None  # shared-memory weight regions mapped, by path

    def _weight_exporter(self) -> Any:
        raise NotImplementedError

    def weight_export_plan(
        self, bucket_bytes: int, dtype: str | None = None, lora_export: lora.LoraExport = "merged"
    ) -> ExportPlan:
        """Start an export of the weights in buckets (``generation.interfaces``); a LoRA
        policy exports what ``lora_export`` selects (``lora.LoraExport``)."""
        self._exporter = self._weight_exporter()
        return self._exporter.plan(bucket_bytes, dtype, lora_export)

    def export_weight_bucket(self, step: int) -> Any:
        """Object-store channel: a ``PackedBucket`` (numpy) on producers, None elsewhere."""
        return self._exporter.bucket(step)

    def export_weight_bucket_ipc(self, step: int) -> Any:
        """CUDA IPC channel: an ``IpcBucket`` handle to a device buffer (kept alive for two
        steps, the refit pipeline's depth) on producers, None elsewhere."""
        from collections import deque

        from rl_models.weight_transfer.channels import pack_into_tensor, share_buffer

        if self._ipc_buffers is None:
            self._ipc_buffers = deque(maxlen=2)

        def pack(specs, tensors):
            slots, buffer = pack_into_tensor(specs, tensors, self.device, shared=True)
            if buffer.is_cuda:
                torch.cuda.synchronize(buffer.device)  # written before anyone reads it
            self._ipc_buffers.append(buffer)
            return share_buffer(slots, buffer)

        return self._exporter.bucket(step, pack)

    def init_weight_broadcast(self, host: str, port: int, world: int, backend: str) -> None:
        """Broadcast channel: a producer opens its own as rank 0 (called on producers only)."""
        from rl_models.weight_transfer.channels import BroadcastChannel

        if self._exporter is None or not self._exporter.producer:
            return
        self._channel = BroadcastChannel(host, port, 0, world, backend)

    def export_weight_bucket_broadcast(self, step: int) -> None:
        """Broadcast channel: producers pack the bucket on the device and broadcast it."""
        from rl_models.weight_transfer.channels import pack_into_tensor

        def pack(specs, tensors):
            _, buffer = pack_into_tensor(specs, tensors, self.device)
            self._channel.broadcast(buffer)

        self._exporter.bucket(step, pack)

    def map_weight_region(self, path: str, layout: Any) -> None:
        """Shared-memory channel: map the weight region at ``path`` (a ``shared_memory``
        ``RegionLayout``) and keep the mapping, which outlives the file's name: ``refit`` has
        the file removed as soon as every process has mapped it."""
        from rl_models.weight_transfer.shared_memory import MappedRegion

        if self._regions is None:
            self._regions = {}
        region = self._regions.get(path)
        if region is None or region.digest != layout.digest:
            self._regions.pop(path, None)  # unmap an old layout before mapping the new one
            self._regions[path] = MappedRegion(path, layout)

    def release_weight_region(self, path: str) -> None:
        """Drop this rank's mapping of the region at ``path`` (its memory goes with the last)."""
        (self._regions or {}).pop(path, None)

    def write_weights_to_region(
        self, path: str, layout: Any, bucket_bytes: int, dtype: str | None = None
    ) -> dict[str, int]:
        """Shared-memory channel: write this rank's part of the weights straight into the weight
        region at ``path`` (laid out by ``layout``, a ``shared_memory.RegionLayout``).

        The region is mapped on first use (``map_weight_region``) and the mapping kept for the
        next refits. An exporter with ``write_region`` (DTensor) writes row shards in parallel;
        any other (Megatron) runs its bucket export and writes each gathered tensor into its
        slot instead of a bucket.
        """
        region = (self._regions or {}).get(path)
        if region is None or region.digest != layout.digest:
            if not os.path.exists(path):
                raise FileNotFoundError(
                    f"weight region {path} is not mapped by this policy rank and its file is "
                    "gone (refit removes it once every worker has mapped it; this rank must "
                    "map_weight_region before that)"
                )
            self.map_weight_region(path, layout)
            region = self._regions[path]
        with _copy_threads():
            return self._write_region(region, bucket_bytes, dtype)

    def _write_region(self, region: Any, bucket_bytes: int, dtype: str | None) -> dict[str, int]:
        exporter = self._weight_exporter()
        if hasattr(exporter, "write_region"):
            written = exporter.write_region(region.views, dtype)
            return {"bytes_written": written, **exporter.finish()}
        written = 0

        def write(specs, tensors):
            nonlocal written
            for spec, tensor in zip(specs, tensors, strict=True):
                view = region.views.get(spec.name)
                if view is None or tuple(view.shape) != spec.shape:
                    raise ValueError(f"the weight region has no slot for {spec.name!r}")
                view.copy_(tensor)
                written += view.numel() * view.element_size()

        for step in range(exporter.plan(bucket_bytes, dtype).steps):
            exporter.bucket(step, write)
        return {"bytes_written": written, **exporter.finish()}

    def finish_weight_export(self) -> dict[str, int]:
        stats = self._exporter.finish()
        self._exporter, self._ipc_buffers, self._channel = None, None, None
        return stats
