"""Per-head rank allocation under a mean-rank or byte budget.

``allocation="output"`` (the default) minimises the predicted KL of the decoded distributions: the
sum over all heads of all layers of ``kl_scale_h · err_h(m_h)`` (:mod:`sketchcal.fit.layer`: each
head's output-weighted relative read error at rank m, scaled by how much its reads move the logits),
by a multiple-choice knapsack. The error curves that choose are the held-out ones (the maps are
fitted on the calibration split, so its own curves are optimistic): measured on the held-out
windows where the statistics have them, else predicted from the held-out moments, else (no
held-out split) from the calibration moments. ``allocation="uniform"`` gives every head the same
rank (the ablation). Options per head: the candidate ranks of :mod:`sketchcal.fit.ranks`
(0 = dense, exact). Cost per head:

- ``rank=M``: the effective rank (m, or K for a dense head); constraint ``Σ cost ≤ M · #heads``,
  i.e. the mean rank (dense counted as K) is at most M;
- ``bytes_per_token=B``: the bytes per decoded token of :class:`~sketchcal.fit.traffic.TrafficModel`
  (computed per window of L tokens, so the costs are integers); constraint ``Σ bytes ≤ B``, B being
  per sequence and token for all mixer layers together.

Every allocation reports its predicted KL three ways: on the calibration moments (``predicted_kl``,
what the maps were fitted to), on the held-out moments and on the held-out windows.

``sketch_map="adaptive"`` allocates the adaptive sketch (a map made for each checkpoint at its
flush): a head of rank r reads ``r·(K + V)`` values, its options are
:func:`~sketchcal.fit.ranks.adaptive_candidate_ranks` and its curves the ones measured on the
held-out windows (:meth:`LayerFit.adaptive_view`; every KL figure is then that one). A mean-rank
budget M means the bytes that a static sketch of rank M on every head reads, so that ``--rank 8``
compares the two maps at equal bytes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import torch

from sketchcal.errors import SketchcalError
from sketchcal.fit.knapsack import InfeasibleBudget, solve_mckp
from sketchcal.fit.layer import LayerFit
from sketchcal.fit.ranks import SKETCH_MAPS, SUPPORTED_RANKS, effective_rank
from sketchcal.fit.traffic import TrafficModel

ALLOCATIONS: tuple[str, ...] = ("output", "uniform")
HELDOUT_MISMATCH = 1.5  # held-out KL above this multiple of the fitted KL: too little calibration data


@dataclass
class LayerAllocation:
    layer: int
    ranks: list[int]  # [H], 0 = dense
    mean_rank: float  # dense counted as K
    predicted_kl: float  # nats/token, calibration moments
    heldout_kl: float | None  # nats/token, held-out moments
    measured_kl: float | None  # nats/token, held-out windows
    bytes_per_token: float  # this layer's heads, sketch decoding
    replay_bytes_per_token: float
    standard_bytes_per_token: float


@dataclass
class Allocation:
    """The chosen ranks and what they cost and give. KL figures are predicted, in nats per decoded token."""

    budget: dict[str, float]  # {"rank": M} or {"bytes_per_token": B}
    allocation: str  # "output" | "uniform"
    selected_on: str  # the curves the knapsack minimised: "held-out windows" | "held-out moments" | ...
    layers: list[LayerAllocation]
    mean_rank: float
    predicted_kl: float
    heldout_kl: float | None
    measured_kl: float | None
    bytes_per_token: float
    replay_bytes_per_token: float
    standard_bytes_per_token: float
    optimal: bool  # True: exact knapsack optimum; else within ``gap_bound`` of it
    gap_bound: float  # bound on (objective − optimum), in nats/token
    notes: list[str] = field(default_factory=list)
    sketch_map: str = "static"  # the map the ranks were chosen for: "static" | "adaptive"

    @property
    def reduction_vs_standard(self) -> float:
        """Fraction of the standard decode's state traffic saved (1 − sketch / standard)."""
        return 1.0 - self.bytes_per_token / self.standard_bytes_per_token

    @property
    def reduction_vs_replay(self) -> float:
        """Fraction of ReplaySSM's state traffic saved (1 − sketch / replay)."""
        return 1.0 - self.bytes_per_token / self.replay_bytes_per_token

    @property
    def heldout_score(self) -> float | None:
        """The held-out predicted KL: on the windows where measured, else on the held-out moments."""
        return self.measured_kl if self.measured_kl is not None else self.heldout_kl

    def to_dict(self) -> dict:
        d = asdict(self)
        d["reduction_vs_standard"] = self.reduction_vs_standard
        d["reduction_vs_replay"] = self.reduction_vs_replay
        d["speedup_vs_standard"] = self.standard_bytes_per_token / self.bytes_per_token
        d["speedup_vs_replay"] = self.replay_bytes_per_token / self.bytes_per_token
        return d


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


