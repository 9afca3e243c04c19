"""Tensor parallelism of the DTensor backend: what one process can check (the config's
refusals, the plan's, Qwen3's head-norm gradients on a one-rank mesh, the vocab-parallel
log-softmax's arithmetic). Two tp ranks computing against one process are in
``test_two_ranks.py`` (``tensor_parallel`` scenarios)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial
from transformers import AutoConfig

from rl_models.policy.config import PolicyConfig
from rl_models.policy.dtensor_worker import DTensorPolicyWorker
from rl_models.policy.lm_policy import worker_sharding
from rl_models.policy.logprobs import (
    chunked_vocab_parallel_logprobs,
    vocab_parallel_logprobs,
    vocab_parallel_topk,
)
from rl_models.policy.tensor_parallel import check_plannable, parallelize

from .conftest import TINY_LLAMA, TINY_QWEN3, initial_model, skewed_batch, tiny_config
from .test_token_entropy import float64_logprobs_and_entropy


def test_tensor_parallel_lays_the_workers_out_as_dp_by_tp():
    config = tiny_config(dtensor={"tensor_parallel_size": 2, "sequence_parallel": True})
    assert config.model_parallel_layout == (1, 2)
    sharding = worker_sharding(config, 4)
    assert sharding.get_axis_size("data_parallel") == 2
    assert sharding.get_axis_size("tensor_parallel") == 2
    # Consecutive ranks share a dp rank: the worker's ("dp", "tp") mesh numbers them alike.
    assert sharding.get_worker_coords(1)["tensor_parallel"] == 1
    assert sharding.get_worker_coords(2)["data_parallel"] == 1


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"dtensor": {"sequence_parallel": True}}, "needs dtensor.tensor_parallel_size > 1"),
        ({"lora": {"enabled": True}}, "lora.enabled"),
        ({"model": {"hf_config": TINY_LLAMA, "kind": "value"}}, "model.kind=value"),
    ],
)
def test_combinations_tensor_parallelism_cannot_run_are_refused(overrides, named):
    tp = {"tensor_parallel_size": 1 if "dtensor" in overrides else 2}
    config = {**overrides, "dtensor": {**tp, **overrides.get("dtensor", {})}}
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        tiny_config(**config)


def test_a_megatron_config_has_no_dtensor_section():
    with pytest.raises(ValueError, match="dtensor"):
        PolicyConfig.model_validate(
            {
                "backend": "megatron",
                "model": {"hf_config": TINY_LLAMA},
                "train_global_batch_size": 8,
                "dtensor": {"tensor_parallel_size": 2},
            }
        )


def test_a_worker_count_that_tp_does_not_divide_is_refused():
    # One process (no WORLD_SIZE): 1 worker cannot hold tp=2.
    with pytest.raises(ValueError, match=r"1 policy workers cannot be split .*=2"):
        DTensorPolicyWorker(tiny_config(dtensor={"tensor_parallel_size": 2}))


def test_a_family_without_a_plan_is_refused_by_name():
    with pytest.raises(ValueError, match="no tensor-parallel plan for model type 'gpt2'"):
        check_plannable(AutoConfig.for_model("gpt2"), 2)


@pytest.fixture
def one_rank_mesh():
    """A tensor-parallel mesh of this process alone (gloo), taken down after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_qwen3_head_norm_gradients_are_left_to_be_summed_over_tp(one_rank_mesh, sequence_parallel):
    """Each tp rank applies q_norm and k_norm to its own heads: their weights' gradients must
    come out as pending sums over the ranks (``Partial``), which FSDP2 all-reduces, with or
    without sequence parallelism. On one rank the sum is this rank's gradient, the plain
    model's. (Two ranks against one process: the ``qwen3`` cases of ``test_two_ranks.py``.)"""
    model, plain = initial_model(hf_config=TINY_QWEN3), initial_model(hf_config=TINY_QWEN3)
    parallelize(model, one_rank_mesh, sequence_parallel)
    ids = skewed_batch()["input_ids"][1:2, :20]
    model(ids).logits.to_local().sum().backward()
    plain(ids).logits.sum().backward()
    plain_grads = {n: p.grad for n, p in plain.named_parameters()}
    head_norms = [
        n for n, _ in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))
    ]
    assert len(head_norms) == 2 * TINY_QWEN3["num_hidden_layers"]
    for name in head_norms:
        grad = model.get_parameter(name).grad
        assert isinstance(grad, DTensor) and grad.placements == (Partial(),), name
        torch.testing.assert_close(grad.to_local(), plain_grads[name], rtol=0, atol=1e-12)


