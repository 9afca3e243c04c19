import json
import math
import re
from pathlib import Path

import pytest

from rl_algorithms.utils.logger import Logger, LoggerConfig, Timer


def test_jsonl_and_tensorboard_files_hold_the_logged_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = LoggerConfig(log_dir=str(tmp_path), tensorboard_enabled=True, progress_bar=False)
    with Logger(cfg) as logger:
        for step in range(1, 4):
            logger.log_metrics({"loss": 1.0 / step, "lr": 0.1}, step=step, prefix="train")
        logger.log_metrics({"loss": float("nan")}, step=4, prefix="val")

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    assert lines[1]["train/loss"] == pytest.approx(0.5)
    assert lines[3]["val/loss"] == "nan"  # still valid JSON

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("train/loss")
    assert [(e.step, round(e.value, 6)) for e in scalars] == [(1, 1.0), (2, 0.5), (3, 0.333333)]


def test_wandb_offline_run_directory_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = LoggerConfig(
        log_dir=str(tmp_path), wandb_enabled=True, jsonl_enabled=False, progress_bar=False
    )
    with Logger(cfg, run_config={"policy": {"lr": 1e-3}}) as logger:
        logger.log_metrics({"loss": 2.0}, step=1, prefix="train")
        run_id = logger.state_dict()["wandb_run_id"]
    runs = list((tmp_path / "wandb" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb")), "the offline run holds no .wandb data file"


def test_mlflow_file_store_gets_metrics_and_resumes_the_same_run(tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = LoggerConfig(
        log_dir=str(tmp_path), mlflow_enabled=True, jsonl_enabled=False, progress_bar=False
    )
    with Logger(cfg, run_config={"sft": {"max_num_steps": 3}}) as logger:
        logger.log_metrics({"loss": 3.0}, step=1, prefix="train")
        state = logger.state_dict()
    with Logger(cfg, state=state) as logger:  # a resumed run
        logger.log_metrics({"loss": 2.0}, step=2, prefix="train")
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    history = client.get_metric_history(state["mlflow_run_id"], "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 3.0), (2, 2.0)]
    assert client.get_run(state["mlflow_run_id"]).data.params["sft.max_num_steps"] == "3"


def test_timer_sums_each_phase_until_popped():
    timer = Timer()
    for _ in range(2):
        with timer("generation"):
            sum(range(10_000))
    with timer("train"):
        pass
    timing = timer.pop()
    assert set(timing) == {"timing/generation", "timing/train"}
    assert all(v >= 0 and math.isfinite(v) for v in timing.values())
    assert timer.pop() == {}


def test_gpu_metrics_are_empty_without_cuda(tmp_path):
    import torch

    from rl_algorithms.utils.logger import gpu_metrics

    if torch.cuda.is_available():
        assert any(k.endswith("memory_used_gib") for k in gpu_metrics())
    else:
        assert gpu_metrics() == {}


def test_progress_bar_runs_with_rich(tmp_path, capsys):
    cfg = LoggerConfig(log_dir=str(tmp_path), progress_bar=True)
    with Logger(cfg) as logger:
        logger.progress.start(total=2)
        logger.log_metrics({"loss": 0.5}, step=1, prefix="train")
        logger.log_metrics({"loss": 0.25}, step=2, prefix="train")
    assert Path(tmp_path / "metrics.jsonl").exists()


def test_progress_prints_one_plain_line_per_step_when_not_a_terminal(tmp_path):
    import io

    from rl_algorithms.utils.logger import ProgressBar

    stream = io.StringIO()  # not a terminal, as stdout is under Slurm or `> log.txt`
    progress = ProgressBar(True, ["reward_mean", "loss"], stream=stream)
    progress.start(total=4, done=1, description="grpo")
    progress.update(2, {"turn_0/reward_mean": 0.25, "loss": 0.5, "lr": 1e-5})
    progress.update(2, {"loss": 0.5})  # a second call for the same step prints nothing
    progress.update(3, {"loss": 0.125})
    progress.stop()
    progress.update(4, {"loss": 0.1})  # stopped: nothing more

    lines = stream.getvalue().splitlines()
    clock = r"\d+:\d\d:\d\d"
    assert len(lines) == 2, lines
    assert re.fullmatch(
        rf"grpo step 2/4 \| elapsed {clock} \| eta {clock} \| reward_mean=0\.25 loss=0\.5", lines[0]
    ), lines[0]
    assert re.fullmatch(
        rf"grpo step 3/4 \| elapsed {clock} \| eta {clock} \| loss=0\.125", lines[1]
    )


def test_progress_plain_line_eta_is_mean_step_time_times_steps_left(monkeypatch):
    import io

    from rl_algorithms.utils import logger as logger_module

    now = [100.0]
    monkeypatch.setattr(logger_module.time, "monotonic", lambda: now[0])
    stream = io.StringIO()
    progress = logger_module.ProgressBar(True, ["loss"], stream=stream)
    progress.start(total=10, done=0, description="sft")
    now[0] = 130.0  # 2 steps in 30 s: 15 s a step, 8 steps left
    progress.update(2, {})
    assert stream.getvalue() == "sft step 2/10 | elapsed 0:00:30 | eta 0:02:00\n"


SAMPLES = [
    {"prompt": "What is 2+3?", "completion": "5 | five\nDone.", "reward": 1.0},
    {"prompt": "What is 4*4?", "completion": "15", "reward": 0.0},
]


def test_samples_go_to_jsonl_lines_and_a_tensorboard_text_summary(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rl_algorithms.utils.report import read_history

    cfg = LoggerConfig(log_dir=str(tmp_path), tensorboard_enabled=True, progress_bar=False)
    with Logger(cfg) as logger:
        logger.log_metrics({"accuracy": 0.5}, step=2, prefix="val")
        logger.log_samples(SAMPLES, step=2, prefix="val")
        logger.log_samples([], step=3, prefix="val")  # nothing to show: nothing written

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[1:] == [{"step": 2, "val/samples": s} for s in SAMPLES]
    # The sample lines leave the metrics' history as it was.
    assert read_history(tmp_path / "metrics.jsonl") == {"val/accuracy": [(2, 0.5)]}

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    (event,) = events.Tensors("val/samples/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 2
    assert text.splitlines()[0] == "| prompt | completion | reward |"
    # A "|" or a line break inside a cell would break the Markdown table: escaped.
    assert "| What is 2+3? | 5 \\| five<br>Done. | 1 |" in text.splitlines()
    assert "| What is 4*4? | 15 | 0 |" in text.splitlines()


def test_samples_are_a_plain_table_on_a_console_that_is_not_a_terminal(tmp_path):
    import io

    from rl_algorithms.utils.logger import SHOWN_COMPLETION_CHARS

    stream = io.StringIO()  # `rl grpo > log.txt`: no colour codes, no cursor movement
    cfg = LoggerConfig(log_dir=str(tmp_path), jsonl_enabled=False, progress_bar=True)
    long = {"prompt": "[user] Q", "completion": "x" * 2000 + "TAIL", "reward": 0.5}
    with Logger(cfg) as logger:
        logger.progress.stream = stream
        logger.log_samples([*SAMPLES, long], step=3, prefix="train")
        logger.log_samples([], step=4, prefix="train")  # nothing: no empty table
    text = stream.getvalue()
    assert "\x1b[" not in text and "\r" not in text
    assert text.count("train/samples at step 3") == 1 and "step 4" not in text
    for needed in ("prompt", "completion", "reward", "What is 2+3?", "15", "[user] Q"):
        assert needed in text  # markup-like text is shown as written
    # A long completion is cut on the console (the logs keep it whole).
    assert "TAIL" not in text
    assert "x" * 100 in text.replace("\n", "").replace("│", "").replace(" ", "")
    assert text.count("x") < SHOWN_COMPLETION_CHARS + 50


def test_samples_become_a_table_in_the_wandb_offline_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = LoggerConfig(
        log_dir=str(tmp_path), wandb_enabled=True, jsonl_enabled=False, progress_bar=False
    )
    with Logger(cfg) as logger:
        logger.log_samples(SAMPLES, step=1, prefix="val")
        run_id = logger.state_dict()["wandb_run_id"]
    (run_dir,) = (tmp_path / "wandb" / "wandb").glob(f"offline-run-*-{run_id}")
    (table_file,) = run_dir.glob("files/media/table/val/samples_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["prompt", "completion", "reward"]
    assert table["data"] == [[s["prompt"], s["completion"], s["reward"]] for s in SAMPLES]
