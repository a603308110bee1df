"""Held-out comparisons: basis kinds (state-weighted vs PCA vs random) and shrinkage estimators.

Both functions fit on the calibration split and score on the held-out split of a statistics
directory, with the *same* rank for every head, and average the per-head relative read error over
all heads of all layers (heads whose key dim is ≤ the rank are exact and count as 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from sketchcal.errors import SketchcalError
from sketchcal.fit.layer import LayerFit, fit_layer
from sketchcal.fit.ranks import candidate_ranks
from sketchcal.formats.stats import Stats, load_stats


def _score(fit: LayerFit, source: str, m: int) -> list[float]:
    curves = fit.measured if source == "measured" else fit.heldout_predicted
    if curves is None:
        what = "held-out window sample" if source == "measured" else "held-out moments"
        raise SketchcalError(
            f"the statistics have no {what} for layer {fit.layer}; use source="
            f"{'moments' if source == 'measured' else 'measured'} or recalibrate"
        )
    if m >= fit.key_dim:
        return [0.0] * fit.heads
    return [float(x) for x in curves[:, fit.column(m)]]


def fit_all(
    stats,
    *,
    basis: str = "state",
    coef: str = "state",
    shrinkage: str = "ledoit_wolf",
    seed: int = 0,
    adaptive: bool = False,
    on_layer: Callable[[int], None] | None = None,
) -> list[LayerFit]:
    """Fit every layer of a :class:`~sketchcal.formats.stats.Stats`, one layer in memory at a time
    (moments and held-out windows are read, fitted and dropped). ``adaptive``: also measure the
    adaptive sketch's curves (``fit_layer``). ``on_layer(layer)`` is called after each layer
    (progress)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for li in stats.layers:
        heldout = stats.moments(li.layer, "heldout")
        out.append(
            fit_layer(
                li,
                stats.moments(li.layer, "calib"),
                heldout if not heldout.empty else None,
                stats.windows(li.layer),
                basis=basis,
                coef=coef,
                shrinkage=shrinkage,
                generator=gen,
                decode_tokens=stats.decoded_tokens("calib"),
                adaptive=adaptive,
            )
        )
        if on_layer is not None:
            on_layer(li.layer)
    return out


def _table(fits: list[LayerFit], ranks: Sequence[int] | None, source: str) -> dict[int, float]:
    if ranks is None:
        ranks = [m for m in candidate_ranks(max(f.key_dim for f in fits)) if m]
    out: dict[int, float] = {}
    for m in ranks:
        if m not in candidate_ranks(10**9):
            raise SketchcalError(f"rank {m} is not a supported sketch rank")
        vals = [x for f in fits for x in _score(f, source, m) if math.isfinite(x)]
        out[int(m)] = sum(vals) / len(vals) if vals else float("nan")
    return out


def _kind_table(
    stats, kind: str, ranks, source: str, coef: str, shrinkage: str, seed: int
) -> dict[int, float]:
    from sketchcal.fit.shrinkage import SHRINKAGE_METHODS

    methods = SHRINKAGE_METHODS if shrinkage == "auto" else (shrinkage,)
    tables = [
        _table(fit_all(stats, basis=kind, coef=coef, shrinkage=m, seed=seed), ranks, source) for m in methods
    ]

    def mean(t: dict[int, float]) -> float:
        vals = [x for x in t.values() if math.isfinite(x)]
        return sum(vals) / len(vals) if vals else math.inf

    return min(tables, key=mean)


def _opened(stats: Stats | str | Path) -> Stats:
    return load_stats(stats) if isinstance(stats, str | Path) else stats


def heldout_errors(
    stats: Stats | str | Path,
    kinds: Sequence[str] = ("state", "pca", "random"),
    ranks: Sequence[int] | None = None,
    *,
    source: str = "measured",
    coef: str = "state",
    shrinkage: str = "auto",
    seed: int = 0,
) -> dict[str, dict[int, float]]:
    """Mean held-out relative read error per basis kind and uniform rank.

    Args:
        stats: a :class:`~sketchcal.formats.stats.Stats` or a statistics directory.
        kinds: basis kinds to fit (``"state"``, ``"pca"``, ``"random"``).
        ranks: ranks to score (default: every supported non-zero rank below the largest K).
        source: ``"measured"`` (the verbatim held-out windows) or ``"moments"`` (predicted from the
            held-out second moments).
        coef: ``"state"`` maps for every kind (isolates the basis) or ``"projection"`` (pure E = I).
        shrinkage: estimator for E, or ``"auto"``: per kind, the estimator with the lowest mean
            held-out error over ``ranks`` (every kind gets the same privilege, as in ``convert``).
        seed: seed of the random basis.

    Returns:
        ``{kind: {rank: mean relative error}}``.
    """
    stats = _opened(stats)
    return {kind: _kind_table(stats, kind, ranks, source, coef, shrinkage, seed) for kind in kinds}


def compare_shrinkage(
    stats: Stats | str | Path,
    methods: Sequence[str] = ("ledoit_wolf", "oas", "none"),
    *,
    basis: str = "state",
    ranks: Sequence[int] | None = None,
    source: str = "measured",
) -> dict[str, dict[int, float]]:
    """Mean held-out relative read error per shrinkage estimator and uniform rank (state basis);
    ``ranks``, ``source`` as for :func:`heldout_errors`.

    Returns ``{method: {rank: mean relative error}}``; lower is better.
    """
    stats = _opened(stats)
    return {
        meth: _table(fit_all(stats, basis=basis, coef="state", shrinkage=meth, seed=0), ranks, source)
        for meth in methods
    }
