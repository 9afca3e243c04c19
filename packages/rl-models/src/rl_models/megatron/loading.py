"""Filling one rank's Megatron ``GPTModel`` shard without any rank holding the whole model.

``convert.py`` turns a whole HF state dict into a whole Megatron one and then cuts it
(``shard_megatron``); that needs every weight in memory on every rank. Here the cut comes
first: ``shard_plan`` lists, for the rank at ``(tp_rank, pp_rank)``, each tensor of its
``GPTModel`` and the chunks of the HF tensors it is made of, read off the family's table
(``family.py``): a rank's piece of a fused tensor is the fusion of the matching *chunks* of the
HF tensors (whole key/value groups; one tensor-parallel chunk of gate and of up).

Two sources fill the plan, both handing each finished piece to ``emit`` at once (the caller
copies it into the model and drops it), so at most one piece and its parts are held besides
the model:

* ``load_from_safetensors``: each part is read with ``safe_open(...).get_slice``, so only the
  rank's rows/columns are ever read from disk (counted in ``LoadStats.bytes_read``);
* ``load_from_fresh_init``: the HF model is built on the ``meta`` device and initialised one
  module at a time from the seed (``init_weights_by_module``, exactly as the DTensor worker
  does), each module's full tensors living only until the rank's slices are cut from them.

Pure torch (no megatron import): testable wherever torch is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from rl_models.megatron.convert import GPTLayout, stage_layers
from rl_models.megatron.family import MEGATRON_LAYERS, REPLICATED, Rule, Weight, chunk_bounds

#: Receives each finished piece: its name in this rank's ``GPTModel`` and the tensor.
Emit = Callable[[str, torch.Tensor], None]


@dataclass(frozen=True)
class Part:
    """Chunk ``index`` of ``count`` along ``dim`` of the HF tensor ``name`` (``torch.chunk``'s
    split; ``dim`` None: all of it)."""

    name: str
    dim: int | None = None
    index: int = 0
    count: int = 1

    def slices(self, shape: tuple[int, ...] | list[int]) -> tuple[slice, ...]:
        """The index of the part in a tensor of ``shape``."""
        if self.dim is None:
            return (slice(None),)
        lo, hi = chunk_bounds(shape[self.dim], self.count, self.index)
        return (slice(None),) * self.dim + (slice(lo, hi),)

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.dim is None else tensor[self.slices(tensor.shape)]


@dataclass(frozen=True)
class Piece:
    """One tensor of the rank's ``GPTModel`` and how to make it from HF parts: ``rule.fuse``
    of the parts (under the rank's head counts), then ``pad_rows`` zero rows (the vocabulary
    rounded up to a multiple of tp)."""

    name: str
    parts: tuple[Part, ...]
    rule: Rule = REPLICATED
    pad_rows: int = 0


@dataclass
class LoadStats:
    """What filling a shard cost: counted, not timed."""

    #: bytes of HF tensor data read from files (safetensors source).
    bytes_read: int = 0
    #: bytes of full HF tensors materialised (fresh-init source: one module at a time).
    bytes_initialised: int = 0
    #: fresh-init source: the most bytes of HF tensor storage the loader held at once (the
    #: full tensor being cut, plus the parts kept for pieces not yet complete; a part that is a
    #: view counts the whole tensor it keeps alive).
    peak_full_bytes: int = 0
    #: bytes of the pieces handed to the model.
    bytes_emitted: int = 0
    pieces: int = 0
    names_read: list[str] = field(default_factory=list)


def shard_plan(
    layout: GPTLayout,
    *,
    vocab_size: int,
    tp: int = 1,
    tp_rank: int = 0,
    pp: int = 1,
    pp_rank: int = 0,
    ep: int = 1,
    ep_rank: int = 0,
) -> list[Piece]:
    """Every tensor of the ``GPTModel`` at ``(tp_rank, pp_rank, ep_rank)`` and its HF parts
    (only the experts of expert-parallel rank ``ep_rank``).

    Names and contents equal ``shard_megatron(hf_to_megatron(hf), layout, ...)`` exactly.
    """
    layout.check_tp(tp)
    fam = layout.family

    def piece(name: str, w: Weight, prefix: str = "", hf: tuple[str, ...] | None = None):
        dim = w.rule.dim
        parts = tuple(Part(prefix + n, dim, tp_rank, tp) for n in hf or w.hf)
        return Piece(name, parts, w.rule, w.rule.pad_rows(vocab_size, tp, tp_rank))

    first, last = pp_rank == 0, pp_rank == pp - 1
    plan: list[Piece] = []
    if first:
        plan.append(piece(fam.embedding.megatron, fam.embedding))
    for local, i in enumerate(stage_layers(layout.num_layers, pp, pp_rank)):
        for w in fam.layer_weights(layout, ep, ep_rank):
            plan.append(piece(f"{MEGATRON_LAYERS}{local}.{w.megatron}", w, fam.hf_layer(i)))
    if last:
        plan.append(piece(fam.final_norm.megatron, fam.final_norm))
        out = fam.output_layer
        if not layout.tied_embeddings:
            plan.append(piece(out.megatron, out))
        elif not first:  # the last stage's own copy of the tied embedding
            plan.append(piece(out.megatron, out, hf=fam.embedding.hf))
    return plan


def build_piece(piece: Piece, tensors: list[torch.Tensor], local: GPTLayout) -> torch.Tensor:
    """The piece from its parts' tensors (in ``piece.parts`` order); ``local``: the rank's
    head counts (``GPTLayout.per_rank``)."""
    tensor = piece.rule.fuse(tensors, local)
    if piece.pad_rows:
        tensor = torch.cat([tensor, tensor.new_zeros(piece.pad_rows, *tensor.shape[1:])])
    return tensor.contiguous()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view keeps its whole base)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


class _SafetensorsFiles:
    """Name -> open ``safe_open`` handle over a model directory's safetensors files."""

    def __init__(self, path: str, stack: ExitStack) -> None:
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                where = json.load(f)["weight_map"]
            files = sorted(set(where.values()))
        else:
            files = [f for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
            if not files:
                raise FileNotFoundError(f"{path}: no *.safetensors files")
            where = {}
        self.path = path
        self.handles = {}
        for name in files:
            handle = stack.enter_context(safe_open(os.path.join(path, name), framework="pt"))
            self.handles[name] = handle
            for key in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                where.setdefault(key, name)
        self.where = where

    def read(self, part: Part, stats: LoadStats) -> torch.Tensor:
        if part.name not in self.where:
            raise KeyError(f"{self.path}: the safetensors files have no weight {part.name!r}")
        sliced = self.handles[self.where[part.name]].get_slice(part.name)
        tensor = sliced[part.slices(sliced.get_shape())]
        stats.bytes_read += _nbytes(tensor)
        stats.names_read.append(part.name)
        return tensor


def load_from_safetensors(
    path: str,
    plan: Iterable[Piece],
    layout: GPTLayout,
    tp: int,
    dtype: torch.dtype,
    emit: Emit,
) -> LoadStats:
    """Read each piece's parts (slices only) from the files in ``path`` and ``emit`` it."""
    stats = LoadStats()
    local = layout.per_rank(tp)
    with ExitStack() as stack:
        files = _SafetensorsFiles(path, stack)
        for piece in plan:
            tensors = [files.read(p, stats).to(dtype) for p in piece.parts]
            _emit(piece, build_piece(piece, tensors, local), emit, stats)
    return stats


def _emit(piece: Piece, tensor: torch.Tensor, emit: Emit, stats: LoadStats) -> None:
    stats.bytes_emitted += _nbytes(tensor)
    stats.pieces += 1
    emit(piece.name, tensor)


def load_from_fresh_init(
    hf_model_on_meta: torch.nn.Module,
    seed: int,
    plan: Iterable[Piece],
    layout: GPTLayout,
    tp: int,
    emit: Emit,
) -> LoadStats:
    """The pieces of a freshly initialised HF model, without materialising all of it.

    ``hf_model_on_meta``: the HF model built on the ``meta`` device (weights tied). Its
    Hugging Face initialisation runs module by module from ``seed`` (``init_weights_by_module``,
    the same numbers the DTensor worker draws); a tensor is final once the last module holding
    it (a tied weight has two) has been initialised, and only then are the rank's slices cut.
    Each piece is emitted as soon as all its parts exist.
    """
    from rl_models.modeling.build import init_weights_by_module

    stats = LoadStats()
    local = layout.per_rank(tp)
    pending = list(plan)
    wanted: dict[str, list[Part]] = {}
    for piece in pending:
        for part in piece.parts:
            wanted.setdefault(part.name, []).append(part)
    names_of: dict[int, list[str]] = {}
    for name, param in hf_model_on_meta.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    holders_left = {key: len(names) for key, names in names_of.items()}
    have: dict[Part, torch.Tensor] = {}

    def on_init(real: torch.Tensor, full: torch.Tensor) -> None:
        key = id(real)
        if key not in holders_left:
            return  # a buffer (rotary frequencies): not a weight
        stats.bytes_initialised += _nbytes(full)
        holders_left[key] -= 1
        if holders_left[key]:
            return  # a tied weight: the last module to initialise it decides its value
        for name in names_of[key]:
            for part in wanted.get(name, ()):
                cut = part.of(full)
                # A slice is copied so the full temporary can go; the whole tensor is kept.
                have[part] = cut if cut.numel() == full.numel() else cut.clone()
        held = _storage_bytes([full, *have.values()])
        stats.peak_full_bytes = max(stats.peak_full_bytes, held)
        for piece in [p for p in pending if all(part in have for part in p.parts)]:
            pending.remove(piece)
            tensors = [have[part] for part in piece.parts]
            _emit(piece, build_piece(piece, tensors, local), emit, stats)
        still_needed = {part for p in pending for part in p.parts}
        for part in [p for p in have if p not in still_needed]:
            del have[part]

    init_weights_by_module(hf_model_on_meta, seed, on_init=on_init)
    if pending:
        raise RuntimeError(f"no initialised weights for {[p.name for p in pending][:8]}")
    return stats
