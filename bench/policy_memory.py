"""Peak resident memory of the DTensor policy worker: building a model, and log-probs.

Two measurements, each taken in fresh processes (so one cannot inherit another's peak), as
the growth of the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs``) over its size just before:

1. **Building a model from config, per rank**, with 1 rank (the whole model in one process)
   and with 2 FSDP2 ranks (gloo), launched by ``torch.distributed.run``. Sharded, the model is
   built on the meta device and each rank materialises only its shards plus one module at a
   time; the full-model size is printed for scale.
2. **A training step whose loss needs log-probs** over one micro-batch with a large
   vocabulary, with the whole ``[tokens, vocab]`` logits (``logprob_chunk_size: null``, the
   previous path) and chunked (``logprob_chunk_size``, the default).

Prints each figure and the ratios last.

    uv run python bench/policy_memory.py
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys

import torch

# ~170M parameters: 680 MB of float32 weights, most in the decoder layers.
BUILD_MODEL = {
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}
# Tiny layers, big vocabulary: the output layer's logits dominate the step's memory.
LOGPROB_MODEL = {
    **BUILD_MODEL,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 32768,
    "max_position_embeddings": 4096,
}
ROWS, ROW_TOKENS, CHUNK = 4, 1024, 1024
MB = 2**20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> int:
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def child_build() -> None:
    from rl_models.policy.dtensor_worker import DTensorPolicyWorker

    config = {
        "model": {"hf_config": BUILD_MODEL, "dtype": "float32"},
        "optimizer": {"name": "SGD", "kwargs": {"lr": 1e-3}},
        "train_global_batch_size": 2,
    }
    before = _reset_peak()
    worker = DTensorPolicyWorker(config)
    peak = _status("VmHWM") - before
    full = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    print(json.dumps({"rank": worker.rank, "peak": peak, "full": full}), flush=True)
    worker.shutdown()


def child_logprobs(chunk: int | None) -> None:
    from rl_distributed.batched_data_dict import BatchedDataDict
    from rl_models.losses import NLLLoss
    from rl_models.policy.dtensor_worker import DTensorPolicyWorker

    config = {
        "model": {"hf_config": LOGPROB_MODEL, "dtype": "float32"},
        "optimizer": {"name": "SGD", "kwargs": {"lr": 1e-3}},
        "train_global_batch_size": ROWS,
        "train_micro_batch_size": ROWS,
        "logprob_chunk_size": chunk,
    }
    worker = DTensorPolicyWorker(config)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, LOGPROB_MODEL["vocab_size"], (ROWS, ROW_TOKENS), generator=gen)
    data = BatchedDataDict(
        input_ids=ids,
        input_lengths=torch.full((ROWS,), ROW_TOKENS),
        token_mask=torch.ones(ROWS, ROW_TOKENS),
    )
    before = _reset_peak()
    worker.train(data, NLLLoss())
    print(json.dumps({"peak": _status("VmHWM") - before}), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str], ranks: int | None = None) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if ranks is None:
        cmd = [sys.executable, __file__, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
        cmd += [f"--master-port={_free_port()}", __file__, *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    one = _run(["--child", "build"], ranks=1)
    two = _run(["--child", "build"], ranks=2)
    full = one[0]["full"]
    print(f"model built from config: {full / MB:,.0f} MiB of float32 weights")
    print(f"build, 1 rank: peak +{one[0]['peak'] / MB:,.0f} MiB")
    two_peak = max(r["peak"] for r in two)
    for r in sorted(two, key=lambda r: r["rank"]):
        print(f"build, 2 ranks: rank {r['rank']} peak +{r['peak'] / MB:,.0f} MiB")

    tokens = ROWS * ROW_TOKENS
    logits = tokens * LOGPROB_MODEL["vocab_size"] * 4
    print(
        f"train step over {tokens} tokens, vocabulary {LOGPROB_MODEL['vocab_size']}: "
        f"one float32 [tokens, vocab] tensor is {logits / MB:,.0f} MiB"
    )
    [whole] = _run(["--child", "logprobs", "--chunk", "none"])
    print(f"log-probs from whole logits: peak +{whole['peak'] / MB:,.0f} MiB")
    [chunked] = _run(["--child", "logprobs", "--chunk", str(CHUNK)])
    print(f"log-probs in chunks of {CHUNK} tokens: peak +{chunked['peak'] / MB:,.0f} MiB")
    print(f"build peak per rank, 2 ranks / 1 rank: {two_peak / one[0]['peak']:.2f}")
    print(f"log-prob step peak, chunked / whole: {chunked['peak'] / whole['peak']:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", choices=["build", "logprobs"])
    parser.add_argument("--chunk", default="none")
    args = parser.parse_args()
    if args.child == "build":
        child_build()
    elif args.child == "logprobs":
        child_logprobs(None if args.chunk == "none" else int(args.chunk))
    else:
        main()
