"""Tool calls in a model's turn, read from its text in the format of the model's family.

Where the calls are in the text is found by transformers' response parser
(``transformers.utils.chat_parsing.parse_response``, driven by a declarative response template
per format: which markers open and close a call region); what each region holds is read with
Python's JSON decoder. A call that cannot be read is not dropped: it becomes a
:class:`ToolCall` with an ``error`` saying what is wrong, which the environment answers with a
tool message (so the model sees its mistake and can recover) and counts as malformed.

Formats (``parser`` in the tool environment's config):

- ``hermes``: Hermes / Qwen2.5 / Qwen3 and the Hermes-style ChatML template of SmolLM2:
  ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, any number per turn, text around
  them. A region may also hold a JSON list of calls (as SmolLM2's function-calling data writes).
- ``llama3_json``: Llama 3.1 / 3.2 / 3.3 JSON tool calls: the turn *starts* with
  ``{"name": "f", "parameters": {...}}`` (several separated by ``;``), or holds one after
  ``<|python_tag|>``. A final answer that starts with ``{`` reads as a call in this format.
- ``mistral``: Mistral v3 (Mistral 7B v0.3, Nemo, Small): ``[TOOL_CALLS]`` then a JSON list of
  ``{"name": ..., "arguments": {...}}``. ``[TOOL_CALLS]`` is a special token of Mistral's
  tokenizers: a rollout keeps it in the turn's text (``rl_algorithms.episodes.turn_text``).

Arguments may also come as a JSON string holding the object (OpenAI's wire form), and a call
may be wrapped as ``{"type": "function", "function": {...}}``.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCall:
    """One call of a turn. ``error`` (the call could not be read: bad JSON, no name, arguments
    that are no object) means it is not run; the model is told ``error`` instead."""

    id: str
    name: str  # "" when the call named no tool
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def as_message_call(self) -> dict[str, Any]:
        """The call as chat templates and OpenAI's API write it in an assistant message."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedTurn:
    text: str  # the turn's text without its calls
    calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallFormat:
    """How one model family writes tool calls."""

    # A transformers response template with two regions: ``calls`` (the text holding calls)
    # and ``text`` (the rest).
    template: dict[str, Any]
    # A ``calls`` region -> the JSON values read from it (an exception for one that could not
    # be read) and the text left after them.
    read_region: Callable[[str], tuple[list[Any], str]]
    arguments_key: str  # where a call's arguments are: "arguments" or "parameters"
    example: str  # a well-formed call, for the message a malformed one gets


def _template(calls_open: dict[str, str], calls_close: dict[str, str]) -> dict[str, Any]:
    return {
        # Only read when a prefix is given; ours is always empty (the turn's text is complete).
        "start_anchor_pattern": r"\A",
        "fields": {
            "calls": {**calls_open, **calls_close, "repeats": True, "content": "text"},
            # The region without an opening marker: everything that is not a call.
            "text": {"repeats": True, "content": "text", "content_args": {"strip": False}},
        },
    }


# Longer call regions are refused unread: a model's output is untrusted, and a call this long
# is degenerate output, not a call worth parsing.
MAX_CALL_CHARS = 100_000


def _read_one_value(region: str) -> tuple[list[Any], str]:
    """The region is one JSON value (a call, or a list of calls)."""
    if len(region) > MAX_CALL_CHARS:
        return [ValueError(f"{len(region)} characters, over the limit of {MAX_CALL_CHARS}")], ""
    try:
        return [json.loads(region)], ""
    except (json.JSONDecodeError, RecursionError) as e:
        return [_unreadable(e)], ""


def _unreadable(error: Exception) -> ValueError:
    """Why a JSON value could not be read, said plainly (a value nested thousands deep makes
    Python's decoder recurse out of its stack: a generated call must never crash the run)."""
    if isinstance(error, RecursionError):
        return ValueError("nested too deeply")
    return ValueError(str(error))


