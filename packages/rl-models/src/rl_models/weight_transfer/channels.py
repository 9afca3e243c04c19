"""Weight channels besides the CPU object store: CUDA IPC (colocated) and broadcast (separate).

``refit`` (``channel=...``) picks one; the buckets and their planning are the same everywhere
(``buckets.py``), only the carrier of the bytes differs:

- ``object_store``: a ``PackedBucket`` (numpy, Ray shared memory); ``load_weight_bucket``.
- ``cuda_ipc``: the producer packs the bucket into one device buffer and returns
  ``torch.multiprocessing.reductions.reduce_tensor``'s handle (``IpcBucket``); a generation
  worker on the same node rebuilds a view of that very memory and copies from it
  (``receive_weight_bucket_ipc``). The producer keeps the buffer alive until the next bucket.
  With ``torch.multiprocessing``'s ``file_system`` sharing strategy the same handles also work
  for CPU tensors, which is how this path is tested without a GPU.
- ``broadcast``: a process group (``ProcessGroupNCCL`` on GPUs, ``ProcessGroupGloo`` on CPUs)
  spanning one producing policy rank (rank 0) and every generation worker, set up outside the
  training world through its own ``TCPStore``; the producer broadcasts the packed device
  buffer, the workers receive into a buffer of the planned size and load from it
  (``receive_weight_bucket_broadcast``).

``ChannelReceiver`` gives a generation worker all three receive methods on top of its own
``load_named_weights``; ``BucketSender`` gives a policy worker the sending side.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from rl_models.weight_transfer.buckets import (
    PackedBucket,
    TensorSlot,
    TensorSpec,
    _aligned,
    slots_of,
    unpack_bucket,
)


def pack_into_tensor(
    specs: Sequence[TensorSpec],
    tensors: Iterable[torch.Tensor],
    device: torch.device | str,
    shared: bool = False,
) -> tuple[tuple[TensorSlot, ...], torch.Tensor]:
    """Like ``weights.pack_planned`` but into a ``uint8`` tensor on ``device`` (a GPU buffer
    for IPC and NCCL). ``shared``: a CPU buffer is made in shared memory before it is filled,
    so ``share_buffer`` needs no copy."""
    slots = slots_of(specs)
    buffer = torch.empty(buffer_bytes(slots), dtype=torch.uint8, device=device)
    if shared and buffer.device.type == "cpu":
        # CPU storages travel as named shared-memory files (the default strategy passes file
        # descriptors, which only a multiprocessing connection can carry).
        torch.multiprocessing.set_sharing_strategy("file_system")
        buffer.share_memory_()
    count = 0
    for slot, t in zip(slots, tensors, strict=False):
        count += 1
        if tuple(t.shape) != slot.shape or str(t.dtype).removeprefix("torch.") != slot.dtype:
            raise ValueError(f"tensor {slot.name!r} does not match its planned slot")
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[slot.offset : slot.offset + slot.nbytes].copy_(raw, non_blocking=True)
    if count != len(slots):
        raise ValueError(f"bucket planned for {len(slots)} tensors received {count}")
    return tuple(slots), buffer


def unpack_tensor(
    slots: Sequence[TensorSlot], buffer: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into a ``uint8`` buffer (any device), no copy."""
    for slot in slots:
        raw = buffer[slot.offset : slot.offset + slot.nbytes]
        yield slot.name, raw.view(getattr(torch, slot.dtype)).reshape(slot.shape)


def buffer_bytes(slots: Sequence[TensorSlot]) -> int:
    return max((s.offset + _aligned(s.nbytes) for s in slots), default=0)


# -- CUDA IPC ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IpcBucket:
    """A bucket's layout and a handle to the producer's buffer.

    ``handle``: the buffer pickled by ``multiprocessing``'s ``ForkingPickler`` with torch's
    reductions registered (``torch.multiprocessing.reductions.reduce_tensor``): for a CUDA
    tensor the CUDA IPC memory handle, for a shared CPU tensor the shared-memory file's name;
    never the bytes themselves.
    """

    slots: tuple[TensorSlot, ...]
    handle: bytes


def share_buffer(slots: tuple[TensorSlot, ...], buffer: torch.Tensor) -> IpcBucket:
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as mp  # (importing it registers torch's reductions)

    cpu = buffer.device.type == "cpu"
    if cpu and (not buffer.is_shared() or mp.get_sharing_strategy() != "file_system"):
        raise ValueError("a CPU buffer must be packed with shared=True to be shared")
    return IpcBucket(slots, bytes(ForkingPickler.dumps(buffer)))


def open_buffer(bucket: IpcBucket) -> torch.Tensor:
    """The producer's buffer, mapped into this process (same memory, no copy)."""
    import pickle

    import torch.multiprocessing  # noqa: F401

    return pickle.loads(bucket.handle)


# -- broadcast over a dedicated process group --------------------------------------------------


class BroadcastChannel:
    """A process group of ``world`` processes (rank 0 sends), independent of any default group.

    ``backend``: "nccl" (GPUs; buffers must be CUDA tensors) or "gloo" (CPU).
    """

    def __init__(
        self, host: str, port: int, rank: int, world: int, backend: str, timeout_s: float = 600
    ) -> None:
        from torch.distributed import TCPStore

        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = TCPStore(host, port, world, is_master=rank == 0, timeout=timeout)
        self.rank, self.world, self.backend = rank, world, backend
        if backend == "nccl":
            from torch.distributed import ProcessGroupNCCL

            self.group = ProcessGroupNCCL(self.store, rank, world)
        elif backend == "gloo":
            from torch.distributed import ProcessGroupGloo

            self.group = ProcessGroupGloo(self.store, rank, world, timeout)
        else:
            raise ValueError(f"broadcast backend must be 'nccl' or 'gloo', not {backend!r}")

    def broadcast(self, buffer: torch.Tensor) -> None:
        """Rank 0's ``buffer`` into every rank's ``buffer`` (same size everywhere)."""
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([buffer], opts).wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# -- the two sides ---------------------------------------------------------------------------------


class ChannelReceiver:
    """The receive methods of a generation worker, given its ``load_named_weights``."""

    device: torch.device
    _channels: dict[int, BroadcastChannel] | None = None  # one per producing policy rank

    def load_named_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError  # each generation worker defines how it takes weights

    def load_weight_bucket(self, bucket: PackedBucket) -> None:
        self.load_named_weights(unpack_bucket(bucket))

    def receive_weight_bucket_ipc(self, bucket: IpcBucket) -> None:
        buffer = open_buffer(bucket)
        self.load_named_weights(unpack_tensor(bucket.slots, buffer))
        if buffer.is_cuda:
            torch.cuda.synchronize(buffer.device)  # done reading before the producer reuses it
        del buffer

    def init_weight_broadcast(
        self, host: str, port: int, rank: int, world: int, backend: str, key: int = 0
    ) -> None:
        """Join producer ``key``'s channel as ``rank`` (a fresh one each refit)."""
        if self._channels is None:
            self._channels = {}
        self._channels[key] = BroadcastChannel(host, port, rank, world, backend)

    def receive_weight_bucket_broadcast(self, slots: tuple[TensorSlot, ...], key: int = 0) -> None:
        channel = (self._channels or {}).get(key)
        if channel is None:
            raise RuntimeError(f"no broadcast channel {key}: call init_weight_broadcast first")
        buffer = torch.empty(buffer_bytes(slots), dtype=torch.uint8, device=self.device)
        channel.broadcast(buffer)
        self.load_named_weights(unpack_tensor(slots, buffer))
