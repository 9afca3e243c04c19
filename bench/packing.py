"""How much padding each way of micro-batching a long-tailed batch costs.

Run: ``uv run python bench/packing.py`` (a few seconds on a laptop CPU).

One global batch of 4096 sequences with seed-fixed lognormal lengths (median about 300 tokens,
clipped to [16, 8192]) is sharded over 8 data-parallel ranks with a budget of 16384 tokens per
micro-batch, and every sequence slot is aligned to a multiple of 16 tokens (as tensor or context
parallelism needs). Each line reports padding tokens per 100 real tokens, counting the tokens
the model actually processes that are not real:

- naive: plain contiguous shards cut into micro-batches of a fixed size in the original order,
  each padded to its longest sequence (rounded up to 16). The fixed size is the largest one
  that can never exceed the budget, ``budget // max_length``.
- dynamic batching: ``shard_by_batch_size(dynamic_batching_args=...)``; each micro-batch is
  padded to its longest sequence rounded up to 16.
- sequence packing (FFD, MFFD): ``shard_by_batch_size(sequence_packing_args=...)`` and
  ``pack_sequences`` on every bin. Only padding inside the packed rows counts, i.e. each
  sequence rounded up to 16; the unused capacity of a bin is not computed on and is not
  padding. The figure in parentheses adds what padding every rank's bin to the longest bin of
  the same step would cost, for kernels that need one shape across ranks.

The last line is the naive figure divided by the FFD packing figure.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_distributed.packing import pack_sequences

SEQUENCES, MIN_LEN, MAX_LEN = 4096, 16, 8192
RANKS, BUDGET, ALIGN = 8, 16384, 16


def make_batch() -> BatchedDataDict:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(300), 1.1, SEQUENCES), MIN_LEN, MAX_LEN).astype(int)
    # Only shapes matter here, so the token ids are zeros in the narrowest dtype.
    return BatchedDataDict(
        input_ids=torch.zeros(SEQUENCES, MAX_LEN, dtype=torch.uint8),
        input_lengths=torch.from_numpy(lengths),
    )


def round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def per_100(padded: int, real: int) -> float:
    return 100 * (padded - real) / real


def naive(batch: BatchedDataDict, real: int) -> tuple[float, int]:
    size = BUDGET // int(batch["input_lengths"].max())
    padded = steps = 0
    for shard in batch.shard_by_batch_size(RANKS):
        for mb in shard.make_microbatch_iterator(size):
            padded += mb.size * round_up(int(mb["input_lengths"].max()))
            steps += 1
    print(
        f"naive (micro-batch size {size}, original order): {per_100(padded, real):.2f} "
        f"padding tokens per 100 real tokens, {steps // RANKS} micro-batches per rank"
    )
    return per_100(padded, real), size


def dynamic(batch: BatchedDataDict, real: int) -> None:
    start = time.perf_counter()
    shards, _ = batch.shard_by_batch_size(
        RANKS,
        dynamic_batching_args={
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "max_tokens_per_microbatch": BUDGET,
            "sequence_length_round": ALIGN,
        },
    )
    seconds = time.perf_counter() - start
    padded = sum(
        mb["input_ids"].numel()
        for shard in shards
        for mb in shard.make_microbatch_iterator_with_dynamic_shapes()
    )
    steps = len(shards[0].micro_batch_indices[0])
    print(
        f"dynamic batching: {per_100(padded, real):.2f} padding tokens per 100 real tokens, "
        f"{steps} micro-batches per rank, planned in {seconds:.2f} s"
    )


def packing(batch: BatchedDataDict, real: int, algorithm: str, label: str) -> float:
    start = time.perf_counter()
    shards, _ = batch.shard_by_batch_size(
        RANKS,
        sequence_packing_args={
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "max_tokens_per_microbatch": BUDGET,
            "algorithm": algorithm,
            "sequence_length_pad_multiple": ALIGN,
        },
    )
    seconds = time.perf_counter() - start
    # row_tokens[rank][step]: tokens in the packed row that rank runs at that step.
    row_tokens = [
        [
            pack_sequences(mb["input_ids"], mb["input_lengths"], ALIGN).input_ids.shape[1]
            for mb in shard.make_microbatch_iterator_for_packable_sequences()
        ]
        for shard in shards
    ]
    padded = sum(map(sum, row_tokens))
    common = sum(RANKS * max(step) for step in zip(*row_tokens, strict=True))
    print(
        f"sequence packing {label}: {per_100(padded, real):.2f} padding tokens per 100 real "
        f"tokens, {len(row_tokens[0])} bins per rank, planned in {seconds:.2f} s "
        f"({per_100(common, real):.2f} if each step pads bins to a common length)"
    )
    return per_100(padded, real)


def main() -> None:
    batch = make_batch()
    lengths = batch["input_lengths"]
    real = int(lengths.sum())
    print(
        f"{SEQUENCES} sequences: median {int(lengths.median())}, mean {lengths.double().mean():.0f},"
        f" max {int(lengths.max())} tokens; {RANKS} ranks; {BUDGET} tokens per micro-batch; "
        f"slots aligned to {ALIGN}"
    )
    naive_padding, _ = naive(batch, real)
    dynamic(batch, real)
    ffd = packing(batch, real, "first_fit_decreasing", "FFD")
    packing(batch, real, "modified_first_fit_decreasing", "MFFD")
    print(f"naive/packing: {naive_padding / ffd:.1f}x less padding with packing")


if __name__ == "__main__":
    main()
