"""Per-head rank allocation under a mean-rank or byte budget (multiple-choice knapsack).

Objective: the mean over all heads of all layers of the predicted relative read error (calibration
moments, :mod:`sketchcal.fit.curves`), each head weighted equally. Options per head: the candidate
ranks of :mod:`sketchcal.fit.ranks` (0 = dense). Cost per head:

- ``rank=M``: the effective rank (m, or K for a dense head); constraint ``Σ cost ≤ M · #heads``,
  i.e. the mean rank (dense counted as K) is at most M;
- ``bytes_per_token=B``: the bytes per decoded token of :class:`~sketchcal.fit.traffic.TrafficModel`
  (computed per window of L tokens, so the costs are integers); constraint ``Σ bytes ≤ B``, B being
  per sequence and token for all mixer layers together.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from sketchcal.errors import SketchcalError
from sketchcal.fit.knapsack import InfeasibleBudget, solve_mckp
from sketchcal.fit.layer import LayerFit
from sketchcal.fit.ranks import SUPPORTED_RANKS, effective_rank
from sketchcal.fit.traffic import TrafficModel


@dataclass
class LayerAllocation:
    layer: int
    ranks: list[int]  # [H], 0 = dense
    mean_rank: float  # dense counted as K
    predicted_error: float  # mean over heads, calibration moments
    heldout_predicted_error: float | None  # mean over heads, held-out moments
    measured_error: float | None  # mean over heads, held-out windows
    bytes_per_token: float  # this layer's heads, sketch decoding
    replay_bytes_per_token: float
    standard_bytes_per_token: float


@dataclass
class Allocation:
    """The chosen ranks and what they cost and give. Errors are relative read errors (fractions)."""

    budget: dict[str, float]  # {"rank": M} or {"bytes_per_token": B}
    layers: list[LayerAllocation]
    mean_rank: float
    predicted_error: float
    heldout_predicted_error: float | None
    measured_error: float | None
    bytes_per_token: float
    replay_bytes_per_token: float
    standard_bytes_per_token: float
    optimal: bool  # True: exact knapsack optimum; else within ``gap_bound`` of it
    gap_bound: float  # bound on (objective − optimum), in mean relative error
    notes: list[str] = field(default_factory=list)

    @property
    def reduction_vs_standard(self) -> float:
        """Fraction of the standard decode's state traffic saved (1 − sketch / standard)."""
        return 1.0 - self.bytes_per_token / self.standard_bytes_per_token

    @property
    def reduction_vs_replay(self) -> float:
        """Fraction of ReplaySSM's state traffic saved (1 − sketch / replay)."""
        return 1.0 - self.bytes_per_token / self.replay_bytes_per_token

    def to_dict(self) -> dict:
        d = asdict(self)
        d["reduction_vs_standard"] = self.reduction_vs_standard
        d["reduction_vs_replay"] = self.reduction_vs_replay
        d["speedup_vs_standard"] = self.standard_bytes_per_token / self.bytes_per_token
        d["speedup_vs_replay"] = self.replay_bytes_per_token / self.bytes_per_token
        return d


