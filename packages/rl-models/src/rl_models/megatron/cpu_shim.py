"""Let Megatron-core's GPT forward/backward run on CPU-only machines (tests, laptops).

Places in megatron-core 0.16 that assume CUDA even with ``use_cpu_initialization=True``:

* ``GlobalMemoryBuffer.get_tensor`` allocates its scratch buffers (the attention scores'
  ``baddbmm`` input) on ``torch.cuda.current_device()``;
* ``CudaRNGStatesTracker.fork`` swaps CUDA RNG states around dropout, and there are none;
* ``RotaryEmbedding.get_emb`` moves its inverse frequencies to ``torch.cuda.current_device()``;
* tensor and pipeline parallelism: the pipeline schedules count tokens in
  ``torch.zeros(..., device="cuda")``; p2p communication allocates its receive buffers (and
  the shapes of variable-length ones) on ``torch.cuda.current_device()`` and calls
  ``torch.cuda.synchronize()``; the tensor-parallel gathers and reduce-scatters of sequence
  parallelism allocate their outputs on ``torch.cuda.current_device()``;
* mixture-of-experts layers: the all-to-all token dispatcher makes a ``torch.cuda.Stream`` at
  construction and copies its split sizes to the host on it (inside ``torch.cuda.stream``,
  then waits on a recorded event); the router and the auxiliary-loss tracker allocate on
  ``torch.cuda.current_device()`` / ``device="cuda"``; and without Transformer Engine the
  router's gating matmul reads ``moe_utils.te_general_gemm``, a name only bound when Transformer
  Engine imports (a ``NameError`` otherwise): it is bound to None, the "no TE" value the code
  tests for.

``apply()`` replaces these, only when CUDA is unavailable: buffers are allocated on the CPU,
``fork`` does nothing and the rotary angles stay where the frequencies are. For the last group
the modules named in ``_CPU_AS_CUDA_MODULES`` see, in place of the ``torch`` module, a thin
proxy in which "the current CUDA device" and ``device="cuda"`` mean the CPU,
``torch.cuda.synchronize`` does nothing and CUDA streams are stand-ins on which every copy is
already done, and
``all_to_all_single`` takes split sizes given as host tensors (gloo's CPU collectives are synchronous for tensors),
and ``all_gather`` / ``reduce_scatter`` take pieces of unequal lengths (experts beside tensor
parallelism); everything else is the real ``torch``. Patching those modules' globals, not ``torch.cuda``
itself, keeps the change invisible to the rest of the process.

Dropout must be 0 (the policy worker sets it so): with a no-op fork, dropout inside
tensor-parallel regions would draw from the default CPU generator instead of a tracked per-rank
stream. On GPU machines nothing is changed.

The default causal mask (``get_default_causal_mask``) is also built on ``"cuda"``; that one is
avoided without patching, by always passing an explicit attention mask. Tied embeddings with
pipeline parallelism move the last stage's copy with ``.cuda()`` at construction; the worker
avoids that path by tying the two copies itself (see ``parallel.build_gpt``).
"""

from __future__ import annotations

import contextlib
import importlib
import operator
from functools import reduce
from typing import Any

import torch

_applied = False

#: Modules whose ``torch.cuda.current_device()``/``device="cuda"`` allocations and
#: ``torch.cuda.synchronize()`` calls are redirected to the CPU.
_CPU_AS_CUDA_MODULES = (
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
)


def _cpu_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
    required = reduce(operator.mul, tensor_shape, 1)
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < required:
        buf = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype, device="cpu")
    return buf[:required].view(*tensor_shape)


@contextlib.contextmanager
def _no_fork(self, name=None):
    yield


def _cpu_rotary_emb(self, max_seq_len, offset=0):
    # [seq, dim/2] angles -> [seq, 1, 1, dim]: halves (or, interleaved, pairs) share an angle.
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if self.rotary_interleaved:
        emb = freqs.repeat_interleave(2, dim=-1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


def _on_cpu(device: Any) -> Any:
    is_cuda = isinstance(device, int) or str(device).startswith("cuda")
    return torch.device("cpu") if device is not None and is_cuda else device


class _HostStream:
    """A CUDA stream on a CPU-only machine: work "on" it is done when it returns."""

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self) -> _HostStream:
        return self  # an event that has already happened

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


