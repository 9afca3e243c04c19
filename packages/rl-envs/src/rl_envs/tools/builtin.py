"""The built-in tools: ``calculator``, ``python`` and ``search``.

They run where every tool runs, in a verifier process under the call's timeout
(:mod:`rl_envs.tools.execute`); their heavy imports happen on first use. Their docstrings are
what the model is shown (through ``get_json_schema``): they speak to the model.
"""

from __future__ import annotations

import ast
import functools
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_envs.code.sandbox import SandboxLimits

# The python tool's sandbox limits unless its ``kwargs.limits`` says otherwise: a tool call is
# a short computation inside a conversation, not a test suite.
PYTHON_TOOL_LIMITS = {"cpu_time_s": 5, "case_time_s": 5.0, "wall_time_s": 8.0}

# What a calculator expression may use: arithmetic, and these functions and constants of math.
_CALCULATOR_FUNCTIONS = {
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    **{name: getattr(math, name) for name in ("sqrt", "exp", "log", "log2", "log10", "floor")},
    **{name: getattr(math, name) for name in ("ceil", "sin", "cos", "tan", "asin", "acos")},
    **{name: getattr(math, name) for name in ("atan", "degrees", "radians", "gcd", "hypot")},
}
_CALCULATOR_NAMES = {"pi": math.pi, "e": math.e}
# Arithmetic operators only (no comparisons, bit operations, ``in`` or ``is``).
_CALCULATOR_OPERATORS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
_CALCULATOR_OPERATORS += (ast.USub, ast.UAdd)
# The syntax it evaluates (simpleeval refuses every other node: attributes, subscripts,
# comprehensions, assignments, imports...).
_CALCULATOR_NODES = (ast.Expr, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Call)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Supports + - * / // % ** and parentheses, the constants pi and e, and the functions abs,
    round, min, max, sqrt, exp, log, log2, log10, floor, ceil, sin, cos, tan, asin, acos, atan,
    degrees, radians, gcd and hypot.

    Args:
        expression: The expression, e.g. "(3 + 4) * sqrt(2)".
    """
    from simpleeval import DEFAULT_OPERATORS, SimpleEval

    # One expression only (simpleeval would quietly evaluate the first of several).
    tree = ast.parse(expression.strip(), mode="eval")
    evaluator = SimpleEval(
        # simpleeval's own operators: its power refuses huge results rather than hanging.
        operators={k: v for k, v in DEFAULT_OPERATORS.items() if k in _CALCULATOR_OPERATORS},
        functions=_CALCULATOR_FUNCTIONS,
        names=_CALCULATOR_NAMES,
    )
    evaluator.nodes = {k: v for k, v in evaluator.nodes.items() if k in _CALCULATOR_NODES}
    value = evaluator.eval(expression.strip(), previously_parsed=ast.Expr(tree.body))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"the expression's value is a {type(value).__name__}, not a number")
    return str(value)


def python_tool_limits(limits: Mapping[str, Any] | None = None) -> SandboxLimits:
    """The sandbox limits the python tool runs under: :data:`PYTHON_TOOL_LIMITS`, with what its
    config's ``kwargs.limits`` sets instead (None or left out: nothing). The one place they are
    merged: the environment checks at setup the very limits each call runs with."""
    from rl_envs.code.sandbox import SandboxLimits

    return SandboxLimits.model_validate({**PYTHON_TOOL_LIMITS, **(limits or {})})


def python(code: str, limits: dict[str, Any] | None = None) -> str:
    """Run a Python program and return what it printed (and its error, if it failed).

    The program runs in a fresh sandbox with no network and no files of ours, under time and
    memory limits; print what you want to see.

    Args:
        code: The program's source code.
        limits: Set by the environment's config, not by the model.
    """
    from rl_envs.code.cases import StdioCase
    from rl_envs.code.sandbox import run_code

    sandbox = python_tool_limits(limits)
    result = run_code(code, [StdioCase(stdin="", stdout="")], sandbox)
    report = result.outputs[0]
    if result.timed_out or report is None:
        return f"Error: the program did not finish within {sandbox.wall_time_s:g} s"
    if "error" in report:
        return f"Error: {report['error']}"
    out = report["stdout"]
    if report["exit_code"] != 0:
        if out and not out.endswith("\n"):
            out += "\n"
        out += f"{result.stderr.strip()}\n(exit code {report['exit_code']})"
    return out or "(the program printed nothing)"


@functools.cache
def _index(corpus: str, modified: float) -> tuple[Any, list[dict[str, Any]]]:
    """The BM25 index of a corpus file (JSON lines with a ``text`` and, optionally, a
    ``title``), built once per process and file version (``modified``)."""
    import bm25s

    docs = []
    with Path(corpus).open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            doc = json.loads(line)
            if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                raise ValueError(f"{corpus}, line {line_no}: expected an object with a 'text'")
            docs.append(doc)
    if not docs:
        raise ValueError(f"{corpus} holds no documents")
    texts = [f"{d.get('title', '')}\n{d['text']}" for d in docs]
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
    return retriever, docs


def _corpus_index(corpus: str) -> tuple[Any, list[dict[str, Any]]]:
    return _index(corpus, Path(corpus).stat().st_mtime)


def prepare_search(corpus: str, top_k: int = 3) -> None:
    """Build the corpus's index in this process before any call (see ``BuiltinTool.prepare``):
    a call's timeout is sized for a query, not for indexing a corpus."""
    _corpus_index(corpus)


def search(query: str, corpus: str, top_k: int = 3) -> str:
    """Search the document collection and return the best matching documents.

    Args:
        query: What to look for, in words.
        corpus: Set by the environment's config, not by the model.
        top_k: Set by the environment's config, not by the model.
    """
    import bm25s

    retriever, docs = _corpus_index(corpus)
    tokens = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
    k = max(1, min(top_k, len(docs)))
    found, scores = retriever.retrieve(tokens, k=k, show_progress=False)
    hits = [(int(i), float(s)) for i, s in zip(found[0], scores[0], strict=True) if s > 0]
    if not hits:
        return "No document matches the query."
    parts = []
    for rank, (i, _) in enumerate(hits, 1):
        doc = docs[i]
        title = f" {doc['title']}" if doc.get("title") else ""
        parts.append(f"[{rank}]{title}\n{doc['text']}")
    return "\n\n".join(parts)
