"""Conversations and prompts from files: SFT responses and RL prompts.

A chat row is ``{"messages": [{"role", "content"}, ...], "extra_env_info": dict | None,
"task_name": str | None}``. Files hold either OpenAI chat format (a column of message lists) or
plain text columns (prompt, response, system) named in the config.
"""

from __future__ import annotations

from typing import Any, Literal

from rl_data.datasets.base import FileFormat, Row, RowDataset, collect_rows
from rl_data.errors import BadRowPolicy
from rl_data.messages import check_messages
from rl_distributed.config import ConfigModel


class ChatFileConfig(ConfigModel):
    """A JSONL/Parquet file or saved HF dataset of conversations (SFT) or prompts (RL).

    Rows are read from ``messages_key`` (OpenAI chat format) unless ``prompt_key`` is set; then
    the user turn comes from ``prompt_key``, and optional system and assistant turns from
    ``system_key`` and ``response_key``.
    """

    source: Literal["chat_file"] = "chat_file"
    path: str
    format: FileFormat = "auto"
    split: str | None = None  # which split of a saved DatasetDict
    messages_key: str = "messages"
    prompt_key: str | None = None
    response_key: str | None = None
    system_key: str | None = None
    env_info_keys: list[str] = []  # columns handed to the environment (e.g. the answer)
    task_name: str | None = None
    on_bad_row: BadRowPolicy = "raise"


def text_or_messages(value: Any, role: str, what: str) -> list[dict[str, str]]:
    """A plain string as one message of ``role``, or a checked list of messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return check_messages(value, what)
    raise ValueError(f"{what} must be a string or a list of messages, got {type(value).__name__}")


def _text(record: Row, key: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"column {key!r} must be a string, got {type(value).__name__}")
    return value


def chat_row(cfg: ChatFileConfig, record: Row) -> Row:
    if cfg.prompt_key is None:
        messages = check_messages(record[cfg.messages_key], cfg.messages_key)
    else:
        messages = [{"role": "user", "content": _text(record, cfg.prompt_key)}]
        if cfg.system_key is not None:
            messages.insert(0, {"role": "system", "content": _text(record, cfg.system_key)})
        if cfg.response_key is not None:
            messages.append({"role": "assistant", "content": _text(record, cfg.response_key)})
    env_info = {key: record[key] for key in cfg.env_info_keys} if cfg.env_info_keys else None
    return {"messages": messages, "extra_env_info": env_info, "task_name": cfg.task_name}


def load_chat_file(cfg: ChatFileConfig) -> RowDataset:
    return collect_rows(
        cfg.path, cfg.format, cfg.split, lambda record: [chat_row(cfg, record)], cfg.on_bad_row
    )
