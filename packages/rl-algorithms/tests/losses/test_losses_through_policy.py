"""The clipped PG loss trained through the real Policy: 2 Ray ranks equal 1 in-process rank."""

import pytest
import torch
from safetensors.torch import load_file

from rl_algorithms.losses import ClippedPGLossFn
from rl_distributed.batched_data_dict import BatchedDataDict
from rl_distributed.virtual_cluster import RayVirtualCluster
from rl_models.policy.config import PolicyConfig
from rl_models.policy.dtensor_worker import DTensorPolicyWorker
from rl_models.policy.lm_policy import Policy

from ..conftest import TINY_LLAMA

LOSS = {"ratio_clip_min": 0.1, "ratio_clip_max": 0.15, "reference_policy_kl_penalty": 0.1}


def config() -> PolicyConfig:
    return PolicyConfig.model_validate(
        {
            "model": {"hf_config": TINY_LLAMA, "dtype": "float64"},
            "optimizer": {"name": "SGD", "kwargs": {"lr": 1.0}},
            "max_grad_norm": None,
            "train_global_batch_size": 8,
            "train_micro_batch_size": 2,
            "reference_policy": {"enabled": True},
        }
    )


def grpo_like_batch() -> BatchedDataDict:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 12, 7, 9, 3, 12, 6, 10])
    S = 12
    real = torch.arange(S)[None, :] < lengths[:, None]
    ids = torch.randint(1, TINY_LLAMA["vocab_size"], (8, S), generator=g) * real
    data = BatchedDataDict(
        input_ids=ids,
        input_lengths=lengths,
        loss_mask=((torch.arange(S)[None, :] >= 2) & real).double(),
        sample_mask=torch.tensor([1.0, 1, 1, 1, 1, 1, 0, 1]),
        advantages=torch.randn(8, 1, generator=g, dtype=torch.float64).expand(8, S).clone(),
    )
    return data


def add_logprobs(data, logprobs, reference):
    g = torch.Generator().manual_seed(1)
    # An off-policy pi_old, so that clipping is active on some tokens.
    data["prev_logprobs"] = (
        logprobs + torch.randn(logprobs.shape, generator=g, dtype=torch.float64) * 0.3
    )
    data["generation_logprobs"] = data["prev_logprobs"].clone()
    data["reference_logprobs"] = reference
    return data


# CISPO, SAPO (its paper's sample-level mean), Dr. GRPO, GSPO and ICE-POP masking.
OBJECTIVES = [
    {"use_cispo": True, "ratio_clip_min": 1.0, "ratio_clip_max": 0.3},
    {"use_sapo": True, "token_level_loss": False},
    {"constant_length_normalizer": 12},
    {"sequence_level_importance_ratios": True},
    {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio": 1.5,
        "truncated_importance_sampling_ratio_min": 0.7,
    },
]


@pytest.mark.ray
@pytest.mark.slow  # a 2-rank Ray worker group: ~35 s on 2 cores
def test_two_ranks_train_like_one_and_report_the_loss_metrics(ray_session, tmp_path):
    local = DTensorPolicyWorker(config())
    data = grpo_like_batch()
    lp = local.get_logprobs(data)["logprobs"]
    ref = local.get_reference_policy_logprobs(data)["reference_logprobs"]
    data = add_logprobs(data, lp, ref)
    local_metrics = local.train(data, ClippedPGLossFn(LOSS)).metrics
    # A generator whose log-probs differ from the trainer's, for the mismatch corrections.
    mismatched = data.copy()
    noise = torch.randn(lp.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    mismatched["generation_logprobs"] = data["prev_logprobs"] + 0.5 * noise
    expected = {k: v.detach() for k, v in local.model.state_dict().items()}

    cluster = RayVirtualCluster([2], use_gpus=False)
    policy = Policy(cluster, config())
    try:
        metrics = policy.train(data, ClippedPGLossFn(LOSS)).metrics
        policy.save_checkpoint(str(tmp_path))
        two_rank_losses = [
            policy.train(mismatched, ClippedPGLossFn({**LOSS, **extra})).metrics["loss"]
            for extra in OBJECTIVES
        ]
        policy.save_checkpoint(str(tmp_path / "after"))
    finally:
        policy.shutdown()
        cluster.shutdown()

    saved = load_file(str(tmp_path / "model.safetensors"))
    assert max(float((saved[k] - expected[k]).abs().max()) for k in expected) < 1e-8
    for key in ("loss", "probs_ratio", "probs_ratio_min", "probs_ratio_max", "clip_fraction"):
        assert metrics[key] == pytest.approx(local_metrics[key], rel=1e-9), key
    assert 0 < metrics["clip_fraction"][0] < 1
    assert metrics["probs_ratio_min"][0] < 1 < metrics["probs_ratio_max"][0]
    assert metrics["kl_penalty"][0] == pytest.approx(0.0, abs=1e-12)  # current == reference
    assert metrics["token_mult_prob_error"] == [pytest.approx(1.0)]
    # The newer objectives, one step each from there on, on both: their global normalisers
    # (sample counts, constant lengths, sequence means) are where ranks could disagree.
    for step, extra in enumerate(OBJECTIVES):
        loss = ClippedPGLossFn({**LOSS, **extra})
        local_step = local.train(mismatched, loss).metrics
        assert two_rank_losses[step] == pytest.approx(local_step["loss"], rel=1e-9), extra
        # Each correction acts on this batch: a no-op one would pass the comparison above.
        if "use_cispo" in extra:
            assert 0 < local_step["clip_fraction"][0] < 1
        if "truncated_importance_sampling_type" in extra:
            assert 0 < local_step["is_oob_ratio"][0] < 1
    expected = {k: v.detach() for k, v in local.model.state_dict().items()}
    saved = load_file(str(tmp_path / "after" / "model.safetensors"))
    assert max(float((saved[k] - expected[k]).abs().max()) for k in expected) < 1e-8
