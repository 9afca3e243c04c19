"""ConfigError and the per-key problems it carries."""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ConfigIssue:
    """One problem found in a config: where it is, what was there, and what was wanted."""

    key: str
    """Dotted path to the offending key (list indices as numbers: ``a.groups.1.lr``)."""
    kind: str
    """Pydantic's error type (``literal_error``, ``missing``, ``extra_forbidden``, ...) or
    ``interpolation`` / ``mandatory`` for values that could not be resolved."""
    expected: str
    """What would have been accepted, e.g. ``one of 'adam', 'sgd'`` or ``int``."""
    value: Any = None
    """The offending value (``None`` for missing keys)."""

    def __str__(self) -> str:
        if self.kind == "missing":
            return f"{self.key}: missing required key — expected {self.expected}"
        if self.kind == "extra_forbidden":
            return f"{self.key}: got {short_repr(self.value)} — {self.expected}"
        if self.kind == "interpolation":
            return f"{self.key}: cannot resolve {self.value!r} — {self.expected}"
        if self.kind == "mandatory":
            return f"{self.key}: got '???' — {self.expected}"
        return f"{self.key}: got {short_repr(self.value)} — expected {self.expected}"


class ConfigError(ValueError):
    """A config could not be loaded, overridden, resolved or validated.

    The message is meant for humans; ``errors`` holds the same problems as
    :class:`ConfigIssue` records (empty for file-level problems such as a missing file).
    """

    def __init__(self, message: str, errors: Sequence[ConfigIssue] = ()) -> None:
        super().__init__(message)
        self.errors: list[ConfigIssue] = list(errors)


# Tracebacks and reprs show the public home of these classes.
ConfigIssue.__module__ = ConfigError.__module__ = "rl_distributed.config"


_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 60
_repr.maxlist = _repr.maxdict = 5


def short_repr(value: Any) -> str:
    """``repr`` cut down to a line: long strings and big containers are elided."""
    return _repr.repr(value)


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """``"did you mean 'x'?"`` for the closest of ``choices``, or ``""`` if none is close."""
    close = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    return f"did you mean {', '.join(repr(c) for c in close)}?" if close else ""
