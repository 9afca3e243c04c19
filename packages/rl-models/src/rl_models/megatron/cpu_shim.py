"""Let Megatron-core's GPT forward/backward run on CPU-only machines (tests, laptops).

Three places in megatron-core 0.16 assume CUDA even with ``use_cpu_initialization=True``:

* ``GlobalMemoryBuffer.get_tensor`` allocates its scratch buffers (the attention scores'
  ``baddbmm`` input) on ``torch.cuda.current_device()``;
* ``CudaRNGStatesTracker.fork`` swaps CUDA RNG states around dropout, and there are none;
* ``RotaryEmbedding.get_emb`` moves its inverse frequencies to ``torch.cuda.current_device()``.

``apply()`` replaces all three, only when CUDA is unavailable: buffers are allocated on the
CPU, ``fork`` does nothing and the rotary angles stay where the frequencies are. Dropout must then be 0 (the policy worker sets it so): with a no-op fork,
dropout inside tensor-parallel regions would draw from the default CPU generator instead of a
tracked per-rank stream. On GPU machines nothing is changed.

The default causal mask (``get_default_causal_mask``) is also built on ``"cuda"``; that one is
avoided without patching, by always passing an explicit attention mask.
"""

from __future__ import annotations

import contextlib
import operator
from functools import reduce

import torch

_applied = False


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


def apply() -> bool:
    """Patch megatron-core for CPU if CUDA is unavailable; True if patched (idempotent)."""
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        from megatron.core import utils
        from megatron.core.models.common.embeddings import rotary_pos_embedding
        from megatron.core.tensor_parallel import random

        utils.GlobalMemoryBuffer.get_tensor = _cpu_get_tensor
        random.CudaRNGStatesTracker.fork = _no_fork
        rotary_pos_embedding.RotaryEmbedding.get_emb = _cpu_rotary_emb
        _applied = True
    return True
