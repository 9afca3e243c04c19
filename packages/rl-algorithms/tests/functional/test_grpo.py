"""`rl grpo` end to end on a tiny model: on-policy ratios, generator/trainer agreement and a
two-turn environment rollout, read back from the JSONL and TensorBoard logs."""

import math

import pytest

from rl_algorithms import cli

from .conftest import TINY_LLAMA, read_metrics, series, write_config, write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]


def grpo_config(tmp_path, assets) -> dict:
    """Arithmetic prompts scored by the math environment. A random tiny model never answers
    right, so DAPO's overlong shaping (responses stop at a space, so lengths vary) gives the
    rewards a spread and the policy gradient something to push."""
    return {
        "policy": {
            "model": {"hf_config": TINY_LLAMA, "dtype": "float32"},
            "max_total_sequence_length": 128,
            # Two optimiser steps of 8 rows per 16 rollouts: pi_old is taken by a separate
            # log-prob pass, and the second step's ratios show the first step's change.
            "train_global_batch_size": 8,
            "train_micro_batch_size": 4,
            "optimizer": {"name": "AdamW", "kwargs": {"lr": 1.0e-3}},
            "reference_policy": {"enabled": True},
        },
        "tokenizer": {"path": assets["tokenizer"]},
        "generation": {
            "backend": "hf",
            "sampling": {"temperature": 0.8, "max_new_tokens": 12, "stop_strings": [" "]},
        },
        "loss_fn": {"reference_policy_kl_penalty": 0.01},
        "env": {"arithmetic": {"kind": "math", "config": {"num_workers": 1}}},
        "data": {
            "train": {"source": "arithmetic", "size": 40, "max_operand": 9},
            "validation_fraction": 0.2,
            "max_seq_length": 64,
        },
        "grpo": {
            "num_prompts_per_step": 4,
            "num_generations_per_prompt": 4,
            "max_num_steps": 3,
            "val_period": 3,
            "val_batch_size": 4,
            "max_val_samples": 4,
            "reward_shaping": {
                "enabled": True,
                "max_response_length": 8,
                "overlong_buffer_length": 6,
            },
        },
        "logger": {
            "log_dir": str(tmp_path / "logs"),
            "progress_bar": False,
            "tensorboard_enabled": True,
        },
        "checkpointing": {"checkpoint_dir": str(tmp_path / "ckpt"), "save_period": 3},
        "cluster": {"ray_num_cpus": 4},
    }


def test_rl_grpo_is_on_policy_and_the_generator_agrees_with_the_trainer(tmp_path, assets):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = write_config(tmp_path, grpo_config(tmp_path, assets))
    assert cli.main(["grpo", "--config", path]) == 0

    records = read_metrics(tmp_path / "logs")
    steps = [r for r in records if "train/loss" in r]
    assert len(steps) == 3
    for r in steps:
        # The first update is on-policy (ratio 1); the second sees the first one's change
        # (lr 1e-3 on a tiny model moves it visibly), within the range clipping handles.
        assert 0.5 <= r["train/probs_ratio_min"] <= 1.0 <= r["train/probs_ratio_max"] <= 2.0, r
        assert 0.9 <= r["train/probs_ratio"] <= 1.1, r
        assert 1.0 <= r["train/token_mult_prob_error"] < 1.05, r
        for key in ("loss", "reward_mean", "shaped_reward_mean", "kl_penalty", "grad_norm"):
            assert math.isfinite(r[f"train/{key}"]), key
        assert r["train/timing/generation"] > 0 and r["train/timing/train"] > 0
    # The shaping spreads the rewards: advantages are not all zero, so the policy moved.
    assert max(series(steps, "train/advantages_abs_mean")) > 0
    assert series(steps, "train/refit_seconds"), "the generator was never refit after a step"
    assert len(series(records, "val/reward_mean")) == 1

    events = EventAccumulator(str(tmp_path / "logs" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/probs_ratio_max")] == [1, 2, 3]
    assert (tmp_path / "ckpt" / "step_3" / "policy" / "model.safetensors").is_file()

    # Re-running with the same checkpoint directory resumes: the generator is refit with the
    # loaded weights (or it would refuse to sample, or disagree with the trainer).
    assert cli.main(["grpo", "--config", path, "grpo.max_num_steps=4"]) == 0
    records = read_metrics(tmp_path / "logs")
    assert series(records, "run/resumed_from_step") == [3]
    (step4,) = [r for r in records if r.get("step") == 4 and "train/loss" in r]
    assert step4["train/refit_seconds"] > 0
    assert 0.5 <= step4["train/probs_ratio_min"] <= 1.0 <= step4["train/probs_ratio_max"] <= 2.0
    assert step4["train/token_mult_prob_error"] < 1.05


def test_rl_grpo_two_turn_sliding_puzzle_with_a_separate_generator(tmp_path, assets):
    board = [[1, 2, 3], [4, 5, 6], [7, 0, 8]]
    prompt = "Slide the blank to solve: <action>up|down|left|right</action>\n1 2 3\n4 5 6\n7 _ 8"
    rows = [{"prompt": prompt, "board": board, "turn": 0}] * 8
    config = grpo_config(tmp_path, assets)
    config["data"] = {
        "train": {
            "source": "chat_file",
            "path": write_jsonl(tmp_path / "puzzles.jsonl", rows),
            "prompt_key": "prompt",
            "env_info_keys": ["board", "turn"],
            "task_name": "sliding_puzzle",
        },
        "max_seq_length": 64,
    }
    config["env"] = {"sliding_puzzle": {"config": {"max_turns": 4}}}
    config["policy"]["max_total_sequence_length"] = 256
    config["policy"]["train_global_batch_size"] = 8
    config["generation"]["colocated"] = False
    config["generation"]["sampling"] = {"temperature": 1.0, "max_new_tokens": 10}
    config["grpo"].update(
        num_prompts_per_step=2,
        num_generations_per_prompt=4,
        max_num_steps=1,
        val_period=0,
        max_rollout_turns=2,
    )
    config["checkpointing"]["enabled"] = False
    assert cli.main(["grpo", "--config", write_config(tmp_path, config)]) == 0

    (step,) = [r for r in read_metrics(tmp_path / "logs") if "train/loss" in r]
    # Nobody solves the puzzle in one turn: all 8 samples played both turns.
    assert step["train/turn_0/active_samples"] == 8
    assert step["train/turn_1/active_samples"] == 8
    assert step["train/mean_turns"] == 2.0
    assert 0.8 <= step["train/probs_ratio_min"] <= step["train/probs_ratio_max"] <= 1.2
    assert step["train/token_mult_prob_error"] < 1.05
    assert math.isfinite(step["train/reward_mean"])
