"""The two-reward recipe for GDPO against the summed rewards (examples/objectives): its format
reward pays for a bare integer only, and the recipe reads as GDPO (nothing runs)."""

import importlib.util
from pathlib import Path

from rl_algorithms import cli

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "objectives" / "two_rewards.yaml"


def test_the_format_reward_pays_for_a_bare_integer_only():
    spec = importlib.util.spec_from_file_location("rewards", RECIPE.parent / "rewards.py")
    rewards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rewards)
    completions = ["57", " 57\n", "-3", "The answer is 57.", "57.", "5 7", "", "57 apples"]
    expected = [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert rewards.just_the_number(completions) == expected
    # The main job's prompts are conversations: each completion is the assistant's message.
    messages = [[{"role": "assistant", "content": text}] for text in completions]
    assert rewards.just_the_number(completions=messages) == expected


def test_the_two_reward_recipe_reads_as_gdpo(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipe names its reward file from the repository root
    argv = ["grpo", "--config", str(RECIPE), "grpo.advantage_estimator=gdpo", "--print-config"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "advantage_estimator: gdpo" in printed
    assert "function: examples/objectives/rewards.py:just_the_number" in printed
    assert "kind: reward_functions" in printed
