"""Preference data: a prompt with a chosen and a rejected reply, or with ranked replies.

A preference row is ``{"prompt": messages, "chosen": messages, "rejected": messages}``, the
replies holding only what follows the prompt. Ranked replies become several rows.

TRL's preference formats load as they are: with an explicit prompt column, or with an implicit
prompt, where ``chosen`` and ``rejected`` are whole conversations (or texts) and the prompt is
what they share at the start.
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import Any, Literal

from rl_data.datasets.base import Row, RowDataset, load_file_rows
from rl_data.datasets.chat import FileSourceConfig, text_or_messages


class PreferenceFileConfig(FileSourceConfig):
    """A JSONL/Parquet file or saved HF dataset of preferences.

    The prompt (``prompt_key``) is a string (one user turn) or a message list; replies are
    strings (one assistant turn) or message lists. With ``completions_key`` the row holds a list
    of replies ranked best first, each a reply or ``{"completion": reply, "score": number}``
    (sorted by score, highest first); ``pairs`` says which pairs it yields: the best against
    each other one, or every better/worse pair. A row without ``prompt_key`` has an implicit
    prompt (see the module).
    """

    # Selects this source, preference pairs (explicit or implicit prompt, or ranked completions).
    source: Literal["preference_file"] = "preference_file"
    # Column holding the prompt (a string or messages); rows without it have an implicit prompt.
    prompt_key: str = "prompt"
    # Column holding the preferred reply.
    chosen_key: str = "chosen"
    # Column holding the other reply.
    rejected_key: str = "rejected"
    # Column holding replies ranked best first, instead of chosen/rejected.
    completions_key: str | None = None
    # With completions_key, best_vs_rest (the best against each other one) or all (every
    # better/worse pair).
    pairs: Literal["best_vs_rest", "all"] = "best_vs_rest"


def _ranked(value: Any, key: str) -> list[list[dict[str, str]]]:
    if not isinstance(value, list) or len(value) < 2:
        raise ValueError(f"column {key!r} must be a list of at least two ranked completions")
    if all(isinstance(c, dict) and "completion" in c for c in value):
        for i, c in enumerate(value):
            if not isinstance(c.get("score"), int | float):
                raise ValueError(f"{key}[{i}] has completion but no numeric 'score'")
        value = [c["completion"] for c in sorted(value, key=lambda c: -c["score"])]
    return [text_or_messages(c, "assistant", f"{key}[{i}]") for i, c in enumerate(value)]


def _split_text(chosen: str, rejected: str) -> tuple[str, str, str]:
    """The shared start of two texts, cut at a word boundary, and what follows in each."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    # back to the last whitespace, which goes with the replies: "The sky is" + " blue."
    space = max(chosen.rfind(" ", 0, n), chosen.rfind("\n", 0, n))
    cut = space if space > 0 else n
    return chosen[:cut], chosen[cut:], rejected[cut:]


def _implicit_prompt(cfg: PreferenceFileConfig, record: Row) -> Row:
    chosen, rejected = record[cfg.chosen_key], record[cfg.rejected_key]
    if isinstance(chosen, str) and isinstance(rejected, str):
        prompt, chosen, rejected = _split_text(chosen, rejected)
        if not prompt:
            raise ValueError(
                f"no prompt column {cfg.prompt_key!r}, and {cfg.chosen_key!r} and "
                f"{cfg.rejected_key!r} share no text at the start to take as the prompt"
            )
        return {
            "prompt": [{"role": "user", "content": prompt}],
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}],
        }
    chosen = text_or_messages(chosen, "assistant", cfg.chosen_key)
    rejected = text_or_messages(rejected, "assistant", cfg.rejected_key)
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n == 0 or n == len(chosen) or n == len(rejected):
        raise ValueError(
            f"no prompt column {cfg.prompt_key!r}, and {cfg.chosen_key!r} and "
            f"{cfg.rejected_key!r} do not start with the same messages and then differ"
        )
    return {"prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


def preference_rows(cfg: PreferenceFileConfig, record: Row) -> list[Row]:
    if cfg.prompt_key not in record and cfg.completions_key is None:
        return [_implicit_prompt(cfg, record)]
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
    return load_file_rows(
        cfg.path,
        cfg.format,
        cfg.split,
        partial(preference_rows, cfg),
        cfg.on_bad_row,
        cfg.columns,
        cfg.cache_dir,
    )
