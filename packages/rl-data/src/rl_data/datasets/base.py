"""Rows read from files, with where each came from, and the bad-row policy."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from rl_data.errors import BadRowPolicy, DataError, SkippedRow

FileFormat = Literal["auto", "jsonl", "parquet", "hf_disk"]
Row = dict[str, Any]


class RowDataset(Sequence[Row]):
    """Rows in a canonical shape (see the source modules), each with its origin for errors.

    ``skipped`` lists the rows a source left out under ``on_bad_row: skip``.
    """

    def __init__(
        self,
        rows: list[Row],
        origins: list[tuple[str, int]],
        skipped: Sequence[SkippedRow] = (),
    ) -> None:
        if len(rows) != len(origins):
            raise ValueError("every row needs an origin")
        self.rows = rows
        self.origins = origins  # (source, 1-based row) for each row
        self.skipped = list(skipped)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Row:  # type: ignore[override]
        return self.rows[i]

    def origin(self, i: int) -> tuple[str, int]:
        return self.origins[i]

    def select(self, indices: Sequence[int]) -> RowDataset:
        """These rows, in this order (splits and shuffles)."""
        return RowDataset(
            [self.rows[i] for i in indices], [self.origins[i] for i in indices], self.skipped
        )


def read_records(
    path: str | Path, fmt: FileFormat = "auto", split: str | None = None
) -> Iterator[tuple[int, Any]]:
    """``(row number, record)`` for each record of a JSONL, Parquet or saved HF dataset.

    Row numbers are 1-based: a JSONL file's line number, a table's row index + 1. A line that is
    not JSON is yielded as a :class:`DataError` instead of a record, so the caller's bad-row
    policy decides. An empty file is always an error.
    """
    path = Path(path)
    if not path.exists():
        raise DataError("file not found", str(path))
    fmt = _detect_format(path) if fmt == "auto" else fmt
    records = {"jsonl": _jsonl, "parquet": _parquet, "hf_disk": _hf_disk}[fmt](path, split)
    empty = True
    for n, record in records:
        empty = False
        yield n, record
    if empty:
        raise DataError("contains no rows", str(path))


def _detect_format(path: Path) -> FileFormat:
    if path.is_dir():
        return "hf_disk"
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise DataError(
        f"cannot tell the format from the suffix {suffix!r}; set format to jsonl, parquet or"
        " hf_disk",
        str(path),
    )


def _jsonl(path: Path, split: str | None) -> Iterator[tuple[int, Any]]:
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                yield n, DataError(f"not valid JSON ({e.msg} at column {e.colno})", str(path), n)


def _parquet(path: Path, split: str | None) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for unreadable files
        raise DataError(f"cannot read as Parquet: {e}", str(path)) from None
    yield from enumerate(table.to_pylist(), start=1)


def _hf_disk(path: Path, split: str | None) -> Iterator[tuple[int, Any]]:
    import datasets

    try:
        data = datasets.load_from_disk(str(path))
    except Exception as e:  # FileNotFoundError or a format error, with the library's message
        raise DataError(f"cannot load a saved Hugging Face dataset: {e}", str(path)) from None
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise DataError(f"has splits {sorted(data)}; set split to one of them", str(path))
        data = data[split]
    yield from enumerate(data, start=1)


def collect_rows(
    path: str | Path,
    fmt: FileFormat,
    split: str | None,
    convert: Callable[[Any], list[Row]],
    on_bad_row: BadRowPolicy,
) -> RowDataset:
    """Read a file and turn each record into rows with ``convert``.

    ``convert`` raises ``ValueError`` (or ``KeyError`` for a missing column) for a bad record;
    that becomes a :class:`DataError` naming the file and row, or a :class:`SkippedRow`.
    """
    source = str(path)
    rows: list[Row] = []
    origins: list[tuple[str, int]] = []
    skipped: list[SkippedRow] = []
    for n, record in read_records(path, fmt, split):
        try:
            if isinstance(record, DataError):
                raise record
            if not isinstance(record, dict):
                raise ValueError(f"a row must be a JSON object, got {type(record).__name__}")
            converted = convert(record)
        except KeyError as e:
            present = sorted(record) if isinstance(record, dict) else []
            reason = f"missing column {e.args[0]!r} (columns: {present})"
            _bad(reason, source, n, on_bad_row, skipped)
            continue
        except ValueError as e:
            reason = e.reason if isinstance(e, DataError) else str(e)
            _bad(reason, source, n, on_bad_row, skipped)
            continue
        rows.extend(converted)
        origins.extend([(source, n)] * len(converted))
    if not rows:
        raise DataError(f"no usable rows ({len(skipped)} skipped)", source)
    return RowDataset(rows, origins, skipped)


def _bad(
    reason: str, source: str, row: int, policy: BadRowPolicy, skipped: list[SkippedRow]
) -> None:
    if policy == "raise":
        raise DataError(reason, source, row)
    skipped.append(SkippedRow(source, row, reason))
