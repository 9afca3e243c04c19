"""Refit channels, in every part that runs without a GPU.

CUDA IPC and NCCL use the same code with CUDA buffers and ``ProcessGroupNCCL``; here the IPC
handles carry CPU shared memory (``file_system`` sharing) and the broadcast runs on gloo.
"""

import pickle
import subprocess
import sys
import threading

import torch

from rl_models.generation.refit import pick_channel
from rl_models.weight_transfer.buckets import TensorSpec
from rl_models.weight_transfer.channels import (
    BroadcastChannel,
    buffer_bytes,
    free_port,
    open_buffer,
    pack_into_tensor,
    share_buffer,
    unpack_tensor,
)

TENSORS = {
    "w": torch.randn(4, 3),
    "b": torch.arange(5, dtype=torch.int64),
    "h": torch.randn(3).to(torch.bfloat16),
}


def packed(shared=False):
    specs = [TensorSpec.of(n, t) for n, t in TENSORS.items()]
    return pack_into_tensor(specs, TENSORS.values(), "cpu", shared=shared)


def test_device_buffer_round_trip():
    slots, buffer = packed()
    assert buffer.dtype == torch.uint8 and buffer.numel() == buffer_bytes(slots)
    for name, t in unpack_tensor(slots, buffer):
        assert torch.equal(t, TENSORS[name]), name


def test_ipc_handle_maps_the_same_memory_in_another_process():
    slots, buffer = packed(shared=True)
    handle = pickle.dumps(share_buffer(slots, buffer))
    reader = (
        "import pickle, sys\n"
        "from rl_models.weight_transfer.channels import open_buffer, unpack_tensor\n"
        "b = pickle.loads(sys.stdin.buffer.read())\n"
        "print({n: t.float().sum().item() for n, t in unpack_tensor(b.slots, open_buffer(b))})"
    )
    out = subprocess.run(
        [sys.executable, "-c", reader], input=handle, capture_output=True, check=True
    )
    sums = eval(out.stdout.decode())
    for name, t in TENSORS.items():
        assert abs(sums[name] - t.float().sum().item()) < 1e-6
    # Same memory, not a copy: a write here is seen through the rebuilt handle.
    shared = open_buffer(pickle.loads(handle))
    buffer.zero_()
    assert int(shared.sum()) == 0


def test_broadcast_channel_delivers_rank_zero_buffer_to_every_rank():
    slots, sent = packed()
    port, world = free_port(), 3
    received = {}

    def member(rank):
        channel = BroadcastChannel("127.0.0.1", port, rank, world, "gloo", timeout_s=60)
        buffer = sent if rank == 0 else torch.empty_like(sent)
        channel.broadcast(buffer)
        received[rank] = dict(unpack_tensor(slots, buffer))

    threads = [threading.Thread(target=member, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(received) == [0, 1, 2]
    for rank in (1, 2):
        for name, t in TENSORS.items():
            assert torch.equal(received[rank][name], t), (rank, name)


def test_auto_channel_choice():
    assert pick_channel("auto", colocated=True, use_gpus=False) == "object_store"
    assert pick_channel("auto", colocated=True, use_gpus=True) == "cuda_ipc"
    assert pick_channel("auto", colocated=False, use_gpus=True) == "broadcast"
    assert pick_channel("broadcast", colocated=True, use_gpus=False) == "broadcast"
