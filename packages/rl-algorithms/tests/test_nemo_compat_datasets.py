"""NeMo RL's dataset names and hub ids, found locally and converted as NeMo shapes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_algorithms import cli

from .test_nemo_compat import ALGORITHM, NO_OFFLOAD, recipe


def fake_hub_snapshot(hf_home: Path, repo: str) -> Path:
    """The layout huggingface_hub's cache uses: models--org--name/{refs/main, snapshots/rev}."""
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("0123abcd")
    return snapshot


def test_a_hub_id_resolves_from_the_local_cache_or_says_where_it_looked(tmp_path, monkeypatch):
    from rl_models.model_files import resolve_model_path

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    snapshot = fake_hub_snapshot(tmp_path / "hf", "Org/Tiny-1B")
    assert Path(resolve_model_path("Org/Tiny-1B")) == snapshot
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "hf" / "hub")):
        resolve_model_path("Org/Missing-1B")


def run_prepare(name: str, *overrides: str):
    algorithm = cli.load_algorithm(ALGORITHM[name])
    nemo: list = []
    config = cli.build_config(algorithm, ["--config", recipe(name), *overrides], nemo)
    return nemo[0].prepare(config)


def test_a_named_dataset_is_found_locally_and_converted_as_nemo_shapes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("RL_DATASETS_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("RL_DATA_CACHE", str(tmp_path / "cache"))
    fake_hub_snapshot(tmp_path / "hf", "Qwen/Qwen2.5-1.5B")
    (tmp_path / "data" / "OpenMathInstruct-2").mkdir(parents=True)
    rows = [{"problem": "What is 1+1?", "expected_answer": "2", "generated_solution": "..."}]
    (tmp_path / "data" / "OpenMathInstruct-2" / "train_1M.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows)
    )
    prompt = tmp_path / "cot.txt"
    prompt.write_text("Think, then answer: {}")
    config = run_prepare("grpo_math_1B", f"data.default.prompt_file={prompt}")
    assert Path(config.policy.model.path).is_dir()  # the hub id, resolved from the cache
    written = [json.loads(line) for line in Path(config.data.train.path).read_text().splitlines()]
    assert written == [
        {
            "messages": [{"role": "user", "content": "Think, then answer: What is 1+1?"}],
            "ground_truth": "2",
        }
    ]


def test_a_missing_dataset_fails_before_the_run_naming_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("RL_DATASETS_DIR", str(tmp_path / "data"))
    fake_hub_snapshot(tmp_path / "hf", "meta-llama/Llama-3.2-1B-Instruct")
    with pytest.raises(FileNotFoundError) as e:
        run_prepare("dpo")
    assert "'HelpSteer3'" in str(e.value)
    assert str(tmp_path / "data" / "nvidia" / "HelpSteer3") in str(e.value)


def test_helpsteer3_rows_become_preference_pairs(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("RL_DATASETS_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("RL_DATA_CACHE", str(tmp_path / "cache"))
    fake_hub_snapshot(tmp_path / "hf", "meta-llama/Llama-3.2-1B-Instruct")
    ctx = [{"role": "user", "content": "hi"}]
    rows = [
        {"context": ctx, "response1": "a", "response2": "b", "overall_preference": -2},
        {"context": "plain", "response1": "a", "response2": "b", "overall_preference": 1},
        {"context": ctx, "response1": "a", "response2": "b", "overall_preference": 0},
    ]
    for split in ("train", "validation"):
        path = tmp_path / "data" / "HelpSteer3" / f"{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = run_prepare("dpo")
    written = [json.loads(line) for line in Path(config.data.train.path).read_text().splitlines()]
    assert written == [  # negative: response1 preferred; positive: response2; ties dropped
        {"prompt": ctx, "chosen": "a", "rejected": "b"},
        {"prompt": "plain", "chosen": "b", "rejected": "a"},
    ]


def test_sliding_puzzle_games_are_generated_as_nemo_draws_them(tmp_path, monkeypatch):
    from rl_envs.sliding_puzzle import SlidingPuzzleConfig, first_prompt, solved_board

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("RL_DATA_CACHE", str(tmp_path / "cache"))
    fake_hub_snapshot(tmp_path / "hf", "Qwen/Qwen2.5-1.5B-Instruct")
    config = run_prepare(
        "grpo_sliding_puzzle",
        *NO_OFFLOAD["grpo_sliding_puzzle"],
        "grpo.max_num_steps=2",
        "grpo.max_val_samples=3",
    )
    train = [json.loads(x) for x in Path(config.data.train.path).read_text().splitlines()]
    val = [json.loads(x) for x in Path(config.data.validation.path).read_text().splitlines()]
    assert (len(train), len(val)) == (2 * 32, 3)  # steps x prompts per step; max_val_samples
    env_cfg = SlidingPuzzleConfig(max_turns=30)
    for game in train:
        size = len(game["board"])
        assert 2 <= size <= 5 and game["turn"] == 0
        assert game["board"] != solved_board(size)
        assert game["prompt"] == first_prompt(game, env_cfg)
    assert len({len(g["board"]) for g in train}) > 1  # sizes are drawn, not all 5x5


def test_a_split_is_never_read_from_a_file_without_splits(tmp_path, monkeypatch):
    from rl_algorithms.nemo_compat.datasets import DatasetJob

    monkeypatch.setenv("RL_DATASETS_DIR", str(tmp_path / "data"))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "squad.jsonl").write_text("{}\n")  # one file: train or validation?
    job = DatasetJob("data.validation", "squad", "validation", "squad", "sft")
    with pytest.raises(FileNotFoundError) as e:
        job.locate()
    assert str(tmp_path / "data" / "squad" / "validation.jsonl") in str(e.value)
    assert "without splits is not read for a split" in str(e.value)
    # A saved DatasetDict counts only when it holds the split.
    (tmp_path / "data" / "squad").mkdir()
    index = tmp_path / "data" / "squad" / "dataset_dict.json"
    index.write_text(json.dumps({"splits": ["train"]}))
    with pytest.raises(FileNotFoundError, match="a DatasetDict with split 'validation'"):
        job.locate()
    index.write_text(json.dumps({"splits": ["train", "validation"]}))
    assert job.locate() == (tmp_path / "data" / "squad", "validation")


def test_a_changed_prompt_file_converts_the_dataset_again(tmp_path, monkeypatch):
    from rl_algorithms.nemo_compat.datasets import DatasetJob

    monkeypatch.setenv("RL_DATASETS_DIR", str(tmp_path / "data"))
    source = tmp_path / "data" / "OpenMathInstruct-2" / "train_1M.jsonl"
    source.parent.mkdir(parents=True)
    source.write_text(json.dumps({"problem": "1+1?", "expected_answer": "2"}) + "\n")
    prompt = tmp_path / "prompt.txt"
    job = DatasetJob("data.train", "OpenMathInstruct-2", "train_1M", "math", "prompt")
    job.prompt_file, job.out = str(prompt), str(tmp_path / "cache" / "out.jsonl")

    def user_text() -> str:
        job.write(None)
        return json.loads(Path(job.out).read_text())["messages"][0]["content"]

    prompt.write_text("Solve: {}")
    assert user_text() == "Solve: 1+1?"
    prompt.write_text("Think, then answer: {}")
    assert user_text() == "Think, then answer: 1+1?"
