"""The adaptive sketch on the kernels: a map made for each checkpoint at its flush.

A flush writes the sketch rows ``T = R_{:m} S_c`` [m, V] of every head of rank m, as for the
static sketch (``pool.sketch``). :func:`factor` (one Triton kernel, a program per batch entry and
head) turns them into the adaptive read's factors, in the math of ``reference.adaptive_factor``
(another orthonormal basis of the same span):

    Qᵀ = orth(T)          [M, V]: Gram–Schmidt over the head's m rows, twice per row (rows past m zero)
    P_S = Qᵀ S_cᵀ          [M, K]: one more pass over the checkpoint (none for a dense head)

The read of effective query ``u`` is then ``Q (P_S u)``: ``S_cᵀ u`` projected onto the span of
``S_cᵀ R_{:m}ᵀ``, what the reference's SVD gives, up to rounding. Qᵀ is written over T in the
pool's sketch (each program has read its head's T whole before it stores: every row of Qᵀ
depends on the largest row of T). The read kernel takes ``P_S`` and ``Qᵀ`` as per-slot
coefficient maps and sketch rows (:class:`AdaptiveSketch`), so a sketch step reads
``m·(K + V)`` values per head instead of ``m·V``. Dense heads (rank 0) read their read copy as
in the static sketch.

A row of ``T`` whose part orthogonal to the rows before it is below ``TOL`` of the largest row
(a rank-deficient state, or one that is still zero) gets a zero row of Qᵀ, as the reference
drops singular values below its tolerance; either way the read of it is negligible.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from sketchcal.kernels.common.pool import AdaptiveSketch, DecodePool, next_pow2, value_major
from sketchcal.kernels.common.triton_helpers import interpreting

TOL = 2.0**-20  # a row of T with less of its own direction than this (relative) is dropped


@triton.jit
def _factor_kernel(
    slots, state, sketch, rows, maps, ranks, ss_state, ss_sketch, ss_rows, ss_maps, K: tl.constexpr,
    V: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, SM: tl.constexpr, BK: tl.constexpr,
    TOL: tl.constexpr, PRECISION: tl.constexpr, STATE_VM: tl.constexpr,
):  # fmt: skip
    """Program (head, batch entry): Qᵀ [M, V] and P_S [M, K] of the entry's slot and head (nothing
    for padding). ``sketch`` [N, H, SM, V] the flush's rows T, ``state`` [N, H, K, V] fp32
    (``STATE_VM``: each slot's part stored value-major, [H, V, K]); each tensor's slot part at its
    slot stride ``ss_*`` (a dense pool's or a page's)."""
    i_h = tl.program_id(0)
    i_b = tl.program_id(1)
    s = tl.load(slots + i_b).to(tl.int64)
    if s < 0:  # padding, or a row that is not flushing in this call: nothing to read or write
        return
    state += s * ss_state + i_h * (K * V)
    sketch += s * ss_sketch + i_h * (SM * V)
    rows += s * ss_rows + i_h * (M * V)
    maps += s * ss_maps + i_h * (M * K)
    m = tl.load(ranks + i_h)
    o_r = tl.arange(0, MP)
    o_v = tl.arange(0, V)
    t = tl.load(sketch + o_r[:, None] * V + o_v[None, :], mask=o_r[:, None] < m, other=0.0)
    t = t.to(tl.float32)
    largest = tl.max(tl.sqrt(tl.sum(t * t, axis=1)), axis=0)
    q = tl.zeros([MP, V], dtype=tl.float32)
    for i in range(0, m):  # rows ≥ m of T are zero (a rolled loop: the head's own rank)
        row = tl.sum(tl.where(o_r[:, None] == i, t, 0.0), axis=0)  # [V]
        for _ in tl.static_range(2):  # rows ≥ i of q are still zero
            row -= tl.sum(tl.sum(q * row[None, :], axis=1)[:, None] * q, axis=0)
        norm = tl.sqrt(tl.sum(row * row, axis=0))
        keep = norm > TOL * largest
        row = tl.where(keep, row / tl.where(keep, norm, 1.0), 0.0)
        q = tl.where(o_r[:, None] == i, row[None, :], q)
    out_rows = o_r[:, None] < M
    tl.store(rows + o_r[:, None] * V + o_v[None, :], q.to(rows.dtype.element_ty), mask=out_rows)
    if m > 0:  # a dense head reads its read copy, never P_S: its checkpoint is not read here
        for k0 in tl.static_range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            in_k = o_k[:, None] < K
            if STATE_VM:
                s_at = state + o_v[None, :] * K + o_k[:, None]
            else:
                s_at = state + o_k[:, None] * V + o_v[None, :]
            s_blk = tl.load(s_at, mask=in_k, other=0.0)  # [BK, V]
            p = tl.dot(q, tl.trans(s_blk), input_precision=PRECISION)  # [MP, BK]
            p_out = maps + o_r[:, None] * K + o_k[None, :]
            tl.store(p_out, p.to(maps.dtype.element_ty), mask=out_rows & (o_k[None, :] < K))


def factor(
    pool: DecodePool,
    sketch: AdaptiveSketch,
    slots: Tensor,
    *,
    block_k: int = 32,
    num_warps: int | None = None,
) -> None:
    """The adaptive factors of the checkpoints ``pool.state[slots]`` from the sketch rows their
    flush just wrote (``pool.sketch[slots]``), into ``sketch.rows`` / ``sketch.maps``; entries
    with a negative slot write nothing. ``pool`` is dense or paged (``pool.check_paged``: its state
    may be value-major), ``sketch`` checked for it (:meth:`AdaptiveSketch.check`).

    ``num_warps`` (default: 1 for a layer of at most 16 rows, else 2): one warp keeps Gram–Schmidt's
    reductions within it (at 12 rows, batch 256, GDN's shape on an H200: 156 µs, 2 warps 299, 4
    warps 766; splitting a head's P_S columns over 2–4 programs, each redoing the Gram–Schmidt, was
    1.2–1.8× slower); wider layers spill one warp's registers (48 rows: 1,393 µs, 2 warps 715).
    ``P_S`` comes from the tensor cores in TF32 when it is stored in bf16 (TF32's rounding, 2⁻¹¹, is
    below bf16's), else in three TF32 products (about fp32's)."""
    precision = "tf32" if sketch.maps.dtype.itemsize < 4 else "tf32x3"
    if interpreting():  # (the interpreter multiplies in fp32 and takes no TF32)
        precision = "ieee"
    _, h, kd, vd = pool.state.shape
    m = sketch.tables.map_rows
    mp = max(16, next_pow2(m))
    if num_warps is None:
        num_warps = 1 if mp <= 16 else 2
    state_vm = value_major(pool.state)
    _factor_kernel[(h, slots.numel())](
        slots, pool.state, pool.sketch, sketch.rows, sketch.maps, sketch.tables.ranks, pool.state.stride(0),
        pool.sketch.stride(0), sketch.rows.stride(0), sketch.maps.stride(0), K=kd, V=vd, M=m, MP=mp,
        SM=pool.sketch.shape[2], BK=min(block_k, kd), TOL=TOL, PRECISION=precision, STATE_VM=state_vm,
        num_warps=num_warps,
    )  # fmt: skip
