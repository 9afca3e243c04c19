"""Reward functions called as TRL calls them, and the stops and warnings that keep a broken one
from training on a constant: the environment's own logic, in process (no Ray, no verifier
processes: an in-process pool stands in for the verifier pool)."""

import json
import logging
import re

import pytest
import torch

from rl_data.datasets import ChatFileConfig, load_dataset
from rl_data.types import STRING_PROMPT_KEY
from rl_envs import reward_function_env
from rl_envs._child import resolve
from rl_envs.pool import Outcome
from rl_envs.reward_function_env import RewardFunctionsEnvConfig, RewardFunctionsEnvironment
from rl_envs.reward_functions import (
    PICKLED_PREFIX,
    call_reward_function,
    load_reward_function,
    reference_for,
)

# TRL's documented example (GRPOTrainer docs), as a user copies it.
TRL_FILE = """
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]

def echo(prompts, completions, **kwargs):
    return [{"prompts": prompts, "completions": completions, "kwargs": kwargs}]

def constant(prompts, completions, **kwargs):
    return [0.5 for _ in completions]

def nothing(prompts, completions, **kwargs):
    return [float("nan") for _ in completions]

def raises(prompts, completions, **kwargs):
    raise KeyError("no such field 'answer'")

def old_style(prompts, completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]

def plain(prompts, completions):
    return [1.0 for _ in completions]

import asyncio

calls = []  # the batch sizes the functions below were called with

def match_batch(prompts, completions, ground_truth):
    calls.append(len(completions))
    return [float(a == b) for a, b in zip(completions, ground_truth)]

async def async_len(prompts, completions, **kwargs):
    calls.append(len(completions))
    lengths = [asyncio.sleep(0.01, result=float(len(c))) for c in completions]
    return list(await asyncio.gather(*lengths))

def one_for_all(prompts, completions, **kwargs):
    return [1.0]
"""


class InProcessPool:
    """The verifier pool's contract (``map`` of argument tuples to outcomes), in process."""

    def __init__(self, function, **_):
        self.function = resolve(function)

    def map(self, items):
        outcomes = []
        for args in items:
            try:
                outcomes.append(Outcome("ok", self.function(*args)))
            except Exception as e:
                outcomes.append(Outcome("error", error=f"{type(e).__name__}: {e}"))
        return outcomes

    def shutdown(self):
        pass


@pytest.fixture
def trl_file(tmp_path):
    path = tmp_path / "trl_rewards.py"
    path.write_text(TRL_FILE)
    return path


@pytest.fixture
def make_env(monkeypatch, trl_file):
    monkeypatch.setattr(reward_function_env, "WorkerPool", InProcessPool)

    def make(*names, **config):
        functions = [
            {"function": f"{trl_file}:{n}"}
            if isinstance(n, str)
            else n
            if isinstance(n, dict)
            else {"function": n}
            for n in names
        ]
        cfg = RewardFunctionsEnvConfig(functions=functions, config_key="env.qa.config", **config)
        return RewardFunctionsEnvironment(cfg)

    return make


def rows_from_file(tmp_path, records):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return list(load_dataset(ChatFileConfig(path=str(path))))


def answered(row, text):
    """A row's prompt and a generated answer, as a rollout hands them to the environment."""
    ids = torch.arange(len(text))
    message = {"role": "assistant", "content": text, "token_ids": ids}
    return [*row["messages"], message], row["extra_env_info"]


def step(env, samples):
    logs, metadata = zip(*samples, strict=True)
    return env.step(list(logs), list(metadata))


def metrics(env, rewards):
    return env.global_post_process_and_metrics({"rewards": rewards})[1]


# --- the calling convention -----------------------------------------------------------------


