"""`rl ppo` end to end on a tiny model, its policy training LoRA adapters on two DTensor ranks
(the critic and the HF generator beside it on the same two, or each on two workers of its
own): the critic learns the returns, every loss is finite, refits send the generator only the
adapters, and a run stopped after a checkpoint and resumed equals the uninterrupted one (the
policy's merged weights and adapters, and the critic)."""

import math

import pytest
import torch
from safetensors.torch import load_file

from rl_algorithms import cli

from ..conftest import TEST_RAY_CPUS, ray_with_cpus
from .conftest import (
    LORA,
    TINY_LLAMA,
    check_adapter_refits,
    check_generator_agrees,
    read_metrics,
    series,
    write_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(900)]
STEPS = 4


def ppo_config(tmp_path, assets) -> dict:
    """Arithmetic prompts scored by the math environment; DAPO's overlong shaping (responses
    stop at a space, so lengths vary) gives a random model's rewards a spread for the critic
    to learn."""
    return {
        "policy": {
            "model": {"hf_config": TINY_LLAMA, "dtype": "float32"},
            "max_total_sequence_length": 128,
            "train_global_batch_size": 8,
            "train_micro_batch_size": 4,
            "optimizer": {"name": "AdamW", "kwargs": {"lr": 1.0e-3}},
            "reference_policy": {"enabled": True},
            "lora": LORA,
        },
        "critic": {
            "train_micro_batch_size": 4,
            "optimizer": {"name": "AdamW", "kwargs": {"lr": 3.0e-3}},
        },
        "tokenizer": {"path": assets["tokenizer"]},
        "generation": {
            "backend": "hf",
            "sampling": {"temperature": 1.0, "max_new_tokens": 12, "stop_strings": [" "]},
        },
        # The classic RLHF form: the KL to the reference in the token rewards.
        "loss_fn": {"reference_policy_kl_penalty": 0.01, "use_kl_in_reward": True},
        "env": {"arithmetic": {"kind": "math", "config": {"num_workers": 1}}},
        "data": {
            "train": {"source": "arithmetic", "size": 80, "max_operand": 9},
            "validation_fraction": 0.1,
            "max_seq_length": 64,
        },
        "ppo": {
            "num_prompts_per_step": 8,
            "ppo_epochs": 2,
            "critic_ppo_epochs": 4,
            "policy_training_start_step": 1,
            "max_num_steps": STEPS,
            "val_period": STEPS,
            "val_batch_size": 4,
            "max_val_samples": 4,
            "reward_shaping": {
                "enabled": True,
                "max_response_length": 8,
                "overlong_buffer_length": 6,
            },
        },
        "logger": {"log_dir": str(tmp_path / "logs"), "progress_bar": False},
        "checkpointing": {"checkpoint_dir": str(tmp_path / "ckpt"), "save_period": 2},
        "cluster": {"ray_num_cpus": 4, "cpu_workers_per_node": 2},
    }


def run_ppo(tmp_path, assets, *overrides: str) -> list[dict]:
    cfg = write_config(tmp_path, ppo_config(tmp_path, assets))
    assert cli.main(["ppo", "--config", cfg, *overrides]) == 0
    return read_metrics(tmp_path / "logs")


def weights(path) -> dict[str, torch.Tensor]:
    """A model directory's weights, or a peft adapter directory's adapters."""
    name = "adapter_model" if path.name == "adapter" else "model"
    return load_file(path / f"{name}.safetensors")


@pytest.fixture(scope="module")
def straight(tmp_path_factory, assets):
    """The uninterrupted run, colocated critic: what the resumed run and the critic on workers
    of its own are held against (one run serves both tests)."""
    root = tmp_path_factory.mktemp("straight")
    return root, run_ppo(root, assets)