def _mean(values: list[float]) -> float | None:
    vals = [v for v in values if math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def validate_budget(rank: float | None, bytes_per_token: float | None, max_k: int) -> None:
    if (rank is None) == (bytes_per_token is None):
        raise SketchcalError("give exactly one budget: --rank M (mean rank) or --bytes-per-token B")
    if rank is not None:
        if not math.isfinite(rank) or rank <= 0:
            raise SketchcalError(f"--rank must be a positive mean rank, got {rank}")
        if rank > max_k:
            raise SketchcalError(
                f"--rank {rank:g} exceeds the key dim K={max_k}; a mean rank of K already "
                "means every head reads its full state"
            )
    if bytes_per_token is not None and (not math.isfinite(bytes_per_token) or bytes_per_token <= 0):
        raise SketchcalError(f"--bytes-per-token must be positive, got {bytes_per_token}")


def allocate(
    fits: list[LayerFit],
    traffic: list[TrafficModel],
    *,
    rank: float | None = None,
    bytes_per_token: float | None = None,
    max_cells: int = 50_000_000,
) -> Allocation:
    """Choose every head's rank. Exactly one of ``rank`` / ``bytes_per_token`` must be given.

    Args:
        fits: one :class:`LayerFit` per layer (its ``predicted`` curves are the objective).
        traffic: the byte model of each layer, same order.
        rank: mean rank budget M (dense heads count as K), 0 < M ≤ max K.
        bytes_per_token: byte budget per sequence and decoded token, all mixer layers together.

    Raises:
        SketchcalError: a missing/double/invalid budget, or one that cannot be met.
    """
    if len(fits) != len(traffic) or not fits:
        raise ValueError("one traffic model per layer fit is needed")
    validate_budget(rank, bytes_per_token, max(f.key_dim for f in fits))
    window = traffic[0].window
    if any(t.window != window for t in traffic):
        raise ValueError("all layers must share the window length")
    costs: list[list[int]] = []
    values: list[list[float]] = []
    owners: list[tuple[int, int]] = []
    for li, (fit, tm) in enumerate(zip(fits, traffic, strict=True)):
        for h in range(fit.heads):
            if rank is not None:
                costs.append([effective_rank(m, fit.key_dim) for m in fit.ranks])
            else:
                costs.append([tm.window_bytes(m) for m in fit.ranks])
            values.append([float(x) for x in fit.predicted[h]])
            owners.append((li, h))
    n = len(costs)
    budget = math.floor(rank * n + 1e-9) if rank is not None else math.floor(bytes_per_token * window + 1e-6)
    try:
        res = solve_mckp(costs, values, budget, max_cells=max_cells)
    except InfeasibleBudget as err:
        supported = ", ".join(str(m) for m in SUPPORTED_RANKS if m)
        if rank is not None:
            raise SketchcalError(
                f"--rank {rank:g} cannot be met: the smallest supported rank of every head "
                f"already gives mean rank {err.min_cost / n:.2f} (supported ranks: {supported}, "
                "0 = dense counts as K); raise --rank"
            ) from None
        raise SketchcalError(
            f"--bytes-per-token {bytes_per_token:g} cannot be met: the smallest supported ranks "
            f"need {err.min_cost / window:.0f} bytes per token; raise the budget"
        ) from None
    ranks = [[0] * f.heads for f in fits]
    for (li, h), j in zip(owners, res.choice, strict=True):
        ranks[li][h] = fits[li].ranks[j]
    layers = [_layer_summary(f, tm, r) for f, tm, r in zip(fits, traffic, ranks, strict=True)]
    heads = [(f, h, r[h]) for f, r in zip(fits, ranks, strict=True) for h in range(f.heads)]
    notes = []
    if not res.exact:
        notes.append(
            f"rank allocation rounded the costs; within {(res.value - res.lower_bound) / n:.2e} "
            "mean relative error of the optimum"
        )
    return Allocation(
        budget={"rank": float(rank)} if rank is not None else {"bytes_per_token": float(bytes_per_token)},
        layers=layers,
        mean_rank=sum(effective_rank(m, f.key_dim) for f, _, m in heads) / n,
        predicted_error=res.value / n,
        heldout_predicted_error=_mean([_at(f.heldout_predicted, f, h, m) for f, h, m in heads]),
        measured_error=_mean([_at(f.measured, f, h, m) for f, h, m in heads]),
        bytes_per_token=sum(lay.bytes_per_token for lay in layers),
        replay_bytes_per_token=sum(lay.replay_bytes_per_token for lay in layers),
        standard_bytes_per_token=sum(lay.standard_bytes_per_token for lay in layers),
        optimal=res.exact,
        gap_bound=0.0 if res.exact else (res.value - res.lower_bound) / n,
        notes=notes,
    )


def _at(curves: torch.Tensor | None, fit: LayerFit, head: int, m: int) -> float:
    if curves is None:
        return float("nan")
    return float(curves[head, fit.column(m)])


def _layer_summary(fit: LayerFit, tm: TrafficModel, ranks: list[int]) -> LayerAllocation:
    h = fit.heads
    return LayerAllocation(
        layer=fit.layer,
        ranks=list(ranks),
        mean_rank=sum(effective_rank(m, fit.key_dim) for m in ranks) / h,
        predicted_error=sum(_at(fit.predicted, fit, i, m) for i, m in enumerate(ranks)) / h,
        heldout_predicted_error=_mean([_at(fit.heldout_predicted, fit, i, m) for i, m in enumerate(ranks)]),
        measured_error=_mean([_at(fit.measured, fit, i, m) for i, m in enumerate(ranks)]),
        bytes_per_token=sum(tm.step_bytes(m) for m in ranks),
        replay_bytes_per_token=h * tm.step_bytes(0),
        standard_bytes_per_token=h * tm.standard_step_bytes(),
    )
