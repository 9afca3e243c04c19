"""The calculator agent, in one command: SmolLM2-135M-Instruct learns to multiply three-digit
numbers by calling a `calculator` tool, on a CPU.

    uv run python examples/agents/calculator.py              # from the repository's root
    uv run python examples/agents/calculator.py --seed 1 --baseline

What it runs, each phase an `rl` command that can also be typed by hand (the recipes are the
YAML files beside this one):

1. the data (multiplication.py), into results/agents/data;
2. `rl eval`: the model as shipped, offered the calculator, on the validation questions
   (greedy, multi-turn with the tool environment): accuracy before training;
3. `rl sft`: the warm-up on tool-use traces (sft.yaml): the model as shipped never calls a
   tool, so GRPO alone would never see a reward for calling one;
4. `rl grpo`: GRPO over tool-calling episodes from the warm-up's checkpoint
   (grpo_calculator.yaml), validating with the tool before its first step and after its last;
5. with --baseline, `rl grpo` without the tool (grpo_no_tools.yaml): the model as shipped,
   the same questions, reward and GRPO budget, answering directly.

Then it prints validation accuracy at each stage and the wall time of each phase. A run's
results go to results/agents/seed_<seed>/; running the command again evaluates the model as
shipped again and resumes the training phases from their checkpoints (a finished one only
reports).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # multiplication.py, when run as a script from anywhere

from multiplication import write_data  # noqa: E402

from rl_algorithms.cli import main as rl  # noqa: E402
from rl_algorithms.utils.report import read_history  # noqa: E402

# Where the recipes are and where they read the data, from the repository's root (the recipes'
# paths start there, as the `rl` commands they show are typed there).
RECIPES = Path("examples/agents")
DATA = Path("results/agents/data")


def phase_args(recipe: str, out: Path, seed: int) -> list[str]:
    """The arguments of one phase's command: its recipe, this seed, its own output folders."""
    seed_key = {"sft.yaml": "sft.seed", "eval_calculator.yaml": "eval.seed"}.get(
        recipe, "grpo.seed"
    )
    args = ["--config", str(RECIPES / recipe), f"{seed_key}={seed}"]
    args.append(f"logger.log_dir={out / 'logs'}")
    if recipe != "eval_calculator.yaml":
        args.append(f"checkpointing.checkpoint_dir={out / 'checkpoints'}")
    return args


def run_phase(name: str, command: list[str], seconds: dict[str, float]) -> None:
    print(f"\n=== {name}: rl {' '.join(command)}", flush=True)
    start = time.perf_counter()
    code = rl(command)
    seconds[name] = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"{name} failed (exit code {code}); see its output above")


def accuracies(log_dir: Path, key: str = "val/accuracy") -> list[tuple[int, float]]:
    """(step, value) of ``key`` in a run's metrics.jsonl."""
    return read_history(log_dir / "metrics.jsonl").get(key, [])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=42, help="seeds SFT's and GRPO's sampling")
    parser.add_argument("--baseline", action="store_true", help="also run GRPO without tools")
    args = parser.parse_args(argv)
    if not RECIPES.is_dir():
        raise SystemExit("run it from the repository's root (the recipes' paths start there)")

    out = Path("results/agents") / f"seed_{args.seed}"
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    write_data(DATA)
    run_phase(
        "before", ["eval", *phase_args("eval_calculator.yaml", out / "before", args.seed)], seconds
    )
    run_phase("sft", ["sft", *phase_args("sft.yaml", out / "sft", args.seed)], seconds)
    sft_checkpoint = max(
        (out / "sft" / "checkpoints").glob("step_*"), key=lambda p: int(p.name[5:])
    )
    grpo = phase_args("grpo_calculator.yaml", out / "grpo", args.seed)
    run_phase("grpo", ["grpo", *grpo, f"policy.model.path={sft_checkpoint / 'policy'}"], seconds)
    demo_seconds = time.perf_counter() - start
    if args.baseline:
        no_tools = phase_args("grpo_no_tools.yaml", out / "no_tools", args.seed)
        run_phase("no-tool baseline", ["grpo", *no_tools], seconds)

    before = accuracies(out / "before" / "logs", "eval/sample_accuracy")[-1][1]
    grpo_val = accuracies(out / "grpo" / "logs")
    rows = [
        ("before training", before, "rl eval", seconds["before"]),
        ("after the SFT warm-up", grpo_val[0][1], "rl sft", seconds["sft"]),
        ("after GRPO", grpo_val[-1][1], "rl grpo", seconds["grpo"]),
    ]
    print(f"\nvalidation accuracy with the calculator (seed {args.seed}, greedy):")
    for label, accuracy, command, took in rows:
        print(f"  {label:<22} {accuracy:.3f}   {command:<8} {took:5.0f} s")
    print(f"  the whole demo: {demo_seconds:.0f} s")
    if args.baseline:
        base = accuracies(out / "no_tools" / "logs")
        print(
            f"without the tool (GRPO, same budget): {base[0][1]:.3f} -> {base[-1][1]:.3f}   "
            f"{seconds['no-tool baseline']:.0f} s"
        )


if __name__ == "__main__":
    main()
