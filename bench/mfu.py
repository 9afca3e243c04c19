"""Model FLOPs utilisation (MFU) of a packed training step of the DTensor policy worker.

The baseline is the device's own dense matmul rate, measured in the same process (a large
``A @ B`` in the compute dtype); ours is the FLOP rate of whole training steps (forward,
backward, optimiser) of a model built from config, on a length-skewed batch with sequence
packing. Training FLOPs are counted the usual way, without activation recomputation:
``6 * N_matmul * tokens + 6 * layers * d_attn * sum(len_i ** 2)`` (causal attention).
Prints the ratio (ours / measured matmul peak) last; on a known GPU also MFU against the
vendor's dense peak (H100/H200 SXM bf16: 989 TFLOP/s), the number the project's target is
stated in (>= 40% for a ~0.5B model on an H100).

    uv run python bench/mfu.py                  # tiny model, float32 (CPU smoke run)
    uv run python bench/mfu.py --model qwen2-0.5b --mixed-precision bfloat16   # on a GPU
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.losses import NLLLoss
from rl_models.policy.dtensor_worker import DTensorPolicyWorker

MODELS = {
    # The shape of Qwen2.5-0.5B (494M parameters), fresh weights.
    "qwen2-0.5b": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
    },
    "tiny": {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 4096,
        "max_position_embeddings": 4096,
    },
    # The smallest Llama with every part (bench/gpu_check.py's CI run on 2 CPU cores).
    "micro": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 1024,
    },
}
VENDOR_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}  # dense bf16


def skewed_lengths(n: int, longest: int, seed: int = 0) -> torch.Tensor:
    """Log-normal lengths, as RL rollouts have: many short, a few near ``longest``."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n, generator=gen) * 0.8) * longest / 6
    return lengths.clamp(16, longest).long()


def make_batch(lengths: torch.Tensor, vocab: int) -> BatchedDataDict:
    width = int(lengths.max())
    real = torch.arange(width)[None, :] < lengths[:, None]
    ids = torch.randint(1, vocab, (len(lengths), width)) * real
    return BatchedDataDict(input_ids=ids, input_lengths=lengths, loss_mask=real.float())


def training_flops(model: dict, n_matmul: int, lengths: torch.Tensor) -> float:
    d_attn = model["num_attention_heads"] * (model["hidden_size"] // model["num_attention_heads"])
    attention = 6 * model["num_hidden_layers"] * d_attn * float((lengths.double() ** 2).sum())
    return 6 * n_matmul * float(lengths.sum()) + attention


def matmul_params(worker: DTensorPolicyWorker) -> int:
    """Parameters that take part in a matmul: all but the embedding lookup (the output layer
    counts, also when it shares the embedding's weight)."""
    model = worker.model
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return total if tied else total - embedding


def measured_matmul_tflops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    start, repeats = time.perf_counter(), 10
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(
    model_name: str = "tiny",
    sequences: int = 64,
    longest: int | None = None,
    tokens_per_microbatch: int | None = None,
    mixed_precision: str | None = None,
    attn: str = "sdpa",
    activation_checkpointing: bool = False,
    steps: int = 3,
    matmul_size: int | None = None,
    report: Callable[[str], None] = print,
) -> float:
    """Time ``steps`` packed training steps, measure the matmul peak, ``report`` each result
    line and return training FLOP/s over the measured peak. ``bench/gpu_check.py`` runs it too."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = MODELS[model_name]
    longest = longest or (4096 if cuda else 512)
    budget = tokens_per_microbatch or (16384 if cuda else 1024)
    lengths = skewed_lengths(sequences, longest)
    data = make_batch(lengths, model["vocab_size"])
    worker = DTensorPolicyWorker(
        {
            "model": {"hf_config": model, "dtype": "float32", "attn_implementation": attn},
            "optimizer": {
                "name": "AdamW",
                "kwargs": {"lr": 1e-5, **({"fused": True} if cuda else {})},
            },
            "train_global_batch_size": sequences,
            "sequence_packing": {"enabled": True, "max_tokens_per_microbatch": budget},
            "mixed_precision": mixed_precision,
            "activation_checkpointing": activation_checkpointing,
        }
    )
    n_matmul = matmul_params(worker)
    flops = training_flops(model, n_matmul, lengths)
    report(
        f"device {torch.cuda.get_device_name() if cuda else 'cpu'}; model {model_name} "
        f"({n_matmul / 1e6:.0f}M matmul parameters); {sequences} sequences, "
        f"{int(lengths.sum())} tokens, lengths {int(lengths.min())}..{int(lengths.max())}; "
        f"packed rows of <= {budget} tokens; {flops / 1e12:.2f} TFLOP per step"
    )

    worker.train(data, NLLLoss())  # warm-up (allocator, kernels)
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        worker.train(data, NLLLoss())
    sync(device)
    step_s = (time.perf_counter() - start) / steps
    ours = flops / step_s / 1e12
    report(f"training: {step_s:.3f} s/step, {int(lengths.sum()) / step_s:,.0f} tokens/s")
    report(f"training: {ours:.2f} TFLOP/s")
    del worker
    if cuda:
        torch.cuda.empty_cache()

    compute_dtype = torch.bfloat16 if mixed_precision else torch.float32
    peak = measured_matmul_tflops(device, compute_dtype, matmul_size or (8192 if cuda else 1024))
    report(f"baseline: {peak:.2f} TFLOP/s for a dense {compute_dtype} matmul on this device")
    if cuda:
        name = torch.cuda.get_device_name()
        vendor = next((v for k, v in VENDOR_PEAK_TFLOPS.items() if k in name), None)
        if vendor and compute_dtype == torch.bfloat16:
            report(
                f"MFU against the {name} dense bf16 peak of {vendor} TFLOP/s: {ours / vendor:.1%}"
            )
    report(f"training / measured matmul peak: {ours / peak:.2f}x")
    return ours / peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", dest="model_name", choices=MODELS, default="tiny")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--longest", type=int, default=None, help="longest sequence")
    parser.add_argument("--tokens-per-microbatch", type=int, default=None)
    parser.add_argument("--mixed-precision", choices=["bfloat16"], default=None)
    parser.add_argument("--attn", default="sdpa", help="attn_implementation")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    run(**vars(parser.parse_args()))


if __name__ == "__main__":
    main()
