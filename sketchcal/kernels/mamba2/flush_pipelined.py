"""Mamba-2's flush as a persistent, software-pipelined chunked fold, written in Gluon (CUDA only):
Mamba-2's default flush.

Each program walks the heads ``pid, pid + programs, …`` (work item = batch row × H + head). As
soon as a head's state tile and buffer have moved from shared memory into registers, the program
starts the next head's copies into the same shared memory (``cp.async``: no registers held), which
then run while it folds and stores the current head; one program per tile that loads, computes,
then stores has no load in flight while it computes. The head's small inputs (its buffered
decays, the new token) are loaded into registers one head ahead too, and the slot of the head after
that, so that no load waits at the start of a head.

The math is that of the chunked flush (``mamba2/flush_chunk.py``): with the ``n`` buffered tokens'
keys ``K_b`` [BC, K] (bf16), values ``W`` [BC, V] and decays ``α``,

    Sᵀ ← (α_0⋯α_{n−1}) Sᵀ + (g ⊙ W)ᵀ K_b,   g_j = α_{j+1}⋯α_{n−1},

on tensor cores, ``(g ⊙ W)ᵀ`` split into three bf16 terms (exact to fp32 rounding), the tile
``Sᵀ`` [V, K] the MMA accumulator. Then the flush's new token (optional), the state store, the
read copy (replay mode: every head; sketch mode: the dense heads) and the sketch ``R_{:m} S``
(``Sᵀ R_{:m}ᵀ`` on tensor cores, as ``flush_chunk.sketch_terms`` defines it). R's terms come split
already (``SketchTables.frame_terms``): the first 16 rows of the item's group are copied with its
tiles, into a ring of two slots (this item's, the next one's), and enter the products straight
from shared memory; rows past 16 (ranks above 16) are loaded from global memory.

Gluon kernels cannot run in the CPU interpreter: the ``gpu`` tests hold this kernel to the float64
reference.
"""

from __future__ import annotations

from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from sketchcal.kernels.common import gluon_helpers as gh
from sketchcal.kernels.common.flush import flush_arguments, flush_flags
from sketchcal.kernels.common.pool import DecodePool, SketchTables
from sketchcal.kernels.common.recurrence import StepInputs
from sketchcal.kernels.common.triton_helpers import buffer_block
from sketchcal.kernels.mamba2.flush_chunk import sketch_terms


@gluon.jit
def _split3(a):
    """An fp32 tensor as three bf16 terms, largest first (their sum is exact to fp32 rounding): the
    Gluon twin of ``triton_helpers.split_bf16``, written with Gluon's ops."""
    a1 = a.to(gl.bfloat16)
    rest = a - a1.to(gl.float32)
    a2 = rest.to(gl.bfloat16)
    a3 = (rest - a2.to(gl.float32)).to(gl.bfloat16)
    return a1, a2, a3


