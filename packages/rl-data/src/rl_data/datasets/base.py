"""Rows read from files, lazily, with where each came from, and the bad-row policy.

A file source is one file, a folder, or a glob of JSONL/Parquet shards, or a folder written by
``datasets.save_to_disk``. None of it is held in memory: JSONL shards keep the byte offset of
each line and read a line when its row is asked for; Parquet shards are converted once into
``datasets``' memory-mapped Arrow cache, and saved datasets are memory-mapped as they are. Rows
are checked once when the source is opened (a bad row is an error naming its file and row, or
is skipped), then converted again each time they are read.
"""

from __future__ import annotations

import glob
import json
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

import numpy as np

from rl_data.errors import BadRowPolicy, DataError, SkippedRow

FileFormat = Literal["auto", "jsonl", "parquet", "hf_disk"]
Row = dict[str, Any]
TaskSpec = dict[str, Any]  # rl_data.types.TaskDataSpec; a plain dict here to avoid the import

_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_PARQUET_SUFFIXES = (".parquet", ".pq")
# Files that make a folder a `datasets.save_to_disk` folder rather than a folder of shards.
_SAVED_DATASET_MARKERS = ("state.json", "dataset_dict.json")


class RowDataset(Sequence[Row]):
    """Rows in a canonical shape (see the source modules), each with its origin for errors.

    ``skipped`` lists the rows a source left out under ``on_bad_row: skip``. ``task_spec``
    (system prompt, prompt template) is how the rows' task is prompted; a
    :class:`~rl_data.processors.ProcessedDataset` given no task spec of its own uses it.
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
        self.task_spec: TaskSpec = {}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Row:  # type: ignore[override]
        return self.rows[i]

    def origin(self, i: int) -> tuple[str, int]:
        return self.origins[i]

    def select(self, indices: Sequence[int]) -> RowDataset:
        """These rows, in this order (splits and shuffles)."""
        out = RowDataset(
            [self.rows[i] for i in indices], [self.origins[i] for i in indices], self.skipped
        )
        out.task_spec = dict(self.task_spec)
        return out


# -- record sources: raw records of files, by index ------------------------------------------


class _JsonlShard:
    """One JSONL file: the byte offset and line number of each non-blank line.

    A line that is not JSON reads as a :class:`DataError`, so the caller's bad-row policy
    decides. The file is opened on first read in each process (a pickled shard reopens it).
    """

    def __init__(self, path: Path, limit: int | None = None) -> None:
        self.path = path
        # typed arrays, not lists: 8 bytes a line while counting millions of lines
        offsets, lines = array("q"), array("q")
        with path.open("rb") as f:
            offset = 0
            for n, line in enumerate(f, start=1):
                if limit is not None and len(offsets) >= limit:
                    break
                if line.strip():
                    offsets.append(offset)
                    lines.append(n)
                offset += len(line)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.lines = np.asarray(lines, dtype=np.int64)
        self._file: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_file": None}

    def __len__(self) -> int:
        return len(self.offsets)

    def record(self, i: int) -> Any:
        if self._file is None:
            self._file = self.path.open("rb")
        self._file.seek(int(self.offsets[i]))
        return self._parse(self._file.readline(), i)

    def iter_records(self) -> Iterator[Any]:
        """Every record in order, read sequentially (the check when a source is opened)."""
        with self.path.open("rb") as f:
            for i, offset in enumerate(self.offsets):
                f.seek(int(offset))
                yield self._parse(f.readline(), i)

    def _parse(self, line: bytes, i: int) -> Any:
        try:
            return json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            where = f" ({e.msg} at column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
            return DataError(f"not valid JSON{where}", str(self.path), int(self.lines[i]))

    def origin(self, i: int) -> tuple[str, int]:
        return str(self.path), int(self.lines[i])


class _ArrowSource:
    """A memory-mapped ``datasets.Dataset`` whose rows came from ``files`` (in order)."""

    def __init__(self, data: Any, files: list[tuple[str, int]]) -> None:
        self.data = data
        self.names = [name for name, _ in files]
        self.starts = np.cumsum([0] + [n for _, n in files])

    def __len__(self) -> int:
        return len(self.data)

    def record(self, i: int) -> Any:
        return self.data[int(i)]

    def iter_records(self) -> Iterator[Any]:
        # a batch of rows at a time: much faster than indexing row by row
        for batch in self.data.iter(batch_size=256):
            columns = list(batch)
            for values in zip(*(batch[c] for c in columns), strict=True):
                yield dict(zip(columns, values, strict=True))

    def origin(self, i: int) -> tuple[str, int]:
        shard = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.names[shard], int(i - self.starts[shard]) + 1


class _Records:
    """The records of several sources one after another."""

    def __init__(self, sources: list[Any]) -> None:
        self.sources = sources
        self.starts = np.cumsum([0] + [len(s) for s in sources])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _locate(self, i: int) -> tuple[Any, int]:
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.sources[k], int(i - self.starts[k])

    def record(self, i: int) -> Any:
        source, j = self._locate(i)
        return source.record(j)

    def iter_records(self) -> Iterator[Any]:
        for source in self.sources:
            yield from source.iter_records()

    def origin(self, i: int) -> tuple[str, int]:
        source, j = self._locate(i)
        return source.origin(j)


def resolve_files(path: str) -> tuple[FileFormat, list[Path]]:
    """The format and files that ``path`` names: a file, a saved dataset, a folder or a glob.

    A folder holds either a ``datasets.save_to_disk`` dataset or shards (its ``*.jsonl`` or
    ``*.parquet`` files, sorted by name, not its subfolders); a glob (``data/train-*.parquet``,
    ``data/**/*.jsonl``) names shards directly. All shards must have one format. Raises
    :class:`DataError` naming ``path`` when it names nothing readable.
    """
    p = Path(path)
    if any(c in path for c in "*?["):
        files = [Path(f) for f in sorted(glob.glob(path, recursive=True)) if Path(f).is_file()]
        if not files:
            raise DataError("no file matches this pattern", path)
    elif p.is_dir():
        if any((p / marker).is_file() for marker in _SAVED_DATASET_MARKERS):
            return "hf_disk", [p]
        files = sorted(
            f for f in p.iterdir() if f.suffix.lower() in _JSONL_SUFFIXES + _PARQUET_SUFFIXES
        )
        if not files:
            raise DataError(
                "folder holds neither a saved Hugging Face dataset nor .jsonl/.parquet files", path
            )
    elif p.is_file():
        files = [p]
    else:
        raise DataError("file not found", path)
    formats = {_format_of(f) for f in files}
    if len(formats) > 1:
        raise DataError(f"shards of more than one format ({sorted(formats)}); use one", path)
    return formats.pop(), files


def _format_of(path: Path) -> FileFormat:
    suffix = path.suffix.lower()
    if suffix in _JSONL_SUFFIXES:
        return "jsonl"
    if suffix in _PARQUET_SUFFIXES:
        return "parquet"
    raise DataError(
        f"cannot tell the format from the suffix {suffix!r}; set format to jsonl, parquet or"
        " hf_disk",
        str(path),
    )


def open_records(
    path: str, fmt: FileFormat = "auto", split: str | None = None, cache_dir: str | None = None
) -> _Records:
    """The raw records of a file source (see :func:`resolve_files`), read on demand; only the
    first ones inside :func:`sampled_rows`."""
    detected, files = resolve_files(path)
    fmt = detected if fmt == "auto" else fmt
    limit = _ROW_LIMIT.get()
    if fmt == "jsonl":
        sources: list[Any] = []
        for f in files:
            left = None if limit is None else limit - sum(len(s) for s in sources)
            if left == 0:
                break
            sources.append(_JsonlShard(f, left))
    elif fmt == "parquet":
        sources = [_parquet(files, cache_dir) if limit is None else _parquet_head(files, limit)]
    else:
        sources = [_saved_dataset(files[0], split, limit)]
    records = _Records(sources)
    if len(records) == 0:
        raise DataError("contains no rows", path)
    return records


def _parquet(files: list[Path], cache_dir: str | None) -> _ArrowSource:
    import datasets
    import pyarrow.parquet as pq

    counts = []
    for f in files:
        try:
            counts.append((str(f), pq.ParquetFile(f).metadata.num_rows))
        except Exception as e:  # pyarrow raises several types for unreadable files
            raise DataError(f"cannot read as Parquet: {e}", str(f)) from None
    # Converted once into datasets' Arrow cache (reused while the files are unchanged) and
    # memory-mapped from there: rows are paged in by the OS as they are read.
    data = datasets.Dataset.from_parquet(
        [str(f) for f in files], cache_dir=cache_dir, keep_in_memory=False
    )
    return _ArrowSource(data, counts)


def _parquet_head(files: list[Path], limit: int) -> _ArrowSource:
    """The first ``limit`` rows of Parquet shards, read straight from the files: a sample to
    check needs no conversion of the whole data into the Arrow cache."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables, counts = [], []
    for f in files:
        left = limit - sum(n for _, n in counts)
        if left <= 0:
            break
        try:
            batch = next(pq.ParquetFile(f).iter_batches(batch_size=left), None)
        except Exception as e:  # pyarrow raises several types for unreadable files
            raise DataError(f"cannot read as Parquet: {e}", str(f)) from None
        rows = 0 if batch is None else batch.num_rows
        if batch is not None:
            tables.append(pa.Table.from_batches([batch]).to_pylist())
        counts.append((str(f), rows))
    return _ArrowSource(_RecordList([r for table in tables for r in table]), counts)


