"""Megatron model families: a family is one table, and every conversion is derived from it.

Qwen3 (Llama's layer plus per-head q/k norms, no q/k/v biases) and Qwen3-MoE (a router and
experts in every layer, split over expert-parallel ranks) are tables and nothing else:
conversion both ways, tensor/pipeline/expert sharding, the per-rank loading plan and the weight
export must all follow from them. The MoE side works on the checkpoint's names (one tensor per
expert and projection, as ``save_pretrained`` writes them), read back from the saved files.
"""

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from rl_models.generation.config import GenerationConfig
from rl_models.generation.hf_worker import HfGenerationWorker
from rl_models.megatron import families
from rl_models.megatron.convert import (
    GPTLayout,
    check_expert_numbering,
    check_expert_parallel,
    experts_to_global,
    hf_to_megatron,
    megatron_to_hf,
    shard_megatron,
    unshard_megatron,
)
from rl_models.megatron.families import family_for, register_family
from rl_models.megatron.families.llama import LAYER
from rl_models.megatron.families.qwen3 import FAMILY as QWEN3
from rl_models.megatron.families.qwen3_moe import FAMILY as QWEN3_MOE
from rl_models.megatron.family import GATE_UP, QKV, ModelFamily, Weight
from rl_models.megatron.loading import load_from_safetensors, shard_plan
from rl_models.megatron.weight_export import MegatronWeightExporter
from rl_models.policy.weight_export import WeightExportMethods
from rl_models.weight_transfer.shared_memory import RegionLayout

from .conftest import TINY_LLAMA
from .test_weight_export import _Shard, exported

TINY_QWEN3 = {**TINY_LLAMA, "model_type": "qwen3", "head_dim": 8}
TINY_QWEN3_MOE = {
    **TINY_QWEN3,
    "model_type": "qwen3_moe",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}
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
    assert family_for(AutoConfig.for_model("qwen3")) is QWEN3 and not QWEN3.moe
    assert family_for(AutoConfig.for_model("qwen3_moe")) is QWEN3_MOE and QWEN3_MOE.moe
    with pytest.raises(ValueError, match="no Megatron conversion for model_type 'mixtral'"):
        GPTLayout.from_hf_config(AutoConfig.for_model("mixtral"))
    with pytest.raises(ValueError, match="already belongs to Megatron family 'llama'"):
        register_family(ModelFamily("other", model_types=("llama",), layer=LAYER))
    with pytest.raises(ValueError, match="fuses 3 HF tensors, the row names 2"):
        Weight("self_attention.linear_qkv.weight", ("q", "k"), QKV)
    with pytest.raises(ValueError, match="names a layer weight twice"):
        ModelFamily("twice", model_types=("x",), layer=LAYER + LAYER[:1])


def test_qwen3_round_trips():
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
def test_qwen3_shards_loads_and_exports(tmp_path, tp, pp):
    """Each rank's shard, cut from the whole model or read from slices of the safetensors
    files, is the same; joined again, and exported, it is the HF model."""
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


def saved_moe(path, **overrides) -> tuple[GPTLayout, dict[str, torch.Tensor]]:
    """The tiny Qwen3-MoE saved to ``path``: its layout and its checkpoint's tensors."""
    model = tiny_model(TINY_QWEN3_MOE, **overrides)
    model.save_pretrained(path)
    return GPTLayout.from_hf_config(model.config), load_file(str(path / "model.safetensors"))


def test_qwen3_moe_round_trips(tmp_path):
    layout, hf = saved_moe(tmp_path)
    assert layout.family is QWEN3_MOE and layout.num_experts == 4
    meg = hf_to_megatron(hf, layout)
    fc1 = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    gate, up = (hf[f"model.layers.1.mlp.experts.3.{p}_proj.weight"] for p in ("gate", "up"))
    assert torch.equal(meg[fc1], torch.cat([gate, up]))
    router = meg["decoder.layers.0.mlp.router.weight"]
    assert torch.equal(router, hf["model.layers.0.mlp.gate.weight"])
    # a layer: 2 norms, qkv, proj, 2 q/k norms, router, and 2 weights for each of 4 experts
    assert len(meg) == 3 + (7 + 2 * 4) * TINY_QWEN3_MOE["num_hidden_layers"]
    back = megatron_to_hf(meg, layout)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    with pytest.raises(ValueError, match="every layer must be a mixture of experts"):
        GPTLayout.from_hf_config(AutoConfig.for_model("qwen3_moe", mlp_only_layers=[0]))


EP_LAYOUTS = [(1, 2), (2, 2), (1, 4)]


