"""The one-kernel read of the window modes, shared by the three families: replay and sketch steps
and ``spec_verify``.

Per program (grid ``(V / BV, H, B)``: one slot, one head, BV value columns) and for each of the T
new tokens, the ReplaySSM product form ``o = S_cᵀ u + Σ_j c_j w_j`` with ``u = M_pᵀ q``: one
backward sweep over the new tokens, then over the ``pos`` buffered ones (:func:`backward`: the
query pushed back through each token's transition; the coefficient of its w is ``k_j · u``), and
exactly one checkpoint read of ``u``: the read copy ``S_cᵀ u`` [K, BV], or for a head of rank
m > 0 the sketch ``(R_{:m} S_c)ᵀ (P u)`` (``checkpoint_read``). The new tokens are appended to
the buffer (layouts in ``common/pool.py``); nothing else is written.

Launch shape (``KernelConfig``): ``group`` sweeps the live buffered tokens ``group`` per rolled
iteration (0: all C unrolled, dead ones as identities); ``dense_rows`` reads a dense head's read
copy that many rows at a time; ``early_map`` loads a sketch head's first 8 map rows before the
sweep; ``prefetch`` asks L2 for the buffered tokens first.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from sketchcal.kernels.common.pool import (
    AdaptiveSketch,
    DecodePool,
    SketchTables,
    is_dense,
    slot_strides,
    value_major,
)
from sketchcal.kernels.common.recurrence import StepInputs
from sketchcal.kernels.common.triton_helpers import (
    FAMILY_ID,
    backward,
    beta_or_placeholder,
    checkpoint_read,
    clip_block_v,
    dependent_launch,
    entry_slot,
    first_map_rows,
    launch_options,
    load_token,
    prefetch_buffer,
    prefetch_enabled,
    sweep_buffered,
)


@triton.jit
def _read_kernel(
    slots, pos, q, k, w, decay, beta, skip, out, buf_k, buf_w, buf_decay, buf_beta, buf_logdecay, rd, sk,
    ranks, maps, sk_head_stride, ss_bk, ss_bw, ss_bd, ss_bb, ss_bl, ss_rd, ss_sk, ss_map,
    T: tl.constexpr, H: tl.constexpr, G: tl.constexpr, K: tl.constexpr,
    V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, M: tl.constexpr, FAMILY: tl.constexpr,
    SKETCH: tl.constexpr, HAS_SKIP: tl.constexpr, GROUP: tl.constexpr, DENSE_ROWS: tl.constexpr,
    EARLY_MAP: tl.constexpr, PREFETCH: tl.constexpr, LOG2_DECAY: tl.constexpr, PAGED: tl.constexpr,
    RD_VM: tl.constexpr, SLOT_MAPS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The reads (replay, sketch, spec_verify). ``LOG2_DECAY`` (KDA): the buffered decays are read
    as log₂ in bf16 from ``buf_logdecay`` (half the bytes; the flush keeps the fp32 ones), which
    each appended token also gets. ``PAGED``: the pool is not dense (``pool.is_dense``), each tensor's
    slot part is at its slot stride ``ss_*`` (buf_k, buf_w, buf_decay, buf_beta, buf_logdecay, rd,
    sk, and with ``SLOT_MAPS`` maps); ``RD_VM``: the read copy is value-major. ``SLOT_MAPS`` (the
    adaptive sketch): ``maps`` and ``sk`` hold each slot's own map and sketch rows ([N, H, M, K],
    [N, H, M, V])."""
    dependent_launch(PDL)
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    i_g = i_h // (H // G)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_r8 = tl.arange(0, 8)
    # no early exit for padding (an exit waits for the slot, and the compiler sinks every load
    # below it): a padding entry reads slot 0 with an empty buffer and stores nothing. So the loads
    # that do not need the slot are in flight with it, unmasked by it: pos, rank, the first new
    # token's inputs and query, the first 8 map rows (rows past the head's rank meet sketch rows
    # masked to zero).
    live, s, p = entry_slot(slots, pos, i_b)
    if PAGED:  # each tensor's slot part where its slot stride puts it; heads counted within it
        buf_k, buf_w, buf_decay = buf_k + s * ss_bk, buf_w + s * ss_bw, buf_decay + s * ss_bd
        buf_beta, buf_logdecay = buf_beta + s * ss_bb, buf_logdecay + s * ss_bl
        rd, sk = rd + s * ss_rd, sk + s * ss_sk
        if SLOT_MAPS:
            maps += s * ss_map
        sh, sg = i_h, i_g
    else:  # dense [N, ...] arrays: the head's and group's index over all slots
        sh, sg = s * H + i_h, s * G + i_g
    m = tl.load(ranks + i_h) if SKETCH else 0
    mh = sh if SLOT_MAPS else i_h  # the map's head: one per slot and head, or one per head
    x0 = i_b * T
    k0, w0, d0, b0 = load_token(
        k, w, decay, beta, (x0 * G + i_g) * K, (x0 * H + i_h) * V, x0 * H + i_h, o_k, o_v, i_b >= 0, K, V,
        FAMILY,
    )  # fmt: skip
    q0 = tl.load(q + (x0 * G + i_g) * K + o_k).to(tl.float32)
    if SKETCH and EARLY_MAP:  # noqa: SIM108  (a constexpr branch)
        pm0 = first_map_rows(maps, mh, o_k, K, M)
    else:
        pm0 = tl.zeros([8, K], dtype=tl.float32)
    sk_h = sk + sh * sk_head_stride
    if SKETCH:
        # the first 8 sketch rows, in flight while the buffer is worked through
        st0 = tl.load(sk_h + o_r8[:, None] * V + o_v[None, :], mask=o_r8[:, None] < m, other=0.0)
    else:
        st0 = tl.zeros([8, BV], dtype=tl.float32)
    hb = sh * C  # this head's first buffer entry
    gb = sg * C  # this group's first buffer entry
    read_decays = buf_logdecay if LOG2_DECAY else buf_decay  # the buffered decays as the sweep reads them
    if PREFETCH:
        prefetch_buffer(buf_k, buf_w, read_decays, buf_beta, hb, gb, p, i_v * BV, K, V, BV, C, FAMILY)
    # append the T new tokens at p, p+1, ...: each program writes its w tile; the first tile writes
    # decay and beta, and the first head of the group its k. Reads below touch entries < p only.
    for t in tl.static_range(T):
        jw = p + t
        ok = (jw < C) & live
        x_t = i_b * T + t
        if t == 0:
            k_new, w_new, d_new, b_new = k0, w0, d0, b0
        else:
            k_new, w_new, d_new, b_new = load_token(
                k, w, decay, beta, (x_t * G + i_g) * K, (x_t * H + i_h) * V, x_t * H + i_h, o_k, o_v, live, K,
                V, FAMILY,
            )  # fmt: skip
        mw = o_v < tl.where(ok, V, 0)
        tl.store(buf_w + (hb + jw) * V + o_v, w_new.to(buf_w.dtype.element_ty), mask=mw)
        if i_v == 0:
            if FAMILY == 2:
                mk = o_k < tl.where(ok, K, 0)
                tl.store(buf_decay + (hb + jw) * K + o_k, d_new.to(buf_decay.dtype.element_ty), mask=mk)
                if LOG2_DECAY:
                    lg = tl.log2(d_new).to(buf_logdecay.dtype.element_ty)
                    tl.store(buf_logdecay + (hb + jw) * K + o_k, lg, mask=mk)
            else:
                tl.store(buf_decay + hb + jw, d_new.to(buf_decay.dtype.element_ty), mask=ok)
            if FAMILY != 0:
                tl.store(buf_beta + hb + jw, b_new.to(buf_beta.dtype.element_ty), mask=ok)
            if i_h % (H // G) == 0:
                mk = o_k < tl.where(ok, K, 0)
                tl.store(buf_k + (gb + jw) * K + o_k, k_new.to(buf_k.dtype.element_ty), mask=mk)
    rd_h = rd + sh * (K * V)
    # entry 0 of this group's / head's buffer (the sweeps add 32-bit token offsets)
    DS: tl.constexpr = K if FAMILY == 2 else 1  # decay entries per token
    k_g = buf_k + gb * K
    w_h = buf_w + hb * V
    decay_h = read_decays + hb * DS
    beta_h = buf_beta + hb
    for t in tl.static_range(T):
        x_t = i_b * T + t
        if t == 0:  # noqa: SIM108  (a constexpr branch: the other side is never compiled)
            v = q0
        else:
            v = tl.load(q + (x_t * G + i_g) * K + o_k).to(tl.float32)
        acc = tl.zeros([BV], dtype=tl.float32)
        c = tl.full([], 1.0, tl.float32)  # the query is c v (backward)
        # the new tokens t..0, one by one
        for i in tl.static_range(T):
            d = T - 1 - i
            if d <= t:
                x_d = i_b * T + d
                if d == 0:
                    kk, ww, dd, bb = k0, w0, d0, b0
                else:
                    kk, ww, dd, bb = load_token(
                        k, w, decay, beta, (x_d * G + i_g) * K, (x_d * H + i_h) * V, x_d * H + i_h, o_k, o_v,
                        live, K, V, FAMILY,
                    )  # fmt: skip
                kv, v, c = backward(v, c, kk, dd, bb, FAMILY)
                acc += kv * ww
        if GROUP == 0:
            # the buffered tokens C-1..0 unrolled, dead ones (≥ p) as identities: every load issues
            # up front (the faster form at ~160 registers; at 64-80 the groups below win)
            for i in tl.static_range(C):
                j = C - 1 - i
                v, c, acc = sweep_buffered(
                    v, c, acc, k_g, w_h, decay_h, beta_h, j, j < p, o_k, o_v, K, V, FAMILY, LOG2_DECAY,
                )  # fmt: skip
        else:
            # the live tokens p-1..0, GROUP per iteration (the group's loads issue together). The
            # pointers step back GROUP tokens per iteration, so a group's tokens sit at constant
            # offsets from them. The last group runs past token 0 with identities (masked loads:
            # their addresses are never dereferenced).
            k_j, w_j = k_g + (p - 1) * K, w_h + (p - 1) * V
            decay_j, beta_j = decay_h + (p - 1) * DS, beta_h + (p - 1)
            for j0 in range(0, p, GROUP):
                for i in tl.static_range(GROUP):
                    v, c, acc = sweep_buffered(
                        v, c, acc, k_j, w_j, decay_j, beta_j, -i, i < p - j0, o_k, o_v, K, V, FAMILY,
                        LOG2_DECAY,
                    )  # fmt: skip
                k_j, w_j = k_j - GROUP * K, w_j - GROUP * V
                decay_j, beta_j = decay_j - GROUP * DS, beta_j - GROUP
        o = acc + checkpoint_read(
            v * c,
            rd_h,
            sk_h,
            m,
            pm0,
            st0,
            maps,
            mh,
            o_k,
            o_v,
            K,
            V,
            M,
            SKETCH,
            DENSE_ROWS,
            EARLY_MAP,
            RD_VM,
        )
        if HAS_SKIP:
            o += tl.load(skip + (x_t * H + i_h) * V + o_v).to(tl.float32)
        tl.store(out + (x_t * H + i_h) * V + o_v, o.to(out.dtype.element_ty), mask=o_v < tl.where(live, V, 0))


def read_options(cfg, key_dim: int) -> dict:
    """The read kernel's constexprs that come from its launch shape."""
    return dict(
        GROUP=cfg.group,
        DENSE_ROWS=min(cfg.dense_rows, key_dim),
        EARLY_MAP=cfg.early_map,
        PREFETCH=prefetch_enabled(cfg.prefetch),
    )


def launch(
    family: str, pool: DecodePool, tables: SketchTables | None, slots: Tensor, pos: Tensor, x: StepInputs,
    out: Tensor, cfg, adaptive: AdaptiveSketch | None = None,
) -> None:  # fmt: skip
    """:func:`_read_kernel` over (V / BV, H, B) for a checked window pool and inputs: reads the
    read copy (``tables`` None: replay), the sketch, or with ``adaptive`` (``tables`` is its
    tables) each slot's adaptive factors; writes ``out`` [B, T, H, V]."""
    b, t, g, kd = x.k.shape
    h, vd = pool.heads, x.w.shape[-1]
    bv = clip_block_v(cfg.block_v, vd)
    sketch = tables is not None
    sk = pool.sketch if sketch else pool.read
    maps = tables.maps if sketch else pool.buf_decay
    if adaptive is not None:
        sk, maps = adaptive.rows, adaptive.maps
    paged = not is_dense(pool)  # only a paged pool may read a value-major (fp32) read copy
    _read_kernel[(vd // bv, h, b)](
        slots, pos, x.q, x.k, x.w, x.decay, beta_or_placeholder(x), x.skip if x.skip is not None else x.w,
        out, pool.buf_k, pool.buf_w, pool.buf_decay,
        pool.buf_beta if pool.buf_beta is not None else pool.buf_decay,
        pool.buf_logdecay if pool.buf_logdecay is not None else pool.buf_decay, pool.read, sk,
        tables.ranks if sketch else slots, maps,
        sk.shape[2] * sk.shape[3],
        *slot_strides(
            pool, "buf_k", "buf_w", "buf_decay", "buf_beta", "buf_logdecay", fallback=pool.buf_decay
        ),
        pool.read.stride(0), sk.stride(0), maps.stride(0), T=t, H=h, G=g, K=kd, V=vd, BV=bv, C=pool.capacity,
        M=tables.map_rows if sketch else 1, FAMILY=FAMILY_ID[family], SKETCH=sketch,
        HAS_SKIP=x.skip is not None, LOG2_DECAY=pool.buf_logdecay is not None,
        PAGED=paged, RD_VM=paged and value_major(pool.read), SLOT_MAPS=adaptive is not None,
        **read_options(cfg, kd),
        **launch_options(cfg.num_warps, cfg.maxnreg, pool.state.device),
    )  # fmt: skip
