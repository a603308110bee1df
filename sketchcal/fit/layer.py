"""Fit one mixer layer: shrink E per head, solve each group's basis and frame, build error curves.

Everything is weighted by the reads' output weights γ (:mod:`sketchcal.calibrate.fisher`): the
bases solve the state-weighted problem for the output-weighted query moment ``C_fisher``, a
group's heads are pooled by their share of the predicted KL, and the error curves are
output-weighted relative errors. ``kl_scale`` turns a head's relative error into predicted KL
per decoded token: ``KL_h(m) ≈ kl_scale_h · err_h(m)``, ``kl_scale_h = Σ γ ‖S_cᵀu‖² / (2 V n)``
with n the decoded tokens of the calibration split.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from sketchcal.fit.basis import coef_map, coef_maps, group_bases, nested_frame, projection_map
from sketchcal.fit.curves import measured_adaptive_curve, measured_curve, predicted_curve
from sketchcal.fit.ranks import adaptive_candidate_ranks, candidate_ranks
from sketchcal.fit.shrinkage import shrink

COEF_KINDS: tuple[str, ...] = ("state", "projection")


@dataclass
class LayerFit:
    """Frames, regularised moments and error curves of one layer.

    Shapes: H heads, G groups, K key dim, C = len(ranks) candidate ranks (``ranks[0] == 0``, dense).
    """

    layer: int
    heads: int
    groups: int
    key_dim: int
    value_dim: int
    basis: str
    coef: str
    ranks: list[int]  # candidate ranks, dense (0) first
    frames: Tensor  # [G, K, K] f64, R_g (rows = rotated coordinates)
    eigvals: Tensor  # [G, K] f64, λ of the group basis solve (NaN for a random basis)
    e_map: Tensor  # [H, K, K] f64, the regularised mean E each head's map uses
    shrinkage: Tensor  # [H] f64, shrinkage coefficient per head
    predicted: Tensor  # [H, C] f64, predicted relative error from the calibration moments
    heldout_predicted: Tensor | None  # [H, C] f64, from the held-out moments
    measured: Tensor | None  # [H, C] f64, measured on the held-out windows
    read_energy: Tensor  # [H] f64, mean exact read energy per calibration read (for reports)
    kl_scale: Tensor  # [H] f64, predicted KL per decoded token of a relative error of 1
    adaptive_ranks: list[int] | None = None  # the adaptive sketch's candidate ranks, dense (0) first
    adaptive_measured: Tensor | None = None  # [H, C_a] f64, its error measured on the held-out windows

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.groups

    def frame_of(self, head: int) -> Tensor:
        return self.frames[head // self.heads_per_group]

    def head_map(self, head: int, m: int) -> Tensor:
        """Rotated coefficient map [m, K] of ``head`` at rank ``m`` > 0."""
        frame = self.frame_of(head)
        if self.coef == "projection":
            return projection_map(frame, m)
        return coef_map(frame, self.e_map[head], m)

    def coef_maps(self, ranks: list[int]) -> Tensor:
        """The stored coefficient maps for per-head ``ranks`` [H]: [H, M, K] with M = max(1, max rank).

        Row j < m_h of head h is row j of its rotated map ``[I_m  Gᵀ]`` (it applies to ``R_g u``);
        the other rows are zero, and a dense head (m = 0) is all zeros.
        """
        mmax = max([1, *ranks])
        out = torch.zeros(self.heads, mmax, self.key_dim, dtype=torch.float64)
        for h, m in enumerate(ranks):
            if m:
                out[h, :m] = self.head_map(h, m)
        return out

    def column(self, m: int) -> int:
        return self.ranks.index(m)

    def adaptive_view(self) -> LayerFit:
        """This fit as the adaptive sketch's: its candidate ranks and curves in place of the static
        map's. Every curve is the one measured on the held-out windows (no moment formula predicts
        an adaptive read). Needs :func:`fit_layer` with ``adaptive=True`` and windows."""
        if self.adaptive_measured is None or self.adaptive_ranks is None:
            raise ValueError(
                f"layer {self.layer} has no adaptive curves (fit_layer(adaptive=True) with windows)"
            )
        return replace(
            self, ranks=list(self.adaptive_ranks), predicted=self.adaptive_measured, heldout_predicted=None,
            measured=self.adaptive_measured, adaptive_ranks=None, adaptive_measured=None,
        )  # fmt: skip


def fit_layer(
    info,
    calib,
    heldout=None,
    windows=None,
    *,
    basis: str = "state",
    coef: str = "state",
    shrinkage: str = "ledoit_wolf",
    generator: torch.Generator | None = None,
    decode_tokens: int | None = None,
    adaptive: bool = False,
) -> LayerFit:
    """Fit the frames of one layer and compute its error curves.

    Args:
        info: the layer's :class:`~sketchcal.formats.stats.LayerInfo` (layer, heads H, groups G,
            key_dim K, value_dim V); head h is in group ``h // (H // G)``.
        calib: the calibration :class:`~sketchcal.formats.stats.Moments` (sums: E, C [H, K, K] ...).
        heldout: held-out Moments, or None (no held-out prediction then).
        windows: held-out :class:`~sketchcal.formats.stats.HeldoutWindows`, or None.
        basis: ``"state"``, ``"pca"`` or ``"random"`` (see :func:`sketchcal.fit.basis.group_basis`).
        coef: ``"state"`` (state-weighted least-squares maps, each head with its own E) or
            ``"projection"`` (orthogonal projection, the E = I ablation of the map).
        shrinkage: ``"ledoit_wolf"``, ``"oas"`` or ``"none"`` for E.
        generator: randomness of the ``"random"`` basis.
        decode_tokens: decoded tokens of the calibration split, n in ``kl_scale`` (default: the
            number of non-flush reads, which undercounts by the flush reads).
        adaptive: also measure the adaptive sketch's curves on ``windows`` (``adaptive_measured``
            over ``adaptive_candidate_ranks``), for :meth:`LayerFit.adaptive_view`.
    """
    if coef not in COEF_KINDS:
        raise ValueError(f"unknown coefficient map {coef!r}; choose one of {', '.join(COEF_KINDS)}")
    heads, groups, k, v_dim = info.heads, info.groups, info.key_dim, info.value_dim
    if tuple(calib.E.shape) != (heads, k, k) or heads % groups:
        raise ValueError(
            f"moments of shape {list(calib.E.shape)} do not match {heads} heads in {groups} groups, K={k}"
        )
    e_map = torch.empty(heads, k, k, dtype=torch.float64)
    s_coef = torch.empty(heads, dtype=torch.float64)
    for h in range(heads):
        e_map[h], s_coef[h] = shrink(
            calib.E[h], float(calib.E_col4[h]), calib.n_checkpoints, v_dim, shrinkage
        )
    c_mean = calib.C_fisher_mean
    kl_scale = calib.fisher / (2.0 * v_dim * (decode_tokens or max(calib.n_reads, 1)))
    hpg = heads // groups
    grouped = (groups, hpg, k, k)
    votes = kl_scale.reshape(groups, hpg)  # a group's heads pooled by their share of the KL
    b, eigvals = group_bases(e_map.reshape(grouped), c_mean.reshape(grouped), basis, generator, votes)
    frames = nested_frame(b)
    ranks = candidate_ranks(k)
    e_raw = calib.E_mean
    fit = LayerFit(
        layer=info.layer,
        heads=heads,
        groups=groups,
        key_dim=k,
        value_dim=v_dim,
        basis=basis,
        coef=coef,
        ranks=ranks,
        frames=frames,
        eigvals=eigvals,
        e_map=e_map,
        shrinkage=s_coef,
        predicted=torch.zeros(heads, len(ranks), dtype=torch.float64),
        heldout_predicted=None,
        measured=None,
        read_energy=calib.read_energy / max(calib.n_reads, 1),
        kl_scale=kl_scale,
    )
    use_heldout = heldout is not None and not heldout.empty
    if use_heldout:
        fit.heldout_predicted = torch.zeros(heads, len(ranks), dtype=torch.float64)
        e_ho, c_ho = heldout.E_mean, heldout.C_fisher_mean
    if windows is not None:
        fit.measured = torch.zeros(heads, len(ranks), dtype=torch.float64)
        if adaptive:
            fit.adaptive_ranks = adaptive_candidate_ranks(k, v_dim)
            fit.adaptive_measured = torch.zeros(heads, len(fit.adaptive_ranks), dtype=torch.float64)
    for h in range(heads):
        frame = fit.frame_of(h)
        if coef == "projection":
            maps = {m: projection_map(frame, m) for m in ranks if m}
        else:
            maps = coef_maps(frame, e_map[h], ranks)
        fit.predicted[h] = predicted_curve(frame, maps, e_raw[h], c_mean[h], ranks)
        if use_heldout:
            fit.heldout_predicted[h] = predicted_curve(frame, maps, e_ho[h], c_ho[h], ranks)
        if windows is not None:
            fit.measured[h] = measured_curve(
                frame, maps, windows.S[:, h], windows.u[:, :, h], windows.mask, ranks, windows.gamma[:, :, h]
            )
            if fit.adaptive_measured is not None:
                fit.adaptive_measured[h] = measured_adaptive_curve(
                    frame, windows.S[:, h], windows.u[:, :, h], windows.mask, fit.adaptive_ranks,
                    windows.gamma[:, :, h],
                )  # fmt: skip
    return fit
