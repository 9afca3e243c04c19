"""Rewards per second: the environment's worker pool against what a user would write instead.

    uv run python bench/envs.py [--task code|math|both] [--workers 2]

For each task the same samples are scored with the same verifier function three ways:

* a plain loop in one process;
* a plain ``multiprocessing.Pool`` of ``--workers`` processes (``pool.map`` in chunks): the
  obvious parallel version, with no Ray and no per-sample timeouts;
* the environment (``CodeEnvironment`` / ``MathEnvironment``): Ray worker actors, each with a
  verifier process, every sample under its own timeout and, for code, in its own sandbox.

``code`` scores model-like programs (right, wrong, crashing) against function-call and
stdin/stdout cases in the bubblewrap sandbox; ``math`` scores LaTeX answers with math-verify.
Targets: at least 1.5x the loop, at least 0.9x the ``multiprocessing.Pool`` (printed last):
isolation and per-sample timeouts must not cost throughput.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import time
from collections.abc import Callable
from typing import Any

import ray

from rl_distributed.virtual_cluster import init_ray
from rl_envs.code.env import CodeEnvConfig, CodeEnvironment
from rl_envs.math_env import MathEnvConfig, MathEnvironment
from rl_envs.verifiers import score_code, score_math

LIMITS = {"cpu_time_s": 2, "case_time_s": 4.0, "wall_time_s": 10.0}
PROGRAMS = {  # what a policy writes: right, subtly wrong, crashing
    "right": "def solve(xs):\n    return sorted(xs)[len(xs) // 2]\n"
    "if __name__ == '__main__':\n    print(solve(list(map(int, input().split()))))\n",
    "wrong": "def solve(xs):\n    return sorted(xs)[0]\n"
    "if __name__ == '__main__':\n    print(solve(list(map(int, input().split()))))\n",
    "crash": "def solve(xs):\n    return xs[len(xs)]\n",
}


def code_samples(n: int, rng: random.Random) -> tuple[list[list[dict]], list[dict]]:
    logs, metadata = [], []
    for _ in range(n):
        tests = []
        for _ in range(3):
            xs = [rng.randint(-50, 50) for _ in range(rng.choice([3, 5, 7]))]
            median = sorted(xs)[len(xs) // 2]
            tests.append({"function": "solve", "args": [xs], "expected": median})
        xs = [rng.randint(-50, 50) for _ in range(5)]
        tests.append({"stdin": " ".join(map(str, xs)) + "\n", "stdout": str(sorted(xs)[2])})
        program = PROGRAMS[rng.choice(list(PROGRAMS))]
        response = f"Sort and take the middle:\n```python\n{program}```"
        logs.append([{"role": "user", "content": "q"}, {"role": "assistant", "content": response}])
        metadata.append({"tests": tests})
    return logs, metadata


def math_samples(n: int, rng: random.Random) -> tuple[list[list[dict]], list[dict]]:
    logs, metadata = [], []
    for _ in range(n):
        a, b = rng.randint(1, 99), rng.randint(2, 99)
        shown = f"\\frac{{{a}}}{{{b}}}" if rng.random() < 0.5 else f"\\frac{{{a + 1}}}{{{b}}}"
        response = (
            f"Adding up the parts gives $x = {shown}$, so the answer is $\\boxed{{{shown}}}$."
        )
        logs.append([{"role": "user", "content": "q"}, {"role": "assistant", "content": response}])
        metadata.append({"ground_truth": f"{a}/{b}"})
    return logs, metadata


def score_code_sample(sample: tuple[list[dict], dict]) -> float:
    log, meta = sample
    return score_code(log[1]["content"], meta["tests"], LIMITS)[0]


def score_math_sample(sample: tuple[list[dict], dict]) -> float:
    log, meta = sample
    return score_math(log[1]["content"], meta["ground_truth"])[0]


TASKS: dict[str, tuple[Callable[..., Any], Callable[..., float], Callable[[int], Any], int]] = {
    "code": (
        code_samples,
        score_code_sample,
        lambda w: CodeEnvironment(
            CodeEnvConfig(num_workers=w, num_cpus_per_worker=1, sandbox=LIMITS, timeout_s=30)
        ),
        120,
    ),
    "math": (
        math_samples,
        score_math_sample,
        lambda w: MathEnvironment(MathEnvConfig(num_workers=w, num_cpus_per_worker=1)),
        1000,
    ),
}


def bench(task: str, workers: int, n: int | None) -> tuple[float, float]:
    make, score_one, make_env, default_n = TASKS[task]
    logs, metadata = make(n or default_n, random.Random(0))
    samples = list(zip(logs, metadata, strict=True))
    env = make_env(workers)
    env.step(logs[: 4 * workers], metadata[: 4 * workers])  # warm the workers
    time.sleep(3)  # let Ray's own start-up work settle: all three then share the same machine

    score_one(samples[0])  # imports and caches warm
    start = time.perf_counter()
    loop = [score_one(s) for s in samples]
    loop_rate = len(samples) / (time.perf_counter() - start)
    print(f"{task}: plain loop, 1 process:           {loop_rate:8.1f} rewards/s")

    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pool.map(score_one, samples[:workers])  # imports
        start = time.perf_counter()
        pooled = pool.map(score_one, samples, chunksize=max(1, len(samples) // (4 * workers)))
        mp_rate = len(samples) / (time.perf_counter() - start)
    print(f"{task}: multiprocessing.Pool({workers}):          {mp_rate:8.1f} rewards/s")

    start = time.perf_counter()
    out = env.step(logs, metadata)
    env_rate = len(samples) / (time.perf_counter() - start)
    print(f"{task}: environment, {workers} workers:           {env_rate:8.1f} rewards/s")
    env.shutdown()
    assert out.rewards.tolist() == loop == pooled, "the three ways disagree"
    print(f"{task}: mean reward {sum(loop) / len(loop):.3f} over {len(loop)} samples")
    return env_rate / loop_rate, env_rate / mp_rate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", choices=["code", "math", "both"], default="both")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=None)
    args = parser.parse_args()
    tasks = ["math", "code"] if args.task == "both" else [args.task]
    init_ray(num_cpus=args.workers + 1, log_to_driver=False)
    ratios = {task: bench(task, args.workers, args.samples) for task in tasks}
    ray.shutdown()
    for task, (over_loop, _) in ratios.items():
        print(f"{task}: environment / plain loop: {over_loop:.2f}x (target >= 1.5x)")
    for task, (_, over_pool) in ratios.items():
        print(f"{task}: environment / multiprocessing.Pool: {over_pool:.2f}x (target >= 0.9x)")


if __name__ == "__main__":
    main()
