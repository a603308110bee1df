"""KDA's flush as a persistent, software-pipelined Gluon sweep (CUDA only), with the per-channel
decays deferred into one scale per key channel: KDA's default flush.

Triton's sweep (``common/flush.py``, KDA's fallback) runs one program per [K, BV] tile and spends
three operations per state element per buffered token: the decay ``S ← Diag(α_j) S``, the dot
``kᵀ S`` and the rank-1 update; every program also rebuilds each token's per-channel terms (keys,
decays) for its own tile, and no load is in flight while it computes. Here a program of
``num_warps`` warps takes whole heads, ``pid, pid + programs, …``, a work item at a time: a work
item is ``KernelConfig.block_v`` value columns of a head, each warp a band of 16 (or 8) columns,
and a head's items follow one another. While one item is swept, the next item's state tile,
buffered keys, decays and values are copied into shared memory (``cp.async``). Several programs per
SM (``KernelConfig.per_sm``) let the phases of one (coefficients, sweep, stores, sketch) overlap
those of the others.

The math: with ``c_j = α_0 ⊙ ⋯ ⊙ α_j`` (per channel, running products) the head's state is held as
``S = Diag(c) Ŝ``, and token j (``w_j = β_j v_j``) costs two operations per element:

    d_j = w_j − Ŝᵀ (β_j c_j ⊙ k_j),   Ŝ ← Ŝ + (k_j / c_j) d_jᵀ,

since ``kᵀ Diag(α_j) S_{j−1} = (c_j ⊙ k_j)ᵀ Ŝ`` and ``Diag(α_j) S_{j−1} + k_j d_jᵀ = Diag(c_j)(Ŝ +
(k_j / c_j) d_jᵀ)``. The two coefficient rows of every token are built once per head, one channel per
thread, into shared memory, by the head's first item; its later items sweep with the same rows.
``S = Diag(c_{n−1}) Ŝ`` at the end. The scale only moves each key row by a factor: the rounding is
that of the direct sweep. A window whose running products leave [2⁻⁶⁴, 2⁶⁴] (a decay product that
underflows, an exact zero) would overflow ``k / c``: that head is swept the direct way instead
(``Diag(α_j)`` applied at each token, three operations per element), from the same shared memory.

Then the flush's new token, the state store, the read copy (replay: every head; sketch: the dense
heads) and the sketch ``R_{:m} S`` (exact fp32 products of R's rows, on the FMA units, as the
Triton sweep writes it).

Gluon kernels cannot run in the CPU interpreter: the ``gpu`` tests hold this kernel to the float64
reference.
"""

from __future__ import annotations

from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from sketchcal.kernels.common.flush import flush_arguments, flush_flags
from sketchcal.kernels.common.gluon_helpers import (
    async_load,
    barrier,
    head_flags,
    launch_persistent,
    mul,
    store_state,
    work_item,
)
from sketchcal.kernels.common.pool import DecodePool, SketchTables
from sketchcal.kernels.common.recurrence import StepInputs

# the running products the scaled sweep takes: their reciprocals stay finite and normal
from sketchcal.kernels.common.triton_helpers import HUGE, TINY, clip_block_v

if hasattr(gl.shared_memory_descriptor, "reinterpret"):  # Triton ≥ 3.7

    @gluon.jit
    def _rows(plane, R: gl.constexpr, N: gl.constexpr, layout: gl.constexpr):
        """The plane [R, N] viewed as [R, 1, N]: ``.index(j)`` is then row j as [1, N], at a dynamic j."""
        return plane.reinterpret(plane.dtype, [R, 1, N], layout)

else:  # Triton 3.6

    @gluon.jit
    def _rows(plane, R: gl.constexpr, N: gl.constexpr, layout: gl.constexpr):
        """The plane [R, N] viewed as [R, 1, N]: ``.index(j)`` is then row j as [1, N], at a dynamic j."""
        return plane._reinterpret(plane.dtype, [R, 1, N], layout)


