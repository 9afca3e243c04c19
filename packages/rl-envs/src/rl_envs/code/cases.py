"""Test cases of a coding task, and the trusted comparison of a program's outputs with them.

Two kinds, both of which the program answers with *outputs* only:

* :class:`StdioCase`: the program runs with ``stdin`` on its standard input; its standard
  output must equal ``stdout`` (line by line, trailing whitespace ignored).
* :class:`CallCase`: ``function(*args, **kwargs)`` is called; its return value, written out as
  JSON, must equal ``expected`` *type-strictly*: ``1``, ``1.0``, ``True`` and ``"1"`` all differ;
  floats compare with a small tolerance; lists and dicts compare element by element.

The expected outputs stay in the verifier process: they never enter the sandbox. That is what
makes the reward hard to game: a program cannot read, patch or fake its way past a comparison
that happens where it cannot reach.

Assert-style tests (``assert f(2) == 4``) would run inside the program's own interpreter,
where the program can redefine ``==``, ``exec`` or ``AssertionError``: they are gameable and
not run. :func:`call_cases_from_asserts` turns the common ``assert f(...) == <literal>`` form
into :class:`CallCase` instead.
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from pydantic import TypeAdapter, field_validator

from rl_distributed.config import ConfigModel

FLOAT_REL_TOL = 1e-6
FLOAT_ABS_TOL = 1e-9


def _json_value(value: Any) -> Any:
    """``value`` as it comes back from JSON (tuples become lists); refuses what JSON cannot hold."""
    try:
        return json.loads(json.dumps(value, allow_nan=True))
    except (TypeError, ValueError) as e:
        raise ValueError(f"not a JSON value: {value!r} ({e})") from None


class StdioCase(ConfigModel):
    stdin: str = ""
    stdout: str


class CallCase(ConfigModel):
    function: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    expected: Any

    @field_validator("function")
    @classmethod
    def _identifier(cls, name: str) -> str:
        if not name.isidentifier():
            raise ValueError(f"function must be a Python name, got {name!r}")
        return name

    @field_validator("args", "kwargs", "expected")
    @classmethod
    def _json(cls, value: Any) -> Any:
        return _json_value(value)


TestCase = StdioCase | CallCase
_CASES = TypeAdapter(list[StdioCase | CallCase])


def parse_cases(tests: Any) -> list[TestCase]:
    """A sample's ``tests``: a non-empty list of stdio or function-call cases (dicts), or that
    list as a JSON string. A Parquet column of mixed cases gives every row every key, the
    other kind's as None: those are dropped."""
    if isinstance(tests, str) and tests.lstrip().startswith("["):
        tests = json.loads(tests)
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"'tests' must be a non-empty list of test cases, got {tests!r:.200}")
    if any(isinstance(t, str) for t in tests):
        raise ValueError(
            "'tests' holds strings (assert-style tests?): these run inside the program's own "
            "interpreter and can be gamed; give {'stdin', 'stdout'} or {'function', 'args', "
            "'expected'} cases (rl_envs.code.cases.call_cases_from_asserts converts "
            "'assert f(...) == value')"
        )
    return _CASES.validate_python([_one_kind(t) for t in tests])


def _one_kind(case: Any) -> Any:
    """Drops the other kind's keys where they are None (``expected: None`` is a real value)."""
    if not isinstance(case, dict):
        return case
    other = ("function", "args", "kwargs", "expected")
    if case.get("function") is not None:
        other = ("stdin", "stdout")
    return {k: v for k, v in case.items() if not (k in other and v is None)}


def sandbox_job(case: TestCase) -> dict[str, Any]:
    """What the sandbox gets of a case: its inputs, never its expected output."""
    if isinstance(case, StdioCase):
        return {"stdin": case.stdin}
    return {"function": case.function, "args": case.args, "kwargs": case.kwargs}


def same_json_value(got: Any, expected: Any) -> bool:
    """Type-strict equality of two JSON values (bool is not int, int is not float)."""
    if type(got) is not type(expected):
        return False
    if isinstance(got, float):
        if math.isnan(expected):
            return math.isnan(got)
        return math.isclose(got, expected, rel_tol=FLOAT_REL_TOL, abs_tol=FLOAT_ABS_TOL)
    if isinstance(got, list):
        return len(got) == len(expected) and all(map(same_json_value, got, expected))
    if isinstance(got, dict):
        return got.keys() == expected.keys() and all(
            same_json_value(got[k], expected[k]) for k in got
        )
    return got == expected


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def case_passed(case: TestCase, record: dict[str, Any] | None) -> bool:
    """Whether the program's output for ``case`` (its record from the sandbox) is right."""
    if record is None or record.get("error") is not None:
        return False
    if isinstance(case, StdioCase):
        stdout = record.get("stdout")
        return (
            isinstance(stdout, str)
            and record.get("exit_code") == 0
            and (_lines(stdout) == _lines(case.stdout))
        )
    return "value" in record and same_json_value(record["value"], case.expected)


def call_cases_from_asserts(tests: list[str]) -> list[CallCase]:
    """``["assert add(1, 2) == 3", ...]`` -> function-call cases, parsed (never run) here.

    Only ``assert NAME(literal args) == literal`` (either side) is understood; anything else is
    a ``ValueError`` naming the test.
    """
    cases = []
    for test in tests:
        try:
            node = ast.parse(test.strip()).body
            if len(node) != 1 or not isinstance(node[0], ast.Assert):
                raise ValueError("not a single assert statement")
            compare = node[0].test
            if not (
                isinstance(compare, ast.Compare)
                and len(compare.ops) == 1
                and isinstance(compare.ops[0], ast.Eq)
            ):
                raise ValueError("not of the form 'assert f(...) == value'")
            call, value = compare.left, compare.comparators[0]
            if isinstance(value, ast.Call) and not isinstance(call, ast.Call):
                call, value = value, call
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
                raise ValueError("one side must be a call of a plain function name")
            if any(isinstance(a, ast.Starred) for a in call.args) or any(
                k.arg is None for k in call.keywords
            ):
                raise ValueError("*args and **kwargs are not supported")
            cases.append(
                CallCase(
                    function=call.func.id,
                    args=[ast.literal_eval(a) for a in call.args],
                    kwargs={k.arg: ast.literal_eval(k.value) for k in call.keywords},
                    expected=ast.literal_eval(value),
                )
            )
        except (SyntaxError, ValueError, TypeError) as e:
            raise ValueError(f"cannot turn {test!r} into a function-call case: {e}") from None
    return cases
