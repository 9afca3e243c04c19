"""Refit throughput: policy worker group -> generation worker group, versus a plain copy.

A ~100M-parameter Llama (float32, built from a config) lives in a DTensor policy worker group
and an HF generation worker group (separate workers on one node). Ours: ``refit`` with the
channel it picks itself (``--channel auto``): on one CPU node that is the shared-memory weight
region (``weight_transfer/shared_memory.py``: the policy ranks write the weights straight into a
``/dev/shm`` region whose views are the generator's parameters; three small Ray calls), bytes
moved per second. ``--channel object_store`` measures the bucketed object-store path instead
(export in ``--bucket-mb`` buckets, Ray's object store, load into the generator's parameters).
Baseline, in this process: ``dst.copy_(src)`` over tensors of the same shapes, the least any
refit must do (every byte written once into the generator's weights). Both sides are timed in
alternating rounds; each round gives a ratio, and the median of those is printed last.

    uv run python bench/refit.py [--rounds 3] [--bucket-mb 64] [--policy-ranks 1] [--channel auto]

Target: ratio (ours / plain) >= 0.5.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rl_distributed import RayVirtualCluster, init_ray
from rl_models.generation.hf_generation import HfGeneration
from rl_models.generation.refit import refit
from rl_models.modeling.build import build_model
from rl_models.policy.config import PolicyConfig
from rl_models.policy.lm_policy import Policy

LLAMA_100M = {
    "model_type": "llama",
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "vocab_size": 8192,
    "max_position_embeddings": 512,
}


def plain_copy_seconds(config: PolicyConfig) -> tuple[float, int]:
    """One pass of ``dst.copy_(src)`` over the model's tensors (warm destination)."""
    src = [t.detach() for t in build_model(config.model, config.seed).state_dict().values()]
    dst = [torch.empty_like(t) for t in src]
    for d, s in zip(dst, src, strict=True):  # first touch of the destination pages
        d.copy_(s)
    start = time.perf_counter()
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)
    return time.perf_counter() - start, sum(t.numel() * t.element_size() for t in src)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--policy-ranks", type=int, default=1)
    parser.add_argument(
        "--channel", default="auto", choices=["auto", "shared_memory", "object_store"]
    )
    args = parser.parse_args()
    if args.rounds < 1 or args.policy_ranks < 1 or args.bucket_mb < 1:
        parser.error("--rounds, --policy-ranks and --bucket-mb must be >= 1")

    config = PolicyConfig.model_validate(
        {"model": {"hf_config": LLAMA_100M}, "train_global_batch_size": 1}
    )
    params = sum(p.numel() for p in build_model(config.model, config.seed).parameters())
    init_ray(num_cpus=4, log_to_driver=False)
    policy_cluster = RayVirtualCluster([args.policy_ranks], use_gpus=False)
    gen_cluster = RayVirtualCluster([1], use_gpus=False)
    policy = Policy(policy_cluster, config)
    generation = HfGeneration(
        gen_cluster,
        {"backend": "hf", "colocated": False, "refit_bucket_bytes": args.bucket_mb * 2**20},
        model=config.model,
    )
    try:
        # warm-up: object-store pages, lazy allocations, the shared region's creation
        refit(policy, generation, channel=args.channel)
        ours, plain = [], []
        for _ in range(args.rounds):
            stats = refit(policy, generation, channel=args.channel)
            ours.append(stats.bytes / stats.seconds)
            seconds, nbytes = plain_copy_seconds(config)
            plain.append(nbytes / seconds)
    finally:
        generation.shutdown()
        policy.shutdown()
        policy_cluster.shutdown()
        gen_cluster.shutdown()

    gb = 1e9
    ratios = sorted(o / p for o, p in zip(ours, plain, strict=True))
    print(f"model: {params / 1e6:.1f}M parameters, {stats.bytes / 2**20:.0f} MiB float32")
    if stats.channel == "shared_memory":
        print("channel: shared_memory (one /dev/shm weight region, no buckets)")
    else:
        print(f"channel: {stats.channel}, {stats.buckets} buckets of <= {args.bucket_mb} MiB")
    print(
        f"ours  (refit, {args.policy_ranks} policy rank(s) -> 1 generator): "
        f"{statistics.median(ours) / gb:.2f} GB/s median of {args.rounds} rounds"
    )
    print(f"plain (dst.copy_(src), one process): {statistics.median(plain) / gb:.2f} GB/s")
    print(f"per-round ratios: {' '.join(f'{r:.2f}' for r in ratios)}")
    print(f"ratio ours/plain (median of rounds): {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
