"""The seeds of the library's random streams, each a pure function of a configured seed.

torch seeds its global generator at random in every process, so anything drawn from it differs
between two runs of one config and between a run and its resume. Every draw the library makes
therefore comes from a configured seed: a model's initial weights and a new head from the
seed itself (``modeling.build``), and sampling, LoRA's adapters and dropout from a generator
seeded by ``row_seed`` of the seed and of where the draw stands in the run. Those streams are
told apart by the number and kind of their parts:

- sampling: ``(generation seed, weight version, call, row)``, four parts, the second never
  negative (``rl_models.generation.seeds``);
- LoRA's adapters: ``(policy seed, ADAPTER_STREAM)``, two parts;
- dropout: ``(policy seed, DROPOUT_STREAM, rank, optimiser step)``, four parts, the second
  negative.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence

import torch

_MASK_63 = (1 << 63) - 1  # non-negative int64: what torch and vLLM take as a seed

ADAPTER_STREAM = 0x10AA
DROPOUT_STREAM = -1


def row_seed(*parts: int) -> int:
    """A 63-bit seed from integers (BLAKE2b: no two tuples of parts collide in practice)."""
    digest = hashlib.blake2b(b",".join(str(int(p)).encode() for p in parts), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & _MASK_63


@contextlib.contextmanager
def seeded_generators(seed: int, cuda_devices: Sequence[torch.device] = ()) -> Iterator[None]:
    """Draw from ``seed`` inside the block: torch's global CPU generator, and that of each of
    ``cuda_devices``, forked and seeded; the caller's generators are as they were after it."""
    with torch.random.fork_rng(devices=list(cuda_devices)):
        torch.default_generator.manual_seed(seed)
        for device in cuda_devices:
            torch.cuda.default_generators[device.index or 0].manual_seed(seed)
        yield
