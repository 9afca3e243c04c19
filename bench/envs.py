"""Math-verify rewards per second: the environment's worker-actor pool versus a plain loop.

    uv run python bench/envs.py [--samples 400] [--workers 2]

Both sides score the same responses against the same ground truths with the same function
(``rl_envs.verifiers.score_math``); the pool gets the batch in chunks (one RPC per chunk).
For scale it also times the same work on a bare ``multiprocessing.Pool`` of as many processes,
no Ray and no timeouts: the most this machine gives for this work. The last line is the
speed-up of the environment over the loop.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import time

import ray

from rl_distributed.virtual_cluster import init_ray
from rl_envs.math_env import MathEnvConfig, MathEnvironment
from rl_envs.verifiers import score_math


def make_samples(n: int, seed: int = 0) -> tuple[list[list[dict]], list[dict]]:
    rng = random.Random(seed)
    logs, metadata = [], []
    for _ in range(n):
        a, b = rng.randint(1, 99), rng.randint(2, 99)
        right = rng.random() < 0.5
        shown = f"\\frac{{{a}}}{{{b}}}" if right else f"\\frac{{{a + 1}}}{{{b}}}"
        response = (
            f"Adding up the parts gives $x = {shown}$, so the answer is $\\boxed{{{shown}}}$."
        )
        logs.append([{"role": "user", "content": "q"}, {"role": "assistant", "content": response}])
        metadata.append({"ground_truth": f"{a}/{b}"})
    return logs, metadata


def _score(sample: tuple[list[dict], dict]) -> float:
    log, meta = sample
    return score_math(log[1]["content"], meta["ground_truth"])[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    logs, metadata = make_samples(args.samples)

    init_ray(num_cpus=args.workers + 1, log_to_driver=False)
    env = MathEnvironment(MathEnvConfig(num_workers=args.workers, num_cpus_per_worker=1))
    env.step(logs[: 4 * args.workers], metadata[: 4 * args.workers])  # warm the workers
    time.sleep(5)  # let Ray's own start-up work finish: both sides then share the same machine

    score_math(logs[0][1]["content"], metadata[0]["ground_truth"])  # imports, caches warm
    start = time.perf_counter()
    loop = [
        score_math(log[1]["content"], m["ground_truth"])[0]
        for log, m in zip(logs, metadata, strict=True)
    ]
    loop_rate = len(logs) / (time.perf_counter() - start)
    print(f"plain loop, 1 process:      {loop_rate:8.1f} rewards/s")

    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        pool.map(_score, [(logs[0], metadata[0])] * args.workers)  # imports
        start = time.perf_counter()
        pool.map(
            _score,
            list(zip(logs, metadata, strict=True)),
            chunksize=max(1, len(logs) // (4 * args.workers)),
        )
        bare_rate = len(logs) / (time.perf_counter() - start)
    print(
        f"bare multiprocessing, {args.workers}:  {bare_rate:8.1f} rewards/s (no Ray, no timeouts)"
    )

    start = time.perf_counter()
    out = env.step(logs, metadata)
    pool_rate = len(logs) / (time.perf_counter() - start)
    print(f"environment, {args.workers} workers:     {pool_rate:8.1f} rewards/s")
    assert out.rewards.tolist() == loop, "the pool and the loop disagree"
    env.shutdown()
    ray.shutdown()
    print(f"speed-up: {pool_rate / loop_rate:.2f}x")


if __name__ == "__main__":
    main()
