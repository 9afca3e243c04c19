"""Tensor and pipeline parallelism of the Megatron-core worker, through the ``Policy`` controller.

Two CPU workers (gloo) hold one model replica between them: two tensor-parallel shards, or two
pipeline stages. Their log-probs must match plain HF float64, and one SGD step must move the
weights as the single-process DTensor worker does on the same data; tolerance and its reasons
as in ``test_megatron_worker.py``.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import rl_models.megatron  # noqa: F401  (registers rl_models.megatron -> the mcore env)
from rl_data.batch import TrainBatch
from rl_distributed import RayVirtualCluster
from rl_models.losses import LabelSmoothedNLLLoss, NLLLoss
from rl_models.policy.dtensor_worker import DTensorPolicyWorker
from rl_models.policy.lm_policy import Policy

from .conftest import skewed_batch, tiny_config
from .test_megatron_worker import ATOL, hf_logprobs

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("ray_session")]

PACKED = {"sequence_packing": {"enabled": True, "max_tokens_per_microbatch": 70}}
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
}


@pytest.mark.parametrize("case", list(CASES))
def test_model_parallel_policy_matches_hf_and_the_dtensor_worker(case, tiny_llama, tmp_path):
    megatron, extra = CASES[case]
    data = skewed_batch()
    config = tiny_config(
        model={"path": tiny_llama, "dtype": "float64"},
        backend="megatron",
        megatron=megatron,
        reference_policy={"enabled": True},
        **extra,
    )
    cluster = RayVirtualCluster([2], use_gpus=False)
    policy = Policy(cluster, config)
    try:
        assert policy.dp_size == 1  # both workers hold one replica between them
        expected = hf_logprobs(tiny_llama, data)
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
        assert metrics["loss"][0] == pytest.approx(nll)

        ckpt = str(tmp_path / "ckpt")
        policy.save_checkpoint(ckpt)
        after = policy.get_logprobs(data)["logprobs"]
        ref_lp = policy.get_reference_policy_logprobs(data)["reference_logprobs"]
    finally:
        policy.shutdown()
        cluster.shutdown()

    reference = DTensorPolicyWorker(tiny_config(model={"path": tiny_llama, "dtype": "float64"}))
    ref_metrics = reference.train(data, NLLLoss()).metrics
    assert metrics["loss"][0] == pytest.approx(ref_metrics["loss"][0], rel=1e-6)
    assert metrics["grad_norm"][0] == pytest.approx(ref_metrics["grad_norm"][0], rel=1e-6)
    trained = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64).state_dict()
    for name, tensor in reference.model.state_dict().items():
        torch.testing.assert_close(trained[name], tensor, rtol=0, atol=ATOL, msg=name)
    torch.testing.assert_close(after, hf_logprobs(ckpt, data), rtol=0, atol=ATOL)
    assert (after - got).abs().max() > 1e-3
    torch.testing.assert_close(ref_lp, got, rtol=0, atol=1e-12)
