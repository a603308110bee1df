"""The token-by-token flush, shared by the three families, and the argument list of every flush.

A flush folds the ``pos[b]`` buffered tokens of a slot (then the call's new token, if any) exactly
into its fp32 checkpoint, token by token: ``S ← A_j S + k_j w_jᵀ`` on a [K, BV] tile per program
(grid ``(V / BV, H, B)``), scalar decays (Mamba-2, GDN) kept in a separate scale
(``forward_scaled``), KDA's per-channel decays applied to the tile. Then the state store, the read
copy (replay mode: every row; sketch mode: the dense heads, ``SketchTables.read_rows``) and, in
sketch mode, the sketch ``R_{:m} S`` [m, V] of each head of rank m, row by row on the FMA units.

Launch shape (``KernelConfig``): ``block_v``, ``num_warps``, ``maxnreg``; ``vec`` caps the value
columns each thread holds (more of each k·S reduction inside the thread, fewer shuffles);
``prefetch`` asks L2 for the buffered tokens first.

:func:`flush_arguments` is the positional argument list that every flush kernel takes (this one,
Mamba-2's chunked and Gluon flushes, KDA's Gluon sweep), so each launcher adds only its
constexprs.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from sketchcal.kernels.common.pool import DecodePool, SketchTables, is_dense, slot_strides, value_major
from sketchcal.kernels.common.recurrence import StepInputs
from sketchcal.kernels.common.triton_helpers import (
    FAMILY_ID,
    beta_or_placeholder,
    clip_block_v,
    dependent_launch,
    forward,
    forward_scaled,
    launch_options,
    load_token,
    prefetch_buffer,
    prefetch_enabled,
    step_emit,
    store_read_copy,
    tile_ptrs,
)


@triton.jit
def _flush_kernel(
    state, slots, pos, q, k, w, decay, beta, skip, out, buf_k, buf_w, buf_decay, buf_beta,  # flush_arguments
    rd, read_rows, sk, ranks, frames, sk_head_stride, ss_st, ss_bk, ss_bw, ss_bd, ss_bb, ss_rd, ss_sk,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    FAMILY: tl.constexpr, HAS_X: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_READ: tl.constexpr,
    ROWS: tl.constexpr, SKETCH_OUT: tl.constexpr, VEC: tl.constexpr, PREFETCH: tl.constexpr,
    PAGED: tl.constexpr, ST_VM: tl.constexpr, RD_VM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The token-by-token flush on [K, BV] tiles of S (any family); ``PREFETCH``: see
    ``KernelConfig.prefetch``. ``PAGED``: the pool is not dense (``pool.is_dense``), each tensor's
    slot part is at its slot stride ``ss_*`` (:func:`slot_args`); ``ST_VM`` / ``RD_VM``: the state /
    read copy is stored value-major."""
    dependent_launch(PDL)
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    s = tl.load(slots + i_b).to(tl.int64)
    if s < 0:
        return
    n = tl.load(pos + i_b)
    i_g = i_h // (H // G)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    # a value-major state is held as a [BV, K] tile (keys on axis 1), each value column's k·S
    # reduction along contiguous keys; a key-major one as [K, BV]
    KX: tl.constexpr = 1 if ST_VM else 0
    if VEC > 0 and not ST_VM:
        # a true (smaller) contiguity bound: the tile's layout then gives each thread VEC columns
        o_v = tl.max_contiguous(o_v, VEC)
    live = s >= 0
    if PAGED:  # each tensor's slot part where its slot stride puts it; heads counted within it
        buf_k, buf_w = buf_k + s * ss_bk, buf_w + s * ss_bw
        buf_decay, buf_beta = buf_decay + s * ss_bd, buf_beta + s * ss_bb
        state, rd, sk = state + s * ss_st, rd + s * ss_rd, sk + s * ss_sk
        sh, sg = i_h, i_g
    else:  # dense [N, ...] arrays: the head's and group's index over all slots
        sh, sg = s * H + i_h, s * G + i_g
    hb = sh * C
    gb = sg * C
    p_s = tile_ptrs(state + sh * (K * V), o_k, o_v, K, V, ST_VM, KX)
    if PREFETCH:
        prefetch_buffer(buf_k, buf_w, buf_decay, buf_beta, hb, gb, n, i_v * BV, K, V, BV, C, FAMILY)
    S = tl.load(p_s, eviction_policy="evict_first")
    # a rolled loop (an unrolled one overflows the instruction cache) that loads token j + 1
    # while token j is applied; scalar decays go into a separate scale (forward_scaled), applied
    # once at the end
    kk, ww, dd, bb = load_token(
        buf_k, buf_w, buf_decay, buf_beta, gb * K, hb * V, hb, o_k, o_v, n > 0, K, V, FAMILY,
    )  # fmt: skip
    scale = dd * 0.0 + 1.0  # Mamba-2, GDN: the decay product so far (KDA: unused)
    for j in range(0, n):
        kn, wn, dn, bn = load_token(
            buf_k, buf_w, buf_decay, buf_beta, (gb + j + 1) * K, (hb + j + 1) * V, hb + j + 1, o_k, o_v,
            j + 1 < n, K, V, FAMILY,
        )  # fmt: skip
        if FAMILY == 2:  # per-channel decays go straight into the tile
            S = forward(S, kk, ww, dd, bb, FAMILY, KX)
        else:
            S, scale = forward_scaled(S, scale, kk, ww, dd, bb, FAMILY, KX)
        kk, ww, dd, bb = kn, wn, dn, bn
    if FAMILY != 2:
        S = S * scale
    if HAS_X:
        S = step_emit(
            S, q, k, w, decay, beta, skip, out, i_b, i_h, i_g, o_k, o_v, live, H, G, K, V, FAMILY, HAS_SKIP,
            KX,
        )  # fmt: skip
    tl.store(p_s, S, eviction_policy="evict_first")
    if HAS_READ:
        p_r = tile_ptrs(rd + sh * (K * V), o_k, o_v, K, V, RD_VM, KX)
        store_read_copy(S, p_r, read_rows, i_h, ROWS)
    if SKETCH_OUT:
        m = tl.load(ranks + i_h)
        sk_h = sk + sh * sk_head_stride
        fr_g = frames + i_g * K * K  # R of this head's group, [K, K]
        # row by row on the FMA units: the sweep's tile layout is not a tensor-core operand's,
        # and converting it costs more than the m reductions over K. Row r + 1 of R is loaded
        # while row r is applied.
        rrow = tl.load(fr_g + o_k, mask=o_k < tl.where(m > 0, K, 0), other=0.0)
        for r in range(0, m):
            rnext = tl.load(fr_g + (r + 1) * K + o_k, mask=o_k < tl.where(r + 1 < m, K, 0), other=0.0)
            row = tl.sum(S * tl.expand_dims(rrow, 1 - KX), axis=KX)
            tl.store(sk_h + r * V + o_v, row.to(sk.dtype.element_ty))
            rrow = rnext


