"""``python -m rl_models.memory_model NAME``: a model's memory per GPU as a table, or with
``--doc`` (and no model) the tables of docs/guides/memory.md."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

from rich.console import Console
from rich.table import Table

from rl_models.memory_model import GPU_BYTES, HEADROOM, OVERHEAD, Plan, Shape, breakdown, gib
from rl_models.memory_model.plans import (
    GEN_PARTS,
    PARTS,
    SHAPES,
    doc_tables,
    phases_of,
    vllm_range,
)

# The settings that take one of a few names, and the names.
CHOICES = {"backend": ["dtensor", "megatron"], "generator": ["vllm", "hf"]}


def _boolean(text: str) -> bool:
    """``true`` or ``false`` (any case); anything else is refused, never read as false."""
    value = {"true": True, "false": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def _tokens_or_none(text: str) -> int | None:
    """A token count, or ``none`` (log-probs over the whole micro-batch, unchunked)."""
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count or none, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rl_models.memory_model",
        description="Memory per GPU of training a model (Llama, Qwen2, Qwen3, Qwen3-MoE).",
    )
    parser.add_argument(
        "model",
        nargs="?",
        help=f"a Hugging Face config.json path, or one of {', '.join(SHAPES)}",
    )
    parser.add_argument("--doc", action="store_true", help="print docs/guides/memory.md's tables")
    for f in fields(Plan):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            parser.add_argument(
                flag, type=_boolean, default=f.default, help=f"true or false (default {f.default})"
            )
        elif f.name in CHOICES:
            parser.add_argument(flag, choices=CHOICES[f.name], default=f.default)
        elif f.name == "logprob_chunk":
            parser.add_argument(
                flag, type=_tokens_or_none, default=f.default, help=f"or none (default {f.default})"
            )
        else:
            parser.add_argument(flag, type=int, default=f.default, help=f"(default {f.default})")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.doc:
        print(doc_tables())
        return
    if args.model is None:
        parser.error("a model is needed (a config.json path or a name), unless --doc is given")
    if args.model in SHAPES:
        config = SHAPES[args.model]
    else:
        try:
            with open(args.model) as f:
                config = json.load(f)
        except (OSError, ValueError) as err:
            parser.error(
                f"{args.model}: not a readable config.json, nor one of {list(SHAPES)} ({err})"
            )
    plan = Plan(**{f.name: getattr(args, f.name) for f in fields(Plan)})
    try:  # an unmodelled family or a plan the mesh refuses: one line naming it, not a traceback
        shape = Shape.from_config(config)
        b = breakdown(shape, plan)
    except ValueError as err:
        parser.error(f"{args.model}: {err}")
    mesh = f"dp={plan.dp}" + (f", cp={plan.cp}" if plan.cp > 1 else "")
    if plan.generator_gpus:
        mesh += f", generator on {plan.generator_gpus} more GPUs"
    table = Table(title=f"{args.model}: {shape.total_params / 1e9:.2f}B parameters, {mesh}")
    table.add_column("part")
    table.add_column("GiB per GPU", justify="right")
    for part in PARTS + GEN_PARTS:
        table.add_row(part.replace("_", " "), gib(getattr(b, part)))
    table.add_row("overhead (each process)", gib(OVERHEAD))
    for phase in phases_of(b):
        table.add_row(f"{phase} peak", gib(getattr(b, phase)), style="bold")
    if vllm := vllm_range(b, plan):
        table.add_row("vLLM gpu_memory_utilization", vllm)
    verdict = "fits" if b.fits() else "does not fit"
    table.caption = f"{verdict} in {1 - HEADROOM:.0%} of {GPU_BYTES / 1e9:.0f} GB"
    Console().print(table)


if __name__ == "__main__":
    main()
