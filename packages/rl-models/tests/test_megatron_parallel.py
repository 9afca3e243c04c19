"""Tensor and pipeline parallelism of the Megatron-core worker, through the ``Policy`` controller.

Two CPU workers (gloo) hold one model replica between them: two tensor-parallel shards, or two
pipeline stages; or, for a mixture of experts, two data-parallel replicas that split each
layer's experts (expert parallelism, tokens sent to their experts' rank by all-to-all). Their
log-probs must match plain HF float64, and one SGD step must move the weights as the
single-process DTensor worker does on the same data; tolerance and its reasons as in
``test_megatron_worker.py``. The sequence-parallel case runs Qwen3 (query/key norms), the
expert-parallel one Qwen3-MoE, the others Llama.

The unpacked cases also check, on the same workers (a Megatron policy start costs a minute
here), what a refit and the start-up rely on: each rank read only its slice of the safetensors
files, and the weight export hands out the HF state dict bit for bit without any rank holding
more than one decoder layer of full tensors (``test_megatron_sharded_build.py`` covers a fresh
initialisation). The expert-parallel case checks the export after its training step, against
the state dict gathered as checkpoints gather it: each rank sends its own experts.
"""

import json
import os
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

import rl_models.megatron  # noqa: F401  (registers rl_models.megatron -> the mcore env)
from rl_data.batch import TrainBatch
from rl_distributed import RayVirtualCluster
from rl_models.losses import LabelSmoothedNLLLoss, NLLLoss
from rl_models.policy.dtensor_worker import DTensorPolicyWorker
from rl_models.policy.lm_policy import Policy
from rl_models.weight_transfer.buckets import unpack_bucket

from .conftest import TINY_QWEN3, save_tiny, skewed_batch, tiny_config
from .test_megatron_worker import ATOL, hf_logprobs

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("ray_session")]

PACKED = {"sequence_packing": {"enabled": True, "max_tokens_per_microbatch": 70}}
TINY_QWEN3_MOE = {
    **TINY_QWEN3,
    "model_type": "qwen3_moe",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
}
MOMENTUM = {"lr": 1.0, "momentum": 0.9}
#: The model of each case that is not Llama.
MODELS = {"tp2-sp-packed": TINY_QWEN3, "ep2-moe": TINY_QWEN3_MOE}
CASES = {
    # Several log-prob micro-batches; train in one micro-batch.
    "tp2": ({"tensor_parallel_size": 2}, {"logprob_micro_batch_size": 3}),
    # Three micro-batches in flight through the two stages (1F1B), in training too.
    "pp2": (
        {"pipeline_parallel_size": 2},
        {"logprob_micro_batch_size": 3, "train_micro_batch_size": 3},
    ),
    # Packed rows of different lengths; the sequence split over the two ranks.
    "tp2-sp-packed": ({"tensor_parallel_size": 2, "sequence_parallel": True}, PACKED),
    "pp2-packed": ({"pipeline_parallel_size": 2}, PACKED),
    # Each rank has half of each layer's experts and half of the data. Momentum (the first
    # step is plain SGD's) gives each rank optimiser state of its own experts to checkpoint.
    "ep2-moe": (
        {"expert_parallel_size": 2},
        {"logprob_micro_batch_size": 3, "optimizer": {"name": "SGD", "kwargs": MOMENTUM}},
    ),
}


# The cases whose workers also check loading and export (see the module docstring).
CHECKS_LOAD_AND_EXPORT = ("tp2", "pp2")


def check_each_rank_read_only_its_slice(policy: Policy, expected: dict[str, torch.Tensor]) -> None:
    full_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    for rank_stats in policy.worker_group.call_all("weight_load_stats"):
        assert rank_stats["model_piece_numel"] * 8 < 0.8 * full_bytes
        assert rank_stats["bytes_emitted"] == rank_stats["model_piece_numel"] * 8
        assert 0 < rank_stats["bytes_read"] < 0.8 * full_bytes
        assert rank_stats["bytes_initialised"] == 0


