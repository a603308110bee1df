"""Mamba-2's sketch step as two kernels: what a key group shares, then what each head adds.

A Mamba-2 read (one new token, ``n`` buffered ones, scalar decays) is

    o = (k_n·q) w_n + α_n [ Σ_{j<n} g_j (k_j·q) w_j + (α_0⋯α_{n−1}) (R_{:m} S_c)ᵀ (P q) ] (+ D x)

with ``g_j = α_{j+1}⋯α_{n−1}``. Everything that is a reduction over K (the dots ``k_j·q`` and the
coefficients ``P q``) depends only on the group's keys and query, and the head's map; what is
left per head is a weighted sum of [V] rows. The one-kernel read (``decode._read_kernel``)
computes the dots again in each of the group's H/G heads, each ending in a shuffle reduction.
Here:

1. :func:`_group_kernel`, two kinds of program in one launch:
   - one per (batch entry, group): appends the new key to the buffer and computes ``k_j·q`` for
     the buffered keys and the new one;
   - one per (16 batch entries, 32 map rows, group): ``P q`` for those entries on tensor cores,
     from the group's maps packed one after the other (``SketchTables.group_maps`` [G, R, K]), so
     each map tile is loaded once for 16 entries rather than once per entry and head.
   Both write to the pool's ``workspace`` [N, G, (H/G)·M + C + 1]: each head's M coefficients,
   then the dots (entry n: the new token's).
2. :func:`_head_kernel`, one program per (batch entry, ``heads`` heads of a group, BV columns):
   appends w and the decays, and sums the buffered rows of w and the sketch rows with those
   coefficients. A dense head (rank 0) reads its read copy with ``q`` as the one-kernel read does.

Both are programmatic dependent launches; the second waits for the first's writes
(``_dependent_launch``), so a step is still two launches in one stream, with no host sync, and
can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sketchcal.kernels.common.decode import (
    KernelConfig,
    _buffer_block,
    _decay_products,
    _dense_read,
    _dependent_launch,
    _dot_ff,
    _dot_fk,
    _interpreting,
    _launch_options,
)
from sketchcal.kernels.common.pool import DecodePool, SketchTables
from sketchcal.kernels.common.recurrence import StepInputs

COLUMNS = 32  # coefficient columns per program of the group kernel: a [32, K] tile of the maps
ROWS = 16  # batch entries per coefficient program (the tensor-core tile's N)


@triton.jit
def _group_kernel(
    slots, pos, q, k, buf_k, ws, group_maps, group_cols, group_width, B,
    G: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, R: tl.constexpr,
    RB: tl.constexpr, BB: tl.constexpr, WS: tl.constexpr, DOTS: tl.constexpr, Q_BF16: tl.constexpr,
    EMULATE: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (G, B + ⌈B/BB⌉·⌈R/RB⌉), two kinds of program. ``ws`` row (slot, group):
    ``[coefficients (H/G)·M | dots C + 1]``, the dots starting at ``DOTS``.

    - the first B, one per batch entry: append the new key; the dots ``k_j·q`` (j < n) and the new
      key's (entry n);
    - the others, one per (BB batch entries, RB map columns): the coefficients ``P q`` of those
      entries on tensor cores, ``[RB, K] @ [K, BB]``, the fp32 maps in three bf16 terms (exact
      products with bf16 queries; fp32 queries are split too), so every batch entry shares each
      map tile's load."""
    _dependent_launch(PDL)
    i_g = tl.program_id(0)
    i = tl.program_id(1)
    o_k = tl.arange(0, K)
    if i < B:
        s_in = tl.load(slots + i)
        live = s_in >= 0
        s = tl.maximum(s_in, 0).to(tl.int64)
        p = tl.where(live, tl.load(pos + i), 0)
        o_c = tl.arange(0, BC)
        qq = tl.load(q + (i * G + i_g) * K + o_k).to(tl.float32)
        k_new = tl.load(k + (i * G + i_g) * K + o_k)
        gb = (s * G + i_g) * C
        kb = tl.load(buf_k + (gb + o_c[:, None]) * K + o_k[None, :], mask=o_c[:, None] < p, other=0.0)
        tl.store(buf_k + (gb + p) * K + o_k, k_new.to(buf_k.dtype.element_ty),
                 mask=o_k < tl.where(live & (p < C), K, 0))
        row = ws + (s * G + i_g) * WS
        tl.store(row + DOTS + o_c, tl.sum(kb.to(tl.float32) * qq[None, :], axis=1), mask=o_c < p)
        tl.store(row + DOTS + p, tl.sum(k_new.to(tl.float32) * qq, axis=0), mask=(p <= C) & live)
    else:
        NR: tl.constexpr = (R + RB - 1) // RB
        i_rb = (i - B) % NR
        if i_rb * RB < tl.load(group_width + i_g):
            o_b = ((i - B) // NR) * BB + tl.arange(0, BB)
            s_in = tl.load(slots + o_b, mask=o_b < B, other=-1)
            s = tl.maximum(s_in, 0).to(tl.int64)
            cols = i_rb * RB + tl.arange(0, RB)
            pm = tl.load(group_maps + (i_g * R + cols[:, None]) * K + o_k[None, :], mask=cols[:, None] < R,
                         other=0.0)
            qt = tl.load(q + (o_b[None, :] * G + i_g) * K + o_k[:, None], mask=o_b[None, :] < B, other=0.0)
            coef = tl.zeros((RB, BB), dtype=tl.float32)
            if Q_BF16:
                coef = _dot_fk(pm, qt, coef, True, EMULATE)
            else:
                coef = _dot_ff(pm, qt.to(tl.float32), coef, 3, EMULATE)
            dst = tl.load(group_cols + i_g * R + cols, mask=cols < R, other=-1)
            tl.store(ws + (s[None, :] * G + i_g) * WS + dst[:, None], coef,
                     mask=(dst[:, None] >= 0) & (s_in >= 0)[None, :])


@triton.jit
def _head_kernel(
    slots, pos, q, w, decay, skip, out, buf_w, buf_decay, rd, sk, ranks, ws, sk_head_stride,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    HP: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, M: tl.constexpr, WS: tl.constexpr,
    DOTS: tl.constexpr, HAS_SKIP: tl.constexpr, DENSE_ROWS: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (V // BV, H // HP, B): ``HP`` heads of one key group per program, as the leading
    dimension of every tile ([HP, BC, BV] buffered w, [HP, 8, BV] sketch rows), so that their
    loads issue together and a reduction over rows stays inside a warp's tile."""
    _dependent_launch(PDL)
    i_v = tl.program_id(0)
    i_b = tl.program_id(2)
    o_hp = tl.program_id(1) * HP + tl.arange(0, HP)  # this program's heads
    i_g = (tl.program_id(1) * HP) // (H // G)
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, BC)
    o_r8 = tl.arange(0, 8)
    # no early exit for padding (as in the one-kernel read): it reads slot 0, stores nothing
    s_in = tl.load(slots + i_b)
    live = s_in >= 0
    s = tl.maximum(s_in, 0).to(tl.int64)
    p = tl.where(live, tl.load(pos + i_b), 0)
    m = tl.load(ranks + o_hp)  # [HP]
    x = i_b * H + o_hp
    w_new = tl.load(w + x[:, None] * V + o_v[None, :]).to(tl.float32)
    d_new = tl.load(decay + x).to(tl.float32)
    sk_h = sk + (s * H + o_hp) * sk_head_stride
    rows8 = o_r8[None, :] < m[:, None]  # [HP, 8]
    st0 = tl.load(sk_h[:, None, None] + o_r8[None, :, None] * V + o_v[None, None, :], mask=rows8[:, :, None],
                  other=0.0)
    hb = (s * H + o_hp) * C
    wb = tl.load(buf_w + (hb[:, None, None] + o_c[None, :, None]) * V + o_v[None, None, :],
                 mask=(o_c < p)[None, :, None], other=0.0)
    al = tl.load(buf_decay + hb[:, None] + o_c[None, :], mask=(o_c < p)[None, :], other=1.0)
    al_next = tl.load(buf_decay + hb[:, None] + o_c[None, :] + 1, mask=(o_c + 1 < p)[None, :], other=1.0)
    row = ws + (s * G + i_g) * WS
    z = tl.load(row + DOTS + o_c, mask=o_c < p, other=0.0)
    z_new = tl.load(row + DOTS + p)
    c_h = row + (o_hp % (H // G)) * M  # [HP] each head's coefficients
    coef = tl.load(c_h[:, None] + o_r8[None, :], mask=rows8, other=0.0)
    ok = live & (p < C)
    tl.store(buf_w + (hb + p)[:, None] * V + o_v[None, :], w_new.to(buf_w.dtype.element_ty),
             mask=o_v[None, :] < tl.where(ok, V, 0))
    if i_v == 0:
        tl.store(buf_decay + hb + p, d_new.to(buf_decay.dtype.element_ty), mask=o_hp < tl.where(ok, H, 0))
    g, total = _decay_products(al, al_next, o_c[None, :] == 0, 1)  # [HP, BC], [HP]
    acc = tl.sum((g * z[None, :])[:, :, None] * wb.to(tl.float32), axis=1)  # [HP, BV]
    ck = tl.sum(st0.to(tl.float32) * coef[:, :, None], axis=1)
    for r0 in range(8, tl.max(m, axis=0), 8):
        rows = (r0 + o_r8)[None, :] < m[:, None]
        c_r = tl.load(c_h[:, None] + r0 + o_r8[None, :], mask=rows, other=0.0)
        st = tl.load(sk_h[:, None, None] + (r0 + o_r8)[None, :, None] * V + o_v[None, None, :],
                     mask=rows[:, :, None], other=0.0)
        ck += tl.sum(st.to(tl.float32) * c_r[:, :, None], axis=1)
    if tl.min(m, axis=0) == 0:  # dense heads: their read copy, one head at a time
        o_k = tl.arange(0, K)
        qq = tl.load(q + (i_b * G + i_g) * K + o_k).to(tl.float32)
        for j in tl.static_range(HP):
            i_h = tl.program_id(1) * HP + j
            if tl.load(ranks + i_h) == 0:
                dense = _dense_read(qq, rd + (s * H + i_h) * (K * V), o_k, o_v, V, K, DENSE_ROWS)
                ck = tl.where((o_hp == i_h)[:, None], dense[None, :], ck)
    o = z_new * w_new + d_new[:, None] * (acc + total[:, None] * ck)
    if HAS_SKIP:
        o += tl.load(skip + x[:, None] * V + o_v[None, :]).to(tl.float32)
    tl.store(out + x[:, None] * V + o_v[None, :], o.to(out.dtype.element_ty),
             mask=o_v[None, :] < tl.where(live, V, 0))


def usable(family: str, pool: DecodePool, tables: SketchTables, tokens: int) -> bool:
    """Whether a sketch read can take the split form: Mamba-2, one token, a pool with a workspace
    (``allocate_pool`` gives Mamba-2 sketch pools one) and tables packed for Mamba-2."""
    return (family == "mamba2" and tokens == 1 and pool.workspace is not None
            and tables.group_maps is not None)


def launch(
    pool: DecodePool, tables: SketchTables, slots: Tensor, pos: Tensor, x: StepInputs, out: Tensor,
    cfg: KernelConfig, block_v: int, dense_rows: int,
) -> None:
    """The split sketch read of one token (``usable`` is True): :func:`launch_group` with
    ``cfg.split`` warps per program, then :func:`launch_heads` with ``cfg.num_warps`` warps and
    ``cfg.heads`` heads per program."""
    launch_group(pool, tables, slots, pos, x, cfg.split)
    launch_heads(pool, tables, slots, pos, x, out, cfg, block_v, dense_rows)


def _workspace_layout(pool: DecodePool, tables: SketchTables, groups: int) -> tuple[int, int]:
    """(row width, offset of the dots) of the pool's workspace, checked against the tables."""
    width, m_rows = pool.workspace.shape[-1], tables.map_rows
    dots = (pool.heads // groups) * m_rows
    if width != dots + pool.capacity + 1 or pool.sketch.shape[2] != m_rows:
        raise ValueError(f"the pool's workspace [.., {width}] and sketch ({pool.sketch.shape[2]} rows) do "
                         f"not fit tables of {m_rows} map rows: allocate the pool with sketch_rows={m_rows}")
    return width, dots


def launch_group(
    pool: DecodePool, tables: SketchTables, slots: Tensor, pos: Tensor, x: StepInputs, warps: int,
) -> None:
    """:func:`_group_kernel` over (G, B): appends the new keys; the workspace gets the dots and
    coefficients."""
    b, _, g, kd = x.k.shape
    width, dots = _workspace_layout(pool, tables, g)
    r = tables.group_maps.shape[1]
    tiles = -(-b // ROWS) * -(-r // COLUMNS)
    _group_kernel[(g, b + tiles)](
        slots, pos, x.q, x.k, pool.buf_k, pool.workspace, tables.group_maps, tables.group_cols,
        tables.group_width, b,
        G=g, K=kd, C=pool.capacity, BC=_buffer_block(pool.capacity), R=r, RB=COLUMNS, BB=ROWS, WS=width,
        DOTS=dots, Q_BF16=x.q.dtype == torch.bfloat16, EMULATE=_interpreting(),
        **_launch_options(KernelConfig(1, warps), pool.state.device),
    )


def launch_heads(
    pool: DecodePool, tables: SketchTables, slots: Tensor, pos: Tensor, x: StepInputs, out: Tensor,
    cfg: KernelConfig, block_v: int, dense_rows: int,
) -> None:
    """:func:`_head_kernel` over (V / BV, H, B), after :func:`launch_group`: appends w and the
    decays; writes ``out``."""
    b, _, g, kd = x.k.shape
    h, vd = pool.heads, x.w.shape[-1]
    width, dots = _workspace_layout(pool, tables, g)
    sk = pool.sketch
    hp = cfg.heads
    if (h // g) % hp:
        raise ValueError(f"KernelConfig.heads ({hp}) must divide the heads per group ({h // g})")
    _head_kernel[(vd // block_v, h // hp, b)](
        slots, pos, x.q, x.w, x.decay, x.skip if x.skip is not None else x.w, out, pool.buf_w,
        pool.buf_decay, pool.read, sk, tables.ranks, pool.workspace, sk.shape[2] * sk.shape[3],
        H=h, G=g, K=kd, V=vd, BV=block_v, HP=hp, C=pool.capacity, BC=_buffer_block(pool.capacity),
        M=tables.map_rows, WS=width, DOTS=dots, HAS_SKIP=x.skip is not None, DENSE_ROWS=dense_rows,
        **_launch_options(cfg, pool.state.device),
    )
