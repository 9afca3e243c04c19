"""Starting a run's environments: their verifier pools sized to the CPUs Ray has free, and one
that cannot be placed refused at once, naming its config key."""

import json
import time

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from rl_algorithms.checks import check_rows_for_envs
from rl_algorithms.environments import (
    EnvSpec,
    environment_class,
    fit_worker_pool,
    offered_tools,
    required_metadata,
    start_environments,
)
from rl_data.datasets import load_dataset
from rl_data.errors import DataError
from rl_envs.math_env import MathEnvConfig


def test_environments_share_the_free_cpus_one_after_the_other():
    # Started together, each would see the same free CPUs: the sizes are decided in turn.
    first, left = fit_worker_pool("a", MathEnvConfig(), free_cpus=3.0)
    second, left = fit_worker_pool("b", MathEnvConfig(), left)
    assert (first.num_workers, second.num_workers, left) == (2, 1, 0.0)
    explicit, _ = fit_worker_pool("c", MathEnvConfig(num_workers=4, num_cpus_per_worker=0.5), 2.0)
    assert explicit.num_workers == 4
    with pytest.raises(ValueError, match=r"env\.d\.config\.num_workers: no room .* 0 CPUs free"):
        fit_worker_pool("d", MathEnvConfig(), left)
    untouched = object()  # an environment of one's own, without a verifier pool
    assert fit_worker_pool("e", untouched, 1.0) == (untouched, 1.0)


def test_on_an_attached_cluster_a_given_number_is_left_to_ray(monkeypatch):
    # What is free on a shared or autoscaling cluster now says little about what Ray places.
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    asked, left = fit_worker_pool("a", MathEnvConfig(num_workers=8), free_cpus=2.0)
    assert (asked.num_workers, left) == (8, -6.0)
    fitted, _ = fit_worker_pool("b", MathEnvConfig(), free_cpus=2.0)  # None: still fitted
    assert fitted.num_workers == 2
    monkeypatch.delenv("RAY_ADDRESS")
    with pytest.raises(ValueError, match=r"env\.a\.config\.num_workers is 8"):
        fit_worker_pool("a", MathEnvConfig(num_workers=8), free_cpus=2.0)


def test_a_recipe_names_the_tool_environment_by_its_kind(tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(
        "def correct(prompts, completions, trajectory, answer, **kw):\n    return [1.0]\n"
    )
    spec = EnvSpec(
        kind="tools",
        config={"tools": ["calculator"], "functions": [{"function": f"{rewards}:correct"}]},
    )
    cls, cfg = environment_class("calc", spec)
    assert (cls.__name__, cfg.config_key, cfg.tools[0].name) == (
        "ToolEnvironment",
        "env.calc.config",
        "calculator",
    )
    # The trajectory comes from the environment, not from the data.
    assert required_metadata("calc", spec) == ("answer",)
    # Its tool pool is sized like any verifier pool.
    fitted, left = fit_worker_pool("calc", cfg, free_cpus=3.0)
    assert (fitted.num_workers, left) == (2, 1.0)
    # A row without a tools column is offered the configured ones (its prompt shows them);
    # a row whose column offers a tool the environment does not have is refused at setup.
    offered = offered_tools({"calc": spec, "math": EnvSpec(kind="math")})
    assert list(offered) == ["calc"]
    assert [t["function"]["name"] for t in offered["calc"]] == ["calculator"]
    data = tmp_path / "rows.jsonl"
    weather = {**offered["calc"][0], "function": {**offered["calc"][0]["function"]}}
    weather["function"]["name"] = "weather"
    row = {"prompt": "6 * 7?", "answer": "42"}
    data.write_text(json.dumps(row) + "\n" + json.dumps({**row, "tools": [weather]}) + "\n")
    rows = load_dataset({"source": "chat_file", "path": str(data), "task_name": "calc"})
    with pytest.raises(DataError, match=r"row 2: .*offers \['weather'\], which env.calc does not"):
        check_rows_for_envs(rows, {"calc": spec})


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_an_environment_the_cluster_has_no_room_for_fails_at_once(ray_session):
    # The case: an environment at its defaults on a cluster whose CPUs the policy and
    # generation already hold. It used to sit at step 0 with no message, then (with its pool's
    # CPUs reserved first) failed after a wait without naming the key to change.
    policy_and_generation = placement_group([{"CPU": ray.available_resources()["CPU"]}])
    ray.get(policy_and_generation.ready(), timeout=60)
    try:
        start = time.monotonic()
        with pytest.raises(ValueError) as refused:
            start_environments({"reasoning_gym": EnvSpec()})
        assert time.monotonic() - start < 5
        message = str(refused.value)
        assert message.startswith("env.reasoning_gym.config.num_workers: no room")
        assert "the Ray cluster has 0 CPUs free" in message
        with pytest.raises(ValueError, match=r"num_workers is 1: .* has 0 free"):
            start_environments({"reasoning_gym": EnvSpec(config={"num_workers": 1})})
    finally:
        remove_placement_group(policy_and_generation)
