"""A format reward for the main job's task, for GDPO's two-reward recipe (two_rewards.yaml).

The prompt asks for "just the number"; correctness is the built-in ``math`` reward. This one
pays for the format alone, so the two rewards disagree often early in training (a right answer
inside a sentence, a bare wrong number): the case where GDPO's per-reward normalisation and
GRPO's normalised sum give different advantages."""

import re

_BARE_NUMBER = re.compile(r"-?\d+")


def just_the_number(completions: list, **_) -> list[float]:
    """1.0 when the completion, stripped of surrounding whitespace, is one integer, else 0.0.
    A completion is its text, or (the main job's conversational prompts) the assistant's
    messages ``[{"role": "assistant", "content": text}]``, the answer in the last."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(bool(_BARE_NUMBER.fullmatch(text.strip()))) for text in texts]
