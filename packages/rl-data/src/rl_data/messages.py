"""Message logs: checking them, and tokenising them one message at a time.

Each message's ``token_ids`` are computed once, from the text that message adds to the rendered
conversation (see :meth:`ChatTemplate.message_texts`). Appending turns to a log tokenises only the
new messages: earlier messages keep their tensors, so a multi-turn rollout never sees the ids of
an earlier turn change (re-tokenising a whole conversation can merge tokens across turn
boundaries and shift them).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from rl_data.templates import ChatTemplate, Tools
from rl_data.tokenizers import encode_texts
from rl_data.types import TENSOR_KEYS, MessageLog

ROLES = frozenset({"system", "user", "assistant", "tool", "environment"})


# Keys of a message besides role and content that chat templates read (OpenAI / Hugging Face
# conventions): kept on the message so that the template renders them.
MESSAGE_EXTRAS = frozenset({"tool_calls", "tool_call_id", "name", "reasoning_content"})


def check_messages(messages: Any, what: str = "messages") -> list[dict[str, Any]]:
    """``messages`` as plain dicts, or a ValueError saying what is wrong.

    Each keeps ``role``, ``content`` and those of :data:`MESSAGE_EXTRAS` it has; keys that are
    ``None`` count as absent (Arrow fills a field that only some messages have with nulls), and
    other keys are left out: templates do not read them. An assistant message that only calls
    tools may have no content (it becomes ""). Tool calls are OpenAI's
    (``{"type": "function", "id": ..., "function": {"name": ..., "arguments": ...}}``, see
    :func:`check_tool_calls`); a ``tool`` message may name the call it answers with
    ``tool_call_id``, which must then be the id of a call made before it.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{what} must be a non-empty list of messages, got {_show(messages)}")
    out = []
    call_ids: set[str] = set()
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(
                f"{what}[{i}] must be a dict with 'role' and 'content', got {_show(m)}"
            )
        calls = m.get("tool_calls")
        content = m.get("content")
        if content is None and calls:
            content = ""
        missing = [k for k, v in (("role", m.get("role")), ("content", content)) if v is None]
        if missing:
            raise ValueError(f"{what}[{i}] has no {' or '.join(map(repr, missing))}")
        role = m["role"]
        if role not in ROLES:
            raise ValueError(f"{what}[{i}] has role {role!r}; expected one of {sorted(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(
                f"{what}[{i}] ({role}) content must be a string, got {type(content).__name__}"
            )
        message: dict[str, Any] = {"role": role, "content": content}
        message.update({k: m[k] for k in sorted(MESSAGE_EXTRAS) if m.get(k) is not None})
        for key in ("tool_call_id", "name", "reasoning_content"):
            if key in message and not isinstance(message[key], str):
                raise ValueError(
                    f"{what}[{i}] ({role}) {key} must be a string, got {_show(message[key])}"
                )
        if "tool_calls" in message:
            if role != "assistant":
                raise ValueError(f"{what}[{i}] ({role}) has tool_calls; only assistants call tools")
            message["tool_calls"] = check_tool_calls(message["tool_calls"], f"{what}[{i}]")
            call_ids.update(c["id"] for c in message["tool_calls"] if "id" in c)
        if "tool_call_id" in message:
            if role != "tool":
                raise ValueError(f"{what}[{i}] ({role}) has tool_call_id; only tool replies do")
            if call_ids and message["tool_call_id"] not in call_ids:
                raise ValueError(
                    f"{what}[{i}] (tool) answers tool_call_id {message['tool_call_id']!r}, but"
                    f" the calls before it have ids {sorted(call_ids)}"
                )
        out.append(message)
    return out


