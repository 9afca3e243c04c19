"""Qwen3-MoE: Qwen3's attention (query/key norms) and a mixture-of-experts MLP in every layer.

The router (HF ``mlp.gate``) is Megatron's ``mlp.router``; each expert is a gated MLP like
Llama's, HF ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` (the checkpoint names, which
``from_pretrained``/``save_pretrained`` and vLLM use; transformers fuses them into 3-D tensors
in memory only). No shared experts. Routing, HF's: softmax over all experts, the top k, and
with ``norm_topk_prob`` those k renormalised (Megatron: softmax over the top k's logits, the
same numbers; without it, Megatron's ``moe_router_pre_softmax``).
"""

from __future__ import annotations

from typing import Any

from rl_models.megatron.families.qwen3 import QK_NORMS, refuse_attention_bias
from rl_models.megatron.family import EXPERT, GATE_UP, QKV, ROW, ModelFamily, Weight


def _qkv() -> tuple[str, ...]:
    return tuple(f"self_attn.{p}_proj.weight" for p in "qkv")


LAYER = (
    Weight("input_layernorm.weight", "input_layernorm.weight"),
    Weight("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    Weight("self_attention.linear_qkv.weight", _qkv(), QKV),
    Weight("self_attention.linear_proj.weight", "self_attn.o_proj.weight", ROW),
    *QK_NORMS,
    Weight("mlp.router.weight", "mlp.gate.weight"),
)

_EXPERT = f"mlp.experts.{EXPERT}."
#: One expert; tensor parallelism splits it like a dense MLP (expert tensor parallel = tp).
EXPERTS = (
    Weight(
        f"mlp.experts.local_experts.{EXPERT}.linear_fc1.weight",
        (f"{_EXPERT}gate_proj.weight", f"{_EXPERT}up_proj.weight"),
        GATE_UP,
    ),
    Weight(
        f"mlp.experts.local_experts.{EXPERT}.linear_fc2.weight", f"{_EXPERT}down_proj.weight", ROW
    ),
)


def _check(config: Any) -> None:
    refuse_attention_bias(config)
    # Dense layers in between (mlp_only_layers, decoder_sparse_step > 1) would need a second
    # layer spec and table; every Qwen3-MoE release has experts in every layer.
    if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
        raise ValueError(
            "Qwen3-MoE with dense layers (mlp_only_layers, decoder_sparse_step != 1) is not "
            "supported: every layer must be a mixture of experts"
        )


FAMILY = ModelFamily(
    "qwen3_moe",
    model_types=("qwen3_moe",),
    layer=LAYER,
    experts=EXPERTS,
    check_config=_check,
)
