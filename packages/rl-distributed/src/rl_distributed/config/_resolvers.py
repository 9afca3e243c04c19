"""Small arithmetic resolvers for training configs: ``${mul:${a},2}``, ``div``, ``max``, ``min``."""

from __future__ import annotations

import math
from typing import Any

from omegaconf import OmegaConf


def _numbers(name: str, args: tuple[Any, ...]) -> tuple[float, ...]:
    if not args:
        raise ValueError(f"${{{name}:...}} needs at least one argument")
    for arg in args:
        if isinstance(arg, bool) or not isinstance(arg, int | float):
            raise TypeError(f"${{{name}:...}} takes numbers, got {arg!r}")
    return args


def _mul(*args: float) -> float:
    return math.prod(_numbers("mul", args))


def _div(a: float, b: float) -> float:
    """True division, but an int when both sides are ints and it divides exactly."""
    _numbers("div", (a, b))
    if isinstance(a, int) and isinstance(b, int) and b != 0 and a % b == 0:
        return a // b
    return a / b


def _max(*args: float) -> float:
    return max(_numbers("max", args))


def _min(*args: float) -> float:
    return min(_numbers("min", args))


def register_resolvers() -> None:
    """Register ``mul``, ``div``, ``max`` and ``min`` with OmegaConf (idempotent).

    ``${mul:${policy.micro_batch_size},2}``; ``div`` gives an int when ints divide exactly, so
    ``${div:${global_batch},${num_gpus}}`` can feed an ``int`` field (and fails validation if it
    does not divide).
    """
    for name, fn in {"mul": _mul, "div": _div, "max": _max, "min": _min}.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


register_resolvers()
