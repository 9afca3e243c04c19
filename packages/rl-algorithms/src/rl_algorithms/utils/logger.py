"""One logger for a training run, fanning out to every enabled backend.

Backends: a JSONL file (always on unless disabled: what the tests and quick scripts read),
TensorBoard (``torch.utils.tensorboard``), Weights & Biases (offline when no API key is set,
so a run never needs the network) and MLflow (a local file store unless a tracking URI is
given; needs the ``rl-algorithms[mlflow]`` extra). Besides metrics it times the phases of a step
(:class:`Timer`), shows progress with an ETA and the key metrics (a rich bar on a terminal, one
plain line per step otherwise), and reports GPU memory and utilisation where CUDA devices exist.

    logger = Logger(LoggerConfig(log_dir="logs/run1", tensorboard_enabled=True))
    with logger.timer("generation"):
        ...
    logger.log_metrics({"loss": 0.3, **logger.timer.pop()}, step=1, prefix="train")
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TextIO

from pydantic import Field

from rl_distributed.config import ConfigModel


class WandbConfig(ConfigModel):
    # W&B project name.
    project: str = "rl"
    name: str | None = None  # None: W&B picks one
    # None: "online" when WANDB_API_KEY is set, else "offline" (files under log_dir/wandb).
    mode: str | None = None


class TensorboardConfig(ConfigModel):
    log_dir: str | None = None  # None: log_dir/tensorboard


class MlflowConfig(ConfigModel):
    # MLflow experiment the run is logged under.
    experiment_name: str = "rl"
    # MLflow run name; None lets MLflow pick one.
    run_name: str | None = None
    tracking_uri: str | None = None  # None: a file store under log_dir/mlruns


class LoggerConfig(ConfigModel):
    """Which backends a run logs to (NeMo RL's key names)."""

    # Where logs are written (metrics.jsonl, TensorBoard, curves, the resolved config.yaml).
    log_dir: str = "logs"
    jsonl_enabled: bool = True  # log_dir/metrics.jsonl, one line per log_metrics call
    # Log to TensorBoard (under log_dir unless tensorboard.log_dir is set).
    tensorboard_enabled: bool = False
    # Log to Weights & Biases (see wandb.*).
    wandb_enabled: bool = False
    # Log to MLflow (see mlflow.*).
    mlflow_enabled: bool = False
    monitor_gpus: bool = True  # GPU memory/utilisation with each log call (no-op without CUDA)
    # Show a progress line per step (step, elapsed time, ETA, progress_metrics).
    progress_bar: bool = True
    # Metrics shown next to the progress bar (names without prefix, e.g. "loss").
    progress_metrics: list[str] = Field(default_factory=lambda: ["loss"])
    # Samples (prompt, completion, reward) of the validation and of the latest training step,
    # at every validation: a table on the console (long texts shortened) and in W&B, a text
    # summary in TensorBoard, one line each in the JSONL file (0: none).
    num_val_samples_to_print: int = Field(4, ge=0)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    tensorboard: TensorboardConfig = Field(default_factory=TensorboardConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)


class Backend(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...
    def log_samples(self, key: str, samples: list[dict[str, Any]], step: int) -> None: ...
    def close(self) -> None: ...


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite-or-not real numbers among ``metrics`` (tensors and numpy scalars included)."""
    out = {}
    for key, value in metrics.items():
        value = _plain(value)
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            out[key] = float(value)
    return out


def _plain(value: Any) -> Any:
    """Tensors and numpy values as Python numbers or lists (for JSON and the backends)."""
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):
        return value.tolist()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


class JsonlBackend:
    """Appends ``{"step": n, "<prefix>/<name>": value, ...}`` lines (resumed runs append)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        record = {"step": step, **{k: _json_safe(_plain(v)) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # readable while the run goes on, and up to date if it is killed

    def log_samples(self, key: str, samples: list[dict[str, Any]], step: int) -> None:
        # One line per sample, its fields nested under ``key``: readers of the metrics (the
        # report's history) take only top-level numbers, so these lines leave them unchanged.
        for sample in samples:
            record = {"step": step, key: {k: _json_safe(_plain(v)) for k, v in sample.items()}}
            self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _json_safe(value: Any) -> Any:
    # JSON has no NaN/inf: write them as strings so a diverged run's log still parses.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class TensorboardBackend:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for key, value in scalar_metrics(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_samples(self, key: str, samples: list[dict[str, Any]], step: int) -> None:
        self.writer.add_text(key, samples_markdown(samples), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    def __init__(
        self,
        cfg: WandbConfig,
        log_dir: Path,
        run_config: Mapping[str, Any] | None,
        run_id: str | None,
    ) -> None:
        import wandb

        mode = cfg.mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        log_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.project,
            name=cfg.name,
            dir=str(log_dir),
            mode=mode,
            config=dict(run_config or {}),
            id=run_id,  # a resumed run keeps writing to the same W&B run
            resume="allow" if run_id else None,
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self.run.log(scalar_metrics(metrics), step=step)

    def log_samples(self, key: str, samples: list[dict[str, Any]], step: int) -> None:
        import wandb

        columns = sample_columns(samples)
        rows = [[_plain(sample.get(c)) for c in columns] for sample in samples]
        self.run.log({key: wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowBackend:
    def __init__(
        self,
        cfg: MlflowConfig,
        log_dir: Path,
        run_config: Mapping[str, Any] | None,
        run_id: str | None,
    ) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ImportError(
                "logger.mlflow_enabled needs MLflow: install rl-algorithms[mlflow]"
            ) from None
        uri = cfg.tracking_uri
        if uri is None:
            # A local file store needs no server and no SQL stack; MLflow 3 keeps it behind an
            # opt-in flag (it still works, in maintenance mode).
            uri = (log_dir.resolve() / "mlruns").as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            experiment = self.client.get_experiment_by_name(cfg.experiment_name)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self.client.create_experiment(cfg.experiment_name)
            )
            run_id = self.client.create_run(experiment_id, run_name=cfg.run_name).info.run_id
            for key, value in _flatten(run_config or {}).items():
                self.client.log_param(run_id, key, str(value)[:500])  # MLflow caps param values
        self.run_id = run_id

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [
            Metric(key, value, now, step)
            for key, value in scalar_metrics(metrics).items()
            if math.isfinite(value)
        ]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def log_samples(self, key: str, samples: list[dict[str, Any]], step: int) -> None:
        records = [{k: _json_safe(_plain(v)) for k, v in s.items()} for s in samples]
        name = f"{key.replace('/', '_')}_step_{step}.json"
        self.client.log_text(self.run_id, json.dumps(records, indent=1), f"samples/{name}")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def sample_columns(samples: list[dict[str, Any]]) -> list[str]:
    """Every field of ``samples``, in the order they first appear."""
    return list(dict.fromkeys(k for sample in samples for k in sample))


def samples_markdown(samples: list[dict[str, Any]]) -> str:
    """``samples`` as a Markdown table (TensorBoard renders text summaries as Markdown)."""
    columns = sample_columns(samples)

    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(_plain(value))
        # A cell is one line of the table: escape what would end it or split it.
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(s.get(c, "")) for c in columns) + " |" for s in samples]
    return "\n".join(lines)


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class Timer:
    """Wall time per named phase, summed until :meth:`pop` hands the totals out.

    ``with timer("generation"): ...`` may run several times in one step; the step's timing is
    the sum. Timings come out as ``timing/<phase>`` seconds, ready to log.
    """

    def __init__(self) -> None:
        self._totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._totals[phase] += time.perf_counter() - start

    def add(self, phase: str, seconds: float) -> None:
        """Count ``seconds`` to ``phase`` as if a ``with`` block had lasted that long (time
        measured elsewhere, e.g. the agent loop's generate calls, which overlap)."""
        self._totals[phase] += seconds

    def pop(self) -> dict[str, float]:
        """``{"timing/<phase>": seconds}`` since the last pop, then start afresh."""
        out = {f"timing/{phase}": seconds for phase, seconds in self._totals.items()}
        self._totals.clear()
        return out


def gpu_metrics() -> dict[str, float]:
    """Memory in use (GiB) and utilisation (%) of each visible CUDA device; empty without.

    Read through NVML (as ``nvidia-smi`` does), so the driver process, which holds no CUDA
    context of its own, sees what the workers on its node use; a device NVML cannot read is
    left out rather than failing the step.
    """
    import torch

    if not torch.cuda.is_available():
        return {}
    out: dict[str, float] = {}
    for i in range(torch.cuda.device_count()):
        try:
            out[f"gpu/{i}/memory_used_gib"] = torch.cuda.device_memory_used(i) / 2**30
            out[f"gpu/{i}/utilization_pct"] = float(torch.cuda.utilization(i))
        except Exception:  # no NVML (pynvml missing, MIG, permissions): nothing to report
            continue
    return out


class ProgressBar:
    """Progress with ETA and a few metrics; draws nothing when disabled.

    On a terminal it is a live rich bar. When the stream is not a terminal (a Slurm job,
    ``rl ... > log.txt``) a live bar would show nothing until the run ends, so each update
    prints one plain line instead: ``<name> step 3/30 | elapsed 0:00:41 | eta 0:06:09 | loss=...``.
    """

    def __init__(self, enabled: bool, shown: list[str], stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.shown = shown
        self.stream = stream  # None: sys.stdout as it is when the display starts
        self._progress: Any = None
        self._task: Any = None
        self._plain: _PlainProgress | None = None

    def start(self, total: int, done: int = 0, description: str = "train") -> None:
        if not self.enabled:
            return
        stream = self.stream if self.stream is not None else sys.stdout
        if not _is_terminal(stream):
            self._plain = _PlainProgress(stream, total, done, description)
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}"),
            console=Console(file=stream),
        )
        self._progress.start()
        self._task = self._progress.add_task(description, total=total, completed=done, metrics="")

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self._plain is not None:
            self._plain.line(step, self._shown_text(metrics))
        elif self._progress is not None:
            self._progress.update(self._task, completed=step, metrics=self._shown_text(metrics))

    def _shown_text(self, metrics: Mapping[str, Any]) -> str:
        scalars = scalar_metrics(metrics)
        shown = []
        for name in self.shown:
            # The metric itself, else one logged under a prefix ("turn_0/reward_mean"): once.
            key = (
                name
                if name in scalars
                else next((k for k in scalars if k.endswith(f"/{name}")), None)
            )
            if key is not None:
                shown.append(f"{name}={scalars[key]:.4g}")
        return " ".join(shown)

    def print_samples(self, title: str, samples: list[dict[str, Any]]) -> None:
        """``samples`` as a table on the console: through the live bar's console when it is
        drawn (printing around it would tear it), else on the stream. A stream that is not a
        terminal gets plain text, without colour codes."""
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        table = Table(title=title, show_lines=True, title_justify="left")
        columns = sample_columns(samples)
        for column in columns:
            table.add_column(column, overflow="fold")
        for sample in samples:
            # Text, not markup: a completion's "[assistant]" or "[/b]" is shown as written.
            table.add_row(*(Text(_cell_text(c, sample.get(c))) for c in columns))
        if self._progress is not None:
            self._progress.console.print(table)
            return
        stream = self.stream if self.stream is not None else sys.stdout
        Console(file=stream, width=None if _is_terminal(stream) else 120).print(table)

    def stop(self) -> None:
        self._plain = None
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


# How much of a sample a console table shows: the end of a prompt (where the question is)
# and the start of a completion. The logs' own tables keep the whole text.
SHOWN_PROMPT_CHARS = 300
SHOWN_COMPLETION_CHARS = 600


def _cell_text(column: str, value: Any) -> str:
    value = _plain(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    if column == "prompt" and len(text) > SHOWN_PROMPT_CHARS:
        return "..." + text[-SHOWN_PROMPT_CHARS:]
    if len(text) > SHOWN_COMPLETION_CHARS:
        return text[:SHOWN_COMPLETION_CHARS] + "..."
    return text


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class _PlainProgress:
    """One line per step for a stream that is not a terminal; the ETA is the mean time of the
    steps done since the display started, times the steps left (a resumed run's earlier steps
    took no time here)."""

    def __init__(self, stream: TextIO, total: int, done: int, description: str) -> None:
        self.stream = stream
        self.total = total
        self.first_step = done
        self.description = description
        self.started = time.monotonic()
        self.last_step: int | None = None

    def line(self, step: int, metrics_text: str) -> None:
        if step == self.last_step:  # a second log call for the same step adds nothing new
            return
        self.last_step = step
        elapsed = time.monotonic() - self.started
        steps_done = step - self.first_step
        eta = _clock(elapsed / steps_done * max(self.total - step, 0)) if steps_done > 0 else "?"
        parts = [
            f"{self.description} step {step}/{self.total}",
            f"elapsed {_clock(elapsed)}",
            f"eta {eta}",
        ]
        if metrics_text:
            parts.append(metrics_text)
        print(" | ".join(parts), file=self.stream, flush=True)


def _clock(seconds: float) -> str:
    """``H:MM:SS``, as rich's columns show time."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class Logger:
    """Fans ``log_metrics`` out to the enabled backends; times phases; draws progress.

    ``run_config`` (the resolved run config) is recorded by W&B and MLflow. ``state_dict`` /
    ``load_state_dict`` carry the W&B and MLflow run ids through a checkpoint, so a resumed run
    goes on writing to the same runs; create the Logger with the state to resume.
    """

    def __init__(
        self,
        config: LoggerConfig,
        run_config: Mapping[str, Any] | None = None,
        state: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.log_dir = Path(config.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        state = dict(state or {})
        self.timer = Timer()
        self.progress = ProgressBar(config.progress_bar, config.progress_metrics)
        self.backends: dict[str, Backend] = {}
        if config.jsonl_enabled:
            self.backends["jsonl"] = JsonlBackend(self.log_dir / "metrics.jsonl")
        if config.tensorboard_enabled:
            tb_dir = Path(config.tensorboard.log_dir or self.log_dir / "tensorboard")
            self.backends["tensorboard"] = TensorboardBackend(tb_dir)
        if config.wandb_enabled:
            self.backends["wandb"] = WandbBackend(
                config.wandb, self.log_dir / "wandb", run_config, state.get("wandb_run_id")
            )
        if config.mlflow_enabled:
            self.backends["mlflow"] = MlflowBackend(
                config.mlflow, self.log_dir, run_config, state.get("mlflow_run_id")
            )

    def log_metrics(self, metrics: Mapping[str, Any], step: int, prefix: str = "") -> None:
        """Log ``metrics`` at ``step`` under ``prefix/`` (plus GPU metrics if monitored)."""
        named = {f"{prefix}/{k}" if prefix else k: v for k, v in metrics.items()}
        if self.config.monitor_gpus:
            named.update(gpu_metrics())
        for backend in self.backends.values():
            backend.log(named, step)
        if prefix in ("", "train"):
            self.progress.update(step, metrics)

    def log_samples(self, samples: list[dict[str, Any]], step: int, prefix: str = "val") -> None:
        """Log example rows (``{"prompt": ..., "completion": ..., "reward": ...}``) under
        ``<prefix>/samples``: a W&B table, a TensorBoard text summary, a JSONL line each."""
        if not samples:
            return
        key = f"{prefix}/samples" if prefix else "samples"
        for backend in self.backends.values():
            backend.log_samples(key, samples, step)
        self.progress.print_samples(f"{key} at step {step}", samples)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if "wandb" in self.backends:
            state["wandb_run_id"] = self.backends["wandb"].run.id  # type: ignore[attr-defined]
        if "mlflow" in self.backends:
            state["mlflow_run_id"] = self.backends["mlflow"].run_id  # type: ignore[attr-defined]
        return state

    def close(self) -> None:
        self.progress.stop()
        for backend in self.backends.values():
            backend.close()
        self.backends.clear()

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
