"""Associative recall built from the tokenizer's vocabulary: can the decoder look a value up?

Each sequence is a text prefix (the first ``prompt`` tokens of a held-out sample, run as prefill),
optionally more held-out text, then ``n_pairs`` key–value pairs ``k₁ v₁ k₂ v₂ …`` and ``n_queries``
queries ``k v`` repeating earlier keys, all after the prefix as decode steps (teacher-forced). Keys
and values are distinct whole-word tokens of the vocabulary (`` word`` pieces), so the only way to
predict a queried value is to recall the pair from the recurrent (or attention) state several
windows back. The score is top-1 accuracy of the value after each queried key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from sketchcal.errors import SketchcalError


def word_tokens(tokenizer: Any, min_chars: int = 3) -> list[int]:
    """Ids of single tokens that decode to one whole word with a leading space (`` word``)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    out = []
    for i in range(len(tokenizer)):
        if i in special:
            continue
        s = tokenizer.decode([i])
        if s.startswith(" ") and s[1:].isalpha() and len(s) - 1 >= min_chars:
            out.append(i)
    return out


@dataclass
class RecallSet:
    """Sequences [N, prompt + decoded] and where the answers are.

    ``query_pos`` [N, Q]: positions whose next-token logits must predict ``answers`` [N, Q].
    """

    ids: Tensor
    query_pos: Tensor
    answers: Tensor
    n_pairs: int

    @property
    def num_queries(self) -> int:
        return int(self.answers.numel())


def build_recall(
    tokenizer: Any,
    prefixes: list[list[int]],
    decoded: int,
    *,
    seed: int = 0,
    max_queries: int = 16,
    text: list[list[int]] | None = None,
) -> RecallSet:
    """One recall sequence per prefix, with ``decoded`` tokens after it: the tokens of ``text``
    (one row per prefix, decoded as ordinary text; default none), then pairs and queries in the
    rest."""
    lead = len(text[0]) if text else 0
    if text and any(len(t) != lead for t in text):
        raise ValueError("the text rows must have one length")
    span = decoded - lead
    n_queries = max(1, min(max_queries, span // 8))
    n_pairs = (span - 2 * n_queries) // 2
    if n_pairs < n_queries:
        raise SketchcalError(f"the retrieval test needs at least 4 decoded tokens (--tokens), got {decoded}")
    vocab = word_tokens(tokenizer)
    if len(vocab) < 4 * n_pairs:
        vocab = word_tokens(tokenizer, min_chars=1)
    if len(vocab) < 2 * n_pairs + 1:
        raise SketchcalError(
            f"the tokenizer has {len(vocab)} whole-word tokens, too few for {n_pairs} distinct "
            "key-value pairs; lower --tokens or skip the retrieval test"
        )
    gen = torch.Generator().manual_seed(seed)
    vocab_t = torch.tensor(vocab)
    rows, qpos, answers = [], [], []
    for prefix in prefixes:
        words = vocab_t[torch.randperm(len(vocab), generator=gen)[: 2 * n_pairs + 1]]
        keys, values, filler = words[:n_pairs], words[n_pairs : 2 * n_pairs], int(words[-1])
        pairs = torch.stack([keys, values], dim=1).flatten()
        which = torch.randperm(n_pairs, generator=gen)[:n_queries]
        queries = torch.stack([keys[which], values[which]], dim=1).flatten()
        tail = torch.full((span - 2 * n_pairs - 2 * n_queries,), filler)  # 0 or 1 token
        lead_ids = torch.tensor(text[len(rows)] if text else [], dtype=torch.long)
        rows.append(torch.cat([torch.tensor(prefix, dtype=torch.long), lead_ids, pairs, tail, queries]))
        start = len(prefix) + lead + 2 * n_pairs + tail.numel()
        qpos.append(start + 2 * torch.arange(n_queries))
        answers.append(values[which])
    return RecallSet(torch.stack(rows), torch.stack(qpos), torch.stack(answers), n_pairs)


def recall_hits(logits: Tensor, query_pos: Tensor, answers: Tensor, offset: int) -> Tensor:
    """Top-1 hits [N, Q] (bool). ``logits`` [N, T, vocab] hold positions ``offset`` onward."""
    idx = (query_pos - offset).to(logits.device)
    picked = logits.gather(1, idx[..., None].expand(-1, -1, logits.shape[-1]))
    return (picked.argmax(-1).cpu() == answers).cpu()
