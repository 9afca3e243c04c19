"""How much router replay narrows the generator/trainer log-prob gap on a tiny MoE model.

A tiny Qwen3-MoE (fresh weights from seed 0) samples with the HF sampler in bfloat16, recording
its routes; the DTensor policy scores the same tokens in float32, once routing by itself and
once replaying the generator's routes. The generator's bfloat16 rounding flips some tokens'
top-k experts in the trainer; replay removes those flips, and what is left is the rounding of
the rest of the model. Prints, over the sampled tokens: the share of (token, layer) routes the
trainer's own router chooses otherwise, and the mean and largest |log p_gen - log p_train| and
``token_mult_prob_error`` (mean of exp|diff|, 1 = equal) with replay off and on.

    uv run python bench/router_replay_mismatch.py
"""

from __future__ import annotations

import torch

from rl_distributed.batched_data_dict import BatchedDataDict
from rl_models.generation.config import SamplingConfig
from rl_models.generation.sampling import sample
from rl_models.modeling.build import build_model
from rl_models.modeling.moe_routes import NO_ROUTE, RouteRecorder
from rl_models.policy.config import PolicyConfig
from rl_models.policy.dtensor_worker import DTensorPolicyWorker

MODEL = {
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}
PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 16, 24, 48


def policy(replay: bool) -> DTensorPolicyWorker:
    config = {
        "model": {"hf_config": MODEL, "dtype": "float32"},
        "train_global_batch_size": PROMPTS,
        "train_micro_batch_size": PROMPTS,
        "router_replay": replay,
    }
    return DTensorPolicyWorker(PolicyConfig.model_validate(config))


def main() -> None:
    trainer, replaying = policy(False), policy(True)
    generator = build_model(trainer.config.model, trainer.config.seed).to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, MODEL["vocab_size"], (PROMPTS, PROMPT_TOKENS), generator=gen)
    lengths = torch.full((PROMPTS,), PROMPT_TOKENS)
    out = sample(
        generator,
        ids,
        lengths,
        SamplingConfig(max_new_tokens=NEW_TOKENS),
        row_seeds=list(range(PROMPTS)),
        record_routes=True,
    )
    total = lengths + out.generation_lengths
    batch = BatchedDataDict(
        input_ids=out.output_ids, input_lengths=total, routed_experts=out.routed_experts
    )
    pos = torch.arange(out.output_ids.shape[1])[None, :]
    sampled = (pos >= lengths[:, None]) & (pos < total[:, None])

    # The trainer's own choices, for the share of flipped routes.
    with RouteRecorder(trainer.model) as recorder, torch.no_grad():
        trainer.model(input_ids=out.output_ids, attention_mask=(pos < total[:, None]).long())
        own = recorder.take().view(out.routed_experts.shape)
    recorded = out.routed_experts.long()
    known = sampled[..., None] & (recorded[..., 0] != NO_ROUTE)
    flipped = (own.sort(-1).values != recorded.sort(-1).values).any(-1) & known
    print(f"sampled tokens: {int(sampled.sum())}")
    print(f"routes the float32 trainer chooses otherwise: {float(flipped.sum() / known.sum()):.2%}")

    for name, worker in (("replay off", trainer), ("replay on", replaying)):
        lp = worker.get_logprobs(batch)["logprobs"].double()
        gap = (out.logprobs.double() - lp).abs()[sampled]
        print(
            f"{name}: mean |dlogp| {float(gap.mean()):.3e}, max {float(gap.max()):.3e}, "
            f"token_mult_prob_error {float(gap.exp().mean()):.6f}"
        )


if __name__ == "__main__":
    main()
