"""NeMo RL's own recipes, run by `rl` on tiny models on the CPU: the sliding-puzzle GRPO recipe,
the PPO math recipe (its ``value:`` section our critic) and the distillation math recipe (its
``teacher:`` section our teacher).

The recipe files are the verbatim copies in tests/nemo_recipes; every override names a NeMo RL
key (sizing the run for a CPU) except the Ray CPU count, which is ours. Models are named by hub
ids and found in a local Hugging Face cache laid out as huggingface_hub writes it; NeMo's named
math datasets are read from local files in their published column layout.
"""

import json
import math
import shutil
import time
from pathlib import Path

import pytest
import yaml

from rl_algorithms import cli

from .conftest import TINY_LLAMA, read_metrics, write_jsonl

# Each run takes a minute or two alone; on a loaded machine the default 300 s is too short.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(900)]

RECIPES = Path(__file__).parents[1] / "nemo_recipes"
SNAPSHOT = "0123abcd"

# A CPU-sized run: NeMo keys every recipe here has, with ours (the Ray CPU count) last.
CPU_SIZED = [
    "policy.precision=float32",
    "policy.generation.backend=hf",
    "checkpointing.enabled=false",
    "logger.monitor_gpus=false",
    "cluster.gpus_per_node=0",
    "cluster.ray_num_cpus=4",
]
PROBLEMS = [("What is 2 + 2?", "4"), ("What is 3 + 5?", "8")]


