"""A bucket of named tensors packed into one flat byte buffer, the unit a refit moves.

One contiguous ``uint8`` numpy array travels through Ray's shared-memory object store without a
pickle copy, and a reader on the same node maps it zero-copy; the tensors are views into it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch


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


def pack_bucket(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> PackedBucket:
    """Copy ``(name, tensor)`` pairs into one buffer (each tensor 8-byte aligned)."""
    items = [(name, t.detach().contiguous().cpu()) for name, t in named_tensors]
    slots, offset = [], 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        slots.append(
            TensorSlot(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes)
        )
        offset += (nbytes + 7) // 8 * 8
    buffer = np.empty(offset, dtype=np.uint8)
    flat = torch.from_numpy(buffer)
    for slot, (_, t) in zip(slots, items, strict=True):
        flat[slot.offset : slot.offset + slot.nbytes].copy_(t.reshape(-1).view(torch.uint8))
    return PackedBucket(tuple(slots), buffer)


def unpack_bucket(bucket: PackedBucket) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into the bucket's buffer (no copy; read-only if it is)."""
    flat = torch.frombuffer(memoryview(bucket.buffer), dtype=torch.uint8) if bucket.nbytes else None
    for slot in bucket.slots:
        raw = flat[slot.offset : slot.offset + slot.nbytes]
        yield slot.name, raw.view(getattr(torch, slot.dtype)).reshape(slot.shape)
