"""Start-up time of a 2-worker group in a cached isolated environment vs the system one.

Also the cold build of that environment with uv (into a fresh cache folder). Groups are
started and shut down in alternating rounds in one process; medians are reported.

    uv run python bench/worker_startup.py [--rounds 5]

Target: cached isolated start <= 1.5x the system-environment start.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    # A fresh cache, so the cold build is really cold (set before Ray's workers start).
    os.environ["RL_ENV_CACHE_DIR"] = tempfile.mkdtemp(prefix="rl-bench-envs-")

    from rl_distributed import RayVirtualCluster, RayWorkerBuilder, RayWorkerGroup, init_ray
    from rl_distributed.venvs import define_env, ensure_env

    init_ray(num_cpus=4, log_to_driver=False)
    env = define_env("bench-isolated", requirements=["six==1.16.0"])
    start = time.perf_counter()
    ensure_env(env)
    cold_build = time.perf_counter() - start

    cluster = RayVirtualCluster([2], use_gpus=False)

    def start_group(python_env: str) -> float:
        builder = RayWorkerBuilder("rl_distributed.testing.EchoWorker").with_python_env(python_env)
        begin = time.perf_counter()
        group = RayWorkerGroup(cluster, builder)  # returns once every worker answered
        elapsed = time.perf_counter() - begin
        group.shutdown()
        return elapsed

    system, isolated = [], []
    for _ in range(args.rounds):
        system.append(start_group("system"))
        isolated.append(start_group("bench-isolated"))
    cluster.shutdown()

    system_s, isolated_s = statistics.median(system), statistics.median(isolated)
    print(f"cold build of the isolated environment (uv): {cold_build:6.2f} s")
    print(f"2-worker group start, system environment:    {system_s:6.2f} s")
    print(f"2-worker group start, cached isolated env:   {isolated_s:6.2f} s")
    print(f"ratio isolated/system: {isolated_s / system_s:.2f} (target <= 1.5)")


if __name__ == "__main__":
    main()
