import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from rl_algorithms.utils.checkpoint import (
    CheckpointingConfig,
    CheckpointManager,
    duration_seconds,
)
from rl_data.loader import StatefulDataLoader
from rl_distributed.config import ConfigError, validate_config
from rl_distributed.launchers import CHECKPOINT_DEADLINE_ENV


class LinearPolicy:
    """Saves and loads real weights + optimiser state the way Policy.save_checkpoint does."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(4, 2)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.1)

    def step(self) -> None:
        self.optimizer.zero_grad()
        self.model(torch.ones(1, 4)).sum().backward()
        self.optimizer.step()

    def save_checkpoint(self, path: str, training_state_dir: str | None = None) -> None:
        state_dir = training_state_dir or path
        os.makedirs(path, exist_ok=True)
        os.makedirs(state_dir, exist_ok=True)
        torch.save(self.model.state_dict(), os.path.join(path, "model.pt"))
        torch.save(self.optimizer.state_dict(), os.path.join(state_dir, "optim.pt"))

    def load_checkpoint(self, path: str, training_state_dir: str | None = None) -> None:
        self.model.load_state_dict(torch.load(os.path.join(path, "model.pt")))
        state_dir = training_state_dir or path
        self.optimizer.load_state_dict(torch.load(os.path.join(state_dir, "optim.pt")))


def manager(tmp_path, **kw) -> CheckpointManager:
    return CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt"), **kw))


def test_resume_restores_weights_optimizer_loader_rng_and_extra_state(tmp_path):
    policy = LinearPolicy()
    loader = StatefulDataLoader(list(range(20)), batch_size=4, seed=3)
    it = iter(loader)
    for _ in range(2):
        next(it)
        policy.step()
    ckpts = manager(tmp_path)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    ckpts.save(2, policy, dataloader=loader, extra_state={"history": [1.0, 0.5]})
    expected_batch = next(it)
    expected_draws = (random.random(), np.random.rand(), torch.rand(1))
    policy.step()
    expected_weight = policy.model.weight.detach().clone()

    fresh, fresh_loader = LinearPolicy(seed=1), StatefulDataLoader(list(range(20)), 4, seed=3)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    resumed = manager(tmp_path)
    state = resumed.load(resumed.latest(), fresh, dataloader=fresh_loader)
    assert state["step"] == 2 and state["extra"] == {"history": [1.0, 0.5]}
    assert next(iter(fresh_loader)) == expected_batch
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected_draws
    fresh.step()  # Adam's moments came back too, so the next step lands on the same weights
    torch.testing.assert_close(fresh.model.weight, expected_weight, rtol=0, atol=0)


def test_the_policy_folder_holds_the_model_and_the_optimiser_state_lies_beside_it(tmp_path):
    policy = LinearPolicy()
    policy.step()
    path = manager(tmp_path).save(1, policy, models={"critic": LinearPolicy(seed=2)})
    for name in ("policy", "critic"):
        assert sorted(os.listdir(path / name)) == ["model.pt"]
        assert sorted(os.listdir(path / "optimizer_state" / name)) == ["optim.pt"]


def test_a_checkpoint_with_the_optimiser_state_in_the_model_folder_still_loads(tmp_path):
    """Checkpoints written before the optimiser state moved out of ``policy/`` resume."""
    policy = LinearPolicy()
    policy.step()
    path = manager(tmp_path).save(1, policy)
    os.rename(path / "optimizer_state" / "policy" / "optim.pt", path / "policy" / "optim.pt")
    os.rmdir(path / "optimizer_state" / "policy")
    os.rmdir(path / "optimizer_state")
    policy.step()
    expected = policy.model.weight.detach().clone()

    fresh = LinearPolicy(seed=1)
    resumed = manager(tmp_path)
    resumed.load(resumed.latest(), fresh)
    fresh.step()  # the same weights after the step: Adam's moments were read from policy/
    torch.testing.assert_close(fresh.model.weight, expected, rtol=0, atol=0)


def test_keeps_the_top_k_by_metric_plus_the_latest(tmp_path):
    ckpts = manager(tmp_path, keep_top_k=2, metric_name="val/loss", higher_is_better=False)
    losses = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.7, 5: 0.8}
    for step, loss in losses.items():
        ckpts.save(step, None, metrics={"val/loss": loss})
    assert [p.name for p in ckpts.checkpoints()] == ["step_2", "step_3", "step_5"]
    assert ckpts.latest().name == "step_5"


def test_without_a_metric_keeps_the_newest(tmp_path):
    ckpts = manager(tmp_path, keep_top_k=2)
    for step in range(1, 5):
        ckpts.save(step, None)
    assert [p.name for p in ckpts.checkpoints()] == ["step_3", "step_4"]


def test_a_checkpoint_killed_mid_write_is_never_resumed_from(tmp_path):
    """A real SIGKILL while the policy is being written; the next run sees only step_1."""
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from rl_algorithms.utils.checkpoint import CheckpointingConfig, CheckpointManager

        class SlowPolicy:
            def save_checkpoint(self, path, training_state_dir=None):
                os.makedirs(path)
                with open(os.path.join(path, "model.safetensors"), "wb") as f:
                    f.write(b"x" * 1000)
                    f.flush()
                    print("writing", flush=True)
                    time.sleep(60)  # killed here

        m = CheckpointManager(CheckpointingConfig(checkpoint_dir={str(tmp_path / "ckpt")!r}))
        m.save(1, None)
        m.save(2, SlowPolicy())
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        assert any(p.name.startswith(".tmp-step_2") for p in (tmp_path / "ckpt").iterdir())
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    time.sleep(0.1)
    resumed = manager(tmp_path)
    assert resumed.latest().name == "step_1"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_1"]  # leftover gone


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    run = {
        "policy": {"model": {"path": "models/a", "dtype": "float32"}, "lr": 1e-5},
        "tokenizer": {"path": "models/a"},
        "data": {"train": {"path": "train.jsonl"}},
        "sft": {"max_num_steps": 10},
    }
    ckpt = manager(tmp_path)
    path = ckpt.save(4, None, run_config=run)
    # The same run, continued for longer with another learning rate: resumable.
    longer = {
        **run,
        "sft": {"max_num_steps": 20},
        "policy": {"model": {"path": "models/a", "dtype": "bfloat16"}, "lr": 2e-5},
    }
    ckpt.check_resumable(path, longer)
    other_model = {**run, "policy": {**run["policy"], "model": {"path": "models/b"}}}
    with pytest.raises(ValueError, match=r"another run .*policy\.model\.path: checkpoint"):
        ckpt.check_resumable(path, other_model)
    other_data = {**run, "data": {"train": {"path": "other.jsonl"}}}
    with pytest.raises(ValueError, match=r"data\.train: checkpoint .*'train.jsonl'.*'other.jsonl'"):
        ckpt.check_resumable(path, other_data)


class VersionedPolicy(LinearPolicy):
    """Counts its weight versions as ``Policy`` does: one per optimiser step, one per load."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.weight_version = 0

    def step(self) -> None:
        super().step()
        self.weight_version += 1

    def load_checkpoint(self, path: str, training_state_dir: str | None = None) -> None:
        super().load_checkpoint(path, training_state_dir)
        self.weight_version += 1


