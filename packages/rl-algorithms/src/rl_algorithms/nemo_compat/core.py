"""The pieces of a translation: rule kinds, the context rules see, and the result."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


class Refuse(Exception):
    """Raised by a conversion: the value asks for something we lack (the message says what)."""


@dataclass(frozen=True)
class Entry:
    key: str  # the NeMo key
    value: Any
    target: str | None = None  # our key (translated entries)
    reason: str = ""  # why ignored / refused, or a note on the translation


@dataclass(frozen=True)
class To:
    """Translated to ``target`` (``{0}``, ``{1}`` stand for what ``*`` / ``**`` matched)."""

    target: str
    convert: Callable[[Any, Context], Any] | None = None
    note: str = ""


@dataclass(frozen=True)
class Ignore:
    """No meaning here, whatever the value."""

    reason: str


@dataclass(frozen=True)
class Unless:
    """Ignored when the value is neutral (one of ``neutral``, or the predicate holds), refused
    otherwise: ``would`` says what the key would have done."""

    neutral: tuple[Any, ...] | Callable[[Any, Context], bool]
    would: str


@dataclass(frozen=True)
class Call:
    """A key whose translation needs code (several targets, or a look at other keys)."""

    fn: Callable[[Context, str, Any], None]


Rule = To | Ignore | Unless | Call


@dataclass
class Translation:
    """Our config (a plain dict, before defaults and validation) and what became of each key."""

    algorithm: str
    config: dict[str, Any] = field(default_factory=dict)
    translated: list[Entry] = field(default_factory=list)
    ignored: list[Entry] = field(default_factory=list)
    refused: list[Entry] = field(default_factory=list)
    # Data to write before the run (converted datasets, generated games): see .datasets.
    data_jobs: list[Any] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{len(self.translated)} keys translated, {len(self.ignored)} ignored, "
            f"{len(self.refused)} refused"
        )

    def ignored_report(self) -> str:
        """One line per reason; the keys of a switched-off section as ``section.*``."""
        by_reason: dict[str, list[str]] = {}
        for e in self.ignored:
            by_reason.setdefault(e.reason, []).append(e.key)
        lines = []
        for reason, keys in by_reason.items():
            off = re.match(r"section (\S+) is off", reason)
            shown = f"{off.group(1)}.* ({len(keys)} keys)" if off else ", ".join(keys)
            lines.append(f"  {shown}: {reason}")
        return "NeMo RL keys ignored:\n" + "\n".join(lines)

    def refused_issues(self) -> list[Any]:
        from rl_distributed.config import ConfigIssue

        return [
            ConfigIssue(e.key, "nemo_refused", f"{e.value!r}: {e.reason}") for e in self.refused
        ]

    def prepare(self, config: Any) -> Any:
        """Before the run (not for ``--print-config``): hub ids to local model directories and
        NeMo's datasets to our files; raises ``FileNotFoundError`` saying where it looked."""
        from rl_algorithms.nemo_compat.datasets import resolve_hub_paths

        resolve_hub_paths(config)
        for job in self.data_jobs:
            job.write(config)
        return config


class Context:
    """What rules see: the whole (resolved) NeMo recipe, and where results go."""

    def __init__(
        self, tree: dict[str, Any], algorithm: str, source: str | None = None, section: str = ""
    ) -> None:
        self.tree = tree
        # The NeMo section walked as ``policy`` (``value``, ``teacher``); "" for the recipe.
        self.section = section
        self.result = Translation(algorithm)
        self.done: set[str] = set()
        self.source = source  # the recipe file (relative prompt files are found from it)

    @property
    def algorithm(self) -> str:
        return self.result.algorithm

    def get(self, key: str, default: Any = None) -> Any:
        node: Any = self.tree
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def ours(self, key: str) -> Any:
        """A value already translated (None when not yet)."""
        node: Any = self.result.config
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def has(self, key: str) -> bool:
        return self.get(key, _ABSENT) is not _ABSENT

    def put(self, nemo_key: str, value: Any, target: str, note: str = "", ours: Any = None) -> None:
        """``target`` gets ``ours`` (``value`` itself when None) and the key counts translated."""
        _set(self.result.config, target, value if ours is None else ours)
        self.record(nemo_key, value, target, note)

    def record(self, nemo_key: str, value: Any, target: str, note: str = "") -> None:
        """The key counts translated into ``target``, which code around it fills in."""
        self.result.translated.append(Entry(nemo_key, value, target, note))
        self.done.add(nemo_key)

    def set_ours(self, target: str, value: Any) -> None:
        """A value of ours that follows from keys already recorded (no entry of its own)."""
        _set(self.result.config, target, value)

    def ignore(self, nemo_key: str, value: Any, reason: str) -> None:
        self.result.ignored.append(Entry(nemo_key, value, None, reason))
        self.done.add(nemo_key)

    def refuse(self, nemo_key: str, value: Any, reason: str) -> None:
        self.result.refused.append(Entry(nemo_key, value, None, reason))
        self.done.add(nemo_key)

    def leaves(self, prefix: str) -> Iterator[tuple[str, Any]]:
        """The leaf keys under ``prefix`` (itself if it is a leaf; none if it is absent)."""
        node = self.get(prefix, _ABSENT)
        if isinstance(node, dict) and node:
            yield from flatten(node, prefix)
        elif node is not _ABSENT:
            yield prefix, node


def _set(tree: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[last] = value


def flatten(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Leaf keys; an empty mapping and a list are leaves (values in their own right)."""
    for key, value in tree.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            yield from flatten(value, full)
        else:
            yield full, value


_ABSENT = object()
