"""Where a weight named as in the checkpoint lives in a ``transformers`` model's memory.

Why: a policy may export weights under their *checkpoint* names (one tensor per expert and
projection, ``model.layers.0.mlp.experts.3.gate_proj.weight``: the Megatron backend, as
``save_pretrained`` writes them and vLLM loads them), while transformers 5 keeps a mixture of
experts *fused* in memory (``mlp.experts.gate_up_proj`` ``[experts, 2 * inter, hidden]``, gate
rows first, and ``mlp.experts.down_proj``). A generator holding the in-memory model must write
such a tensor into its slice of the fused parameter.

The conversion is transformers' own: the table ``from_pretrained`` loads checkpoints with
(``conversion_mapping.get_model_conversion_mapping``; for Qwen3-MoE and its ~30 relatives,
``MergeModulelist(dim=0)`` stacks the experts, then ``Concatenate(dim=1)`` joins gate and up in
the order of the converter's source patterns). ``rename_source_key`` maps a checkpoint name to
its parameter and the source pattern it matched; the operations are written for whole
collections of tensors, so for one tensor their effect is read off here: the expert number
selects along the merge dimension, the pattern's place among the converter's sources picks its
equal chunk along the concatenation dimension. A converter with any other operation is refused
by name (``UnsupportedCheckpointName``) rather than guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


class UnsupportedCheckpointName(ValueError):
    """A checkpoint name whose conversion to the in-memory model is not a plain slice."""


@dataclass(frozen=True)
class ParameterSlice:
    """A checkpoint tensor's place: ``view``, a view of parameter ``param`` (``whole``).

    ``part`` is which piece of a fused parameter the view is, ``(expert, chunk)`` of
    ``parts`` ``(experts, chunks)``: the pieces of one parameter are disjoint and together
    the whole of it (``FusedCoverage`` counts them). None: the view is the whole parameter.
    """

    param: str
    whole: torch.Tensor
    view: torch.Tensor
    part: tuple[int, int] | None = None
    parts: tuple[int, int] = (1, 1)

    @property
    def contiguous_bytes(self) -> tuple[int, int] | None:
        """``(offset, nbytes)`` of the view within its parameter's bytes when it is one
        contiguous run of them (it can then live in a flat buffer); else None."""
        if not (self.view.is_contiguous() and self.whole.is_contiguous()):
            return None
        size = self.view.element_size()
        start = self.view.storage_offset() - self.whole.storage_offset()
        return start * size, self.view.numel() * size


class CheckpointViews:
    """Views of ``model``'s parameters by checkpoint name (in-memory names map to themselves).

    ``slice(name)`` is the ``ParameterSlice`` a tensor sent under ``name`` is written into, or
    None when the model has no such weight. A checkpoint name that transformers only renames
    (Mixtral's ``block_sparse_moe.gate`` is ``mlp.gate`` in memory) is the whole renamed
    parameter; one a converter fuses is its slice of the fused parameter. Parameters are looked up when asked, so views taken
    after the model's parameters were re-pointed (``param.data = ...``) see the new memory.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self._renamings, self._converters = _conversions(model)
        self._by_pattern = {p: c for c in self._converters for p in c.source_patterns}

    def refresh(self) -> None:
        """Look the parameters up again (after modules were replaced, e.g. LoRA layers)."""
        self.params = dict(self.model.named_parameters(remove_duplicate=False))

    def slice(self, name: str) -> ParameterSlice | None:
        param = self.params.get(name)
        if param is not None:
            return ParameterSlice(name, param.data, param.data)
        if not (self._renamings or self._converters):
            return None
        from transformers.core_model_loading import rename_source_key

        target, pattern = rename_source_key(name, self._renamings, self._converters)
        param = self.params.get(target)
        if param is None:
            return None
        if pattern is None:  # renamed only: the checkpoint tensor is the whole parameter
            return ParameterSlice(target, param.data, param.data)
        return _slice_of(self._by_pattern[pattern], pattern, name, target, param)


class FusedCoverage:
    """Which parts of each fused parameter a set of checkpoint tensors writes.

    Why: a refit (or a shared region's layout) that writes some experts of a fused parameter
    must write all of them, or the rest stay stale without anyone noticing; and a layout must
    hold each part once. Parts are counted, not bytes: one part twice and another never sum
    to the right size. The parts of ``CheckpointViews`` partition their parameter, so a part
    written once each, or the parameter written whole, is every element written once.
    """

    def __init__(self) -> None:
        # parameter -> part (None: the whole parameter) -> the first name that wrote it
        self._written: dict[str, dict[tuple[int, int] | None, str]] = {}
        self._parts: dict[str, tuple[int, int]] = {}

    def add(self, name: str, target: ParameterSlice) -> str | None:
        """Record that tensor ``name`` writes ``target``. Returns the name of an earlier tensor
        that wrote some of the same elements (the same part, or the whole parameter and a
        part of it), else None."""
        written = self._written.setdefault(target.param, {})
        if target.part is None:
            earlier = next(iter(written.values()), None)
        else:
            self._parts[target.param] = target.parts
            earlier = written.get(target.part, written.get(None))
        written.setdefault(target.part, name)
        return earlier

    def gaps(self) -> list[str]:
        """One line for each fused parameter written in part only, naming the parts that
        were not written as ``(expert, chunk)`` (a chunk: gate or up of a gate_up_proj)."""
        lines = []
        for param, written in self._written.items():
            if None in written:  # written whole (or not fused at all)
                continue
            experts, chunks = self._parts[param]
            missing = [
                (e, c) for e in range(experts) for c in range(chunks) if (e, c) not in written
            ]
            if missing:
                shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
                lines.append(
                    f"{param!r} ({experts} experts x {chunks} chunks): {len(missing)} parts "
                    f"not written, (expert, chunk) {shown}; written e.g. "
                    f"{next(iter(written.values()))!r}"
                )
        return lines


def _conversions(model: torch.nn.Module) -> tuple[list, list]:
    """The renamings and converters transformers loads ``model``'s checkpoints with."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # a transformers without conversion tables: names are what they are
        return [], []
    if not isinstance(model, PreTrainedModel):
        return [], []
    transforms = get_model_conversion_mapping(model, add_legacy=False)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renamings, converters


def _slice_of(
    converter, pattern: str, name: str, target: str, param: torch.Tensor
) -> ParameterSlice:
    """The part of fused parameter ``target`` that checkpoint tensor ``name`` (matched by
    ``pattern`` of ``converter``) becomes: expert ``e``'s chunk ``c`` of the concatenation (0
    of 1 without one), so that the parts partition the parameter."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    kinds = [type(op) for op in ops]
    if kinds not in ([MergeModulelist], [MergeModulelist, Concatenate]):
        raise UnsupportedCheckpointName(
            f"checkpoint weight {name!r} is converted by transformers with "
            f"{[k.__name__ for k in kinds]}; only a stack of experts (MergeModulelist), "
            "optionally followed by a Concatenate, can be written into its slice"
        )
    # The expert number is what the pattern's "*" matched (the last match in the name).
    number = re.escape(pattern).replace(r"\*", r"(\d+)")
    found = list(re.finditer(number, name))
    if not found:
        raise UnsupportedCheckpointName(f"no expert number in checkpoint weight {name!r}")
    expert = int(found[-1].group(1))
    merge_dim = ops[0].dim
    if expert >= param.shape[merge_dim]:
        raise UnsupportedCheckpointName(
            f"checkpoint weight {name!r} is expert {expert}; the model has "
            f"{param.shape[merge_dim]} in its fused parameter"
        )
    view = param.data.select(merge_dim, expert)
    chunk, chunks = 0, 1
    if len(ops) == 2:
        sources = converter.source_patterns
        cat = ops[1].dim
        cat = cat - 1 if cat > merge_dim else cat  # (the expert dimension is gone)
        size, rest = divmod(view.shape[cat], len(sources))
        if rest:
            raise UnsupportedCheckpointName(
                f"fused parameter of {name!r} is not {len(sources)} equal parts of {cat}"
            )
        chunk, chunks = sources.index(pattern), len(sources)
        view = view.narrow(cat, chunk * size, size)
    parts = (param.shape[merge_dim], chunks)
    return ParameterSlice(target, param.data, view, part=(expert, chunk), parts=parts)