def check_tool_calls(calls: Any, what: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, checked, with each call's arguments as a dict.

    A call is ``{"type": "function", "id": ..., "function": {"name": ..., "arguments": ...}}``
    (``type`` and ``id`` optional). Arguments given as a JSON string (OpenAI's wire format) are
    parsed: chat templates write them with ``tojson``, which would quote a string a second
    time, so they expect a dict, as ``apply_chat_template`` does.
    """
    if not isinstance(calls, list) or not all(isinstance(c, Mapping) for c in calls):
        raise ValueError(f"{what} tool_calls must be a list of dicts, got {_show(calls)}")
    out = []
    for j, call in enumerate(calls):
        where = f"{what} tool_calls[{j}]"
        call = {k: v for k, v in call.items() if v is not None}
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise ValueError(
                f'{where} must be {{"type": "function", "function": {{"name": ..., "arguments":'
                f" ...}}}}, got {_show(call)}"
            )
        name, arguments = function.get("name"), function.get("arguments", {})
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where} function has no 'name' (a string)")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"{where} arguments are not valid JSON ({e.msg})") from None
            except RecursionError:
                raise ValueError(f"{where} arguments are nested too deeply") from None
        if not isinstance(arguments, Mapping):
            raise ValueError(f"{where} arguments must be a JSON object, got {_show(arguments)}")
        if "id" in call and not isinstance(call["id"], str):
            raise ValueError(f"{where} id must be a string, got {_show(call['id'])}")
        out.append({**call, "function": {**function, "name": name, "arguments": dict(arguments)}})
    return out


def check_tools(tools: Any, what: str = "tools") -> list[dict[str, Any]]:
    """The tools a conversation is offered, checked: a list of OpenAI function schemas
    ``{"type": "function", "function": {"name", "description", "parameters"}}`` (TRL's
    ``tools`` column), or the same list as a JSON string (how Parquet files keep them whole).

    Keys whose value is ``None`` are dropped at every depth: Arrow gives every tool's schema
    the union of all tools' keys, filling the ones a tool lacks with nulls, and a template
    would render them.
    """
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} is a string but not JSON ({e.msg})") from None
        except RecursionError:
            raise ValueError(f"{what} is nested too deeply") from None
    if not isinstance(tools, list):
        raise ValueError(f"{what} must be a list of function schemas, got {_show(tools)}")
    out = []
    for j, tool in enumerate(tools):
        tool = _without_nulls(tool)
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise ValueError(
                f'{what}[{j}] must be {{"type": "function", "function": {{"name": ...,'
                f' "description": ..., "parameters": {{...}}}}}}, got {_show(tool)}'
            )
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"{what}[{j}] function has no 'name' (a string)")
        if not isinstance(function.get("description", ""), str):
            raise ValueError(f"{what}[{j}] ({function['name']}) description must be a string")
        if not isinstance(function.get("parameters", {}), dict):
            raise ValueError(
                f"{what}[{j}] ({function['name']}) parameters must be a JSON schema object"
            )
        out.append(tool)
    return out


def _without_nulls(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def tokenize_message_logs(
    logs: Sequence[MessageLog],
    tokenizer: Any,
    template: ChatTemplate,
    add_generation_prompt: bool = False,
    tools: Sequence[Tools | None] | None = None,
) -> None:
    """Give every message without ``token_ids`` its ids, in place, for all logs at once.

    Messages that already have ``token_ids`` are left untouched; only the messages after the
    last tokenised one are rendered and tokenised. ``add_generation_prompt`` appends the
    assistant header to the last message (prompts for generation). ``tools`` holds, for each
    log, the tools its conversation is offered (None: none); a log must be rendered with the
    same tools every time it is tokenised further (they are where its sample's
    ``extra_env_info`` keeps them, under :data:`~rl_data.types.TOOLS_KEY`).
    """
    if tools is not None and len(tools) != len(logs):
        raise ValueError(f"tools must hold one entry per log: {len(tools)} for {len(logs)} logs")
    pending: list[tuple[MessageLog, int]] = []
    texts: list[str] = []
    for n, log in enumerate(logs):
        start = 0
        for i, message in enumerate(log):
            if "token_ids" in message:
                if i != start:
                    raise ValueError(
                        f"message {i} is tokenised but message {start} before it is not"
                    )
                start = i + 1
        if start == len(log):
            continue
        pending.append((log, start))
        offered = None if tools is None else tools[n]
        texts.extend(template.message_texts(log, add_generation_prompt, start, offered))
    if not texts:
        return
    encoded = encode_texts(tokenizer, texts)
    # One tensor for all ids, cut per message; each piece is cloned so that a message never
    # holds a view of the whole batch's storage (pickling a view sends all of it).
    lengths = [len(ids) for ids in encoded]
    flat = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int64, count=sum(lengths))
    pieces = iter(torch.from_numpy(flat).split(lengths))
    for log, start in pending:
        for message in log[start:]:
            message["token_ids"] = next(pieces).clone()


def message_log_length(log: MessageLog) -> int:
    return sum(m["token_ids"].shape[0] for m in log)


def truncate_message_log(log: MessageLog, max_tokens: int) -> MessageLog:
    """The first ``max_tokens`` tokens of ``log``; messages past the cut keep zero tokens."""
    out: MessageLog = []
    left = max_tokens
    for message in log:
        kept = dict(message)
        for key in TENSOR_KEYS:
            if key in kept:
                kept[key] = kept[key][:left]
        left -= len(kept["token_ids"])
        out.append(kept)  # type: ignore[arg-type]
    return out