class _RecordList(list):
    """Records in memory, read the way ``_ArrowSource`` reads a ``datasets.Dataset``."""

    def iter(self, batch_size: int) -> Iterator[dict[str, list[Any]]]:
        for start in range(0, len(self), batch_size):
            chunk = self[start : start + batch_size]
            yield {c: [r[c] for r in chunk] for c in (chunk[0] if chunk else {})}


def _saved_dataset(path: Path, split: str | None, limit: int | None = None) -> _ArrowSource:
    import datasets

    try:
        data = datasets.load_from_disk(str(path), keep_in_memory=False)
    except Exception as e:  # FileNotFoundError or a format error, with the library's message
        raise DataError(f"cannot load a saved Hugging Face dataset: {e}", str(path)) from None
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise DataError(f"has splits {sorted(data)}; set split to one of them", str(path))
        data = data[split]
    if limit is not None and len(data) > limit:
        data = data.select(range(limit))
    return _ArrowSource(data, [(str(path), len(data))])


def read_records(
    path: str | Path, fmt: FileFormat = "auto", split: str | None = None
) -> Iterator[tuple[int, Any]]:
    """``(row number, record)`` for each record of a file source, one at a time.

    Row numbers are 1-based: a JSONL file's line number, a table's row index + 1. A line that
    is not JSON is yielded as a :class:`DataError` instead of a record.
    """
    records = open_records(str(path), fmt, split)
    for i in range(len(records)):
        yield records.origin(i)[1], records.record(i)


