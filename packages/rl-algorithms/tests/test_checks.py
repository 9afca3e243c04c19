"""`rl ... --print-config` and the start of a run check the model, tokenizer and data files
(and the columns the rewards read) in seconds, with no Ray; an interrupted or finished run
says where it stands in one line."""

import json
from pathlib import Path

import pytest

from rl_algorithms import checks, cli

NEW_DATA = ["~data.train", "data.validation_fraction=0"]


@pytest.fixture(autouse=True)
def no_ray(monkeypatch, tmp_path):
    """Starting Ray fails these tests: every check must come before it. The run's outputs go
    to the test's folder."""
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("ray.init was called")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)


def write(path: Path, lines: list[str]) -> str:
    path.write_text("".join(f"{line}\n" for line in lines))
    return str(path)


def print_config(capsys, *overrides: str) -> tuple[int, str]:
    code = cli.main(["grpo", *overrides, "--print-config"])
    return code, capsys.readouterr().err


def train_file(path: str, **keys: str) -> str:
    extra = "".join(f", {k}: {v}" for k, v in keys.items())
    return f"+data.train={{source: chat_file, path: {path}{extra}}}"


def test_a_line_that_is_not_json_is_named_with_its_file_and_line(capsys, tmp_path):
    data = write(
        tmp_path / "train.jsonl",
        ['{"prompt": "1 + 1?", "ground_truth": "2"}', "", '{"prompt": "2 + 2?", "ground_truth"'],
    )
    code, err = print_config(capsys, *NEW_DATA, train_file(data, task_name="arithmetic"))
    assert code == cli.CONFIG_ERROR_EXIT
    assert f"data.train: {data}, row 3: not valid JSON" in err
    assert "Traceback" not in err


def test_a_row_without_a_prompt_names_the_columns_expected(capsys, tmp_path):
    data = write(tmp_path / "train.jsonl", ['{"question": "1 + 1?", "ground_truth": "2"}'])
    code, err = print_config(capsys, *NEW_DATA, train_file(data, task_name="arithmetic"))
    assert code == cli.CONFIG_ERROR_EXIT
    assert f"data.train: {data}, row 1: no column 'messages', 'prompt' or 'text'" in err
    assert "'question'" in err  # the columns the row has


def test_a_model_path_that_does_not_exist_names_its_key(capsys, tmp_path):
    missing = tmp_path / "no-such-model"
    code, err = print_config(
        capsys,
        f"policy.model.path={missing}",
        "~policy.model.gguf_file",
        f"tokenizer.path={missing}",
    )
    assert code == cli.CONFIG_ERROR_EXIT
    assert f"policy.model.path: model '{missing}': no local path" in err
    assert f"tokenizer.gguf_file: GGUF file not found: {missing}" in err


def test_a_reward_function_argument_no_column_holds_is_refused(capsys, tmp_path):
    (tmp_path / "rewards.py").write_text(
        "def by_difficulty(prompts, completions, difficulty, **kwargs):\n"
        "    return [1.0 for _ in completions]\n"
    )
    data = write(tmp_path / "train.jsonl", ['{"prompt": "1 + 1?", "answer": "2"}'])
    env = "env.arithmetic={kind: reward_functions, config: {functions: [{function: rewards.py:by_difficulty}]}}"
    code, err = print_config(capsys, *NEW_DATA, train_file(data, task_name="arithmetic"), env)
    assert code == cli.CONFIG_ERROR_EXIT
    assert f"data.train: {data}, row 1: no column 'difficulty'" in err
    assert "the row has ['answer']" in err


def test_good_data_passes_and_the_config_is_printed(capsys, tmp_path):
    data = write(tmp_path / "train.jsonl", ['{"prompt": "1 + 1?", "answer": "2"}'] * 3)
    columns = "{answer: ground_truth}"
    code = cli.main(
        [
            "grpo",
            *NEW_DATA,
            train_file(data, task_name="arithmetic", columns=columns),
            "--print-config",
        ]
    )
    assert code == 0
    assert "source: chat_file" in capsys.readouterr().out


