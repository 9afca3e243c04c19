"""Megatron model families: a family is one table, and every conversion is derived from it.

The family under test is defined here, in the test (a Qwen3-style model: Llama's layer plus
per-head q/k norms, no q/k/v biases), and registered for its ``model_type`` only while the test
runs. Nothing else about it is written anywhere: conversion both ways, tensor/pipeline sharding,
the per-rank loading plan and the weight export must all follow from its table.
"""

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rl_models.megatron import families
from rl_models.megatron.convert import (
    GPTLayout,
    hf_to_megatron,
    megatron_to_hf,
    shard_megatron,
    unshard_megatron,
)
from rl_models.megatron.families import family_for, register_family
from rl_models.megatron.families.llama import LAYER
from rl_models.megatron.family import GATE_UP, QKV, ModelFamily, Weight
from rl_models.megatron.loading import load_from_safetensors, shard_plan
from rl_models.megatron.weight_export import MegatronWeightExporter

from .conftest import TINY_LLAMA
from .test_weight_export import _Shard, exported


def _refuse_attention_bias(config) -> None:
    if config.attention_bias:
        raise ValueError("attention_bias is not supported")


QWEN3 = ModelFamily(
    "qwen3",
    model_types=("qwen3",),
    layer=(
        *LAYER,
        Weight("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
        Weight("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
    ),
    check_config=_refuse_attention_bias,
)
TINY_QWEN3 = {**TINY_LLAMA, "model_type": "qwen3", "head_dim": 8}
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.fixture
def registry(monkeypatch):
    """The family registry, restored after the test."""
    monkeypatch.setattr(families, "FAMILIES", dict(families.FAMILIES))
    return families.FAMILIES


def tiny_model(spec: dict, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = {**spec, **overrides}
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    with torch.no_grad():  # norms start at 1: make them differ, so a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def test_the_package_families_are_found_by_model_type(registry):
    assert family_for(AutoConfig.for_model("llama")).name == "llama"
    qwen2 = family_for(AutoConfig.for_model("qwen2"))
    assert qwen2.name == "qwen2" and qwen2.qkv_bias and qwen2.layer is LAYER
    with pytest.raises(ValueError, match="no Megatron conversion for model_type 'qwen3'"):
        GPTLayout.from_hf_config(AutoConfig.for_model("qwen3"))
    with pytest.raises(ValueError, match="already belongs to Megatron family 'llama'"):
        register_family(ModelFamily("other", model_types=("llama",), layer=LAYER))
    with pytest.raises(ValueError, match="fuses 3 HF tensors, the row names 2"):
        Weight("self_attention.linear_qkv.weight", ("q", "k"), QKV)
    with pytest.raises(ValueError, match="names a layer weight twice"):
        ModelFamily("twice", model_types=("x",), layer=LAYER + LAYER[:1])


def test_a_family_defined_in_one_place_round_trips(registry):
    register_family(QWEN3)
    model = tiny_model(TINY_QWEN3, tie_word_embeddings=True)
    layout = GPTLayout.from_hf_config(model.config)
    assert layout.family is QWEN3 and layout.head_dim == 8 and not layout.qkv_bias
    hf = model.state_dict()
    meg = hf_to_megatron(hf, layout)
    norm = "decoder.layers.1.self_attention.q_layernorm.weight"
    assert torch.equal(meg[norm], hf["model.layers.1.self_attn.q_norm.weight"])
    assert len(meg) == 2 + 8 * TINY_QWEN3["num_hidden_layers"]  # 6 weights + 2 norms a layer
    back = megatron_to_hf(meg, layout)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    with pytest.raises(ValueError, match="attention_bias"):
        GPTLayout.from_hf_config(tiny_model(TINY_QWEN3, attention_bias=True).config)


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}-pp{p}" for t, p in LAYOUTS])
def test_a_new_family_shards_loads_and_exports(registry, tmp_path, tp, pp):
    """Each rank's shard, cut from the whole model or read from slices of the safetensors
    files, is the same; joined again, and exported, it is the HF model."""
    register_family(QWEN3)
    model = tiny_model(TINY_QWEN3, vocab_size=127)  # 127: tp=2 pads the vocabulary
    model.save_pretrained(tmp_path)
    layout = GPTLayout.from_hf_config(model.config)
    hf = model.state_dict()
    full = hf_to_megatron(hf, layout)
    grid = [
        [shard_megatron(full, layout, tp=tp, tp_rank=t, pp=pp, pp_rank=p) for t in range(tp)]
        for p in range(pp)
    ]
    q_norm = "decoder.layers.0.self_attention.q_layernorm.weight"  # replicated over tp
    assert all(torch.equal(shard[q_norm], full[q_norm]) for shard in grid[0])
    for p, row in enumerate(grid):
        for t, expected in enumerate(row):
            plan = shard_plan(layout, vocab_size=127, tp=tp, tp_rank=t, pp=pp, pp_rank=p)
            got: dict[str, torch.Tensor] = {}
            load_from_safetensors(str(tmp_path), plan, layout, tp, torch.float64, got.__setitem__)
            assert set(got) == set(expected)
            for name, tensor in expected.items():
                assert torch.equal(got[name], tensor), name
    back = unshard_megatron(grid, layout)
    assert set(back) == set(full) and all(torch.equal(back[n], t) for n, t in full.items())

    def gather_for(p, t):
        def gather(tensor):
            name = next(n for n, v in grid[p][t].items() if v is tensor or v.equal(tensor))
            return [grid[p][r][name] for r in range(tp)] if t == 0 else None

        return gather

    ranks = [(p, t) for p in range(pp) for t in range(tp)]
    exporters = [
        MegatronWeightExporter(
            _Shard(grid[p][t]),
            layout,
            **dict(tp=tp, tp_rank=t, pp=pp, pp_rank=p, dp_rank=0, gather=gather_for(p, t)),
        )
        for p, t in ranks
    ]
    got, _ = exported(exporters, bucket_bytes=1 << 14)
    assert set(got) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(got[name], tensor), name


def test_the_one_file_example_in_the_docs_is_a_working_family(registry):
    """docs/guides/adding-a-megatron-family.md includes this file as the family to copy."""
    path = Path(__file__).parents[3] / "docs" / "guides" / "megatron_family_mistral.py"
    spec = importlib.util.spec_from_file_location("megatron_family_mistral", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    register_family(module.FAMILY)
    model = tiny_model({**TINY_LLAMA, "model_type": "mistral"}, sliding_window=None)
    layout = GPTLayout.from_hf_config(model.config)
    assert layout.family is module.FAMILY
    hf = model.state_dict()
    back = megatron_to_hf(hf_to_megatron(hf, layout), layout)
    assert all(torch.equal(back[n], t) for n, t in hf.items())
    with pytest.raises(ValueError, match="sliding_window"):
        GPTLayout.from_hf_config(AutoConfig.for_model("mistral", sliding_window=4096))


def test_rules_split_like_the_hf_chunks_they_are_made_of():
    """The loader's invariant: rank r's part of a fused tensor is the fusion of chunk r of
    each HF tensor (for QKV under the rank's own head counts)."""
    layout = GPTLayout(num_layers=1, num_heads=8, num_kv_heads=4, head_dim=2)
    q, k, v = torch.randn(16, 3), torch.randn(8, 3), torch.randn(8, 3)
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    for rule, hf in ((QKV, [q, k, v]), (GATE_UP, [gate, up])):
        whole = rule.fuse(hf, layout)
        assert all(torch.equal(a, b) for a, b in zip(rule.split(whole, layout), hf, strict=True))
        for tp in (2, 4):
            parts = [rule.part(whole, layout, tp, r) for r in range(tp)]
            for r, part in enumerate(parts):
                chunks = [t.chunk(tp, dim=rule.dim)[r] for t in hf]
                assert torch.equal(part, rule.fuse(chunks, layout.per_rank(tp)))
            assert torch.equal(rule.join(parts, layout), whole)
