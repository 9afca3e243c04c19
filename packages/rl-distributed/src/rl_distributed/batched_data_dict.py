"""``BatchedDataDict``: a batch of samples as a dict of per-sample values, with the slicing,
sharding and micro-batching that data-parallel training and generation need.

Values are torch tensors or numpy arrays with the batch on dim 0, or lists with one item per
sample. Methods that select rows (``slice``, ``select_indices``, ``chunk``, ``get_batch``,
``repeat_interleave``, ``shard_by_batch_size``) return new objects (whose tensors and arrays
may be views of the original's). ``reorder_data``, ``truncate_tensors`` and ``to`` replace the
values of the object itself and return it, so they chain.
"""

from __future__ import annotations

import functools
from collections import UserDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, Literal, NotRequired, TypedDict, TypeVar, overload

import numpy as np

from rl_distributed._torch import missing_torch

try:
    import torch
except ImportError as err:
    raise missing_torch("rl_distributed.BatchedDataDict") from err

from rl_distributed.packing import (
    ShardPlan,
    plan_dynamic_microbatches,
    plan_packed_microbatches,
)

T = TypeVar("T")

Indices = Sequence[int] | torch.Tensor | np.ndarray


class DynamicBatchingArgs(TypedDict):
    """Settings for ``shard_by_batch_size(..., dynamic_batching_args=...)``."""

    input_key: str  # right-padded [B, S, ...] tensor whose dim 1 is the sequence
    input_lengths_key: str  # [B] real lengths of input_key's rows
    max_tokens_per_microbatch: int  # budget for n_samples * padded length
    sequence_length_round: NotRequired[int]  # pad each micro-batch to a multiple (default 1)


class SequencePackingArgs(TypedDict):
    """Settings for ``shard_by_batch_size(..., sequence_packing_args=...)``."""

    input_key: str  # right-padded [B, S, ...] tensor whose dim 1 is the sequence
    input_lengths_key: str  # [B] real lengths of input_key's rows
    max_tokens_per_microbatch: int  # bin capacity: tokens in one packed row
    algorithm: NotRequired[str]  # a name in packing.PACKING_ALGORITHMS (default FFD)
    sequence_length_pad_multiple: NotRequired[int]  # round each sequence up (default 1)


MicroBatchKind = Literal["dynamic", "packed"]


def _batch_len(value: Any) -> int:
    return len(value) if isinstance(value, list) else int(value.shape[0])


def _take(value: Any, idx: list[int]) -> Any:
    if isinstance(value, torch.Tensor):
        return value.index_select(0, torch.tensor(idx, dtype=torch.long, device=value.device))
    if isinstance(value, np.ndarray):
        return value[np.asarray(idx, dtype=np.int64)]
    return [value[i] for i in idx]


def _cut(value: Any, dim: int, length: int) -> Any:
    """``value`` narrowed to its first ``length`` entries along ``dim``, when it has that dim."""
    if isinstance(value, torch.Tensor | np.ndarray) and value.ndim > dim:
        return value[(slice(None),) * dim + (slice(0, length),)]
    return value


def _concat(key: str, values: list[Any], pad_value: Any) -> Any:
    """Concatenate along the batch, right-padding tensors/arrays to the largest other dims."""
    kinds = {type(v) for v in values}
    if len(kinds) > 1:
        raise ValueError(f"key {key!r} holds different types across batches: {kinds}")
    if isinstance(values[0], list):
        return [item for v in values for item in v]
    ndims = {v.ndim for v in values}
    if len(ndims) > 1:
        raise ValueError(f"key {key!r} has different numbers of dims across batches: {ndims}")
    rows = sum(_batch_len(v) for v in values)
    trailing = tuple(max(sizes) for sizes in zip(*(v.shape[1:] for v in values), strict=True))
    if isinstance(values[0], torch.Tensor):
        devices = {v.device for v in values}
        if len(devices) > 1:
            raise ValueError(f"key {key!r} has tensors on different devices: {devices}")
        dtype = functools.reduce(torch.promote_types, (v.dtype for v in values))
        out = torch.full((rows, *trailing), pad_value, dtype=dtype, device=values[0].device)
    else:
        out = np.full((rows, *trailing), pad_value, dtype=np.result_type(*values))
    start = 0
    for v in values:
        out[(slice(start, start + len(v)), *(slice(0, n) for n in v.shape[1:]))] = v
        start += len(v)
    return out


