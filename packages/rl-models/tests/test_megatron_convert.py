"""HF <-> Megatron weight conversion: pure torch, so it runs without megatron-core."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rl_models.megatron.convert import (
    GPTLayout,
    hf_to_megatron,
    megatron_to_hf,
    padded_vocab_size,
    shard_megatron,
    stage_layers,
    unshard_megatron,
)

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


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize(
    "spec,overrides",
    [(TINY_LLAMA, {}), (TINY_LLAMA, {"tie_word_embeddings": True, "vocab_size": 127}), (QWEN2, {})],
    ids=["llama", "llama-tied-odd-vocab", "qwen2-tied-qkv-bias"],
)
def test_shard_then_unshard_is_bit_exact(spec, overrides, tp, pp):
    model = hf_model(spec, **overrides)
    layout = GPTLayout.from_hf_config(model.config)
    hf = model.state_dict()
    full = hf_to_megatron(hf, layout)
    shards = [
        [shard_megatron(full, layout, tp=tp, tp_rank=t, pp=pp, pp_rank=p) for t in range(tp)]
        for p in range(pp)
    ]
    vocab = padded_vocab_size(model.config.vocab_size, tp)
    first, last = shards[0][0], shards[-1][0]
    assert first["embedding.word_embeddings.weight"].shape[0] == vocab // tp
    assert ("output_layer.weight" in last) is (not layout.tied_embeddings or pp > 1)
    per_stage = layout.num_layers // pp
    for stage in shards:
        layers = {k.split(".")[2] for k in stage[0] if k.startswith("decoder.layers.")}
        assert layers == {str(i) for i in range(per_stage)}  # numbered from 0 on every stage
    if pp > 1:
        assert "embedding.word_embeddings.weight" not in last
        assert not any(k.startswith(("output_layer", "decoder.final")) for k in first)
    back = unshard_megatron(shards, layout)
    assert set(back) == set(full)
    for name, tensor in full.items():
        assert torch.equal(back[name], tensor), name
    hf_back = megatron_to_hf(back, layout)
    for name, tensor in hf.items():
        assert torch.equal(hf_back[name], tensor), name


def test_shards_match_a_hand_computation():
    """tp=2, pp=2, 2 layers, 4 query heads in 2 groups, vocab 5 (padded to 6)."""
    layout = GPTLayout(
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=1, qkv_bias=True, vocab_size=5
    )
    hidden, ffn = 2, 4
    layer = {
        # Rows q0..q3, k0 k1, v0 v1: values say which row they are.
        "self_attn.q_proj.weight": torch.tensor([[10.0, 10], [11, 11], [12, 12], [13, 13]]),
        "self_attn.k_proj.weight": torch.tensor([[20.0, 20], [21, 21]]),
        "self_attn.v_proj.weight": torch.tensor([[30.0, 30], [31, 31]]),
        "self_attn.q_proj.bias": torch.tensor([10.0, 11, 12, 13]),
        "self_attn.k_proj.bias": torch.tensor([20.0, 21]),
        "self_attn.v_proj.bias": torch.tensor([30.0, 31]),
        "self_attn.o_proj.weight": torch.arange(8.0).reshape(hidden, 4),
        "mlp.gate_proj.weight": torch.tensor([[1.0, 1], [2, 2], [3, 3], [4, 4]]),
        "mlp.up_proj.weight": torch.tensor([[5.0, 5], [6, 6], [7, 7], [8, 8]]),
        "mlp.down_proj.weight": torch.arange(8.0).reshape(hidden, ffn) + 100,
        "input_layernorm.weight": torch.ones(hidden),
        "post_attention_layernorm.weight": torch.full((hidden,), 2.0),
    }
    hf = {f"model.layers.{i}.{k}": v + i * 1000 for i in range(2) for k, v in layer.items()}
    hf["model.embed_tokens.weight"] = torch.arange(10.0).reshape(5, hidden)
    hf["lm_head.weight"] = -torch.arange(10.0).reshape(5, hidden)
    hf["model.norm.weight"] = torch.ones(hidden)
    full = hf_to_megatron(hf, layout)

    # Stage 1 (last), tensor-parallel rank 1: HF layer 1 as its local layer 0.
    shard = shard_megatron(full, layout, tp=2, tp_rank=1, pp=2, pp_rank=1)
    assert set(shard) == {
        "decoder.layers.0.input_layernorm.weight",
        "decoder.layers.0.pre_mlp_layernorm.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.linear_qkv.bias",
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.0.mlp.linear_fc2.weight",
        "decoder.final_layernorm.weight",
        "output_layer.weight",
    }
    m = "decoder.layers.0."
    # Group 1 of layer 1: q2 q3 k1 v1 (+1000).
    qkv = torch.tensor([12.0, 13, 21, 31]) + 1000
    assert torch.equal(shard[m + "self_attention.linear_qkv.bias"], qkv)
    assert torch.equal(shard[m + "self_attention.linear_qkv.weight"], qkv[:, None].expand(4, 2))
    # Second halves of gate and of up: [gate 3, gate 4, up 7, up 8].
    fc1 = torch.tensor([3.0, 4, 7, 8]) + 1000
    assert torch.equal(shard[m + "mlp.linear_fc1.weight"], fc1[:, None].expand(4, 2))
    # Row parallel: columns 2:4 of o_proj and of down_proj.
    assert torch.equal(
        shard[m + "self_attention.linear_proj.weight"], torch.tensor([[1002.0, 1003], [1006, 1007]])
    )
    assert torch.equal(
        shard[m + "mlp.linear_fc2.weight"], torch.tensor([[1102.0, 1103], [1106, 1107]])
    )
    assert torch.equal(shard[m + "pre_mlp_layernorm.weight"], torch.full((2,), 1002.0))
    # Vocab 5 padded to 6; rank 1 holds rows 3, 4 and the zero pad row.
    out = torch.tensor([[-6.0, -7], [-8, -9], [0, 0]])
    assert torch.equal(shard["output_layer.weight"], out)

    # Stage 0, tensor-parallel rank 0: the embedding's first 3 rows and HF layer 0, group 0.
    shard = shard_megatron(full, layout, tp=2, tp_rank=0, pp=2, pp_rank=0)
    assert torch.equal(
        shard["embedding.word_embeddings.weight"], torch.arange(6.0).reshape(3, hidden)
    )
    assert torch.equal(
        shard[m + "self_attention.linear_qkv.bias"], torch.tensor([10.0, 11, 20, 30])
    )
    assert "output_layer.weight" not in shard and "decoder.final_layernorm.weight" not in shard


def test_parallel_sizes_that_do_not_divide_are_refused():
    assert list(stage_layers(4, 2, 1)) == [2, 3]
    with pytest.raises(ValueError, match="pipeline stages"):
        stage_layers(3, 2, 0)
    layout = GPTLayout(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="tensor-parallel"):
        shard_megatron({}, layout, tp=4)
    assert padded_vocab_size(127, 2) == 128 and padded_vocab_size(128, 4) == 128
