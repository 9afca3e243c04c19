"""`rl sft` end to end on a tiny model: losses read back from the JSONL and TensorBoard logs."""

import math

import pytest

from rl_algorithms import cli

from .conftest import base_config, read_metrics, series, write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]


def test_rl_sft_trains_validates_and_checkpoints(tmp_path, assets):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = base_config(tmp_path, assets)
    path = write_config(tmp_path, config)
    assert (
        cli.main(
            [
                "sft",
                "--config",
                path,
                "sft.max_num_steps=8",
                "sft.val_period=4",
                "sft.val_at_start=true",
                "checkpointing.save_period=4",
            ]
        )
        == 0
    )

    records = read_metrics(tmp_path / "logs")
    losses = series(records, "train/loss")
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-2:]) < 0.8 * sum(losses[:2]), losses
    val = series(records, "val/loss")
    assert len(val) == 3 and val[-1] < val[0], val  # at start, step 4, step 8
    assert all(r["train/timing/train"] > 0 for r in records if "train/loss" in r)

    events = EventAccumulator(str(tmp_path / "logs" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 9))
    assert [p.name for p in sorted((tmp_path / "ckpt").iterdir())] == ["step_4", "step_8"]
    assert (tmp_path / "ckpt" / "step_8" / "policy" / "model.safetensors").is_file()
    assert (tmp_path / "logs" / "config.yaml").is_file()
