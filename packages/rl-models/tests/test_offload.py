"""Offloading weights and optimiser state and bringing them back changes nothing in training.

On a CPU-only machine the offload target is the CPU too; offloading still makes dedicated
copies, so the tests can see the old storages go and the training continue bit-identically.
"""

import weakref

import pytest
import torch

from rl_models.losses import NLLLoss
from rl_models.policy.dtensor_worker import DTensorPolicyWorker

from .conftest import skewed_batch, tiny_config

CONFIG = {
    "optimizer": {"name": "AdamW", "kwargs": {"lr": 1e-2}},
    "offload": {"optimizer_state": True, "device": "cpu"},
}


def state_tensors(worker: DTensorPolicyWorker) -> list[torch.Tensor]:
    return [
        v
        for state in worker.optimizer.state.values()
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and k != "step"
    ]


def two_steps(cycle) -> dict[str, torch.Tensor]:
    """Weights after two Adam steps, with ``cycle(worker)`` run between them."""
    worker = DTensorPolicyWorker(tiny_config(**CONFIG))
    worker.train(skewed_batch(seed=1), NLLLoss())
    cycle(worker)
    worker.train(skewed_batch(seed=2), NLLLoss())
    return {k: v.detach().clone() for k, v in worker.model.state_dict().items()}


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, torch.Tensor]:
    return two_steps(lambda worker: None)


def assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_offloading_the_optimizer_state_releases_the_old_tensors():
    worker = DTensorPolicyWorker(tiny_config(**CONFIG))
    worker.train(skewed_batch(seed=1), NLLLoss())
    old = state_tensors(worker)
    assert old
    values = [t.clone() for t in old]
    refs = [weakref.ref(t) for t in old]
    del old
    worker.offload_optimizer_state()
    assert all(ref() is None for ref in refs)  # nothing holds the old state any more
    new = state_tensors(worker)
    assert all(torch.equal(a, b) for a, b in zip(new, values, strict=True))


def test_offloading_weights_keeps_the_parameters_the_optimizer_holds():
    worker = DTensorPolicyWorker(tiny_config(**CONFIG))
    params = list(worker.model.parameters())
    values = [p.detach().clone() for p in params]
    old = [p.data for p in params]  # kept alive, so a new copy cannot reuse their memory
    worker.offload_weights()
    assert [id(p) for p in worker.model.parameters()] == [id(p) for p in params]
    assert [id(p) for p in worker.optimizer.param_groups[0]["params"]] == [id(p) for p in params]
    assert all(p.data_ptr() != o.data_ptr() for p, o in zip(params, old, strict=True))
    assert all(torch.equal(p, v) for p, v in zip(params, values, strict=True))


def test_training_after_offload_and_reload_is_bit_identical(uninterrupted):
    def cycle(worker):
        worker.offload_optimizer_state()
        worker.offload_weights()
        worker.reload()

    assert_identical(two_steps(cycle), uninterrupted)


def test_prepare_methods_offload_per_config_and_train_identically(uninterrupted):
    def cycle(worker):
        old = state_tensors(worker)  # kept alive, so a new copy cannot reuse their memory
        worker.prepare_for_lp_inference()  # offload.optimizer_state: the state moves away
        new = state_tensors(worker)
        assert all(n.data_ptr() != o.data_ptr() for n, o in zip(new, old, strict=True))
        worker.get_logprobs(skewed_batch())
        worker.prepare_for_training()

    assert_identical(two_steps(cycle), uninterrupted)