def tiny_model_in_hub_cache(hf_home: Path, repo: str, tokenizer_dir: str, seed: int = 0) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / SNAPSHOT
    config = AutoConfig.for_model(**{**TINY_LLAMA, "max_position_embeddings": 1024})
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(snapshot)
    shutil.copytree(tokenizer_dir, snapshot, dirs_exist_ok=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(SNAPSHOT)


def run_nemo_recipe(command: str, recipe: str, tmp_path: Path, *overrides: str) -> list[dict]:
    """`rl <command> --config <recipe>` with the overrides; the train steps' metrics."""
    started = time.monotonic()
    argv = [command, "--config", str(RECIPES / recipe), *overrides]
    argv += [f"logger.log_dir={tmp_path / 'logs'}", *CPU_SIZED]
    assert cli.main(argv) == 0
    print(f"rl {command} --config {recipe}: {time.monotonic() - started:.0f}s")
    return [r for r in read_metrics(tmp_path / "logs") if "train/loss" in r]


def saved_config(tmp_path: Path) -> dict:
    return yaml.safe_load((tmp_path / "logs" / "config.yaml").read_text())


def from_the_cache(path: str, repo: str) -> bool:
    return path.endswith(f"models--{repo.replace('/', '--')}/snapshots/{SNAPSHOT}")


@pytest.fixture
def hub_and_data(tmp_path, assets, monkeypatch) -> Path:
    """A hub cache with the tiny policy, and empty local dataset and conversion directories."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("RL_DATASETS_DIR", str(tmp_path / "datasets"))
    monkeypatch.setenv("RL_DATA_CACHE", str(tmp_path / "cache"))
    tiny_model_in_hub_cache(tmp_path / "hf", "tiny-org/TinyLlama", assets["tokenizer"])
    return tmp_path / "datasets"


def test_rl_grpo_runs_nemo_rls_sliding_puzzle_recipe(tmp_path, hub_and_data):
    steps = run_nemo_recipe(
        "grpo",
        "grpo_sliding_puzzle.yaml",
        tmp_path,
        "policy.model_name=tiny-org/TinyLlama",
        "policy.dtensor_cfg.cpu_offload=false",  # refused otherwise (FSDP2 parameter offload)
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
    )
    assert len(steps) == 2
    for step in steps:
        assert math.isfinite(step["train/loss"]) and math.isfinite(step["train/reward_mean"])
        # A random tiny model never solves a puzzle in one turn: every game played two.
        assert step["train/mean_turns"] == 2.0
    assert from_the_cache(saved_config(tmp_path)["policy"]["model"]["path"], "tiny-org/TinyLlama")
    files = sorted((tmp_path / "cache").glob("sliding_puzzle-*.jsonl"))  # train and validation
    games = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    assert len(files) == 2 and len(games) == 2 * 2 + 2  # prompts x steps, max_val_samples
    assert all(2 <= len(g["board"]) <= 3 for g in games)


def dapo_row(i: int, question: str, answer: str) -> dict:
    """A row of BytedTsinghua-SIA/DAPO-Math-17k (and its AIME-2024) as published."""
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": question, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lang"},
        "extra_info": {"index": str(i)},
    }


def test_rl_ppo_runs_nemo_rls_ppo_math_recipe_with_its_value_model(tmp_path, hub_and_data):
    # Found under the hub ids here (the NeMo names work too, as in the distillation test).
    for hub_id in ("BytedTsinghua-SIA/DAPO-Math-17k", "BytedTsinghua-SIA/AIME-2024"):
        (hub_and_data / hub_id).mkdir(parents=True)
        rows = [dapo_row(i, q, a) for i, (q, a) in enumerate(PROBLEMS)]
        write_jsonl(hub_and_data / hub_id / "train.jsonl", rows)
    steps = run_nemo_recipe(
        "ppo",
        "ppo_math_1B.yaml",
        tmp_path,
        "policy.model_name=tiny-org/TinyLlama",  # value.model_name follows it
        "value.precision=float32",
        "env.math.math_verify_impl=hf_math_verify",  # refused: NeMo's DAPO verifier
        "env.math.num_workers=1",
        "policy.generation.max_new_tokens=8",
        "policy.max_total_sequence_length=256",
        "policy.train_global_batch_size=2",
        "policy.train_micro_batch_size=2",
        "ppo.num_prompts_per_step=2",
        "ppo.num_generations_per_prompt=1",
        "ppo.ppo_epochs=1",
        "ppo.max_num_steps=2",
        "ppo.val_at_start=false",
    )
    assert len(steps) == 2
    for step in steps:
        assert math.isfinite(step["train/loss"])
        assert math.isfinite(step["train/critic/value_loss"])  # the value model trained
    config = saved_config(tmp_path)
    assert config["critic"]["model"]["kind"] == "value"
    assert from_the_cache(config["critic"]["model"]["path"], "tiny-org/TinyLlama")
    assert config["critic"]["optimizer"]["kwargs"]["lr"] == 1.0e-5  # value.optimizer's
    assert config["ppo"]["adv_estimator"]["name"] == "gae"


def test_rl_distill_runs_nemo_rls_distillation_math_recipe_with_its_teacher(
    tmp_path, assets, hub_and_data, monkeypatch
):
    tiny_model_in_hub_cache(tmp_path / "hf", "tiny-org/TinyTeacher", assets["tokenizer"], seed=1)
    # NeMo's named datasets in their published columns, under the NeMo names.
    for name in ("DeepScaler", "AIME2024"):
        (hub_and_data / name).mkdir(parents=True)
        rows = [{"problem": q, "answer": a, "solution": f"So {a}."} for q, a in PROBLEMS]
        write_jsonl(hub_and_data / name / "train.jsonl", rows)
    # Run from a NeMo RL checkout's root, where the recipe's prompt_file (relative) lies.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples" / "prompts").mkdir(parents=True)
    (tmp_path / "examples" / "prompts" / "cot.txt").write_text("Reason, then answer: {}")
    steps = run_nemo_recipe(
        "distill",
        "distillation_math.yaml",
        tmp_path,
        "policy.model_name=tiny-org/TinyLlama",
        "teacher.model_name=tiny-org/TinyTeacher",
        "teacher.precision=float32",
        "policy.dtensor_cfg.tensor_parallel_size=1",
        "policy.dtensor_cfg.context_parallel_size=1",
        "teacher.dtensor_cfg.tensor_parallel_size=1",
        "teacher.dtensor_cfg.context_parallel_size=1",
        "env.math.num_workers=1",
        "policy.generation.max_new_tokens=8",
        "policy.max_total_sequence_length=256",
        "teacher.max_total_sequence_length=256",
        "policy.train_global_batch_size=2",
        "policy.train_micro_batch_size=2",
        "distillation.num_prompts_per_step=2",
        "distillation.max_num_steps=2",
        "distillation.topk_logits_k=8",
        "logger.wandb_enabled=false",
    )
    assert len(steps) == 2
    for step in steps:
        assert math.isfinite(step["train/loss"]) and math.isfinite(step["train/kl"])
    config = saved_config(tmp_path)
    assert from_the_cache(config["teacher"]["model"]["path"], "tiny-org/TinyTeacher")
    assert from_the_cache(config["policy"]["model"]["path"], "tiny-org/TinyLlama")
    lines = Path(config["data"]["train"]["path"]).read_text().splitlines()
    prompts = [json.loads(line) for line in lines]
    assert prompts[0]["messages"][-1]["content"] == "Reason, then answer: What is 2 + 2?"
