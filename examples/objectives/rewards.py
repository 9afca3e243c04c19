"""Format rewards for the main job's task, for GDPO's two-reward recipes.

The prompt asks for "just the number"; correctness is the built-in ``math`` reward. These pay
for the format alone, so the two rewards disagree often early in training (a right answer
inside a sentence, a bare wrong number): the case where GDPO's per-reward normalisation and
GRPO's normalised sum give different advantages.

- ``just_the_number`` (two_rewards.yaml) pays for a bare integer only. SmolLM2-135M adds
  better when it writes the sum out, so this reward can be had by giving up accuracy, and on
  some seeds it took the run over (docs/guides/objectives.md).
- ``no_words`` (two_rewards_no_words.yaml) pays for an answer without prose: a bare integer or
  the sum written out (``65 + 97 = 162``). It still disagrees with correctness (a wrong sum
  written out, a right one inside a sentence), but no longer pays for dropping the working."""

import re

_BARE_NUMBER = re.compile(r"-?\d+")
# A bare integer, or a sum or difference written out before it ("65 + 97 = 162"); ASCII
# digits only.
_NO_WORDS = re.compile(r"(?:-?\d+ *[+-] *-?\d+ *= *)?-?\d+", re.ASCII)


def _texts(completions: list) -> list[str]:
    # A completion is its text, or (the main job's conversational prompts) the assistant's
    # messages ``[{"role": "assistant", "content": text}]``, the answer in the last.
    return [c if isinstance(c, str) else c[-1]["content"] for c in completions]


def just_the_number(completions: list, **_) -> list[float]:
    """1.0 when the completion, stripped of surrounding whitespace, is one integer, else 0.0."""
    return [float(bool(_BARE_NUMBER.fullmatch(text.strip()))) for text in _texts(completions)]


def no_words(completions: list, **_) -> list[float]:
    """1.0 when the completion, stripped of surrounding whitespace, is an integer, or a sum or
    difference of two integers written out before it (``162``, ``65 + 97 = 162``), else 0.0."""
    return [float(bool(_NO_WORDS.fullmatch(text.strip()))) for text in _texts(completions)]
