"""Per-call latency of RayWorkerGroup dispatch versus raw Ray actor handles.

Both sides drive two CPU workers of the same class on the same placement-group bundles, in
one process, in alternating rounds (so drift in machine load hits both alike). One call =
send a small keyword call to every worker and wait for all results.

    uv run python bench/dispatch.py [--calls 2000] [--rounds 5]

Target: ratio (ours / raw) <= 1.2.
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_distributed import RayVirtualCluster, RayWorkerBuilder, RayWorkerGroup, init_ray
from rl_distributed.testing import EchoWorker


def time_calls(call, n: int) -> float:
    call()  # warm the path
    start = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    init_ray(num_cpus=4, log_to_driver=False)
    cluster = RayVirtualCluster([2], use_gpus=False, max_colocated_worker_groups=2)
    group = RayWorkerGroup(cluster, RayWorkerBuilder("rl_distributed.testing.EchoWorker"))
    pg = cluster.get_placement_groups()[0]
    raw_actors = [
        ray.remote(EchoWorker)
        .options(
            num_cpus=0.5,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=i
            ),
        )
        .remote()
        for i in range(2)
    ]
    ray.get([a.ping.remote() for a in raw_actors])

    def ours():
        return group.call_all("echo", step=1)

    def raw():
        return ray.get([a.echo.remote(step=1) for a in raw_actors])

    assert ours() == raw()
    ours_s, raw_s = [], []
    for _ in range(args.rounds):
        raw_s.append(time_calls(raw, args.calls))
        ours_s.append(time_calls(ours, args.calls))
    ours_t, raw_t = statistics.median(ours_s), statistics.median(raw_s)

    group.shutdown()
    cluster.shutdown()
    ray.shutdown()
    print(f"raw Ray actor handles:       {raw_t * 1e6:8.1f} us per call over 2 workers")
    print(f"run_all_workers_single_data: {ours_t * 1e6:8.1f} us per call over 2 workers")
    print(f"ratio ours/raw: {ours_t / raw_t:.3f} (target <= 1.2)")


if __name__ == "__main__":
    main()
