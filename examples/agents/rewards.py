"""The calculator agent's reward: the final answer's number against the row's `answer`.

One function serves both runs: with the tool environment it also gets `tool_errors` (the
episode's calls that failed); the no-tool baseline (`kind: reward_functions`) has none.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+")


def final_number(text: str) -> int | None:
    """The last integer in ``text`` (thousands separators allowed), or None."""
    numbers = _NUMBER.findall(text.replace(",", ""))
    return int(numbers[-1]) if numbers else None


def correct(completions, answer, tool_errors=None, **kwargs):
    """1.0 when the final answer's last number is the answer. A wrong answer also loses 0.1 per
    failed tool call (unreadable, wrong arguments, ...), so that among wrong answers the ones
    that called the tool properly rank higher; a right answer is worth 1.0 whatever it took,
    since validation counts a reward of 1.0 as correct."""
    errors = tool_errors if tool_errors is not None else [0] * len(completions)
    rewards = []
    for completion, expected, failed in zip(completions, answer, errors, strict=True):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        right = final_number(text) == int(expected)
        rewards.append(1.0 if right else -0.1 * failed)
    return rewards