def test_trls_reward_len_example_scores_string_prompts_by_their_completions_length(
    tmp_path, make_env
):
    # The case: a prompt-only dataset of string prompts. On main every completion was
    # a one-message list (len 1), so every sample got -19.
    (row,) = rows_from_file(tmp_path, [{"prompt": "Write a short poem."}])
    env = make_env("reward_len")
    texts = ["x" * 20, "x" * 5, "x" * 30]
    out = step(env, [answered(row, t) for t in texts])
    assert out.rewards.tolist() == [0.0, -15.0, -10.0]


def test_string_prompts_give_strings_and_conversations_give_message_lists(tmp_path, trl_file):
    string_row, chat_row = rows_from_file(
        tmp_path,
        [
            {"prompt": "2+2?", "ground_truth": "4"},
            {"prompt": [{"role": "user", "content": "2+2?"}], "ground_truth": "4"},
        ],
    )
    assert string_row["extra_env_info"] == {"ground_truth": "4", STRING_PROMPT_KEY: "2+2?"}
    assert chat_row["extra_env_info"] == {"ground_truth": "4"}
    ref = f"{trl_file}:echo"
    (seen,) = call_reward_function(ref, "2+2?", "4", {"ground_truth": "4"}, [7])
    assert seen == {
        "prompts": ["2+2?"],
        "completions": ["4"],
        "kwargs": {"ground_truth": ["4"], "completion_ids": [[7]]},
    }
    (seen,) = call_reward_function(ref, chat_row["messages"], "4", {"ground_truth": "4"})
    assert seen["prompts"] == [[{"role": "user", "content": "2+2?"}]]
    assert seen["completions"] == [[{"role": "assistant", "content": "4"}]]
    # A function without **kwargs or completion_ids is not given completion_ids.
    assert call_reward_function(f"{trl_file}:plain", "2+2?", "4", {}, [7]) == [1.0]


def test_the_environment_passes_the_datasets_own_string_and_no_private_column(
    tmp_path, make_env, monkeypatch
):
    seen = []
    monkeypatch.setattr(
        reward_function_env, "check_value", lambda result: seen.append(result[0]) or 1.0
    )
    (row,) = rows_from_file(tmp_path, [{"prompt": "Hi", "label": "a"}])
    row["messages"].insert(0, {"role": "system", "content": "a task's system prompt"})
    step(make_env("echo"), [answered(row, "abc")])
    assert seen[0]["prompts"] == ["Hi"] and seen[0]["completions"] == ["abc"]
    assert seen[0]["kwargs"] == {"label": ["a"], "completion_ids": [[0, 1, 2]]}


def test_a_callable_from_python_is_accepted_as_well_as_a_reference(tmp_path, make_env):
    (row,) = rows_from_file(tmp_path, [{"prompt": "Hi", "ground_truth": "2"}])

    def local_reward(completions, **kwargs):  # no import path: pickled by value
        return [float(len(c)) for c in completions]

    env = make_env(local_reward, load_reward_function("math"))
    assert env.functions[0].function.startswith(PICKLED_PREFIX)
    assert env.functions[0].name == "local_reward"
    assert env.functions[1].function == "rl_envs.reward_functions:math_reward"
    assert reference_for(load_reward_function("math")) == "rl_envs.reward_functions:math_reward"
    out = step(env, [answered(row, "ab"), answered(row, r"\boxed{2}")])
    assert out.rewards.tolist() == [2.0, 9.0 + 1.0]


# --- stops and warnings ---------------------------------------------------------------------


def test_a_function_raising_on_every_sample_stops_on_the_first_batch_naming_it(tmp_path, make_env):
    (row,) = rows_from_file(tmp_path, [{"prompt": "Hi"}])
    env = make_env("constant", "raises")
    with pytest.raises(RuntimeError) as stopped:
        step(env, [answered(row, "a"), answered(row, "b")])
    message = str(stopped.value)
    assert "env.qa.config.functions[1] (raises: " in message and "trl_rewards.py:raises)" in message
    assert "raised on every sample of the batch (2)" in message
    assert "KeyError" in message and "no such field 'answer'" in message


