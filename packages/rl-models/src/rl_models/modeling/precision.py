"""Whether a device computes bfloat16 natively, and what the ``auto`` precision settings pick.

bfloat16 halves the bytes moved, but a CPU without AVX512-BF16 or AMX has no bfloat16
arithmetic: PyTorch converts around every operation, and a bfloat16 matmul runs about five
times slower than the same float32 one (8.4 s against 1.6 s for ``[2048, 576] @ [576, 49152]``
on an AVX2-only EPYC). ``auto`` therefore means bfloat16 on GPUs and on CPUs that compute it
natively, and float32 everywhere else.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch

HalfSetting = Literal["bfloat16", "auto"]


def native_bfloat16(device_type: str) -> bool:
    """Whether ``device_type`` ("cuda", "cpu") of this process computes bfloat16 natively."""
    if device_type == "cuda":
        # Pre-Ampere GPUs (V100, T4) only emulate it, which torch counts by default.
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device_type == "cpu":
        # Private helpers, hence looked up: a torch without them is treated as lacking both.
        checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(getattr(torch.cpu, name, lambda: False)() for name in checks)
    return False


def compute_dtype(setting: HalfSetting | None, device_type: str) -> torch.dtype | None:
    """The dtype ``mixed_precision: setting`` computes in on ``device_type`` (None: the
    weights' own). An explicit bfloat16 on a device that emulates it is kept, with a warning."""
    if setting is None:
        return None
    native = native_bfloat16(device_type)
    if setting == "auto":
        return torch.bfloat16 if native else None
    if not native:
        warnings.warn(
            f"mixed_precision: {setting} on a {device_type} without native bfloat16 (no "
            "AVX512-BF16 or AMX) runs several times slower than float32; 'auto' picks float32 "
            "there",
            stacklevel=2,
        )
    return getattr(torch, setting)


def run_has_native_bfloat16(use_gpus: bool) -> bool:
    """Whether a run's workers compute bfloat16 natively, as the driver can tell: its GPUs when
    it sees them (a CPU-only head node takes the cluster's GPUs to), else its CPU, which stands
    for the workers' (the CPU runs this library targets are on one machine)."""
    if use_gpus:
        return not torch.cuda.is_available() or native_bfloat16("cuda")
    return native_bfloat16("cpu")


def settle_mixed_precision(
    setting: HalfSetting | None, use_gpus: bool, supported: bool = True
) -> HalfSetting | None:
    """``mixed_precision`` with ``auto`` made concrete for a run, decided once on the driver so
    that every rank computes alike. ``supported``: whether the backend has mixed precision
    at all (Megatron here does not: ``auto`` is then its weights' own dtype)."""
    if setting != "auto":
        return setting
    return "bfloat16" if supported and run_has_native_bfloat16(use_gpus) else None


def generator_dtype(setting: str | None, use_gpus: bool) -> str | None:
    """The dtype a generator's copy of the policy is held in for ``generation.dtype: setting``
    (None: the policy's own), ``auto`` decided as ``settle_mixed_precision`` decides it."""
    if setting != "auto":
        return setting
    return "bfloat16" if run_has_native_bfloat16(use_gpus) else None
