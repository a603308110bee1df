"""Bases, nested frames and coefficient maps (all float64, one (layer, group) at a time).

Notation (docs/DESIGN.md): state ``S`` [K, V], read ``o = Sᵀ u``, ``E = mean S Sᵀ`` and
``C = mean u uᵀ`` [K, K]. A rank-m sketch approximates ``Sᵀ u ≈ (R S)_{:m}ᵀ (P u)`` with

- ``R`` [K, K] orthogonal: the *frame*; its first m rows span the first m basis vectors, for every m;
- ``P = [I_m  Gᵀ] R`` [m, K]: the state-weighted least-squares *coefficient map*,
  ``G = E'_{tail,head} E'^{-1}_{head,head}``, ``E' = R E Rᵀ``.

This module stores the map in the rotated frame, ``P_rot = [I_m  Gᵀ]`` [m, K], which applies to the
rotated query ``u' = R u`` (the runtime keeps states and queries in the rotated frame).

Why this basis: for a fixed subspace span(Q) the best map is ``P = (QᵀEQ)^{-1} QᵀE`` whatever C is
(column by column it is an E-weighted least-squares fit of the identity), and the expected read error
``tr((I−QP)ᵀ E (I−QP) C)`` then equals ``tr(EC) − tr((QᵀEQ)^{-1} QᵀECEQ)``. Maximising the
generalised Rayleigh quotient gives ``ECE b = λ E b``, i.e. ``B = E^{−½} W`` with W the top
eigenvectors of ``E^{½} C E^{½}``; the rank-m error is ``Σ_{i>m} λ_i / Σ_i λ_i``.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

BasisKind = Literal["state", "pca", "random"]
BASIS_KINDS: tuple[str, ...] = ("state", "pca", "random")

EIG_FLOOR = 1e-10  # eigenvalues of E below this fraction of the largest are clamped (E^{-1/2} stays finite)


def _sym(a: Tensor) -> Tensor:
    return 0.5 * (a + a.transpose(-1, -2))


def eigh_desc(a: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvalues (descending) and eigenvectors (columns) of symmetric [..., K, K] matrices."""
    vals, vecs = torch.linalg.eigh(_sym(a))
    return vals.flip(-1), vecs.flip(-1)


def sqrt_and_inv_sqrt(e: Tensor, floor: float = EIG_FLOOR) -> tuple[Tensor, Tensor]:
    """``(E^{½}, E^{−½})`` of symmetric PSD [..., K, K] matrices; eigenvalues floored at ``floor·λ_max``."""
    vals, vecs = torch.linalg.eigh(_sym(e))
    top = vals.max(dim=-1, keepdim=True).values.clamp_min(0.0)
    if bool((top <= 0.0).any()):
        raise ValueError("E is zero: the states carry no energy")
    vals = torch.maximum(vals, floor * top)
    vt = vecs.transpose(-1, -2)
    half = (vecs * vals.sqrt().unsqueeze(-2)) @ vt
    inv_half = (vecs * vals.rsqrt().unsqueeze(-2)) @ vt
    return half, inv_half


def state_weighted_basis(e: Tensor, c: Tensor, rank: int | None = None) -> tuple[Tensor, Tensor]:
    """The state-weighted basis: ``B = E^{−½} W``, W = top eigenvectors of ``E^{½} C E^{½}``.

    Args:
        e: [..., K, K] state second moments (already regularised), c: [..., K, K] query second moments.
        rank: number of vectors (default K).

    Returns:
        ``(B, λ)``: B [..., K, rank] (columns ordered by decreasing λ, not normalised), λ [..., rank].
    """
    half, inv_half = sqrt_and_inv_sqrt(e)
    vals, w = eigh_desc(half @ c @ half)
    r = e.shape[-1] if rank is None else rank
    return inv_half @ w[..., :r], vals[..., :r]


