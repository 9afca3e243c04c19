"""The two-reward recipe the GDPO runs use (examples/objectives): its format reward pays for a
bare integer only, and the recipe reads as GRPO and as GDPO (nothing runs)."""

import importlib.util
from pathlib import Path

import pytest

from rl_algorithms import cli

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "objectives" / "two_rewards.yaml"


def test_the_format_reward_pays_for_a_bare_integer_only():
    spec = importlib.util.spec_from_file_location("rewards", RECIPE.parent / "rewards.py")
    rewards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rewards)
    completions = ["57", " 57\n", "-3", "The answer is 57.", "57.", "5 7", "", "57 apples"]
    assert rewards.just_the_number(completions) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("estimator", ["grpo", "gdpo"])
def test_the_two_reward_recipe_reads_with_either_estimator(estimator, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipe names its reward file from the repository root
    argv = ["grpo", "--config", str(RECIPE), f"grpo.advantage_estimator={estimator}"]
    assert cli.main([*argv, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert f"advantage_estimator: {estimator}" in printed
    assert "function: examples/objectives/rewards.py:just_the_number" in printed
    assert "kind: reward_functions" in printed
