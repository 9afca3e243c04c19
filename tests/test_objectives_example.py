"""The two-reward recipes for GDPO against the summed rewards (examples/objectives): what each
format reward pays for, and that the recipes read as GDPO (nothing runs)."""

import importlib.util
from pathlib import Path

import pytest

from rl_algorithms import cli

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "objectives" / "two_rewards.yaml"


def _rewards():
    spec = importlib.util.spec_from_file_location("rewards", RECIPE.parent / "rewards.py")
    rewards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rewards)
    return rewards


def test_the_format_reward_pays_for_a_bare_integer_only():
    rewards = _rewards()
    completions = ["57", " 57\n", "-3", "The answer is 57.", "57.", "5 7", "", "57 apples"]
    expected = [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert rewards.just_the_number(completions) == expected
    # The main job's prompts are conversations: each completion is the assistant's message.
    messages = [[{"role": "assistant", "content": text}] for text in completions]
    assert rewards.just_the_number(completions=messages) == expected


def test_the_no_words_reward_pays_for_a_written_sum_and_refuses_prose():
    rewards = _rewards()
    completions = ["162", " 65 + 97 = 162\n", "65+97=162", "-3", "65 + 97 = 162.", "The sum is 162"]
    completions += ["65 + 97 =", "", "162\n162", "162 apples", "1 2 3", "= 162", "+162"]
    completions += ["1-2-3", "\u0661\u0666\u0662"]  # the last: Arabic-Indic digits
    expected = [1.0, 1.0, 1.0, 1.0] + [0.0] * 11
    assert rewards.no_words(completions) == expected
    messages = [[{"role": "assistant", "content": text}] for text in completions]
    assert rewards.no_words(completions=messages) == expected


@pytest.mark.parametrize(
    "recipe, function",
    [("two_rewards.yaml", "just_the_number"), ("two_rewards_no_words.yaml", "no_words")],
)
def test_the_two_reward_recipes_read_as_gdpo(recipe, function, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipe names its reward file from the repository root
    path = str(RECIPE.parent / recipe)
    argv = ["grpo", "--config", path, "grpo.advantage_estimator=gdpo", "--print-config"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "advantage_estimator: gdpo" in printed
    assert f"function: examples/objectives/rewards.py:{function}" in printed
    assert "kind: reward_functions" in printed
