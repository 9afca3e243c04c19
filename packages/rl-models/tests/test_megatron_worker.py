"""The Megatron-core policy worker, run by Ray in the isolated ``mcore`` environment.

megatron-core is not installed in the driver's environment: only the worker imports it.

Tolerance: both sides compute in float64 except the RoPE angles, which HF and Megatron both
form in float32; HF also takes their cos/sin in float32, Megatron in float64 (after casting
the angles), a relative difference of ~6e-8 on every rotated query/key. Seen on this model:
log-probs within 4.1e-8 of HF (padded and packed alike), weights after one SGD step within
5.9e-8 of the DTensor worker's, log-probs after it within 1.0e-7; hence ``atol=1e-6``.
"""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

import rl_models.megatron  # noqa: F401  (registers rl_models.megatron -> the mcore env)
from rl_data.batch import TrainBatch
from rl_distributed import RayVirtualCluster, RayWorkerBuilder, RayWorkerGroup
from rl_models.losses import NLLLoss
from rl_models.policy.dtensor_worker import DTensorPolicyWorker

from .conftest import sequence_logprobs, skewed_batch, tiny_config

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("ray_session")]
WORKER = "rl_models.megatron.worker.MegatronPolicyWorker"
ATOL = 1e-6


def hf_logprobs(path, data) -> torch.Tensor:
    """Plain HF float64: each sequence alone, unpadded."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    # Mixture-of-experts models: transformers' default grouped matmul has no float64 kernel.
    model.config._experts_implementation = "eager"
    return sequence_logprobs(model, data)


def call(group: RayWorkerGroup, method: str, **kwargs):
    [result] = group.call_all(method, **kwargs)
    return result


def test_megatron_worker_matches_hf_and_the_dtensor_worker(tiny_llama, tmp_path):
    data = skewed_batch()
    model = {"path": tiny_llama, "dtype": "float64"}
    settings = dict(model=model, logprob_micro_batch_size=3, reference_policy={"enabled": True})
    config = tiny_config(**settings)  # the DTensor worker's, for the reference step
    mcore_config = tiny_config(backend="megatron", **settings)
    packed_config = tiny_config(
        model=model,
        backend="megatron",
        sequence_packing={"enabled": True, "max_tokens_per_microbatch": 70},
    )
    cluster = RayVirtualCluster([1], use_gpus=False, max_colocated_worker_groups=2)
    groups = [
        RayWorkerGroup(cluster, RayWorkerBuilder(WORKER, c.model_dump()), name_prefix=name)
        for c, name in ((mcore_config, "mcore"), (packed_config, "mcore-packed"))
    ]
    plain, packed = groups
    try:
        expected = hf_logprobs(tiny_llama, data)
        got = call(plain, "get_logprobs", data=data)["logprobs"]
        assert got.shape == data["input_ids"].shape and got.dtype == torch.float64
        torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)
        padding = torch.arange(got.shape[1])[None] >= data["input_lengths"][:, None]
        assert (got[:, 0] == 0).all() and (got[padding] == 0).all()
        # Packed rows (block-diagonal masks) give the same log-probs.
        packed_lp = call(packed, "get_logprobs", data=data)["logprobs"]
        torch.testing.assert_close(packed_lp, expected, rtol=0, atol=ATOL)

        # One SGD step (lr=1) moves the weights as the DTensor worker moves the HF model's.
        call(plain, "prepare_for_training")
        metrics = call(plain, "train", data=data, loss_fn=NLLLoss()).metrics
        call(plain, "prepare_for_lp_inference")
        reference = DTensorPolicyWorker(config)
        ref_metrics = reference.train(data, NLLLoss()).metrics
        mask = TrainBatch.from_transport(data).loss_token_mask()
        assert metrics["global_valid_toks"] == [float(mask.sum())]
        assert metrics["loss"][0] == pytest.approx(float(-(expected * mask).sum() / mask.sum()))
        assert metrics["loss"][0] == pytest.approx(ref_metrics["loss"][0], rel=1e-6)
        assert metrics["grad_norm"][0] == pytest.approx(ref_metrics["grad_norm"][0], rel=1e-6)

        # The checkpoint is HF-loadable and holds the trained weights.
        ckpt, state = str(tmp_path / "ckpt"), str(tmp_path / "state")
        call(plain, "save_checkpoint", path=ckpt, training_state_dir=state)
        assert not {"optimizer.pt", "scheduler.pt"} & set(os.listdir(ckpt))
        assert {"optimizer.pt", "scheduler.pt"} <= set(os.listdir(state))
        trained = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64).state_dict()
        for name, tensor in reference.model.state_dict().items():
            torch.testing.assert_close(trained[name], tensor, rtol=0, atol=ATOL, msg=name)
        after = call(plain, "get_logprobs", data=data)["logprobs"]
        torch.testing.assert_close(after, hf_logprobs(ckpt, data), rtol=0, atol=ATOL)
        assert (after - got).abs().max() > 1e-3
        # The reference policy kept the initial weights.
        ref_lp = call(plain, "get_reference_policy_logprobs", data=data)["reference_logprobs"]
        torch.testing.assert_close(ref_lp, got, rtol=0, atol=1e-12)
        # Only at the loss's tokens (what GRPO asks for): the same values, zero elsewhere.
        ref_at_loss = call(plain, "get_reference_policy_logprobs", data=data, at_loss_tokens=True)[
            "reference_logprobs"
        ]
        torch.testing.assert_close(ref_at_loss, got * (mask > 0), rtol=0, atol=1e-12)
        # Loading the checkpoint back undoes a further step.
        call(plain, "train", data=data, loss_fn=NLLLoss())
        call(plain, "load_checkpoint", path=ckpt, training_state_dir=state)
        restored = call(plain, "get_logprobs", data=data)["logprobs"]
        torch.testing.assert_close(restored, after, rtol=0, atol=1e-12)
    finally:
        for group in groups:
            group.shutdown()
        cluster.shutdown()


def test_two_data_parallel_ranks_train_like_one(tiny_llama, tmp_path):
    """Each rank holds the whole model and half of each global batch; the gradients are
    averaged over ranks, so one step equals the single-process step of the DTensor worker."""
    data = skewed_batch()
    config = tiny_config(model={"path": tiny_llama, "dtype": "float64"})
    mcore_config = {**config.model_dump(), "backend": "megatron"}
    cluster = RayVirtualCluster([2], use_gpus=False)
    group = RayWorkerGroup(cluster, RayWorkerBuilder(WORKER, mcore_config))
    try:
        shards = data.shard_by_batch_size(2, batch_size=config.train_global_batch_size)
        futures = group.run_all_workers_sharded_data(
            "train",
            in_sharded_axes=["data_parallel"],
            data=shards,
            common_kwargs={"loss_fn": NLLLoss()},
        )
        metrics = [r.metrics for r in group.get_all_worker_results(futures)]
        ckpt = str(tmp_path / "ckpt")
        group.call_all("save_checkpoint", path=ckpt)
    finally:
        group.shutdown()
        cluster.shutdown()
    reference = DTensorPolicyWorker(config)
    ref_metrics = reference.train(data, NLLLoss()).metrics
    assert metrics[0] == metrics[1]  # the metrics are all-reduced
    assert metrics[0]["loss"][0] == pytest.approx(ref_metrics["loss"][0], rel=1e-6)
    assert metrics[0]["grad_norm"][0] == pytest.approx(ref_metrics["grad_norm"][0], rel=1e-6)
    trained = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64).state_dict()
    for name, tensor in reference.model.state_dict().items():
        torch.testing.assert_close(trained[name], tensor, rtol=0, atol=ATOL, msg=name)