class BatchedDataDict(UserDict[str, Any], Generic[T]):
    """A batch of samples stored column-wise: ``key -> value with one entry per sample``.

    ``T`` is an optional ``TypedDict`` describing the keys, for type checkers only.

    After ``shard_by_batch_size`` with dynamic batching or sequence packing, each shard carries
    its micro-batch plan as plain (picklable) attributes:

    - ``micro_batch_indices[g][m] = (start, end)``: rows of micro-batch ``m`` of global batch
      ``g``, as offsets into this shard;
    - ``micro_batch_lengths[g][m]``: the sequence length that micro-batch's padded tensors are
      cut to when iterated (dynamic batching: its longest sample rounded up to
      ``sequence_length_round``; packing: its longest sample), never more than the stored width;
    - ``micro_batch_kind``: ``"dynamic"`` or ``"packed"``; ``micro_batch_input_key``: the key
      whose dim-1 width identifies sequence tensors.

    They are ``None`` otherwise. ``to`` and ``truncate_tensors`` keep them; anything that moves
    rows (``reorder_data``, or building a new object) drops them.
    """

    def __init__(self, data: Mapping[str, Any] | None = None, /, **kwargs: Any) -> None:
        self.micro_batch_indices: list[list[tuple[int, int]]] | None = None
        self.micro_batch_lengths: list[list[int]] | None = None
        self.micro_batch_kind: MicroBatchKind | None = None
        self.micro_batch_input_key: str | None = None
        super().__init__(data, **kwargs)

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, torch.Tensor | np.ndarray):
            if value.ndim == 0:
                raise ValueError(f"key {key!r}: a 0-d value has no batch dimension")
        elif not isinstance(value, list):
            raise TypeError(
                f"key {key!r}: values must be torch tensors, numpy arrays or lists, "
                f"got {type(value).__name__}"
            )
        super().__setitem__(key, value)

    @property
    def size(self) -> int:
        """The number of samples; every value must have this many rows."""
        sizes = {key: _batch_len(value) for key, value in self.data.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"values disagree on the batch size: {sizes}")
        return next(iter(sizes.values()), 0)

    def get_dict(self) -> dict[str, Any]:
        """A plain ``dict`` of the values (a new dict; the values are shared)."""
        return dict(self.data)

    def _with(self, data: dict[str, Any]) -> BatchedDataDict[T]:
        return type(self)(data)

    @classmethod
    def from_batches(
        cls,
        batches: Sequence[Mapping[str, Any]],
        pad_value_dict: Mapping[str, Any] | None = None,
    ) -> BatchedDataDict[T]:
        """Concatenate batches (``BatchedDataDict``s or plain dicts) along the batch.

        Lists are joined. Tensors and arrays whose non-batch dims differ (e.g. sequence length)
        are right-padded to the largest with ``pad_value_dict.get(key, 0)``. Every batch must
        have the same keys.
        """
        if not batches:
            raise ValueError("from_batches needs at least one batch")
        pad_value_dict = pad_value_dict or {}
        keys = list(batches[0].keys())
        for n, batch in enumerate(batches[1:], start=1):
            if set(batch.keys()) != set(keys):
                missing = sorted(set(keys) - set(batch.keys()))
                extra = sorted(set(batch.keys()) - set(keys))
                raise ValueError(
                    f"batch {n} has different keys from batch 0: missing {missing}, extra {extra}"
                )
        return cls(
            {
                key: _concat(key, [b[key] for b in batches], pad_value_dict.get(key, 0))
                for key in keys
            }
        )

    # ---- row selection ---------------------------------------------------------------------

    def slice(self, start: int, end: int) -> BatchedDataDict[T]:
        """Rows ``start:end``, with Python slice semantics."""
        return self._with({key: value[start:end] for key, value in self.data.items()})

    def _index_list(self, idx: Indices) -> list[int]:
        if isinstance(idx, torch.Tensor | np.ndarray):
            if idx.dtype in (torch.bool, np.bool_):
                raise TypeError("indices must be integers, not a boolean mask")
            idx = idx.tolist()
        out = [int(i) for i in idx]
        size = self.size
        bad = [i for i in out if not 0 <= i < size]
        if bad:
            raise IndexError(f"index {bad[0]} is out of range for a batch of {size}")
        return out

    def select_indices(self, idx: Indices) -> BatchedDataDict[T]:
        """The rows at ``idx`` (non-negative ints; a list, tensor or array), in that order."""
        idx = self._index_list(idx)
        return self._with({key: _take(value, idx) for key, value in self.data.items()})

    def chunk(self, rank: int, chunks: int) -> BatchedDataDict[T]:
        """Contiguous part ``rank`` of ``chunks`` equal parts."""
        if not 0 <= rank < chunks:
            raise ValueError(f"rank {rank} is out of range for {chunks} chunks")
        size = self.size
        if size % chunks:
            raise ValueError(f"batch of {size} cannot be split into {chunks} equal chunks")
        step = size // chunks
        return self.slice(rank * step, (rank + 1) * step)

    def get_batch(self, batch_idx: int, batch_size: int) -> BatchedDataDict[T]:
        """Rows ``batch_idx * batch_size`` up to ``batch_size`` further (fewer at the end)."""
        start = batch_idx * batch_size
        if batch_size < 1 or not 0 <= start < self.size:
            raise IndexError(
                f"batch {batch_idx} of size {batch_size} is out of range for {self.size} rows"
            )
        return self.slice(start, start + batch_size)

    def repeat_interleave(self, n: int) -> BatchedDataDict[T]:
        """Every sample repeated ``n`` times in a row (list items are repeated by reference)."""
        if n < 0:
            raise ValueError(f"repeat count must be non-negative, got {n}")
        return self.select_indices([i for i in range(self.size) for _ in range(n)])

    def make_microbatch_iterator(self, microbatch_size: int) -> Iterator[BatchedDataDict[T]]:
        """Consecutive slices of ``microbatch_size`` rows (the last may be shorter)."""
        if microbatch_size < 1:
            raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}")
        size = self.size
        for start in range(0, size, microbatch_size):
            yield self.slice(start, start + microbatch_size)

    # ---- in-place changes ------------------------------------------------------------------

    def reorder_data(self, indices: Indices) -> BatchedDataDict[T]:
        """Permute the rows in place, ``new[i] = old[indices[i]]``; returns ``self``.

        Drops any micro-batch plan, whose row offsets no longer hold.
        """
        idx = self._index_list(indices)
        if sorted(idx) != list(range(self.size)):
            raise ValueError(f"indices must be a permutation of range({self.size})")
        for key, value in self.data.items():
            self.data[key] = _take(value, idx)
        self.micro_batch_indices = self.micro_batch_lengths = None
        self.micro_batch_kind = self.micro_batch_input_key = None
        return self

    def truncate_tensors(self, dim: int, length: int) -> BatchedDataDict[T]:
        """Cut every tensor or array with more than ``dim`` dims to ``length`` along ``dim``,
        in place; returns ``self``. Lists are left alone.
        """
        if dim < 1:
            raise ValueError(f"dim must be >= 1 (dim 0 is the batch), got {dim}")
        for key, value in self.data.items():
            self.data[key] = _cut(value, dim, length)
        return self

    def to(self, device: str | torch.device) -> BatchedDataDict[T]:
        """Move every tensor to ``device`` in place; returns ``self``."""
        for key, value in self.data.items():
            if isinstance(value, torch.Tensor):
                self.data[key] = value.to(device)
        return self

    # ---- sharding --------------------------------------------------------------------------

    @overload
    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_args: None = None,
        sequence_packing_args: None = None,
    ) -> list[BatchedDataDict[T]]: ...

    @overload
    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        *,
        dynamic_batching_args: DynamicBatchingArgs,
        sequence_packing_args: None = None,
    ) -> tuple[list[BatchedDataDict[T]], list[int]]: ...

    @overload
    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_args: None = None,
        *,
        sequence_packing_args: SequencePackingArgs,
    ) -> tuple[list[BatchedDataDict[T]], list[int]]: ...

    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_args: DynamicBatchingArgs | None = None,
        sequence_packing_args: SequencePackingArgs | None = None,
    ) -> list[BatchedDataDict[T]] | tuple[list[BatchedDataDict[T]], list[int]]:
        """Split the batch among ``shards`` data-parallel ranks.

        The rows form consecutive global batches of ``batch_size`` (default: one global batch of
        everything). Shard ``r`` holds, for every global batch in order, part ``r`` of it, so
        each rank sees a part of every global batch. Without micro-batch arguments part ``r`` is
        the ``r``-th contiguous chunk and a list of shards is returned. ``batch_size`` must be
        divisible by ``shards`` unless ``allow_uneven_shards``, in which case the first
        ``batch_size % shards`` ranks get one sample more.

        With ``dynamic_batching_args`` (see ``packing.plan_dynamic_microbatches``) or
        ``sequence_packing_args`` (see ``packing.plan_packed_microbatches``), rows are instead
        dealt to balance tokens and ordered into micro-batches, each shard gets a micro-batch
        plan (see the class docstring) with the same number of micro-batches on every shard for
        each global batch, and ``(shards, restore_indices)`` is returned: if per-row outputs of
        each shard are concatenated in shard order (``BatchedDataDict.from_batches``),
        ``.reorder_data(restore_indices)`` puts them back in the original row order. With
        dynamic batching, shards get the same sample counts as without it; with packing they
        get the same number of bins, so sample counts may differ.
        """
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        if dynamic_batching_args is not None and sequence_packing_args is not None:
            raise ValueError("pass dynamic_batching_args or sequence_packing_args, not both")
        total = self.size
        if total == 0:
            raise ValueError("cannot shard an empty batch")
        batch_size = total if batch_size is None else batch_size
        if batch_size < 1 or total % batch_size:
            raise ValueError(
                f"batch of {total} rows is not divisible into global batches of {batch_size}"
            )
        if batch_size % shards and not allow_uneven_shards:
            raise ValueError(
                f"global batch size {batch_size} is not divisible by {shards} shards; "
                "pass allow_uneven_shards=True to allow it"
            )
        shard_sizes = [batch_size // shards + (r < batch_size % shards) for r in range(shards)]
        starts = range(0, total, batch_size)

        if dynamic_batching_args is None and sequence_packing_args is None:
            offsets = np.cumsum([0, *shard_sizes]).tolist()
            return [
                self.select_indices(
                    [g + i for g in starts for i in range(offsets[r], offsets[r + 1])]
                )
                for r in range(shards)
            ]

        args: Mapping[str, Any] = dynamic_batching_args or sequence_packing_args  # type: ignore[assignment]
        input_key, lengths_key = args["input_key"], args["input_lengths_key"]
        width = self._sequence_width(input_key)
        lengths = self._lengths(lengths_key)
        if max(lengths) > width:
            raise ValueError(
                f"{lengths_key!r} holds a length of {max(lengths)} but {input_key!r} "
                f"is only {width} wide"
            )
        budget = args["max_tokens_per_microbatch"]
        plans: list[list[ShardPlan]] = []  # [global batch][shard]
        for g in starts:
            local = lengths[g : g + batch_size]
            if dynamic_batching_args is not None:
                round_to = dynamic_batching_args.get("sequence_length_round", 1)
                plans.append(plan_dynamic_microbatches(local, shard_sizes, budget, round_to))
            else:
                plans.append(
                    plan_packed_microbatches(
                        local,
                        shards,
                        budget,
                        args.get("algorithm", "first_fit_decreasing"),
                        args.get("sequence_length_pad_multiple", 1),
                    )
                )

        kind: MicroBatchKind = "dynamic" if dynamic_batching_args is not None else "packed"
        out, order = [], []
        for r in range(shards):
            rows: list[int] = []
            indices, seq_lengths = [], []
            for g, per_shard in zip(starts, plans, strict=True):
                plan, base = per_shard[r], len(rows)
                rows += [g + i for i in plan.rows]
                indices.append([(base + s, base + e) for s, e in plan.micro_batches])
                seq_lengths.append([min(n, width) for n in plan.seq_lengths])
            shard = self.select_indices(rows)
            shard.micro_batch_indices, shard.micro_batch_lengths = indices, seq_lengths
            shard.micro_batch_kind, shard.micro_batch_input_key = kind, input_key
            out.append(shard)
            order += rows
        # order[j] is the original row of concatenated row j; restoring needs its inverse.
        restore = [0] * total
        for j, original in enumerate(order):
            restore[original] = j
        return out, restore

    def _sequence_width(self, key: str) -> int:
        value = self.data.get(key)
        if not isinstance(value, torch.Tensor) or value.ndim < 2:
            raise ValueError(f"{key!r} must be a [batch, sequence, ...] tensor to micro-batch by")
        return int(value.shape[1])

    def _lengths(self, key: str) -> list[int]:
        if key not in self.data:
            raise KeyError(f"no lengths under {key!r}; keys are {sorted(self.data)}")
        value = self.data[key]
        lengths = value.tolist() if isinstance(value, torch.Tensor | np.ndarray) else value
        if any(isinstance(n, list) for n in lengths):
            raise ValueError(f"{key!r} must hold one length per sample")
        return [int(n) for n in lengths]

    # ---- planned micro-batches -------------------------------------------------------------

    def make_microbatch_iterator_with_dynamic_shapes(self) -> Iterator[BatchedDataDict[T]]:
        """Yield the dynamic-batching micro-batches of this shard, global batch by global batch,
        with sequence tensors (dim 1 as wide as the input key's) cut to the micro-batch's
        padded length.
        """
        return self._iter_planned("dynamic", "dynamic_batching_args")

    def make_microbatch_iterator_for_packable_sequences(self) -> Iterator[BatchedDataDict[T]]:
        """Yield the bins of this shard, each as a padded micro-batch whose sequence tensors are
        cut to its longest sample; the model worker packs each into one row
        (``packing.pack_sequences``).
        """
        return self._iter_planned("packed", "sequence_packing_args")

    def _iter_planned(self, kind: MicroBatchKind, arg: str) -> Iterator[BatchedDataDict[T]]:
        if self.micro_batch_kind != kind:
            raise ValueError(
                f"this batch has no {kind} micro-batch plan; make one with "
                f"shard_by_batch_size(..., {arg}=...)"
            )
        assert self.micro_batch_indices is not None and self.micro_batch_lengths is not None
        width = self._sequence_width(self.micro_batch_input_key)  # type: ignore[arg-type]
        return self._iter_plan(width)

    def _iter_plan(self, width: int) -> Iterator[BatchedDataDict[T]]:
        for bounds, lengths in zip(
            self.micro_batch_indices,  # type: ignore[arg-type]
            self.micro_batch_lengths,  # type: ignore[arg-type]
            strict=True,
        ):
            for (start, end), length in zip(bounds, lengths, strict=True):
                mb = self.slice(start, end)
                for key, value in mb.items():
                    sequence = isinstance(value, torch.Tensor | np.ndarray) and value.ndim >= 2
                    if sequence and value.shape[1] == width:
                        mb.data[key] = _cut(value, 1, length)
                yield mb