def selection_curves(fit: LayerFit) -> tuple[torch.Tensor, str]:
    """The error curves [H, C] that choose the ranks of ``fit``'s heads, and what they are."""
    if fit.measured is not None:
        # a head whose sampled windows hold no weighted energy has NaN there: use its moments
        backup = fit.heldout_predicted if fit.heldout_predicted is not None else fit.predicted
        return torch.where(torch.isnan(fit.measured), backup, fit.measured), "held-out windows"
    if fit.heldout_predicted is not None:
        return fit.heldout_predicted, "held-out moments"
    return fit.predicted, "calibration moments"


def allocate(
    fits: list[LayerFit],
    traffic: list[TrafficModel],
    *,
    rank: float | None = None,
    bytes_per_token: float | None = None,
    allocation: str = "output",
    sketch_map: str = "static",
    max_cells: int = 50_000_000,
) -> Allocation:
    """Choose every head's rank. Exactly one of ``rank`` / ``bytes_per_token`` must be given.

    Args:
        fits: one :class:`LayerFit` per layer.
        traffic: the byte model of each layer, same order.
        rank: mean rank budget M (dense heads count as K), 0 < M ≤ max K.
        bytes_per_token: byte budget per sequence and decoded token, all mixer layers together.
        allocation: ``"output"`` (minimum predicted KL) or ``"uniform"`` (every head the same rank:
            M itself, or the largest rank whose bytes fit ``bytes_per_token``).
        sketch_map: ``"static"`` or ``"adaptive"`` (the fits need ``adaptive`` curves; a rank
            budget M then means the bytes of a static sketch of rank M on every head).

    Raises:
        SketchcalError: a missing/double/invalid budget, or one that cannot be met.
    """
    if len(fits) != len(traffic) or not fits:
        raise ValueError("one traffic model per layer fit is needed")
    if allocation not in ALLOCATIONS:
        raise SketchcalError(f"--allocation must be one of {', '.join(ALLOCATIONS)}, got {allocation!r}")
    validate_budget(rank, bytes_per_token, max(f.key_dim for f in fits))
    given = {"rank": float(rank)} if rank is not None else {"bytes_per_token": float(bytes_per_token)}
    notes = []
    if sketch_map not in SKETCH_MAPS:
        raise SketchcalError(f"--sketch-map must be one of {', '.join(SKETCH_MAPS)}, got {sketch_map!r}")
    if sketch_map == "adaptive":
        fits, traffic, bytes_per_token = _adaptive(fits, traffic, rank, bytes_per_token)
        notes.append(
            "adaptive sketch: ranks chosen, and every KL figure measured, on the held-out windows"
            + (f"; budget: the bytes of static rank {rank:g} on every head" if rank is not None else "")
        )
        rank = None  # the byte budget chooses
    window = traffic[0].window
    if any(t.window != window for t in traffic):
        raise ValueError("all layers must share the window length")
    selection = [selection_curves(f) for f in fits]
    fallback = False
    costs: list[list[int]] = []
    values: list[list[float]] = []
    owners: list[tuple[int, int]] = []
    for li, (fit, tm, (curves, _)) in enumerate(zip(fits, traffic, selection, strict=True)):
        for h in range(fit.heads):
            if rank is not None:
                costs.append([effective_rank(m, fit.key_dim) for m in fit.ranks])
            else:
                costs.append([tm.window_bytes(m) for m in fit.ranks])
            values.append([float(fit.kl_scale[h] * x) for x in curves[h]])
            owners.append((li, h))
    n = len(costs)
    budget = math.floor(rank * n + 1e-9) if rank is not None else math.floor(bytes_per_token * window + 1e-6)
    heads = _Heads(fits, costs, owners, budget)
    if allocation == "uniform":
        choice = _uniform(heads, rank, bytes_per_token, window)
        exact, gap = True, 0.0
    else:
        try:
            res = solve_mckp(costs, values, budget, max_cells=max_cells)
        except InfeasibleBudget as err:
            raise _infeasible(rank, bytes_per_token, err.min_cost, n, window, given) from None
        choice, exact, gap = res.choice, res.exact, res.value - res.lower_bound
        kept = _uniform_if_no_worse(heads, choice, selection[0][1])
        if kept is not None:
            choice, exact, gap, fallback = kept, True, 0.0, True
    ranks = [[0] * f.heads for f in fits]
    for (li, h), j in zip(owners, choice, strict=True):
        ranks[li][h] = fits[li].ranks[j]
    layers = [_layer_summary(f, tm, r) for f, tm, r in zip(fits, traffic, ranks, strict=True)]
    if not exact:
        notes.append(f"rank allocation rounded the costs; within {gap:.2e} nats/token of the optimum")
    if fallback:
        notes.append(
            "every head keeps the same rank: on the held-out moments, which did not choose the ranks, "
            "the knapsack's allocation predicts no lower KL than uniform ranks at the same budget"
        )
    alloc = Allocation(
        budget=given,
        allocation=allocation,
        selected_on=selection[0][1] if allocation == "output" else "none (uniform)",
        layers=layers,
        mean_rank=sum(effective_rank(m, f.key_dim) for f, r in zip(fits, ranks, strict=True) for m in r) / n,
        predicted_kl=sum(lay.predicted_kl for lay in layers),
        heldout_kl=_total([lay.heldout_kl for lay in layers]),
        measured_kl=_total([lay.measured_kl for lay in layers]),
        bytes_per_token=sum(lay.bytes_per_token for lay in layers),
        replay_bytes_per_token=sum(lay.replay_bytes_per_token for lay in layers),
        standard_bytes_per_token=sum(lay.standard_bytes_per_token for lay in layers),
        optimal=exact,
        gap_bound=gap,
        notes=notes,
        sketch_map=sketch_map,
    )
    held = alloc.heldout_score
    if held is not None and alloc.predicted_kl > 0 and held > HELDOUT_MISMATCH * alloc.predicted_kl:
        alloc.notes.append(
            f"the held-out error is {held / alloc.predicted_kl:.1f}× the fitted one (predicted KL "
            f"{held:.2e} vs {alloc.predicted_kl:.2e} nats/token): too little calibration data for "
            "these ranks; calibrate with more --samples or longer --seq-len"
        )
    return alloc


