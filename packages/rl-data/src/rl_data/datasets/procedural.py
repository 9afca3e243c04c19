"""Procedurally generated tasks with verifiable answers: reasoning-gym's, and built-in arithmetic.

Rows are chat rows (one user turn) whose ``extra_env_info`` keeps the ground truth, so the
environment can score a generated answer without seeing the data source.
"""

from __future__ import annotations

import difflib
import operator
import random
import string
import warnings
from typing import Any, Literal

from pydantic import Field, model_validator

from rl_data.datasets.base import RowDataset
from rl_distributed.config import ConfigModel


class ReasoningGymConfig(ConfigModel):
    """``size`` tasks of one reasoning-gym dataset (any of its task names), generated from ``seed``.

    ``extra_env_info`` holds ``ground_truth`` (the reference answer), ``reasoning_gym_task`` and
    the full ``entry`` (question, answer, metadata): what ``rl_envs``' reasoning-gym
    environment reads, and ``reasoning_gym.get_score_answer_fn(task)(answer, entry)`` scores.
    """

    source: Literal["reasoning_gym"] = "reasoning_gym"
    task: str
    size: int = Field(1000, gt=0)
    seed: int = 0
    task_config: dict[str, Any] = {}  # the task's own options (difficulty ranges...)
    task_name: str = "reasoning_gym"


def _reasoning_gym() -> Any:
    with warnings.catch_warnings():  # one of its dependencies warns on first import
        warnings.simplefilter("ignore", SyntaxWarning)
        import reasoning_gym  # imports every task module: seconds, so only when asked for
    return reasoning_gym


def reasoning_gym_task_names() -> list[str]:
    return sorted(_reasoning_gym().factory.DATASETS)


def load_reasoning_gym(cfg: ReasoningGymConfig) -> RowDataset:
    reasoning_gym = _reasoning_gym()
    names = reasoning_gym_task_names()
    if cfg.task not in names:
        close = difflib.get_close_matches(cfg.task, names, n=3)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"unknown reasoning-gym task {cfg.task!r}{hint}")
    try:
        data = reasoning_gym.create_dataset(
            cfg.task, seed=cfg.seed, size=cfg.size, **cfg.task_config
        )
    except (TypeError, ValueError, AssertionError) as e:
        raise ValueError(f"reasoning-gym task {cfg.task!r} rejected its config: {e}") from None
    source = f"reasoning_gym:{cfg.task}"
    rows = []
    for entry in data:
        rows.append(
            {
                "messages": [{"role": "user", "content": entry["question"]}],
                "extra_env_info": {
                    "ground_truth": entry["answer"],
                    "reasoning_gym_task": cfg.task,
                    "entry": entry,
                },
                "task_name": cfg.task_name,
            }
        )
    return RowDataset(rows, [(source, n) for n in range(1, len(rows) + 1)])


_OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


class ArithmeticConfig(ConfigModel):
    """``size`` questions ``a <op> b`` with integer operands in ``[min_operand, max_operand]``,
    asked in the words of ``prompt`` (``{a}``, ``{op}`` and ``{b}`` are filled in)."""

    source: Literal["arithmetic"] = "arithmetic"
    size: int = Field(1000, gt=0)
    seed: int = 0
    min_operand: int = Field(0, ge=0)
    max_operand: int = Field(100, gt=0)
    operations: list[Literal["+", "-", "*"]] = ["+", "-", "*"]
    prompt: str = "What is {a} {op} {b}? Answer with the number only."
    # No question twice, so rows held out for validation are never seen in training.
    distinct: bool = False
    task_name: str = "arithmetic"

    @model_validator(mode="after")
    def _valid(self) -> ArithmeticConfig:
        if self.min_operand > self.max_operand:
            raise ValueError(
                f"arithmetic: min_operand ({self.min_operand}) > max_operand ({self.max_operand})"
            )
        try:
            # Only the bare names: str.format would also follow "{a.__class__}" and the like.
            fields = {f for _, f, _, _ in string.Formatter().parse(self.prompt) if f is not None}
            if not fields <= {"a", "op", "b"}:
                raise KeyError(", ".join(sorted(fields - {"a", "op", "b"})))
            self.prompt.format(a=1, op="+", b=2)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"arithmetic.prompt {self.prompt!r}: only {{a}}, {{op}} and {{b}} may be "
                f"filled in ({e!r})"
            ) from None
        if self.distinct:
            count = (self.max_operand - self.min_operand + 1) ** 2 * len(set(self.operations))
            if self.size > count:
                raise ValueError(
                    f"arithmetic: size {self.size} > the {count} distinct questions there are"
                )
        return self


def load_arithmetic(cfg: ArithmeticConfig) -> RowDataset:
    if not cfg.operations:
        raise ValueError("arithmetic needs at least one operation")
    rng = random.Random(cfg.seed)  # its own generator: the global one is nobody's to reseed
    rows, seen = [], set()
    while len(rows) < cfg.size:
        a = rng.randint(cfg.min_operand, cfg.max_operand)
        b = rng.randint(cfg.min_operand, cfg.max_operand)
        op = rng.choice(cfg.operations)
        if cfg.distinct:
            if (a, op, b) in seen:
                continue
            seen.add((a, op, b))
        question = cfg.prompt.format(a=a, op=op, b=b)
        rows.append(
            {
                "messages": [{"role": "user", "content": question}],
                "extra_env_info": {"ground_truth": str(_OPERATIONS[op](a, b))},
                "task_name": cfg.task_name,
            }
        )
    return RowDataset(rows, [("arithmetic", n) for n in range(1, cfg.size + 1)])
