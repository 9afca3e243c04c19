"""Training-step throughput with sequence packing vs plain padding, on a length-skewed batch.

Same model, same data, same process: a batch where a few long sequences sit among many short
ones, so padded micro-batches are mostly padding. Prints real (non-padding) tokens per second
for both, and the speed-up last.

    uv run python bench/train_step.py
"""

from __future__ import annotations

import time

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
    "max_position_embeddings": 1024,
}
BATCH, MICRO_BATCH, TOKEN_BUDGET = 32, 8, 1024


def skewed_batch(seed: int = 0) -> BatchedDataDict:
    """One long sequence in every eight; the rest short (as in RL rollouts of mixed length)."""
    gen = torch.Generator().manual_seed(seed)
    short = torch.randint(16, 64, (BATCH,), generator=gen)
    lengths = torch.where(torch.arange(BATCH) % 8 == 0, torch.tensor(512), short)
    width = int(lengths.max())
    real = torch.arange(width)[None, :] < lengths[:, None]
    ids = torch.randint(1, MODEL["vocab_size"], (BATCH, width), generator=gen) * real
    return BatchedDataDict(input_ids=ids, input_lengths=lengths, token_mask=real.float())


def tokens_per_second(packing: bool, data: BatchedDataDict, repeats: int = 2) -> float:
    worker = DTensorPolicyWorker(
        {
            "model": {"hf_config": MODEL, "dtype": "float32"},
            "optimizer": {"name": "SGD", "kwargs": {"lr": 1e-3}},
            "train_global_batch_size": BATCH,
            "train_micro_batch_size": MICRO_BATCH,
            "sequence_packing": {"enabled": packing, "max_tokens_per_microbatch": TOKEN_BUDGET},
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
    data = skewed_batch()
    lengths = data["input_lengths"]
    print(
        f"batch: {BATCH} sequences, {int(lengths.sum())} real tokens, lengths "
        f"{int(lengths.min())}..{int(lengths.max())}; padded micro-batches of {MICRO_BATCH}, "
        f"packed rows of <= {TOKEN_BUDGET} tokens"
    )
    padded = tokens_per_second(False, data)
    print(f"padded: {padded:,.0f} tokens/s")
    packed = tokens_per_second(True, data)
    print(f"packed: {packed:,.0f} tokens/s")
    print(f"packed / padded: {packed / padded:.2f}x")


if __name__ == "__main__":
    main()
