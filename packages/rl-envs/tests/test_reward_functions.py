"""Reward functions (TRL's ``reward_funcs`` form): loading them from a module or a user's file,
checking what they return, weighting several into one reward, and running them in the verifier
pool under the per-sample timeout."""

import math

import pytest
import ray
import torch

from rl_envs.reward_function_env import (
    RewardFunctionsEnvConfig,
    RewardFunctionsEnvironment,
    RewardFunctionSpec,
)
from rl_envs.reward_functions import (
    ValueStats,
    call_reward_function,
    check_value,
    combine,
    load_reward_function,
    required_columns,
    resolve_reference,
)

USER_FILE = '''
import time

def brevity(prompts, completions, **columns):
    return [1.0 / len(c[0]["content"]) if c[0]["content"] else None for c in completions]

def picky(prompts, completions, label, **columns):
    """None on 'skip', raises on 'boom', hangs on 'hang', two values on 'twice', else the
    label's length."""
    text = completions[0][0]["content"]
    if text == "twice":
        return [1.0, 2.0]
    if text == "boom":
        raise RuntimeError("picky cannot score boom")
    if text == "hang":
        time.sleep(60)
    return [None if text == "skip" else float(len(label[0]))]

def echo(prompts, completions, **columns):
    return [(prompts, completions, columns)]

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FILE)
    return path


# --- loading --------------------------------------------------------------------------------


def test_a_function_loads_from_a_file_a_module_or_a_builtin_name(user_file, monkeypatch):
    brevity = load_reward_function(f"{user_file}:brevity")
    assert brevity([], [[{"content": "abcd"}]]) == [0.25]
    assert load_reward_function("math").__name__ == "math_reward"
    assert load_reward_function("rl_envs.reward_functions:math_reward").__name__ == "math_reward"
    # A relative path is taken from the working directory and made absolute, so that a Ray
    # worker elsewhere finds the same file.
    monkeypatch.chdir(user_file.parent)
    assert resolve_reference("my_rewards.py:brevity") == f"{user_file}:brevity"
    assert load_reward_function("my_rewards.py:brevity")([], [[{"content": "ab"}]]) == [0.5]


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("{dir}/missing.py:brevity", r"no such file '.*missing\.py'"),
        ("{dir}/my_rewards.py:nope", r"'.*my_rewards\.py' has no 'nope'"),
        ("{dir}/my_rewards.py:NOT_A_FUNCTION", "'NOT_A_FUNCTION' is a int, not a function"),
        ("{dir}/broken.py:f", r"importing '.*broken\.py' failed: SyntaxError"),
        ("no_such_package.rewards:f", "cannot import module 'no_such_package.rewards'"),
        ("brevity", "neither a built-in reward function"),
    ],
)
def test_a_function_that_cannot_be_loaded_says_why(user_file, ref, message):
    (user_file.parent / "broken.py").write_text("def f(:\n")
    with pytest.raises(ValueError, match=message):
        load_reward_function(ref.format(dir=user_file.parent))


def test_the_columns_a_function_needs_are_its_arguments_without_a_default(user_file):
    assert required_columns(load_reward_function("math")) == ("ground_truth",)
    assert required_columns(load_reward_function(f"{user_file}:picky")) == ("label",)
    assert required_columns(load_reward_function(f"{user_file}:brevity")) == ()


def test_a_call_is_trl_shaped_one_completion_at_a_time(user_file):
    prompt = [{"role": "user", "content": "2+2?"}]
    ((prompts, completions, columns),) = call_reward_function(
        f"{user_file}:echo", prompt, "4", {"ground_truth": "4", "level": 3}
    )
    assert prompts == [prompt]
    assert completions == [[{"role": "assistant", "content": "4"}]]
    assert columns == {"ground_truth": ["4"], "level": [3]}


# --- values, weights, None ------------------------------------------------------------------


def test_a_value_is_one_number_or_none_per_completion():
    assert check_value([0.5]) == 0.5
    assert check_value((2,)) == 2.0
    assert check_value([None]) is None
    assert check_value([float("nan")]) is None  # TRL's own "no opinion"
    for bad, message in [
        ([1.0, 2.0], "returned 2 values for 1 completion"),
        ([], "returned 0 values"),
        (0.5, "returned a float"),
        ("0.5", "returned a str"),
        (["0.5"], "'0.5' \\(str\\)"),
        ([True], "True \\(bool\\)"),
        ([float("inf")], "must be finite"),
    ]:
        with pytest.raises(TypeError, match=message):
            check_value(bad)


def test_the_reward_is_the_weighted_sum_leaving_none_out():
    values = [[1.0, 0.0, None, None], [0.5, None, 2.0, None]]
    rewards = combine(values, [1.0, -0.5])
    # By hand: 1*1 - .5*.5, 1*0 (the second function passed), -.5*2, nothing scored -> 0.
    assert rewards == [0.75, 0.0, -1.0, 0.0]


def test_each_function_reports_mean_std_and_none_fraction_since_last_taken():
    stats = ValueStats()
    stats.add([1.0, None])
    stats.add([3.0, None])
    assert stats.take() == {"none_fraction": 0.5, "mean": 2.0, "std": 1.0}
    stats.add([None, None])
    assert stats.take() == {"none_fraction": 1.0}
    assert stats.take() == {}
    values = [0.1, -2.5, 7.25, 3.0]  # std against the textbook two-pass formula
    stats.add(values)
    mean = sum(values) / 4
    expected = math.sqrt(sum((v - mean) ** 2 for v in values) / 4)
    assert stats.take()["std"] == pytest.approx(expected, rel=1e-12)


def test_config_names_functions_and_refuses_two_of_one_name(user_file):
    cfg = RewardFunctionsEnvConfig(
        functions=[{"function": "math"}, {"function": f"{user_file}:brevity", "weight": 0.1}]
    )
    assert [f.name for f in cfg.functions] == ["math", "brevity"]
    assert cfg.functions[0].function == "rl_envs.reward_functions:math_reward"
    with pytest.raises(ValueError, match="two functions are named 'b'"):
        RewardFunctionsEnvConfig(
            functions=[{"function": "math", "name": "b"}, {"function": "math", "name": "b"}]
        )
    with pytest.raises(ValueError, match="name 'a b'"):
        RewardFunctionSpec(function="math", name="a b")
    with pytest.raises(ValueError, match="at least 1"):
        RewardFunctionsEnvConfig(functions=[])


# --- in the verifier pool -------------------------------------------------------------------


def conversation(response: str) -> list[dict]:
    return [{"role": "user", "content": "say it"}, {"role": "assistant", "content": response}]


@pytest.fixture(scope="module")
def env(ray_session, tmp_path_factory):
    """The built-in math reward and a user's function, as a run has them: a Ray actor."""
    user_file = tmp_path_factory.mktemp("user") / "my_rewards.py"
    user_file.write_text(USER_FILE)
    cfg = RewardFunctionsEnvConfig(
        functions=[
            {"function": "math", "name": "correct"},
            {"function": f"{user_file}:picky", "weight": -0.5},
        ],
        num_workers=2,
        timeout_s=3.0,
        config_key="env.qa.config",
    )
    actor = RewardFunctionsEnvironment.as_actor(cfg)
    yield actor
    call(actor, "shutdown")
    ray.kill(actor)


def call(actor, method, *args):
    return ray.get(getattr(actor, method).remote(*args))


def step(env, responses, meta=None):
    meta = meta or [{"ground_truth": "4", "label": "abc"} for _ in responses]
    return call(env, "step", [conversation(r) for r in responses], meta)


@pytest.mark.ray
def test_functions_are_weighted_timed_out_and_logged_each_under_its_name(env):
    call(env, "global_post_process_and_metrics", {"rewards": torch.zeros(1)})  # a clean slate
    out = step(env, [r"\boxed{4}", "skip", "boom", "hang", r"\boxed{5}"])
    # correct: 1 0 0 0 0; picky: 3, None, error, timeout, 3 (weight -0.5).
    assert out.rewards.tolist() == [1.0 - 1.5, 0.0, 0.0, 0.0, -1.5]
    assert out.answers[0] == "correct=1 picky=3"
    assert out.answers[3] == "correct=0 picky=None"
    _, metrics = call(env, "global_post_process_and_metrics", {"rewards": out.rewards})
    assert metrics["correct/mean"] == pytest.approx(0.2)
    assert metrics["correct/std"] == pytest.approx(0.4)
    assert metrics["correct/none_fraction"] == 0.0
    assert metrics["picky/mean"] == 3.0 and metrics["picky/std"] == 0.0
    assert metrics["picky/none_fraction"] == pytest.approx(0.6)
    assert metrics["picky/timeouts"] == 1 and metrics["picky/verifier_errors"] == 1
    assert metrics["reward_mean"] == pytest.approx(sum(out.rewards.tolist()) / 5)


@pytest.mark.ray
def test_each_functions_value_comes_apart_in_the_functions_order_and_weights(env):
    """For GDPO: the components are the functions' values in ``functions``' order (a None as
    0), under their names and weights, and their weighted sum is the reward, unchanged."""
    out = step(env, [r"\boxed{4}", "skip", r"\boxed{5}"])
    assert out.rewards.tolist() == [1.0 - 1.5, 0.0, -1.5]
    components = out.reward_components
    assert components.names == ("correct", "picky")
    assert components.weights == (1.0, -0.5)
    assert components.values.tolist() == [[1.0, 3.0], [0.0, 0.0], [0.0, 3.0]]
    torch.testing.assert_close(components.combined().float(), out.rewards)
    assert [s.reward_components.values.tolist() for s in out.steps()][2] == [0.0, 3.0]
    assert RewardFunctionsEnvironment.returns_reward_components


@pytest.mark.ray
def test_a_row_without_a_column_a_function_reads_is_refused_naming_it(env):
    with pytest.raises(ray.exceptions.RayTaskError, match=r"sample 1 .* no 'label'"):
        step(env, ["x", "y"], [{"ground_truth": "4", "label": "a"}, {"ground_truth": "4"}])


@pytest.mark.ray
def test_a_function_returning_nonsense_stops_the_run_naming_it(env):
    with pytest.raises(ray.exceptions.RayTaskError) as refused:
        step(env, ["fine", "twice"])
    message = str(refused.value)
    assert "env.qa.config.functions[1] (picky: " in message and "my_rewards.py:picky)" in message
    assert "returned 2 values for 1 completion" in message and "at sample 1" in message
    assert "'twice'" in message  # the completion it was given


@pytest.mark.ray
def test_a_function_raising_on_every_sample_is_an_error_not_a_zero_reward(env):
    # The first batch whose every sample raises stops the run, before anything trains on it.
    with pytest.raises(ray.exceptions.RayTaskError) as refused:
        step(env, ["boom", "boom"])
    message = str(refused.value)
    assert "env.qa.config.functions[1] (picky: " in message
    assert "raised on every sample of the batch (2)" in message
    assert "picky cannot score boom" in message


@pytest.mark.ray
def test_one_sample_raising_alone_in_its_batch_stops_the_run_only_after_a_few_in_a_row(env):
    # A tool environment scores each episode as it ends, alone: one completion a function
    # raises on costs that sample, as long as it is not every batch's in a row.
    out = step(env, ["boom"])
    assert out.answers == ["correct=0 picky=None"]
    step(env, ["boom"])
    with pytest.raises(ray.exceptions.RayTaskError, match="3 batches in a row") as stopped:
        step(env, ["boom"])
    assert "picky cannot score boom" in str(stopped.value)


@pytest.mark.ray
def test_a_batch_whose_calls_all_time_out_stops_only_after_a_few_in_a_row(env):
    step(env, ["fine"])
    step(env, ["hang"])
    step(env, ["boom", "fine"])  # picky scores "fine": the streak ends
    step(env, ["hang"])
    step(env, ["hang"])
    with pytest.raises(ray.exceptions.RayTaskError, match="3 batches in a row"):
        step(env, ["hang"])
