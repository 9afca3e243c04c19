"""Streaming a Megatron (tensor, pipeline and expert parallel) policy's weights out under HF
names.

Pure torch, like ``convert``: the tensor-parallel gather is passed in, so the logic runs (and is
tested) without megatron-core.

Each pipeline stage exports its own layers (the first stage also the embedding, the last the
final norm and, unless tied to the embedding, the LM head). Within a stage, one *unit* at a time
(the embedding, one decoder layer, the final norm, the output layer) is gathered from the
tensor-parallel ranks onto tensor-parallel rank 0 (``dist.gather``, never to every rank), put
back together (``convert.tp_whole``) and converted to HF tensors
(``convert.megatron_layer_to_hf``; both follow the family's table, ``family.py``); the HF
tensors are copied into the current bucket and the unit is dropped when the next one is
gathered. A rank so holds at most one bucket plus one
layer, never the model. Only tensor-parallel rank 0 of data-parallel replica 0 of each stage
produces buckets (with expert parallelism: of each of the first ``ep`` replicas, see below); the
other tensor-parallel ranks of those replicas take part in the gathers; other replicas (same
weights) do nothing.

Expert parallelism (a mixture of experts over ``ep`` ranks): the first ``ep`` data-parallel
replicas (expert-parallel ranks 0..ep-1 of the first expert group) hold every expert once
between them, as for ``parallel.gather_hf_state``. Each of them exports the experts it holds,
under their global HF numbers (the family's ``expert_weights``, the renumbering the loader and
``convert.experts_to_global`` use); expert-parallel rank 0 also exports everything that is not
an expert (which every expert-parallel rank holds alike). No tensor crosses the expert group:
a stage has ``ep`` producers, which the refit already merges like the producers of several
stages, and each holds at most its own experts of one layer.

Bucket boundaries are planned over HF tensors from shapes alone (meta tensors run through the
same conversion), so a layer larger than a bucket is spread over several buckets, gathered once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rl_models.megatron.convert import (
    GPTLayout,
    in_first_expert_group,
    megatron_global_to_hf,
    megatron_layer_to_hf,
    stage_layers,
    tp_whole,
)
from rl_models.megatron.family import MEGATRON_EXPERTS, MEGATRON_LAYERS
from rl_models.policy.weight_export import Packer
from rl_models.weight_transfer.buckets import ExportPlan, TensorSpec, pack_planned, plan_buckets

#: Gathers this rank's tensor over the tensor-parallel group: the list of every rank's part on
#: the destination rank (tensor-parallel rank 0), None elsewhere.
TpGather = Callable[[torch.Tensor], "list[torch.Tensor] | None"]


@dataclass(frozen=True)
class _Unit:
    local_names: tuple[str, ...]  # this rank's GPTModel state-dict keys it is made of
    layer: int | None  # global decoder layer number (None: embedding / norm / output layer)


class MegatronWeightExporter:
    """One rank's part in exporting the model it holds a piece of (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        layout: GPTLayout,
        *,
        tp: int,
        tp_rank: int,
        pp: int,
        pp_rank: int,
        dp_rank: int,
        gather: TpGather,
        ep: int = 1,
        ep_rank: int = 0,
    ) -> None:
        """``ep``/``ep_rank``: the expert-parallel size and this rank's place in its expert
        group (``convert.in_first_expert_group``: replica ``dp_rank < ep`` is expert-parallel
        rank ``dp_rank`` of the first group)."""
        self.model, self.layout, self.tp, self.gather = model, layout, tp, gather
        self.ep, self.ep_rank = ep, ep_rank
        # The first expert group holds each weight once; later groups are copies of it.
        self.active = in_first_expert_group(dp_rank, ep)
        self.producer = self.active and tp_rank == 0
        # Every expert-parallel rank holds the weights outside the experts: rank 0 sends them.
        self.dense = ep_rank == 0
        self.layers = stage_layers(layout.num_layers, pp, pp_rank)
        self.first, self.last = pp_rank == 0, pp_rank == pp - 1
        self._plan: list[list[TensorSpec]] | None = None
        self._owner: dict[str, _Unit] = {}  # HF name -> the unit that makes it
        self._cached: tuple[_Unit, dict[str, torch.Tensor]] | None = None
        self._dtype: torch.dtype | None = None
        self.peak_held_bytes = 0  # largest converted unit held at once (bytes)

    def _local(self) -> dict[str, torch.Tensor]:
        state = self.model.state_dict()
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}

    def _units(self, local: Mapping[str, torch.Tensor]) -> list[_Unit]:
        fam = self.layout.family
        units = []
        if self.first and self.dense:
            units.append(_Unit((fam.embedding.megatron,), None))
        for j, i in enumerate(self.layers):
            prefix = f"{MEGATRON_LAYERS}{j}."
            own = prefix if self.dense else prefix + MEGATRON_EXPERTS
            names = tuple(k for k in local if k.startswith(own) and not k.endswith("_extra_state"))
            if names:
                units.append(_Unit(names, i))
        if self.last and self.dense:
            units.append(_Unit((fam.final_norm.megatron,), None))
            if not self.layout.tied_embeddings:
                units.append(_Unit((fam.output_layer.megatron,), None))
        return units

    def _convert(self, unit: _Unit, whole: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF tensors of ``unit`` from its whole (tensor-parallel merged) Megatron tensors."""
        if unit.layer is None:
            (name,) = unit.local_names
            return megatron_global_to_hf(name, whole[name], self.layout)
        offset = self.layers.start

        def take(name: str) -> torch.Tensor:
            index, rest = name[len(MEGATRON_LAYERS) :].split(".", 1)
            local = f"{MEGATRON_LAYERS}{int(index) - offset}.{rest}"
            if local not in whole:
                raise KeyError(f"pipeline stage holding layers {self.layers} has no {local!r}")
            return whole[local]

        fam, ep, ep_rank = self.layout.family, self.ep, self.ep_rank
        rows = fam.layer_weights if self.dense else fam.expert_weights
        return megatron_layer_to_hf(take, unit.layer, self.layout, rows(self.layout, ep, ep_rank))

    def plan(
        self, bucket_bytes: int, dtype: str | None = None, lora_export: str = "merged"
    ) -> ExportPlan:
        if lora_export != "merged":
            raise ValueError(f"the Megatron backend has no LoRA to export ({lora_export!r})")
        if not self.active:
            self._plan = []
            return ExportPlan(steps=0, producer=False)
        self._dtype = getattr(torch, dtype) if dtype else None
        local = self._local()
        specs, self._owner = [], {}
        for unit in self._units(local):
            meta = {
                n: tp_whole(n, [torch.empty_like(local[n], device="meta")] * self.tp, self.layout)
                for n in unit.local_names
            }
            for hf_name, t in self._convert(unit, meta).items():
                out_dtype = str(self._dtype or t.dtype).removeprefix("torch.")
                specs.append(TensorSpec(hf_name, out_dtype, tuple(t.shape)))
                self._owner[hf_name] = unit
        self._plan = plan_buckets(specs, bucket_bytes)
        if not self.producer:
            return ExportPlan(steps=len(self._plan), producer=False)
        nbytes = sum(s.nbytes for s in specs)
        return ExportPlan(len(self._plan), True, nbytes, tuple(tuple(b) for b in self._plan))

    def _gathered(self, unit: _Unit) -> dict[str, torch.Tensor]:
        """HF tensors of ``unit`` on the producer (empty elsewhere); the last unit is kept."""
        if self._cached is not None and self._cached[0] == unit:
            return self._cached[1]
        self._cached = None  # free the previous unit before gathering the next
        local = self._local()
        parts = {n: self.gather(local[n].detach().contiguous()) for n in unit.local_names}
        converted: dict[str, torch.Tensor] = {}
        if self.producer:
            whole = {n: tp_whole(n, p, self.layout) for n, p in parts.items()}
            converted = self._convert(unit, whole)
            if self._dtype is not None:
                converted = {k: v.to(self._dtype) for k, v in converted.items()}
            held = sum(t.numel() * t.element_size() for t in converted.values())
            self.peak_held_bytes = max(self.peak_held_bytes, held)
        self._cached = (unit, converted)
        return converted

    def _tensors(self, specs: list[TensorSpec]) -> Iterator[torch.Tensor]:
        for spec in specs:
            yield self._gathered(self._owner[spec.name])[spec.name]

    def bucket(self, step: int, pack: Packer = pack_planned) -> Any:
        """Step ``step``'s bucket, made by ``pack(specs, tensors)`` (producer; else None)."""
        if self._plan is None:
            raise RuntimeError("export_weight_bucket before weight_export_plan")
        if step >= len(self._plan):
            return None
        specs = self._plan[step]
        with torch.no_grad():
            if self.producer:
                return pack(specs, self._tensors(specs))
            for spec in specs:  # take part in the gathers
                self._gathered(self._owner[spec.name])
        return None

    def finish(self) -> dict[str, int]:
        self._plan, self._cached = None, None
        return {"peak_held_bytes": self.peak_held_bytes}


def tp_gather_to(group, dst: int, tp: int) -> TpGather:
    """A ``TpGather`` over ``group`` onto global rank ``dst`` (``torch.distributed.gather``)."""
    import torch.distributed as dist

    def gather(t: torch.Tensor) -> list[torch.Tensor] | None:
        if tp == 1:
            return [t]
        here = dist.get_rank() == dst
        parts = [torch.empty_like(t) for _ in range(tp)] if here else None
        dist.gather(t, parts, dst=dst, group=group)
        return parts

    return gather
