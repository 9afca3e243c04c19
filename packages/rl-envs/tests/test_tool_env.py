"""The tool environment end to end: turns with calls answered by tool messages, what goes wrong
with a call told to the model and counted, the final answer scored by a reward function that
reads the trajectory.

Tools and reward functions run in real verifier processes under their real timeouts; only Ray
is left out (a pool of one process each stands in for the Ray worker pool), except in the last
test, which runs the environment as a Ray actor.
"""

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rl_envs import reward_function_env
from rl_envs.pool import VerifierProcess
from rl_envs.tools import env as tool_env
from rl_envs.tools.env import ToolEnvConfig, ToolEnvironment

TOOLS_FILE = '''
import time

def echo(text: str, times: int = 1) -> str:
    """Repeat a text.

    Args:
        text: The text.
        times: How often.
    """
    return text * times

def hang(seconds: float) -> str:
    """Wait.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke up"

def fail(reason: str) -> str:
    """Raise.

    Args:
        reason: Why.
    """
    raise RuntimeError(reason)

def raw(n: int) -> str:
    """Return bytes.

    Args:
        n: How many.
    """
    return b"x" * n

def flood(megabytes: int) -> str:
    """Return a lot of text.

    Args:
        megabytes: How much.
    """
    return "y" * (megabytes << 20)
'''

REWARDS_FILE = '''
def correct(prompts, completions, trajectory, tool_calls, tool_errors, answer, **kwargs):
    """1 for the right answer after a tool message that holds it; 0.25 off per failed call."""
    out = []
    for c, t, calls, errors, a in zip(completions, trajectory, tool_calls, tool_errors, answer):
        told = any(m["role"] == "tool" and m["content"] == a for m in t)
        called = [c["function"]["name"] for m in t for c in m.get("tool_calls", [])]
        right = c[-1]["content"].strip() == a and told and "calculator" in called
        out.append(float(right) - 0.25 * errors)
    return out
'''

TIMEOUT_S = 1.5


class ProcessPool:
    """The worker pool's contract (``map`` of argument tuples to outcomes, each under the
    timeout; callable from several threads) with one real verifier process and no Ray."""

    def __init__(self, function, timeout_s, preload=(), warmups=(), **_):
        self.function, self.timeout_s = function, timeout_s
        self.process = VerifierProcess((function.partition(":")[0], *preload), warmups)
        self.lock = threading.Lock()  # one process, one pipe: one call at a time

    def map(self, items):
        with self.lock:
            return [self.process.call(self.function, args, self.timeout_s) for args in items]

    def shutdown(self):
        self.process.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool_env")
    (root / "my_tools.py").write_text(TOOLS_FILE)
    (root / "my_rewards.py").write_text(REWARDS_FILE)
    return root


def make_env(files, monkeypatch, **config):
    config.setdefault("max_tool_calls", 16)
    monkeypatch.setattr(tool_env, "WorkerPool", ProcessPool)
    monkeypatch.setattr(reward_function_env, "WorkerPool", ProcessPool)
    user_tools = [{"function": f"{files}/my_tools.py:{n}"} for n in ("echo", "hang", "fail")]
    user_tools += [{"function": f"{files}/my_tools.py:{n}"} for n in ("raw", "flood")]
    cfg = ToolEnvConfig(
        tools=["calculator", *user_tools],
        functions=[{"function": f"{files}/my_rewards.py:correct"}],
        tool_timeout_s=TIMEOUT_S,
        max_output_chars=1000,
        config_key="env.calc.config",
        **config,
    )
    return ToolEnvironment(cfg)


@pytest.fixture
def env(files, monkeypatch):
    environment = make_env(files, monkeypatch)
    yield environment
    environment.shutdown()


def said(text):
    return {"role": "assistant", "content": text}


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


PROMPT = [{"role": "user", "content": "What is 6 * 7?"}]


