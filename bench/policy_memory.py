"""Peak resident memory of the policy workers: building a model, and log-probs.

Each measurement is taken in fresh processes (so one cannot inherit another's peak), as the
growth of the process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``)
over its size just before:

1. **DTensor: building a model from config, per rank**, with 1 rank (the whole model in one
   process) and with 2 FSDP2 ranks (gloo), launched by ``torch.distributed.run``. Sharded, the
   model is built on the meta device and each rank materialises only its shards plus one
   module at a time; the full-model size is printed for scale.
2. **Megatron: building the same model, per rank** (in the isolated ``mcore`` environment),
   with 1 rank, 2 tensor-parallel ranks and 2 pipeline stages, from config (fresh weights)
   and from safetensors files. The baseline is what the worker did before: build the whole HF
   model on every rank, convert it and cut the rank's shard out (``shard_megatron``); ours
   allocates only the rank's ``GPTModel`` piece and fills it from slices (``loading.py``).
   From safetensors, the resident set also counts the pages of the memory-mapped files that
   were read (page cache, reclaimable): a column slice touches every page of its tensor.
3. **A training step whose loss needs log-probs** over one micro-batch with a large
   vocabulary, with the whole ``[tokens, vocab]`` logits (``logprob_chunk_size: null``, the
   previous path) and chunked (``logprob_chunk_size``, the default).

Prints each figure and the ratios last.

    uv run python bench/policy_memory.py [--skip-dtensor] [--skip-megatron]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

import torch

from rl_models.resident_memory import peak_since, reset_peak

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


def child_build() -> None:
    from rl_models.policy.dtensor_worker import DTensorPolicyWorker

    config = {
        "model": {"hf_config": BUILD_MODEL, "dtype": "float32"},
        "optimizer": {"name": "SGD", "kwargs": {"lr": 1e-3}},
        "train_global_batch_size": 2,
    }
    before = reset_peak()
    worker = DTensorPolicyWorker(config)
    peak = peak_since(before)
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
        loss_mask=torch.ones(ROWS, ROW_TOKENS),
    )
    before = reset_peak()
    worker.train(data, NLLLoss())
    print(json.dumps({"peak": peak_since(before)}), flush=True)


def _megatron_config(layout: str, source: str | None) -> dict:
    tp, pp = {"1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}[layout]
    model = {"path": source} if source else {"hf_config": BUILD_MODEL}
    return {
        "model": {**model, "dtype": "float32"},
        "backend": "megatron",
        "megatron": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp},
        "optimizer": {"name": "SGD", "kwargs": {"lr": 1e-3}},
        "train_global_batch_size": 2,
    }


def child_megatron(layout: str, source: str | None, whole: bool) -> None:
    """One rank's Megatron build: ours (the worker), or the whole-model baseline."""
    import torch.distributed as dist

    from rl_models.megatron import cpu_shim
    from rl_models.megatron.convert import GPTLayout, hf_to_megatron, shard_megatron
    from rl_models.megatron.parallel import ShardFiller, build_gpt, init_model_parallel
    from rl_models.megatron.worker import MegatronPolicyWorker
    from rl_models.modeling.build import build_model
    from rl_models.policy.base_worker import init_distributed
    from rl_models.policy.config import PolicyConfig

    config = PolicyConfig.model_validate(_megatron_config(layout, source))
    if not whole:
        before = reset_peak()
        worker = MegatronPolicyWorker(config)
        peak = peak_since(before)
        piece = sum(p.numel() * p.element_size() for p in worker.model.parameters())
        print(json.dumps({"rank": worker.rank, "peak": peak, "piece": piece}), flush=True)
        worker.shutdown()
        return
    init_distributed(torch.device("cpu"), always=True)
    cpu_shim.apply()
    r = init_model_parallel(config.megatron)
    before = reset_peak()
    hf = build_model(config.model, config.seed)  # the whole model, on every rank
    layout_ = GPTLayout.from_hf_config(hf.config)
    full = hf_to_megatron(hf.state_dict(), layout_)
    shard = shard_megatron(full, layout_, tp=r.tp, tp_rank=r.tp_rank, pp=r.pp, pp_rank=r.pp_rank)
    gpt = build_gpt(hf.config, config.model.torch_dtype, config.megatron)
    del hf, full
    fill = ShardFiller(gpt)
    for name, tensor in shard.items():
        fill(name, tensor)
    del shard
    peak = peak_since(before)
    print(json.dumps({"rank": dist.get_rank(), "peak": peak}), flush=True)
    dist.destroy_process_group()


