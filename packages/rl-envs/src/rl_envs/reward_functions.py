"""Reward functions as TRL users write them, and how several combine into one reward.

A reward function is called as TRL's ``GRPOTrainer`` calls the functions in ``reward_funcs``::

    fn(prompts=[...], completions=[...], completion_ids=[...], **columns) -> list[float | None]

with one entry per completion, in the format of the dataset's prompts, as TRL does:

- a prompt that is a string in the dataset (TRL's *standard* format: a ``prompt`` column of
  strings, or the config's ``prompt_key``): ``prompts[i]`` is that string and ``completions[i]``
  the answer's text;
- a prompt that is a conversation (*conversational* format: ``prompt`` or ``messages`` holding
  messages): ``prompts[i]`` is the conversation before the answer (``{"role", "content"}``
  messages) and ``completions[i]`` is ``[{"role": "assistant", "content": text}]``.

``completion_ids[i]`` (the answer's token ids) is passed to functions that take it or
``**kwargs``, and every column of the row's ``extra_env_info`` (``ground_truth``, say) as a
keyword argument holding one value per completion. ``None`` means "this function has no opinion
on this completion".

A function is named ``"package.module:function"``, ``"path/to/file.py:function"`` or a built-in
name (:data:`BUILTIN_REWARD_FUNCTIONS`), or given as a Python callable (see
:func:`reference_for`). This module is what verifier processes import (see :mod:`rl_envs.pool`),
so it stays free of torch and Ray.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Built-in reward functions, by the name a config may use instead of an import path.
BUILTIN_REWARD_FUNCTIONS = {
    "math": "rl_envs.reward_functions:math_reward",
    "answer_exact": "rl_envs.tag_rewards:answer_exact",
    "answer_is_integer": "rl_envs.tag_rewards:answer_is_integer",
    "think_answer_format": "rl_envs.tag_rewards:think_answer_format",
}

#: Heavy modules a built-in function imports (by its import path), preloaded by the verifier
#: processes so that the first sample does not pay for them under its timeout.
BUILTIN_PRELOAD = {"rl_envs.reward_functions:math_reward": ("math_verify",)}

#: The arguments every call gets; any other argument without a default is a dataset column.
CALL_ARGUMENTS = ("prompts", "completions")
#: Arguments passed only to a function that names them or takes ``**kwargs`` (as TRL passes
#: them), so that a function written for ``prompts`` and ``completions`` alone still works.
OPTIONAL_ARGUMENTS = ("completion_ids",)

#: How a callable that cannot be imported by name travels to the verifier processes.
PICKLED_PREFIX = "pickled:"


def math_reward(
    prompts: Sequence[Any], completions: Sequence[Any], ground_truth: Sequence[str], **columns: Any
) -> list[float]:
    """The math environment's reward as a reward function: 1.0 when the completion's final
    answer equals ``ground_truth`` mathematically (math-verify; an answer to a number must be
    written as one: ``score_math``), else 0.0."""
    from rl_envs.verifiers import score_math

    return [
        score_math(completion_text(c), truth)[0]
        for c, truth in zip(completions, ground_truth, strict=True)
    ]


def completion_text(completion: Any) -> str:
    """The text of a completion in TRL's conversational form (or a plain string)."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"]


def reference_for(function: Callable[..., Any]) -> str:
    """A reference naming a Python callable (given from the Python API rather than as a
    string): ``"package.module:function"`` when the function can be imported by that name, else
    the function itself, pickled by value (cloudpickle), so that a function defined in a script
    or a notebook reaches the verifier processes too."""
    if not callable(function):
        raise ValueError(f"{function!r} is not callable")
    module = getattr(function, "__module__", None)
    qualname = getattr(function, "__qualname__", "")
    if module and module != "__main__" and "<" not in qualname and "." not in qualname:
        try:
            if getattr(importlib.import_module(module), qualname, None) is function:
                return f"{module}:{qualname}"
        except Exception:  # not importable where we are: pickle it instead
            pass
    import cloudpickle

    data = cloudpickle.dumps(function, protocol=pickle.HIGHEST_PROTOCOL)
    return PICKLED_PREFIX + base64.urlsafe_b64encode(data).decode("ascii")


def describe_reference(ref: str) -> str:
    """A reference as messages show it (a pickled function by its name, not its bytes)."""
    if ref.startswith(PICKLED_PREFIX):
        name = getattr(load_reward_function(ref), "__qualname__", "function")
        return f"<pickled Python function {name}>"
    return ref