def test_a_function_written_for_message_lists_fails_on_strings_with_a_hint(tmp_path, make_env):
    (row,) = rows_from_file(tmp_path, [{"prompt": "Hi"}])
    with pytest.raises(RuntimeError, match="prompts are strings, so prompts and completions"):
        step(make_env("old_style"), [answered(row, "a"), answered(row, "b")])


@pytest.mark.parametrize(
    ("function", "what"),
    [("constant", r"the same value \(0.5\) to every sample"), ("nothing", "no value")],
)
def test_a_constant_or_valueless_function_is_warned_about_once_then_a_metric(
    tmp_path, make_env, caplog, function, what
):
    (row,) = rows_from_file(tmp_path, [{"prompt": "Hi"}])
    env = make_env(function, "reward_len", warn_constant_steps=3)
    caplog.set_level(logging.WARNING, logger=reward_function_env.__name__)
    seen = []
    for _ in range(5):
        out = step(env, [answered(row, "a"), answered(row, "abc")])
        taken = metrics(env, out.rewards)
        seen.append((taken[f"{function}/constant_steps"], taken["reward_len/constant_steps"]))
        if taken[f"{function}/constant_steps"] < 3:
            assert not caplog.records
    assert seen == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0)]
    (warning,) = [r for r in caplog.records if "constant" in r.getMessage()]
    assert f"functions[0] ({function}: " in warning.getMessage()
    assert re.search(what, warning.getMessage())
    # A call without samples (the counts only) changes nothing; a varying step resets it.
    assert f"{function}/constant_steps" not in metrics(env, torch.zeros(0))


def test_one_varying_step_ends_the_constant_streak(tmp_path, make_env):
    (row,) = rows_from_file(tmp_path, [{"prompt": "Hi"}])
    env = make_env("reward_len")
    out = step(env, [answered(row, "a"), answered(row, "a")])
    assert metrics(env, out.rewards)["reward_len/constant_steps"] == 1
    out = step(env, [answered(row, "a"), answered(row, "ab")])
    assert metrics(env, out.rewards)["reward_len/constant_steps"] == 0


# --- batched and async functions ----------------------------------------------------------------


def test_a_batched_function_is_called_once_with_every_completion_in_order(tmp_path, make_env):
    ref = f"{tmp_path / 'trl_rewards.py'}:match_batch"
    calls = load_reward_function(ref).__globals__["calls"]
    rows = rows_from_file(tmp_path, [{"prompt": "q", "ground_truth": g} for g in "abca"])
    env = make_env({"function": ref, "batched": True, "name": "together"}, "match_batch")
    out = step(env, [answered(row, t) for row, t in zip(rows, "abxa", strict=True)])
    assert out.rewards.tolist() == [2.0, 2.0, 0.0, 2.0]  # the batched and the per-sample one
    assert calls == [4, 1, 1, 1, 1]  # one call of 4, then one per completion


def test_an_async_function_is_awaited_per_sample_or_batched(tmp_path, make_env):
    (row,) = rows_from_file(tmp_path, [{"prompt": "Write."}])
    ref = f"{tmp_path / 'trl_rewards.py'}:async_len"
    calls = load_reward_function(ref).__globals__["calls"]
    batched = make_env({"function": ref, "batched": True, "name": "together"})
    apart = make_env({"function": ref})
    texts = ["x" * 3, "x" * 7, ""]
    for env, sizes in ((batched, [3]), (apart, [1, 1, 1])):
        calls.clear()
        assert step(env, [answered(row, t) for t in texts]).rewards.tolist() == [3.0, 7.0, 0.0]
        assert calls == sizes


def test_a_batched_function_returning_too_few_values_stops_naming_it(tmp_path, make_env):
    (row,) = rows_from_file(tmp_path, [{"prompt": "q"}])
    env = make_env({"function": f"{tmp_path / 'trl_rewards.py'}:one_for_all", "batched": True})
    with pytest.raises(ValueError, match=r"functions\[0\] \(one_for_all.*returned 1 values for "):
        step(env, [answered(row, t) for t in ("a", "b", "c")])
