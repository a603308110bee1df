"""Documents from local files: ``.txt``, ``.jsonl`` and ``.parquet``, or a directory of them.

Every reader yields the non-empty documents of its file in file order, as ``str``; a document that is
empty or only whitespace is skipped. Problems are one-line :class:`SketchcalError`\\ s that name the
file (and line, for JSON Lines).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sketchcal.errors import SketchcalError

SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".parquet")
_PARQUET_BATCH_ROWS = 1024


def iter_path_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """Documents of a supported file, or of every supported file under a directory.

    A directory is walked recursively; files are read in the order of their relative POSIX paths,
    hidden files and folders (names starting with ``.``) and files of other types are ignored.
    Problems with the path itself (no supported file, unsupported extension, unreadable Parquet
    file or missing column) are raised here, before any document is read.
    """
    if not path.is_dir():
        return iter_file_documents(path, text_field)
    files = [
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix.lower() in SUPPORTED_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    ]
    if not files:
        raise SketchcalError(f"directory {path} holds no {', '.join(SUPPORTED_SUFFIXES)} files")
    files.sort(key=lambda p: p.relative_to(path).as_posix())
    return (doc for file in files for doc in iter_file_documents(file, text_field))


def iter_file_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """Documents of one ``.txt``, ``.jsonl`` or ``.parquet`` file (chosen by its extension)."""
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return iter_txt(path)
    if suffix == ".jsonl":
        return iter_jsonl(path, text_field)
    if suffix == ".parquet":
        return iter_parquet(path, text_field)
    raise SketchcalError(
        f"unsupported data file {path}: use a {', '.join(SUPPORTED_SUFFIXES)} file or a directory of them"
    )


def iter_txt(path: Path) -> Iterator[str]:
    """Plain UTF-8 text; documents are separated by one or more blank (or whitespace-only) lines.

    Each document is its lines joined with ``\\n``, stripped at both ends.
    """
    lines: list[str] = []
    try:
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    lines.append(line.rstrip("\n"))
                elif lines:
                    yield "\n".join(lines).strip()
                    lines = []
    except UnicodeDecodeError as err:
        raise SketchcalError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start})") from err
    if lines:
        yield "\n".join(lines).strip()


def iter_jsonl(path: Path, text_field: str = "text") -> Iterator[str]:
    """JSON Lines: one JSON object per line, the document in its string field ``text_field``.

    Blank lines are skipped, and so are rows whose field is ``null`` or an empty string.
    """
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise SketchcalError(f"{path}:{lineno}: not valid JSON ({err.msg})") from err
                if not isinstance(row, dict):
                    raise SketchcalError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
                if text_field not in row:
                    fields = ", ".join(repr(k) for k in list(row)[:10]) or "none"
                    raise SketchcalError(
                        f"{path}:{lineno}: no field {text_field!r} (fields: {fields}); "
                        "choose the text field with --text-field"
                    )
                value = row[text_field]
                if value is None:
                    continue
                if not isinstance(value, str):
                    raise SketchcalError(
                        f"{path}:{lineno}: field {text_field!r} is a {type(value).__name__}, not a string"
                    )
                if value.strip():
                    yield value
    except UnicodeDecodeError as err:
        raise SketchcalError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start})") from err


def iter_parquet(path: Path, text_field: str = "text") -> Iterator[str]:
    """Parquet: the string column ``text_field``, read in row batches (null and empty values skipped).

    The file is opened and its schema checked now; rows are read lazily.
    """
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as err:
        raise SketchcalError(
            f"reading {path} needs the optional pyarrow package: pip install 'sketchcal[data]'"
        ) from err
    try:
        pfile = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise SketchcalError(f"cannot read parquet file {path}: {err}") from err
    schema = pfile.schema_arrow
    if text_field not in schema.names:
        columns = ", ".join(repr(n) for n in schema.names[:10]) or "none"
        raise SketchcalError(
            f"{path}: no column {text_field!r} (columns: {columns}); choose the text column with --text-field"
        )
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or _is_string_view(pa, kind)):
        raise SketchcalError(f"{path}: column {text_field!r} has type {kind}, not string")
    return _parquet_rows(pfile, text_field)


def _parquet_rows(pfile: Any, text_field: str) -> Iterator[str]:
    for batch in pfile.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_field]):
        for value in batch.column(0).to_pylist():
            if value and value.strip():
                yield value


def _is_string_view(pa: Any, kind: Any) -> bool:
    """pyarrow >= 16 has a third string type, string_view."""
    check = getattr(pa.types, "is_string_view", None)
    return bool(check and check(kind))
