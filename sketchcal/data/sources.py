"""Where calibration documents come from, and which of them are held out.

A *source* is one of

- ``None`` or ``"builtin"``: the corpus shipped in ``sketchcal/data/corpus`` (Python standard-library
  docstrings; its ``calib.jsonl`` and ``heldout.jsonl`` are the two splits);
- a local ``.txt`` (documents separated by blank lines), ``.jsonl`` (one JSON object per line, the
  text in field ``text_field``) or ``.parquet`` (string column ``text_field``) file, or a directory
  of such files;
- otherwise a Hugging Face dataset, ``DATASET_ID[:CONFIG[:SPLIT]]`` (needs ``sketchcal[data]``).

Splits. The builtin corpus ships its own. Every other source is split by document content: a document
is held out when the SHA-256 of its text falls in the first :data:`HELDOUT_FRACTION` of the hash
range. The rule depends on nothing but the text (no seed, no position, no other document), so
calibration and verification agree on it whatever their seeds, and equal documents are never on both
sides.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from sketchcal.data.files import SUPPORTED_SUFFIXES, iter_path_documents
from sketchcal.data.hf_dataset import iter_hub_documents, parse_hub_source
from sketchcal.errors import SketchcalError

BUILTIN = "builtin"
SPLITS = ("calib", "heldout", "all")
HELDOUT_FRACTION = 0.1
CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "tokenizer"

_HELDOUT_SALT = b"sketchcal-heldout-v1\0"
# Extensions that mark a string as a file name rather than a dataset id, even when the file is missing.
_FILE_LIKE_SUFFIXES = (*SUPPORTED_SUFFIXES, ".json", ".csv", ".tsv", ".gz", ".zst", ".md", ".arrow")


def builtin_tokenizer_path() -> Path:
    """Directory of the small byte-level BPE tokenizer shipped with sketchcal (transformers-loadable)."""
    return TOKENIZER_DIR


def is_builtin(source: str | os.PathLike | None) -> bool:
    """True for ``None`` and ``"builtin"``."""
    return source is None or str(source) == BUILTIN


def is_heldout_document(text: str) -> bool:
    """The held-out rule for every source except the builtin corpus (see the module docstring)."""
    digest = hashlib.sha256(_HELDOUT_SALT + text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < HELDOUT_FRACTION * 2**64


def describe_source(source: str | os.PathLike | None) -> str:
    """The canonical name of a source for manifests: ``"builtin"``, or the string as given."""
    return BUILTIN if is_builtin(source) else str(source)


def iter_labelled_documents(
    source: str | os.PathLike | None = None,
    *,
    text_field: str = "text",
    revision: str | None = None,
    include_heldout: bool = True,
) -> Iterator[tuple[str, bool]]:
    """``(text, held_out)`` for every non-empty document of ``source``, in source order.

    For the builtin corpus the calib documents come first, then (if ``include_heldout``) the held-out
    ones. Errors about the source itself (missing file, unsupported extension, ``datasets`` not
    installed) are raised before the first document is produced.
    """
    if is_builtin(source):
        _no_revision(source, revision)
        files = [("calib", False), ("heldout", True)] if include_heldout else [("calib", False)]
        return ((text, held) for name, held in files for text in _iter_builtin(name))
    stream = _open_source(source, text_field, revision)
    return ((text, is_heldout_document(text)) for text in stream)


def iter_documents(
    source: str | os.PathLike | None = None,
    *,
    split: str = "calib",
    text_field: str = "text",
    revision: str | None = None,
) -> Iterator[str]:
    """The non-empty documents of one split (``"calib"``, ``"heldout"`` or ``"all"``), lazily."""
    if split not in SPLITS:
        raise SketchcalError(f"unknown data split {split!r}: use one of {', '.join(SPLITS)}")
    if is_builtin(source):
        _no_revision(source, revision)
        names = ["calib", "heldout"] if split == "all" else [split]
        return (text for name in names for text in _iter_builtin(name))
    stream = _open_source(source, text_field, revision)
    if split == "all":
        return stream
    want_heldout = split == "heldout"
    return (text for text in stream if is_heldout_document(text) == want_heldout)


def load_documents(
    source: str | os.PathLike | None = None,
    *,
    split: str = "calib",
    text_field: str = "text",
    revision: str | None = None,
    max_documents: int | None = None,
) -> list[str]:
    """The documents of one split of ``source`` as a list of non-empty strings, in source order.

    ``split`` is ``"calib"``, ``"heldout"`` or ``"all"``; ``text_field`` names the JSON field or
    Parquet/dataset column (the builtin corpus ignores it); ``revision`` is a Hugging Face dataset
    revision (only for dataset ids); ``max_documents`` stops early (useful for large datasets).
    Raises :class:`SketchcalError` when the split holds no non-empty document.
    """
    if max_documents is not None and max_documents < 1:
        raise SketchcalError(f"max_documents must be at least 1, got {max_documents}")
    docs: list[str] = []
    for text in iter_documents(source, split=split, text_field=text_field, revision=revision):
        docs.append(text)
        if max_documents is not None and len(docs) >= max_documents:
            break
    if not docs:
        name = describe_source(source)
        raise SketchcalError(f"data source {name!r} has no non-empty documents in split {split!r}")
    return docs


def _iter_builtin(name: str) -> Iterator[str]:
    path = CORPUS_DIR / f"{name}.jsonl"
    if not path.is_file():
        raise SketchcalError(f"the builtin corpus file {path} is missing; reinstall sketchcal")
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)["text"]


def _no_revision(source: str | os.PathLike | None, revision: str | None) -> None:
    if revision is not None:
        raise SketchcalError(
            f"a revision applies only to Hugging Face datasets, not to {describe_source(source)!r}; drop it"
        )


def _open_source(source: str | os.PathLike, text_field: str, revision: str | None) -> Iterator[str]:
    """Validate ``source`` now and return a lazy iterator over its documents."""
    if not isinstance(text_field, str) or not text_field:
        raise SketchcalError(f"the text field must be a non-empty string, got {text_field!r}")
    text = os.fspath(source)
    path = Path(text).expanduser()
    if path.exists():
        _no_revision(source, revision)
        return iter_path_documents(path, text_field)
    hub = None if _looks_like_path(text) else parse_hub_source(text)
    if hub is None:
        raise SketchcalError(
            f"data source {text!r} does not exist: pass an existing .txt/.jsonl/.parquet file or directory, "
            "'builtin', or a Hugging Face dataset id"
        )
    return iter_hub_documents(hub, text_field, revision)


def _looks_like_path(text: str) -> bool:
    return (
        text.startswith(("/", "./", "../", "~", "."))
        or "\\" in text
        or text.count("/") > 1
        or text.lower().endswith(_FILE_LIKE_SUFFIXES)
    )
