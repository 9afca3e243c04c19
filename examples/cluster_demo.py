"""A tour of the cluster primitives: reserve CPUs, start a worker group, train data-parallel.

    uv run python examples/cluster_demo.py [--workers 2] [--steps 20]

Starts a local Ray cluster (or attaches to RAY_ADDRESS), reserves one CPU bundle per worker,
starts the workers from a class path (the driver never imports the class), and trains a linear
regression with torch.distributed (gloo) DDP, each worker taking its shard of every batch.
"""

from __future__ import annotations

import argparse

import torch

from rl_distributed import NamedSharding, RayVirtualCluster, RayWorkerBuilder, RayWorkerGroup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    cluster = RayVirtualCluster([args.workers], use_gpus=False, name="demo")
    print(cluster)
    group = RayWorkerGroup(
        cluster,
        RayWorkerBuilder("rl_distributed.testing.DataParallelRegressor", dim=4, lr=0.2),
        name_prefix="regressor",
        sharding_annotations=NamedSharding(list(range(args.workers)), ["data_parallel"]),
    )
    for meta in group.worker_metadata:
        print(f"  {meta.describe()} bundle {meta.bundle_index}")

    true_w = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        x = torch.randn(32 * args.workers, 4, generator=gen, dtype=torch.float64)
        y = x @ true_w + 0.1 * torch.randn(len(x), generator=gen, dtype=torch.float64)
        futures = group.run_all_workers_sharded_data(
            "train_step",
            in_sharded_axes=["data_parallel"],
            x=x.chunk(args.workers),
            y=y.chunk(args.workers),
        )
        losses = group.get_all_worker_results(futures)
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss per rank {[round(v, 4) for v in losses]}")

    weights = group.call_all("weights")
    print("learned weight (rank 0):", [round(v, 3) for v in weights[0]["weight"][0].tolist()])
    print("true weight:            ", true_w.tolist())
    group.shutdown(cleanup_method="close")
    cluster.shutdown()


if __name__ == "__main__":
    main()