class _CpuCuda:
    """``torch.cuda`` as the patched modules see it."""

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> _HostStream:
        return _HOST_STREAM

    @staticmethod
    def current_stream(device: Any = None) -> _HostStream:
        return _HOST_STREAM

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(device: Any = None) -> None:
        pass


def _factory(fn):
    def on_cpu(*args, device=None, **kwargs):
        return fn(*args, device=_on_cpu(device), **kwargs)

    return staticmethod(on_cpu)


def _sizes(split: Any) -> Any:
    return split.tolist() if isinstance(split, torch.Tensor) else split


class _CpuDistributed:
    """``torch.distributed`` as the patched modules see it: the all-to-all token dispatcher
    hands ``all_to_all_single`` its split sizes as tensors, which it moves to the host (as
    lists) only when they are on a GPU; torch wants lists. With experts beside tensor
    parallelism, the dispatcher also gathers and reduce-scatters pieces of unequal lengths
    over the tensor-parallel ranks (each routed a different number of tokens), which NCCL
    does and gloo refuses: here they go through equal-sized collectives instead."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)

    @staticmethod
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        return torch.distributed.all_to_all_single(
            output, input, _sizes(output_split_sizes), _sizes(input_split_sizes), **kw
        )

    @staticmethod
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        """Every rank's ``tensor`` into ``tensor_list``; unequal first dimensions are padded
        to the longest for the gather and cut back after it (synchronously)."""
        lengths = [t.shape[0] for t in tensor_list]
        if len(set(lengths)) == 1:
            return torch.distributed.all_gather(tensor_list, tensor, group=group, async_op=async_op)
        if async_op or any(t.shape[1:] != tensor.shape[1:] for t in tensor_list):
            raise RuntimeError(
                "cpu_shim: an asynchronous all_gather, or one of pieces whose shapes differ "
                "beyond the first dimension, is not done on CPU"
            )
        longest = max(lengths)
        padded = torch.cat([tensor, tensor.new_zeros(longest - tensor.shape[0], *tensor.shape[1:])])
        gathered = [torch.empty_like(padded) for _ in lengths]
        torch.distributed.all_gather(gathered, padded, group=group)
        for out, got, n in zip(tensor_list, gathered, lengths, strict=True):
            out.copy_(got[:n])
        return None

    @staticmethod
    def reduce_scatter(
        output, input_list, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False
    ):
        """The sum over the ranks of each rank's ``input_list``, piece ``rank`` into
        ``output`` (pieces of any lengths): one all-reduce of them all, synchronously."""
        if async_op or op != torch.distributed.ReduceOp.SUM:
            raise RuntimeError("cpu_shim: reduce_scatter is done on CPU as a plain sum")
        whole = torch.cat([t.reshape(-1) for t in input_list])
        torch.distributed.all_reduce(whole, group=group)
        rank = torch.distributed.get_rank(group)
        start = sum(t.numel() for t in input_list[:rank])
        output.copy_(whole[start : start + output.numel()].view_as(output))
        return None


class _CpuTorch:
    """``torch`` as the patched modules see it: the real one, but CUDA allocations on CPU."""

    cuda = _CpuCuda()
    distributed = _CpuDistributed()
    empty = _factory(torch.empty)
    zeros = _factory(torch.zeros)
    ones = _factory(torch.ones)
    tensor = _factory(torch.tensor)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def apply() -> bool:
    """Patch megatron-core for CPU if CUDA is unavailable; True if patched (idempotent)."""
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        from megatron.core import utils
        from megatron.core.models.common.embeddings import rotary_pos_embedding
        from megatron.core.tensor_parallel import random
        from megatron.core.transformer.moe import moe_utils

        utils.GlobalMemoryBuffer.get_tensor = _cpu_get_tensor
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
        random.CudaRNGStatesTracker.fork = _no_fork
        rotary_pos_embedding.RotaryEmbedding.get_emb = _cpu_rotary_emb
        proxy = _CpuTorch()
        for name in _CPU_AS_CUDA_MODULES:
            module = importlib.import_module(name)
            if module.torch is not torch:
                raise RuntimeError(f"{name} does not import torch as `torch`: update cpu_shim")
            module.torch = proxy
        _applied = True
    return True