def test_a_turn_with_calls_gets_one_tool_message_per_call_and_goes_on(env):
    log = [
        *PROMPT,
        said(
            "Let me compute. "
            + call("calculator", expression="6*7")
            + call("echo", text="ab", times=2)
        ),
    ]
    out = env.step([log], [{"answer": "42"}])
    assert out.observations[0] == [
        {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": "42"},
        {"role": "tool", "tool_call_id": "call_1", "name": "echo", "content": "abab"},
    ]
    assert out.terminateds.tolist() == [False] and out.rewards.tolist() == [0.0]
    assert out.metadata[0] == {
        "answer": "42",
        "tool_episode": {"turns": 1, "calls": 2, "errors": 0},
    }
    assert out.reward_components.values.tolist() == [[0.0]]


def test_what_goes_wrong_with_a_call_is_told_to_the_model_and_counted(env):
    turn = (
        '<tool_call>{"name": "echo", "arguments": {"text": "a",}}</tool_call>'  # bad JSON
        + call("weather", city="Paris")  # no such tool
        + call("echo", times=2)  # missing argument
        + call("echo", text="a", colour="red")  # unknown argument
        + call("echo", text=3)  # wrong type
        + call("hang", seconds=60)
        + call("fail", reason="disk on fire")
        + call("raw", n=10)
        + call("flood", megabytes=10)
        + call("calculator", expression="__import__('os')")
    )
    start = time.monotonic()
    out = env.step([[*PROMPT, said(turn)]], [{"answer": "42"}])
    took = time.monotonic() - start
    replies = [m["content"] for m in out.observations[0]]
    assert len(replies) == 10 and not out.terminateds[0]
    assert replies[0].startswith("Error: this tool call could not be read: not valid JSON")
    assert (
        '<tool_call>{"name": "tool_name", "arguments": {"arg": "value"}}</tool_call>' in replies[0]
    )
    assert replies[1].startswith(
        "Error: there is no tool 'weather'. The tools are: calculator, echo"
    )
    assert "'text' is a required property" in replies[2]
    assert "'colour' was unexpected" in replies[3]
    assert "text: 3 is not of type 'string'" in replies[4]
    # The hanging call is cut at its timeout (its process killed), and the others still run.
    assert replies[5] == f"Error: 'hang' did not finish within {TIMEOUT_S:g} s and was stopped."
    assert took < TIMEOUT_S + 20
    assert replies[6] == "Error: 'fail' raised RuntimeError: disk on fire"
    assert (
        replies[7]
        == "Error: 'raw' returned a bytes of length 10, not text (a tool must return a str)."
    )
    assert replies[8].startswith(
        f"Error: the output of 'flood' was {10 << 20} characters, over the limit of 1000"
    )
    assert replies[8].endswith("\n" + "y" * 1000)
    assert replies[9].startswith("Error: 'calculator' raised FunctionNotDefined")
    assert out.metadata[0]["tool_episode"] == {"turns": 1, "calls": 10, "errors": 10}
    metrics = env.global_post_process_and_metrics({"rewards": out.rewards})[1]
    assert metrics["tools/calls"] == 10
    assert metrics["tools/malformed_rate"] == pytest.approx(0.1)
    expected = {"malformed": 1, "unknown_tool": 1, "bad_arguments": 3, "timeout": 1, "raised": 2}
    expected |= {"bad_return": 1, "too_long": 1, "over_budget": 0, "crashed": 0}
    assert {k: metrics[f"tools/errors/{k}"] for k in expected} == expected
    assert metrics["tool/echo/calls"] == 3 and metrics["tool/echo/errors"] == 3
    assert metrics["tool/hang/timeouts"] == 1 and "tool/hang/mean_latency_s" not in metrics
    assert 0 <= metrics["tool/fail/mean_latency_s"] < 1
    # Taken: the next call starts from nothing.
    assert env.global_post_process_and_metrics({"rewards": out.rewards})[1]["tools/calls"] == 0


# Two calls, written as each model family writes them (a Llama 3.1 turn starts with its calls).
WRITTEN = {
    "hermes": lambda calls: (
        "Checking.\n"
        + "".join(
            f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>" for n, a in calls
        )
    ),
    "llama3_json": lambda calls: "; ".join(
        json.dumps({"name": n, "parameters": a}) for n, a in calls
    ),
    "mistral": lambda calls: (
        "Checking. [TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])
    ),
}


@pytest.mark.parametrize("fmt", sorted(WRITTEN))
def test_an_unknown_tool_and_missing_arguments_are_told_in_every_format(files, monkeypatch, fmt):
    env = make_env(files, monkeypatch, parser=fmt)
    try:
        text = WRITTEN[fmt]([("weather", {"city": "Paris"}), ("echo", {"times": 2})])
        out = env.step([[*PROMPT, said(text)]], [{"answer": "42"}])
        unknown, missing = out.observations[0]
        assert (unknown["tool_call_id"], missing["tool_call_id"]) == ("call_0", "call_1")
        assert unknown["content"].startswith("Error: there is no tool 'weather'.")
        assert missing["content"].startswith("Error: wrong arguments for 'echo': 'text' is a")
        assert not out.terminateds[0]
    finally:
        env.shutdown()


def test_the_final_answer_is_scored_with_the_whole_trajectory(env):
    log = [*PROMPT, said(call("calculator", expression="6*7"))]
    meta = {"answer": "42"}
    first = env.step([log], [meta])
    log += [*first.observations[0], said("42")]
    final = env.step([log], first.metadata)
    assert final.terminateds.tolist() == [True]
    assert final.rewards.tolist() == [1.0]
    assert final.reward_components.values.tolist() == [[1.0]]
    assert final.metadata[0]["tool_episode"] == {"turns": 2, "calls": 1, "errors": 0}
    # Without the tool message the same answer earns nothing; a failed call costs 0.25.
    guessed = env.step([[*PROMPT, said("42")]], [meta])
    assert guessed.rewards.tolist() == [0.0]
    log = [*PROMPT, said(call("calculator", expression="6*"))]
    first = env.step([log], [meta])
    assert first.observations[0][0]["content"].startswith("Error: 'calculator' raised SyntaxError")
    log += [*first.observations[0], said(call("calculator", expression="6*7"))]
    second = env.step([log], first.metadata)
    log += [*second.observations[0], said("42")]
    final = env.step([log], second.metadata)
    assert final.rewards.tolist() == [0.75]
    metrics = env.global_post_process_and_metrics({"rewards": final.rewards})[1]
    assert metrics["tools/episodes"] == 3
    assert metrics["tools/turns_per_episode"] == pytest.approx((2 + 1 + 3) / 3)
    assert metrics["tools/calls_per_episode"] == pytest.approx((1 + 0 + 2) / 3)
    assert metrics["correct/mean"] == pytest.approx((1 + 0 + 0.75) / 3)


def test_a_sample_offers_only_its_own_tools(env):
    offered = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    log = [*PROMPT, said(call("echo", text="hi"))]
    out = env.step(
        [log, log],
        [{"answer": "42", "tools": offered}, {"answer": "42", "tools": json.dumps(offered)}],
    )
    for reply in out.observations:
        assert reply[0]["content"] == "Error: there is no tool 'echo'. The tools are: calculator."
    weather = [{"type": "function", "function": {"name": "weather"}}]
    with pytest.raises(
        ValueError,
        match=r"sample 0 of the batch's 'tools' column offers the tool 'weather', which env.calc.config.tools does not configure",
    ):
        env.step([log], [{"answer": "42", "tools": weather}])


def test_the_tool_call_budget_ends_the_episode(files, monkeypatch):
    env = make_env(files, monkeypatch, max_tool_calls=2)
    try:
        four = "".join(call("echo", text=t) for t in "abcd")
        log = [*PROMPT, said(four)]
        first = env.step([log], [{"answer": "42"}])
        replies = first.observations[0]
        assert [m["content"] for m in replies[:2]] == ["a", "b"] and not first.terminateds[0]
        # The two calls over the budget: each answered (a call is paired with its reply), the
        # first saying why, the second only that it was not run.
        assert [m["tool_call_id"] for m in replies] == ["call_0", "call_1", "call_2", "call_3"]
        assert replies[2]["content"] == (
            "Error: the episode's 2 tool calls are spent, so this call was not run; answer "
            "without calling tools."
        )
        assert replies[3]["content"] == "Error: not run (the tool calls are spent)."
        assert (
            env.global_post_process_and_metrics({"rewards": torch.zeros(0)})[1][
                "tools/errors/over_budget"
            ]
            == 2.0
        )
        # Calling again with the budget spent: that turn is the final answer, and is scored.
        log += [*first.observations[0], said(call("calculator", expression="6*7"))]
        second = env.step([log], first.metadata)
        assert second.terminateds.tolist() == [True]
        assert second.rewards.tolist() == [-0.5]  # wrong answer, two calls over the budget
    finally:
        env.shutdown()


def test_the_columns_it_gives_reward_functions_are_not_required_of_the_data(files, monkeypatch):
    env_cls_cfg = ToolEnvConfig(
        tools=["calculator"], functions=[{"function": f"{files}/my_rewards.py:correct"}]
    )
    assert ToolEnvironment.required_metadata_for(env_cls_cfg) == ("answer",)
    env = make_env(files, monkeypatch)
    try:
        with pytest.raises(ValueError, match="has no 'answer' in its metadata"):
            env.step([[*PROMPT, said("42")]], [{}])
    finally:
        env.shutdown()


def test_its_counts_add_up_under_concurrent_steps(env):
    # Eight threads play episodes while a ninth takes the metrics again and again (as async
    # GRPO takes an environment's counts while its steps go on), threads switching as often as
    # they can: a count made between a take's read and its reset would be lost without the lock.
    threads, episodes = 8, 10
    keys = ("tools/calls", "tool/calculator/calls", "tools/errors/unknown_tool")
    keys += ("tools/episodes", "correct/samples")
    taken = dict.fromkeys(keys, 0.0)
    playing = threading.Event()

    def take():
        metrics = env.global_post_process_and_metrics({"rewards": []})[1]
        for key in keys:
            taken[key] += metrics.get(key, 0.0)

    def play(_):
        for _ in range(episodes):
            turn = call("calculator", expression="6*7") + call("weather", city="Paris")
            log = [*PROMPT, said(turn)]
            first = env.step([log], [{"answer": "42"}])
            log += [*first.observations[0], said("42")]
            final = env.step([log], first.metadata)
            assert final.terminateds.tolist() == [True]

    def keep_taking():
        while playing.is_set():
            take()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with ThreadPoolExecutor(threads + 1) as pool:
            playing.set()
            taker = pool.submit(keep_taking)
            list(pool.map(play, range(threads)))
            playing.clear()
            taker.result()
    finally:
        sys.setswitchinterval(interval)
    take()
    n = threads * episodes
    assert taken == {
        "tools/calls": 2 * n,  # a calculator call and a call of a tool that is not there
        "tool/calculator/calls": n,
        "tools/errors/unknown_tool": n,
        "tools/episodes": n,
        "correct/samples": n,  # the reward function's own counts (a second pool and lock)
    }


@pytest.mark.ray
def test_it_runs_as_a_ray_actor(ray_session, files):
    import ray

    cfg = ToolEnvConfig(
        tools=["calculator"],
        functions=[{"function": f"{files}/my_rewards.py:correct"}],
        num_workers=1,
    )
    actor = ToolEnvironment.as_actor(cfg)
    try:
        log = [*PROMPT, said(call("calculator", expression="6*7"))]
        first = ray.get(actor.step.remote([log], [{"answer": "42"}]))
        assert first.observations[0][0]["content"] == "42"
        log += [*first.observations[0], said("42")]
        final = ray.get(actor.step.remote([log], first.metadata))
        assert final.rewards.tolist() == [1.0]
    finally:
        ray.get(actor.shutdown.remote())
        ray.kill(actor)


def test_a_search_call_never_waits_for_the_corpus_to_be_indexed(files, tmp_path, monkeypatch):
    """Indexing this corpus takes over a second, several times a call's timeout: the tool's
    process indexes it as it starts, so calls answer in time: the first one, and the first
    after a call that hung had the process killed (its fresh process indexes it again)."""
    words = [f"word{i}" for i in range(3000)]
    docs = [
        {"title": f"doc {i}", "text": " ".join(words[(i * 7 + k * 13) % 3000] for k in range(30))}
        for i in range(16000)
    ]
    docs[123]["text"] += " zebra"
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    monkeypatch.setattr(tool_env, "WorkerPool", ProcessPool)
    monkeypatch.setattr(reward_function_env, "WorkerPool", ProcessPool)
    cfg = ToolEnvConfig(
        tools=[
            {"function": "search", "kwargs": {"corpus": str(corpus), "top_k": 1}},
            {"function": f"{files}/my_tools.py:hang"},
        ],
        functions=[{"function": f"{files}/my_rewards.py:correct"}],
        tool_timeout_s=0.5,
    )
    env = ToolEnvironment(cfg)
    try:
        for turn in (
            call("search", query="zebra"),
            call("hang", seconds=5) + call("search", query="zebra"),
        ):
            ret = env.step([[*PROMPT, said(turn)]], [{"answer": "42"}])
            found = ret.observations[0][-1]["content"]
            assert found.startswith("[1] doc 123\n"), found
    finally:
        env.shutdown()
