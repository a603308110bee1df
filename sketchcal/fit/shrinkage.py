"""Shrinkage estimates of the state second moment E from the streaming sums of the stats format.

The samples are the state *columns* ``x = S[:, v]`` (K-vectors) of the counted checkpoints, so
``n = n_checkpoints · V`` and the non-centred second moment is ``M = Σ x xᵀ / n = E_sum / n``
(the stats keep ``E_sum = Σ_checkpoints S Sᵀ``). All estimators return
``(1 − s)·M + s·μ·I`` with ``μ = tr(M) / K`` (a scaled-identity target) and differ in ``s``:

- ``ledoit_wolf`` (default): Ledoit & Wolf (2004), exactly as scikit-learn's
  ``ledoit_wolf(X, assume_centered=True)``. It needs ``Σ ‖x‖⁴`` (the stats' ``E_col4``)
  because ``Σ_i ‖x_i x_iᵀ − M‖²_F = Σ_i ‖x_i‖⁴ − n‖M‖²_F``. It makes no distributional assumption,
  which matters here: recurrent states are far from Gaussian (a few channels carry most of the
  energy, and the energy varies a lot from checkpoint to checkpoint).
- ``oas``: Chen et al. (2010), as scikit-learn's ``oas(X, assume_centered=True)``. Its
  shrinkage formula is derived for Gaussian samples; it uses only M and n.
- ``none``: the sample second moment.

Which one, justified by held-out read error (``tests/test_fit_shrinkage.py`` reproduces both cases on
synthetic states, scored with the true moments):

- when E is under-determined (fewer state columns than K, mildly anisotropic truth), shrinkage
  lowers the held-out read error a lot, and with heavy-tailed checkpoints Ledoit–Wolf beats OAS
  (OAS's Gaussian formula under-shrinks);
- when E is well determined and strongly anisotropic (condition ~1e3, many checkpoints), shrinking
  toward μI *raises* the error: the basis and the maps depend on E's weak directions (through
  ``E^{−½}`` and the E-weighted fit), and the target inflates exactly those.

So no estimator is right for every model and calibration size: ``convert`` defaults to
``shrinkage="auto"``, fitting with each of these and keeping the one whose rank allocation has the
lowest held-out error (recorded in ``sketch_config.shrinkage``); :func:`sketchcal.fit.evaluate.
compare_shrinkage` prints the same comparison per rank. Ledoit–Wolf is the default of the functions
here because it is distribution-free and the format stores the statistic it needs. Note that the V
columns of one checkpoint are not independent samples, so ``n`` overstates the effective sample size
and both formulas shrink somewhat less than they ideally would.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

ShrinkageMethod = Literal["ledoit_wolf", "oas", "none"]
SHRINKAGE_METHODS: tuple[str, ...] = ("ledoit_wolf", "oas", "none")


def _target(m: Tensor) -> tuple[Tensor, float]:
    k = m.shape[-1]
    mu = float(torch.diagonal(m).sum()) / k
    return mu * torch.eye(k, dtype=m.dtype), mu


def ledoit_wolf_shrinkage(moment: Tensor, col4_sum: float, n: float) -> float:
    """Ledoit–Wolf shrinkage coefficient in [0, 1].

    ``moment``: [K, K] mean second moment ``M``; ``col4_sum``: ``Σ_i ‖x_i‖⁴``; ``n``: sample count.
    """
    k = moment.shape[-1]
    if k == 1 or n <= 0:
        return 0.0
    mu = float(torch.diagonal(moment).sum()) / k
    fro2 = float((moment * moment).sum())
    beta = (col4_sum / n - fro2) / (k * n)
    delta = (fro2 - k * mu * mu) / k  # ‖M − μI‖²_F / K
    beta = min(beta, delta)
    if beta <= 0.0 or delta <= 0.0:
        return 0.0
    return float(min(beta / delta, 1.0))


def oas_shrinkage(moment: Tensor, n: float) -> float:
    """Oracle-approximating shrinkage coefficient in [0, 1] (scikit-learn's formula)."""
    k = moment.shape[-1]
    if k == 1:
        return 0.0
    alpha = float((moment * moment).mean())
    mu = float(torch.diagonal(moment).sum()) / k
    den = (n + 1.0) * (alpha - mu * mu / k)
    if den <= 0.0:
        return 1.0
    return float(min((alpha + mu * mu) / den, 1.0))


def shrink(
    e_sum: Tensor, col4_sum: float, n_checkpoints: int, value_dim: int, method: str = "ledoit_wolf"
) -> tuple[Tensor, float]:
    """Regularised mean state second moment of one head.

    Args:
        e_sum: [K, K] float64, ``Σ_checkpoints S Sᵀ``.
        col4_sum: ``Σ_checkpoints Σ_v ‖S[:, v]‖⁴``.
        n_checkpoints: number of checkpoints in ``e_sum``.
        value_dim: V (columns per checkpoint).
        method: ``"ledoit_wolf"``, ``"oas"`` or ``"none"``.

    Returns:
        ``(E, s)``: E [K, K] float64 is the shrunk *per-checkpoint* mean ``mean S Sᵀ``
        (= V × the per-column moment; the scale does not matter for any fit) and s the
        shrinkage coefficient.
    """
    if method not in SHRINKAGE_METHODS:
        raise ValueError(f"unknown shrinkage {method!r}; choose one of {', '.join(SHRINKAGE_METHODS)}")
    n = float(n_checkpoints) * float(value_dim)
    m = e_sum.to(torch.float64) / n  # per-column second moment
    if method == "ledoit_wolf":
        s = ledoit_wolf_shrinkage(m, float(col4_sum), n)
    elif method == "oas":
        s = oas_shrinkage(m, n)
    else:
        s = 0.0
    target, _ = _target(m)
    shrunk = (1.0 - s) * m + s * target
    return shrunk * float(value_dim), s
