"""Test cases of a coding task, and the trusted comparison of a program's outputs with them.

Two kinds, both of which the program answers with *outputs* only. The comparison rules:

* :class:`StdioCase`: the program runs with ``stdin`` on its standard input and must exit with
  status 0; its standard output must equal ``stdout`` line by line. Lines end at ``"\n"``
  only; spaces, tabs and carriage returns at the end of a line, and empty lines at the end of
  the output, are ignored. Nothing else is: other Unicode line or paragraph separators
  (``\u2028``, ``\x85``, ``\x0b``...), control characters and non-ASCII spaces are text that
  must match exactly. Numbers in the output are compared as text.
* :class:`CallCase`: ``function(*args, **kwargs)`` is called; its return value, written out as
  JSON, must equal ``expected`` *type-strictly*: ``1``, ``1.0``, ``True`` and ``"1"`` all differ;
  lists and dicts compare element by element. A float may differ from the expected one by
  ``FLOAT_REL_TOL`` of the expected value's magnitude (relative only: ``8e-10`` is not
  ``1e-10``); an expected ``0.0``, which has no scale, accepts ``|x| <= FLOAT_ZERO_TOL``; an
  expected NaN accepts NaN only; infinities must match exactly.

Stated limits hold whatever the output: a case whose program ran past ``case_time_s`` or
whose output is over ``max_output_bytes`` (stdout's bytes; the return value's JSON text) fails.
A report that holds more values, or nests deeper, than a right answer to any of the run's
cases could is not even parsed (:class:`ReportShape`): the verifier's memory is bounded by
the expected values, not by what a program writes.

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
import re
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, field_validator

from rl_distributed.config import ConfigModel

FLOAT_REL_TOL = 1e-6
FLOAT_ZERO_TOL = 1e-12


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


def same_float(got: float, expected: float) -> bool:
    """Equal within a tolerance relative to the expected value's magnitude (module docstring)."""
    if math.isnan(expected):
        return math.isnan(got)
    if got == expected:
        return True
    if math.isinf(expected) or math.isinf(got):  # a tolerance of an infinity admits anything
        return False
    if expected == 0.0:
        return abs(got) <= FLOAT_ZERO_TOL
    return abs(got - expected) <= FLOAT_REL_TOL * abs(expected)


def same_json_value(got: Any, expected: Any) -> bool:
    """Type-strict equality of two JSON values (bool is not int, int is not float)."""
    if type(got) is not type(expected):
        return False
    if isinstance(got, float):
        return same_float(got, expected)
    if isinstance(got, list):
        return len(got) == len(expected) and all(map(same_json_value, got, expected))
    if isinstance(got, dict):
        return got.keys() == expected.keys() and all(
            same_json_value(got[k], expected[k]) for k in got
        )
    return got == expected


def _lines(text: str) -> list[str]:
    lines = [line.rstrip(" \t\r") for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def case_passed(case: TestCase, record: dict[str, Any] | None, max_output_bytes: int) -> bool:
    """Whether the program's output for ``case`` (its record from the sandbox) is right and
    within ``max_output_bytes``."""
    if record is None or record.get("error") is not None:
        return False
    if isinstance(case, StdioCase):
        stdout = record.get("stdout")
        return (
            isinstance(stdout, str)
            and len(stdout.encode(errors="replace")) <= max_output_bytes
            and record.get("exit_code") == 0
            and (_lines(stdout) == _lines(case.stdout))
        )
    return (
        "value" in record
        and len(json.dumps(record["value"]).encode()) <= max_output_bytes
        and same_json_value(record["value"], case.expected)
    )


def _shape(value: Any) -> tuple[int, int]:
    """How many values ``value`` holds (itself included) and how deep its containers nest."""
    if isinstance(value, dict):
        value = list(value.values())
    if not isinstance(value, list):
        return 1, 0
    shapes = [_shape(v) for v in value]
    return 1 + sum(n for n, _ in shapes), 1 + max((d for _, d in shapes), default=0)


# A JSON string, taken whole (possessive: no backtracking over megabytes), and the brackets.
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"')
_BRACKETS = re.compile(rb"[][{}]")


@dataclass(frozen=True)
class ReportShape:
    """The most values and nesting a sandbox report line may have and still carry a right
    answer to one of a run's cases, checked on the raw text before it is parsed.

    Counted without parsing: ``[``, ``{`` and ``,`` outside strings, plus one, is at least the
    number of values a JSON text holds and at most twice it; a record wraps its value in one
    object of a few fields. So a right answer's line never counts more than twice its
    expected value's values, plus a few.
    """

    max_values: int
    max_depth: int

    @classmethod
    def for_cases(cls, cases: list[TestCase]) -> ReportShape:
        max_values, max_depth = 8, 1  # a stdio or error record: one flat object
        for case in cases:
            if isinstance(case, CallCase):
                values, depth = _shape(case.expected)
                max_values = max(max_values, 2 * values + 8)
                max_depth = max(max_depth, depth + 1)
        return cls(max_values, max_depth)

    def admits(self, line: bytes) -> bool:
        text = _JSON_STRING.sub(b'""', line)
        if text.count(b"[") + text.count(b"{") + text.count(b",") + 1 > self.max_values:
            return False
        depth = 0
        for bracket in _BRACKETS.findall(text):  # at most max_values of them, by now
            depth += 1 if bracket in b"[{" else -1
            if depth > self.max_depth:
                return False
        return True


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
