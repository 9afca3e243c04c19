"""Dropout draws from the policy seed, not from the process's randomly seeded generator."""

import torch

from rl_models.losses import NLLLoss
from rl_models.policy.dtensor_worker import DTensorPolicyWorker

from .conftest import TINY_LLAMA, initial_model, skewed_batch, tiny_config


def test_dropout_follows_the_policy_seed_and_resumes_exactly(tmp_path):
    """A model with dropout loaded from files draws nothing from the seed when it is built, and
    torch seeds its global generator at random in every process. Two runs of one config must
    still drop the same activations, a resumed run the ones the uninterrupted run dropped, and
    the caller's generator is left as it was."""
    files = tmp_path / "model"
    initial_model(seed=3, hf_config={**TINY_LLAMA, "attention_dropout": 0.5}).save_pretrained(files)

    def worker(global_seed: int, seed: int) -> DTensorPolicyWorker:
        torch.manual_seed(global_seed)
        model = {"path": str(files), "dtype": "float64"}
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
    with first._seeded_dropout():
        second_step_draws = torch.rand(8)
    uninterrupted = train_step(first, 1)
    resumed = worker(3, seed=0)
    resumed.load_checkpoint(str(tmp_path / "step1"))
    for key, value in train_step(resumed, 1).items():
        assert torch.equal(value, uninterrupted[key]), key
    # Each optimiser step draws other masks: the step count is part of the stream.
    with first._seeded_dropout():
        assert not torch.equal(torch.rand(8), second_step_draws)
