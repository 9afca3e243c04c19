"""The parts of an LLM judge that need no model: its rubric and the rules that read a score.

A judge (``env.<task>.kind: judge``, ``rl_algorithms.judge``) is a generative model prompted
with a rubric, the prompt and the response; its answer is turned into a reward by a declared
rule. The environment itself lives in rl-algorithms, where generation backends can be reached
(rl-envs does not import rl-models); what is here is plain text and arithmetic, so that it is
tested on its own and could serve any other judge.

A rubric is a ``str.format`` template: ``{prompt}`` and ``{response}`` are the sample's, any
other ``{name}`` is the row's column ``name`` (``ground_truth``, say); ``{{`` and ``}}`` are
literal braces. Every value a rubric inserts can be stripped of the judge tokenizer's control
strings (``without_strings``), so that judged text cannot write the judge's chat turns.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from rl_distributed.config import ConfigModel

#: Placeholders every rubric may use: the sample's own prompt and response.
SAMPLE_PLACEHOLDERS = ("prompt", "response")

#: A score as a judge writes it: an optional sign, ASCII digits, an optional fraction.
PLAIN_DECIMAL = re.compile(r"[+-]?[0-9]+(?:\.[0-9]+)?")


def rubric_placeholders(template: str) -> tuple[str, ...]:
    """The names a rubric's ``{...}`` fields hold, in order of first use. A ``ValueError`` for
    a template ``str.format`` cannot read, or a field that is not a plain name (``{}``,
    ``{0}``, ``{row[0]}``, ``{x.y}``, ``{x!r}``, ``{x:>4}``): a rubric names what it inserts."""
    names: list[str] = []
    try:
        fields = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(
            f"the rubric is not a valid template ({e}); write {{{{ for a brace"
        ) from None
    for _, name, spec, conversion in fields:
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            shown = name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            raise ValueError(
                f"the rubric's placeholder {{{shown}}} is not a plain name; use {{prompt}}, "
                "{response} or a column's name, and {{ }} for literal braces"
            )
        if name not in names:
            names.append(name)
    return tuple(names)


def rubric_columns(template: str) -> tuple[str, ...]:
    """The row columns a rubric reads (its placeholders other than prompt and response)."""
    return tuple(n for n in rubric_placeholders(template) if n not in SAMPLE_PLACEHOLDERS)


def prompt_text(prompt: str | Sequence[Mapping[str, Any]]) -> str:
    """A sample's prompt as the rubric shows it: the dataset's string, the content of a
    one-message conversation, else one ``role: content`` line per message."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1:
        return str(prompt[0]["content"])
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def without_strings(text: str, strings: Sequence[str]) -> str:
    """``text`` with every occurrence of each of ``strings`` removed, again and again until none
    is left: removing ``<|im_end|>`` from ``<|im_<|im_end|>end|>`` once would leave a new one."""
    strings = sorted({s for s in strings if s}, key=len, reverse=True)
    while True:
        stripped = text
        for s in strings:
            stripped = stripped.replace(s, "")
        if stripped == text:
            return text
        text = stripped


def render_rubric(
    template: str,
    prompt: str | Sequence[Mapping[str, Any]],
    response: str,
    columns: Mapping[str, Any],
    where: str = "the rubric",
    control_strings: Sequence[str] = (),
) -> str:
    """The rubric filled in for one sample. A ``ValueError`` naming the placeholder (and
    ``where``: the sample) when the row has no such column.

    ``control_strings`` (the judge tokenizer's special tokens) are removed from every inserted
    value, as text: tokenizers encode such a string in plain text as the control token itself,
    so a response holding ``<|im_end|>`` could otherwise end the judge's user turn and write
    an assistant turn of its own."""
    values: dict[str, Any] = {}
    for name in rubric_placeholders(template):
        if name == "prompt":
            values[name] = prompt_text(prompt)
        elif name == "response":
            values[name] = response
        elif name in columns:
            values[name] = columns[name]
        else:
            raise ValueError(
                f"{where}: the rubric's placeholder {{{name}}} is neither prompt, response nor "
                f"a column of the row (its columns: {sorted(columns)})"
            )
    # A placeholder has no format spec (rubric_placeholders), so str() is what format shows.
    return template.format_map(
        {name: without_strings(str(value), control_strings) for name, value in values.items()}
    )


