"""The adaptive sketch on the kernels: a map made for each checkpoint at its flush.

A flush writes the sketch rows ``T = R_{:m} S_c`` [m, V] of every head of rank m, as for the
static sketch (``pool.sketch``). :func:`factor` turns them into the adaptive read's factors,
per flushed slot and head, in the same math as ``reference.adaptive_factor`` (other basis of the
same span):

    G = T Tᵀ = L Lᵀ            (Cholesky, M × M; a row r ≥ m gets G_rr = 1, so L stays regular)
    Qᵀ = L⁻¹ T                 [M, V], orthonormal rows spanning those of T
    P_S = L⁻¹ (T S_cᵀ) = Qᵀ S_cᵀ   [M, K], one more pass over the checkpoint

The read of effective query ``u`` is then ``Q (P_S u)``: ``S_cᵀ u`` projected onto the span of
``S_cᵀ R_{:m}ᵀ``, what the reference's SVD gives, up to rounding. The read kernel takes
``P_S`` and ``Qᵀ`` as per-slot coefficient maps and sketch rows (:class:`AdaptiveSketch`), so a
sketch step reads ``m·(K + V)`` values per head instead of ``m·V``. Dense heads (rank 0) read
their read copy as in the static sketch.

A direction of ``T`` below ``2⁻²⁰`` of its head's largest (a rank-deficient state, or one that is
still zero) is damped by the ``EPS`` ridge instead of being dropped, as the reference drops
singular values below its tolerance; either way the read of it is negligible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sketchcal.kernels.common.pool import DecodePool, SketchTables

EPS = 2.0**-40  # ridge on G, relative to the head's largest diagonal entry (T's energy squared)


@dataclass
class AdaptiveSketch:
    """A layer's adaptive sketch for a pool of N slots: the static tables (bases, ranks, dense
    heads) and the per-slot factors the flushes write.

        tables  the layer's :class:`SketchTables` (its ``maps`` are not read)
        rows    [N + 1, H, M, V] Qᵀ per slot (read dtype); row N takes padding entries' writes
        maps    [N + 1, H, M, K] P_S per slot (read dtype); row N as ``rows``
    """

    tables: SketchTables
    rows: Tensor
    maps: Tensor

    @classmethod
    def allocate(cls, tables: SketchTables, pool: DecodePool) -> AdaptiveSketch:
        """Zero factors for every slot of ``pool`` (a dense window pool with a sketch), in its
        sketch's dtype and on its device."""
        if pool.sketch is None:
            raise ValueError("the adaptive sketch needs a pool with sketch rows (sketch mode)")
        if pool.sketch.dtype.itemsize == 1:
            raise ValueError("the adaptive sketch keeps its factors in bf16 or fp32; use a bf16 read copy")
        n, h, kd, vd = pool.state.shape
        m = tables.map_rows
        z = dict(dtype=pool.sketch.dtype, device=pool.sketch.device)
        return cls(tables, torch.zeros(n + 1, h, m, vd, **z), torch.zeros(n + 1, h, m, kd, **z))

    @property
    def slots(self) -> int:
        return self.rows.shape[0] - 1


def factor(pool: DecodePool, sketch: AdaptiveSketch, slots: Tensor) -> None:
    """The adaptive factors of the checkpoints ``pool.state[slots]`` from the sketch rows their
    flush just wrote (``pool.sketch[slots]``), into ``sketch.rows`` / ``sketch.maps``; entries
    with a negative slot write row N. Torch operations on the device, no host synchronisation."""
    m = sketch.tables.map_rows
    live = slots >= 0
    idx = slots.clamp_min(0).long()
    t = pool.sketch.index_select(0, idx)[:, :, :m].float()  # [B, H, M, V]
    t = t * sketch.tables.rank_mask().to(t)[None, :, :, None]
    s = pool.state.index_select(0, idx)  # [B, H, K, V] fp32 (key-major)
    g = t @ t.transpose(-1, -2)  # [B, H, M, M]
    diag = g.diagonal(dim1=-2, dim2=-1)
    unused = ~sketch.tables.rank_mask()[None]  # [1, H, M]
    ridge = (EPS * diag.amax(-1, keepdim=True)).clamp_min(1e-30)  # a zero state: L = 1e-15 I, Qᵀ = 0
    g = g + torch.diag_embed(torch.where(unused, torch.ones_like(diag), ridge.expand_as(diag)))
    chol, _ = torch.linalg.cholesky_ex(g)
    qt = torch.linalg.solve_triangular(chol, t, upper=False)  # [B, H, M, V]
    p = torch.linalg.solve_triangular(chol, t @ s.transpose(-1, -2), upper=False)  # [B, H, M, K]
    dest = torch.where(live, idx, torch.full_like(idx, sketch.slots))
    sketch.rows.index_copy_(0, dest, qt.to(sketch.rows.dtype))
    sketch.maps.index_copy_(0, dest, p.to(sketch.maps.dtype))
