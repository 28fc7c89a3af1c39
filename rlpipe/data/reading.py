"""Read table rows from parquet or jsonl files, turning every read failure into a DataError that names the file.

Both prompt and SFT datasets go through here so that the error rules (suffix, corrupt file, bad UTF-8, bad JSON,
non-object line) are the same everywhere. The sha256 of the source bytes is computed from the same bytes that were
parsed, so the lineage hash always describes exactly what was loaded.
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlpipe.errors import DataError

PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".ndjson")


@dataclass
class RawTable:
    """Rows of a source file as plain Python values, plus the file's identity for lineage."""

    path: str
    rows: list[dict[str, Any]]
    content_hash: str  # sha256 hex digest of the file bytes


def file_format(path: str | Path) -> str:
    """Return "parquet" or "jsonl" from the file suffix; any other suffix is a DataError."""
    suffix = Path(path).suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    raise DataError(
        f"unsupported file suffix {suffix!r}; expected one of {PARQUET_SUFFIXES + JSONL_SUFFIXES}", file=str(path)
    )


def read_rows(path: str | Path) -> RawTable:
    """Read every row of a parquet or jsonl file; raise DataError on unreadable, corrupt or empty input."""
    fmt = file_format(path)
    name = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read file: {exc}", file=name) from exc
    digest = hashlib.sha256(data).hexdigest()
    rows = _parquet_rows(data, name) if fmt == "parquet" else _jsonl_rows(data, name)
    if not rows:
        raise DataError("file holds no rows", file=name)
    return RawTable(path=name, rows=rows, content_hash=digest)


def _parquet_rows(data: bytes, name: str) -> list[dict[str, Any]]:
    """Decode parquet bytes into a list of row dicts (pyarrow gives lists/dicts as Python objects)."""
    try:
        table = pq.read_table(io.BytesIO(data))
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise DataError(f"not a readable parquet file (truncated or corrupt?): {exc}", file=name) from exc
    _warn_widened_int_columns(table, name)
    return table.to_pylist()


def _warn_widened_int_columns(table: pa.Table, name: str) -> None:
    """Report float columns that hold only whole numbers and some nulls: what pandas makes of an int column with
    a missing value. Their values changed type (10 -> 10.0); readers that match them as text must know."""
    for column_name, column in zip(table.column_names, table.columns, strict=True):
        if not pa.types.is_floating(column.type):
            continue
        values = column.to_pylist()
        present = [v for v in values if v is not None and v == v]  # v != v: NaN
        missing = len(values) - len(present)
        if missing and present and all(float(v).is_integer() for v in present):
            warnings.warn(
                f"file {name}, column {column_name!r}: {column.type} holding only whole numbers and "
                f"{missing} missing value(s), as pandas writes an int column with a gap; its values are "
                "read as floats (10 -> 10.0; ground truths are matched as their integers)",
                WidenedColumnWarning,
                stacklevel=3,
            )


class WidenedColumnWarning(UserWarning):
    """A column's type changed its values (ints stored as floats because of a missing value)."""


def _jsonl_rows(data: bytes, name: str) -> list[dict[str, Any]]:
    """Decode JSON Lines; blank lines are skipped, so row i is the i-th non-blank line (messages give the line)."""
    rows: list[dict[str, Any]] = []
    for line_no, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        row = len(rows)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"line {line_no} is not valid UTF-8: {exc}", file=name, row=row) from exc
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"line {line_no} is not valid JSON: {exc.msg} at column {exc.colno}", file=name, row=row
            ) from exc
        if not isinstance(obj, dict):
            raise DataError(f"line {line_no} is a JSON {type(obj).__name__}, expected an object", file=name, row=row)
        rows.append(obj)
    return rows