@gluon.jit
def _issue_window(
    state, buf_k, buf_w, buf_decay, item, s, n, s_smem, k_smem, w_smem, a_smem, v0, H: gl.constexpr,
    K: gl.constexpr, V: gl.constexpr, C: gl.constexpr, BC: gl.constexpr, LS: gl.constexpr, LB: gl.constexpr,
    LF: gl.constexpr, VT: gl.constexpr,
):  # fmt: skip
    """Start the copies of head item ``item``'s window (slot ``s``, ``n`` buffered tokens) into
    shared memory, uncommitted: value columns ``v0 … v0 + VT`` of its state tile ([K, VT] fp32) and
    buffered values ([BC, VT] bf16), and its buffered keys [BC, K] bf16 and decays [BC, K] fp32
    (rows ≥ n zero-filled). A padding slot or an item past the end copies zeros."""
    i_h = item % H
    live = s >= 0
    head = gl.where(live, s, 0).to(gl.int64) * H + i_h
    o_k = gl.arange(0, K, gl.SliceLayout(1, LS))
    o_v = gl.arange(0, VT, gl.SliceLayout(0, LS))
    m_s = (o_k[:, None] < gl.where(live, K, 0)) & (o_v[None, :] < VT)
    async_load(s_smem, state + head * (K * V) + v0 + (o_k[:, None] * V + o_v[None, :]), m_s)
    nb = gl.where(live, n, 0)
    o_c = gl.arange(0, BC, gl.SliceLayout(1, LB))
    o_kb = gl.arange(0, K, gl.SliceLayout(0, LB))
    o_vb = gl.arange(0, VT, gl.SliceLayout(0, LB))
    m_k = (o_c[:, None] < nb) & (o_kb[None, :] < K)
    async_load(k_smem, buf_k + head * (C * K) + (o_c[:, None] * K + o_kb[None, :]), m_k)  # G = H
    m_w = (o_c[:, None] < nb) & (o_vb[None, :] < VT)
    async_load(w_smem, buf_w + head * (C * V) + v0 + (o_c[:, None] * V + o_vb[None, :]), m_w)
    o_cf = gl.arange(0, BC, gl.SliceLayout(1, LF))
    o_kf = gl.arange(0, K, gl.SliceLayout(0, LF))
    m_a = (o_cf[:, None] < nb) & (o_kf[None, :] < K)
    async_load(a_smem, buf_decay + head * (C * K) + (o_cf[:, None] * K + o_kf[None, :]), m_a)


@gluon.jit
def _small_inputs(
    k, q, w, decay, beta, skip, buf_beta, item, s, n, v0, H: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
    C: gl.constexpr, BC: gl.constexpr, L1: gl.constexpr, LBT: gl.constexpr, HAS_X: gl.constexpr,
    HAS_SKIP: gl.constexpr, VT: gl.constexpr,
):  # fmt: skip
    """Head item ``item``'s small inputs, loaded one item ahead into few registers (1-D layouts
    spread over the whole program; loaded in the tile's layouts instead, each thread would load 16
    of each vector): the buffered betas [BC] (0 past n, in ``LBT``) and with ``HAS_X`` the new
    token's key, query and decay [K], value columns ``v0 … v0 + VT`` of its value and skip [VT]
    (``L1``) and beta."""
    i_b = item // H
    i_h = item % H
    live_s = s >= 0
    o_c = gl.arange(0, BC, LBT)
    hb = (gl.where(live_s, s, 0).to(gl.int64) * H + i_h) * C
    bt = gl.load(buf_beta + hb + o_c, mask=o_c < gl.where(live_s, n, 0), other=0.0)
    o_k = gl.arange(0, K, L1)
    o_v = gl.arange(0, VT, L1)
    live = live_s & HAS_X
    xk = (i_b * H + i_h) * K  # G = H
    xw = (i_b * H + i_h) * V + v0
    mk = live & (o_k < K)
    kk = gl.load(k + xk + o_k, mask=mk, other=0.0)
    qq = gl.load(q + xk + o_k, mask=mk, other=0.0)
    dd = gl.load(decay + xk + o_k, mask=mk, other=1.0)
    ww = gl.load(w + xw + o_v, mask=live & (o_v < VT), other=0.0)
    sw = gl.load(skip + xw + o_v, mask=live & HAS_SKIP & (o_v < VT), other=0.0)
    bx = gl.load(beta + i_b * H + i_h, mask=live, other=0.0)
    return bt, kk, qq, dd, ww, sw, bx


