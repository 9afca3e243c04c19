"""What a finished run shows: a plot of its curves and a summary table.

Both read the run's ``metrics.jsonl`` (the JSONL logger's file), which a resumed run appends
to, so they cover the whole run, not just what this process saw.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

History = dict[str, list[tuple[int, float]]]  # metric name -> [(step, value)], by step


def read_history(jsonl: str | Path) -> History:
    """Every numeric metric of ``jsonl`` as ``(step, value)`` pairs; a step logged twice (a
    resumed run redoing it) keeps its last value."""
    rows: dict[str, dict[int, float]] = defaultdict(dict)
    with open(jsonl) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:  # a line cut short by a kill: skip it, say so
                if n > 1 and not line.endswith("\n"):
                    continue
                raise ValueError(f"{jsonl}:{n}: not a JSON object ({e})") from None
            step = int(record.get("step", 0))
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float):
                    rows[key][step] = float(value)
    return {key: sorted(values.items()) for key, values in rows.items()}


def plot_curves(
    history: History,
    out: str | Path,
    panels: Sequence[tuple[str, str]] = (
        ("train/reward_mean", "train reward (mean)"),
        ("val/accuracy", "validation accuracy (greedy)"),
    ),
    title: str = "",
) -> Path:
    """A PNG with one panel per ``(metric, label)`` against steps; missing metrics are left
    out of the figure (a run without validation plots its reward alone)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a training machine
    import matplotlib.pyplot as plt

    present = [(key, label) for key, label in panels if history.get(key)]
    if not present:
        raise ValueError(f"none of {[k for k, _ in panels]} was logged: nothing to plot")
    fig, axes = plt.subplots(1, len(present), figsize=(5 * len(present), 3.6), squeeze=False)
    for ax, (key, label) in zip(axes[0], present, strict=True):
        steps, values = zip(*history[key], strict=True)
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3)
        ax.set_xlabel("step")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def mean_of(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def summary_rows(history: History, phases: Sequence[str]) -> list[tuple[str, str]]:
    """(what, value) rows summarising a GRPO run: length, time per phase, throughput, reward
    and validation accuracy at the start and at the end."""
    rows: list[tuple[str, str]] = []
    steps = [s for s, _ in history.get("train/reward_mean", [])]
    rows.append(("steps", str(len(steps))))
    wall = dict(history.get("train/step_seconds", []))  # a step's wall clock, when logged
    step_seconds = [
        wall.get(s)
        or sum(v for k in phases for s2, v in history.get(f"train/timing/{k}", []) if s2 == s)
        for s in steps
    ]
    if steps:
        rows.append(("seconds per step (mean)", f"{mean_of(step_seconds):.1f}"))
    for phase in phases:
        values = [v for _, v in history.get(f"train/timing/{phase}", [])]
        if values:
            rows.append((f"  {phase} (mean s)", f"{mean_of(values):.2f}"))
    tokens = [v for _, v in history.get("train/completion_tokens", [])]
    generation = [v for _, v in history.get("train/timing/generation", [])]
    if tokens and step_seconds:
        rows.append(
            ("completion tokens / s (whole step)", f"{sum(tokens) / sum(step_seconds):.1f}")
        )
    if tokens and generation:
        rows.append(("completion tokens / s (generation)", f"{sum(tokens) / sum(generation):.1f}"))
    reward = [v for _, v in history.get("train/reward_mean", [])]
    if reward:
        k = max(1, min(5, len(reward) // 3))
        first, last = mean_of(reward[:k]), mean_of(reward[-k:])
        rows.append((f"train reward (mean of first/last {k} steps)", f"{first:.3f} -> {last:.3f}"))
    accuracy = history.get("val/accuracy", [])
    if accuracy:
        rows.append(
            (
                f"validation accuracy (step {accuracy[0][0]} -> {accuracy[-1][0]})",
                f"{accuracy[0][1]:.3f} -> {accuracy[-1][1]:.3f}",
            )
        )
    return rows


def print_summary(
    rows: Sequence[tuple[str, str]],
    paths: Mapping[str, str],
    title: str,
    console: Any = None,
) -> None:
    """The rows as a table, then each path on a line of its own, in full: a table cell would
    cut a long path to the terminal's width (or fold it over lines, which breaks copying it).
    ``console``: a rich ``Console`` (None: standard output)."""
    from rich.console import Console
    from rich.table import Table

    console = console if console is not None else Console()
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    for name, path in paths.items():
        # soft_wrap: no line breaks inserted and nothing cut; the terminal wraps a long line.
        console.print(f"{name}: {path}", soft_wrap=True, markup=False, highlight=False)


def report_run(run: Any, resumed_at: int, phases: Sequence[str], title: str) -> None:
    """The end of a run: a summary table, a plot of reward and validation accuracy against
    steps (from the JSONL log, so a resumed run's earlier steps count) and, when the run
    validated at its start and end, the line ``validation accuracy: BEFORE -> AFTER``.

    ``run`` has ``step``, ``config`` (logger, checkpointing), ``logger`` and ``checkpointer``.
    """
    jsonl = run.logger.log_dir / "metrics.jsonl"
    if not run.config.logger.jsonl_enabled or not jsonl.is_file():
        return
    # Only this run's steps: a log directory reused by an earlier, longer run (its
    # checkpoints deleted) keeps that run's later steps in the file.
    history = {
        key: kept
        for key, values in read_history(jsonl).items()
        if (kept := [(s, v) for s, v in values if s <= run.step])
    }
    if run.step == resumed_at:
        print(
            f"nothing to train: this run finished at step {run.step} (checkpoints in "
            f"{run.config.checkpointing.checkpoint_dir}); its results:"
        )
    paths = {"logs": str(run.logger.log_dir)}
    if history.get("train/reward_mean"):
        paths["plot"] = str(plot_curves(history, run.logger.log_dir / "curves.png", title=title))
    latest = run.checkpointer.latest() if run.config.checkpointing.enabled else None
    if latest is not None:
        paths["checkpoint (transformers)"] = str(latest / "policy")
    print_summary(summary_rows(history, phases), paths, title=title)
    accuracy = history.get("val/accuracy", [])
    if len(accuracy) >= 2 and accuracy[0][0] == 0:
        print(f"validation accuracy: {accuracy[0][1]:.3f} -> {accuracy[-1][1]:.3f}")