@gluon.jit
def _issue(
    state, buf_k, buf_w, ranks, frame_terms, item, s, n, s_smem, k_smem, w_smem, r_smem, H: gl.constexpr,
    G: gl.constexpr, K: gl.constexpr, V: gl.constexpr, C: gl.constexpr, BC: gl.constexpr, LS: gl.constexpr,
    LB: gl.constexpr, SKETCH_OUT: gl.constexpr, TERMS: gl.constexpr,
):  # fmt: skip
    """Start the copies of work item ``item`` (head ``item % H`` of batch row ``item // H``; slot
    ``s`` and ``n`` from ``gluon_helpers.work_item``) into shared memory: its state tile [K, V], buffered keys
    [BC, K] and values [BC, V] (rows ≥ n zero-filled), and with ``SKETCH_OUT`` the first 16 rows
    of its group's frame as two bf16 terms [32, K] (three, [48, K], when ``TERMS`` is 3; a head of
    rank 0 copies none). A padding slot or an item past the end copies zeros."""
    i_h = item % H
    live = s >= 0
    s64 = gl.where(live, s, 0).to(gl.int64)
    o_k = gl.arange(0, K, gl.SliceLayout(1, LS))
    o_v = gl.arange(0, V, gl.SliceLayout(0, LS))
    p_s = state + (s64 * H + i_h) * (K * V) + (o_k[:, None] * V + o_v[None, :])
    m_s = (o_k[:, None] < gl.where(live, K, 0)) & (o_v[None, :] < V)
    gh.async_load(s_smem, p_s, m_s)
    nb = gl.where(live, n, 0)
    o_c = gl.arange(0, BC, gl.SliceLayout(1, LB))
    o_kb = gl.arange(0, K, gl.SliceLayout(0, LB))
    p_k = buf_k + (s64 * G + i_h // (H // G)) * (C * K) + (o_c[:, None] * K + o_kb[None, :])
    m_k = (o_c[:, None] < nb) & (o_kb[None, :] < K)
    gh.async_load(k_smem, p_k, m_k)
    o_vb = gl.arange(0, V, gl.SliceLayout(0, LB))
    p_w = buf_w + (s64 * H + i_h) * (C * V) + (o_c[:, None] * V + o_vb[None, :])
    m_w = (o_c[:, None] < nb) & (o_vb[None, :] < V)
    gh.async_load(w_smem, p_w, m_w)
    if SKETCH_OUT:
        sketched = live & (gl.load(ranks + i_h) > 0)
        RT: gl.constexpr = 3 if TERMS == 3 else 2
        o_r = gl.arange(0, RT * 16, gl.SliceLayout(1, LB))
        # chunk 0 of group i_h // (H/G) in frame_terms [G, ⌈K/16⌉, 3, 16, K]: its first RT·16 rows
        group = frame_terms + (i_h // (H // G)) * (((K + 15) // 16) * 48 * K)
        p_r = group + (o_r[:, None] * K + o_kb[None, :])
        m_r = (o_r[:, None] < gl.where(sketched, RT * 16, 0)) & (o_kb[None, :] < K)
        gh.async_load(r_smem, p_r, m_r)
    async_copy.commit_group()


@gluon.jit
def _sketch_rows(
    St, b1, b2, b3, p_sk, r0, m, V: gl.constexpr, MMA: gl.constexpr, A_OP: gl.constexpr, TERMS: gl.constexpr
):
    """Sketch rows ``r0 … r0 + 15`` (those below ``m``) of one head, ``Sᵀ R_{r0:r0+16}ᵀ`` [V, 16],
    stored at ``p_sk`` (the head's sketch rows [M, V]): ``b1``-``b3`` are the chunk's terms of
    ``Rᵀ`` [K, 16] as B operands. The products of the terms of ``Sᵀ`` and ``Rᵀ`` down to
    2⁻⁸⁽ᵀᴱᴿᴹˢ⁻¹⁾ of the largest, one term of ``Sᵀ`` live at a time; ``TERMS`` = 1: ``Sᵀ`` rounded
    to bf16 times both terms of ``Rᵀ`` (``triton_helpers.dot_ff``'s definition)."""
    s1 = St.to(gl.bfloat16)
    a = gl.convert_layout(s1, A_OP)
    acc = mma_v2(a, b1, gl.zeros([V, 16], gl.float32, MMA))
    acc = mma_v2(a, b2, acc)
    if TERMS == 3:
        acc = mma_v2(a, b3, acc)
    if TERMS > 1:
        rest = St - s1.to(gl.float32)
        s2 = rest.to(gl.bfloat16)
        a = gl.convert_layout(s2, A_OP)
        acc = mma_v2(a, b1, acc)
    if TERMS == 3:
        acc = mma_v2(a, b2, acc)
        a = gl.convert_layout((rest - s2.to(gl.float32)).to(gl.bfloat16), A_OP)
        acc = mma_v2(a, b1, acc)
    o_vm = gl.arange(0, V, gl.SliceLayout(1, MMA))
    o_rm = gl.arange(0, 16, gl.SliceLayout(0, MMA))
    gl.store(
        p_sk + ((r0 + o_rm[None, :]) * V + o_vm[:, None]),
        acc.to(p_sk.dtype.element_ty),
        mask=(r0 + o_rm[None, :] < m) & (o_vm[:, None] < V),
    )


@gluon.jit
def _store_folded(
    St, state, rd, dense, sk_head, m, frame_terms, r_cur, head, frame, K: gl.constexpr, V: gl.constexpr,
    HAS_READ: gl.constexpr, ROWS: gl.constexpr, SKETCH_OUT: gl.constexpr, SKETCH_TERMS: gl.constexpr,
    MMA: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr, LS: gl.constexpr, LR: gl.constexpr,
):  # fmt: skip
    """The stores of a folded head (``St`` = Sᵀ [V, K] in the MMA layout), shared by the Gluon flushes:
    the state tile S [K, V] at element offset ``head`` of ``state`` (and, with ``HAS_READ``, of the
    read copy ``rd``; ``ROWS``: only for a dense head, ``dense`` > 0), and with ``SKETCH_OUT`` the
    sketch rows ``R_{:m} S`` at ``sk_head``: rows 0-15 from ``r_cur`` (the item's slot of the frame
    ring in shared memory), rows past 16 from ``frame_terms`` of frame ``frame``. ``dense`` and the
    rank ``m`` come from ``gluon_helpers.head_flags``, loaded by the caller at the head's start."""
    # through shared memory into rows of V: 16-byte stores, one address per 4 values
    tile = gl.convert_layout(gl.permute(St, [1, 0]), LS)  # S [K, V]
    o_ks = gl.arange(0, K, gl.SliceLayout(1, LS))
    o_vs = gl.arange(0, V, gl.SliceLayout(0, LS))
    offs = o_ks[:, None] * V + o_vs[None, :]
    gh.store_state(tile, state + head, rd + head, dense, offs, HAS_READ, ROWS)
    if SKETCH_OUT:
        if m > 0:  # rows 0-15: their terms were copied with the item's tiles
            b1 = r_cur.slice(0, 16).permute([1, 0]).load(B_OP)
            b2 = r_cur.slice(16, 16).permute([1, 0]).load(B_OP)
            b3 = r_cur.slice(32 if SKETCH_TERMS == 3 else 16, 16).permute([1, 0]).load(B_OP)
            _sketch_rows(St, b1, b2, b3, sk_head, 0, m, V, MMA, A_OP, SKETCH_TERMS)
        # rows 16 and up (ranks above 16): their terms straight from global memory
        o_r = gl.arange(0, 16, gl.SliceLayout(1, LR))
        o_kt = gl.arange(0, K, gl.SliceLayout(0, LR))
        for r0 in range(16, m, 16):
            chunk = frame_terms + ((frame * ((K + 15) // 16) + r0 // 16) * 48) * K
            chunk += o_r[:, None] * K + o_kt[None, :]
            b1 = gl.convert_layout(gl.permute(gl.load(chunk), [1, 0]), B_OP)
            b2 = gl.convert_layout(gl.permute(gl.load(chunk + 16 * K), [1, 0]), B_OP)
            b3 = b2
            if SKETCH_TERMS == 3:
                b3 = gl.convert_layout(gl.permute(gl.load(chunk + 32 * K), [1, 0]), B_OP)
            _sketch_rows(St, b1, b2, b3, sk_head, r0, m, V, MMA, A_OP, SKETCH_TERMS)


@gluon.jit
def _flush_pipelined_kernel(
    state, slots, pos, q, k, w, decay, beta, skip, out, buf_k, buf_w, buf_decay, buf_beta,  # flush_arguments
    rd, read_rows, sk, ranks, frames, sk_head_stride,
    frame_terms, n_items,
    H: gl.constexpr, G: gl.constexpr, K: gl.constexpr, V: gl.constexpr, C: gl.constexpr, BC: gl.constexpr,
    HAS_X: gl.constexpr, HAS_SKIP: gl.constexpr, HAS_READ: gl.constexpr, ROWS: gl.constexpr,
    SKETCH_OUT: gl.constexpr, SKETCH_TERMS: gl.constexpr,
):  # fmt: skip
    """The flush over ``n_items`` work items (see the module docstring); the arguments are the
    chunked flush's (``beta``, ``buf_beta``: unused, Mamba-2 has none; ``frames``: unused, the
    sketch reads ``SketchTables.frame_terms``), then ``frame_terms``."""
    WARPS: gl.constexpr = gl.num_warps()
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8]
    )
    A_OP: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    B_OP: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    # copies: 16 B per thread along the contiguous axis
    LS: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [WARPS, 1], [1, 0])  # [K, V] fp32
    LB: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])  # [BC, *] bf16
    LT: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [WARPS, 1], [1, 0])  # [V, BC] math
    LR: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [WARPS, 1], [1, 0])  # [16, K] rows of R
    # swizzled so that the MMA layout's reads of Sᵀ (8 consecutive v for 4 k pairs per warp) and
    # the operand reads of the buffers hit distinct banks
    SS: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, order=[1, 0])
    SB: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0])
    s_smem = gl.allocate_shared_memory(gl.float32, [K, V], SS)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [BC, K], SB)
    w_smem = gl.allocate_shared_memory(gl.bfloat16, [BC, V], SB)
    if SKETCH_OUT:  # the first 16 rows of R in two (three) bf16 terms: this item's and the next's
        r_ring = gl.allocate_shared_memory(gl.bfloat16, [2, (3 if SKETCH_TERMS == 3 else 2) * 16, K], SB)
        r_next = r_ring.index(0)
    else:
        r_next = k_smem  # (not written: nothing to copy)

    pid = gl.program_id(0)
    progs = gl.num_programs(0)
    o_vm = gl.arange(0, V, gl.SliceLayout(1, MMA))
    L1: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])  # per-token scalars, the new token
    o_c1 = gl.arange(0, BC, L1)
    # the first item's copies and small inputs, and the next item's slot: then, in each iteration,
    # the next item's copies and small inputs and the slot of the one after, a step ahead of use
    s_c, n_c = gh.work_item(slots, pos, pid, n_items, H)
    _issue(
        state, buf_k, buf_w, ranks, frame_terms, pid, s_c, n_c, s_smem, k_smem, w_smem, r_next, H, G, K, V, C,
        BC, LS, LB, SKETCH_OUT, SKETCH_TERMS,
    )  # fmt: skip
    al, al_next, kk, qq, ww, sw, dd = _small_inputs(
        k, q, w, decay, skip, buf_decay, pid, s_c, n_c, H, G, K, V, C, BC, L1, HAS_X, HAS_SKIP
    )
    s_n, n_n = gh.work_item(slots, pos, pid + progs, n_items, H)
    cur = 0  # this item's slot of r_ring
    for item in range(pid, n_items, progs):
        i_b = item // H
        i_h = item % H
        i_g = i_h // (H // G)
        m_c, r_c = gh.head_flags(ranks, read_rows, item, H, SKETCH_OUT, ROWS)  # for the stores
        async_copy.wait_group(0)
        gh.barrier()
        St = s_smem.permute([1, 0]).load(MMA)  # Sᵀ [V, K]
        kb = k_smem.load(B_OP)  # [BC, K]
        wt = w_smem.permute([1, 0]).load(LT).to(gl.float32)  # Wᵀ [V, BC]
        gh.barrier()
        # the next head's copies run while this one is folded and stored
        if SKETCH_OUT:
            r_next = r_ring.index(1 - cur)
        nxt = item + progs
        _issue(
            state, buf_k, buf_w, ranks, frame_terms, nxt, s_n, n_n, s_smem, k_smem, w_smem, r_next, H, G, K,
            V, C, BC, LS, LB, SKETCH_OUT, SKETCH_TERMS,
        )  # fmt: skip
        nxt = gl.where(nxt < n_items, nxt, 0)
        al_n, al_next_n, kk_n, qq_n, ww_n, sw_n, dd_n = _small_inputs(
            k, q, w, decay, skip, buf_decay, nxt, s_n, n_n, H, G, K, V, C, BC, L1, HAS_X, HAS_SKIP
        )
        s_nn, n_nn = gh.work_item(slots, pos, item + 2 * progs, n_items, H)
        if s_c >= 0:
            s64 = s_c.to(gl.int64)
            g = gl.associative_scan(al_next, 0, gh.mul, reverse=True)
            total = gl.sum(gl.where(o_c1 == 0, g * al, 0.0), axis=0)
            a1, a2, a3 = _split3(wt * gl.convert_layout(g, gl.SliceLayout(0, LT))[None, :])
            St = St * total
            St = mma_v2(gl.convert_layout(a3, A_OP), kb, St)
            St = mma_v2(gl.convert_layout(a2, A_OP), kb, St)
            St = mma_v2(gl.convert_layout(a1, A_OP), kb, St)
            if HAS_X:
                xw = (i_b * H + i_h) * V
                kx = gl.convert_layout(kk, gl.SliceLayout(0, MMA)).to(gl.float32)
                vx = gl.convert_layout(ww, gl.SliceLayout(1, MMA)).to(gl.float32)
                St = St * dd.to(gl.float32) + vx[:, None] * kx[None, :]
                o = gl.sum(St * gl.convert_layout(qq, gl.SliceLayout(0, MMA)).to(gl.float32)[None, :], axis=1)
                if HAS_SKIP:
                    o += gl.convert_layout(sw, gl.SliceLayout(1, MMA)).to(gl.float32)
                gl.store(out + xw + o_vm, o.to(out.dtype.element_ty))
            if SKETCH_OUT:  # noqa: SIM108  (a constexpr branch: r_ring exists only then)
                r_cur = r_ring.index(cur)
            else:
                r_cur = k_smem  # (not read)
            # one 64-bit base per head, 32-bit offsets within it
            _store_folded(
                St, state, rd, r_c, sk + (s64 * H + i_h) * sk_head_stride, m_c, frame_terms, r_cur,
                (s64 * H + i_h) * (K * V), i_g, K, V, HAS_READ, ROWS, SKETCH_OUT, SKETCH_TERMS, MMA, A_OP,
                B_OP, LS, LR,
            )  # fmt: skip
        s_c, n_c, s_n, n_n = s_n, n_n, s_nn, n_nn
        al, al_next, kk, qq, ww, sw, dd = al_n, al_next_n, kk_n, qq_n, ww_n, sw_n, dd_n
        cur = 1 - cur
    async_copy.wait_group(0)


