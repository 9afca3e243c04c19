"""Moving a policy's weights and optimiser state off the accelerator and back.

Colocated generation shares the GPU with training: before the inference engine takes the memory
the trainer's optimiser state (and, after the weights were handed over, the weights too) move to
host memory, and back before the next training step.

Offloading always makes a dedicated copy (``copy=True``), even to the device a tensor is already
on, so the old storage is released; with CUDA present, host copies are pinned so the transfers
back can be asynchronous. Parameters keep their identity (``Module._apply`` swaps their data,
also for FSDP2's DTensor parameters), so the optimiser still refers to them.
"""

from __future__ import annotations

import gc

import torch
from torch.distributed.tensor import DTensor


def _pin(t: torch.Tensor, device: torch.device) -> bool:
    # Pinning needs CUDA and a plain tensor (a DTensor's shards are not pinned here).
    return device.type == "cpu" and torch.cuda.is_available() and not isinstance(t, DTensor)


def move_tensor(t: torch.Tensor, device: torch.device, copy: bool) -> torch.Tensor:
    """``t`` on ``device``: a fresh copy when ``copy``, pinned in host memory where CUDA exists."""
    if _pin(t, device):
        out = torch.empty_like(t, device="cpu", pin_memory=True)
        return out.copy_(t, non_blocking=True)
    return t.to(device, copy=copy, non_blocking=True)


def move_module(module: torch.nn.Module, device: torch.device, copy: bool) -> None:
    """Parameters and buffers of ``module`` to ``device`` in place (parameter objects kept)."""
    module._apply(lambda t: move_tensor(t, device, copy))


def move_optimizer_state(
    optimizer: torch.optim.Optimizer, device: torch.device, copy: bool
) -> None:
    """Every tensor of the optimiser's per-parameter state to ``device``.

    Scalar ``step`` counters stay where the optimiser put them: a few bytes, and a
    non-capturable Adam wants them on the CPU.
    """
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not (key == "step" and value.dim() == 0):
                state[key] = move_tensor(value, device, copy)


def synchronize() -> None:
    """Wait for the asynchronous copies (only CUDA makes any)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def release_cached_memory(device: torch.device) -> None:
    """Hand the blocks freed by an offload back to the driver. PyTorch's caching allocator keeps
    them reserved for this process otherwise, where another process sharing the GPU (the
    generator, the policy beside a critic or teacher) cannot use them."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
