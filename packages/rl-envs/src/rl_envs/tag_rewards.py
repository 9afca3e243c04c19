"""Built-in reward functions for answers written in tags: ``<think>...</think>`` then
``<answer>...</answer>``, the layout of GSM8K-style GRPO recipes (NeMo RL's GDPO math
environment scores with these three: its ``math_multi_reward`` translates to them).

Each takes TRL's arguments (``prompts``, ``completions``, dataset columns) and returns one float
per completion.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from rl_envs.reward_functions import completion_text

# The whole completion: a think block, one newline, an answer block (a final newline allowed).
THINK_THEN_ANSWER = re.compile(r"<think>.*?</think>\n<answer>.*?</answer>\n?", re.DOTALL)


def tagged_answer(text: str) -> str:
    """The text after the last ``<answer>`` up to the next ``</answer>``, stripped; without
    tags, the whole completion stripped (so a bare answer still counts)."""
    after = text.rsplit("<answer>", 1)[-1]
    return after.split("</answer>", 1)[0].strip()


def answer_exact(
    prompts: Sequence[Any], completions: Sequence[Any], ground_truth: Sequence[str], **_: Any
) -> list[float]:
    """1.0 when the tagged answer is ``ground_truth`` character for character, else 0.0."""
    return [
        float(tagged_answer(completion_text(c)) == str(truth).strip())
        for c, truth in zip(completions, ground_truth, strict=True)
    ]


def answer_is_integer(prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[float]:
    """1.0 when the tagged answer is made of ASCII digits only (a non-negative integer), else
    0.0. str.isdigit alone would also take "²" and other digits no integer parser reads."""
    answers = [tagged_answer(completion_text(c)) for c in completions]
    return [float(a.isascii() and a.isdigit()) for a in answers]


def think_answer_format(
    prompts: Sequence[Any], completions: Sequence[Any], **_: Any
) -> list[float]:
    """1.0 when the completion is exactly a think block, a newline and one answer block."""
    scores = []
    for c in completions:
        text = completion_text(c)
        one_answer = text.count("<answer>") == 1 and text.count("</answer>") == 1
        scores.append(float(one_answer and THINK_THEN_ANSWER.fullmatch(text) is not None))
    return scores
