"""Checkpoint names onto transformers' in-memory parameters (``modeling.checkpoint_views``),
and the HF generator's checks that a refit or a shared region writes every part of a fused
parameter exactly once.

Mixtral and PhiMoE keep ``block_sparse_moe`` in their checkpoints: the router is only renamed
(``mlp.gate`` in memory), the experts' ``w1``/``w3``/``w2`` are fused into ``gate_up_proj`` and
``down_proj``. The reference is transformers' own loader, ``from_pretrained``.
"""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rl_models.generation.config import GenerationConfig
from rl_models.generation.hf_worker import HfGenerationWorker
from rl_models.generation.interfaces import IncompleteRefitError
from rl_models.modeling.checkpoint_views import CheckpointViews, FusedCoverage
from rl_models.weight_transfer.buckets import TensorSpec

from .conftest import TINY_LLAMA, save_tiny

TINY_MOE = {**TINY_LLAMA, "num_local_experts": 4, "num_experts_per_tok": 2}
FAMILIES = {
    "mixtral": {**TINY_MOE, "model_type": "mixtral"},
    "phimoe": {**TINY_MOE, "model_type": "phimoe"},
}
#: Layer 0's expert 2 and 3 gate projections (Mixtral's ``w1``): one sent twice, one never.
SENT_TWICE = "model.layers.0.block_sparse_moe.experts.2.w1.weight"
NEVER_SENT = "model.layers.0.block_sparse_moe.experts.3.w1.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(family)``: the tiny model of ``family`` saved by ``save_pretrained`` (once per
    module), and its checkpoint's tensors."""
    cache: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}

    def get(family: str) -> tuple[str, dict[str, torch.Tensor]]:
        if family not in cache:
            path = save_tiny(tmp_path_factory, FAMILIES[family])
            cache[family] = path, load_file(f"{path}/model.safetensors")
        return cache[family]

    return get


@pytest.fixture(params=list(FAMILIES))
def saved_moe(request, saved):
    return saved(request.param)


@pytest.fixture
def mixtral(saved):
    return saved("mixtral")


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.rand_like(p) + 0.5)
    return model


def test_every_checkpoint_name_is_a_slice_and_writing_them_is_from_pretrained(saved_moe):
    path, checkpoint = saved_moe
    expected = dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).state_dict())
    assert "model.layers.0.mlp.experts.gate_up_proj" in expected  # fused in memory
    assert "model.layers.0.block_sparse_moe.gate.weight" in checkpoint  # renamed in memory
    model = perturbed(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64))
    views = CheckpointViews(model)
    coverage = FusedCoverage()
    for name, tensor in checkpoint.items():
        target = views.slice(name)
        assert target is not None, name
        assert target.view.shape == tensor.shape, name
        assert coverage.add(name, target) is None, name  # no two names share an element
        with torch.no_grad():
            target.view.copy_(tensor)
    assert coverage.gaps() == []
    router = views.slice("model.layers.1.block_sparse_moe.gate.weight")  # renamed, whole
    assert router.param in expected and router.part is None
    assert (
        router.view.data_ptr() == router.whole.data_ptr()
        and router.view.shape == router.whole.shape
    )
    state = model.state_dict()
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


def test_coverage_names_a_part_written_twice_and_one_never(mixtral):
    path, checkpoint = mixtral
    views = CheckpointViews(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64))
    coverage = FusedCoverage()
    for name in checkpoint:
        if name != NEVER_SENT:
            assert coverage.add(name, views.slice(name)) is None, name
    assert coverage.add(SENT_TWICE, views.slice(SENT_TWICE)) == SENT_TWICE
    (gap,) = coverage.gaps()  # chunk 0 of gate_up_proj: the gate (w1)
    assert "'model.layers.0.mlp.experts.gate_up_proj' (4 experts x 2 chunks)" in gap
    assert "1 parts not written, (expert, chunk) (3, 0);" in gap
    # The whole parameter written by its in-memory name covers every part, and overlaps them.
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    overlapping = coverage.add(fused, views.slice(fused))
    assert overlapping.startswith("model.layers.0.block_sparse_moe.experts."), overlapping
    assert coverage.gaps() == []


def generator(path: str) -> HfGenerationWorker:
    config = GenerationConfig(backend="hf", sampling={"max_new_tokens": 1, "stop_token_ids": []})
    return HfGenerationWorker(config.model_dump(), {"path": path, "dtype": "float64"})


def test_a_refit_that_leaves_an_expert_unwritten_is_refused(mixtral):
    """One expert sent twice and another never: the same bytes, but the refit is refused at
    its end, and the generator keeps refusing to generate until a complete refit."""
    path, checkpoint = mixtral
    gen = generator(path)
    perturbed(gen.model)
    gen.prepare_for_weight_update()
    sent = [(n, t) for n, t in checkpoint.items() if n != NEVER_SENT]
    gen.load_named_weights([*sent, (SENT_TWICE, checkpoint[SENT_TWICE])])
    with pytest.raises(
        RuntimeError, match=r"version 1 wrote only part.*\(expert, chunk\) \(3, 0\)"
    ):
        gen.set_weight_version(1)
    assert gen.version == 0
    with pytest.raises(IncompleteRefitError):
        gen.generate(None, expected_weight_version=1)
    gen.prepare_for_weight_update()  # the next refit starts its own count
    gen.load_named_weights(list(checkpoint.items()))
    gen.set_weight_version(1)
    expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).state_dict()
    for name, p in gen.model.state_dict().items():
        assert torch.equal(p, expected[name]), name


def test_a_region_layout_must_hold_each_part_of_a_fused_parameter_once(mixtral):
    path, checkpoint = mixtral
    gen = generator(path)
    specs = [TensorSpec.of(n, t) for n, t in checkpoint.items() if n != NEVER_SENT]
    twice = TensorSpec.of(SENT_TWICE, checkpoint[SENT_TWICE])
    # The old check summed bytes per parameter: this layout has the right sum.
    path_, reason = gen.map_weight_region(None, gen.weight_region_layout([*specs, twice]))
    assert path_ is None and reason is not None
    assert f"holds {SENT_TWICE!r} and {SENT_TWICE!r}, which are (partly) the same" in reason
    path_, reason = gen.map_weight_region(None, gen.weight_region_layout(specs))
    assert path_ is None and "does not hold all of fused parameters" in reason
    assert "(expert, chunk) (3, 0)" in reason
    assert gen.region is None and not gen.updating  # declined: nothing changed