def group_bases(
    e_heads: Tensor,
    c_heads: Tensor,
    kind: str = "state",
    generator: torch.Generator | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The full ordered bases [G, K, K] of G groups of h heads each, and their eigenvalues [G, K].

    Args:
        e_heads: [G, h, K, K] regularised state moments, group by group.
        c_heads: [G, h, K, K] query moments.
        kind: ``"state"`` (state-weighted), ``"pca"`` (E = I: eigenvectors of the pooled C) or
            ``"random"`` (random orthogonal bases drawn from ``generator``; λ are NaN).
        weights: [G, h] non-negative weight of each head's relative error in its group's objective
            (None: equal weights).

    For a group of several heads the objective is the weighted mean relative error: with
    ``Ē_h = E_h / tr E_h`` and ``Ĉ_h = C_h / tr(Ē_h C_h)`` the single-head solution is applied to the
    pooled ``Ē = Σ_h w_h Ē_h / Σ w``, ``Ĉ = Σ_h w_h Ĉ_h / Σ w``. This is the exact optimum of the
    group's weighted relative error when the heads' E are proportional, and the plain single-head
    solution for a group of one head. (Pooling ``Σ_h w_h Ē_h Ĉ_h Ē_h`` instead is also exact in that
    case but not robust: ``Ē^{−½}`` then no longer cancels and amplifies the heads' differences in the
    weak directions of E.)
    """
    g, h, k, _ = e_heads.shape
    w = torch.ones(g, h, dtype=e_heads.dtype) if weights is None else weights.to(e_heads.dtype)
    if kind == "random":
        q, r = torch.linalg.qr(torch.randn(g, k, k, dtype=torch.float64, generator=generator))
        q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)  # Haar-distributed
        return q, torch.full((g, k), float("nan"), dtype=torch.float64)
    if kind == "pca":
        trace_c = torch.diagonal(c_heads, dim1=-2, dim2=-1).sum(-1)
        c_bar = c_heads / trace_c.clamp_min(1e-300)[..., None, None]
        vals, vecs = eigh_desc(_weighted_mean(c_bar, w * (trace_c > 0), torch.eye(k, dtype=c_heads.dtype)))
        return vecs, vals
    if kind != "state":
        raise ValueError(f"unknown basis kind {kind!r}; choose one of {', '.join(BASIS_KINDS)}")
    trace_e = torch.diagonal(e_heads, dim1=-2, dim2=-1).sum(-1)
    e_bar = e_heads / trace_e.clamp_min(1e-300)[..., None, None]
    energy = (e_bar * c_heads).sum((-1, -2))  # tr(Ē_h C_h), both symmetric
    c_hat = c_heads / energy.clamp_min(1e-300)[..., None, None]
    # heads that are never read with any energy (dead heads) do not vote; a group of only such heads
    # gets an arbitrary basis (identity moments): every rank of it is exact
    votes = w * ((trace_e > 0) & (energy > 0))
    eye = torch.eye(k, dtype=e_heads.dtype)
    return state_weighted_basis(_weighted_mean(e_bar, votes, eye), _weighted_mean(c_hat, votes, eye))


def _weighted_mean(m: Tensor, w: Tensor, empty: Tensor) -> Tensor:
    """``Σ_h w_h m_h / Σ_h w_h`` over dim 1 of ``m`` [G, h, K, K]; ``empty`` where all weights are 0."""
    total = w.sum(1)[:, None, None]
    mean = (m * w[..., None, None]).sum(1) / total.clamp_min(1e-300)
    return torch.where(total > 0, mean, empty.expand_as(mean))


def group_basis(
    e_heads: Tensor, c_heads: Tensor, kind: str = "state", generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """:func:`group_bases` for one group: ``e_heads``, ``c_heads`` [h, K, K] → ([K, K], [K])."""
    b, lam = group_bases(e_heads[None], c_heads[None], kind, generator)
    return b[0], lam[0]


def nested_frame(b: Tensor) -> Tensor:
    """Orthogonal frames R [..., K, K] whose first m rows span ``b[..., :, :m]`` for every m ≤ r.

    ``b``: [..., K, r] bases, columns in order of importance. Computed by a complete QR ``b = Q T``
    (T upper triangular, so ``span Q[:, :m] = span b[:, :m]``), signs fixed so that ``diag T > 0``;
    ``R = Qᵀ``. Rows beyond r complete the frame arbitrarily.
    """
    k, r = b.shape[-2:]
    q, t = torch.linalg.qr(b, mode="complete")
    d = torch.diagonal(t[..., :r, :r], dim1=-2, dim2=-1)
    sign = torch.ones(*b.shape[:-2], k, dtype=b.dtype)
    sign[..., :r] = torch.where(d < 0, -1.0, 1.0).to(b.dtype)
    return (q * sign.unsqueeze(-2)).transpose(-1, -2).contiguous()


def coef_map(frame: Tensor, e: Tensor, m: int) -> Tensor:
    """Rotated-frame coefficient map ``[I_m  Gᵀ]`` [m, K] of one head at rank m.

    ``frame``: R [K, K]; ``e``: the head's regularised [K, K] state moment. The map in original
    coordinates is ``coef_map(R, E, m) @ R``, equal to ``(B_mᵀ E B_m)^{-1} B_mᵀ E`` for any B_m
    with the span of ``R[:m]ᵀ``.
    """
    return coef_maps(frame, e, [m])[m]


def coef_maps(frame: Tensor, e: Tensor, ranks: list[int]) -> dict[int, Tensor]:
    """:func:`coef_map` for several ranks (``E' = R E Rᵀ`` computed once). Dense (0) is skipped."""
    k = frame.shape[0]
    ep = _sym(frame @ e @ frame.T)
    out = {}
    for m in ranks:
        if m == 0:
            continue
        if not 0 < m <= k:
            raise ValueError(f"rank {m} outside 1..{k}")
        gt, info = torch.linalg.solve_ex(ep[:m, :m], ep[:m, m:])  # Gᵀ = E'_hh^{-1} E'_ht   [m, K−m]
        if int(info) != 0 or not bool(torch.isfinite(gt).all()):
            # E has no energy in part of the sketch: any solution is a least-squares one; take the smallest
            gt = torch.linalg.pinv(ep[:m, :m], hermitian=True) @ ep[:m, m:]
        out[m] = torch.cat([torch.eye(m, dtype=e.dtype), gt], dim=1)
    return out


def projection_map(frame: Tensor, m: int) -> Tensor:
    """Rotated-frame map of the orthogonal projection (the E = I ablation): ``[I_m  0]`` [m, K]."""
    k = frame.shape[0]
    out = torch.zeros(m, k, dtype=frame.dtype)
    out[:, :m] = torch.eye(m, dtype=frame.dtype)
    return out


def coef_map_direct(b_m: Tensor, e: Tensor) -> Tensor:
    """``P = (B_mᵀ E B_m)^{-1} B_mᵀ E`` [m, K] in original coordinates (the textbook formula)."""
    return torch.linalg.solve(b_m.T @ e @ b_m, b_m.T @ e)


def sketch_read(s: Tensor, u: Tensor, frame: Tensor, p_rot: Tensor) -> Tensor:
    """Approximate read ``(R S)_{:m}ᵀ (P_rot R u)``.

    ``s``: [..., K, V] states, ``u``: [..., K] queries (same leading dims or broadcastable),
    ``frame``: R [K, K], ``p_rot``: [m, K]. Returns [..., V].
    """
    m = p_rot.shape[0]
    sketch = frame[:m] @ s  # [..., m, V]
    coeff = (u @ frame.T) @ p_rot.T  # [..., m]
    return (coeff.unsqueeze(-2) @ sketch).squeeze(-2)


def read_error(frame: Tensor, p_rot: Tensor, e: Tensor, c: Tensor) -> float:
    """Relative expected read error of a static map from second moments.

    ``tr(Nᵀ E N C) / tr(E C)`` with ``N = I − R_{:m}ᵀ P_rot R`` (so ``Sᵀu − approx = Sᵀ N u``),
    assuming the checkpoint S and the query u are independent. ``e``, ``c``: [K, K].
    """
    k = frame.shape[0]
    m = p_rot.shape[0]
    if m == 0:
        return 1.0
    n = torch.eye(k, dtype=e.dtype) - frame[:m].T @ p_rot @ frame
    den = float((e * c).sum())  # tr(E C), both symmetric
    if den <= 0.0:
        return 0.0
    return float(((n.T @ e @ n) * c.T).sum()) / den
