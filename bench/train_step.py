"""Training-step throughput of three micro-batch layouts on a realistic length distribution.

Same model, same data, same process. One global batch of sequences with seed-fixed lognormal
lengths (as in ``bench/packing.py``: a long tail over a short median), trained with one
optimiser step per pass, three ways:

- fixed (baseline): micro-batches of a fixed number of rows in dataset order, each padded only
  to its own longest row, which is what a plain ``DataLoader`` with a padding collator gives;
- dynamic batching (baseline): rows sorted by length and cut into micro-batches under a token
  budget, each padded to its own longest row (``dynamic_batching``);
- sequence packing (ours): micro-batches packed into single rows under the same token budget
  (``sequence_packing``), no padding at all.

Prints real (non-padding) tokens per second for each, packing / dynamic, and last packing /
fixed.

    uv run python bench/train_step.py
"""

from __future__ import annotations

import time

import numpy as np
import torch

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.losses import NLLLoss
from rl_models.policy.dtensor_worker import DTensorPolicyWorker

MODEL = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 2048,
    "max_position_embeddings": 2048,
}
SEQUENCES, MEDIAN, SIGMA, MIN_LEN, MAX_LEN = 64, 150, 1.0, 16, 1024
FIXED_ROWS, TOKEN_BUDGET = 8, 2048


def make_batch(seed: int = 0) -> BatchedDataDict:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(MEDIAN), SIGMA, SEQUENCES), MIN_LEN, MAX_LEN)
    lengths_t = torch.from_numpy(lengths.astype(np.int64))
    width = int(lengths_t.max())
    real = torch.arange(width)[None, :] < lengths_t[:, None]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, MODEL["vocab_size"], (SEQUENCES, width), generator=gen) * real
    return BatchedDataDict(input_ids=ids, input_lengths=lengths_t, loss_mask=real.float())


def tokens_per_second(layout: dict, data: BatchedDataDict, repeats: int = 2) -> float:
    worker = DTensorPolicyWorker(
        {
            "model": {"hf_config": MODEL, "dtype": "float32"},
            "optimizer": {"name": "SGD", "kwargs": {"lr": 1e-3}},
            "train_global_batch_size": SEQUENCES,
            "train_micro_batch_size": FIXED_ROWS,
            **layout,
        }
    )
    worker.train(data, NLLLoss())  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        worker.train(data, NLLLoss())
    elapsed = (time.perf_counter() - start) / repeats
    return int(data["input_lengths"].sum()) / elapsed


def main() -> None:
    torch.manual_seed(0)
    data = make_batch()
    lengths = data["input_lengths"]
    print(
        f"batch: {SEQUENCES} sequences, {int(lengths.sum())} real tokens, lengths "
        f"{int(lengths.min())}..{int(lengths.max())} (median {int(lengths.median())}); fixed "
        f"micro-batches of {FIXED_ROWS} rows, dynamic/packed micro-batches of <= "
        f"{TOKEN_BUDGET} tokens; {torch.get_num_threads()} threads"
    )
    fixed = tokens_per_second({}, data)
    print(f"fixed micro-batches (dataset order, trimmed): {fixed:,.0f} tokens/s")
    dynamic = tokens_per_second(
        {"dynamic_batching": {"enabled": True, "train_mb_tokens": TOKEN_BUDGET}}, data
    )
    print(f"dynamic batching: {dynamic:,.0f} tokens/s")
    packed = tokens_per_second(
        {"sequence_packing": {"enabled": True, "max_tokens_per_microbatch": TOKEN_BUDGET}}, data
    )
    print(f"sequence packing: {packed:,.0f} tokens/s")
    print(f"packing / dynamic batching: {packed / dynamic:.2f}x")
    print(f"packing / fixed micro-batches: {packed / fixed:.2f}x")


if __name__ == "__main__":
    main()