def is_file_reference(ref: str) -> bool:
    """``"dir/file.py:fn"`` names a file; ``"package.module:fn"`` a module."""
    location = ref.rpartition(":")[0]
    return location.endswith(".py") or "/" in location or "\\" in location


def resolve_reference(ref: str) -> str:
    """The reference a worker can load from anywhere: a built-in name becomes its import path and
    a file path becomes absolute (Ray workers need not share the driver's working directory)."""
    if ref.startswith(PICKLED_PREFIX):
        return ref
    ref = BUILTIN_REWARD_FUNCTIONS.get(ref, ref)
    if ":" not in ref:
        raise ValueError(
            f"{ref!r} is neither a built-in reward function ({sorted(BUILTIN_REWARD_FUNCTIONS)}) "
            "nor 'package.module:function' nor 'path/to/file.py:function'"
        )
    location, _, name = ref.rpartition(":")
    if is_file_reference(ref):
        return f"{Path(location).expanduser().resolve()}:{name}"
    return ref


@functools.cache
def load_reward_function(ref: str) -> Callable[..., Any]:
    """The function a reference names (see :func:`resolve_reference`), imported once per
    process; a ``ValueError`` saying what is wrong when it cannot be."""
    ref = resolve_reference(ref)
    if ref.startswith(PICKLED_PREFIX):
        try:
            return pickle.loads(base64.urlsafe_b64decode(ref[len(PICKLED_PREFIX) :]))
        except Exception as e:
            raise ValueError(f"a pickled reward function could not be loaded: {e!r}") from e
    location, _, name = ref.rpartition(":")
    if is_file_reference(ref):
        path = Path(location)
        if not path.is_file():
            raise ValueError(f"{ref!r}: no such file {str(path)!r}")
        # A module name of its own per file, so that two files called rewards.py do not clash.
        digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
        module_name = f"rl_user_rewards_{path.stem}_{digest}"
        if module_name in sys.modules:
            module = sys.modules[module_name]
        else:
            spec = importlib.util.spec_from_file_location(module_name, path)
            if spec is None or spec.loader is None:
                raise ValueError(f"{ref!r}: {str(path)!r} cannot be loaded as a Python file")
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except Exception as e:
                raise ValueError(f"{ref!r}: importing {str(path)!r} failed: {e!r}") from e
            sys.modules[module_name] = module
    else:
        try:
            module = importlib.import_module(location)
        except Exception as e:
            raise ValueError(f"{ref!r}: cannot import module {location!r}: {e!r}") from e
    function = getattr(module, name, None)
    if function is None:
        raise ValueError(f"{ref!r}: {location!r} has no {name!r}")
    if not callable(function):
        raise ValueError(f"{ref!r}: {name!r} is a {type(function).__name__}, not a function")
    return function


def required_columns(function: Callable[..., Any]) -> tuple[str, ...]:
    """The dataset columns a function cannot do without: its arguments without a default, other
    than ``prompts`` and ``completions``."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: it says nothing
        return ()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(
        p.name
        for p in parameters
        if p.kind in named
        and p.default is p.empty
        and p.name not in CALL_ARGUMENTS + OPTIONAL_ARGUMENTS
    )


@functools.cache
def _takes(function: Callable[..., Any], argument: str) -> bool:
    """Whether ``function`` accepts ``argument`` by keyword (by name or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == argument and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
        for p in parameters
    )


def call_reward_function(
    ref: str,
    prompt: str | list[dict],
    completion: str,
    columns: dict,
    completion_ids: list[int] | None = None,
) -> Any:
    """One completion's call (what a verifier process runs, under the per-sample timeout), as
    TRL makes it: ``fn(prompts=[prompt], completions=[completion], **{column: [value]})``. See
    :func:`call_reward_function_on_batch`, which it is for a batch of one."""
    ids = None if completion_ids is None else [completion_ids]
    return call_reward_function_on_batch(ref, [prompt], [completion], [columns], ids)