def _adaptive(
    fits: list[LayerFit], traffic: list[TrafficModel], rank: float | None, bytes_per_token: float | None
) -> tuple[list[LayerFit], list[TrafficModel], float]:
    """The adaptive sketch's fits (:meth:`LayerFit.adaptive_view`), byte models and byte budget (a
    rank budget M → what static rank M on every head reads)."""
    missing = [f.layer for f in fits if f.adaptive_measured is None]
    if missing:
        raise SketchcalError(
            f"the adaptive sketch's ranks are chosen on the held-out windows, which the statistics lack "
            f"for layer(s) {', '.join(map(str, missing))}; calibrate with --heldout-windows > 0"
        )
    if rank is not None:
        bytes_per_token = sum(
            f.heads * tm.window_bytes(rank) / tm.window for f, tm in zip(fits, traffic, strict=True)
        )
    return [f.adaptive_view() for f in fits], [replace(tm, adaptive=True) for tm in traffic], bytes_per_token


@dataclass(frozen=True)
class _Heads:
    """The knapsack's items: every head's rank options (``fits[li].ranks``), their ``costs`` [head]
    [option] and the (layer, head) that owns each row, under ``budget``."""

    fits: list[LayerFit]
    costs: list[list[int]]
    owners: list[tuple[int, int]]
    budget: int

    def ranks(self) -> set[int]:
        """The non-zero ranks some head can take."""
        return {m for f in self.fits for m in f.ranks if m}


def _uniform(heads: _Heads, rank: float | None, bytes_per_token: float | None, window: int) -> list[int]:
    """:func:`_uniform_choice`, refusing a mean rank that is not a rank every head can take."""
    if rank is not None and rank not in heads.ranks() and rank < max(f.key_dim for f in heads.fits):
        supported = ", ".join(str(m) for m in SUPPORTED_RANKS if m)
        raise SketchcalError(
            f"--allocation uniform needs a mean rank every head can take; {rank:g} is not one "
            f"(supported ranks: {supported}); choose one of them"
        )
    choice = _uniform_choice(heads)
    if choice is None:
        raise _infeasible(
            rank, bytes_per_token, sum(min(c) for c in heads.costs), len(heads.costs), window, None
        )
    return choice


