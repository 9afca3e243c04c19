"""Processors: how a dataset row becomes a tokenised sample.

A processor is a plain function ``(row, task_spec) -> draft`` that only arranges messages: it
applies the task's system prompt and prompt template and picks what the environment gets. It
returns a *chat draft* (``message_log``, ``extra_env_info``, ``task_name``,
``add_generation_prompt``) or a *preference draft* (``chosen`` and ``rejected`` message logs,
prompt included). Tokenising and the length limit are the same for every processor and happen in
:class:`ProcessedDataset`, batched over many rows, so a new processor is a few lines.

Processors are found by registered name (``sft``, ``prompt``, ``preference``) or by import path
(``my_pkg.my_module:my_processor``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rl_data.datasets.base import Row, RowDataset
from rl_data.errors import DataError, TemplateError
from rl_data.messages import message_log_length, tokenize_message_logs, truncate_message_log
from rl_data.templates import RAW_TEXT_TEMPLATE, ChatTemplate, Tools
from rl_data.types import (
    TENSOR_KEYS,
    TOOLS_KEY,
    DatumSpec,
    MessageLog,
    PreferenceDatumSpec,
    TaskDataSpec,
)

Processor = Callable[[Row, TaskDataSpec], dict[str, Any]]
PROCESSORS: dict[str, Processor] = {}


def register_processor(name: str) -> Callable[[Processor], Processor]:
    def register(fn: Processor) -> Processor:
        PROCESSORS[name] = fn
        return fn

    return register


def get_processor(name: str | Processor) -> Processor:
    """A registered processor, or one imported from ``module:attr`` / ``module.attr``."""
    if callable(name):
        return name
    if name in PROCESSORS:
        return PROCESSORS[name]
    module, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if not sep:
        raise ValueError(f"unknown processor {name!r}; registered: {sorted(PROCESSORS)}")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import processor {name!r}: {e}") from None
    if not callable(fn):
        raise ValueError(f"processor {name!r} is not callable")
    return fn


def _with_task_spec(
    messages: list[dict[str, str]], spec: TaskDataSpec, prompt_at: int | None
) -> list[dict[str, str]]:
    messages = [dict(m) for m in messages]
    template = spec.get("prompt_template")
    if template and prompt_at is not None:
        text = messages[prompt_at]["content"]
        messages[prompt_at]["content"] = template.format(text, prompt=text)
    system = spec.get("system_prompt")
    if system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return messages


def _last_user(messages: list[dict[str, str]]) -> int | None:
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    return users[-1] if users else None


@register_processor("sft")
def sft_processor(row: Row, spec: TaskDataSpec) -> dict[str, Any]:
    """The whole conversation; the loss will fall on its assistant turns."""
    messages = row["messages"]
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("an SFT conversation needs at least one assistant message")
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    raw = bool(row.get("raw_text"))  # plain text: no system prompt or template around it
    return {
        "message_log": messages
        if raw
        else _with_task_spec(messages, spec, users[0] if users else None),
        "extra_env_info": row.get("extra_env_info"),
        "task_name": row.get("task_name") or spec.get("task_name"),
        "add_generation_prompt": False,
        "raw_text": raw,
    }


@register_processor("prompt")
def prompt_processor(row: Row, spec: TaskDataSpec) -> dict[str, Any]:
    """A prompt for generation: the conversation up to its first assistant turn, whose header
    the template appends; the prompt template applies to the last user turn."""
    if row.get("raw_text"):
        raise ValueError(
            "a 'text' row is plain text for SFT; a prompt needs 'prompt' or 'messages'"
        )
    messages = row["messages"]
    first_assistant = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    messages = messages[:first_assistant]
    if not messages:
        raise ValueError("a prompt needs at least one message before the first assistant turn")
    return {
        "message_log": _with_task_spec(messages, spec, _last_user(messages)),
        "extra_env_info": row.get("extra_env_info"),
        "task_name": row.get("task_name") or spec.get("task_name"),
        "add_generation_prompt": True,
    }


@register_processor("preference")
def preference_processor(row: Row, spec: TaskDataSpec) -> dict[str, Any]:
    prompt = _with_task_spec(row["prompt"], spec, _last_user(row["prompt"]))
    return {"chosen": prompt + row["chosen"], "rejected": prompt + row["rejected"]}


def _fresh_log(messages: list[dict[str, Any]]) -> MessageLog:
    # copies without tensors (tokenised anew), keeping what templates read (tool_calls...)
    return [{k: v for k, v in m.items() if k not in TENSOR_KEYS} for m in messages]  # type: ignore[misc]


class ProcessedDataset(Sequence[Any]):
    """Rows turned into :class:`DatumSpec` (or :class:`PreferenceDatumSpec`) on access.

    ``__getitems__`` (what :class:`~rl_data.loader.StatefulDataLoader` calls) tokenises a whole
    batch in one call into the tokenizer. A sample longer than ``max_seq_length`` tokens keeps
    its place: it is cut to ``max_seq_length`` and gets ``loss_multiplier = 0``, so batch sizes
    and sample order do not depend on lengths.

    ``task_spec`` defaults to the rows' own (``RowDataset.task_spec``: the data config's system
    prompt and prompt template). A conversation is rendered with the tools its draft's
    ``extra_env_info`` holds under :data:`~rl_data.types.TOOLS_KEY` (a row's ``tools``
    column; else ``default_tools[task_name]``, the tools its task's environment offers, which
    are then put there for the environment too). Plain-text rows (a ``text`` column, ``raw_text`` drafts) are
    tokenised as their text followed by the EOS token, with no chat template.
    """

    def __init__(
        self,
        rows: RowDataset,
        tokenizer: Any,
        template: ChatTemplate,
        processor: str | Processor = "sft",
        task_spec: TaskDataSpec | None = None,
        max_seq_length: int | None = None,
        default_tools: Mapping[str, Tools] | None = None,
    ) -> None:
        self.rows = rows
        self.default_tools = dict(default_tools or {})
        self.tokenizer = tokenizer
        self.template = template
        self.processor = get_processor(processor)
        self.task_spec: TaskDataSpec = task_spec or dict(getattr(rows, "task_spec", {}))  # type: ignore[assignment]
        self.raw_template = ChatTemplate(RAW_TEXT_TEMPLATE, template.special_tokens)
        self.max_seq_length = max_seq_length

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        drafts = [self._draft(i) for i in indices]
        # one tokenizer call per template and generation-prompt setting, over the whole batch
        for raw, gen in ((False, False), (False, True), (True, False)):
            logs, tools = [], []  # each log with the tools its conversation is offered
            for d in drafts:
                if d.get("add_generation_prompt", False) == gen and d.get("raw_text", False) == raw:
                    offered = (d.get("extra_env_info") or {}).get(TOOLS_KEY)
                    logs += _logs(d)
                    tools += [offered] * len(_logs(d))
            template = self.raw_template if raw else self.template
            try:
                tokenize_message_logs(logs, self.tokenizer, template, gen, tools)
            except TemplateError as e:
                raise TemplateError(f"{e} (batch of rows {list(indices)})") from None
        return [self._finish(i, d) for i, d in zip(indices, drafts, strict=True)]

    def _draft(self, i: int) -> dict[str, Any]:
        try:
            draft = self.processor(self.rows[i], self.task_spec)
        except (KeyError, ValueError, TypeError) as e:
            source, row = self.rows.origin(i)
            reason = f"missing key {e.args[0]!r}" if isinstance(e, KeyError) else str(e)
            raise DataError(f"processor failed: {reason}", source, row) from None
        if "message_log" in draft:
            draft["message_log"] = _fresh_log(draft["message_log"])
            info = draft.get("extra_env_info") or {}
            tools = self.default_tools.get(draft.get("task_name"))  # type: ignore[arg-type]
            if tools is not None and TOOLS_KEY not in info:
                draft["extra_env_info"] = {**info, TOOLS_KEY: tools}
        elif "chosen" in draft and "rejected" in draft:
            draft["chosen"], draft["rejected"] = (
                _fresh_log(draft["chosen"]),
                _fresh_log(draft["rejected"]),
            )
        else:
            raise TypeError(
                "a processor must return a dict with 'message_log', or with 'chosen' and "
                f"'rejected'; got keys {sorted(draft)}"
            )
        return draft

    def _fit(self, log: MessageLog) -> tuple[MessageLog, bool]:
        if self.max_seq_length is None or message_log_length(log) <= self.max_seq_length:
            return log, True
        return truncate_message_log(log, self.max_seq_length), False

    def _finish(self, i: int, draft: dict[str, Any]) -> DatumSpec | PreferenceDatumSpec:
        if "message_log" in draft:
            log, fits = self._fit(draft["message_log"])
            datum: DatumSpec = {
                "message_log": log,
                "length": message_log_length(log),
                "extra_env_info": draft.get("extra_env_info"),
                "loss_multiplier": 1.0 if fits else 0.0,
                "idx": i,
            }
            if draft.get("task_name"):
                datum["task_name"] = draft["task_name"]
            return datum
        chosen, chosen_fits = self._fit(draft["chosen"])
        rejected, rejected_fits = self._fit(draft["rejected"])
        return {
            "message_log_chosen": chosen,
            "message_log_rejected": rejected,
            "length_chosen": message_log_length(chosen),
            "length_rejected": message_log_length(rejected),
            "loss_multiplier": 1.0 if chosen_fits and rejected_fits else 0.0,
            "idx": i,
        }


def _logs(draft: dict[str, Any]) -> list[MessageLog]:
    return (
        [draft["message_log"]] if "message_log" in draft else [draft["chosen"], draft["rejected"]]
    )