class ScoreInTag(ConfigModel):
    """The score is the number inside the judge's last ``<tag>...</tag>``; with ``min`` and
    ``max`` it must lie between them and is mapped linearly onto [0, 1]."""

    # The rule: a number in a tag of the judge's answer.
    rule: Literal["score_in_tag"] = "score_in_tag"
    # The tag's name: the score is read from <tag>...</tag>.
    tag: str = Field("score", pattern=r"^[A-Za-z_][\w.-]*$")
    # The lowest score of the rubric's scale (give both min and max, or neither): a score
    # outside the scale is no score, one inside is mapped linearly onto [0, 1].
    min: float | None = Field(None, allow_inf_nan=False)
    # The highest score of the rubric's scale.
    max: float | None = Field(None, allow_inf_nan=False)

    @model_validator(mode="after")
    def _scale(self) -> ScoreInTag:
        if (self.min is None) != (self.max is None):
            raise ValueError("give both min and max (the rubric's scale), or neither")
        if self.min is not None and self.max is not None and not self.min < self.max:
            raise ValueError(f"min ({self.min:g}) must be below max ({self.max:g})")
        return self

    def parse(self, text: str) -> tuple[float | None, str]:
        """``(score, "")``, or ``(None, why)`` when the text holds no usable score."""
        tag = re.escape(self.tag)
        found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
        if not found:
            return None, f"no <{self.tag}>...</{self.tag}> in the judge's answer"
        # The last one: a judge that quotes the format before answering ends with its verdict.
        content = found[-1].strip()
        # A plain decimal only: float() would also read "1e30", "1_0", "inf" and non-ASCII
        # digits, none of which a rubric asks for.
        value = float(content) if PLAIN_DECIMAL.fullmatch(content) else math.nan
        if not math.isfinite(value):
            return None, f"<{self.tag}> holds {content[:40]!r}, not a number like -1, 7 or 2.5"
        if self.min is None or self.max is None:
            return value, ""
        if not self.min <= value <= self.max:
            return None, f"score {value:g} is outside [{self.min:g}, {self.max:g}]"
        return (value - self.min) / (self.max - self.min), ""


class YesProbability(ConfigModel):
    """The score is P(yes) / (P(yes) + P(no)) at the judge's first generated position: the
    probabilities of the ``yes_tokens`` and of the ``no_tokens`` (each must be one token of
    the judge's tokenizer), summed, read from the generator's ``top_k`` most likely first
    tokens. A token outside those counts as probability 0 (it is less likely than each of
    them); when neither side is among them the sample has no score."""

    # The rule: the probability of a yes token against a no token, first generated position.
    rule: Literal["yes_probability"] = "yes_probability"
    # Tokens that say yes (each one token of the judge's tokenizer), their probabilities summed.
    yes_tokens: list[str] = Field(default_factory=lambda: ["yes", "Yes"], min_length=1)
    # Tokens that say no, likewise.
    no_tokens: list[str] = Field(default_factory=lambda: ["no", "No"], min_length=1)
    # Most likely first tokens the generator reports (vLLM reports at most 20).
    top_k: int = Field(20, ge=1, le=20)

    @model_validator(mode="after")
    def _disjoint(self) -> YesProbability:
        both = set(self.yes_tokens) & set(self.no_tokens)
        if both:
            raise ValueError(f"{sorted(both)} are both yes_tokens and no_tokens")
        return self


def yes_probability(
    top_ids: Sequence[int],
    top_logprobs: Sequence[float],
    yes_ids: Sequence[int],
    no_ids: Sequence[int],
) -> tuple[float | None, str]:
    """``(P(yes) / (P(yes) + P(no)), "")`` from one position's most likely tokens and their
    log-probs, in float64; ``(None, why)`` when neither a yes nor a no token is among them."""
    yes, no = set(yes_ids), set(no_ids)
    p_yes = p_no = 0.0
    best = max((lp for lp in top_logprobs if math.isfinite(lp)), default=0.0)
    for token, logprob in zip(top_ids, top_logprobs, strict=True):
        if not math.isfinite(logprob):
            continue
        # Relative to the most likely token: the ratio is the same, and no exp underflows.
        p = math.exp(float(logprob) - best)
        p_yes += p if token in yes else 0.0
        p_no += p if token in no else 0.0
    if p_yes + p_no == 0.0:
        return None, f"neither a yes nor a no token among the {len(top_ids)} most likely"
    return p_yes / (p_yes + p_no), ""


#: The ``parse`` key of a judge's config: one of the rules, told apart by ``rule``.
ParseRule = Annotated[ScoreInTag | YesProbability, Field(discriminator="rule")]
