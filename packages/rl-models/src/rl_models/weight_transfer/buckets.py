"""A bucket of named tensors packed into one flat byte buffer, the unit a refit moves.

One contiguous ``uint8`` numpy array travels through Ray's shared-memory object store without a
pickle copy, and a reader on the same node maps it zero-copy; the tensors are views into it.

A refit streams a model as a sequence of such buckets. ``plan_buckets`` cuts the model's tensor
list (names, shapes, dtypes: known before any weight is gathered) into buckets of at most
``bucket_bytes``; ``pack_planned`` then fills one bucket as its tensors arrive one at a time, so
a producer holds at most one bucket plus the one full tensor being copied in.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

ALIGN = 8  # every tensor starts at a multiple of 8 bytes: aligned views of any dtype


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorSpec:
    """What a tensor will be, before its data exists (a full, gathered HF-named weight)."""

    name: str  # Hugging Face parameter name
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return int(np.prod(self.shape, dtype=np.int64)) * itemsize

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> TensorSpec:
        return cls(name, str(t.dtype).removeprefix("torch."), tuple(t.shape))


@dataclass(frozen=True)
class TensorSlot:
    name: str  # Hugging Face parameter name
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]
    offset: int  # byte offset into the bucket's buffer
    nbytes: int


@dataclass(frozen=True)
class PackedBucket:
    slots: tuple[TensorSlot, ...]
    buffer: np.ndarray  # uint8, 1-D

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    @property
    def names(self) -> list[str]:
        return [slot.name for slot in self.slots]


@dataclass(frozen=True)
class ExportPlan:
    """One policy rank's part in a weight export."""

    steps: int  # export_weight_bucket calls this rank takes part in (0..steps-1)
    producer: bool  # whether its calls return buckets (else None)
    nbytes: int = 0  # bytes this rank will produce in all
    # Producers: the tensors of each bucket (the broadcast channel sizes receive buffers by it).
    buckets: tuple[tuple[TensorSpec, ...], ...] = ()


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[list[TensorSpec]]:
    """``specs`` cut, in order, into buckets of at most ``bucket_bytes`` each.

    A tensor larger than a bucket travels alone in a bucket of its own size.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    used = 0
    for spec in specs:
        size = _aligned(spec.nbytes)
        if current and used + size > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(spec)
        used += size
    if current:
        buckets.append(current)
    return buckets


def slots_of(specs: Sequence[TensorSpec]) -> tuple[TensorSlot, ...]:
    """Where each planned tensor goes in its bucket's buffer (8-byte aligned, in order)."""
    slots, offset = [], 0
    for spec in specs:
        slots.append(TensorSlot(spec.name, spec.dtype, spec.shape, offset, spec.nbytes))
        offset += _aligned(spec.nbytes)
    return tuple(slots)


def pack_planned(specs: Sequence[TensorSpec], tensors: Iterable[torch.Tensor]) -> PackedBucket:
    """One bucket holding ``tensors`` (one per spec, in order), copied in as they arrive.

    ``tensors`` may be a generator that gathers each full tensor only when asked for it: each
    is copied into the buffer and can be freed before the next is made.
    """
    slots = slots_of(specs)
    buffer = np.empty(sum(_aligned(s.nbytes) for s in slots), dtype=np.uint8)
    flat = torch.from_numpy(buffer)
    count = 0
    for slot, t in zip(slots, tensors, strict=False):
        count += 1
        if tuple(t.shape) != slot.shape or str(t.dtype).removeprefix("torch.") != slot.dtype:
            raise ValueError(
                f"tensor {slot.name!r} is {t.dtype} {tuple(t.shape)} but its bucket slot was "
                f"planned as {slot.dtype} {slot.shape}"
            )
        dst = flat[slot.offset : slot.offset + slot.nbytes]
        dst.copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    if count != len(slots):
        raise ValueError(f"bucket planned for {len(slots)} tensors received {count}")
    return PackedBucket(tuple(slots), buffer)


def pack_bucket(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> PackedBucket:
    """Copy ``(name, tensor)`` pairs into one buffer (each tensor 8-byte aligned)."""
    items = [(name, t.detach().contiguous().cpu()) for name, t in named_tensors]
    return pack_planned([TensorSpec.of(n, t) for n, t in items], (t for _, t in items))


def unpack_bucket(bucket: PackedBucket) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into the bucket's buffer (no copy; read-only if it is)."""
    # A bucket of only zero-size tensors has an empty buffer: still give each its empty view.
    flat = _as_uint8_tensor(bucket.buffer) if bucket.nbytes else torch.empty(0, dtype=torch.uint8)
    for slot in bucket.slots:
        raw = flat[slot.offset : slot.offset + slot.nbytes]
        yield slot.name, raw.view(getattr(torch, slot.dtype)).reshape(slot.shape)


def _as_uint8_tensor(buffer: np.ndarray) -> torch.Tensor:
    """A tensor over ``buffer``'s memory, also when it is read-only (Ray's shared memory).

    torch warns that writing to a read-only buffer is undefined; the views are only read.
    """
    if buffer.flags.writeable:
        return torch.from_numpy(buffer)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(memoryview(buffer), dtype=torch.uint8)
