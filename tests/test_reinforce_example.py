"""The "adding an algorithm" example of docs/architecture.md: the page shows the file as it
is, and the file runs (a plain REINFORCE loop on the built-in arithmetic task, tiny model)."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "reinforce.py"


def test_the_docs_show_the_example_file_whole_and_it_is_short():
    page = (ROOT / "docs" / "architecture.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert EXAMPLE.read_text() in blocks
    assert len(EXAMPLE.read_text().splitlines()) < 80


@pytest.mark.slow
def test_the_reinforce_example_trains_validates_and_checkpoints(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--config",
            str(ROOT / "examples" / "configs" / "grpo_math_cpu.yaml"),
            "grpo.max_num_steps=2",
            "grpo.val_period=2",
            "checkpointing.save_period=2",
            f"logger.log_dir={tmp_path / 'logs'}",
            f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    records = [
        json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().split("\n") if x
    ]
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(math.isfinite(r["train/loss"]) for r in train)
    assert [r["step"] for r in records if "val/accuracy" in r] == [2]
    assert (tmp_path / "ckpt" / "step_2" / "policy").is_dir()