@pytest.mark.parametrize("tp,ep", EP_LAYOUTS, ids=[f"tp{t}-ep{e}" for t, e in EP_LAYOUTS])
def test_experts_split_over_expert_parallel_ranks(tmp_path, tp, ep):
    """Each expert-parallel rank holds its experts (numbered from 0), read from slices of the
    files alone; renumbered and merged, the ranks' shards are the whole model."""
    layout, hf = saved_moe(tmp_path, vocab_size=127)
    full = hf_to_megatron(hf, layout)
    merged: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for e in range(ep):
        for t in range(tp):
            shard = shard_megatron(full, layout, tp=tp, tp_rank=t, ep=ep, ep_rank=e)
            experts = {n.split(".local_experts.")[1].split(".")[0] for n in shard if "expert" in n}
            assert experts == {str(j) for j in range(4 // ep)}
            first = e * 4 // ep  # this rank's local expert 0
            local_fc2 = shard["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"]
            down = hf[f"model.layers.0.mlp.experts.{first}.down_proj.weight"]
            assert torch.equal(local_fc2, down.chunk(tp, dim=1)[t])
            plan = shard_plan(layout, vocab_size=127, tp=tp, tp_rank=t, ep=ep, ep_rank=e)
            got: dict[str, torch.Tensor] = {}
            load_from_safetensors(str(tmp_path), plan, layout, tp, torch.float64, got.__setitem__)
            assert set(got) == set(shard)
            assert all(torch.equal(got[n], x) for n, x in shard.items())
            merged[t].update(experts_to_global(shard, layout, ep, e))
    back = unshard_megatron([merged], layout)
    assert set(back) == set(full) and all(torch.equal(back[n], x) for n, x in full.items())


def expert_parallel_exporters(layout, hf, tp, pp, ep):
    """Every rank of a simulated tp x pp x ep grid as a Megatron exporter of its shard of the
    checkpoint ``hf``, and expert rank 0 of a second expert group (a replica of the first)."""
    full = hf_to_megatron(hf, layout)
    grid = {
        (p, e, t): shard_megatron(
            full, layout, tp=tp, tp_rank=t, pp=pp, pp_rank=p, ep=ep, ep_rank=e
        )
        for p in range(pp)
        for e in range(ep)
        for t in range(tp)
    }

    def gather_for(p, e, t):
        def gather(tensor):
            # By value: the weights are random, so no two tensors of a rank are equal.
            shard = grid[p, e, t]
            name = next(n for n, v in shard.items() if v.shape == tensor.shape and v.equal(tensor))
            return [grid[p, e, r][name] for r in range(tp)] if t == 0 else None

        return gather

    def exporter(p, e, t, dp_rank):
        return MegatronWeightExporter(
            _Shard(grid[p, e, t]),
            layout,
            **dict(tp=tp, tp_rank=t, pp=pp, pp_rank=p, dp_rank=dp_rank, gather=gather_for(p, e, t)),
            ep=ep,
            ep_rank=e,
        )

    return [exporter(p, e, t, dp_rank=e) for p, e, t in grid], exporter(0, 0, 0, dp_rank=ep)


EP_EXPORTS = [(1, 1, 2), (2, 1, 2), (1, 2, 2), (1, 1, 4)]


@pytest.mark.parametrize(
    "tp,pp,ep", EP_EXPORTS, ids=[f"tp{t}-pp{p}-ep{e}" for t, p, e in EP_EXPORTS]
)
def test_expert_parallel_ranks_export_the_checkpoint_between_them(tmp_path, tp, pp, ep):
    """Every rank of a simulated tp x pp x ep grid, plus a second expert group (a replica of
    the first), runs the exporter: the expert-parallel ranks send their own experts under
    their global numbers, rank 0 of each group the rest; together, each tensor exactly once,
    the checkpoint's tensors. Nobody holds more than one layer, buckets keep their bound."""
    layout, hf = saved_moe(tmp_path, vocab_size=127)
    exporters, replica = expert_parallel_exporters(layout, hf, tp, pp, ep)
    layer_bytes = sum(t.numel() * 8 for n, t in hf.items() if ".layers.0." in n)
    bucket_bytes = layer_bytes // 4
    got, sizes = exported([*exporters, replica], bucket_bytes)  # (each name at most once)
    assert not replica.plan(bucket_bytes).producer
    assert set(got) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(got[name], tensor), name
    assert all(nbytes <= bucket_bytes or count == 1 for nbytes, count in sizes)
    embed = hf["model.embed_tokens.weight"].numel() * 8
    assert max(e.peak_held_bytes for e in exporters) <= max(layer_bytes, embed)
    if ep > 1:  # an expert rank's peak: its own experts of one layer
        expert_bytes = sum(t.numel() * 8 for n, t in hf.items() if ".layers.0.mlp.experts." in n)
        later = [x for x in exporters if x.ep_rank > 0]
        assert max(x.peak_held_bytes for x in later) <= expert_bytes // ep


class _PolicyRank(WeightExportMethods):
    """A simulated Megatron rank with the policy worker's weight-export methods."""

    def __init__(self, exporter):
        self.exporter = exporter

    def _weight_exporter(self):
        return self.exporter


GENERATOR_GRIDS = [(1, 1, 1), (2, 2, 2)]


@pytest.mark.parametrize(
    "tp,pp,ep", GENERATOR_GRIDS, ids=[f"tp{t}-pp{p}-ep{e}" for t, p, e in GENERATOR_GRIDS]
)
def test_an_hf_generator_takes_the_megatron_moe_export(tmp_path, tp, pp, ep):
    """The Megatron export names experts as the checkpoint does (one tensor per expert and
    projection); the HF generator keeps them fused in memory. Through buckets (the object
    store's entry point) and through a shared-memory region it lays out, every slice of every
    fused parameter is written: the generator, perturbed before each refit, then holds exactly
    the parameters ``from_pretrained`` loads from the checkpoint, and the same float64 logits."""
    layout, hf = saved_moe(tmp_path, vocab_size=127)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    expected = dict(reference.named_parameters())
    assert "model.layers.0.mlp.experts.gate_up_proj" in expected  # fused in memory
    config = GenerationConfig(backend="hf", sampling={"max_new_tokens": 1, "stop_token_ids": []})
    gen = HfGenerationWorker(config.model_dump(), {"path": str(tmp_path), "dtype": "float64"})
    for model in (reference, gen.model):  # the grouped-matmul kernel has no float64
        model.config._experts_implementation = "eager"
    tokens = torch.randint(0, 127, (3, 11), generator=torch.Generator().manual_seed(0))
    bucket_bytes = sum(t.numel() * 8 for n, t in hf.items() if ".layers.0." in n) // 4

    def perturb():
        with torch.no_grad():
            for p in gen.model.parameters():
                p.add_(torch.rand_like(p) + 0.5)

    def check():
        for name, p in gen.model.named_parameters():
            assert torch.equal(p, expected[name]), name
        with torch.no_grad():
            got, want = gen.model(tokens).logits, reference(tokens).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)

    perturb()
    exporters, replica = expert_parallel_exporters(layout, hf, tp, pp, ep)
    for exporter in [*exporters, replica]:
        for step in range(exporter.plan(bucket_bytes).steps):
            bucket = exporter.bucket(step)
            if bucket is not None:
                gen.load_weight_bucket(bucket)
        exporter.finish()
    check()

    perturb()
    ranks = [_PolicyRank(x) for x in expert_parallel_exporters(layout, hf, tp, pp, ep)[0]]
    plans = [r.weight_export_plan(bucket_bytes) for r in ranks]
    for r in ranks:
        r.finish_weight_export()
    specs = [s for p in plans for bucket in p.buckets for s in bucket]
    path, reason = gen.map_weight_region(None, RegionLayout.of(specs))  # the export's order
    assert path is None and "where the generation model's 'model.layers" in reason
    region_layout = gen.weight_region_layout(specs)
    gen.prepare_for_weight_update()
    path, reason = gen.map_weight_region(None, region_layout)
    assert reason is None, reason
    try:
        for r in ranks:
            r.map_weight_region(path, region_layout)
        gen.unlink_weight_region(path)
        for r in ranks:
            r.write_weights_to_region(path, region_layout, bucket_bytes)
        gen.commit_weight_region(path, region_layout.digest, 1)
        start = gen.region.tensor.data_ptr()
        for name, p in gen.model.named_parameters():  # the region is the model's memory
            assert start <= p.data_ptr() < start + region_layout.nbytes, name
        check()
    finally:
        gen.shutdown()


def test_expert_parallel_sizes_are_checked(tmp_path):
    layout, _ = saved_moe(tmp_path)
    dense = GPTLayout.from_hf_config(tiny_model(TINY_QWEN3).config)
    check_expert_parallel(layout, world=4, tp=1, pp=1, ep=4)
    check_expert_parallel(
        layout, world=8, tp=2, pp=2, ep=2, aux_loss_coeff=0.01, sequence_parallel=True
    )
    cases = [
        (dense, dict(world=2, tp=1, pp=1, ep=2), "needs a mixture-of-experts model"),
        (layout, dict(world=3, tp=1, pp=1, ep=3), "does not divide the model's 4 experts"),
        (layout, dict(world=2, tp=2, pp=1, ep=2), "must divide the data-parallel size 1"),
        (dense, dict(world=1, tp=1, pp=1, ep=1, aux_loss_coeff=0.1), "moe_aux_loss_coeff"),
        (layout, dict(world=2, tp=2, pp=1, ep=1), "sequence_parallel must be true"),
    ]
    for lay, sizes, message in cases:
        with pytest.raises(ValueError, match=message):
            check_expert_parallel(lay, **sizes)


def test_expert_numbering_is_checked_against_megatron_cores():
    """The first expert group's replica ``d`` must be megatron-core's expert-parallel rank
    ``d`` of expert group 0 (what the export and checkpoint gathers assume); later groups hold
    copies and are not asked."""
    check_expert_numbering(dp_rank=1, ep=2, expert_rank=1, expert_group=0)
    check_expert_numbering(dp_rank=3, ep=2, expert_rank=1, expert_group=1)
    message = "megatron-core has it as expert-parallel rank 0 of expert-data-parallel rank 1"
    with pytest.raises(RuntimeError, match=message):  # numbered the other way round
        check_expert_numbering(dp_rank=1, ep=2, expert_rank=0, expert_group=1)


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