def test_resume_restores_the_policys_weight_version(tmp_path):
    # Generators seed their sampling from it (rl_models.generation.seeds): a resumed policy
    # must go on from the saved version, as the uninterrupted run does.
    policy = VersionedPolicy()
    for _ in range(3):
        policy.step()
    ckpts = manager(tmp_path)
    ckpts.save(3, policy)
    fresh = VersionedPolicy(seed=1)
    ckpts.load(ckpts.latest(), fresh)
    assert fresh.weight_version == 3
    # Version 0 names the initial weights every generator starts with; a checkpoint of them
    # leaves the loaded policy a version of its own, so the generator is refit all the same.
    untrained = manager(tmp_path / "untrained")
    untrained.save(1, VersionedPolicy())
    fresh = VersionedPolicy(seed=1)
    untrained.load(untrained.latest(), fresh)
    assert fresh.weight_version == 1


def test_checkpoint_must_save_by_reads_nemo_rls_duration_format():
    assert duration_seconds("01:02:03:04") == 86400 + 2 * 3600 + 3 * 60 + 4
    assert duration_seconds("00:03:35:00") == duration_seconds("03:35:00") == 12900
    assert duration_seconds("0:0:0:1") == 1
    with pytest.raises(ConfigError) as err:
        validate_config({"checkpoint_must_save_by": "3h"}, CheckpointingConfig)
    assert "checkpoint_must_save_by" in str(err.value) and "DD:HH:MM:SS" in str(err.value)
    with pytest.raises(ConfigError):
        validate_config({"checkpoint_must_save_by": "1:2:3:4:5"}, CheckpointingConfig)


def test_the_job_deadline_is_the_earlier_limit_and_must_be_a_unix_time(tmp_path, monkeypatch):
    monkeypatch.setenv(CHECKPOINT_DEADLINE_ENV, "5000")
    assert manager(tmp_path, checkpoint_must_save_by="01:00:00").deadline == 5000.0
    config = CheckpointingConfig(checkpoint_dir=str(tmp_path), checkpoint_must_save_by="60")
    assert CheckpointManager(config, clock=lambda: 4000.0).deadline == 4060.0
    monkeypatch.delenv(CHECKPOINT_DEADLINE_ENV)
    assert manager(tmp_path).deadline is None
    monkeypatch.setenv(CHECKPOINT_DEADLINE_ENV, "2026-01-01T00:00")
    with pytest.raises(ValueError, match=f"{CHECKPOINT_DEADLINE_ENV}='2026-01-01T00:00'"):
        manager(tmp_path)
    monkeypatch.setenv(CHECKPOINT_DEADLINE_ENV, "nan")  # would never stop the run
    with pytest.raises(ValueError, match=f"{CHECKPOINT_DEADLINE_ENV}='nan'"):
        manager(tmp_path)
    # A run that does not checkpoint (rl eval) never reads the variable.
    disabled = CheckpointingConfig(checkpoint_dir=str(tmp_path), enabled=False)
    assert CheckpointManager(disabled).deadline is None
