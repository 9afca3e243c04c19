"""docs/guides/reward-functions.md, run as written: the user's function file, the recipe's
``env`` section and the command, on a tiny model (``rl grpo``); the per-function metrics reach
the JSONL log. Config mistakes about reward functions are refused before Ray starts."""

import re
import shlex
from pathlib import Path

import pytest
import ray
import yaml

from rl_algorithms import cli
from rl_distributed.config import ConfigError

from .conftest import read_metrics, write_config
from .test_grpo import grpo_config

GUIDE = Path(__file__).resolve().parents[4] / "docs" / "guides" / "reward-functions.md"
GRPO_RECIPE = GUIDE.parents[2] / "examples" / "configs" / "grpo_math_cpu.yaml"


def guide_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", GUIDE.read_text(), flags=re.S)


def test_the_guides_function_is_short_and_scores_as_it_says(tmp_path):
    from rl_envs.reward_functions import load_reward_function

    (source,) = guide_blocks("python")
    assert len(source.splitlines()) < 10
    (tmp_path / "my_rewards.py").write_text(source)
    contains_answer = load_reward_function(f"{tmp_path / 'my_rewards.py'}:contains_answer")
    completions = [[{"role": "assistant", "content": t}] for t in ("it is 12", "13", "  ")]
    assert contains_answer([[]] * 3, completions, ground_truth=["12"] * 3) == [1.0, 0.0, None]
    # TRL's standard format: prompts and completions are strings.
    texts = ["it is 12", "13", "  "]
    assert contains_answer(["q"] * 3, texts, ground_truth=["12"] * 3) == [1.0, 0.0, None]


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("no_such_file.py:f", r"env\.arithmetic\.config\.functions\.1\.function: .*no such file"),
        ("rl_envs.reward_functions:nope", r"functions\.1\.function: .*has no 'nope'"),
    ],
)
def test_a_function_that_cannot_be_loaded_is_refused_before_ray_starts(function, message):
    functions = f"[{{function: math}}, {{function: '{function}'}}]"
    argv = [
        "--config",
        str(GRPO_RECIPE),
        "tokenizer.path=/tokenizer",
        "env.arithmetic.kind=reward_functions",
        f"env.arithmetic.config={{functions: {functions}}}",
    ]
    with pytest.raises(ConfigError, match=message):
        cli.build_config(cli.load_algorithm("grpo"), argv)
    assert not ray.is_initialized()


def test_the_guides_recipe_as_written_builds_on_the_main_job(tmp_path, monkeypatch):
    """The guide's (and README's) files, written beside each other and read as `rl grpo
    --config my_recipe.yaml` reads them: the main job with the guide's environment."""
    (source,) = guide_blocks("python")
    (recipe,) = guide_blocks("yaml")
    (tmp_path / "my_rewards.py").write_text(source)
    (tmp_path / "my_recipe.yaml").write_text(recipe)
    monkeypatch.chdir(tmp_path)
    grpo = cli.load_algorithm("grpo")
    config = cli.build_config(grpo, ["--config", "my_recipe.yaml"])
    main = cli.build_config(grpo, [])  # `rl grpo` alone: the main job
    env = config.env["arithmetic"]
    assert env.kind == "reward_functions"
    assert [(f.get("name"), f["weight"]) for f in env.config["functions"]] == [
        (None, 1.0),
        (None, 0.5),
    ]
    assert [f["function"] for f in env.config["functions"]][1] == "my_rewards.py:contains_answer"
    assert config.policy.model == main.policy.model and config.data == main.data
    assert config.checkpointing.checkpoint_dir != main.checkpointing.checkpoint_dir
    assert not ray.is_initialized()


@pytest.mark.slow
@pytest.mark.usefixtures("machine_sized_ray")
def test_the_guides_reward_function_trains_with_the_math_reward(tmp_path, assets, monkeypatch):
    # On the machine's own CPUs, not the 4 logical ones of the other tests: the guide's
    # environment (its num_workers left out) must fit a 2-core machine.
    (source,) = guide_blocks("python")
    (env_section,) = guide_blocks("yaml")
    (command,) = guide_blocks("bash")
    (tmp_path / "my_rewards.py").write_text(source)
    config = grpo_config(tmp_path, assets)
    del config["cluster"]["ray_num_cpus"]
    config["env"] = yaml.safe_load(env_section)["env"]
    config["grpo"].update(max_num_steps=2, val_period=0)
    config["checkpointing"]["enabled"] = False
    write_config(tmp_path, config)
    (tmp_path / "run.yaml").rename(tmp_path / "my_recipe.yaml")

    monkeypatch.chdir(tmp_path)  # the guide's relative paths are from where `rl` runs
    argv = shlex.split(command.strip())
    assert argv[:3] == ["uv", "run", "rl"]
    assert cli.main(argv[3:]) == 0

    steps = [r for r in read_metrics(tmp_path / "logs") if "train/loss" in r]
    assert len(steps) == 2
    for r in steps:
        for name in ("math", "contains_answer"):
            key = f"train/env/arithmetic/{name}"
            assert r[f"{key}/samples"] == 16, r  # 4 prompts x 4 generations
            assert 0.0 <= r[f"{key}/none_fraction"] <= 1.0
            if r[f"{key}/none_fraction"] < 1.0:
                assert 0.0 <= r[f"{key}/mean"] <= 1.0 and r[f"{key}/std"] >= 0.0
        # The environment's reward is 1.0 * math + 0.5 * contains_answer, a None counting 0
        # (a random model rarely scores, so this is mostly a check of the names and counts;
        # packages/rl-envs/tests/test_reward_functions.py checks the weighting on real values).
        env = "train/env/arithmetic"
        scored = {
            name: r.get(f"{env}/{name}/mean", 0.0) * (1 - r[f"{env}/{name}/none_fraction"])
            for name in ("math", "contains_answer")
        }
        expected = scored["math"] + 0.5 * scored["contains_answer"]
        assert r[f"{env}/reward_mean"] == pytest.approx(expected, abs=1e-6), r
        # Both functions scored every sample in time, in their own processes.
        assert r["train/env/arithmetic/math/timeouts"] == 0
        assert r["train/env/arithmetic/contains_answer/verifier_errors"] == 0


def test_setup_knows_the_columns_the_functions_read(tmp_path):
    """What setup checks the rows against (rl_data.datasets.require_env_info): a reward
    function's arguments without a default, and a class's ``required_metadata``."""
    from rl_algorithms.environments import EnvSpec, required_metadata

    (tmp_path / "mine.py").write_text("def f(prompts, completions, label, **kw):\n    return []\n")
    functions = [{"function": "math"}, {"function": f"{tmp_path / 'mine.py'}:f"}]
    spec = EnvSpec(kind="reward_functions", config={"functions": functions})
    assert required_metadata("qa", spec) == ("ground_truth", "label")
    assert required_metadata("arithmetic", EnvSpec(kind="math")) == ("ground_truth",)
