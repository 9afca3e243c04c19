"""The shared-memory refit channel: one weight region that policy and generator both map.

When every policy rank and every generation worker run on one node (and on CPUs), the weights
need not travel at all. A *weight region* is a file in ``/dev/shm`` (memory, not disk) sized for
the whole exported model and laid out like one big bucket (``RegionLayout``: each HF-named tensor
at an 8-byte aligned offset). Each side maps it with ``MAP_SHARED``:

- the HF generation workers point their parameters at views of it once (the first refit copies
  their current values in, one parameter at a time), so the region *is* their weights: no second
  copy of the model exists, and a later refit needs no load at all;
- every policy rank writes straight into it: an FSDP2 rank its own row slice of each
  ``Shard(0)`` parameter (all ranks in parallel, no collective), and gathered tensors (LoRA
  merges, other placements, Megatron layers) are written by the producing rank. One copy of
  each byte, no pickling, no object store.

A refit is then three small Ray calls: ``prepare_for_weight_update`` on the generators (from
here on they refuse to sample: their weights are being overwritten), ``write_weights_to_region``
on the policy ranks, and ``commit_weight_region(path, digest, version)`` on the generators, which
checks the layout they map and stamps the version. A refit that fails before the commit leaves
the generators refusing with ``IncompleteRefitError``, as on every other channel.

Lifecycle of a region's *name* (its file in ``/dev/shm``): the memory lives as long as any
process maps it, the name only while processes still have to find it. ``refit`` creates the
region on one generation worker (``create_region``), maps it on the other generation workers and
on every policy rank, then has the creator ``unlink`` it: from then on the region has no name,
and the kernel frees its pages when the last mapping goes, however its processes end (shutdown,
exception, SIGKILL). Only during that set-up (one copy of the weights) is the file named, as
``rl-refit-<creator pid>-<creator start time>-<random>``; if its creator dies within that
window, the next ``create_region`` on the machine removes it (a file whose creator process, pid
*and* start time, no longer exists), and so does the creator's ``shutdown`` or interpreter exit.
The policy ranks drop their mappings at ``refit.WeightSync.release`` (the generator's
``shutdown``, or a refit from another policy or in another dtype), the generation workers when
they map another region or exit.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rl_models.weight_transfer.buckets import TensorSlot, TensorSpec, _aligned, slots_of

#: Where a consumer keeps a tensor: (segment name, byte offset in the segment, segment bytes).
Placer = Callable[[TensorSpec], "tuple[str, int, int] | None"]

REGION_DIR = "/dev/shm"
PREFIX = "rl-refit-"


@dataclass(frozen=True)
class RegionLayout:
    """Where each exported tensor lives in the region (the policy's export order)."""

    slots: tuple[TensorSlot, ...]

    @classmethod
    def of(cls, specs: Sequence[TensorSpec], place: Placer | None = None) -> RegionLayout:
        """Each tensor at the next aligned offset, in the order of ``specs``; or, with
        ``place``, where the consumer keeps it: ``place(spec)`` names the *segment* (e.g. a
        fused parameter) the tensor is a contiguous part of, its byte offset in it and the
        segment's size (None: a segment of its own). A segment is laid out whole at its first
        tensor, so a consumer can map the segment as one tensor and the producer write each
        part by name."""
        if place is None:
            return cls(slots_of(specs))
        slots, segments, end = [], {}, 0
        for spec in specs:
            where = place(spec)
            key, inner, size = where if where is not None else (spec.name, 0, spec.nbytes)
            if key not in segments:
                segments[key], end = end, end + _aligned(size)
            slots.append(
                TensorSlot(spec.name, spec.dtype, spec.shape, segments[key] + inner, spec.nbytes)
            )
        return cls(tuple(slots))

    @property
    def nbytes(self) -> int:
        return max((s.offset + s.nbytes for s in self.slots), default=0)

    @property
    def digest(self) -> str:
        """A fingerprint of names, dtypes, shapes and offsets: both sides must agree on it."""
        text = ";".join(f"{s.name}:{s.dtype}:{s.shape}:{s.offset}" for s in self.slots)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field 22), or
    None if there is no such process. With the pid it names one process, even after pid reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields from 3 on follow the ")" of the name


def _creator_alive(filename: str) -> bool | None:
    """Whether the process that created region file ``filename`` still runs (None: not a
    region file)."""
    if not filename.startswith(PREFIX):
        return None
    pid, *rest = filename.removeprefix(PREFIX).split("-")
    if not pid.isdigit():
        return None
    started = _start_time(int(pid))
    if started is None:
        return False
    return len(rest) < 2 or rest[0] == started  # (a name without a start time: the pid alone)


def remove_stale_regions(directory: str = REGION_DIR) -> list[str]:
    """Remove region files whose creating process is gone; returns their paths."""
    removed = []
    for filename in os.listdir(directory):
        if _creator_alive(filename) is not False:
            continue
        path = os.path.join(directory, filename)
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass  # another process swept it first
    return removed


def create_region(nbytes: int, directory: str = REGION_DIR) -> str:
    """A new zero-filled region file of ``nbytes`` (pages are allocated on first write).

    The caller maps it, has the other processes map it, and then ``remove_region``s the name
    (see the module's docstring)."""
    remove_stale_regions(directory)
    pid = os.getpid()
    name = f"{PREFIX}{pid}-{_start_time(pid)}-{uuid.uuid4().hex[:12]}"
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        # Reserve the pages now: a sparse file on a small /dev/shm (Docker's default is
        # 64 MiB) would otherwise fail later with SIGBUS in whichever process writes first,
        # instead of here with ENOSPC, which the refit turns into a fallback.
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path


def map_region(path: str, nbytes: int) -> torch.Tensor:
    """The region as a ``uint8`` tensor over a shared mapping of the file (writes are seen by
    every process that maps it)."""
    size = os.stat(path).st_size
    if size < nbytes:
        raise ValueError(f"weight region {path} holds {size} bytes; the layout needs {nbytes}")
    return torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)


def region_views(region: torch.Tensor, layout: RegionLayout) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` views into the mapped region, one per slot (no copy)."""
    views = {}
    for slot in layout.slots:
        raw = region[slot.offset : slot.offset + slot.nbytes]
        views[slot.name] = raw.view(getattr(torch, slot.dtype)).reshape(slot.shape)
    return views


def remove_region(path: str | None) -> None:
    """Remove a region's name; mappings of it stay valid (its memory goes with the last)."""
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class MappedRegion:
    """One process's mapping of a region, kept across refits (re-mapping costs page faults on
    every page, as much time as the copy itself)."""

    def __init__(self, path: str, layout: RegionLayout) -> None:
        self.path, self.layout = path, layout
        self.digest = layout.digest
        self.tensor = map_region(path, layout.nbytes)
        self.views = region_views(self.tensor, layout)
