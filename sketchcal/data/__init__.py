"""Calibration data: documents from a source, and deterministic token samples cut from them.

- :func:`load_documents` / :func:`iter_documents`: the non-empty documents of a split (``"calib"``,
  ``"heldout"`` or ``"all"``) of a source: ``None``/``"builtin"`` (the shipped corpus of Python
  standard-library docstrings), a local ``.txt``/``.jsonl``/``.parquet`` file or a directory of them,
  or a Hugging Face dataset ``DATASET_ID[:CONFIG[:SPLIT]]`` (needs ``pip install sketchcal[data]``).
- :func:`build_samples` -> :class:`SampleSet`: calib and held-out token-id samples plus a
  JSON-serialisable ``info`` dict for manifests.
- :func:`builtin_tokenizer_path`: the small byte-level BPE tokenizer shipped with the package
  (vocabulary 2048; ``<|endoftext|>`` = 0 is eos and pad, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2).

Held-out documents never feed calib samples: the builtin corpus ships separate files, every other
source is split by a hash of each document's text (:func:`is_heldout_document`).
"""

from __future__ import annotations

from sketchcal.data.samples import SampleSet, build_samples
from sketchcal.data.sources import (
    BUILTIN,
    HELDOUT_FRACTION,
    SPLITS,
    builtin_tokenizer_path,
    describe_source,
    is_builtin,
    is_heldout_document,
    iter_documents,
    iter_labelled_documents,
    load_documents,
)

__all__ = [
    "BUILTIN",
    "HELDOUT_FRACTION",
    "SPLITS",
    "SampleSet",
    "build_samples",
    "builtin_tokenizer_path",
    "describe_source",
    "is_builtin",
    "is_heldout_document",
    "iter_documents",
    "iter_labelled_documents",
    "load_documents",
]
