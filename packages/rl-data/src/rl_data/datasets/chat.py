"""Conversations and prompts from files: SFT responses and RL prompts.

A chat row is ``{"messages": [{"role", "content"}, ...], "extra_env_info": dict | None,
"task_name": str | None}``, plus ``"raw_text": True`` for plain text (trained on as it is,
with no chat template). Files hold TRL's dataset formats as they are, told apart row by row
by their columns:

- ``messages``: a conversation (OpenAI chat format: assistant ``tool_calls``, ``tool``
  replies with ``tool_call_id``);
- ``prompt`` (a string or messages), and optionally ``completion`` (the same): prompt-only
  (RL) and prompt-completion (SFT) data;
- ``text``: plain text, for language-model SFT.

Or columns named in the config: ``prompt_key`` (the user turn) with ``system_key`` and
``response_key``. A ``tools`` column (OpenAI function schemas, as TRL names it) is checked and
always kept in ``extra_env_info`` under :data:`~rl_data.types.TOOLS_KEY`: the conversation is
rendered with those tools, and the environment learns which tools the sample was offered.
Every other column goes to ``extra_env_info`` (what the environment and reward functions
read), unless ``env_info_keys`` picks them. A prompt that is a string (a
``prompt`` column of strings, or ``prompt_key``) is kept there too, under
:data:`~rl_data.types.STRING_PROMPT_KEY`, so that reward functions get it as TRL gives it.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

from pydantic import field_validator, model_validator

from rl_data.datasets.base import FileFormat, Row, RowDataset, check_path, load_file_rows
from rl_data.errors import BadRowPolicy
from rl_data.messages import check_messages, check_tools
from rl_data.types import STRING_PROMPT_KEY, TOOLS_KEY
from rl_distributed.config import ConfigModel


class FileSourceConfig(ConfigModel):
    """Where a file source's records come from, and how its columns are renamed."""

    # A JSONL or Parquet file, a folder of such shards or a glob of them
    # ("data/train-*.parquet"), or a folder written by datasets' save_to_disk.
    path: str
    # The files' format; auto tells it from the path (jsonl, parquet, or a save_to_disk folder,
    # hf_disk).
    format: FileFormat = "auto"
    split: str | None = None  # which split of a saved DatasetDict
    # Column renames applied to every row before anything reads it: {name in the file: name
    # used here}, e.g. {answer: ground_truth} for a reward that reads "ground_truth".
    columns: dict[str, str] = {}
    # Where Parquet shards are converted to memory-mapped Arrow (None: datasets' cache).
    cache_dir: str | None = None
    # raise stops at a malformed row, naming its file and row; skip leaves it out and counts it.
    on_bad_row: BadRowPolicy = "raise"

    @field_validator("path")
    @classmethod
    def _exists(cls, path: str) -> str:
        return check_path(path)

    @model_validator(mode="after")
    def _renames_distinct(self) -> FileSourceConfig:
        targets = list(self.columns.values())
        twice = sorted({t for t in targets if targets.count(t) > 1})
        if twice:
            raise ValueError(f"columns renames several columns to {twice}")
        return self


class ChatFileConfig(FileSourceConfig):
    """Conversations (SFT) or prompts (RL) from files; see the module for the formats read.

    With ``prompt_key`` set, the user turn comes from that column, and optional system and
    assistant turns from ``system_key`` and ``response_key``.
    """

    # Selects this source, rows in TRL's formats (messages, prompt/completion, text).
    source: Literal["chat_file"] = "chat_file"
    # Column holding a conversation (a list of messages).
    messages_key: str = "messages"
    # Column holding the user turn (a string); set it for data not in TRL's column names.
    prompt_key: str | None = None
    # With prompt_key, the column holding the assistant reply.
    response_key: str | None = None
    # With prompt_key, the column holding a system message.
    system_key: str | None = None
    # Columns handed to the environment (e.g. the answer); None: every column the messages
    # were not read from.
    env_info_keys: list[str] | None = None
    # The environment (env.<task_name>) that scores these rows.
    task_name: str | None = None


def text_or_messages(value: Any, role: str, what: str) -> list[dict[str, Any]]:
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


def _trl_row(cfg: ChatFileConfig, record: Row) -> tuple[list[dict[str, Any]], list[str], bool]:
    """Messages, the columns they came from and whether the row is plain text, for a row in
    one of TRL's formats."""
    if cfg.messages_key in record:
        return check_messages(record[cfg.messages_key], cfg.messages_key), [cfg.messages_key], False
    if "prompt" in record:
        messages = text_or_messages(record["prompt"], "user", "prompt")
        if "completion" not in record:
            return messages, ["prompt"], False
        completion = text_or_messages(record["completion"], "assistant", "completion")
        return messages + completion, ["prompt", "completion"], False
    if "text" in record:
        return [{"role": "assistant", "content": _text(record, "text")}], ["text"], True
    raise ValueError(
        f"no column {cfg.messages_key!r}, 'prompt' or 'text' (columns: {sorted(record)}); "
        "name the prompt column with prompt_key, or rename columns with 'columns'"
    )


def chat_row(cfg: ChatFileConfig, record: Row) -> Row:
    raw_text = False
    string_prompt = None
    if cfg.prompt_key is None:
        messages, used, raw_text = _trl_row(cfg, record)
        if used[0] == "prompt" and isinstance(record["prompt"], str):
            string_prompt = record["prompt"]
    else:
        string_prompt = _text(record, cfg.prompt_key)
        messages = [{"role": "user", "content": _text(record, cfg.prompt_key)}]
        used = [cfg.prompt_key]
        if cfg.system_key is not None:
            messages.insert(0, {"role": "system", "content": _text(record, cfg.system_key)})
            used.append(cfg.system_key)
        if cfg.response_key is not None:
            messages.append({"role": "assistant", "content": _text(record, cfg.response_key)})
            used.append(cfg.response_key)
    if cfg.env_info_keys is None:
        env_info = {k: v for k, v in record.items() if k not in used} or None
    else:
        env_info = {key: record[key] for key in cfg.env_info_keys} or None
    if string_prompt is not None:
        env_info = {**(env_info or {}), STRING_PROMPT_KEY: string_prompt}
    if record.get(TOOLS_KEY) is not None:  # None: a row without tools in a Parquet column
        env_info = {**(env_info or {}), TOOLS_KEY: check_tools(record[TOOLS_KEY], TOOLS_KEY)}
    elif env_info is not None:
        env_info = {k: v for k, v in env_info.items() if k != TOOLS_KEY} or None
    row = {"messages": messages, "extra_env_info": env_info, "task_name": cfg.task_name}
    if raw_text:
        row["raw_text"] = True
    return row


def _one_chat_row(cfg: ChatFileConfig, record: Row) -> list[Row]:
    return [chat_row(cfg, record)]


def load_chat_file(cfg: ChatFileConfig) -> RowDataset:
    return load_file_rows(
        cfg.path,
        cfg.format,
        cfg.split,
        partial(_one_chat_row, cfg),  # a partial, not a closure: rows pickle to Ray actors
        cfg.on_bad_row,
        cfg.columns,
        cfg.cache_dir,
    )
