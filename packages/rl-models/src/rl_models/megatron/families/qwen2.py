"""Qwen2: Llama's layer with biases on the q, k and v projections (none on o_proj)."""

from __future__ import annotations

from rl_models.megatron.families.llama import LAYER, refuse_mlp_bias
from rl_models.megatron.family import ModelFamily

FAMILY = ModelFamily(
    "qwen2", model_types=("qwen2",), layer=LAYER, qkv_bias=True, check_config=refuse_mlp_bias
)