def _uniform_choice(heads: _Heads) -> list[int] | None:
    """The option index of every head for the largest rank all heads share within ``budget``
    (a head whose candidates stop below that rank reads densely), dense first: it fits only when
    the budget covers every head dense. None when not even the smallest rank fits."""
    fits = heads.fits
    for m in [0, *sorted(heads.ranks(), reverse=True)]:
        choice = [fits[li].ranks.index(m) if m in fits[li].ranks else 0 for li, _ in heads.owners]
        if sum(c[j] for c, j in zip(heads.costs, choice, strict=True)) <= heads.budget:
            return choice
    return None


def _uniform_if_no_worse(heads: _Heads, choice: list[int], selected_on: str) -> list[int] | None:
    """The uniform ranks' option indices when they fit ``budget`` and the held-out moments predict
    them no worse than ``choice``; else None.

    The knapsack minimises the curves of :func:`selection_curves` exactly, so on those curves it can
    never lose to uniform ranks; the guard needs an estimate that did not choose: the held-out
    moments when the held-out windows chose (none otherwise: no guard)."""
    fits = heads.fits
    if selected_on != "held-out windows" or any(f.heldout_predicted is None for f in fits):
        return None
    uniform = _uniform_choice(heads)
    if uniform is None or uniform == choice:
        return None

    def check(opt: list[int]) -> float:
        return sum(
            float(fits[li].kl_scale[h] * fits[li].heldout_predicted[h, j].nan_to_num(0.0))
            for (li, h), j in zip(heads.owners, opt, strict=True)
        )

    return uniform if check(uniform) <= check(choice) else None


def _infeasible(
    rank: float | None,
    bytes_per_token: float | None,
    min_cost: int,
    n: int,
    window: int,
    given: dict[str, float] | None,
) -> SketchcalError:
    supported = ", ".join(str(m) for m in SUPPORTED_RANKS if m)
    if rank is None and given is not None and "rank" in given:  # an adaptive sketch at a static rank's bytes
        return SketchcalError(
            f"--rank {given['rank']:g} with the adaptive sketch cannot be met: static rank "
            f"{given['rank']:g} reads {bytes_per_token:.0f} bytes per token, the smallest adaptive ranks "
            f"{min_cost / window:.0f}; raise --rank"
        )
    if rank is not None:
        return SketchcalError(
            f"--rank {rank:g} cannot be met: the smallest supported rank of every head already gives "
            f"mean rank {min_cost / n:.2f} (supported ranks: {supported}, 0 = dense counts as K); "
            "raise --rank"
        )
    return SketchcalError(
        f"--bytes-per-token {bytes_per_token:g} cannot be met: the smallest supported ranks need "
        f"{min_cost / window:.0f} bytes per token; raise the budget"
    )


def _total(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(values)


def _kl(curves: torch.Tensor | None, fit: LayerFit, ranks: list[int]) -> float | None:
    """Σ_h kl_scale_h · curves[h, m_h]; a head whose held-out windows hold no weighted read energy
    (NaN: nothing to approximate there) counts 0."""
    if curves is None:
        return None
    return sum(float(fit.kl_scale[h] * curves[h, fit.column(m)].nan_to_num(0.0)) for h, m in enumerate(ranks))


def _layer_summary(fit: LayerFit, tm: TrafficModel, ranks: list[int]) -> LayerAllocation:
    h = fit.heads
    return LayerAllocation(
        layer=fit.layer,
        ranks=list(ranks),
        mean_rank=sum(effective_rank(m, fit.key_dim) for m in ranks) / h,
        predicted_kl=_kl(fit.predicted, fit, ranks) or 0.0,
        heldout_kl=_kl(fit.heldout_predicted, fit, ranks),
        measured_kl=_kl(fit.measured, fit, ranks),
        bytes_per_token=sum(tm.step_bytes(m) for m in ranks),
        replay_bytes_per_token=h * tm.step_bytes(0),
        standard_bytes_per_token=h * tm.standard_step_bytes(),
    )
