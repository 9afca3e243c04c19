"""Chunked, vocab-parallel log-probs of the Megatron worker (2 tensor-parallel ranks, gloo).

With ``logprob_chunk_size`` the last stage never makes the ``[tokens, vocab]`` logits: each
rank turns ``chunk_size`` hidden states at a time into its ``[chunk, V/2]`` slice of logits, and
the log-softmax over the whole vocabulary is all-reduced across the two ranks. The reference
is plain float64 PyTorch on the HF model, each sequence alone, with the temperature applied:
its log-probs, and one SGD step (lr=1) on the NLL of those log-probs, ``W - dL/dW``, which
checks the gradients of every weight. Tolerance as in ``test_megatron_worker.py`` (RoPE angles).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

import rl_models.megatron  # noqa: F401  (registers rl_models.megatron -> the mcore env)
from rl_data.batch import TrainBatch
from rl_distributed import RayVirtualCluster
from rl_models.losses import NLLLoss
from rl_models.policy.lm_policy import Policy

from .conftest import skewed_batch, tiny_config

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("ray_session")]
ATOL = 1e-6
TEMPERATURE = 0.7
CHUNK = 16  # tokens; the batch has 8 x 60 positions, so ~30 chunks

CASES = {
    "tp2": ({"tensor_parallel_size": 2}, {}),
    # The output layer's input is gathered over the sequence first; packed rows.
    "tp2-sp-packed": (
        {"tensor_parallel_size": 2, "sequence_parallel": True},
        {"sequence_packing": {"enabled": True, "max_tokens_per_microbatch": 70}},
    ),
}


def reference_step(path: str, data) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Float64 log-probs at ``TEMPERATURE`` and the weights after one SGD step (lr=1) on their
    masked mean NLL: plain PyTorch on the HF model, each sequence unpadded."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    lp = torch.zeros(data["input_ids"].shape, dtype=torch.float64)
    rows = []
    for ids, n in zip(data["input_ids"], data["input_lengths"], strict=True):
        logits = model(ids[None, :n]).logits[0, :-1] / TEMPERATURE
        rows.append(torch.log_softmax(logits, dim=-1).gather(-1, ids[1:n, None])[:, 0])
    for row, values in enumerate(rows):
        lp[row, 1 : 1 + values.numel()] = values
    mask = TrainBatch.from_transport(data).loss_token_mask()
    loss = -(lp * mask).sum() / mask.sum()
    loss.backward()
    after = {k: (p - p.grad).detach() for k, p in model.named_parameters()}
    return lp.detach(), after


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(CASES))
def test_chunked_vocab_parallel_logprobs_match_float64(tiny_llama, tmp_path, case):
    megatron, extra = CASES[case]
    data = skewed_batch()
    config = tiny_config(
        model={"path": tiny_llama, "dtype": "float64"},
        backend="megatron",
        megatron=megatron,
        logprob_temperature=TEMPERATURE,
        logprob_chunk_size=CHUNK,
        **extra,
    )
    expected_lp, expected_after = reference_step(tiny_llama, data)
    cluster = RayVirtualCluster([2], use_gpus=False)
    policy = Policy(cluster, config)
    try:
        got = policy.get_logprobs(data)["logprobs"]
        policy.prepare_for_training()
        metrics = policy.train(data, NLLLoss()).metrics
        ckpt = str(tmp_path / "ckpt")
        policy.save_checkpoint(ckpt)
    finally:
        policy.shutdown()
        cluster.shutdown()
    torch.testing.assert_close(got, expected_lp, rtol=0, atol=ATOL)
    mask = TrainBatch.from_transport(data).loss_token_mask()
    assert metrics["loss"][0] == pytest.approx(float(-(expected_lp * mask).sum() / mask.sum()))
    trained = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64).state_dict()
    for name, tensor in expected_after.items():
        torch.testing.assert_close(trained[name], tensor, rtol=0, atol=ATOL, msg=name)