@gluon.jit
def _small_inputs(
    k, q, w, decay, skip, buf_decay, item, s, n, H: gl.constexpr, G: gl.constexpr, K: gl.constexpr,
    V: gl.constexpr, C: gl.constexpr, BC: gl.constexpr, L1: gl.constexpr, HAS_X: gl.constexpr,
    HAS_SKIP: gl.constexpr,
):  # fmt: skip
    """Work item ``item``'s small inputs, loaded one item ahead into few registers (1-D layouts
    spread over the whole program): the buffered decays ``α_j`` and ``α_{j+1}`` [BC] (1 past n),
    and with ``HAS_X`` the new token's key and query [K], value and skip [V] and decay."""
    i_b = item // H
    i_h = item % H
    hb = (gl.where(s >= 0, s, 0).to(gl.int64) * H + i_h) * C
    o_c = gl.arange(0, BC, L1)
    al = gl.load(buf_decay + hb + o_c, mask=o_c < n, other=1.0)
    al_next = gl.load(buf_decay + hb + o_c + 1, mask=o_c + 1 < n, other=1.0)
    o_k = gl.arange(0, K, L1)
    o_v = gl.arange(0, V, L1)
    live = (s >= 0) & HAS_X
    xk = (i_b * G + i_h // (H // G)) * K
    kk = gl.load(k + xk + o_k, mask=live & (o_k < K), other=0.0)
    qq = gl.load(q + xk + o_k, mask=live & (o_k < K), other=0.0)
    xw = (i_b * H + i_h) * V
    ww = gl.load(w + xw + o_v, mask=live & (o_v < V), other=0.0)
    sw = gl.load(skip + xw + o_v, mask=live & HAS_SKIP & (o_v < V), other=0.0)
    dd = gl.load(decay + i_b * H + i_h, mask=live, other=1.0)
    return al, al_next, kk, qq, ww, sw, dd


def launch(
    family: str, pool: DecodePool, tables: SketchTables | None, slots: Tensor, pos: Tensor,
    x: StepInputs | None, out: Tensor | None, cfg,
) -> None:  # fmt: skip
    """:func:`_flush_pipelined_kernel` on ``cfg.per_sm`` programs per SM over the batch's heads,
    for a checked Mamba-2 window pool (and new token) with bf16 buffered inputs on a CUDA device."""
    sketch = tables is not None
    sk = pool.sketch if sketch else pool.state
    gh.launch_persistent(
        _flush_pipelined_kernel, flush_arguments(pool, tables, slots, pos, x, out),
        tables.frame_terms if sketch else pool.buf_decay, H=pool.heads, G=pool.buf_k.shape[1],
        K=pool.state.shape[2], V=pool.state.shape[3], C=pool.capacity, BC=buffer_block(pool.capacity),
        **flush_flags(pool, tables, x), SKETCH_TERMS=sketch_terms(sk.dtype), batch=slots.shape[0],
        per_sm=cfg.per_sm, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg,
    )  # fmt: skip
