"""Per-head read-error curves: predicted from second moments, measured on held-out windows.

For a head with frame R (its group's), rank m and rotated map ``P_rot`` [m, K]:

- **predicted** (from moments ``E``, ``C``, as :func:`sketchcal.fit.basis.read_error`):
  ``err(m) = tr(Nᵀ E N C) / tr(E C)``, ``N = I − R_{:m}ᵀ P_rot R``: the expected squared read error
  over the expected squared read, assuming the checkpoint and the query are independent. Evaluated
  with the *raw* (unshrunk) calibration moments, or the held-out ones, while the map was built
  from the shrunk calibration E. With the output-weighted query moment ``C_fisher = Σ γ u uᵀ`` it
  is the output-weighted relative error ``Σ γ ‖δ‖² / Σ γ ‖S_cᵀu‖²`` (γ: :mod:`sketchcal.calibrate.fisher`).
- **measured** (from the verbatim held-out windows): ``Σ γ ‖S_cᵀu − (R S_c)_{:m}ᵀ (P_rot R u)‖² /
  Σ γ ‖S_cᵀu‖²``, summed over all sampled windows and their existing non-flush reads (a ratio of
  sums, not a mean of ratios), each read weighted by its γ (1 without weights).
- **measured adaptive** (the adaptive sketch, same windows and weights): the read
  ``Q (P_S u)`` of ``reference.adaptive_read``, with the factors ``reference.adaptive_factor``
  makes of each checkpoint on the frame's first r rows, in place of the static map's read (every
  rank from one orthonormalisation per checkpoint: :func:`measured_adaptive_curve`). No moment
  formula predicts it (the map depends on the checkpoint), so it is measured only.

Dense (m = 0) is exact: error 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sketchcal.fit.basis import read_error


def predicted_curve(frame: Tensor, maps: dict[int, Tensor], e: Tensor, c: Tensor, ranks: list[int]) -> Tensor:
    """Predicted relative error of one head at each rank. Returns [len(ranks)] float64.

    ``maps[m]``: the head's rotated map [m, K] for every non-zero m in ``ranks``; ``e``, ``c``:
    [K, K] mean moments to evaluate with.
    """
    out = torch.zeros(len(ranks), dtype=torch.float64)
    ep, cp = frame @ e @ frame.T, frame @ c @ frame.T
    den = float((ep * cp).sum())
    if den <= 0.0:
        return out  # the head is never read with any energy: nothing to approximate
    k = frame.shape[0]
    for i, m in enumerate(ranks):
        if not m:
            continue
        p = maps[m]
        if not torch.equal(p[:, :m], torch.eye(m, dtype=p.dtype)):
            out[i] = read_error(frame, p, e, c)
            continue
        # rotated residual N' = I − [I_m; 0][I_m  Gᵀ] is zero on the first m columns; its tail is [−Gᵀ; I]
        tail = torch.cat([-p[:, m:], torch.eye(k - m, dtype=p.dtype)], dim=0)  # [K, K−m]
        out[i] = float(((tail.T @ ep @ tail) * cp[m:, m:]).sum()) / den
    return out


def measured_curve(
    frame: Tensor,
    maps: dict[int, Tensor],
    s: Tensor,
    u: Tensor,
    mask: Tensor,
    ranks: list[int],
    gamma: Tensor | None = None,
) -> Tensor:
    """Measured relative read error of one head on held-out windows. Returns [len(ranks)] float64.

    Args:
        frame: R [K, K]; maps: rotated maps as in :func:`predicted_curve`.
        s: [R, K, V] checkpoints of the sampled windows (this head).
        u: [R, L−1, K] effective queries of their non-flush reads (this head).
        mask: [R, L−1] bool, True where the read exists.
        gamma: [R, L−1] output weights of the reads (None: all 1).
    NaN for every rank when the windows hold no (weighted) read energy.
    """
    s, u, exact, den = _weighted_reads(s, u, mask, gamma)
    out = torch.zeros(len(ranks), dtype=torch.float64)
    if den <= 0.0:
        return out.fill_(float("nan"))
    s_rot = torch.einsum("jk,rkv->rjv", frame, s)
    u_rot = u @ frame.T
    for i, m in enumerate(ranks):
        if m:
            coeff = u_rot @ maps[m].T  # [R, L−1, m]
            approx = torch.einsum("rtm,rmv->rtv", coeff, s_rot[:, :m])
            diff = exact - approx
            out[i] = float((diff * diff).sum()) / den
    return out


def measured_adaptive_curve(
    frame: Tensor, s: Tensor, u: Tensor, mask: Tensor, ranks: list[int], gamma: Tensor | None = None
) -> Tensor:
    """Measured relative read error of one head's adaptive sketch at each rank r of ``ranks`` on
    held-out windows (arguments as :func:`measured_curve`; the bases are the frame's first r rows).
    Returns [len(ranks)] float64, NaN for every rank when the windows hold no (weighted) read energy.

    The read at rank r is ``Sᵀu`` projected onto span(Sᵀ R_{:r}ᵀ) (``reference.adaptive_factor`` /
    ``adaptive_read``). These spans are nested in r, so one orthonormalisation of ``Sᵀ R_{:r_max}ᵀ``
    per checkpoint, column by column in rank order (as the flush kernel's, :func:`_nested_basis`),
    gives every rank's basis as its first r columns.
    """
    s, u, exact, den = _weighted_reads(s, u, mask, gamma)
    out = torch.zeros(len(ranks), dtype=torch.float64)
    if den <= 0.0:
        return out.fill_(float("nan"))
    top = max(ranks)
    if top == 0:
        return out
    m = torch.einsum("rkv,jk->rvj", s, frame[:top].to(torch.float64))  # Sᵀ R_{:top}ᵀ [R, V, top]
    q = _nested_basis(m)
    coeff = torch.einsum("rtv,rvj->rtj", exact, q)  # the read's coordinates on the columns
    for i, rank in enumerate(ranks):
        if rank:
            diff = exact - torch.einsum("rtj,rvj->rtv", coeff[..., :rank], q[..., :rank])
            out[i] = float((diff * diff).sum()) / den
    return out


def _nested_basis(m: Tensor) -> Tensor:
    """[R, V, J] columns → [R, V, J] orthonormal columns whose first j span the first j of ``m``
    (Gram–Schmidt, twice per column); a column whose part orthogonal to the ones before it is below
    ``max(V, J)·ε`` of the largest column is dropped (a zero column), as ``reference.adaptive_factor``
    drops such singular directions."""
    q = torch.zeros_like(m)
    tol = m.norm(dim=-2).amax(-1) * max(m.shape[-2:]) * torch.finfo(m.dtype).eps  # [R]
    for j in range(m.shape[-1]):
        col = m[..., j]
        for _ in range(2):
            col = col - torch.einsum("rvi,ri->rv", q[..., :j], torch.einsum("rvi,rv->ri", q[..., :j], col))
        norm = col.norm(dim=-1)
        keep = norm > tol
        q[..., j] = torch.where(keep.unsqueeze(-1), col / torch.where(keep, norm, 1.0).unsqueeze(-1), 0.0)
    return q


def _weighted_reads(
    s: Tensor, u: Tensor, mask: Tensor, gamma: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, float]:
    """``(s, √γ·u, S_cᵀ(√γ·u), Σ γ‖S_cᵀu‖²)`` in float64 for checkpoints ``s`` [R, K, V] and queries
    ``u`` [R, L−1, K] (masked reads weigh 0): each read's squared error then counts γ times."""
    s = s.to(torch.float64)
    weight = mask.to(torch.float64) if gamma is None else mask.to(torch.float64) * gamma.to(torch.float64)
    u = u.to(torch.float64) * weight.sqrt().unsqueeze(-1)
    exact = torch.einsum("rkv,rtk->rtv", s, u)
    return s, u, exact, float((exact * exact).sum())