def call_reward_function_on_batch(
    ref: str,
    prompts: list[str | list[dict]],
    completions: list[str],
    columns: list[dict],
    completion_ids: list[list[int] | None] | None = None,
) -> Any:
    """One call for a batch of completions, as TRL makes it: ``fn(prompts=[...],
    completions=[...], **{column: [value per completion]})``, each completion a string when its
    prompt is one (TRL's standard format) and ``[{"role": "assistant", "content": text}]`` when
    its prompt is a conversation. A column some rows lack is ``None`` in theirs.
    ``completion_ids`` goes to a function that takes it. An ``async def`` function is run to
    its end here (in an event loop of its own), so that it may await many requests at once.
    The result is returned as it is: :func:`check_value` judges each completion's value."""
    function = load_reward_function(ref)
    answers: list[Any] = [
        c if isinstance(p, str) else [{"role": "assistant", "content": c}]
        for p, c in zip(prompts, completions, strict=True)
    ]
    names = dict.fromkeys(key for row in columns for key in row)
    kwargs: dict[str, Any] = {key: [row.get(key) for row in columns] for key in names}
    has_ids = completion_ids is not None and all(i is not None for i in completion_ids)
    if has_ids and _takes(function, "completion_ids"):
        kwargs["completion_ids"] = completion_ids
    result = function(prompts=list(prompts), completions=answers, **kwargs)
    if inspect.isawaitable(result):
        result = asyncio.run(_awaited(result))
    return result


async def _awaited(awaitable: Any) -> Any:
    """``awaitable``'s result (``asyncio.run`` takes coroutines only, not any awaitable)."""
    return await awaitable


def check_value(result: Any) -> float | None:
    """The one reward in a single completion's result, or a ``TypeError`` saying what the result
    was instead. NaN counts as ``None`` (TRL turns ``None`` into NaN)."""
    if isinstance(result, (str, bytes, Mapping)) or not isinstance(result, Sequence):
        raise TypeError(
            f"returned a {type(result).__name__} ({result!r:.80}); expected a list with one "
            "float or None per completion"
        )
    if len(result) != 1:
        raise TypeError(
            f"returned {len(result)} values for 1 completion ({result!r:.80}); expected one "
            "float or None per completion"
        )
    (value,) = result
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"returned {value!r:.80} ({type(value).__name__}) for a completion; expected a "
            "float or None"
        )
    value = float(value)
    if math.isnan(value):
        return None
    if math.isinf(value):
        raise TypeError(f"returned {value} for a completion; a reward must be finite")
    return value


def combine(values: Sequence[Sequence[float | None]], weights: Sequence[float]) -> list[float]:
    """Per completion, the weighted sum of the functions' rewards (``values[f][i]``: function
    ``f`` on completion ``i``). A ``None`` is left out of the sum, as TRL leaves out NaN, so a
    completion every function passed on gets 0.0."""
    if len(values) != len(weights):
        raise ValueError(f"{len(values)} functions' values but {len(weights)} weights")
    n = len(values[0]) if values else 0
    return [
        sum(w * v[i] for v, w in zip(values, weights, strict=True) if v[i] is not None)
        for i in range(n)
    ]


@dataclass
class ValueStats:
    """One function's values since they were last taken, as running sums: constant memory
    however rarely a loop takes the metrics (async GRPO takes them once per trained step,
    after many groups were scored)."""

    count: int = 0
    scored: int = 0
    total: float = 0.0
    total_sq: float = 0.0
    low: float = math.inf
    high: float = -math.inf

    def add(self, values: Sequence[float | None]) -> None:
        for v in values:
            self.count += 1
            if v is not None:
                self.scored += 1
                self.total += v
                self.total_sq += v * v
                self.low = min(self.low, v)
                self.high = max(self.high, v)

    def constant(self) -> bool | None:
        """Whether these values say nothing to learn from: every one ``None``, or every one the
        same number; ``None`` when there are no values."""
        if not self.count:
            return None
        return self.scored == 0 or (self.scored == self.count and self.low == self.high)

    def take(self) -> dict[str, float]:
        """``mean`` and ``std`` (population) of the values that were not ``None``, and
        ``none_fraction``; ``mean`` and ``std`` are left out when every value was ``None``.
        Then start again from nothing."""
        out: dict[str, float] = {}
        if self.count:
            out["none_fraction"] = 1.0 - self.scored / self.count
        if self.scored:
            mean = self.total / self.scored
            out["mean"] = mean
            out["std"] = math.sqrt(max(0.0, self.total_sq / self.scored - mean * mean))
        self.count = self.scored = 0
        self.total = self.total_sq = 0.0
        self.low, self.high = math.inf, -math.inf
        return out
