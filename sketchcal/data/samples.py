"""Calibration samples: token-id sequences cut from a document source, deterministically.

Plain text (``chat_template=False``): the documents of a split are tokenised one by one (no special
tokens added) and joined with the tokenizer's eos token between consecutive documents, the same as
tokenising ``eos.join(documents)``; the stream is cut into consecutive, non-overlapping windows of
exactly ``seq_len`` tokens (a final partial window is dropped), and the samples are a seeded random
choice of those windows, without repetition.

Chat (``chat_template=True``): the same, with documents joined by a blank line instead of eos and
windows of ``seq_len - T`` tokens, T being the length of the chat template around an empty message.
Each chosen window is decoded to text, wrapped as one user message with
``apply_chat_template(..., add_generation_prompt=True)`` and tokenised again; if the result exceeds
``seq_len`` (re-tokenisation can differ at the edges), text is cut from its end until it fits. Chat
samples therefore have variable length ``<= seq_len`` and always hold the complete template.

Only as much of a source is tokenised as the samples need, with a margin: a split stops taking
documents once its stream holds ``max(8 * samples * window, 2**20)`` tokens, so the result depends
on the source, the tokenizer and the arguments only. Calib and held-out samples use separate random
generators derived from ``seed``; the global torch/numpy/python RNG states are neither used nor
changed.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sketchcal.data.sources import HELDOUT_FRACTION, describe_source, is_builtin, iter_labelled_documents
from sketchcal.errors import SketchcalError

_OVERSAMPLE = 8
_MIN_POOL_TOKENS = 1 << 20
_TOKENIZE_BATCH = 64
_CHAT_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class SampleSet:
    """Token-id samples for calibration and for held-out evaluation.

    ``calib``: ``num_samples`` lists of token ids (exactly ``seq_len`` each for plain text, at most
    ``seq_len`` with a chat template); ``heldout``: ``heldout_samples`` such lists, cut only from
    held-out documents; ``info``: JSON-serialisable description for manifests: ``source``,
    ``text_field``, ``revision``, ``heldout_rule``, ``seq_len``, ``seed``, ``chat_template``, and per
    split (``{"calib": ..., "heldout": ...}``) ``samples``, ``documents`` (documents read),
    ``pool_tokens`` (tokens in the stream they make), ``windows`` (windows available), ``tokens``
    (tokens in the samples) and ``sha256`` (of the documents read, each as its UTF-8 byte count, ``:``
    and its UTF-8 bytes; None for a split that was not read).
    """

    calib: list[list[int]]
    heldout: list[list[int]]
    info: dict[str, Any]


@dataclass
class _Pool:
    """The token stream of one split, grown document by document until it holds ``target`` tokens."""

    name: str
    wanted: int
    window: int
    separator: list[int]
    target: int
    chunks: list[np.ndarray] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    n_tokens: int = 0
    n_docs: int = 0
    sha: Any = field(default_factory=hashlib.sha256)

    @property
    def full(self) -> bool:
        return self.n_tokens >= self.target

    def add(self, text: str, tokenizer: Any) -> None:
        data = text.encode("utf-8")
        self.sha.update(f"{len(data)}:".encode() + data)
        self.pending.append(text)
        self.n_docs += 1
        if len(self.pending) >= _TOKENIZE_BATCH:
            self.flush(tokenizer)

    def flush(self, tokenizer: Any) -> None:
        if not self.pending:
            return
        encoded = _encode(tokenizer, self.pending)
        self.pending = []
        for ids in encoded:
            if self.chunks:
                self.chunks.append(np.asarray(self.separator, dtype=np.int64))
                self.n_tokens += len(self.separator)
            self.chunks.append(np.asarray(ids, dtype=np.int64))
            self.n_tokens += len(ids)

    def stream(self) -> np.ndarray:
        return np.concatenate(self.chunks) if self.chunks else np.zeros(0, dtype=np.int64)


def build_samples(
    tokenizer: Any,
    source: str | os.PathLike | None = None,
    *,
    num_samples: int,
    seq_len: int,
    heldout_samples: int = 0,
    seed: int = 0,
    chat_template: bool = False,
    text_field: str = "text",
    revision: str | None = None,
    evaluation: bool = False,
    option_names: Mapping[str, str] | None = None,
) -> SampleSet:
    """Cut ``num_samples`` calib and ``heldout_samples`` held-out samples of ``seq_len`` tokens.

    ``tokenizer`` is a transformers tokenizer; ``source``, ``text_field`` and ``revision`` are as in
    :func:`sketchcal.data.load_documents`. Held-out samples come only from held-out documents (the
    builtin ``heldout.jsonl``, or the content-hash split of any other source), calib samples only from
    the others. With ``evaluation`` every document of a source other than the builtin corpus is
    held-out (a file given for evaluation is used whole) and ``num_samples`` may be 0.
    ``option_names`` names the caller's options for ``num_samples``, ``heldout_samples`` and
    ``seq_len`` in error messages (default: these argument names). Raises :class:`SketchcalError` for
    bad arguments, a tokenizer without eos token (plain) or chat template (chat), an unusable source,
    or too few tokens for the samples asked for.
    """
    names = {"num_samples": "num_samples", "heldout_samples": "heldout_samples", "seq_len": "seq_len"}
    names.update(option_names or {})
    _check_int("num_samples", num_samples, 0 if evaluation else 1)
    _check_int("seq_len", seq_len, 1)
    _check_int("heldout_samples", heldout_samples, 0)
    _check_int("seed", seed, None)
    num_samples, seq_len, heldout_samples, seed = map(int, (num_samples, seq_len, heldout_samples, seed))
    if chat_template:
        overhead = len(_chat_ids(tokenizer, ""))
        window = seq_len - overhead
        if window < 1:
            raise SketchcalError(
                f"seq_len {seq_len} leaves no room for text: the chat template alone takes {overhead} "
                f"tokens; use a seq_len above {overhead}"
            )
        separator = _encode(tokenizer, [_CHAT_SEPARATOR])[0]
    else:
        overhead = 0
        window = seq_len
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise SketchcalError("the tokenizer has no eos token to separate documents; set its eos_token")
        separator = [int(eos)]

    pools = {
        name: _Pool(name, wanted, window, separator, _target_tokens(wanted, window))
        for name, wanted in (("calib", num_samples), ("heldout", heldout_samples))
    }
    labelled = iter_labelled_documents(
        source, text_field=text_field, revision=revision, include_heldout=heldout_samples > 0
    )
    whole = evaluation and not is_builtin(source)
    for text, held in labelled:
        pool = pools["heldout" if held or whole else "calib"]
        if not pool.full:
            pool.add(text, tokenizer)
        elif all(p.full for p in pools.values()):
            break
    for pool in pools.values():
        pool.flush(tokenizer)

    name = describe_source(source)
    samples: dict[str, list[list[int]]] = {}
    windows: dict[str, int] = {}
    for split, pool in pools.items():
        if pool.wanted == 0:
            samples[split], windows[split] = [], 0
            continue
        picked, windows[split] = _pick_windows(
            pool, _generator(seed, split), name, overhead, chat_template, names
        )
        if chat_template:
            picked = [_fit_chat(tokenizer, ids, seq_len) for ids in picked]
        samples[split] = picked

    info: dict[str, Any] = {
        "source": name,
        "text_field": None if is_builtin(source) else text_field,
        "revision": revision,
        "heldout_rule": (
            "builtin heldout.jsonl"
            if is_builtin(source)
            else "every document"
            if whole
            else f"sha256 of the document text, {HELDOUT_FRACTION:.0%} of documents"
        ),
        "seq_len": seq_len,
        "seed": seed,
        "chat_template": bool(chat_template),
        "samples": {s: len(v) for s, v in samples.items()},
        "documents": {s: p.n_docs for s, p in pools.items()},
        "pool_tokens": {s: p.n_tokens for s, p in pools.items()},
        "windows": windows,
        "tokens": {s: sum(len(x) for x in v) for s, v in samples.items()},
        "sha256": {s: p.sha.hexdigest() if p.n_docs else None for s, p in pools.items()},
    }
    return SampleSet(calib=samples["calib"], heldout=samples["heldout"], info=info)


def _target_tokens(wanted: int, window: int) -> int:
    return 0 if wanted == 0 else max(_OVERSAMPLE * wanted * window, _MIN_POOL_TOKENS)


def _pick_windows(
    pool: _Pool, generator: torch.Generator, source: str, overhead: int, chat: bool, names: Mapping[str, str]
) -> tuple[list[list[int]], int]:
    """``pool.wanted`` distinct windows in random order, and how many windows the stream has."""
    if pool.n_docs == 0:
        raise SketchcalError(
            f"data source {source!r} has no non-empty {pool.name} documents"
            + (
                ""
                if pool.name == "calib"
                else f" (about {HELDOUT_FRACTION:.0%} of a source's documents are held out); "
                f"use {names['heldout_samples']} 0 or a source with more documents"
            )
        )
    stream = pool.stream()
    available = len(stream) // pool.window
    if available < pool.wanted:
        length = (
            f"{pool.window} text tokens (seq_len minus {overhead} for the chat template)"
            if chat
            else f"{pool.window} tokens"
        )
        arg = names["num_samples" if pool.name == "calib" else "heldout_samples"]
        raise SketchcalError(
            f"the {pool.name} split of data source {source!r} has {len(stream)} tokens in {pool.n_docs} "
            f"documents, enough for {available} samples of {length}, but {pool.wanted} were asked for: "
            f"lower {arg} to {available} or less, use a shorter {names['seq_len']}, or a larger data source"
        )
    order = torch.randperm(available, generator=generator)[: pool.wanted].tolist()
    return [stream[i * pool.window : (i + 1) * pool.window].tolist() for i in order], available


def _fit_chat(tokenizer: Any, body: list[int], seq_len: int) -> list[int]:
    """The window's text as one templated user message, cut from its end to fit ``seq_len`` tokens."""
    while True:
        text = tokenizer.decode(body).strip().strip("\ufffd").strip()
        ids = _chat_ids(tokenizer, text)
        if len(ids) <= seq_len or not body:
            return ids
        body = body[: max(0, len(body) - (len(ids) - seq_len))]


def _chat_ids(tokenizer: Any, text: str) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise SketchcalError(
            "chat_template=True but the tokenizer has no chat template; calibrate on plain text instead"
        )
    messages = [{"role": "user", "content": text}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return _encode(tokenizer, [prompt])[0]


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added, no over-length warnings."""
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]]


def _generator(seed: int, split: str) -> torch.Generator:
    """A private CPU generator for one split, derived from ``seed`` (any int, negative ones too)."""
    digest = hashlib.sha256(f"sketchcal-samples:{seed}:{split}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "big") >> 1)


def _check_int(name: str, value: Any, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise SketchcalError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise SketchcalError(f"{name} must be at least {minimum}, got {value}")
