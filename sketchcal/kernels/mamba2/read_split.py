"""Mamba-2's sketch step as two kernels: what a key group shares, then what each head adds.

A Mamba-2 read (one new token, ``n`` buffered ones, scalar decays) is

    o = (k_n·q) w_n + α_n [ Σ_{j<n} g_j (k_j·q) w_j + (α_0⋯α_{n−1}) (R_{:m} S_c)ᵀ (P q) ] (+ D x)

with ``g_j = α_{j+1}⋯α_{n−1}``. Everything that is a reduction over K (the dots ``k_j·q`` and the
coefficients ``P q``) depends only on the group's keys and query, and the head's map; what is
left per head is a weighted sum of [V] rows. The one-kernel read (``common/read.py``) computes
the dots again in each of the group's H/G heads, each ending in a shuffle reduction.
Here:

1. :func:`_group_kernel`, two kinds of program in one launch:
   - one per (batch entry, ``dots`` groups): appends the new keys to the buffer and computes
     ``k_j·q`` for the buffered keys and the new one;
   - one per (16 batch entries, 32 map rows, group): ``P q`` for those entries on tensor cores,
     from the group's maps packed one after the other (``SketchTables.group_maps`` [G, R, K]), so
     each map tile is loaded once for 16 entries rather than once per entry and head.
   Both write to the pool's ``workspace`` [N, G, (H/G)·M + C + 1]: each head's M coefficients,
   then the dots (entry n: the new token's). With ``dots`` = 0 (the default) there are no dot
   programs: the coefficient programs append the keys, and the head kernel computes the dots.
2. :func:`_head_kernel`, one program per (batch entry, ``heads`` heads of a group, BV columns):
   appends w and the decays, and sums the buffered rows of w and the sketch rows with those
   coefficients. A dense head (rank 0) reads its read copy with ``q`` as the one-kernel read does.

Both are programmatic dependent launches; the second waits for the first's writes
(``dependent_launch``), so a step is still two launches in one stream, with no host sync, and
can be captured in a CUDA graph. Each loads what does not depend on the kernel before it (the
tables; all but the workspace) before it waits, so those loads overlap that kernel's end.

Where it cannot run (several tokens: ``spec_verify``; a pool without a workspace; replay mode) the
dispatch takes the one-kernel read with the same launch shape (:func:`usable`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sketchcal.kernels.common.pool import (
    DecodePool,
    SketchTables,
    is_dense,
    slot_strides,
    value_major,
    workspace_layout,
)
from sketchcal.kernels.common.recurrence import StepInputs
from sketchcal.kernels.common.triton_helpers import (
    buffer_block,
    clip_block_v,
    decay_products,
    dense_read,
    dependent_launch,
    dot_ff,
    dot_fk,
    entry_slot,
    interpreting,
    launch_options,
)

COLUMNS = 32  # coefficient columns per program of the group kernel: a [32, K] tile of the maps
ROWS = 16  # batch entries per coefficient program (the tensor-core tile's N)


@triton.jit
def _group_kernel(
    slots, pos, q, k, buf_k, ws, group_maps, group_cols, group_width, B, ss_bk, ss_ws, G: tl.constexpr,
    K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, R: tl.constexpr, RB: tl.constexpr, BB: tl.constexpr,
    DG: tl.constexpr, NO_DOTS: tl.constexpr, WS: tl.constexpr, DOTS: tl.constexpr, Q_BF16: tl.constexpr,
    EMULATE: tl.constexpr, PAGED: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (B·G/DG + G·⌈B/BB⌉·⌈R/RB⌉,), two kinds of program. ``ws`` row (slot, group):
    ``[coefficients (H/G)·M | dots C + 1]``, the dots starting at ``DOTS``.

    - the first B·G/DG, one per (batch entry, DG groups): append the new keys; the dots
      ``k_j·q`` (j < n) and the new key's (entry n), from a [DG, BC, K] tile of buffered keys;
    - the others, one per (group, BB batch entries, RB map columns): the coefficients ``P q`` of
      those entries on tensor cores, ``[RB, K] @ [K, BB]``, the fp32 maps in three bf16 terms
      (exact products with bf16 queries; fp32 queries are split too), so every batch entry shares
      each map tile's load.

    ``NO_DOTS``: no dot programs (the head kernel computes the dots); the first column tile of
    each (group, BB entries) appends their new keys. ``PAGED``: the pool is not dense, each slot's
    part of ``buf_k`` and ``ws`` is at its slot stride ``ss_bk`` / ``ss_ws``."""
    i = tl.program_id(0)
    o_k = tl.arange(0, K)
    n_dot = 0 if NO_DOTS else B * (G // DG)
    if i < n_dot:
        dependent_launch(PDL)
        i_b = i // (G // DG)
        o_g = (i % (G // DG)) * DG + tl.arange(0, DG)
        live, s, p = entry_slot(slots, pos, i_b)
        o_c = tl.arange(0, BC)
        x = (i_b * G + o_g)[:, None] * K + o_k[None, :]  # [DG, K]
        qq = tl.load(q + x).to(tl.float32)
        k_new = tl.load(k + x)
        if PAGED:
            buf_k, ws = buf_k + s * ss_bk, ws + s * ss_ws
            sg = o_g.to(tl.int64)
        else:
            sg = s * G + o_g
        gb = sg * C  # [DG]
        kb = tl.load(
            buf_k + (gb[:, None, None] + o_c[None, :, None]) * K + o_k[None, None, :],
            mask=(o_c[None, :, None] < p) & (o_k[None, None, :] < K),
            other=0.0,
        )
        tl.store(
            buf_k + (gb + p)[:, None] * K + o_k[None, :],
            k_new.to(buf_k.dtype.element_ty),
            mask=o_k[None, :] < tl.where(live & (p < C), K, 0),
        )
        row = ws + sg * WS + DOTS  # [DG]
        tl.store(
            row[:, None] + o_c[None, :],
            tl.sum(kb.to(tl.float32) * qq[:, None, :], axis=2),
            mask=(o_g[:, None] < G) & (o_c[None, :] < p),
        )
        tl.store(
            row + p, tl.sum(k_new.to(tl.float32) * qq, axis=1), mask=o_g < tl.where(live & (p <= C), G, 0)
        )
    else:
        NR: tl.constexpr = (R + RB - 1) // RB
        tiles = tl.cdiv(B, BB) * NR  # per group
        i_g = (i - n_dot) // tiles
        i_rb = (i - n_dot) % NR
        cols = i_rb * RB + tl.arange(0, RB)
        width = tl.load(group_width + i_g)
        used = (cols < width) & (cols < R)
        # no step writes the tables: they are loaded before waiting for the kernel before
        pm = tl.load(group_maps + (i_g * R + cols[:, None]) * K + o_k[None, :], mask=used[:, None], other=0.0)
        dst = tl.load(group_cols + i_g * R + cols, mask=used, other=-1)
        dependent_launch(PDL)
        o_b = (((i - n_dot) % tiles) // NR) * BB + tl.arange(0, BB)
        s_in = tl.load(slots + o_b, mask=o_b < B, other=-1)
        # no dot programs: the first column tile appends the new keys (two ifs: the first is
        # resolved at compile time)
        if NO_DOTS:  # noqa: SIM102
            if i_rb == 0:
                p = tl.load(pos + o_b, mask=s_in >= 0, other=C)
                kt = tl.load(
                    k + (o_b[:, None] * G + i_g) * K + o_k[None, :], mask=o_b[:, None] < B, other=0.0
                )
                s_k = tl.maximum(s_in, 0).to(tl.int64)
                if PAGED:
                    p_k = buf_k + (s_k * ss_bk)[:, None] + ((i_g * C + p) * K)[:, None] + o_k[None, :]
                else:
                    dst_k = (s_k * G + i_g) * C + p
                    p_k = buf_k + dst_k[:, None] * K + o_k[None, :]
                tl.store(
                    p_k,
                    kt.to(buf_k.dtype.element_ty),
                    mask=(p < C)[:, None] & (o_k[None, :] < K),
                )
        if i_rb * RB < width:
            s = tl.maximum(s_in, 0).to(tl.int64)
            qt = tl.load(q + (o_b[None, :] * G + i_g) * K + o_k[:, None], mask=o_b[None, :] < B, other=0.0)
            coef = tl.zeros((RB, BB), dtype=tl.float32)
            if Q_BF16:
                coef = dot_fk(pm, qt, coef, True, EMULATE)
            else:
                coef = dot_ff(pm, qt.to(tl.float32), coef, 3, EMULATE)
            if PAGED:  # noqa: SIM108  (a constexpr branch)
                slot_row = s * ss_ws + i_g * WS
            else:
                slot_row = (s * G + i_g) * WS
            tl.store(
                ws + slot_row[None, :] + dst[:, None],
                coef,
                mask=(dst[:, None] >= 0) & (s_in >= 0)[None, :],
            )


@triton.jit
def _head_kernel(
    slots, pos, q, k, w, decay, skip, out, buf_k, buf_w, buf_decay, rd, sk, ranks, ws, sk_head_stride,
    ss_bk, ss_bw, ss_bd, ss_rd, ss_sk, ss_ws,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, HP: tl.constexpr,
    C: tl.constexpr, BC: tl.constexpr, M: tl.constexpr, WS: tl.constexpr, DOTS: tl.constexpr,
    DOTS_HERE: tl.constexpr, HAS_SKIP: tl.constexpr, DENSE_ROWS: tl.constexpr, PAGED: tl.constexpr,
    RD_VM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (V // BV, H // HP, B): ``HP`` heads of one key group per program, as the leading
    dimension of every tile (two [HP, BC/2, BV] halves of the buffered w, [HP, 8, BV] sketch rows),
    so that their loads issue together and a reduction over rows stays inside a warp's tile. The
    second half's sums run only when it holds tokens (n > BC/2): the buffer is half empty on
    average.

    Only the workspace is the group kernel's output: everything else is loaded before waiting for
    it (``dependent_launch``), so those loads overlap its run. They come from kernels before it,
    which have finished by then, since the group kernel waits before letting this one launch.
    ``DOTS_HERE``: the group's dots ``k_j·q`` are computed here too, before that wait (the buffered
    keys it reads, j < n, are not the ones the group kernel appends). ``PAGED``: the pool is not
    dense, each slot's part of a tensor at its slot stride ``ss_*``; ``RD_VM``: the read copy is
    value-major."""
    i_v = tl.program_id(0)
    i_b = tl.program_id(2)
    o_hp = tl.program_id(1) * HP + tl.arange(0, HP)  # this program's heads
    i_g = (tl.program_id(1) * HP) // (H // G)
    o_v = i_v * BV + tl.arange(0, BV)
    o_r8 = tl.arange(0, 8)
    # no early exit for padding (as in the one-kernel read): it reads slot 0, stores nothing
    live, s, p = entry_slot(slots, pos, i_b)
    if PAGED:  # each tensor's slot part where its slot stride puts it; heads counted within it
        buf_k, buf_w, buf_decay = buf_k + s * ss_bk, buf_w + s * ss_bw, buf_decay + s * ss_bd
        rd, sk, ws = rd + s * ss_rd, sk + s * ss_sk, ws + s * ss_ws
        sh, sg = o_hp.to(tl.int64), i_g
    else:  # dense [N, ...] arrays: the heads' and group's index over all slots
        sh, sg = s * H + o_hp, s * G + i_g
    m = tl.load(ranks + o_hp)  # [HP]
    x = i_b * H + o_hp
    w_new = tl.load(w + x[:, None] * V + o_v[None, :]).to(tl.float32)
    d_new = tl.load(decay + x).to(tl.float32)
    sk_h = sk + sh * sk_head_stride
    rows8 = o_r8[None, :] < m[:, None]  # [HP, 8]
    st0 = tl.load(
        sk_h[:, None, None] + o_r8[None, :, None] * V + o_v[None, None, :], mask=rows8[:, :, None], other=0.0
    )
    hb = sh * C
    # the buffer in two halves of BC/2 rows: the second one's sums only run when it holds tokens
    o_l = tl.arange(0, BC // 2)
    o_u = BC // 2 + o_l
    wb_l = tl.load(
        buf_w + (hb[:, None, None] + o_l[None, :, None]) * V + o_v[None, None, :],
        mask=(o_l < p)[None, :, None],
        other=0.0,
    )  # [HP, BC/2, BV]
    wb_u = tl.load(
        buf_w + (hb[:, None, None] + o_u[None, :, None]) * V + o_v[None, None, :],
        mask=(o_u < p)[None, :, None],
        other=0.0,
    )
    o_c = tl.arange(0, BC)
    al = tl.load(buf_decay + hb[:, None] + o_c[None, :], mask=(o_c < p)[None, :], other=1.0)
    al_next = tl.load(buf_decay + hb[:, None] + o_c[None, :] + 1, mask=(o_c + 1 < p)[None, :], other=1.0)
    row = ws + sg * WS
    if DOTS_HERE:
        o_k = tl.arange(0, K)
        x_g = (i_b * G + i_g) * K + o_k
        qk = tl.load(q + x_g).to(tl.float32)
        gb = sg * C
        kb_l = tl.load(buf_k + (gb + o_l[:, None]) * K + o_k[None, :], mask=o_l[:, None] < p, other=0.0)
        kb_u = tl.load(buf_k + (gb + o_u[:, None]) * K + o_k[None, :], mask=o_u[:, None] < p, other=0.0)
        z_l = tl.sum(kb_l.to(tl.float32) * qk[None, :], axis=1)
        z_new = tl.sum(tl.load(k + x_g).to(tl.float32) * qk, axis=0)
        dependent_launch(PDL)
    else:
        dependent_launch(PDL)
        z_l = tl.load(row + DOTS + o_l, mask=o_l < p, other=0.0)
        z_new = tl.load(row + DOTS + p)
    c_h = row + (o_hp % (H // G)) * M  # [HP] each head's coefficients
    coef = tl.load(c_h[:, None] + o_r8[None, :], mask=rows8, other=0.0)
    ok = live & (p < C)
    tl.store(
        buf_w + (hb + p)[:, None] * V + o_v[None, :],
        w_new.to(buf_w.dtype.element_ty),
        mask=o_v[None, :] < tl.where(ok, V, 0),
    )
    if i_v == 0:
        tl.store(buf_decay + hb + p, d_new.to(buf_decay.dtype.element_ty), mask=o_hp < tl.where(ok, H, 0))
    # the products over the whole [HP, BC] tile, then split in halves: Triton 3.6 fails an assertion
    # lowering the scan of an [HP, BC/2] tile in some layouts (2 heads per program, fp8 sketch)
    g, total = decay_products(al, al_next, o_c[None, :] == 0, 1)  # [HP, BC], [HP]
    g_l, g_u = tl.split(tl.permute(tl.reshape(g, (HP, 2, BC // 2)), (0, 2, 1)))
    acc = tl.sum((g_l * z_l[None, :])[:, :, None] * wb_l.to(tl.float32), axis=1)  # [HP, BV]
    if p > BC // 2:
        if DOTS_HERE:
            z_u = tl.sum(kb_u.to(tl.float32) * qk[None, :], axis=1)
        else:
            z_u = tl.load(row + DOTS + o_u, mask=o_u < p, other=0.0)
        acc += tl.sum((g_u * z_u[None, :])[:, :, None] * wb_u.to(tl.float32), axis=1)
    ck = tl.sum(st0.to(tl.float32) * coef[:, :, None], axis=1)
    for r0 in range(8, tl.max(m, axis=0), 8):
        rows = (r0 + o_r8)[None, :] < m[:, None]
        c_r = tl.load(c_h[:, None] + r0 + o_r8[None, :], mask=rows, other=0.0)
        st = tl.load(
            sk_h[:, None, None] + (r0 + o_r8)[None, :, None] * V + o_v[None, None, :],
            mask=rows[:, :, None],
            other=0.0,
        )
        ck += tl.sum(st.to(tl.float32) * c_r[:, :, None], axis=1)
    if tl.min(m, axis=0) == 0:  # dense heads: their read copy, one head at a time
        o_k = tl.arange(0, K)
        qq = tl.load(q + (i_b * G + i_g) * K + o_k).to(tl.float32)
        for j in tl.static_range(HP):
            i_h = tl.program_id(1) * HP + j
            if tl.load(ranks + i_h) == 0:
                rd_h = rd + (i_h if PAGED else s * H + i_h) * (K * V)
                dense = dense_read(qq, rd_h, o_k, o_v, V, K, DENSE_ROWS, RD_VM)
                ck = tl.where((o_hp == i_h)[:, None], dense[None, :], ck)
    o = z_new * w_new + d_new[:, None] * (acc + total[:, None] * ck)
    if HAS_SKIP:
        o += tl.load(skip + x[:, None] * V + o_v[None, :]).to(tl.float32)
    tl.store(
        out + x[:, None] * V + o_v[None, :],
        o.to(out.dtype.element_ty),
        mask=o_v[None, :] < tl.where(live, V, 0),
    )


def usable(family: str, pool: DecodePool, tables: SketchTables | None, tokens: int) -> bool:
    """Whether a read can take the split form: a Mamba-2 sketch read of one token, from a pool with
    a workspace (``allocate_pool`` gives Mamba-2 sketch pools one) and tables packed for Mamba-2."""
    return (
        family == "mamba2"
        and tables is not None
        and tokens == 1
        and pool.workspace is not None
        and tables.group_maps is not None
    )


def launch(
    family: str, pool: DecodePool, tables: SketchTables, slots: Tensor, pos: Tensor, x: StepInputs,
    out: Tensor, cfg,
) -> None:  # fmt: skip
    """The split sketch read of one token (:func:`usable` is True): :func:`launch_group` with
    ``cfg.coef_warps`` warps per program, then :func:`launch_heads` with ``cfg.num_warps`` warps and
    ``cfg.heads`` heads per program (neither takes a register cap)."""
    launch_group(pool, tables, slots, pos, x, cfg)
    launch_heads(pool, tables, slots, pos, x, out, cfg)


def _workspace_layout(pool: DecodePool, tables: SketchTables, groups: int) -> tuple[int, int]:
    """(row width, offset of the dots) of the pool's workspace, checked against the tables."""
    m_rows = tables.map_rows
    width, dots = workspace_layout(pool.heads // groups, m_rows, pool.capacity)
    if pool.workspace.shape[-1] != width or pool.sketch.shape[2] != m_rows:
        raise ValueError(
            f"the pool's workspace [.., {pool.workspace.shape[-1]}] and sketch "
            f"({pool.sketch.shape[2]} rows) do not fit tables of {m_rows} map rows: "
            f"allocate the pool with sketch_rows={m_rows}"
        )
    return width, dots


def _dividing_power_of_two(at_most: int, n: int) -> int:
    """The largest power of two that divides ``n`` and is at most ``at_most`` (a power of two):
    ``KernelConfig.heads`` and ``dots`` are clipped to the model's groups like ``block_v`` to V."""
    return min(at_most, n & -n)


def launch_group(
    pool: DecodePool, tables: SketchTables, slots: Tensor, pos: Tensor, x: StepInputs, cfg,
) -> None:  # fmt: skip
    """:func:`_group_kernel`, ``cfg.coef_warps`` warps per program and ``cfg.dots`` key groups per
    dot program: appends the new keys; the workspace gets the dots and coefficients."""
    b, _, g, kd = x.k.shape
    width, dots = _workspace_layout(pool, tables, g)
    r = tables.group_maps.shape[1]
    dg = _dividing_power_of_two(max(cfg.dots, 1), g)
    tiles = -(-b // ROWS) * -(-r // COLUMNS)
    _group_kernel[((b * (g // dg) if cfg.dots else 0) + g * tiles,)](
        slots, pos, x.q, x.k, pool.buf_k, pool.workspace, tables.group_maps, tables.group_cols,
        tables.group_width, b, *slot_strides(pool, "buf_k", "workspace"), G=g, K=kd, C=pool.capacity,
        BC=buffer_block(pool.capacity), R=r, RB=COLUMNS, BB=ROWS, DG=dg, NO_DOTS=cfg.dots == 0, WS=width,
        DOTS=dots, Q_BF16=x.q.dtype == torch.bfloat16, EMULATE=interpreting(), PAGED=not is_dense(pool),
        **launch_options(cfg.coef_warps, 0, pool.state.device),
    )  # fmt: skip


def launch_heads(
    pool: DecodePool, tables: SketchTables, slots: Tensor, pos: Tensor, x: StepInputs, out: Tensor, cfg,
) -> None:  # fmt: skip
    """:func:`_head_kernel` over (V / BV, H / ``heads``, B), after :func:`launch_group`: appends
    w and the decays; writes ``out``."""
    b, _, g, kd = x.k.shape
    h, vd = pool.heads, x.w.shape[-1]
    width, dots = _workspace_layout(pool, tables, g)
    sk = pool.sketch
    hp = _dividing_power_of_two(cfg.heads, h // g)
    block_v = clip_block_v(cfg.block_v, vd)
    paged = not is_dense(pool)
    _head_kernel[(vd // block_v, h // hp, b)](
        slots, pos, x.q, x.k, x.w, x.decay, x.skip if x.skip is not None else x.w, out, pool.buf_k,
        pool.buf_w, pool.buf_decay, pool.read, sk, tables.ranks, pool.workspace, sk.shape[2] * sk.shape[3],
        *slot_strides(pool, "buf_k", "buf_w", "buf_decay", "read", "sketch", "workspace"),
        H=h, G=g, K=kd, V=vd, BV=block_v, HP=hp, C=pool.capacity, BC=buffer_block(pool.capacity),
        M=tables.map_rows, WS=width, DOTS=dots, DOTS_HERE=cfg.dots == 0, HAS_SKIP=x.skip is not None,
        DENSE_ROWS=min(cfg.dense_rows, kd), PAGED=paged, RD_VM=paged and value_major(pool.read),
        **launch_options(cfg.num_warps, 0, pool.state.device),
    )  # fmt: skip
