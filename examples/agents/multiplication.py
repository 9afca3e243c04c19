"""The calculator agent's data: multiplications of a three-digit number by a two- or
three-digit one, which SmolLM2-135M cannot do in its head and can do with the `calculator`.

- `train.jsonl` / `validation.jsonl`: questions for GRPO, each with its `answer` and the
  `tools` it is offered (the calculator's OpenAI schema, so the `chatml_tools` template shows
  the model the tool, and the tool environment lets it call it);
- `train_no_tools.jsonl` / `validation_no_tools.jsonl`: the same questions without `tools`,
  for the baseline that must answer directly;
- `sft.jsonl`: tool-use traces for the warm-up, each a question, the assistant's call of the
  calculator, the tool's reply and the assistant's final answer (OpenAI's message format:
  `tool_calls`, `role: tool`).

The three sets of questions never share one: validation measures questions never trained on.

    python examples/agents/multiplication.py results/agents/data
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

from rl_envs.tools.registry import ToolSpec, tool_schema

PROMPT = "What is {a} * {b}? Answer with just the number."
# The schema the tool environment derives from the built-in calculator's signature and
# docstring: what the model is shown is what the environment checks its calls against.
CALCULATOR = tool_schema(ToolSpec(function="calculator"))
SIZES = {"sft": 512, "train": 1024, "validation": 32}
DATA_SEED = 0  # the questions stay the same whatever the training seed, so runs compare


def questions(count: int, rng: random.Random, taken: set[tuple[int, int]]) -> list[tuple[int, int]]:
    """``count`` new questions (a, b): a of three digits, b of two or three; each is added to
    ``taken``, so no question is drawn twice across calls."""
    out = []
    while len(out) < count:
        a, b = rng.randint(100, 999), rng.randint(10, 999)
        if (a, b) not in taken:
            taken.add((a, b))
            out.append((a, b))
    return out


def question_row(a: int, b: int, tools: bool = True) -> dict[str, Any]:
    """A GRPO row: the question, its answer and (with ``tools``) the calculator on offer."""
    row: dict[str, Any] = {"prompt": PROMPT.format(a=a, b=b), "answer": str(a * b)}
    if tools:
        row["tools"] = [CALCULATOR]
    return row


def tool_trace(a: int, b: int) -> dict[str, Any]:
    """An SFT row: the question answered with one calculator call, as a model should do it."""
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}},
    }
    messages = [
        {"role": "user", "content": PROMPT.format(a=a, b=b)},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": str(a * b)},
        {"role": "assistant", "content": str(a * b)},
    ]
    return {"messages": messages, "tools": [CALCULATOR]}


def write_data(out_dir: str | Path, sizes: dict[str, int] = SIZES) -> dict[str, Path]:
    """Write the five files into ``out_dir``; returns their paths by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng, taken = random.Random(DATA_SEED), set()
    drawn = {name: questions(n, rng, taken) for name, n in sizes.items()}
    files = {
        "sft": [tool_trace(a, b) for a, b in drawn["sft"]],
        "train": [question_row(a, b) for a, b in drawn["train"]],
        "validation": [question_row(a, b) for a, b in drawn["validation"]],
        "train_no_tools": [question_row(a, b, tools=False) for a, b in drawn["train"]],
        "validation_no_tools": [question_row(a, b, tools=False) for a, b in drawn["validation"]],
    }
    paths = {}
    for name, rows in files.items():
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return paths


if __name__ == "__main__":
    for name, path in write_data(
        sys.argv[1] if len(sys.argv) > 1 else "results/agents/data"
    ).items():
        print(f"{name}: {path}")
