"""`rl rm` end to end: a tiny sequence classifier learns to rank chosen above rejected."""

import math

import pytest
import torch

from rl_algorithms import cli

from .conftest import base_config, read_metrics, series, write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]


def test_rl_rm_loss_falls_and_the_checkpoint_is_a_classifier(tmp_path, assets):
    from transformers import AutoModelForSequenceClassification

    config = base_config(tmp_path, assets, kind="pref")
    config["policy"]["model"]["kind"] = "sequence_classification"
    config["rm"] = {"max_num_steps": 6, "val_period": 6, "val_global_batch_size": 4}
    assert cli.main(["rm", "--config", write_config(tmp_path, config)]) == 0

    records = read_metrics(tmp_path / "logs")
    # What the config declares it logs (and so lets checkpointing.metric_name rank by) is
    # logged: the declaration cannot drift from the loop.
    logged = {key for record in records for key in record}
    declared = cli.build_config(cli.load_algorithm("rm"), ["--config", str(tmp_path / "run.yaml")])
    assert declared.logged_metrics() <= logged, declared.logged_metrics() - logged
    losses = series(records, "train/loss")
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-2:]) < 0.8 * sum(losses[:2]), losses
    model = AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "ckpt" / "step_6" / "policy", dtype=torch.float32
    )
    assert model.config.num_labels == 1
