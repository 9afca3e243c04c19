"""The calculator agent of examples/agents: its data load as the recipes read them, its SFT
traces are what the tool environment would run and the template renders, its reward scores
final answers, and its recipes (with the demo's own overrides) build. Nothing trains here;
the demo's learning is measured in docs/guides/agents.md."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from rl_algorithms import cli
from rl_algorithms.checks import data_problems, model_problems

ROOT = Path(__file__).resolve().parents[1]
AGENTS = ROOT / "examples" / "agents"
SMALL = {"sft": 8, "train": 16, "validation": 8}


def load(name):
    spec = importlib.util.spec_from_file_location(f"agents_{name}", AGENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(AGENTS))  # calculator.py imports multiplication.py beside it
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(AGENTS))
    return module


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A run directory as the demo's: examples/ linked in, the data written where the recipes
    read it."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    paths = load("multiplication").write_data("results/agents/data", SMALL)
    return tmp_path, paths


def numbers(prompt):
    a, b = map(
        int,
        re.fullmatch(r"What is (\d+) \* (\d+)\? Answer with just the number\.", prompt).groups(),
    )
    return a, b


def test_the_questions_are_new_in_each_split_and_their_answers_right(workdir):
    from rl_data.datasets import load_dataset

    _, paths = workdir
    seen = {}
    for name in ("train", "validation", "train_no_tools", "validation_no_tools"):
        rows = load_dataset({"source": "chat_file", "path": str(paths[name])})
        assert len(rows) == SMALL[name.removesuffix("_no_tools")]
        pairs = set()
        for row in rows:
            a, b = numbers(row["messages"][0]["content"])
            assert 100 <= a <= 999 and 10 <= b <= 999
            assert row["extra_env_info"]["answer"] == str(a * b)
            assert ("tools" in row["extra_env_info"]) == ("no_tools" not in name)
            pairs.add((a, b))
        seen[name] = pairs
    assert (
        seen["train"] == seen["train_no_tools"]
        and seen["validation"] == seen["validation_no_tools"]
    )
    sft = [json.loads(line) for line in paths["sft"].read_text().splitlines()]
    sft_pairs = {numbers(r["messages"][0]["content"]) for r in sft}
    assert len(sft_pairs) == SMALL["sft"]
    assert not (sft_pairs & seen["train"]) and not (sft_pairs & seen["validation"])
    assert not (seen["train"] & seen["validation"])


def test_a_trace_trains_on_the_call_the_tool_environment_runs_and_the_answer(workdir):
    from rl_data import (
        ChatTemplate,
        ChatTemplateConfig,
        ProcessedDataset,
        build_tokenizer,
        sft_collate,
    )
    from rl_data.datasets import load_dataset
    from rl_envs.tools.builtin import calculator
    from rl_envs.tools.parsers import parse_tool_calls
    from rl_envs.tools.registry import Tool, ToolSpec

    _, paths = workdir
    dataset = load_dataset({"source": "chat_file", "path": str(paths["sft"])})
    tool = Tool(ToolSpec(function="calculator"))
    assert dataset[0]["extra_env_info"]["tools"] == [tool.schema]
    a, b = numbers(dataset[0]["messages"][0]["content"])
    tokenizer = build_tokenizer([paths["sft"].read_text()] * 4)
    template = ChatTemplate.from_config(ChatTemplateConfig(kind="chatml_tools"), tokenizer)
    batch = sft_collate(
        [ProcessedDataset(dataset, tokenizer, template, "sft")[0]],
        pad_token_id=tokenizer.pad_token_id,
    )
    ids = batch.input_ids[0]
    trained = tokenizer.decode(ids[batch.loss_mask[0].bool()])
    call, answer = trained.split("<|im_end|>\n")[:2]
    assert answer == str(a * b)
    # The call as the model learns to write it is one the environment reads, accepts and runs.
    turn = parse_tool_calls(call, "hermes")
    assert [(c.name, c.error) for c in turn.calls] == [("calculator", None)]
    assert tool.argument_errors(turn.calls[0].arguments) == []
    assert calculator(**turn.calls[0].arguments) == str(a * b)
    # The tool's reply and the prompt (with the tool's schema) are read, never trained on.
    text = tokenizer.decode(ids)
    assert "<tools>" in text and f"<tool_response>\n{a * b}\n</tool_response>" in text
    assert "tool_response" not in trained and "<tools>" not in trained


def test_the_reward_reads_the_final_number_and_charges_failed_calls_of_wrong_answers():
    correct = load("rewards").correct
    message = [{"role": "assistant", "content": "It is 56,088."}]
    assert correct(completions=[message], answer=["56088"], tool_errors=[2]) == [1.0]
    assert correct(
        completions=["56088", "56089", "no idea", "5 then 56088"], answer=["56088"] * 4
    ) == [
        1.0,
        0.0,
        0.0,
        1.0,
    ]
    assert correct(completions=["1", "2"], answer=["3", "3"], tool_errors=[0, 3]) == pytest.approx(
        [0.0, -0.3]
    )


@pytest.mark.parametrize(
    ("recipe", "algorithm"),
    [
        ("sft.yaml", "sft"),
        ("eval_calculator.yaml", "eval"),
        ("grpo_calculator.yaml", "grpo"),
        ("grpo_no_tools.yaml", "grpo"),
    ],
)
def test_each_phase_of_the_demo_builds_and_its_data_holds_what_its_environment_reads(
    workdir, recipe, algorithm
):
    tmp_path, _ = workdir
    argv = load("calculator").phase_args(recipe, tmp_path / "out", seed=3)
    config = cli.build_config(cli.load_algorithm(algorithm), argv)
    assert data_problems(config) == []
    if recipe != "grpo_calculator.yaml":  # that one starts from the warm-up's checkpoint
        assert model_problems(config) == []
    assert str(tmp_path / "out" / "logs") == config.logger.log_dir


def test_the_tool_run_and_the_baseline_share_model_reward_and_budget(workdir):
    grpo = cli.load_algorithm("grpo")
    tools = cli.build_config(grpo, ["--config", str(AGENTS / "grpo_calculator.yaml")])
    plain = cli.build_config(grpo, ["--config", str(AGENTS / "grpo_no_tools.yaml")])
    assert tools.env["calc"].kind == "tools" and plain.env["calc"].kind == "reward_functions"
    assert tools.tokenizer.chat_template.kind == "chatml_tools"
    assert plain.tokenizer.chat_template.kind == "tokenizer"
    assert tools.grpo.max_rollout_turns >= 2 and plain.grpo.max_rollout_turns == 1
    same = (
        "num_prompts_per_step",
        "num_generations_per_prompt",
        "max_num_steps",
        "max_val_samples",
    )
    assert {k: getattr(tools.grpo, k) for k in same} == {k: getattr(plain.grpo, k) for k in same}
    assert tools.generation.sampling == plain.generation.sampling
    assert tools.policy.optimizer == plain.policy.optimizer
    assert tools.env["calc"].config["functions"] == plain.env["calc"].config["functions"]
    assert plain.policy.model.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
