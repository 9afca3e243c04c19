"""The gradient of a global batch must not depend on how it is split (the key property).

One SGD step with lr=1 and no clipping moves the weights by exactly minus the gradient, so
equal updated weights mean equal gradients.
"""

import pytest
import torch
from safetensors.torch import load_file

from rl_data.batch import TrainBatch
from rl_distributed.virtual_cluster import RayVirtualCluster
from rl_models.losses import NLLLoss
from rl_models.policy.dtensor_worker import DTensorPolicyWorker
from rl_models.policy.lm_policy import Policy

from .conftest import skewed_batch, tiny_config


class MeanPerMicrobatchNLL:
    """The classic mistake: normalise by the micro-batch's own token count."""

    def __call__(self, logprobs, data, global_valid_seqs, global_valid_toks):
        mask = data.loss_token_mask().to(logprobs)
        return -(logprobs * mask).sum() / mask.sum().clamp(min=1), {}


def weights_after_one_step(loss_fn=None, **config) -> dict[str, torch.Tensor]:
    # Fixed micro-batches unless a test asks otherwise (the CPU default `auto` is dynamic).
    worker = DTensorPolicyWorker(tiny_config(**{"dynamic_batching": {"enabled": False}, **config}))
    worker.train(skewed_batch(), loss_fn or NLLLoss())
    return {k: v.detach().clone() for k, v in worker.model.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def one_microbatch() -> dict[str, torch.Tensor]:
    return weights_after_one_step(train_micro_batch_size=8)


def test_the_step_changes_the_weights(one_microbatch):
    initial = DTensorPolicyWorker(tiny_config()).model.state_dict()
    assert max_diff(one_microbatch, initial) > 1e-2


@pytest.mark.parametrize("micro_batch_size", [1, 3])
def test_many_microbatches_give_the_same_gradient(one_microbatch, micro_batch_size):
    got = weights_after_one_step(train_micro_batch_size=micro_batch_size)
    assert max_diff(got, one_microbatch) < 1e-6


def test_sequence_packing_gives_the_same_gradient(one_microbatch):
    got = weights_after_one_step(
        sequence_packing={"enabled": True, "max_tokens_per_microbatch": 64}
    )
    assert max_diff(got, one_microbatch) < 1e-6


def test_dynamic_batching_gives_the_same_gradient(one_microbatch):
    got = weights_after_one_step(dynamic_batching={"enabled": True, "train_mb_tokens": 70})
    assert max_diff(got, one_microbatch) < 1e-6


def test_per_microbatch_normalisation_would_be_caught(one_microbatch):
    same_split = weights_after_one_step(MeanPerMicrobatchNLL(), train_micro_batch_size=8)
    assert max_diff(same_split, one_microbatch) < 1e-6  # one micro-batch: no difference...
    naive = weights_after_one_step(MeanPerMicrobatchNLL(), train_micro_batch_size=2)
    assert max_diff(naive, one_microbatch) > 1e-3  # ...but split, the naive loss drifts


@pytest.mark.ray
@pytest.mark.parametrize(
    "batching",
    # Each Ray worker group costs ~25 s on 2 cores: only the padded variant runs in the main tier.
    [
        {"train_micro_batch_size": 1, "dynamic_batching": {"enabled": False}},
        pytest.param(
            {"sequence_packing": {"enabled": True, "max_tokens_per_microbatch": 64}},
            marks=pytest.mark.slow,
        ),
        pytest.param(
            {"dynamic_batching": {"enabled": True, "train_mb_tokens": 70}},
            marks=pytest.mark.slow,
        ),
    ],
    ids=["padded", "packed", "dynamic"],
)
def test_two_data_parallel_ray_workers_give_the_same_gradient(
    ray_session, tmp_path, one_microbatch, batching
):
    cluster = RayVirtualCluster([2], use_gpus=False)
    policy = Policy(cluster, tiny_config(**batching))
    try:
        data = skewed_batch()
        before = policy.get_logprobs(data)["logprobs"]
        metrics = policy.train(data, NLLLoss()).metrics
        policy.save_checkpoint(str(tmp_path))
    finally:
        policy.shutdown()
        cluster.shutdown()
    from .test_logprobs import reference_logprobs

    # Gathered back in the caller's row order, and equal to the single-process log-probs.
    torch.testing.assert_close(before, reference_logprobs(data), rtol=0, atol=1e-10)
    assert metrics["global_valid_toks"] == [
        float(TrainBatch.from_transport(data).loss_token_mask().sum())
    ]
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert max_diff({k: saved[k] for k in one_microbatch}, one_microbatch) < 1e-6
