"""KDA's flush as a persistent, software-pipelined chunked (UT) fold on tensor cores, in Gluon
(CUDA only).

The token-by-token flush (``decode._flush_kernel``) spends ~300 instructions per buffered token on
every [K, 16] tile of a head: it is issue-bound at about half of copy bandwidth (BENCHMARKS.md).
Here a program of ``num_warps`` warps takes whole heads (work item = batch row × H + head), walking
``pid, pid + programs, …`` as Mamba-2's Gluon flush does (``common/flush_pipelined.py``, whose
helpers it shares): while one head is folded, the next head's state tile, buffered keys, values
and decays, and its frame rows, are copied into shared memory (``cp.async``).

The math, for one head with ``n`` buffered tokens (keys ``k_j`` bf16, per-channel decays
``α_j`` [K] fp32, ``β_j``, ``w_j = β_j v_j``; rows past ``n`` are identity tokens), on the tile
``Sᵀ`` [V, K] (the MMA accumulator, each warp a band of value rows):

    γ_j = α_0⋯α_j,  ρ_i = α_{i+1}⋯α_{n−1}  (per channel; running products, never ratios)
    H_{ji} = Σ_c k_j k_i α_{i+1}⋯α_j        (j > i: the decayed Gram, a running product on the
                                             FMA units, 16 rows of ``k_i ⊙ α_{i+1}⋯α_j``)
    X = (K ⊙ Γ) S                           (tensor cores: [16, K] × [K, V])
    D_j = w_j − β_j (X_j + Σ_{i<j} H_{ji} D_i)   (forward substitution, one value row per thread)
    S ← γ_{n−1} ⊙ S + (K ⊙ ρ)ᵀ D            (tensor cores: [K, 16] × [16, V])

Both tensor-core products multiply two fp32 operands, each split into three bf16 terms (the six
products down to 2⁻¹⁶ of the largest: exact to fp32 rounding, as ``decode._dot_ff`` with TERMS 3).
Then the flush's new token (per-channel decay and delta rule on the registers), the state store,
the read copy (replay: every head; sketch: the dense heads) and the sketch ``R_{:m} S`` exactly as
Mamba-2's Gluon flush writes it (``decode.sketch_terms``).

Speed (BENCHMARKS.md, eleventh session): on the H200 it is 1.40–1.44× slower than KDA's sweep (908
against 629 µs for the sketch flush at batch 256), so it is a tuning candidate, not the default. Its
174 KB of shared memory leave one program of 8 warps per SM; without the folding it runs at copy
speed, and the folding's chains of dependent steps (the Gram's reductions, the substitution, the
MMA chains) take ~9 µs per head that nothing overlaps.

Gluon kernels cannot run in the CPU interpreter: the ``gpu`` tests hold this kernel to the float64
reference (``decode.flush`` chooses it with ``KernelConfig.pipelined``).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from sketchcal.kernels.common.flush_pipelined import (
    _async_load,
    _barrier,
    _entry,
    _head_flags,
    _mul,
    _split3,
    _store_folded,
    launch_persistent,
)


@gluon.jit
def _suffix(p1, e1, i1, p2, e2, i2):
    """Combine two runs of tokens for a scan over (product, product after the run's first token,
    first token index): whichever run comes first keeps its exclusive product times the other's
    whole one (so the order the scan passes them in does not matter)."""
    first = i1 < i2
    return p1 * p2, gl.where(first, e1 * p2, e2 * p1), gl.where(first, i1, i2)


@gluon.jit
def _issue_window(
    state,
    buf_k,
    buf_w,
    buf_decay,
    item,
    s,
    n,
    s_smem,
    k_smem,
    w_smem,
    a_smem,
    v0,
    H: gl.constexpr,
    K: gl.constexpr,
    V: gl.constexpr,
    C: gl.constexpr,
    BC: gl.constexpr,
    LS: gl.constexpr,
    LB: gl.constexpr,
    LF: gl.constexpr,
    VT: gl.constexpr,
):
    """Start the copies of head item ``item``'s window (slot ``s``, ``n`` buffered tokens) into
    shared memory, uncommitted: value columns ``v0 … v0 + VT`` of its state tile ([K, VT] fp32) and
    buffered values ([BC, VT] bf16), and its buffered keys [BC, K] bf16 and decays [BC, K] fp32
    (rows ≥ n zero-filled). A padding slot or an item past the end copies zeros. Shared by both KDA
    Gluon flushes (this UT fold, whole heads: ``v0`` = 0, VT = V; and ``flush_sweep.py``)."""
    i_h = item % H
    live = s >= 0
    head = gl.where(live, s, 0).to(gl.int64) * H + i_h
    o_k = gl.arange(0, K, gl.SliceLayout(1, LS))
    o_v = gl.arange(0, VT, gl.SliceLayout(0, LS))
    m_s = (o_k[:, None] < gl.where(live, K, 0)) & (o_v[None, :] < VT)
    _async_load(s_smem, state + head * (K * V) + v0 + (o_k[:, None] * V + o_v[None, :]), m_s)
    nb = gl.where(live, n, 0)
    o_c = gl.arange(0, BC, gl.SliceLayout(1, LB))
    o_kb = gl.arange(0, K, gl.SliceLayout(0, LB))
    o_vb = gl.arange(0, VT, gl.SliceLayout(0, LB))
    m_k = (o_c[:, None] < nb) & (o_kb[None, :] < K)
    _async_load(k_smem, buf_k + head * (C * K) + (o_c[:, None] * K + o_kb[None, :]), m_k)  # G = H
    m_w = (o_c[:, None] < nb) & (o_vb[None, :] < VT)
    _async_load(w_smem, buf_w + head * (C * V) + v0 + (o_c[:, None] * V + o_vb[None, :]), m_w)
    o_cf = gl.arange(0, BC, gl.SliceLayout(1, LF))
    o_kf = gl.arange(0, K, gl.SliceLayout(0, LF))
    m_a = (o_cf[:, None] < nb) & (o_kf[None, :] < K)
    _async_load(a_smem, buf_decay + head * (C * K) + (o_cf[:, None] * K + o_kf[None, :]), m_a)


@gluon.jit
def _issue(
    state,
    buf_k,
    buf_w,
    buf_decay,
    ranks,
    frame_terms,
    item,
    s,
    n,
    s_smem,
    k_smem,
    w_smem,
    a_smem,
    r_smem,
    H: gl.constexpr,
    K: gl.constexpr,
    V: gl.constexpr,
    C: gl.constexpr,
    BC: gl.constexpr,
    LS: gl.constexpr,
    LB: gl.constexpr,
    LF: gl.constexpr,
    SKETCH_OUT: gl.constexpr,
    RT: gl.constexpr,
):
    """Start the copies of work item ``item`` (slot ``s``, ``n`` buffered tokens) into shared
    memory: its state tile [K, V], buffered keys [BC, K], values [BC, V] and decays [BC, K] (rows
    ≥ n zero-filled; the decays' are set to 1 where they are read), and with ``SKETCH_OUT`` the
    first 16 rows of its frame as ``RT`` bf16 terms [RT·16, K] (none for a head of rank 0). A
    padding slot or an item past the end copies zeros."""
    i_h = item % H
    live = s >= 0
    _issue_window(
        state,
        buf_k,
        buf_w,
        buf_decay,
        item,
        s,
        n,
        s_smem,
        k_smem,
        w_smem,
        a_smem,
        0,
        H,
        K,
        V,
        C,
        BC,
        LS,
        LB,
        LF,
        V,
    )
    if SKETCH_OUT:
        sketched = live & (gl.load(ranks + i_h) > 0)
        o_kb = gl.arange(0, K, gl.SliceLayout(0, LB))
        o_r = gl.arange(0, RT * 16, gl.SliceLayout(1, LB))
        # chunk 0 of frame i_h in frame_terms [H, ⌈K/16⌉, 3, 16, K]: its first RT·16 rows
        p_r = frame_terms + i_h * (((K + 15) // 16) * 48 * K) + (o_r[:, None] * K + o_kb[None, :])
        m_r = (o_r[:, None] < gl.where(sketched, RT * 16, 0)) & (o_kb[None, :] < K)
        _async_load(r_smem, p_r, m_r)
    async_copy.commit_group()


@gluon.jit
def _small_inputs(
    k,
    q,
    w,
    decay,
    beta,
    skip,
    buf_beta,
    item,
    s,
    n,
    v0,
    H: gl.constexpr,
    K: gl.constexpr,
    V: gl.constexpr,
    C: gl.constexpr,
    BC: gl.constexpr,
    L1: gl.constexpr,
    LBT: gl.constexpr,
    HAS_X: gl.constexpr,
    HAS_SKIP: gl.constexpr,
    VT: gl.constexpr,
):
    """Head item ``item``'s small inputs, loaded one item ahead: the buffered betas [BC] (0 past
    n, in ``LBT``: every thread holds all of them) and with ``HAS_X`` the new token's key, query and
    decay [K], value columns ``v0 … v0 + VT`` of its value and skip [VT] (``L1``) and beta."""
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
    kk = gl.load(k + xk + o_k, mask=live & (o_k < K), other=0.0)
    qq = gl.load(q + xk + o_k, mask=live & (o_k < K), other=0.0)
    dd = gl.load(decay + xk + o_k, mask=live & (o_k < K), other=1.0)
    ww = gl.load(w + xw + o_v, mask=live & (o_v < VT), other=0.0)
    sw = gl.load(skip + xw + o_v, mask=live & HAS_SKIP & (o_v < VT), other=0.0)
    bx = gl.load(beta + i_b * H + i_h, mask=live, other=0.0)
    return bt, kk, qq, dd, ww, sw, bx


@gluon.jit
def _decay_terms(
    a_smem, k_smem, kg_smem, kr_smem, tot_smem, n, K: gl.constexpr, BC: gl.constexpr, LD: gl.constexpr
):
    """From the buffered decays and keys (shared memory), the terms of both tensor-core products:
    ``K ⊙ Γ`` and ``K ⊙ ρ`` [BC, K] as three bf16 terms each (``kg_smem``, ``kr_smem`` [3, BC, K]),
    and the window's decay ``γ_{n−1}`` [K] (``tot_smem``). One key channel per thread, its tokens
    in registers (``LD``), so the scans over tokens stay in the thread."""
    o_c = gl.arange(0, BC, gl.SliceLayout(1, LD))
    al = gl.where(o_c[:, None] < n, a_smem.load(LD), 1.0)
    kf = k_smem.load(LD).to(gl.float32)
    gam = gl.associative_scan(al, 0, _mul)
    idx = gl.zeros_like(al).to(gl.int32) + o_c[:, None]
    # reverse scan: at token i, (α_i⋯α_{n−1}, α_{i+1}⋯α_{n−1}, i)
    suf, rho, _ = gl.associative_scan((al, gl.full_like(al, 1.0), idx), 0, _suffix, reverse=True)
    tot_smem.store(gl.sum(gl.where(o_c[:, None] == 0, suf, 0.0), axis=0))
    t1, t2, t3 = _split3(kf * gam)
    kg_smem.index(0).store(t1)
    kg_smem.index(1).store(t2)
    kg_smem.index(2).store(t3)
    t1, t2, t3 = _split3(kf * rho)
    kr_smem.index(0).store(t1)
    kr_smem.index(1).store(t2)
    kr_smem.index(2).store(t3)


@gluon.jit
def _decayed_gram(a_smem, k_smem, b_smem, lt_smem, n, K: gl.constexpr, BC: gl.constexpr, LG: gl.constexpr):
    """``Lᵀ`` into ``lt_smem`` [BC, BC], ``L_{ji} = β_j H_{ji}`` (j > i, else 0; ``b_smem`` [1, BC]
    holds β): row i of ``dec`` [BC, K] holds ``k_i ⊙ α_{i+1}⋯α_j`` after token j's decay (a running
    product: nothing overflows), so ``H_{j·} = dec k_j``, column j of ``Lᵀ``. Rows of ``LG`` over
    threads, channels over the rest."""
    o_i = gl.arange(0, BC, gl.SliceLayout(1, LG))
    dec = gl.zeros([BC, K], gl.float32, LG)
    for j in gl.static_range(BC):
        a_j = a_smem.slice(j, 1).load(LG)  # [1, K]
        k_j = k_smem.slice(j, 1).load(LG).to(gl.float32)
        dec = dec * gl.where(j < n, a_j, 1.0)
        b_j = b_smem.slice(j, 1, dim=1).load(LG)  # [1, 1]
        lt_smem.slice(j, 1, dim=1).store(gl.sum(dec * k_j, axis=1)[:, None] * b_j)
        dec = gl.where(o_i[:, None] == j, k_j, dec)


@gluon.jit
def _b_term(terms, t: gl.constexpr, B_OP: gl.constexpr, TRANS: gl.constexpr):
    """Term ``t`` of ``terms`` [3, R, C] (shared memory) as a B operand: [R, C], or [C, R] with
    ``TRANS``."""
    if TRANS:  # noqa: SIM108  (a constexpr branch: the other side is never compiled)
        b = terms.index(t).permute([1, 0]).load(B_OP)
    else:
        b = terms.index(t).load(B_OP)
    return b


@gluon.jit
def _dot3(a, terms, acc, A_OP: gl.constexpr, B_OP: gl.constexpr, TRANS: gl.constexpr):
    """``acc + a @ b`` for an fp32 ``a`` (split here into three bf16 terms) and ``b`` given as its
    three bf16 terms in shared memory (:func:`_b_term`): the six products down to 2⁻¹⁶ of the
    largest, one term of ``a`` live at a time; the three small products go to a second accumulator,
    so that two chains of dependent MMAs run side by side."""
    a1 = a.to(gl.bfloat16)
    rest = a - a1.to(gl.float32)
    a2 = rest.to(gl.bfloat16)
    b1 = _b_term(terms, 0, B_OP, TRANS)
    x = gl.convert_layout((rest - a2.to(gl.float32)).to(gl.bfloat16), A_OP)
    lo = mma_v2(x, b1, gl.zeros_like(acc))
    x = gl.convert_layout(a2, A_OP)
    b2 = _b_term(terms, 1, B_OP, TRANS)
    lo = mma_v2(x, b2, lo)
    acc = mma_v2(x, b1, acc)
    x = gl.convert_layout(a1, A_OP)
    lo = mma_v2(x, _b_term(terms, 2, B_OP, TRANS), lo)
    acc = mma_v2(x, b2, acc)
    return mma_v2(x, b1, acc) + lo


@gluon.jit
def _flush_kda_kernel(
    state,
    slots,
    pos,
    q,
    k,
    w,
    decay,
    beta,
    skip,
    out,
    buf_k,
    buf_w,
    buf_decay,
    buf_beta,
    rd,
    read_rows,
    sk,
    ranks,
    frames,
    sk_head_stride,
    frame_terms,
    n_items,
    H: gl.constexpr,
    K: gl.constexpr,
    V: gl.constexpr,
    C: gl.constexpr,
    BC: gl.constexpr,
    HAS_X: gl.constexpr,
    HAS_SKIP: gl.constexpr,
    HAS_READ: gl.constexpr,
    ROWS: gl.constexpr,
    SKETCH_OUT: gl.constexpr,
    SKETCH_TERMS: gl.constexpr,
):
    """The flush over ``n_items`` work items (see the module docstring); the arguments are the
    chunked flush's (``frames``: unused, the sketch reads ``SketchTables.frame_terms``), then
    ``frame_terms``. BC is 16."""
    WARPS: gl.constexpr = gl.num_warps()
    TR: gl.constexpr = 16 // WARPS  # lanes along the 16 rows of a [16, *] tile
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8]
    )
    A_OP: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    B_OP: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    # copies: 16 B per thread along the contiguous axis
    LS: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [WARPS, 1], [1, 0])  # [K, V] fp32
    LB: gl.constexpr = gl.BlockedLayout([1, 8], [TR, 32 // TR], [WARPS, 1], [1, 0])  # [16, *] bf16
    LF: gl.constexpr = gl.BlockedLayout([1, 4], [TR, 32 // TR], [WARPS, 1], [1, 0])  # [16, K] fp32
    # math: one key channel per thread with all its tokens (decays); token rows over threads (Gram);
    # one value row per thread with all its tokens (forward substitution)
    DR: gl.constexpr = max(1, 32 * WARPS // K)  # lanes along a channel's tokens: the tile covered once
    LD: gl.constexpr = gl.BlockedLayout([BC // DR, 1], [DR, 32 // DR], [1, WARPS], [0, 1])
    LG: gl.constexpr = gl.BlockedLayout([1, K // (32 // TR)], [TR, 32 // TR], [WARPS, 1], [1, 0])
    LR: gl.constexpr = gl.BlockedLayout([1, BC], [32, 1], [WARPS, 1], [1, 0])
    L1: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    LR16: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [WARPS, 1], [1, 0])  # [16, K] rows of R
    LBT: gl.constexpr = gl.SliceLayout(0, LR)
    SS: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, order=[1, 0])
    SB: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0])
    SP: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    SP1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    RT: gl.constexpr = 3 if SKETCH_TERMS == 3 else 2
    s_smem = gl.allocate_shared_memory(gl.float32, [K, V], SS)
    k_ring = gl.allocate_shared_memory(gl.bfloat16, [2, BC, K], SP)  # read by rows: unswizzled
    w_ring = gl.allocate_shared_memory(gl.bfloat16, [2, BC, V], SB)
    a_ring = gl.allocate_shared_memory(gl.float32, [2, BC, K], SP)
    kg_smem = gl.allocate_shared_memory(gl.bfloat16, [3, BC, K], SB)
    kr_smem = gl.allocate_shared_memory(gl.bfloat16, [3, BC, K], SB)
    lt_smem = gl.allocate_shared_memory(gl.float32, [BC, BC], SP)  # Lᵀ
    b_smem = gl.allocate_shared_memory(gl.float32, [1, BC], SP)  # the item's β
    tot_smem = gl.allocate_shared_memory(gl.float32, [K], SP1)
    if SKETCH_OUT:  # the first 16 rows of R in RT bf16 terms: this item's and the next's
        r_ring = gl.allocate_shared_memory(gl.bfloat16, [2, RT * 16, K], SB)
        r_next = r_ring.index(0)
    else:
        r_next = kg_smem.index(0)  # (not written: nothing to copy)

    pid = gl.program_id(0)
    progs = gl.num_programs(0)
    o_vm = gl.arange(0, V, gl.SliceLayout(1, MMA))
    o_t = gl.arange(0, BC, LBT)
    s_c, n_c = _entry(slots, pos, pid, n_items, H)
    _issue(
        state,
        buf_k,
        buf_w,
        buf_decay,
        ranks,
        frame_terms,
        pid,
        s_c,
        n_c,
        s_smem,
        k_ring.index(0),
        w_ring.index(0),
        a_ring.index(0),
        r_next,
        H,
        K,
        V,
        C,
        BC,
        LS,
        LB,
        LF,
        SKETCH_OUT,
        RT,
    )
    bt, kk, qq, dd, ww, sw, bx = _small_inputs(
        k, q, w, decay, beta, skip, buf_beta, pid, s_c, n_c, 0, H, K, V, C, BC, L1, LBT, HAS_X, HAS_SKIP, V
    )
    s_n, n_n = _entry(slots, pos, pid + progs, n_items, H)
    cur = 0  # this item's slot of the rings
    for item in range(pid, n_items, progs):
        i_b = item // H
        i_h = item % H
        m_c, r_c = _head_flags(ranks, read_rows, item, H, SKETCH_OUT, ROWS)  # for the stores
        b_smem.store(bt[None, :])  # (every thread is past the previous item's reads of it)
        async_copy.wait_group(0)
        _barrier()
        St = s_smem.permute([1, 0]).load(MMA)  # Sᵀ [V, K]
        _barrier()
        nxt = item + progs
        if SKETCH_OUT:
            r_next = r_ring.index(1 - cur)
        _issue(
            state,
            buf_k,
            buf_w,
            buf_decay,
            ranks,
            frame_terms,
            nxt,
            s_n,
            n_n,
            s_smem,
            k_ring.index(1 - cur),
            w_ring.index(1 - cur),
            a_ring.index(1 - cur),
            r_next,
            H,
            K,
            V,
            C,
            BC,
            LS,
            LB,
            LF,
            SKETCH_OUT,
            RT,
        )
        nxt = gl.where(nxt < n_items, nxt, 0)
        bt_n, kk_n, qq_n, dd_n, ww_n, sw_n, bx_n = _small_inputs(
            k,
            q,
            w,
            decay,
            beta,
            skip,
            buf_beta,
            nxt,
            s_n,
            n_n,
            0,
            H,
            K,
            V,
            C,
            BC,
            L1,
            LBT,
            HAS_X,
            HAS_SKIP,
            V,
        )
        s_nn, n_nn = _entry(slots, pos, item + 2 * progs, n_items, H)
        if s_c >= 0:
            s64 = s_c.to(gl.int64)
            head = s64 * H + i_h
            a_cur = a_ring.index(cur)
            k_cur = k_ring.index(cur)
            _decay_terms(a_cur, k_cur, kg_smem, kr_smem, tot_smem, n_c, K, BC, LD)
            _decayed_gram(a_cur, k_cur, b_smem, lt_smem, n_c, K, BC, LG)
            _barrier()
            # X = (K ⊙ Γ) S, as Xᵀ = Sᵀ (K ⊙ Γ)ᵀ [V, BC]
            xt = _dot3(St, kg_smem, gl.zeros([V, BC], gl.float32, MMA), A_OP, B_OP, True)
            # Dᵀ by forward substitution, one value row per thread: column j of Zᵀ = Wᵀ − Xᵀ β
            # minus Σ_{i<j} L_{ji} times the columns i already solved
            wt = w_ring.index(cur).permute([1, 0]).load(LR).to(gl.float32)
            zt = wt - gl.convert_layout(xt, LR) * bt[None, :]
            for j in gl.static_range(BC):
                lrow = lt_smem.permute([1, 0]).slice(j, 1).load(LR)  # row j of L, [1, BC]
                corr = gl.sum(zt * lrow, axis=1)
                zt = gl.where(o_t[None, :] == j, zt - corr[:, None], zt)
            # S ← γ_{n−1} ⊙ S + (K ⊙ ρ)ᵀ D, as Sᵀ ← Sᵀ γ_{n−1} + Dᵀ (K ⊙ ρ)
            St = St * tot_smem.load(gl.SliceLayout(0, MMA))[None, :]
            St = _dot3(zt, kr_smem, St, A_OP, B_OP, False)
            if HAS_X:
                xw = (i_b * H + i_h) * V
                kx = gl.convert_layout(kk, gl.SliceLayout(0, MMA)).to(gl.float32)
                St = St * gl.convert_layout(dd, gl.SliceLayout(0, MMA)).to(gl.float32)[None, :]
                ks = gl.sum(St * kx[None, :], axis=1)
                vx = gl.convert_layout(ww, gl.SliceLayout(1, MMA)).to(gl.float32)
                St = St + (vx - bx.to(gl.float32) * ks)[:, None] * kx[None, :]
                o = gl.sum(St * gl.convert_layout(qq, gl.SliceLayout(0, MMA)).to(gl.float32)[None, :], axis=1)
                if HAS_SKIP:
                    o += gl.convert_layout(sw, gl.SliceLayout(1, MMA)).to(gl.float32)
                gl.store(out + xw + o_vm, o.to(out.dtype.element_ty))
            if SKETCH_OUT:  # noqa: SIM108  (a constexpr branch: r_ring exists only then)
                r_cur = r_ring.index(cur)
            else:
                r_cur = kg_smem.index(0)  # (not read)
            _store_folded(
                St,
                state,
                rd,
                r_c,
                sk + head * sk_head_stride,
                m_c,
                frame_terms,
                r_cur,
                head * (K * V),
                i_h,
                K,
                V,
                HAS_READ,
                ROWS,
                SKETCH_OUT,
                SKETCH_TERMS,
                MMA,
                A_OP,
                B_OP,
                LS,
                LR16,
            )
        s_c, n_c, s_n, n_n = s_n, n_n, s_nn, n_nn
        bt, kk, qq, dd, ww, sw, bx = bt_n, kk_n, qq_n, dd_n, ww_n, sw_n, bx_n
        cur = 1 - cur
    async_copy.wait_group(0)


def usable(
    heads: int, groups: int, key_dim: int, value_dim: int, capacity: int, num_warps: int, block_v: int = 0
) -> bool:
    """Whether this kernel takes a KDA pool of these dims (else the flush takes another kernel):
    one head per group, a buffer of at most 16 tokens (one chunk), 4 or 8 warps, and tiles its
    layouts cover (K ≥ 32; V ≥ 16 rows per warp). ``block_v`` is ignored: a work item is a whole
    head."""
    return (
        groups == heads
        and 0 < capacity <= 16
        and num_warps in (4, 8)
        and key_dim >= 32
        and value_dim >= 16 * num_warps
    )


def launch(args: tuple, frame_terms: torch.Tensor, **options) -> None:
    """Launch this module's kernel (``flush_pipelined.launch_persistent``'s options; constexprs H, K,
    V, C, HAS_X, HAS_SKIP, HAS_READ, ROWS, SKETCH_OUT, SKETCH_TERMS; BC is 16)."""
    launch_persistent(_flush_kda_kernel, args, frame_terms, BC=16, **options)
