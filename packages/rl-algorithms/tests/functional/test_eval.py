"""`rl eval` end to end: a checkpoint written by the CheckpointManager, arithmetic prompts
scored by the math environment, metrics in the JSONL log and the per-sample file."""

import json
import math
from pathlib import Path

import pytest
import torch

from rl_algorithms import cli
from rl_algorithms.utils.checkpoint import CheckpointingConfig, CheckpointManager

from ..conftest import VLLM_CPU
from .conftest import TINY_LLAMA, read_metrics, save_tiny_vllm_llama, write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]
PROGRAMS = Path(__file__).parents[1] / "agent_program_examples.py"


class SavedModel:
    """Writes a tiny HF model where Policy.save_checkpoint would (the checkpoint's policy/)."""

    def save_checkpoint(self, path: str, training_state_dir: str | None = None) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        hf = dict(TINY_LLAMA)
        config = AutoConfig.for_model(hf.pop("model_type"), **hf)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)


def test_rl_eval_scores_a_checkpoint(tmp_path, assets):
    ckpt = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt")))
    ckpt.save(3, SavedModel())
    samples = tmp_path / "samples.jsonl"
    config = {
        "checkpoint": str(tmp_path / "ckpt"),  # a checkpoint directory: its latest step
        "tokenizer": {"path": assets["tokenizer"]},
        "generation": {"backend": "hf", "sampling": {"max_new_tokens": 8}},
        "env": {"arithmetic": {"kind": "math", "config": {"num_workers": 1}}},
        "data": {
            "dataset": {"source": "arithmetic", "size": 3, "max_operand": 9},
            "max_seq_length": 64,
        },
        "eval": {
            "num_tests_per_prompt": 4,
            "pass_k_value": [1, 4],
            "prompts_per_batch": 2,
            "max_total_sequence_length": 96,
            "output_file": str(samples),
        },
        "logger": {"log_dir": str(tmp_path / "logs"), "progress_bar": False},
        "cluster": {"ray_num_cpus": 4},
    }
    assert cli.main(["eval", "--config", write_config(tmp_path, config)]) == 0

    [record] = [r for r in read_metrics(tmp_path / "logs") if "eval/pass@1" in r]
    assert record["eval/num_prompts"] == 3 and record["eval/num_samples"] == 12
    lines = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(lines) == 12 and sorted({r["prompt_idx"] for r in lines}) == [0, 1, 2]
    # the logged metrics are those of the samples written out
    correct = [r["correct"] for r in lines]
    assert record["eval/pass@1"] == pytest.approx(sum(correct) / 12)
    assert 0.0 <= record["eval/pass@1"] <= record["eval/pass@4"] <= 1.0
    assert math.isfinite(record["eval/majority_vote_accuracy"])
    assert all(r["reward"] in (0.0, 1.0) and isinstance(r["response"], str) for r in lines)


def test_rl_eval_on_vllm_plays_an_agent_program_against_a_model_directory(tmp_path, assets):
    """`backend: vllm` (the default eval recipe's) end to end on vllm-cpu, every episode played
    by an agent program of the user's (two turns through the run's OpenAI-compatible endpoint,
    with the plain `openai` client) and scored by the math environment."""
    model = save_tiny_vllm_llama(tmp_path / "tiny", assets["tokenizer"])
    config = {
        "model": {"path": model, "dtype": "float32"},
        "tokenizer": {"path": model},
        "generation": {
            "backend": "vllm",
            "sampling": {"max_new_tokens": 8},
            "vllm": dict(VLLM_CPU),
        },
        "env": {"arithmetic": {"kind": "math", "config": {"num_workers": 1}}},
        "data": {
            "dataset": {"source": "arithmetic", "size": 3, "max_operand": 9},
            "max_seq_length": 64,
        },
        "eval": {
            "num_tests_per_prompt": 2,
            "pass_k_value": [1, 2],
            "prompts_per_batch": 3,
            "max_total_sequence_length": 120,
            "agent_program": {"function": f"{PROGRAMS}:talk", "max_episode_seconds": 120},
            "output_file": str(tmp_path / "samples.jsonl"),
        },
        "logger": {"log_dir": str(tmp_path / "logs"), "progress_bar": False},
        "cluster": {"ray_num_cpus": 4},
    }
    assert cli.main(["eval", "--config", write_config(tmp_path, config)]) == 0
    [record] = [r for r in read_metrics(tmp_path / "logs") if "eval/pass@1" in r]
    assert record["eval/num_prompts"] == 3 and record["eval/num_samples"] == 6
    assert 0.0 <= record["eval/pass@1"] <= record["eval/pass@2"] <= 1.0
    # Every episode was the program's: two requests, its second user turn in the transcript.
    assert record["eval/agent_program/failed_episodes"] == 0, record
    assert record["eval/agent_program/requests_mean"] == 2, record
    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and all("Once more." in r["response"] for r in lines), lines
