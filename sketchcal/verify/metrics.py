"""Accuracy metrics of one decoding configuration against the full-state (standard) model.

- :class:`TokenMetrics`: per decoded token, KL(standard ‖ mode) of the next-token distributions,
  top-1 agreement with standard, and the negative log-likelihood of the true next token
  (→ perplexity); KL is also binned by the token's position p = 1..L in its window.
- :class:`ReadErrorMeter`: a runtime :class:`~sketchcal.runtime.Probe` that compares the
  checkpoint read ``S_cᵀu`` of every non-flush step as served (sketch, low-precision copy) with the
  exact one of the same checkpoint and effective query. Per layer it keeps ``Σ‖served − exact‖²``
  and ``Σ‖exact‖²``; the relative read error is their ratio, the definition of the fit's measured
  curves (:mod:`sketchcal.fit.curves`), so the numbers compare with the allocation's.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


def kl_per_token(logits_ref: Tensor, logits: Tensor) -> Tensor:
    """KL(p_ref ‖ p) per row: logits [..., vocab] → [...] float64 (computed row by row in float64)."""
    lp_ref = torch.log_softmax(logits_ref.double(), dim=-1)
    lp = torch.log_softmax(logits.double(), dim=-1)
    return (lp_ref.exp() * (lp_ref - lp)).sum(-1).clamp_min(0.0)


def nll_per_token(logits: Tensor, targets: Tensor) -> Tensor:
    """−log p(target) per row: logits [..., vocab], targets [...] → [...] float64."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    return -lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def percentile(values: Tensor, q: float) -> float:
    """The q-quantile (0..1) of a 1-D tensor; NaN when empty."""
    if values.numel() == 0:
        return math.nan
    return float(torch.quantile(values.double(), q))


LENGTH_BUCKETS = 8  # spans of the decoded positions that KL is reported over (verify's plot)


def length_edges(tokens: int, buckets: int = LENGTH_BUCKETS) -> list[int]:
    """Edges ``[0, …, tokens]`` of ``min(buckets, tokens)`` spans of equal length (the last one
    takes the remainder)."""
    n = max(1, min(buckets, tokens))
    step = tokens // n
    return [i * step for i in range(n)] + [tokens]


@dataclass
class TokenMetrics:
    """Running next-token metrics of one configuration over the decoded positions."""

    window: int
    kl: list[Tensor] = field(default_factory=list)  # [B, T] per batch
    agree: list[Tensor] = field(default_factory=list)
    nll: list[Tensor] = field(default_factory=list)
    kl_pos_sum: Tensor | None = None
    kl_pos_count: Tensor | None = None

    def add(self, logits_ref: Tensor, logits: Tensor, targets: Tensor, positions: Tensor) -> None:
        """One batch: logits [B, T, vocab], targets [B, T], positions [T] (window position 1..L)."""
        kls, agrees, nlls = [], [], []
        for b in range(logits.shape[0]):  # row by row: float64 log-softmax of a large vocabulary
            kls.append(kl_per_token(logits_ref[b], logits[b]).cpu())
            agrees.append((logits_ref[b].argmax(-1) == logits[b].argmax(-1)).cpu())
            nlls.append(nll_per_token(logits[b], targets[b]).cpu())
        kl = torch.stack(kls)
        self.kl.append(kl)
        self.agree.append(torch.stack(agrees).flatten())
        self.nll.append(torch.stack(nlls).flatten())
        idx = positions.cpu().long() - 1
        if self.kl_pos_sum is None:
            self.kl_pos_sum = torch.zeros(self.window, dtype=torch.float64)
            self.kl_pos_count = torch.zeros(self.window, dtype=torch.float64)
        self.kl_pos_sum.index_add_(0, idx, kl.sum(0))
        self.kl_pos_count.index_add_(0, idx, torch.full_like(idx, kl.shape[0], dtype=torch.float64))

    def summary(self) -> dict[str, float | list[float]]:
        kl = torch.cat(self.kl).flatten() if self.kl else torch.zeros(0, dtype=torch.float64)
        agree = torch.cat(self.agree) if self.agree else torch.zeros(0, dtype=torch.bool)
        nll = torch.cat(self.nll) if self.nll else torch.zeros(0, dtype=torch.float64)
        by_pos = []
        if self.kl_pos_sum is not None:
            by_pos = (self.kl_pos_sum / self.kl_pos_count.clamp_min(1)).tolist()
        return {
            "tokens": int(kl.numel()),
            "kl_mean": float(kl.mean()) if kl.numel() else math.nan,
            "kl_p99": percentile(kl, 0.99),
            "top1_agreement": float(agree.double().mean()) if agree.numel() else math.nan,
            "perplexity": math.exp(float(nll.mean())) if nll.numel() else math.nan,
            "kl_by_position": by_pos,
            "kl_by_length": self.by_length(),
        }

    def by_length(self, buckets: int = LENGTH_BUCKETS) -> list[float]:
        """Mean KL over each of ``buckets`` equal spans of the decoded positions (the last span takes
        the remainder): where in the sequence the error is; late positions, where the states are
        full, usually carry more."""
        if not self.kl:
            return []
        kl = torch.cat(self.kl)  # [N, T]
        edges = length_edges(kl.shape[1], buckets)
        return [float(kl[:, a:b].mean()) for a, b in itertools.pairwise(edges)]


class ReadErrorMeter:
    """Probe accumulating the relative read error of the served non-flush reads, per layer and position."""

    wants_exact = True

    def __init__(self, window: int):
        self.window = window
        self.err: dict[int, Tensor] = {}  # layer -> [L] Σ‖served − exact‖² by window position
        self.energy: dict[int, Tensor] = {}  # layer -> [L] Σ‖exact‖²

    def on_read(self, layer: int | None, positions: Tensor, approx: Tensor, exact: Tensor | None) -> None:
        if exact is None or layer is None:
            return
        diff = (approx.double() - exact.double()).pow(2).sum(dim=(0, 2, 3)).cpu()  # [n]
        energy = exact.double().pow(2).sum(dim=(0, 2, 3)).cpu()
        if layer not in self.err:
            self.err[layer] = torch.zeros(self.window, dtype=torch.float64)
            self.energy[layer] = torch.zeros(self.window, dtype=torch.float64)
        idx = positions.long() - 1
        self.err[layer].index_add_(0, idx, diff)
        self.energy[layer].index_add_(0, idx, energy)

    def on_flush(self, layer: int | None, checkpoint: Tensor) -> None:
        return None

    def per_layer(self) -> dict[int, float]:
        """Relative read error Σ‖Δ‖² / Σ‖exact‖² of each layer (0 for a layer never read)."""
        out = {}
        for layer in sorted(self.err):
            den = float(self.energy[layer].sum())
            out[layer] = float(self.err[layer].sum()) / den if den > 0 else 0.0
        return out