# -- file rows: converted on access ----------------------------------------------------------


def renamed(record: Any, columns: Mapping[str, str]) -> Any:
    """``record`` with its columns renamed by ``columns`` (file name -> name the config reads).

    Raises ``ValueError`` naming a column of the map that the record lacks.
    """
    if not columns or not isinstance(record, dict):
        return record
    missing = [old for old in columns if old not in record]
    if missing:
        raise ValueError(
            f"column {missing[0]!r} of the rename map 'columns' is missing "
            f"(columns: {sorted(record)})"
        )
    return {columns.get(k, k): v for k, v in record.items()}


class FileRows(RowDataset):
    """Rows of a file source, converted from their records each time they are read.

    Opening checks every record once (so a bad row fails at setup, naming its file and row, or
    is skipped) and keeps only an index: record ``i``'s ``j``-th row for each row.
    """

    def __init__(
        self,
        records: _Records,
        convert: Callable[[Any], list[Row]],
        on_bad_row: BadRowPolicy,
        columns: Mapping[str, str] | None = None,
    ) -> None:
        self.records = records
        self.convert = convert
        self.columns = dict(columns or {})
        self.task_spec = {}
        self.skipped = []
        record_of, part_of = array("q"), array("q")  # row k is record_of[k]'s part_of[k]-th
        for i, record in enumerate(records.iter_records()):
            try:
                n = len(self._convert(i, record))
            except DataError as e:
                if on_bad_row == "raise":
                    raise
                self.skipped.append(SkippedRow(e.source or "", e.row or 0, e.reason))
                continue
            record_of.extend([i] * n)
            part_of.extend(range(n))
        if not record_of:
            raise DataError(f"no usable rows ({len(self.skipped)} skipped)", records.origin(0)[0])
        self.index = np.stack(
            [np.frombuffer(record_of, np.int64), np.frombuffer(part_of, np.int64)], 1
        )

    def _convert(self, i: int, record: Any = None) -> list[Row]:
        """Record ``i``'s rows, or a :class:`DataError` naming its file and row."""
        if record is None:
            record = self.records.record(i)
        source, n = self.records.origin(i)
        try:
            if isinstance(record, DataError):
                raise record
            if not isinstance(record, dict):
                raise ValueError(f"a row must be a JSON object, got {type(record).__name__}")
            return self.convert(renamed(record, self.columns))
        except KeyError as e:
            present = sorted(renamed(record, {})) if isinstance(record, dict) else []
            raise DataError(
                f"missing column {e.args[0]!r} (columns: {present})", source, n
            ) from None
        except ValueError as e:
            raise DataError(e.reason if isinstance(e, DataError) else str(e), source, n) from None

    @property
    def rows(self) -> list[Row]:  # type: ignore[override]
        """Every row, converted (in memory: for small data and tests)."""
        return [self[k] for k in range(len(self))]

    @property
    def origins(self) -> list[tuple[str, int]]:  # type: ignore[override]
        return [self.origin(k) for k in range(len(self))]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, k: int) -> Row:  # type: ignore[override]
        i, j = self.index[k]
        return self._convert(int(i))[int(j)]

    def origin(self, k: int) -> tuple[str, int]:
        return self.records.origin(int(self.index[k][0]))

    def select(self, indices: Sequence[int]) -> FileRows:
        out = object.__new__(FileRows)
        out.__dict__.update(self.__dict__)
        out.index = self.index[np.asarray(list(indices), dtype=np.int64).reshape(-1)]
        out.task_spec = dict(self.task_spec)
        return out


