"""The functions verifier processes run: (response, ground truth...) -> (reward, answer).

They live apart from the environment classes so that a verifier process imports only what
scoring needs: not torch or Ray, which cost seconds on every (re)start of a process.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from typing import Any

from rl_envs.code.cases import parse_cases
from rl_envs.code.sandbox import SandboxLimits, run_code

_FENCE = re.compile(r"```(?:python|py)?[^\n]*\n(.*?)```", re.DOTALL)


def score_math(response: str, ground_truth: str) -> tuple[float, str | None]:
    """1.0 when the response's final answer equals ``ground_truth`` mathematically, else 0.0;
    where the ground truth is a number, the answer must be written as one
    (``_written_as_a_number``).

    Runs in a verifier process's main thread, so math-verify's own ``signal.alarm`` timeouts
    work; the pool's per-sample timeout backs them up.
    """
    from math_verify import parse, verify
    from math_verify.grader import is_equation, take_last_relation

    if not isinstance(ground_truth, str) or not ground_truth.strip():
        raise ValueError(f"no ground truth to check against: {ground_truth!r}")
    # A bare "3/4" or "\frac{3}{4}" parses the same way once it is boxed.
    gold = parse(ground_truth if "\\boxed" in ground_truth else f"\\boxed{{{ground_truth}}}")
    if not gold:
        raise ValueError(f"ground truth does not parse: {ground_truth!r}")
    pred = parse(response)
    answer = pred[-1] if pred and isinstance(pred[-1], str) else (str(pred[0]) if pred else None)
    if pred and getattr(gold[0], "is_Number", False):
        # "$28 + 99 = 127$" answers 127: math-verify compares an equation's last right side.
        value = take_last_relation(pred[0]).rhs if is_equation(pred[0]) else pred[0]
        if not _written_as_a_number(value):
            # To sympy "12 + 15" equals 27, but an answer that leaves the sum to the reader has
            # not answered: models learn to restate the question's arithmetic ("The answer is
            # 12 + 15"), as the main job's policy did under this reward before the check.
            return 0.0, answer
    return (1.0 if pred and verify(gold, pred) else 0.0), answer


def _written_as_a_number(expr: Any) -> bool:
    """Whether a parsed answer is a number as written: an integer, a decimal, a percentage, a
    fraction (LaTeX fractions of integers parse to numbers; plain ``3/4`` stays ``3 * 4**-1``
    and must be in lowest terms), not a sum, product or power of numbers still to be worked
    out. Where the ground truth is a number, the answer must be one; a ground truth that is an
    expression (``\\sqrt{8}``) leaves the form to math-verify. LaTeX ``\\frac{84}{4}`` is 21 once
    parsed, so a restated division in LaTeX still counts."""
    from math_verify.grader import is_atomic_or_pct_atomic
    from sympy import Number

    if is_atomic_or_pct_atomic(expr, Number):
        return True
    if getattr(expr, "is_Mul", False) and len(expr.args) == 2:
        whole = [a for a in expr.args if a.is_Integer]
        inverse = [a for a in expr.args if a.is_Pow and a.base.is_Integer and a.exp == -1]
        if len(whole) == 1 and len(inverse) == 1:
            numerator, denominator = int(whole[0]), int(inverse[0].base)
            return denominator > 1 and math.gcd(numerator, denominator) == 1
    return False


@functools.lru_cache(maxsize=64)
def _dataset(name: str, seed: int, size: int):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, seed=seed, size=size)


@functools.lru_cache(maxsize=256)
def _scorer(name: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(name)


def score_reasoning_gym(
    response: str, metadata: Mapping[str, Any], answer_tag: str | None
) -> tuple[float, str | None]:
    from reasoning_gym.utils import extract_answer

    answer = extract_answer(response, tag_name=answer_tag) if answer_tag else response.strip()
    if "entry" in metadata:
        entry = metadata["entry"]
        score = _scorer(entry["metadata"]["source_dataset"])
    else:
        dataset = _dataset(metadata["dataset"], int(metadata["seed"]), int(metadata["size"]))
        entry, score = dataset[int(metadata["index"])], dataset.score_answer
    return float(score(answer, entry)), answer


def extract_code(response: str) -> str:
    """The last fenced code block, or the whole response when it has none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def score_code(response: str, tests: list[dict], limits: dict[str, Any]) -> tuple[float, str]:
    """Fraction of ``tests`` (stdio or function-call cases) the response's program passes."""
    result = run_code(extract_code(response), parse_cases(tests), SandboxLimits(**limits))
    # A program stopped by a limit is the program's failure (reward for what passed), not a
    # verifier timeout: the verifier did its job.
    note = " (stopped by the time limit)" if result.timed_out else ""
    if result.memory_limited:
        note += " (stopped by the memory limit)"
    if not result.isolated:
        note += " [UNISOLATED: allow_unisolated]"
    return result.reward, f"{sum(result.passed)}/{len(result.passed)} tests passed{note}"
