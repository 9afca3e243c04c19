"""HF <-> Megatron weight conversion: pure torch, so it runs without megatron-core."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rl_models.megatron.convert import GPTLayout, hf_to_megatron, megatron_to_hf

from .conftest import TINY_LLAMA

QWEN2 = {**TINY_LLAMA, "model_type": "qwen2", "tie_word_embeddings": True}


def hf_model(spec: dict, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = {**spec, **overrides}
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64)


@pytest.mark.parametrize(
    "spec,overrides",
    [(TINY_LLAMA, {}), (TINY_LLAMA, {"tie_word_embeddings": True}), (QWEN2, {})],
    ids=["llama", "llama-tied", "qwen2-tied-qkv-bias"],
)
def test_round_trip_is_bit_exact(spec, overrides):
    model = hf_model(spec, **overrides)
    layout = GPTLayout.from_hf_config(model.config)
    hf = model.state_dict()
    meg = hf_to_megatron(hf, layout)
    layers = TINY_LLAMA["num_hidden_layers"]
    per_layer = 6 + (1 if layout.qkv_bias else 0)  # 2 norms, qkv, proj, fc1, fc2 (+ qkv bias)
    assert len(meg) == 2 + per_layer * layers + (0 if layout.tied_embeddings else 1)
    assert ("output_layer.weight" in meg) is not layout.tied_embeddings
    back = megatron_to_hf(meg, layout)
    assert set(back) == set(hf) | {"lm_head.weight"}
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    if layout.tied_embeddings:
        assert torch.equal(back["lm_head.weight"], hf["model.embed_tokens.weight"])


def test_qkv_rows_are_grouped_per_kv_head():
    """4 query heads, 2 key/value groups: rows [q0 q1 k0 v0 | q2 q3 k1 v1], bias alike."""
    layout = GPTLayout(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=3, qkv_bias=True)
    d, hidden = layout.head_dim, 5

    def labelled(kind: int, heads: int) -> torch.Tensor:
        # Row r of head h holds kind*100 + h*10 + r in every column.
        rows = torch.tensor([kind * 100 + h * 10 + r for h in range(heads) for r in range(d)])
        return rows[:, None].double().expand(-1, hidden).clone()

    q, k, v = labelled(1, 4), labelled(2, 2), labelled(3, 2)
    hf = {
        "model.embed_tokens.weight": torch.zeros(7, hidden),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": torch.zeros(7, hidden),
        "model.layers.0.input_layernorm.weight": torch.ones(hidden),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(hidden),
        "model.layers.0.self_attn.q_proj.weight": q,
        "model.layers.0.self_attn.k_proj.weight": k,
        "model.layers.0.self_attn.v_proj.weight": v,
        "model.layers.0.self_attn.q_proj.bias": q[:, 0],
        "model.layers.0.self_attn.k_proj.bias": k[:, 0],
        "model.layers.0.self_attn.v_proj.bias": v[:, 0],
        "model.layers.0.self_attn.o_proj.weight": torch.zeros(hidden, 4 * d),
        "model.layers.0.mlp.gate_proj.weight": torch.full((8, hidden), 1.0),
        "model.layers.0.mlp.up_proj.weight": torch.full((8, hidden), 2.0),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(hidden, 8),
    }
    meg = hf_to_megatron(hf, layout)
    qkv = meg["decoder.layers.0.self_attention.linear_qkv.weight"]
    heads = [int(qkv[i * d, 0]) // 10 for i in range(qkv.shape[0] // d)]
    assert heads == [10, 11, 20, 30, 12, 13, 21, 31]  # kind*10 + head
    assert torch.equal(meg["decoder.layers.0.self_attention.linear_qkv.bias"], qkv[:, 0])
    fc1 = meg["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1.shape == (16, hidden) and (fc1[:8] == 1).all() and (fc1[8:] == 2).all()


def test_unknown_weights_are_refused():
    model = hf_model(TINY_LLAMA)
    layout = GPTLayout.from_hf_config(model.config)
    hf = dict(model.state_dict())
    hf["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    with pytest.raises(ValueError, match="no Megatron counterpart"):
        hf_to_megatron(hf, layout)
    del hf["model.layers.0.self_attn.o_proj.bias"], hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="up_proj"):
        hf_to_megatron(hf, layout)
    with pytest.raises(ValueError, match="key/value groups"):
        GPTLayout(num_layers=1, num_heads=4, num_kv_heads=3, head_dim=8)