def load_file_rows(
    path: str,
    fmt: FileFormat,
    split: str | None,
    convert: Callable[[Any], list[Row]],
    on_bad_row: BadRowPolicy,
    columns: Mapping[str, str] | None = None,
    cache_dir: str | None = None,
) -> FileRows:
    """A file source's rows: each record renamed by ``columns`` and turned into rows by
    ``convert``, which raises ``ValueError`` (or ``KeyError`` for a missing column) for a bad
    record; that becomes a :class:`DataError` naming the file and row, or a skipped row."""
    return FileRows(open_records(path, fmt, split, cache_dir), convert, on_bad_row, columns)


# How many records each file source reads (None: all); set by ``sampled_rows``.
_ROW_LIMIT: ContextVar[int | None] = ContextVar("rl_data_row_limit", default=None)


@contextmanager
def sampled_rows(limit: int) -> Iterator[None]:
    """File sources opened inside read only their first ``limit`` records (across their
    shards, in order): the same loaders and checks as a run's, in bounded time, for checking
    data before a run (``rl ... --print-config``)."""
    token = _ROW_LIMIT.set(limit)
    try:
        yield
    finally:
        _ROW_LIMIT.reset(token)


# Whether config validation looks for data files (``deferred_path_checks`` turns it off).
_CHECK_PATHS: ContextVar[bool] = ContextVar("rl_data_check_paths", default=True)


@contextmanager
def deferred_path_checks() -> Iterator[None]:
    """Validate configs without looking for their data files: for a config whose files are
    written after validation (a translated NeMo RL recipe, whose datasets are converted only
    when it runs), validated again once they exist."""
    token = _CHECK_PATHS.set(False)
    try:
        yield
    finally:
        _CHECK_PATHS.reset(token)


def check_path(path: str) -> str:
    """``path`` if it names data (a file, folder or glob that matches), else a ``ValueError``
    saying what was looked for: config validation calls it, so a typo fails before a run."""
    if not _CHECK_PATHS.get():
        return path
    try:
        resolve_files(path)
    except DataError as e:
        raise ValueError(f"{e.reason}: {path!r} (relative paths start at {Path.cwd()})") from None
    return path
