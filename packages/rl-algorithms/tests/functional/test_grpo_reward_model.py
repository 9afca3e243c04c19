"""`rl grpo` with a reward model as its reward (`env: {kind: reward_model}`): a tiny sequence
classifier, saved like a trained one, scores the rollouts inside the run."""

import math
import shutil

import pytest

from rl_algorithms import cli

from .conftest import TINY_LLAMA, read_metrics, series, write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]


def save_reward_model(path, tokenizer_dir) -> str:
    """A randomly initialised one-label Llama classifier with the run's tokenizer: its scores
    differ from one response to the next, which a constant (or a failed scoring, 0) cannot."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    config.num_labels = 1
    config.pad_token_id = tokenizer.pad_token_id
    LlamaForSequenceClassification(config).save_pretrained(path)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, path / file.name)
    return str(path)


def test_rl_grpo_takes_its_rewards_from_a_reward_model(tmp_path, assets):
    from pathlib import Path

    model_path = save_reward_model(tmp_path / "reward_model", Path(assets["tokenizer"]))
    config = {
        "policy": {
            "model": {"hf_config": TINY_LLAMA, "dtype": "float32"},
            "max_total_sequence_length": 96,
            "train_global_batch_size": 8,
            "train_micro_batch_size": 4,
            "optimizer": {"name": "AdamW", "kwargs": {"lr": 1.0e-3}},
        },
        "tokenizer": {"path": assets["tokenizer"]},
        "generation": {"backend": "hf", "sampling": {"max_new_tokens": 8}},
        "env": {
            # The arithmetic prompts' task name; their answers go unused.
            "arithmetic": {
                "kind": "reward_model",
                "config": {"model_path": model_path, "device": "cpu"},
            }
        },
        "data": {
            "train": {"source": "arithmetic", "size": 16, "max_operand": 9},
            "max_seq_length": 64,
        },
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "max_num_steps": 2},
        "logger": {"log_dir": str(tmp_path / "logs"), "progress_bar": False},
        "checkpointing": {"enabled": False},
        "cluster": {"ray_num_cpus": 4},
    }
    assert cli.main(["grpo", "--config", write_config(tmp_path, config)]) == 0

    records = read_metrics(tmp_path / "logs")
    assert len(series(records, "train/loss")) == 2
    means, stds = series(records, "train/reward_mean"), series(records, "train/reward_std")
    assert all(math.isfinite(x) for x in means + stds), records
    # Eight responses per step get eight different scores from the classifier.
    assert all(s > 0 for s in stds), stds
    assert all(m != 0 for m in means), means
    # The declared train metrics are logged (no validation in this run).
    declared = cli.build_config(
        cli.load_algorithm("grpo"), ["--config", str(tmp_path / "run.yaml")]
    )
    train_declared = {k for k in declared.logged_metrics() if k.startswith("train/")}
    logged = {key for record in records for key in record}
    assert train_declared <= logged, train_declared - logged