def _mcore_python() -> str:
    from rl_distributed.venvs import ensure_env, registry

    return ensure_env(registry.get("mcore"))


def _save_build_model(folder: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = dict(BUILD_MODEL)
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)


def megatron_main() -> list[str]:
    """Per-rank build peaks, baseline and ours, for each layout and source; ratio lines."""
    import tempfile

    python = _mcore_python()
    ratios = []
    with tempfile.TemporaryDirectory() as folder:
        _save_build_model(folder)
        for source, path in (("config", None), ("safetensors", folder)):
            one_rank = None
            for layout in ("1", "tp2", "pp2"):
                ranks = 1 if layout == "1" else 2
                extra = ["--layout", layout] + (["--source", path] if path else [])
                base = sorted(_run(["--child", "megatron-whole", *extra], ranks, python), key=_rank)
                ours = sorted(_run(["--child", "megatron", *extra], ranks, python), key=_rank)
                base_peak = max(r["peak"] for r in base)
                ours_peak = max(r["peak"] for r in ours)
                name = f"megatron from {source}, {'1 rank' if ranks == 1 else layout}"
                print(
                    f"{name}: model piece per rank "
                    + ", ".join(f"{r['piece'] / MB:,.0f}" for r in ours)
                    + " MiB; peak per rank: whole-model build "
                    + ", ".join(f"+{r['peak'] / MB:,.0f}" for r in base)
                    + " MiB, ours "
                    + ", ".join(f"+{r['peak'] / MB:,.0f}" for r in ours)
                    + " MiB"
                )
                ratios.append(f"{name}, peak ours / whole-model build: {ours_peak / base_peak:.2f}")
                if one_rank is None:
                    one_rank = ours_peak
                else:
                    ratios.append(
                        f"megatron from {source}, ours, {layout} / 1 rank: "
                        f"{ours_peak / one_rank:.2f}"
                    )
    return ratios


def _rank(r: dict) -> int:
    return r["rank"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str], ranks: int | None = None, python: str = sys.executable) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if ranks is None:
        cmd = [python, __file__, *args]
    else:
        cmd = [python, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
        cmd += [f"--master-port={_free_port()}", __file__, *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main(skip_dtensor: bool, skip_megatron: bool) -> None:
    megatron = [] if skip_megatron else megatron_main()
    if skip_dtensor:
        print("\n".join(megatron))
        return
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
    print("\n".join(megatron))
    print(f"build peak per rank, 2 ranks / 1 rank: {two_peak / one[0]['peak']:.2f}")
    print(f"log-prob step peak, chunked / whole: {chunked['peak'] / whole['peak']:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", choices=["build", "logprobs", "megatron", "megatron-whole"])
    parser.add_argument("--chunk", default="none")
    parser.add_argument("--layout", default="1")
    parser.add_argument("--source", default=None)
    parser.add_argument("--skip-dtensor", action="store_true")
    parser.add_argument("--skip-megatron", action="store_true")
    args = parser.parse_args()
    if args.child == "build":
        child_build()
    elif args.child in ("megatron", "megatron-whole"):
        child_megatron(args.layout, args.source, whole=args.child == "megatron-whole")
    elif args.child == "logprobs":
        child_logprobs(None if args.chunk == "none" else int(args.chunk))
    else:
        main(args.skip_dtensor, args.skip_megatron)