def _read_leading_values(region: str) -> tuple[list[Any], str]:
    """JSON values at the start of the region, separated by whitespace or ``;``; the text after
    the last one is the turn's text."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    pos = 0
    if len(region) > MAX_CALL_CHARS:
        return [ValueError(f"{len(region)} characters, over the limit of {MAX_CALL_CHARS}")], ""
    while True:
        while pos < len(region) and (region[pos].isspace() or region[pos] == ";"):
            pos += 1
        if pos == len(region) or (values and region[pos] not in "[{"):
            return values, region[pos:]
        try:
            value, pos = decoder.raw_decode(region, pos)
        except (json.JSONDecodeError, RecursionError) as e:
            return [*values, _unreadable(e)], ""
        values.append(value)


FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat(
        _template({"open": "<tool_call>"}, {"close": "</tool_call>"}),
        _read_one_value,
        "arguments",
        '<tool_call>{"name": "tool_name", "arguments": {"arg": "value"}}</tool_call>',
    ),
    "llama3_json": ToolCallFormat(
        # At the very start of the turn (``\A``: not after text), or after the python tag.
        _template({"open_pattern": r"<\|python_tag\|>|\A\s*(?=\{)"}, {}),
        _read_leading_values,
        "parameters",
        '{"name": "tool_name", "parameters": {"arg": "value"}}',
    ),
    "mistral": ToolCallFormat(
        _template({"open": "[TOOL_CALLS]"}, {}),
        _read_leading_values,
        "arguments",
        '[TOOL_CALLS][{"name": "tool_name", "arguments": {"arg": "value"}}]',
    ),
}


def _as_call(value: Any, call_id: str, fmt: ToolCallFormat) -> ToolCall:
    """One JSON value as a call, or a call with the ``error`` that it is not one."""
    if isinstance(value, ValueError):  # what _unreadable says of a region
        return ToolCall(call_id, "", error=f"not valid JSON: {value}")
    if isinstance(value, dict) and isinstance(value.get("function"), dict):
        value = value["function"]  # {"type": "function", "function": {...}}
    if not isinstance(value, dict):
        return ToolCall(
            call_id, "", error=f"a call must be a JSON object, got {type(value).__name__}"
        )
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(call_id, "", error='a call needs a "name": the tool\'s name as a string')
    other_key = "parameters" if fmt.arguments_key == "arguments" else "arguments"
    arguments = value.get(fmt.arguments_key, value.get(other_key, {}))
    if isinstance(arguments, str):  # OpenAI's wire form: the object as a JSON string
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError) as e:
            return ToolCall(
                call_id, name, error=f"its arguments are not valid JSON: {_unreadable(e)}"
            )
    if not isinstance(arguments, dict):
        return ToolCall(
            call_id,
            name,
            error=f'"{fmt.arguments_key}" must be a JSON object, got {type(arguments).__name__}',
        )
    return ToolCall(call_id, name, arguments)


@functools.cache
def _compiled_template(format_name: str) -> Any:
    """The format's response template, checked and its patterns compiled once per process."""
    from transformers.utils.chat_parsing.response_templates import load_response_template

    return load_response_template(FORMATS[format_name].template)


def parse_tool_calls(text: str, format_name: str, first_id: int = 0) -> ParsedTurn:
    """The calls in ``text`` (a generated turn) in format ``format_name`` (a key of
    :data:`FORMATS`), numbered ``call_<first_id>``, ``call_<first_id + 1>``... in order."""
    from transformers.utils.chat_parsing import parse_response

    fmt = FORMATS[format_name]
    try:
        regions = parse_response(text, _compiled_template(format_name), prefix="")
    except Exception:
        # The region scan itself failed (never seen): the whole turn is one unreadable call
        # rather than a crash of the run; logged, since it would be a bug to report.
        logger.exception("tool-call regions of a turn could not be found (%s)", format_name)
        return ParsedTurn(text, [ToolCall(f"call_{first_id}", "", error="the turn was unreadable")])
    values: list[Any] = []
    text_parts = list(regions.get("text", []))
    for region in regions.get("calls", []):
        read, rest = fmt.read_region(region)
        # A region holding a list of calls (Mistral, SmolLM2) stands for each of them.
        for value in read:
            values.extend(value if isinstance(value, list) else [value])
        text_parts.append(rest)
    calls = [_as_call(v, f"call_{first_id + k}", fmt) for k, v in enumerate(values)]
    return ParsedTurn("".join(text_parts).strip(), calls)


def malformed_message(call: ToolCall, format_name: str) -> str:
    """What the model is told about a call it wrote that could not be read."""
    return (
        f"Error: this tool call could not be read: {call.error}. Write each call as "
        f"{FORMATS[format_name].example}"
    )