def test_ppo_trains_its_critic_and_resumes_exactly(straight, tmp_path, assets):
    straight, records = straight
    for key, steps in [
        ("train/loss", STEPS - 1),  # the policy trains from step 2 on
        ("train/critic/value_loss", STEPS),
        ("train/explained_variance", STEPS),
    ]:
        values = series(records, key)
        assert len(values) == steps and all(math.isfinite(v) for v in values), (key, values)
    # Warm-up: the policy stands still in step 1, then trains.
    assert series(records, "train/policy_trained") == [0.0] + [1.0] * (STEPS - 1)
    # The critic learns the returns: the value loss falls and explained variance rises from
    # its start (a fresh value head explains nothing).
    value_loss = series(records, "train/critic/value_loss")
    assert value_loss[-1] < value_loss[0]
    explained = series(records, "train/explained_variance")
    assert max(explained[-2:]) > explained[0]
    assert (straight / "ckpt" / f"step_{STEPS}" / "critic" / "model.safetensors").is_file()
    check_adapter_refits(records, straight / "ckpt" / f"step_{STEPS}")
    check_generator_agrees(records)

    # Stopped after step 2's checkpoint, then the same command with the full length resumes.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    run_ppo(resumed, assets, "ppo.max_num_steps=2")
    records = run_ppo(resumed, assets)
    assert [r["run/resumed_from_step"] for r in records if "run/resumed_from_step" in r] == [2]
    # The resumed run's fresh generator gets the base once more, then the adapters, and
    # samples with them.
    after = records[next(i for i, r in enumerate(records) if "run/resumed_from_step" in r) :]
    check_adapter_refits(after, resumed / "ckpt" / f"step_{STEPS}")
    check_generator_agrees(after)
    want = {r["step"]: r for r in read_metrics(straight / "logs") if "train/loss" in r}
    for r in (r for r in records if "train/loss" in r):
        for key in ("train/loss", "train/critic/value_loss", "train/reward_mean"):
            assert r[key] == want[r["step"]][key], (r["step"], key)
    for role in ("policy", "policy/adapter", "critic"):
        a = weights(straight / "ckpt" / f"step_{STEPS}" / role)
        b = weights(resumed / "ckpt" / f"step_{STEPS}" / role)
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=f"{role}: {name}")


def test_a_critic_and_a_generator_on_workers_of_their_own_train_like_colocated_ones(
    straight, tmp_path, assets
):
    """``critic.colocated: false`` and ``generation.colocated: false``: each gets a cluster of
    its own (Ray placement groups beside the policy's). Two steps train with finite losses, and
    the first step's values, value loss and explained variance are those of the colocated
    critic of the uninterrupted run on the same rollouts (same seeds: placement changes no
    number). The policy trains from step 1 here, so that step 2 samples after a refit of the
    adapters alone: the generator on workers of its own gets the refits the colocated one got
    (the base once, then exactly the adapters' bytes) and samples with them."""
    config = ppo_config(tmp_path, assets)
    config["critic"]["colocated"] = False
    # As many ranks as the colocated critic had: with fewer, its gradients would be reduced
    # in another order, and the value losses would differ by float32 rounding (about 2e-8).
    config["critic"]["num_workers"] = 2
    # As many generation workers as the colocated generator had: each samples the same rows.
    config["generation"].update(colocated=False, num_workers=2)
    # The critic trains before the policy in a step, so step 1's critic numbers do not see it.
    config["ppo"].update(max_num_steps=2, policy_training_start_step=0)
    config["checkpointing"]["enabled"] = False
    # Four logical CPUs more than the session's cluster: the critic's and the generator's.
    with ray_with_cpus(TEST_RAY_CPUS + 4):
        assert cli.main(["ppo", "--config", write_config(tmp_path, config)]) == 0
    records = read_metrics(tmp_path / "logs")
    separate = [r for r in records if "train/critic/value_loss" in r]
    colocated = [r for r in straight[1] if "train/critic/value_loss" in r]
    assert [r["step"] for r in separate] == [1, 2]
    for key in ("train/critic/value_loss", "train/values_mean", "train/loss"):
        assert all(math.isfinite(r[key]) for r in separate), (key, separate)
    for key in ("train/values_mean", "train/critic/value_loss", "train/explained_variance"):
        assert separate[0][key] == colocated[0][key], key
    # The colocated run refits the base with the adapters, then the adapters alone.
    assert series(records, "train/refit_bytes") == series(straight[1], "train/refit_bytes")[:2]
    check_generator_agrees(records)
