"""Message logs: checking them, and tokenising them one message at a time.

Each message's ``token_ids`` are computed once, from the text that message adds to the rendered
conversation (see :meth:`ChatTemplate.message_texts`). Appending turns to a log tokenises only the
new messages: earlier messages keep their tensors, so a multi-turn rollout never sees the ids of
an earlier turn change (re-tokenising a whole conversation can merge tokens across turn
boundaries and shift them).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from rl_data.templates import ChatTemplate
from rl_data.tokenizers import encode_texts
from rl_data.types import TENSOR_KEYS, MessageLog

ROLES = frozenset({"system", "user", "assistant", "tool", "environment"})


# Keys of a message besides role and content that chat templates read (OpenAI / Hugging Face
# conventions): kept on the message so that the template renders them.
MESSAGE_EXTRAS = frozenset({"tool_calls", "tool_call_id", "name", "reasoning_content"})


def check_messages(messages: Any, what: str = "messages") -> list[dict[str, Any]]:
    """``messages`` as plain dicts, or a ValueError saying what is wrong.

    Each keeps ``role``, ``content`` and those of :data:`MESSAGE_EXTRAS` it has (``tool_calls``
    must be a list of dicts); keys that are ``None`` count as absent (Arrow fills a field that
    only some messages have with nulls), and other keys are left out: templates do not read
    them. An assistant message that only calls tools may have no content (it becomes "").
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{what} must be a non-empty list of messages, got {_show(messages)}")
    out = []
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
        if calls is not None and not (
            isinstance(calls, list) and all(isinstance(c, Mapping) for c in calls)
        ):
            raise ValueError(f"{what}[{i}] tool_calls must be a list of dicts, got {_show(calls)}")
        message: dict[str, Any] = {"role": role, "content": content}
        message.update({k: m[k] for k in sorted(MESSAGE_EXTRAS) if m.get(k) is not None})
        out.append(message)
    return out


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def tokenize_message_logs(
    logs: Sequence[MessageLog],
    tokenizer: Any,
    template: ChatTemplate,
    add_generation_prompt: bool = False,
) -> None:
    """Give every message without ``token_ids`` its ids, in place, for all logs at once.

    Messages that already have ``token_ids`` are left untouched; only the messages after the
    last tokenised one are rendered and tokenised. ``add_generation_prompt`` appends the
    assistant header to the last message (prompts for generation).
    """
    pending: list[tuple[MessageLog, int]] = []
    texts: list[str] = []
    for log in logs:
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
        texts.extend(template.message_texts(log, add_generation_prompt, start=start))
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
