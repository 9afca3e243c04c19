"""Per-row sampling seeds that a resumed run draws again, so that resume is exact.

A generator's sampling must not depend on random state that lives only in its worker
processes: a run stopped and resumed starts fresh workers, and their generators would draw
other numbers than the uninterrupted run's. So the randomness of every sampled row is a pure
function of where the row stands in the run::

    row seed = hash(generation seed, weight version, call number at that version, row)

- *weight version*: the policy version the generator holds (``GenerationInterface
  .weight_version``), which a checkpoint saves and a resume restores;
- *call number*: how many sampling (non-greedy) ``generate`` calls this generator has made at
  that version, counted from 0 again whenever the version changes. A sync RL step refits
  (a new version) before it samples, so its calls -- the turns of a multi-turn rollout, the
  rounds of dynamic sampling -- are numbered 0, 1, ... within the step, and a resumed run numbers
  them the same way. Greedy calls (validation) draw nothing and are not counted, so a
  validation between a checkpoint and the next step changes no seed;
- *row*: the row's index in the call's batch.

A backend turns each row's seed into that row's own random stream (HF: a ``torch.Generator``
per row; vLLM: ``SamplingParams(seed=...)`` per request), so a row's sample does not depend
on which worker or engine it lands on, nor on the other rows of its batch.

The one assumption: a checkpoint is written after the weights changed from the last sampling
call (true for every loop that checkpoints right after its train step). A run that sampled at
version ``v``, checkpointed without a weight change, and resumed, would number its calls at
``v`` from 0 again.
"""

from __future__ import annotations

import torch

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.modeling.random_streams import row_seed

SEEDS_KEY = "sampling_seeds"  # int64 [B] in a generate batch: each row's seed


class SamplingSeeds:
    """The call counter of one generator (held by its driver-side controller)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.version: int | None = None
        self.calls = 0  # sampling calls made at ``self.version``

    def next_call(self, weight_version: int, rows: int) -> torch.Tensor:
        """The ``rows`` seeds (int64) of the next sampling call at ``weight_version``."""
        if weight_version != self.version:
            self.version, self.calls = weight_version, 0
        call = self.calls
        self.calls += 1
        seeds = [row_seed(self.seed, weight_version, call, row) for row in range(rows)]
        return torch.tensor(seeds, dtype=torch.int64)

    def seeded(self, data: BatchedDataDict, greedy: bool, weight_version: int) -> BatchedDataDict:
        """``data`` with each row's seed under ``SEEDS_KEY`` (a shallow copy; the caller's
        batch is left as it is). Greedy batches, and batches that bring seeds of their own,
        are returned unchanged and count no call."""
        if greedy or SEEDS_KEY in data:
            return data
        out = BatchedDataDict(data)
        out[SEEDS_KEY] = self.next_call(weight_version, data.size)
        return out


def seeds_of(data: BatchedDataDict) -> list[int] | None:
    """Each row's seed, or None when the batch has none (the worker's own RNG samples)."""
    if SEEDS_KEY not in data:
        return None
    seeds = data[SEEDS_KEY]
    rows = len(data["input_ids"])  # (data.size would only say that the keys disagree)
    if not isinstance(seeds, torch.Tensor) or seeds.shape != (rows,):
        got = tuple(seeds.shape) if isinstance(seeds, torch.Tensor) else type(seeds).__name__
        raise ValueError(
            f"generate: {SEEDS_KEY} must be an int64 tensor of one seed per row ({rows}), got {got}"
        )
    return [int(s) for s in seeds.tolist()]
