"""Preference data: a prompt with a chosen and a rejected reply, or with ranked replies.

A preference row is ``{"prompt": messages, "chosen": messages, "rejected": messages}``, the
replies holding only what follows the prompt. Ranked replies become several rows.
"""

from __future__ import annotations

import itertools
from typing import Any, Literal

from rl_data.datasets.base import FileFormat, Row, RowDataset, collect_rows
from rl_data.datasets.chat import text_or_messages
from rl_data.errors import BadRowPolicy
from rl_distributed.config import ConfigModel


class PreferenceFileConfig(ConfigModel):
    """A JSONL/Parquet file or saved HF dataset of preferences.

    The prompt (``prompt_key``) is a string (one user turn) or a message list; replies are
    strings (one assistant turn) or message lists. With ``completions_key`` the row holds a list
    of replies ranked best first, each a reply or ``{"completion": reply, "score": number}``
    (sorted by score, highest first); ``pairs`` says which pairs it yields: the best against
    each other one, or every better/worse pair.
    """

    source: Literal["preference_file"] = "preference_file"
    path: str
    format: FileFormat = "auto"
    split: str | None = None
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    completions_key: str | None = None
    pairs: Literal["best_vs_rest", "all"] = "best_vs_rest"
    on_bad_row: BadRowPolicy = "raise"


def _ranked(value: Any, key: str) -> list[list[dict[str, str]]]:
    if not isinstance(value, list) or len(value) < 2:
        raise ValueError(f"column {key!r} must be a list of at least two ranked completions")
    if all(isinstance(c, dict) and "completion" in c for c in value):
        for i, c in enumerate(value):
            if not isinstance(c.get("score"), int | float):
                raise ValueError(f"{key}[{i}] has completion but no numeric 'score'")
        value = [c["completion"] for c in sorted(value, key=lambda c: -c["score"])]
    return [text_or_messages(c, "assistant", f"{key}[{i}]") for i, c in enumerate(value)]


def preference_rows(cfg: PreferenceFileConfig, record: Row) -> list[Row]:
    prompt = text_or_messages(record[cfg.prompt_key], "user", cfg.prompt_key)
    if cfg.completions_key is None:
        chosen = text_or_messages(record[cfg.chosen_key], "assistant", cfg.chosen_key)
        rejected = text_or_messages(record[cfg.rejected_key], "assistant", cfg.rejected_key)
        return [{"prompt": prompt, "chosen": chosen, "rejected": rejected}]
    ranked = _ranked(record[cfg.completions_key], cfg.completions_key)
    if cfg.pairs == "best_vs_rest":
        pairs = [(ranked[0], worse) for worse in ranked[1:]]
    else:
        pairs = list(itertools.combinations(ranked, 2))
    return [{"prompt": prompt, "chosen": c, "rejected": r} for c, r in pairs]


def load_preference_file(cfg: PreferenceFileConfig) -> RowDataset:
    return collect_rows(
        cfg.path, cfg.format, cfg.split, lambda record: preference_rows(cfg, record), cfg.on_bad_row
    )
