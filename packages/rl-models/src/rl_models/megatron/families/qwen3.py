"""Qwen3 (dense): Llama's layer plus RMS norms over each query and key head (Megatron's
``qk_layernorm``), applied before the rotary embedding in both; no q/k/v biases."""

from __future__ import annotations

from typing import Any

from rl_models.megatron.families.llama import LAYER, refuse_mlp_bias
from rl_models.megatron.family import ModelFamily, Weight

#: The per-head query/key norms (one weight of ``head_dim`` each, shared by all heads).
QK_NORMS = (
    Weight("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
    Weight("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
)


def refuse_attention_bias(config: Any) -> None:
    # Qwen3's attention_bias puts biases on q/k/v *and* o_proj; Megatron has no o_proj bias
    # without biases on every linear layer.
    if getattr(config, "attention_bias", False):
        raise ValueError("Qwen3 attention_bias (q/k/v and o_proj biases) is not supported")


def _check(config: Any) -> None:
    refuse_mlp_bias(config)
    refuse_attention_bias(config)


FAMILY = ModelFamily(
    "qwen3", model_types=("qwen3",), layer=(*LAYER, *QK_NORMS), check_config=_check
)
