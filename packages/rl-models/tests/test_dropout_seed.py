"""Dropout and fresh weights draw from the policy seed, not from the process's randomly seeded
generator, and leave that generator as it was."""

import torch

from rl_models.losses import NLLLoss
from rl_models.policy.dtensor_worker import DTensorPolicyWorker

from .conftest import TINY_LLAMA, initial_model, skewed_batch, tiny_config


def dropout_model_files(path) -> str:
    """A tiny Llama with attention dropout, saved: loading it draws nothing from the seed."""
    initial_model(seed=3, hf_config={**TINY_LLAMA, "attention_dropout": 0.5}).save_pretrained(path)
    return str(path)


def test_dropout_follows_the_policy_seed_and_resumes_exactly(tmp_path):
    """A model with dropout loaded from files draws nothing from the seed when it is built, and
    torch seeds its global generator at random in every process. Two runs of one config must
    still drop the same activations, a resumed run the ones the uninterrupted run dropped, and
    the caller's generator is left as it was."""
    files = dropout_model_files(tmp_path / "model")

    def worker(global_seed: int, seed: int) -> DTensorPolicyWorker:
        torch.manual_seed(global_seed)
        model = {"path": files, "dtype": "float64"}
        return DTensorPolicyWorker(tiny_config(model=model, seed=seed))

    def train_step(w: DTensorPolicyWorker, step: int) -> dict[str, torch.Tensor]:
        state = torch.get_rng_state()
        w.train(skewed_batch(seed=step), NLLLoss())
        assert torch.equal(torch.get_rng_state(), state)  # the caller's generator is untouched
        return {k: v.detach().clone() for k, v in w.model.state_dict().items()}

    first, again, other = worker(1, seed=0), worker(2, seed=0), worker(1, seed=1)
    one, same, different = (train_step(w, 0) for w in (first, again, other))
    for key, value in one.items():
        assert torch.equal(value, same[key]), key
    # The files are the same, so only dropout's masks can tell the other seed's step apart.
    assert any(not torch.equal(value, different[key]) for key, value in one.items())

    first.save_checkpoint(str(tmp_path / "step1"))
    uninterrupted = train_step(first, 1)
    resumed = worker(3, seed=0)
    resumed.load_checkpoint(str(tmp_path / "step1"))
    for key, value in train_step(resumed, 1).items():
        assert torch.equal(value, uninterrupted[key]), key


def test_each_optimiser_step_of_a_train_call_draws_from_its_own_stream(tmp_path):
    """One ``train`` call of two optimiser steps equals two calls of one step each: the stream
    is chosen by the step, so a run that checkpoints between the steps resumes exactly."""
    model = {"path": dropout_model_files(tmp_path / "model"), "dtype": "float64"}
    config = tiny_config(model=model, train_global_batch_size=4, train_micro_batch_size=4)
    data = skewed_batch()
    whole, halves = DTensorPolicyWorker(config), DTensorPolicyWorker(config)
    assert whole.train(data, NLLLoss()).optimizer_steps == 2
    halves.train(data.slice(0, 4), NLLLoss())
    halves.train(data.slice(4, 8), NLLLoss())
    got, expected = whole.model.state_dict(), halves.model.state_dict()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-12, msg=key)
    # Nor do the steps repeat one stream: the step count is part of its seed.
    with DTensorPolicyWorker(config)._seeded_dropout():
        at_step_0 = torch.rand(8)
    with whole._seeded_dropout():
        assert not torch.equal(torch.rand(8), at_step_0)


def test_fresh_weights_follow_the_seed_and_leave_the_callers_generator_alone():
    """Hugging Face's initialisers draw from torch's global generator: building a model from a
    config must draw from the seed alone, and not reseed the generator the caller goes on with."""
    torch.manual_seed(5)
    state = torch.get_rng_state()
    first = initial_model(seed=0).state_dict()
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(6)
    again, other = initial_model(seed=0).state_dict(), initial_model(seed=1).state_dict()
    assert all(torch.equal(value, again[key]) for key, value in first.items())
    assert any(not torch.equal(value, other[key]) for key, value in first.items())
