"""Scoring one GRPO group of math answers: CPU and wall time of a step of the math environment,
its answers sent one per call versus in the pool's default chunks.

Asynchronous GRPO scores each group as it finishes, so its environment maps 8 answers at a
time over two verifier workers. Baseline: one call a sample (``chunk_size: 1``, which the pool
used to choose for a map this small: a quarter of a worker's share). Ours: the default chunks
(``rl_envs.pool.chunk_ranges``: at least four samples a call while every worker still gets
one, so two calls of four). CPU time is summed over this process, the verifier workers, their
verifier processes, the raylet and the GCS. Alternating rounds, each in the same Ray cluster;
the median of the rounds' ratios (baseline CPU over ours) is printed last.

    uv run python bench/verifier_pool.py [--groups 150] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import psutil

from rl_distributed import init_ray
from rl_envs.math_env import MathEnvConfig, MathEnvironment

# The processes a group's scoring runs in, besides this one.
SCORING_PROCESSES = ("VerifierWorker", "rl_envs._child", "raylet", "gcs_server")


def scoring_cpu_seconds() -> float:
    total = 0.0
    for process in psutil.process_iter(["cmdline", "cpu_times"]):
        command = " ".join(process.info["cmdline"] or [])
        if process.pid == os.getpid() or any(name in command for name in SCORING_PROCESSES):
            times = process.info["cpu_times"]
            total += times.user + times.system
    return total


def time_groups(env: MathEnvironment, groups: int) -> tuple[float, float]:
    """Milliseconds of CPU and of wall time per group of 8 answers (a third of them right)."""
    logs = [
        [
            {"role": "user", "content": "What is 1 + 1?"},
            {"role": "assistant", "content": f"The answer is \\boxed{{{i % 3}}}."},
        ]
        for i in range(8)
    ]
    metadata = [{"ground_truth": "2"}] * 8
    for _ in range(10):  # warm both workers' verifier processes
        env.step(logs, metadata)
    cpu, wall = scoring_cpu_seconds(), time.perf_counter()
    for _ in range(groups):
        rewards = env.step(logs, metadata).rewards
    cpu, wall = scoring_cpu_seconds() - cpu, time.perf_counter() - wall
    assert rewards.tolist() == [0.0, 0.0, 1.0] * 2 + [0.0, 0.0], rewards
    return 1000 * cpu / groups, 1000 * wall / groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    init_ray(num_cpus=4, log_to_driver=False)
    envs = {
        "one call a sample": MathEnvironment(MathEnvConfig(num_workers=2, chunk_size=1)),
        "default chunks": MathEnvironment(MathEnvConfig(num_workers=2)),
    }
    ratios = []
    for round_ in range(args.rounds):
        order = list(envs) if round_ % 2 == 0 else list(reversed(envs))
        cpu = {}
        for name in order:
            cpu[name], wall = time_groups(envs[name], args.groups)
            print(f"round {round_ + 1}, {name}: {cpu[name]:.1f} ms CPU, {wall:.1f} ms wall a group")
        ratios.append(cpu["one call a sample"] / cpu["default chunks"])
    for env in envs.values():
        env.shutdown()
    print(f"CPU a group, one call a sample / default chunks: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
