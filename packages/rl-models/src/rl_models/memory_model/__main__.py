"""``python -m rl_models.memory_model NAME``: a model's memory per GPU as a table, or with
``--doc`` the tables of docs/guides/memory.md."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, fields

from rich.console import Console
from rich.table import Table

from rl_models.memory_model import GPU_BYTES, HEADROOM, OVERHEAD, Plan, Shape, breakdown, gib
from rl_models.memory_model.plans import SHAPES, doc_tables


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rl_models.memory_model",
        description="Memory per GPU of training a model (Llama, Qwen2, Qwen3, Qwen3-MoE).",
    )
    parser.add_argument(
        "model",
        help="a Hugging Face config.json path, or Llama-3.1-8B, Qwen2.5-32B, Llama-3.1-70B, Qwen3-30B-A3B",
    )
    parser.add_argument("--doc", action="store_true", help="print docs/guides/memory.md's tables")
    for f in fields(Plan):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            parser.add_argument(
                flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=f.default
            )
        elif f.name == "backend":
            parser.add_argument(flag, choices=["dtensor", "megatron"], default=f.default)
        else:
            parser.add_argument(flag, type=int, default=f.default, help=f"(default {f.default})")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.doc:
        print(doc_tables())
        return
    if args.model in SHAPES:
        config = SHAPES[args.model]
    else:
        with open(args.model) as f:
            config = json.load(f)
    shape = Shape.from_config(config)
    plan = Plan(**{f.name: getattr(args, f.name) for f in fields(Plan)})
    b = breakdown(shape, plan)
    table = Table(title=f"{args.model}: {shape.total_params / 1e9:.2f}B parameters, dp={plan.dp}")
    table.add_column("part")
    table.add_column("GiB per GPU", justify="right")
    for part, value in asdict(b).items():
        if part != "offload_optimizer":
            table.add_row(part.replace("_", " "), gib(value))
    table.add_row("overhead (each process)", gib(OVERHEAD))
    table.add_row("training peak", gib(b.training), style="bold")
    table.add_row("generation peak", gib(b.generation), style="bold")
    verdict = "fits" if b.fits() else "does not fit"
    table.caption = f"{verdict} in {1 - HEADROOM:.0%} of {GPU_BYTES / 1e9:.0f} GB"
    Console().print(table)


if __name__ == "__main__":
    main()
