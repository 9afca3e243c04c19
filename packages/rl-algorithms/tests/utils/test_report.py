import json

import pytest

from rl_algorithms.utils.report import plot_curves, print_summary, read_history, summary_rows


def write_log(path, records, tail=""):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.write(tail)


def test_history_keeps_a_redone_steps_last_value_and_skips_a_cut_off_line(tmp_path):
    log = tmp_path / "metrics.jsonl"
    records = [
        {"step": 0, "val/accuracy": 0.25},
        {"step": 1, "train/reward_mean": 0.1, "train/timing/train": 2.0, "note": "text"},
        {"step": 2, "train/reward_mean": 0.3, "train/timing/train": 4.0},
        {"step": 2, "train/reward_mean": 0.4, "train/timing/train": 3.0},  # resumed, redone
        {"step": 2, "val/accuracy": 0.5},
    ]
    write_log(log, records, tail='{"step": 3, "train/rew')  # killed mid-line
    history = read_history(log)
    assert history["train/reward_mean"] == [(1, 0.1), (2, 0.4)]
    assert history["val/accuracy"] == [(0, 0.25), (2, 0.5)]
    assert "note" not in history


def test_a_corrupt_line_in_the_middle_is_an_error_naming_it(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1, "a": 1}\nnot json\n{"step": 2, "a": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_history(log)


def test_summary_rows_from_a_known_history():
    history = {
        "train/reward_mean": [(1, 0.0), (2, 0.2), (3, 0.4), (4, 0.6), (5, 0.8), (6, 1.0)],
        "train/timing/generation": [(s, 1.0) for s in range(1, 7)],
        "train/timing/train": [(s, 3.0) for s in range(1, 7)],
        "train/completion_tokens": [(s, 100.0) for s in range(1, 7)],
        "val/accuracy": [(0, 0.2), (6, 0.7)],
    }
    rows = dict(summary_rows(history, ["generation", "train"]))
    assert rows["steps"] == "6"
    assert rows["seconds per step (mean)"] == "4.0"
    assert rows["completion tokens / s (whole step)"] == "25.0"  # 600 tokens / 24 s
    assert rows["completion tokens / s (generation)"] == "100.0"  # 600 tokens / 6 s
    assert rows["train reward (mean of first/last 2 steps)"] == "0.100 -> 0.900"
    assert rows["validation accuracy (step 0 -> 6)"] == "0.200 -> 0.700"


def test_plot_writes_a_png_with_the_panels_there_are(tmp_path):
    history = {"train/reward_mean": [(1, 0.1), (2, 0.3)], "val/accuracy": [(0, 0.2), (2, 0.4)]}
    out = plot_curves(history, tmp_path / "plots" / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    two = Image.open(out).size
    one = Image.open(plot_curves({"train/reward_mean": [(1, 0.1)]}, tmp_path / "one.png")).size
    assert two[0] > one[0]  # two panels side by side
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_curves({}, tmp_path / "none.png")


def test_the_summary_prints_a_long_path_in_full_on_a_narrow_console():
    import io

    from rich.console import Console

    path = "/scratch/" + "/".join(f"a-rather-long-directory-name-{i}" for i in range(6)) + "/logs"
    out = io.StringIO()
    console = Console(file=out, width=40, force_terminal=False)
    print_summary([("steps", "3")], {"logs": path}, title="GRPO run", console=console)
    lines = out.getvalue().splitlines()
    assert f"logs: {path}" in lines, out.getvalue()  # one line, neither cut nor folded
    assert any("steps" in line for line in lines)
