"""Llama: the decoder layer table that Qwen2 (and other Llama-shaped families) reuse."""

from __future__ import annotations

from typing import Any

from rl_models.megatron.family import GATE_UP, QKV, ROW, ModelFamily, Weight


def _qkv(kind: str) -> tuple[str, ...]:
    return tuple(f"self_attn.{p}_proj.{kind}" for p in "qkv")


#: One decoder layer. The q/k/v biases exist only where the family has them (Qwen2).
LAYER = (
    Weight("input_layernorm.weight", "input_layernorm.weight"),
    Weight("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    Weight("self_attention.linear_qkv.weight", _qkv("weight"), QKV),
    Weight("self_attention.linear_qkv.bias", _qkv("bias"), QKV, only_if="qkv_bias"),
    Weight("self_attention.linear_proj.weight", "self_attn.o_proj.weight", ROW),
    Weight("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), GATE_UP),
    Weight("mlp.linear_fc2.weight", "mlp.down_proj.weight", ROW),
)


def refuse_mlp_bias(config: Any) -> None:
    if getattr(config, "mlp_bias", False):
        raise ValueError("MLP biases are not supported")


def _check(config: Any) -> None:
    refuse_mlp_bias(config)
    # Llama's attention_bias also puts a bias on o_proj, which Megatron cannot hold without
    # biases on every linear layer.
    if getattr(config, "attention_bias", False):
        raise ValueError("Llama attention_bias (o_proj bias) is not supported")


FAMILY = ModelFamily("llama", model_types=("llama",), layer=LAYER, check_config=_check)
