"""Synchronous GRPO resume is exact: 4 steps straight equal 2 steps, a process exit, a resume
and 2 more -- the same per-step metrics and the same final weights (CPU, float32, HF sampler).

The first half runs in a process of its own (a real exit, nothing of it left in this driver),
attached to this test's Ray cluster; the resume is the same command with a higher step limit.
Validation (greedy) runs at the checkpoint's step in both runs, so its generate calls sit
between the checkpoint and the next sampled step, as they do in a long run.
"""

import math
import os
import subprocess
import sys

import pytest
import ray
import torch
from safetensors.torch import load_file

from rl_algorithms import cli

from .conftest import read_metrics, write_config
from .test_grpo import grpo_config

# Three runs of 2-4 steps: ~3.5 min on an idle 2-core machine, longer on a busy one.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(900)]

STEPS = 4
# Differ by how a run was cut, not by what it computed: wall-clock times, and the refit that a
# resumed run does at its first step where the uninterrupted run did it in the validation before.
NOT_COMPARED = ("timing/", "seconds", "refit_", "mfu", "tokens_per_second")


def config(tmp_path, assets) -> dict:
    cfg = grpo_config(tmp_path, assets)
    cfg["grpo"].update(max_num_steps=STEPS, val_period=2)
    cfg["checkpointing"].update(save_period=2, keep_top_k=None)
    return cfg


def steps_of(log_dir) -> dict[tuple[int, str], dict[str, float]]:
    """(step, train|val) -> that record's compared metrics."""
    out = {}
    for record in read_metrics(log_dir):
        for prefix in ("train", "val"):
            values = {
                k: v
                for k, v in record.items()
                if k.startswith(prefix + "/") and not any(s in k for s in NOT_COMPARED)
            }
            if values:
                out[(record["step"], prefix)] = values
    return out


def test_grpo_two_steps_exit_resume_two_equals_four_straight(tmp_path, assets):
    straight = tmp_path / "straight"
    straight.mkdir()
    assert cli.main(["grpo", "--config", write_config(straight, config(straight, assets))]) == 0

    cut = tmp_path / "cut"
    cut.mkdir()
    path = write_config(cut, config(cut, assets))
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    first = subprocess.run(
        [sys.executable, "-m", "rl_algorithms.cli", "grpo", "--config", path,
         "grpo.max_num_steps=2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-4000:]
    assert (cut / "ckpt" / "step_2").is_dir() and not (cut / "ckpt" / "step_3").exists()
    assert cli.main(["grpo", "--config", path]) == 0  # resumes from step_2

    want, got = steps_of(straight / "logs"), steps_of(cut / "logs")
    assert sorted(got) == sorted(want)
    assert [k for k in sorted(want) if k[1] == "train"] == [(s, "train") for s in (1, 2, 3, 4)]
    assert (2, "val") in want and (4, "val") in want
    for key in sorted(want):
        assert got[key].keys() == want[key].keys(), key
        for name, value in want[key].items():
            same = value == got[key][name] or (math.isnan(value) and math.isnan(got[key][name]))
            assert same, (key, name, value, got[key][name])
    for name in ("train/reward_mean", "train/loss", "train/grad_norm", "train/kl_penalty"):
        assert name in want[(3, "train")], name
    resumed = [
        r["run/resumed_from_step"]
        for r in read_metrics(cut / "logs")
        if "run/resumed_from_step" in r
    ]
    assert resumed == [2]

    a = load_file(straight / "ckpt" / f"step_{STEPS}" / "policy" / "model.safetensors")
    b = load_file(cut / "ckpt" / f"step_{STEPS}" / "policy" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
