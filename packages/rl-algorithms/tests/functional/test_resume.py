"""Resume equals an uninterrupted run: the same losses and the same final weights.

The interrupted run is a real `rl sft` process, SIGKILLed once it has written its third
checkpoint (it may be mid-step or mid-checkpoint at that moment); running the same command
again picks up the latest complete checkpoint and finishes. CPU, float32.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import ray
import torch
from safetensors.torch import load_file

from rl_algorithms import cli

from .conftest import base_config, read_metrics, write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]
# Long enough that the kill, sent within ~50 ms of the third checkpoint appearing, always lands
# well before the end (a 6-step run once finished in that window).
STEPS = 16  # two epochs of the 8-step data set


def losses_by_step(log_dir) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for record in read_metrics(log_dir):
        if "train/loss" in record:
            out.setdefault(record["step"], []).append(record["train/loss"])
    return out


def test_killed_and_resumed_run_matches_the_uninterrupted_one(tmp_path, assets):
    straight = tmp_path / "straight"
    straight.mkdir()
    cfg = write_config(straight, base_config(straight, assets))
    assert (
        cli.main(["sft", "--config", cfg, f"sft.max_num_steps={STEPS}", "sft.max_num_epochs=2"])
        == 0
    )

    killed = tmp_path / "killed"
    killed.mkdir()
    cfg = write_config(killed, base_config(killed, assets))
    args = [
        "sft",
        "--config",
        cfg,
        f"sft.max_num_steps={STEPS}",
        "sft.max_num_epochs=2",
        "checkpointing.save_period=1",
        "checkpointing.keep_top_k=10",
    ]
    # The killed run is its own driver process, attached to this test's Ray cluster.
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rl_algorithms.cli", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (killed / "ckpt" / "step_3").exists():
            assert proc.poll() is None, f"the run ended early:\n{proc.stderr.read()}"
            assert time.monotonic() < deadline, "no third checkpoint within 4 minutes"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    interrupted_at = max(int(p.name.split("_")[1]) for p in (killed / "ckpt").glob("step_*"))
    assert interrupted_at < STEPS

    assert cli.main(args) == 0  # the same command again: resumes

    want, got = losses_by_step(straight / "logs"), losses_by_step(killed / "logs")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, values in got.items():  # a step logged before the kill and again after agrees
        assert all(v == want[step][0] for v in values), (step, values, want[step])
    resumed = [r for r in read_metrics(killed / "logs") if "run/resumed_from_step" in r]
    assert [r["run/resumed_from_step"] for r in resumed] == [interrupted_at]

    a = load_file(straight / "ckpt" / f"step_{STEPS}" / "policy" / "model.safetensors")
    b = load_file(killed / "ckpt" / f"step_{STEPS}" / "policy" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