def flush_arguments(
    pool: DecodePool, tables: SketchTables | None, slots: Tensor, pos: Tensor, x: StepInputs | None,
    out: Tensor | None,
) -> tuple:  # fmt: skip
    """The positional arguments of every flush kernel, from ``state`` to ``sk_head_stride``: the
    pool, the new token's inputs (``x`` None: the buffer's tensors stand in, never read), the
    output, the read copy (or the state), the sketch tables (or placeholders in replay mode)."""
    sketch = tables is not None
    sk = pool.sketch if sketch else pool.state
    xs = x if x is not None else StepInputs(pool.buf_k, pool.buf_k, pool.buf_w, pool.buf_decay, pool.buf_beta)
    dummy = pool.buf_decay
    return (
        pool.state,
        slots,
        pos,
        xs.q,
        xs.k,
        xs.w,
        xs.decay,
        beta_or_placeholder(xs),
        xs.skip if xs.skip is not None else xs.w,
        out if out is not None else dummy,
        pool.buf_k,
        pool.buf_w,
        pool.buf_decay,
        pool.buf_beta if pool.buf_beta is not None else dummy,
        pool.read if pool.read is not None else pool.state,
        tables.read_rows if sketch else slots,
        sk,
        tables.ranks if sketch else slots,
        tables.frames if sketch else dummy,
        sk.shape[2] * sk.shape[3],
    )


def slot_args(pool: DecodePool, tables: SketchTables | None) -> tuple:
    """The sweep's slot strides (``ss_st`` … ``ss_sk``), in the order of :func:`flush_arguments`'s
    pool tensors; the other flushes index dense pools only."""
    rd = pool.read if pool.read is not None else pool.state
    sk = pool.sketch if tables is not None else pool.state
    strides = slot_strides(pool, "state", "buf_k", "buf_w", "buf_decay", "buf_beta", fallback=pool.buf_decay)
    return (*strides, rd.stride(0), sk.stride(0))


def flush_flags(pool: DecodePool, tables: SketchTables | None, x: StepInputs | None) -> dict:
    """The constexprs every flush kernel takes besides the dims: a new token (and its skip), a read
    copy, sketch mode (the read copy's dense rows only, and the sketch written)."""
    sketch = tables is not None
    return dict(
        HAS_X=x is not None,
        HAS_SKIP=x is not None and x.skip is not None,
        HAS_READ=pool.read is not None,
        ROWS=sketch,
        SKETCH_OUT=sketch,
    )


def launch(
    family: str, pool: DecodePool, tables: SketchTables | None, slots: Tensor, pos: Tensor,
    x: StepInputs | None, out: Tensor | None, cfg,
) -> None:  # fmt: skip
    """:func:`_flush_kernel` over (V / BV, H, B) for a checked window pool (and new token)."""
    h, g = pool.heads, pool.buf_k.shape[1]
    kd, vd = pool.state.shape[2:]
    bv = clip_block_v(cfg.block_v, vd)
    paged = not is_dense(pool)  # only a paged pool may hold its state (and fp32 read copy) value-major
    _flush_kernel[(vd // bv, h, slots.shape[0])](
        *flush_arguments(pool, tables, slots, pos, x, out), *slot_args(pool, tables), H=h, G=g, K=kd, V=vd,
        BV=bv, C=pool.capacity,
        FAMILY=FAMILY_ID[family], **flush_flags(pool, tables, x), VEC=cfg.vec,
        PREFETCH=prefetch_enabled(cfg.prefetch), PAGED=paged, ST_VM=paged and value_major(pool.state),
        RD_VM=paged and value_major(pool.read if pool.read is not None else pool.state),
        **launch_options(cfg.num_warps, cfg.maxnreg, pool.state.device),
    )  # fmt: skip
