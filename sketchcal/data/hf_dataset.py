"""Documents from a Hugging Face dataset, through the optional ``datasets`` package.

A source string is ``DATASET_ID``, ``DATASET_ID:CONFIG`` or ``DATASET_ID:CONFIG:SPLIT`` (the config may
be empty: ``wikitext::validation``); the dataset split defaults to ``train``. Online the dataset is
streamed, so only the rows that are read are downloaded; when ``datasets`` says the Hub is offline
(``HF_HUB_OFFLINE=1``) it is loaded from the local cache instead, which is the mode that works offline.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sketchcal.errors import SketchcalError, first_line

DEFAULT_HF_SPLIT = "train"
_HF_SOURCE = re.compile(
    r"^(?P<repo>[A-Za-z0-9][\w.\-]*(?:/[A-Za-z0-9][\w.\-]*)?)(?::(?P<config>[\w.\-]*))?(?::(?P<split>\S+))?$"
)


@dataclass(frozen=True)
class HubSource:
    """A parsed Hugging Face source string."""

    repo: str
    config: str | None
    split: str

    def describe(self) -> str:
        """``repo`` plus whichever of config and split were given, for messages."""
        extra = [f"config {self.config!r}"] if self.config else []
        return f"Hugging Face dataset {self.repo!r} ({', '.join([*extra, f'split {self.split!r}'])})"


def parse_hub_source(source: str) -> HubSource | None:
    """The parts of ``DATASET_ID[:CONFIG[:SPLIT]]``, or None when ``source`` does not have that form."""
    match = _HF_SOURCE.match(source)
    if not match:
        return None
    return HubSource(match["repo"], match["config"] or None, match["split"] or DEFAULT_HF_SPLIT)


def iter_hub_documents(
    hub: HubSource, text_field: str = "text", revision: str | None = None
) -> Iterator[str]:
    """Non-empty string values of column ``text_field``, row by row, in the dataset's order.

    The dataset is opened now (so a missing ``datasets`` package or a bad id fails at once); rows are
    read lazily.
    """
    try:
        import datasets
    except ImportError as err:
        raise SketchcalError(
            f"{hub.describe()} needs the optional datasets package: pip install 'sketchcal[data]' "
            "(or pass a local .txt/.jsonl/.parquet file)"
        ) from err
    config = datasets.config
    offline = bool(getattr(config, "HF_HUB_OFFLINE", False) or getattr(config, "HF_DATASETS_OFFLINE", False))
    try:
        dataset = datasets.load_dataset(
            hub.repo, hub.config, split=hub.split, revision=revision, streaming=not offline
        )
    except Exception as err:
        raise SketchcalError(f"cannot load {hub.describe()}: {first_line(err)}") from err
    columns = getattr(dataset, "column_names", None)
    if columns is not None and text_field not in columns:
        names = ", ".join(repr(c) for c in list(columns)[:10]) or "none"
        raise SketchcalError(
            f"{hub.describe()} has no column {text_field!r} (columns: {names}); "
            "choose the text column with --text-field"
        )
    return _rows(dataset, hub, text_field)


def _rows(dataset: Any, hub: HubSource, text_field: str) -> Iterator[str]:
    rows = iter(dataset)
    index = 0
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as err:
            msg = f"reading {hub.describe()} failed at row {index}: {first_line(err)}"
            raise SketchcalError(msg) from err
        if text_field not in row:
            names = ", ".join(repr(c) for c in list(row)[:10]) or "none"
            msg = f"{hub.describe()} has no column {text_field!r} (columns: {names}); use --text-field"
            raise SketchcalError(msg)
        value = row[text_field]
        if value is not None and not isinstance(value, str):
            kind = type(value).__name__
            msg = f"{hub.describe()}: row {index} column {text_field!r} is a {kind}, not a string"
            raise SketchcalError(msg)
        if value and value.strip():
            yield value
        index += 1
