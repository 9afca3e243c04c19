"""Errors that point at the data that caused them.

Every problem with input data is raised as a :class:`DataError` naming the file and the row
(1-based, as an editor shows it), so a user can open the file and fix it. Sources configured with
``on_bad_row: skip`` instead record a :class:`SkippedRow` and go on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

BadRowPolicy = Literal["raise", "skip"]


class DataError(ValueError):
    """Bad input data, with where it came from."""

    def __init__(self, reason: str, source: str | None = None, row: int | None = None) -> None:
        self.reason = reason
        self.source = source
        self.row = row
        where = ""
        if source is not None:
            where = f"{source}, row {row}: " if row is not None else f"{source}: "
        super().__init__(where + reason)


class TemplateError(ValueError):
    """A chat template that cannot be rendered, or cannot be tokenised message by message."""


@dataclass(frozen=True)
class SkippedRow:
    """A row left out because the source was told to skip bad rows."""

    source: str
    row: int
    reason: str

    def __str__(self) -> str:
        return f"{self.source}, row {self.row}: {self.reason}"
