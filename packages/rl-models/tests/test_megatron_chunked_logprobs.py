"""Chunked, vocab-parallel log-probs of the Megatron worker (2 tensor-parallel ranks, gloo).

With ``logprob_chunk_size`` the last stage never makes the ``[tokens, vocab]`` logits: each
rank turns ``chunk_size`` hidden states at a time into its ``[chunk, V/2]`` slice of logits, and
the log-softmax over the whole vocabulary is all-reduced across the two ranks. The reference
is plain float64 PyTorch on the HF model, each sequence alone, with the temperature applied:
its log-probs, and one SGD step (lr=1) on the NLL of those log-probs, ``W - dL/dW``, which
checks the gradients of every weight; one case adds an entropy bonus to that loss, which
checks the vocab-parallel entropy and its gradients. Tolerance as in ``test_megatron_worker.py`` (RoPE angles).
"""

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

import rl_models.megatron  # noqa: F401  (registers rl_models.megatron -> the mcore env)
from rl_data.batch import TrainBatch
from rl_distributed import RayVirtualCluster
from rl_models.losses import NLLLoss
from rl_models.policy.lm_policy import Policy

from . import test_token_entropy
from .conftest import skewed_batch, tiny_config
from .test_token_entropy import ENTROPY_WEIGHT, EntropyBonusLoss, float64_logprobs_and_entropy

# The workers cannot import the tests: the entropy loss travels by value.
ray.cloudpickle.register_pickle_by_value(test_token_entropy)

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.usefixtures("ray_session")]
ATOL = 1e-6
TEMPERATURE = 0.7
CHUNK = 16  # tokens; the batch has 8 x 60 positions, so ~30 chunks

CASES = {
    "tp2": ({"tensor_parallel_size": 2}, {}, False),
    # The output layer's input is gathered over the sequence first; packed rows. Trained with
    # an entropy bonus: the vocab-parallel entropy and its gradient (no extra Ray start).
    "tp2-sp-packed-entropy": (
        {"tensor_parallel_size": 2, "sequence_parallel": True},
        {"sequence_packing": {"enabled": True, "max_tokens_per_microbatch": 70}},
        True,
    ),
}


def reference_step(
    path: str, data, entropy: bool
) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    """Float64 log-probs at ``TEMPERATURE``, the loss, and the weights after one SGD step (lr=1)
    on the masked mean NLL (with ``entropy`` minus ``ENTROPY_WEIGHT`` times the masked mean
    entropy, ``EntropyBonusLoss``): plain PyTorch on the HF model, each sequence unpadded."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    lp = torch.zeros(data["input_ids"].shape, dtype=torch.float64)
    ent = torch.zeros(data["input_ids"].shape, dtype=torch.float64)
    for row, (ids, n) in enumerate(zip(data["input_ids"], data["input_lengths"], strict=True)):
        logits = model(ids[None, :n]).logits[0, :-1] / TEMPERATURE
        both = float64_logprobs_and_entropy(logits, ids[1:n])
        lp = lp.index_put((torch.tensor(row), torch.arange(1, n)), both[:, 0])
        ent = ent.index_put((torch.tensor(row), torch.arange(1, n)), both[:, 1])
    mask = TrainBatch.from_transport(data).loss_token_mask()
    loss = -(lp * mask).sum() / mask.sum()
    if entropy:
        loss = loss - ENTROPY_WEIGHT * (ent * mask).sum() / mask.sum()
    loss.backward()
    after = {k: (p - p.grad).detach() for k, p in model.named_parameters()}
    return lp.detach(), float(loss.detach()), after


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(CASES))
def test_chunked_vocab_parallel_logprobs_match_float64(tiny_llama, tmp_path, case):
    megatron, extra, entropy = CASES[case]
    data = skewed_batch()
    config = tiny_config(
        model={"path": tiny_llama, "dtype": "float64"},
        backend="megatron",
        megatron=megatron,
        logprob_temperature=TEMPERATURE,
        logprob_chunk_size=CHUNK,
        **extra,
    )
    expected_lp, expected_loss, expected_after = reference_step(tiny_llama, data, entropy)
    cluster = RayVirtualCluster([2], use_gpus=False)
    policy = Policy(cluster, config)
    try:
        got = policy.get_logprobs(data)["logprobs"]
        policy.prepare_for_training()
        metrics = policy.train(data, EntropyBonusLoss() if entropy else NLLLoss()).metrics
        ckpt = str(tmp_path / "ckpt")
        policy.save_checkpoint(ckpt)
    finally:
        policy.shutdown()
        cluster.shutdown()
    torch.testing.assert_close(got, expected_lp, rtol=0, atol=ATOL)
    assert metrics["loss"][0] == pytest.approx(expected_loss)
    trained = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64).state_dict()
    for name, tensor in expected_after.items():
        torch.testing.assert_close(trained[name], tensor, rtol=0, atol=ATOL, msg=name)
