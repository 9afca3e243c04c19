"""`rl dpo` end to end on a tiny model: the DPO loss read back from the JSONL log falls."""

import math

import pytest

from rl_algorithms import cli

from .conftest import base_config, read_metrics, series, write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]


def test_rl_dpo_loss_is_finite_and_falls(tmp_path, assets):
    config = base_config(tmp_path, assets, kind="pref")
    config["dpo"] = {
        "max_num_steps": 6,
        "val_period": 3,
        "val_global_batch_size": 4,
        "reference_policy_kl_penalty": 0.5,
    }
    assert cli.main(["dpo", "--config", write_config(tmp_path, config)]) == 0

    records = read_metrics(tmp_path / "logs")
    losses = series(records, "train/loss")
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    # The policy starts as its reference: every log-ratio is 0 and the loss is log 2.
    assert losses[0] == pytest.approx(math.log(2), abs=1e-4)
    assert sum(losses[-2:]) < 0.8 * sum(losses[:2]), losses
    val = series(records, "val/loss")
    assert len(val) == 2 and val[1] < val[0] < math.log(2)