def test_only_the_first_sample_rows_are_read(monkeypatch, capsys, tmp_path):
    lines = ['{"prompt": "1 + 1?", "ground_truth": "2"}'] * 3 + ["not json"]
    data = write(tmp_path / "train.jsonl", lines)
    monkeypatch.setattr(checks, "SAMPLE_ROWS", 3)
    code, _ = print_config(capsys, *NEW_DATA, train_file(data, task_name="arithmetic"))
    assert code == 0
    monkeypatch.setattr(checks, "SAMPLE_ROWS", 4)
    code, err = print_config(capsys, *NEW_DATA, train_file(data, task_name="arithmetic"))
    assert "row 4: not valid JSON" in err


def test_a_real_run_fails_on_bad_data_before_its_tokenizer_or_ray(monkeypatch, capsys, tmp_path):
    import rl_data.tokenizers

    def no_tokenizer(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded")

    monkeypatch.setattr(rl_data.tokenizers, "load_tokenizer", no_tokenizer)
    data = write(tmp_path / "train.jsonl", ["{"])
    code = cli.main(["grpo", *NEW_DATA, train_file(data, task_name="arithmetic")])
    assert code == cli.CONFIG_ERROR_EXIT
    assert f"data.train: {data}, row 1: not valid JSON" in capsys.readouterr().err


def test_rl_traceback_shows_the_traceback(monkeypatch, tmp_path):
    monkeypatch.setenv(cli.TRACEBACK_ENV, "1")
    data = write(tmp_path / "train.jsonl", ["{"])
    with pytest.raises(checks.InputError, match="not valid JSON"):
        cli.main(["grpo", *NEW_DATA, train_file(data), "--print-config"])


def fake_checkpoint(root: Path, step: int) -> None:
    (root / f"step_{step}").mkdir(parents=True)
    (root / f"step_{step}" / "info.json").write_text(json.dumps({"step": step}))


def test_a_finished_run_says_there_is_nothing_to_do(capsys, tmp_path):
    fake_checkpoint(tmp_path / "ckpt", 30)
    overrides = [f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", "grpo.max_num_steps=30"]
    assert cli.main(["grpo", *overrides]) == 0
    err = capsys.readouterr().err
    assert "nothing to do" in err
    assert "already reached step 30 of 30; raise grpo.max_num_steps to continue" in err


def test_the_interrupted_message_says_where_to_resume(tmp_path):
    config = cli.build_config(
        cli.load_algorithm("grpo"), [f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}"]
    )
    assert cli.interrupted_message(config, step=3) == (
        "interrupted at step 3; rerun the same command to resume from the start"
    )
    fake_checkpoint(tmp_path / "ckpt", 5)
    assert cli.interrupted_message(config, step=7) == (
        "interrupted at step 7; rerun the same command to resume from step 5"
    )


def test_ctrl_c_during_a_run_is_one_line(monkeypatch, capsys):
    algorithm = cli.load_algorithm("grpo")

    def interrupted(config):
        try:
            raise KeyboardInterrupt
        finally:
            raise RuntimeError("a worker died while shutting down")  # chained on it

    monkeypatch.setattr(algorithm, "main", interrupted)
    monkeypatch.setattr("rl_algorithms.run._last_run", None)
    assert cli.main(["grpo"]) == cli.INTERRUPTED_EXIT
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "rl grpo: interrupted before the first step; rerun the same command to resume from the start"
    ]


def test_sigint_ends_the_command_with_one_line(tmp_path):
    """The real signal, in a process of its own: a run that sleeps in its loop (no Ray)."""
    import os
    import signal
    import subprocess
    import sys

    script = (
        # A shell's background job starts with SIGINT ignored, and Python then leaves it
        # ignored: Ctrl-C's handling, as a terminal's foreground process has it.
        "import signal, sys, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from rl_algorithms import cli\n"
        "def main(config):\n"
        "    print('running', flush=True)\n"
        "    time.sleep(60)\n"
        "cli.load_algorithm('grpo').main = main\n"
        "sys.exit(cli.main(['grpo']))\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline() == "running\n"
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == cli.INTERRUPTED_EXIT
    assert err.strip().splitlines()[-1] == (
        "rl grpo: interrupted before the first step; rerun the same command to resume from the start"
    )
    assert "Traceback" not in err