def check_export_without_a_full_gather(
    policy: Policy, expected: dict[str, torch.Tensor], tp: int = 1, ep: int = 1
) -> None:
    """The refit's export in buckets of a tenth of the model: the HF state dict exactly."""
    model_bytes = sum(t.numel() * 8 for t in expected.values())
    bucket_bytes = model_bytes // 10
    group = policy.worker_group
    plans = group.call_all("weight_export_plan", bucket_bytes=bucket_bytes)
    got: dict[int, dict[str, torch.Tensor]] = {0: {}, 1: {}}
    for step in range(max(p.steps for p in plans)):
        for rank, bucket in enumerate(group.call_all("export_weight_bucket", step=step)):
            if bucket is None:
                continue
            assert bucket.nbytes <= bucket_bytes or len(bucket.slots) == 1
            got[rank].update((n, t.clone()) for n, t in unpack_bucket(bucket))
    stats = group.call_all("finish_weight_export")
    if tp == 2:  # tensor-parallel rank 0 produces everything, rank 1 only sends its shards
        assert [p.producer for p in plans] == [True, False] and not got[1]
    elif ep == 2:  # expert rank 1 sends its experts (2 and 3 of 4), rank 0 all the rest
        assert all(p.producer for p in plans)
        assert got[1] and all(re.search(r"\.experts\.[23]\.", n) for n in got[1])
        assert not any(re.search(r"\.experts\.[23]\.", n) for n in got[0])
    else:  # each pipeline stage exports its own layers
        assert all(p.producer for p in plans)
        assert all(".layers.0." in n or "embed" in n for n in got[0])
        assert all(
            ".layers.1." in n or n in ("model.norm.weight", "lm_head.weight") for n in got[1]
        )
    merged = {**got[0], **got[1]}
    assert set(merged) == set(expected)
    for name, t in expected.items():
        assert torch.equal(merged[name], t), name
    # No rank ever held more than one unit (here: one decoder layer) of full tensors.
    layer_bytes = sum(t.numel() * 8 for n, t in expected.items() if ".layers.0." in n)
    assert layer_bytes < model_bytes / 2
    for rank_stats in stats:
        assert rank_stats["peak_held_bytes"] <= layer_bytes


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(CASES))
def test_model_parallel_policy_matches_hf_and_the_dtensor_worker(
    case, tiny_llama, tmp_path_factory, tmp_path
):
    megatron, extra = CASES[case]
    path = save_tiny(tmp_path_factory, MODELS[case]) if case in MODELS else tiny_llama
    data = skewed_batch()
    config = tiny_config(
        model={"path": path, "dtype": "float64"},
        backend="megatron",
        megatron=megatron,
        reference_policy={"enabled": True},
        **extra,
    )
    cluster = RayVirtualCluster([2], use_gpus=False)
    policy = Policy(cluster, config)
    try:
        # Both workers hold one replica between them; expert-parallel ranks are replicas.
        assert policy.dp_size == megatron.get("expert_parallel_size", 1)
        if case in CHECKS_LOAD_AND_EXPORT:
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
            check_each_rank_read_only_its_slice(policy, hf.state_dict())
            tp = megatron.get("tensor_parallel_size", 1)
            check_export_without_a_full_gather(policy, hf.state_dict(), tp)
        expected = hf_logprobs(path, data)
        got = policy.get_logprobs(data)["logprobs"]
        assert got.shape == data["input_ids"].shape and got.dtype == torch.float64
        torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)

        mask = TrainBatch.from_transport(data).loss_token_mask()
        nll = float(-(expected * mask).sum() / mask.sum())
        # A loss over whole-vocabulary logits (gathered over the tensor-parallel ranks).
        evaluated = policy.train(data, LabelSmoothedNLLLoss(0.0), eval_mode=True).metrics
        assert evaluated["loss"][0] == pytest.approx(nll, rel=1e-9)

        policy.prepare_for_training()
        metrics = policy.train(data, NLLLoss()).metrics
        policy.prepare_for_lp_inference()
        assert metrics["global_valid_toks"] == [float(mask.sum())]
        if case == "ep2-moe":  # the trained weights, streamed as a refit streams them
            gathered = policy.worker_group.call_all("hf_state_dict")
            assert all(set(g) == set(gathered[0]) for g in gathered)
            check_export_without_a_full_gather(policy, gathered[0], ep=2)
        assert metrics["loss"][0] == pytest.approx(nll)

        ckpt = str(tmp_path / "ckpt")
        policy.save_checkpoint(ckpt)
        after = policy.get_logprobs(data)["logprobs"]
        ref_lp = policy.get_reference_policy_logprobs(data)["reference_logprobs"]
    finally:
        policy.shutdown()
        cluster.shutdown()

    reference = DTensorPolicyWorker(tiny_config(model={"path": path, "dtype": "float64"}))
    reference.model.config._experts_implementation = "eager"  # as in hf_logprobs
    ref_metrics = reference.train(data, NLLLoss()).metrics
    assert metrics["loss"][0] == pytest.approx(ref_metrics["loss"][0], rel=1e-6)
    assert metrics["grad_norm"][0] == pytest.approx(ref_metrics["grad_norm"][0], rel=1e-6)
    # The loss's own metrics reach the driver from the last stage, summed over the replicas.
    assert metrics["num_valid_tokens"] == ref_metrics["num_valid_tokens"] == [float(mask.sum())]
    trained = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64).state_dict()
    for name, tensor in reference.model.state_dict().items():
        torch.testing.assert_close(trained[name], tensor, rtol=0, atol=ATOL, msg=name)
    torch.testing.assert_close(after, hf_logprobs(ckpt, data), rtol=0, atol=ATOL)
    assert (after - got).abs().max() > 1e-3
    torch.testing.assert_close(ref_lp, got, rtol=0, atol=1e-12)
    if case == "ep2-moe":
        check_each_expert_rank_saved_its_optimiser_state(ckpt)


def check_each_expert_rank_saved_its_optimiser_state(ckpt: str) -> None:
    """Both expert ranks wrote their momenta: equal for the weights they share (gradients
    summed over the replicas), different for their own experts (2 of 4, 2 weights each)."""
    from rl_models.megatron.training_state import LAYOUT_FILE

    with open(os.path.join(ckpt, LAYOUT_FILE)) as f:  # what a resume is checked against
        assert json.load(f)["expert_parallel_size"] == 2
    files = [os.path.join(ckpt, f"optimizer-pp0-tp0-ep{e}.pt") for e in (0, 1)]
    ours, theirs = (torch.load(f, weights_only=False)["state"] for f in files)
    assert set(ours) == set(theirs)
    differ = [
        i for i in ours if not torch.equal(ours[i]["momentum_buffer"], theirs[i]["momentum_buffer"])
    ]
    assert len(differ) == 2 * 2 * TINY_QWEN3_MOE["num_hidden_layers"]