@gluon.jit
def _issue(
    state, buf_k, buf_w, buf_decay, buf_beta, m, frames, item, s, n, s_smem, k_smem, a_smem, w_smem, b_smem,
    r_smem, H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, C: gl.constexpr, BC: gl.constexpr,
    MR: gl.constexpr, LS: gl.constexpr, LB: gl.constexpr, LF: gl.constexpr, L1: gl.constexpr,
    SKETCH_OUT: gl.constexpr, VB: gl.constexpr,
):  # fmt: skip
    """Start the copies of work item ``item`` (value columns ``VB · (item % (V / VB))`` onwards of a
    head item; slot ``s``, ``n`` buffered tokens) into shared memory: its state tile [K, VB] fp32,
    buffered keys [BC, K] bf16, decays [BC, K] fp32, values [BC, VB] bf16 and betas [BC] fp32 (rows
    ≥ n zero-filled), and with ``SKETCH_OUT`` the first ``MR`` rows of its frame R [MR, K] fp32
    (rows ≥ its rank ``m`` zero-filled). A padding slot or an item past the end copies zeros."""
    NV: gl.constexpr = V // VB
    i_h = (item // NV) % H
    live = s >= 0
    _issue_window(
        state, buf_k, buf_w, buf_decay, item // NV, s, n, s_smem, k_smem, w_smem, a_smem, (item % NV) * VB, H,
        K, V, C, BC, LS, LB, LF, VB,
    )  # fmt: skip
    # the betas read in the coefficients' layout: a copy instead of a layout conversion (two barriers)
    o_b = gl.arange(0, BC, L1)
    hb = (gl.where(live, s, 0).to(gl.int64) * H + i_h) * C
    async_load(b_smem, buf_beta + hb + o_b, o_b < gl.where(live, n, 0))
    if SKETCH_OUT:
        m = gl.where(live, m, 0)
        o_kf = gl.arange(0, K, gl.SliceLayout(0, LF))
        o_r = gl.arange(0, MR, gl.SliceLayout(1, LF))
        m_r = (o_r[:, None] < m) & (o_kf[None, :] < K)
        async_load(r_smem, frames + i_h * (K * K) + (o_r[:, None] * K + o_kf[None, :]), m_r)
    async_copy.commit_group()


@gluon.jit
def _take_item(w_smem, r_smem, w_cur, r_cur, LB: gl.constexpr, LF: gl.constexpr, SKETCH_OUT: gl.constexpr):
    """An item's values (and with ``SKETCH_OUT`` its frame's first rows, which the previous item's
    sketch may have replaced by later ones) move from the copy buffers ``w_smem`` (``r_smem``) to
    ``w_cur`` (``r_cur``), out of the way of the next item's copies."""
    w_cur.store(w_smem.load(LB))
    if SKETCH_OUT:
        r_cur.store(r_smem.load(LF))


@gluon.jit
def _coefficients(
    a_smem, k_smem, w_smem, r_smem, b_smem, n, dot_smem, upd_smem, scale_smem, w_cur, r_cur, K: gl.constexpr,
    BC: gl.constexpr, LD: gl.constexpr, LB: gl.constexpr, LF: gl.constexpr, SKETCH_OUT: gl.constexpr,
):  # fmt: skip
    """One head's per-token coefficient rows [BC, K] (``dot_smem``, ``upd_smem``) and final scale
    [K] (``scale_smem``) from its buffered decays, keys and betas [BC] (shared memory):
    ``β_j c_j ⊙ k_j``, ``k_j / c_j`` and ``c_{n−1}`` when every running product lies in
    [TINY, HUGE] (returns True); else ``α_j``, ``k_j`` and ones, for the direct sweep (returns
    False). One key channel per thread (``LD``: its tokens in registers, so the scan stays in the
    thread); rows ≥ n are identity tokens (k = 0, α = 1). The item's values (and frame rows) move
    out of the copy buffers first (:func:`_take_item`)."""
    _take_item(w_smem, r_smem, w_cur, r_cur, LB, LF, SKETCH_OUT)
    o_c = gl.arange(0, BC, gl.SliceLayout(1, LD))
    al = gl.where(o_c[:, None] < n, a_smem.load(LD), 1.0)
    kf = k_smem.load(LD).to(gl.float32)
    c = gl.associative_scan(al, 0, mul)
    bad = gl.max(gl.max(gl.where((c >= TINY) & (c <= HUGE), 0, 1), axis=0), axis=0)
    fast = bad == 0
    if fast:
        b = b_smem.load(gl.SliceLayout(1, LD))
        dot_smem.store(b[:, None] * c * kf)
        upd_smem.store(kf / c)
        scale_smem.store(gl.sum(gl.where(o_c[:, None] == BC - 1, c, 0.0), axis=0))
    else:
        dot_smem.store(al)
        upd_smem.store(kf)
        scale_smem.store(gl.full([K], 1.0, gl.float32, gl.SliceLayout(0, LD)))
    return fast


@gluon.jit
def _nth_item(pid, progs, t, n_mine, n_items, NV: gl.constexpr):
    """The ``t``-th work item of program ``pid`` (of ``progs``): part ``t % NV`` of its head
    ``pid + (t // NV) · progs``; ``n_items`` (past the end) once ``t`` reaches ``n_mine``."""
    return gl.where(t < n_mine, (pid + (t // NV) * progs) * NV + t % NV, n_items)


@gluon.jit
def _flush_kda_sweep_kernel(
    state, slots, pos, q, k, w, decay, beta, skip, out, buf_k, buf_w, buf_decay, buf_beta,  # flush_arguments
    rd, read_rows, sk, ranks, frames, sk_head_stride,
    frame_terms, n_items,
    H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, C: gl.constexpr, BC: gl.constexpr,
    MR: gl.constexpr, VB: gl.constexpr, HAS_X: gl.constexpr, HAS_SKIP: gl.constexpr, HAS_READ: gl.constexpr,
    ROWS: gl.constexpr, SKETCH_OUT: gl.constexpr,
):  # fmt: skip
    """The flush over ``n_items`` work items (see the module docstring); the arguments are every
    flush's (``common.flush.flush_arguments``; the sketch reads R from ``frames`` [H, K, K] fp32),
    then ``frame_terms`` (unused) and the item count. A work item is ``VB`` value columns of one
    head (item = (batch row × H + head) × V / VB + part), 16 or 8 per warp; BC is 16; K a multiple
    of 32; the first MR (a multiple of 4) rows of each head's frame are copied with its tiles,
    further rows MR at a time into the same buffer as the sketch rows need them."""
    WARPS: gl.constexpr = gl.num_warps()
    CW: gl.constexpr = VB // WARPS  # value columns per warp: 16 or 8
    NV: gl.constexpr = V // VB  # items per head
    HV: gl.constexpr = H * NV  # items per batch row
    TR: gl.constexpr = 16 // WARPS if WARPS < 16 else 1  # lanes along the 16 rows of a [16, *] copy
    SV: gl.constexpr = min(16, VB // 4)  # lanes along V of the state tile's copy
    # the state tile [K, VB]: each warp CW value columns, a thread CW/4 of them on 4 runs of 4 key
    # rows (4 lanes along V, 8 along K): the k·S reduction is 16 values in the thread, then 3 shuffles
    LT: gl.constexpr = gl.BlockedLayout([4, CW // 4], [8, 4], [1, WARPS], [1, 0])
    ROW: gl.constexpr = gl.SliceLayout(1, LT)  # [K] per key row: a run of 4 per lane, 16-B reads
    COL: gl.constexpr = gl.SliceLayout(0, LT)  # [VB] per value column
    # copies: 16 B per thread along the contiguous axis
    LS: gl.constexpr = gl.BlockedLayout([1, 4], [32 // SV, SV], [WARPS, 1], [1, 0])  # [K, VB] fp32
    LB: gl.constexpr = gl.BlockedLayout([1, 8], [TR, 32 // TR], [WARPS, 1], [1, 0])  # [16, *] bf16
    LF: gl.constexpr = gl.BlockedLayout([1, 4], [TR, 32 // TR], [WARPS, 1], [1, 0])  # [16, K] fp32
    # the coefficients: one key channel per thread with its tokens in registers
    DR: gl.constexpr = max(1, 32 * WARPS // K)  # lanes along a channel's tokens: the tile covered once
    LD: gl.constexpr = gl.BlockedLayout([BC // DR, 1], [DR, 32 // DR], [1, WARPS], [0, 1])
    L1: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    # the state tile swizzled so that the 8 lanes along K (rows 4 apart) of each 16-B read of LT hit
    # distinct banks; the rest unswizzled (rows read whole, or one channel per lane)
    SS: gl.constexpr = gl.SwizzledSharedLayout(4, 4, 8, order=[1, 0])
    SP: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    SP1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    s_smem = gl.allocate_shared_memory(gl.float32, [K, VB], SS)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [BC, K], SP)
    a_smem = gl.allocate_shared_memory(gl.float32, [BC, K], SP)
    w_smem = gl.allocate_shared_memory(gl.bfloat16, [BC, VB], SP)
    w_cur = gl.allocate_shared_memory(gl.bfloat16, [BC, VB], SP)  # this item's, while the next's arrive
    dot_smem = gl.allocate_shared_memory(gl.float32, [BC, K], SP)
    upd_smem = gl.allocate_shared_memory(gl.float32, [BC, K], SP)
    scale_smem = gl.allocate_shared_memory(gl.float32, [K], SP1)
    b_smem = gl.allocate_shared_memory(gl.float32, [BC], SP1)
    # the same planes as [BC, 1, K], for reads of one token's row ([1, K]) at a dynamic index
    dot_rows = _rows(dot_smem, BC, K, SP)
    upd_rows = _rows(upd_smem, BC, K, SP)
    w_rows = _rows(w_cur, BC, VB, SP)
    if SKETCH_OUT:  # the frame's first MR rows: the copy buffer, and this item's
        r_smem = gl.allocate_shared_memory(gl.float32, [MR, K], SP)
        r_cur = gl.allocate_shared_memory(gl.float32, [MR, K], SP)
        r_rows = _rows(r_cur, MR, K, SP)
    else:  # (neither written nor read; no view of MR rows: Triton 3.8 checks a view's size)
        r_smem = a_smem
        r_cur = a_smem
        r_rows = dot_rows

    pid = gl.program_id(0)
    progs = gl.num_programs(0)
    o_k = gl.arange(0, K, ROW)
    o_v = gl.arange(0, VB, COL)
    offs = o_k[:, None] * V + o_v[None, :]
    # a program takes whole heads, pid, pid + progs, …, and a head's NV items one after the other: the
    # coefficient rows it builds for the first serve the rest (the same keys, decays and betas)
    n_mine = ((n_items // NV - pid + progs - 1) // progs) * NV  # this program's items
    item = _nth_item(pid, progs, 0, n_mine, n_items, NV)
    s_c, n_c = work_item(slots, pos, item, n_items, HV)
    m_c, r_c = head_flags(ranks, read_rows, item // NV, H, SKETCH_OUT, ROWS)
    _issue(
        state, buf_k, buf_w, buf_decay, buf_beta, m_c, frames, item, s_c, n_c, s_smem, k_smem, a_smem, w_smem,
        b_smem, r_smem, H, K, V, C, BC, MR, LS, LB, LF, L1, SKETCH_OUT, VB,
    )  # fmt: skip
    item_c = gl.where(item < n_items, item, 0)
    _, kk, qq, dd, ww, sw, bx = _small_inputs(
        k, q, w, decay, beta, skip, buf_beta, item_c // NV, s_c, n_c, (item_c % NV) * VB, H, K, V, C, BC, L1,
        L1, HAS_X, HAS_SKIP, VB,
    )  # fmt: skip
    nxt = _nth_item(pid, progs, 1, n_mine, n_items, NV)
    s_n, n_n = work_item(slots, pos, nxt, n_items, HV)
    m_n, r_n = head_flags(ranks, read_rows, nxt // NV, H, SKETCH_OUT, ROWS)
    fast = n_mine < 0  # (set by each head's first item)
    for t in range(0, n_mine):
        i_b = item // HV
        i_h = (item // NV) % H
        v0 = (item % NV) * VB  # the item's first value column
        # the loads for the items ahead, issued first: the compiler moves the scalars among them into
        # uniform registers at the next branch, which waits for them
        nxt_c = gl.where(nxt < n_items, nxt, 0)
        _, kk_n, qq_n, dd_n, ww_n, sw_n, bx_n = _small_inputs(
            k, q, w, decay, beta, skip, buf_beta, nxt_c // NV, s_n, n_n, (nxt_c % NV) * VB, H, K, V, C, BC,
            L1, L1, HAS_X, HAS_SKIP, VB,
        )  # fmt: skip
        nxt2 = _nth_item(pid, progs, t + 2, n_mine, n_items, NV)
        s_nn, n_nn = work_item(slots, pos, nxt2, n_items, HV)
        m_nn, r_nn = head_flags(ranks, read_rows, nxt2 // NV, H, SKETCH_OUT, ROWS)
        async_copy.wait_group(0)
        barrier()  # (also: every thread is past the previous item's sweep)
        if t % NV == 0:  # a head's first item: its coefficient rows
            fast = _coefficients(
                a_smem, k_smem, w_smem, r_smem, b_smem, n_c, dot_smem, upd_smem, scale_smem, w_cur, r_cur, K,
                BC, LD, LB, LF, SKETCH_OUT,
            )  # fmt: skip
        else:  # the head's rows are still in place: this item's values (and frame rows) only
            _take_item(w_smem, r_smem, w_cur, r_cur, LB, LF, SKETCH_OUT)
        S = s_smem.load(LT)
        barrier()
        # the next head's copies run while this one is swept and stored
        _issue(
            state, buf_k, buf_w, buf_decay, buf_beta, m_n, frames, nxt, s_n, n_n, s_smem, k_smem, a_smem,
            w_smem, b_smem, r_smem, H, K, V, C, BC, MR, LS, LB, LF, L1, SKETCH_OUT, VB,
        )  # fmt: skip
        if s_c >= 0:
            head = s_c.to(gl.int64) * H + i_h
            if fast:
                for j in range(0, n_c):
                    a = dot_rows.index(j).permute([1, 0]).load(LT)  # [K, 1]
                    u = upd_rows.index(j).permute([1, 0]).load(LT)
                    wj = w_rows.index(j).load(LT).to(gl.float32)  # [1, V]
                    d = wj - gl.sum(S * a, axis=0, keep_dims=True)
                    S = S + u * d
            else:  # the direct sweep: dot_smem holds the decays, upd_smem the keys
                hb = head * C
                for j in range(0, n_c):
                    al = dot_rows.index(j).permute([1, 0]).load(LT)
                    kj = upd_rows.index(j).permute([1, 0]).load(LT)
                    wj = w_rows.index(j).load(LT).to(gl.float32)
                    S = S * al
                    d = wj - gl.load(buf_beta + hb + j) * gl.sum(S * kj, axis=0, keep_dims=True)
                    S = S + kj * d
            f = scale_smem.load(ROW)
            if HAS_X:  # the new token's decay goes into the same multiply as the scale
                S = S * (f * gl.convert_layout(dd, ROW).to(gl.float32))[:, None]
                kx = gl.convert_layout(kk, ROW).to(gl.float32)
                ks = gl.sum(S * kx[:, None], axis=0)
                vx = gl.convert_layout(ww, COL).to(gl.float32)
                S = S + kx[:, None] * (vx - bx.to(gl.float32) * ks)[None, :]
                o = gl.sum(S * gl.convert_layout(qq, ROW).to(gl.float32)[:, None], axis=0)
                if HAS_SKIP:
                    o += gl.convert_layout(sw, COL).to(gl.float32)
                gl.store(out + (i_b * H + i_h) * V + v0 + o_v, o.to(out.dtype.element_ty))
            else:
                S = S * f[:, None]
            base = head * (K * V) + v0
            store_state(S, state + base, rd + base, r_c, offs, HAS_READ, ROWS)
            if SKETCH_OUT:
                # R_{:m} S on the FMA units (fp32 products), four rows of R at a time (four independent
                # reductions), MR rows at a time from shared memory: the first MR copied with the
                # item's tiles, each further MR copied into the same buffer once every warp is past
                # the previous ones (rows ≥ m zero-filled)
                m = m_c
                sk_h = sk + (head * sk_head_stride + v0)  # the item's first column of row 0 (a scalar)
                fr = frames + i_h * (K * K)  # R of this head, [K, K]
                o_rf = gl.arange(0, MR, gl.SliceLayout(1, LF))
                o_kf = gl.arange(0, K, gl.SliceLayout(0, LF))
                for r0 in range(0, m, MR):
                    if r0 > 0:
                        barrier()  # every warp is done with the rows before r0
                        m_r = ((r0 + o_rf)[:, None] < m) & (o_kf[None, :] < K)
                        async_load(r_cur, fr + ((r0 + o_rf)[:, None] * K + o_kf[None, :]), m_r)
                        async_copy.commit_group()
                        async_copy.wait_group(0)  # (the next item's copies, issued long before, too)
                        barrier()
                    for r in range(r0, gl.minimum(m, r0 + MR), 4):
                        for i in gl.static_range(4):
                            rr = r_rows.index(r - r0 + i).permute([1, 0]).load(LT)
                            x = gl.sum(S * rr, axis=0, keep_dims=True)
                            row_ok = (r + i < m) & (o_v[None, :] < VB)
                            gl.store(
                                sk_h + ((r + i) * V + o_v[None, :]), x.to(sk.dtype.element_ty), mask=row_ok
                            )
        item, nxt = nxt, nxt2
        s_c, n_c, s_n, n_n = s_n, n_n, s_nn, n_nn
        m_c, m_n, r_c, r_n = m_n, m_nn, r_n, r_nn
        kk, qq, dd, ww, sw, bx = kk_n, qq_n, dd_n, ww_n, sw_n, bx_n
    async_copy.wait_group(0)


def usable(
    heads: int, groups: int, key_dim: int, value_dim: int, capacity: int, num_warps: int, block_v: int
) -> bool:
    """Whether this kernel takes a KDA pool of these dims in work items of ``block_v`` value columns
    (``KernelConfig.block_v``, clipped to V): one head per group, a buffer of at most 16 tokens, 16
    or 8 value columns per warp (up to 8 warps), ``block_v`` dividing V, and K a multiple of 32 (the
    tile layout's key rows)."""
    return (
        groups == heads
        and 0 < capacity <= 16
        and num_warps in (1, 2, 4, 8)
        and block_v in (8 * num_warps, 16 * num_warps)
        and value_dim % block_v == 0
        and key_dim % 32 == 0
    )


# the shared memory an SM gives its programs (the H200's 228 KB, less 1 KB per program for the
# system's use), and what a program of this kernel takes besides its buffers (Triton's scratch)
SM_SHARED = 227 * 1024
SCRATCH = 2 * 1024


def shared_bytes(key_dim: int, value_cols: int, frame_rows: int) -> int:
    """The shared memory of one program (BC = 16): the state tile [K, VB] fp32; keys [16, K] bf16;
    decays and both coefficient planes [16, K] fp32; values [16, VB] bf16 twice; the scale [K]; and
    two [MR, K] fp32 frame buffers."""
    return (
        4 * key_dim * value_cols
        + 2 * 16 * key_dim
        + 3 * 4 * 16 * key_dim
        + 2 * 2 * 16 * value_cols
        + 4 * key_dim
        + 2 * 4 * frame_rows * key_dim
    )


def frame_rows(per_sm: int, key_dim: int, value_cols: int) -> int:
    """The frame rows a program copies with each work item's tiles: 16 where ``per_sm`` programs of
    that size fit in an SM's shared memory (a head of K = V = 128 per program: ~117 KB; half a head:
    ~81 KB), else 8."""
    fits = per_sm * (shared_bytes(key_dim, value_cols, 16) + SCRATCH) <= SM_SHARED
    return 16 if fits else 8


def launch(
    family: str, pool: DecodePool, tables: SketchTables | None, slots: Tensor, pos: Tensor,
    x: StepInputs | None, out: Tensor | None, cfg,
) -> None:  # fmt: skip
    """:func:`_flush_kda_sweep_kernel` on ``cfg.per_sm`` programs per SM over V / VB work items per
    head (VB = ``cfg.block_v`` clipped to V; BC is 16, MR from :func:`frame_rows`), for a checked
    KDA window pool (and new token) that :func:`usable` takes, with bf16 buffered inputs on a CUDA
    device."""
    kd, vd = pool.state.shape[2:]
    vb = clip_block_v(cfg.block_v, vd)
    launch_persistent(
        _flush_kda_sweep_kernel,
        flush_arguments(pool, tables, slots, pos, x, out),
        pool.buf_decay,  # frame_terms: not read
        H=pool.heads,
        K=kd,
        V=vd,
        C=pool.capacity,
        **flush_flags(pool, tables, x),
        VB=vb,
        BC=16,
        MR=frame_rows(cfg.per_sm, kd, vb),
        parts=vd // vb,
        batch=slots.shape[0],
        per_sm=cfg.per_sm,
        num_warps=cfg.num_warps,
        maxnreg=cfg.maxnreg,
    )
