"""Dataset sources, selected by ``source`` in the config, and train/validation splits.

Each source reads or generates rows in a canonical shape (chat rows or preference rows, see
:mod:`rl_data.datasets.chat` and :mod:`rl_data.datasets.preference`); a processor then turns
rows into tokenised samples. New sources register with :func:`register_source`.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Collection, Mapping
from typing import Annotated, Any

import numpy as np
from pydantic import Field, field_validator, model_validator

from rl_data.datasets.base import FileRows, RowDataset, read_records, sampled_rows
from rl_data.datasets.chat import ChatFileConfig, load_chat_file
from rl_data.datasets.preference import PreferenceFileConfig, load_preference_file
from rl_data.datasets.procedural import (
    ArithmeticConfig,
    ReasoningGymConfig,
    load_arithmetic,
    load_reasoning_gym,
    reasoning_gym_task_names,
)
from rl_data.errors import DataError
from rl_data.types import STRING_PROMPT_KEY
from rl_distributed.config import ConfigModel

DATASET_SOURCES: dict[str, Callable[[Any], RowDataset]] = {
    "chat_file": load_chat_file,
    "preference_file": load_preference_file,
    "reasoning_gym": load_reasoning_gym,
    "arithmetic": load_arithmetic,
}

DatasetConfig = Annotated[
    ChatFileConfig | PreferenceFileConfig | ReasoningGymConfig | ArithmeticConfig,
    Field(discriminator="source"),
]


def register_source(name: str, loader: Callable[[Any], RowDataset]) -> None:
    """Make ``loader(cfg)`` the source for configs with ``source == name``.

    The config must be a :class:`ConfigModel` with a ``source`` field; recipes whose typed
    config should accept it extend their own union with it.
    """
    DATASET_SOURCES[name] = loader


def load_dataset(cfg: Any) -> RowDataset:
    """The rows of one dataset config (a typed config or a plain mapping)."""
    if isinstance(cfg, dict):
        from pydantic import TypeAdapter

        cfg = TypeAdapter(DatasetConfig).validate_python(cfg)
    loader = DATASET_SOURCES.get(cfg.source)
    if loader is None:
        raise ValueError(f"unknown dataset source {cfg.source!r}; known: {sorted(DATASET_SOURCES)}")
    return loader(cfg)


class DataConfig(ConfigModel):
    """Train data, and validation data either from its own source or held out of train.

    ``system_prompt`` is put first in every conversation that has no system message;
    ``prompt_template`` is a format string the user's text is put into (as ``{}`` or
    ``{prompt}``): the last user turn of a prompt, the first of an SFT conversation.
    """

    # The training dataset, one of the sources below (chosen by source).
    train: DatasetConfig
    # A validation dataset of its own; None holds validation_fraction of train out instead.
    validation: DatasetConfig | None = None
    # Share of train held out for validation (0, none, unless validation is given).
    validation_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    seed: int = 0  # which rows are held out
    # Put first in every conversation that has no system message.
    system_prompt: str | None = None
    # A format string the user's text goes into (as {} or {prompt}), e.g. to ask for an answer
    # format.
    prompt_template: str | None = None

    @model_validator(mode="after")
    def _one_validation(self) -> DataConfig:
        if self.validation is not None and self.validation_fraction > 0:
            raise ValueError("give either 'validation' or 'validation_fraction', not both")
        return self

    @field_validator("prompt_template")
    @classmethod
    def _fills_in_the_prompt(cls, template: str | None) -> str | None:
        if template is None:
            return None
        # Only bare {} and {prompt}: str.format would also follow "{prompt.__class__}".
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
        if not fields or any(f not in ("", "prompt") for f in fields):
            raise ValueError(
                f"{template!r} must contain {{}} or {{prompt}} (where the user's text goes) and "
                "no other {...} field; write literal braces as {{ and }}"
            )
        return template

    @property
    def task_spec(self) -> dict[str, Any]:
        return {"system_prompt": self.system_prompt, "prompt_template": self.prompt_template}


def load_splits(cfg: DataConfig) -> dict[str, RowDataset]:
    """``{"train": ..., "validation": ...}`` (validation only when configured).

    A held-out split is a seeded random subset of train, the same for the same seed and data.
    """
    splits = _splits(cfg)
    for rows in splits.values():
        rows.task_spec = {**rows.task_spec, **cfg.task_spec}
    return splits


def _splits(cfg: DataConfig) -> dict[str, RowDataset]:
    train = load_dataset(cfg.train)
    if cfg.validation is not None:
        return {"train": train, "validation": load_dataset(cfg.validation)}
    if cfg.validation_fraction == 0:
        return {"train": train}
    n_val = max(1, round(len(train) * cfg.validation_fraction))
    if n_val >= len(train):
        raise ValueError(
            f"validation_fraction {cfg.validation_fraction} of {len(train)} rows leaves no train rows"
        )
    order = np.random.default_rng(cfg.seed).permutation(len(train)).tolist()
    return {
        "train": train.select(sorted(order[n_val:])),
        "validation": train.select(sorted(order[:n_val])),
    }


def require_env_info(rows: RowDataset, needs: Mapping[str | None, Collection[str]]) -> None:
    """Refuse rows whose ``extra_env_info`` lacks a column their task's reward reads.

    ``needs`` maps a task name to the columns its environment (or reward function) reads, e.g.
    ``{"math": ["ground_truth"]}``. Without this check such a row would be scored 0 every time,
    and nothing would say why. Raises :class:`DataError` naming the column, the file and the
    row, with the columns the row has; meant for setup, before any worker starts.
    """
    if not any(needs.values()):
        return
    for i in range(len(rows)):
        row = rows[i]
        task = row.get("task_name")
        info = row.get("extra_env_info") or {}
        missing = [c for c in needs.get(task, ()) if c not in info]
        if missing:
            source, n = rows.origin(i)
            raise DataError(
                f"no column {missing[0]!r}, which task {task!r}'s reward reads (the row has "
                f"{sorted(k for k in info if k != STRING_PROMPT_KEY)}); rename the column that holds it with "
                f"columns: {{<its name>: {missing[0]}}}",
                source,
                n,
            )


__all__ = [
    "DATASET_SOURCES",
    "ArithmeticConfig",
    "ChatFileConfig",
    "DataConfig",
    "DatasetConfig",
    "FileRows",
    "PreferenceFileConfig",
    "ReasoningGymConfig",
    "RowDataset",
    "load_dataset",
    "load_splits",
    "read_records",
    "reasoning_gym_task_names",
    "register_source",
    "require_env_info",
    "sampled_rows",
]
