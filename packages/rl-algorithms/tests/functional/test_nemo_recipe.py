"""NeMo RL's own sliding-puzzle recipe, run by `rl grpo` on a tiny model on the CPU.

The recipe file is the verbatim copy in tests/nemo_recipes; every override names a NeMo RL key
(sizing the run for a CPU) except the Ray CPU count, which is ours. The model is named by a hub
id and found in a local Hugging Face cache laid out as huggingface_hub writes it.
"""

import json
import math
import shutil
from pathlib import Path

import pytest

from rl_algorithms import cli

from .conftest import TINY_LLAMA, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]

RECIPE = Path(__file__).parents[1] / "nemo_recipes" / "grpo_sliding_puzzle.yaml"


def tiny_model_in_hub_cache(hf_home: Path, repo: str, tokenizer_dir: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / "0123abcd"
    config = AutoConfig.for_model(**{**TINY_LLAMA, "max_position_embeddings": 1024})
    AutoModelForCausalLM.from_config(config).save_pretrained(snapshot)
    shutil.copytree(tokenizer_dir, snapshot, dirs_exist_ok=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("0123abcd")


def test_rl_grpo_runs_nemo_rls_sliding_puzzle_recipe(tmp_path, assets, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("RL_DATA_CACHE", str(tmp_path / "cache"))
    tiny_model_in_hub_cache(tmp_path / "hf", "tiny-org/TinyLlama", assets["tokenizer"])
    argv = [
        "grpo",
        "--config",
        str(RECIPE),
        "policy.model_name=tiny-org/TinyLlama",
        "policy.dtensor_cfg.cpu_offload=false",  # refused otherwise (FSDP2 parameter offload)
        "policy.precision=float32",
        "policy.generation.backend=hf",
        "policy.generation.max_new_tokens=8",
        "policy.max_total_sequence_length=512",
        "policy.train_global_batch_size=8",
        "policy.train_micro_batch_size=4",
        "grpo.num_prompts_per_step=2",
        "grpo.num_generations_per_prompt=4",
        "grpo.max_num_steps=2",
        "grpo.max_rollout_turns=2",
        "grpo.max_val_samples=2",
        "grpo.val_batch_size=2",
        "env.sliding_puzzle_game.cfg.game_config.size=3",
        "checkpointing.enabled=false",
        f"logger.log_dir={tmp_path / 'logs'}",
        "logger.monitor_gpus=false",
        "cluster.gpus_per_node=0",
        "cluster.ray_num_cpus=4",
    ]
    assert cli.main(argv) == 0

    steps = [r for r in read_metrics(tmp_path / "logs") if "train/loss" in r]
    assert len(steps) == 2
    for step in steps:
        assert math.isfinite(step["train/loss"]) and math.isfinite(step["train/reward_mean"])
        # A random tiny model never solves a puzzle in one turn: every game played two.
        assert step["train/mean_turns"] == 2.0
    saved = (tmp_path / "logs" / "config.yaml").read_text()
    assert "snapshots/0123abcd" in saved  # the hub id, resolved from the local cache
    files = sorted((tmp_path / "cache").glob("sliding_puzzle-*.jsonl"))  # train and validation
    games = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    assert len(files) == 2 and len(games) == 2 * 2 + 2  # prompts x steps, max_val_samples
    assert all(2 <= len(g["board"]) <= 3 for g in games)