def test_a_layer_with_one_head_norm_of_two_is_refused_by_name(one_rank_mesh):
    """Left out of the plan, a lone head norm would step with each rank's heads' share of its
    gradient; the refusal comes before any layer is split."""
    model = initial_model(hf_config=TINY_QWEN3)
    del model.model.layers[1].self_attn.k_norm
    with pytest.raises(
        ValueError, match=r"model\.layers\.1: it has self_attn\.q_norm but no self_attn\.k_norm"
    ):
        parallelize(model, one_rank_mesh, sequence_parallel=False)
    assert not any(isinstance(p, DTensor) for p in model.parameters())


def test_heads_that_tp_does_not_divide_are_refused():
    hf = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    config = AutoConfig.for_model("llama", **hf)  # 4 query heads, 2 key/value heads
    check_plannable(config, 2)
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible"):
        check_plannable(config, 4)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible"):
        check_plannable(config, 3)


def vocab_inputs(seed: int = 0, vocab: int = 11, padded: int = 16, tokens: int = 9):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(padded, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    return hidden, weight, targets


@pytest.mark.parametrize("chunk_size", [4, None])
def test_one_rank_vocab_parallel_logprobs_drop_padding_columns(chunk_size):
    """A rank holding the whole vocabulary, padded (to a multiple of tp, as Megatron pads it):
    the padding columns are not tokens. Log-probs, entropies and their gradients equal float64
    over the real columns only."""
    hidden, weight, targets = vocab_inputs()
    up = torch.randn(len(targets), 2, dtype=torch.float64)
    out = chunked_vocab_parallel_logprobs(
        hidden, weight, targets, chunk_size, 0, 11, None, None, 0.7, entropy=True
    )
    (out * up).sum().backward()
    h, w = (t.detach().clone().requires_grad_() for t in (hidden, weight))
    want = float64_logprobs_and_entropy(h @ w[:11].T / 0.7, targets)
    (want * up).sum().backward()
    torch.testing.assert_close(out.detach(), want.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(hidden.grad, h.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(weight.grad, w.grad, rtol=0, atol=1e-12)
    assert not weight.grad[11:].any()


def test_vocab_parallel_logprobs_of_k_tokens_per_position():
    """Several targets per position (a distillation student's, at its teacher's top-k)."""
    hidden, weight, _ = vocab_inputs(seed=1)
    logits = (hidden @ weight.T).detach()
    targets = torch.randint(0, 11, (len(logits), 3), generator=torch.Generator().manual_seed(2))
    got = vocab_parallel_logprobs(logits, targets, 0, 11, None)
    want = torch.log_softmax(logits[:, :11], -1).gather(-1, targets)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_one_rank_vocab_parallel_top_k_drops_padding_columns():
    hidden, weight, _ = vocab_inputs(seed=3)
    with torch.no_grad():
        weight[11:] += 100.0  # padding rows that would win every top-k were they tokens
        logits = hidden @ weight.T
    values, ids = vocab_parallel_topk(logits, 4, 0, 11, None, temperature=0.7)
    want_values, want_ids = torch.log_softmax(logits[:, :11] / 0.7, -1).topk(4)
    torch.testing.assert_close(values, want_values, rtol=0, atol=1e-12)
    assert torch.equal(ids, want_ids)
