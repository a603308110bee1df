"""Triton building blocks shared by every decode kernel, and the host-side launch helpers.

Device functions (``@triton.jit``, inlined into the kernels that call them), per program of one
slot, one head and a tile of BV value columns; the state tile is fp32 and holds the key dimension
on axis ``KAXIS``: [K, BV] (0: the sweeps) or its transpose [BV, K] (1: the tensor-core flush).

- tokens: :func:`load_token` (one token's k [K], w [BV], decay, beta as fp32; a masked token is
  the identity transition), :func:`forward` (``S ← A S + k wᵀ``), :func:`forward_scaled` (the
  same with a scalar decay kept in a separate scale), :func:`backward` (one token of a read's
  backward sweep on the query), :func:`sweep_buffered`, :func:`step_emit` (a token and its
  output);
- tensor-core products accurate to fp32: :func:`bdot`, :func:`split_bf16`, :func:`dot_fk`
  (fp32 times bf16 keys), :func:`dot_ff` (fp32 times fp32);
- checkpoint reads: :func:`dense_read`, :func:`first_map_rows`, :func:`checkpoint_read`;
- programs, buffers and launch: :func:`program_slot`, :func:`head_tile`, :func:`entry_slot`,
  :func:`decay_products`, :func:`dependent_launch`, :func:`prefetch_l2`, :func:`prefetch_buffer`,
  :func:`store_read_copy`.

The transition is picked by the ``FAMILY`` constexpr (:data:`FAMILY_ID`): 0 Mamba-2
``A = a I``, 1 GDN ``A = α (I − β k kᵀ)``, 2 KDA ``A = (I − β k kᵀ) Diag(α)``; with the decay
applied first, ``A S = d⊙S + k(−β kᵀ(d⊙S))ᵀ`` for the delta rules.

Precision: products of decays are running products, never ratios, so none overflows; the
tensor-core products that feed the fp32 checkpoint split their fp32 operands into bf16 terms
(exact products, fp32 accumulation) or use 3xTF32.

Launch: on Hopper and later every kernel is a programmatic dependent launch
(:func:`dependent_launch`, :data:`USE_PDL`): its programs become resident while the previous
kernel's last ones run, and wait for its writes before their first load, which hides the launch
gap between consecutive decode kernels.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from sketchcal.kernels.common.pool import DecodePool, next_pow2
from sketchcal.kernels.common.recurrence import StepInputs

FAMILY_ID = {"mamba2": 0, "gdn": 1, "kda": 2}

CHUNK_MIN = 16  # tl.dot needs at least 16 rows/columns: buffer tiles are padded to this

# Programmatic dependent launch of the decode kernels on Hopper and later (see dependent_launch);
# False launches them plainly.
USE_PDL = True

# A window's decay product below TINY is folded into the tile (see forward_scaled); KDA's Gluon flush
# takes its scaled form while every running product of decays lies in [TINY, HUGE]
TINY = tl.constexpr(2.0**-64)
HUGE = tl.constexpr(2.0**64)


def interpreting() -> bool:
    """Whether Triton runs the kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _pdl_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_options(num_warps: int, maxnreg: int = 0, device: torch.device | None = None) -> dict:
    """Triton launch (and compile) options: warps per program and a register cap (0: none); with
    ``device``, also the ``PDL`` constexpr and its launch option."""
    opts = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    if device is not None:
        pdl = USE_PDL and device.type == "cuda" and not interpreting()
        pdl = pdl and _pdl_device(torch.cuda.current_device() if device.index is None else device.index)
        opts.update(PDL=pdl, **({"launch_pdl": True} if pdl else {}))
    return opts


def prefetch_enabled(prefetch: bool) -> bool:
    """``KernelConfig.prefetch`` where it can run: the CPU interpreter runs no inline PTX (and no
    result depends on a prefetch)."""
    return prefetch and not interpreting()


def clip_block_v(block_v: int, vd: int) -> int:
    """``KernelConfig.block_v`` clipped to the value dim V."""
    return max(1, min(block_v, vd))


def buffer_block(capacity: int) -> int:
    """Rows of the buffer tiles: the capacity padded to a power of two ≥ 16."""
    return max(CHUNK_MIN, next_pow2(capacity))


def keys_bf16(pool: DecodePool) -> bool:
    """bf16 buffered keys enter tensor-core dots as they are (exact); others as 3xTF32."""
    return pool.buf_k.dtype == torch.bfloat16


def beta_or_placeholder(x: StepInputs) -> Tensor:
    """The inputs' beta, or any tensor for Mamba-2 (whose kernels never read it)."""
    return x.beta if x.beta is not None else x.decay


@triton.jit
def load_token(
    k, w, decay, beta, k_off, w_off, h_off, o_k, o_v, live, K: tl.constexpr, V: tl.constexpr,
    FAMILY: tl.constexpr, LOG2_DECAY: tl.constexpr = False,
):  # fmt: skip
    """One token's (k [K], w [BV], decay, beta) as fp32; a masked-off token (``live`` False)
    comes back as the identity transition (k = w = 0, decay = 1, beta = 0). ``LOG2_DECAY`` (KDA):
    ``decay`` points at log₂ of the decays (``DecodePool.buf_logdecay``)."""
    # vector masks come from one comparison each (the interpreter rejects broadcast scalar masks)
    mk = o_k < tl.where(live, K, 0)
    kk = tl.load(k + k_off + o_k, mask=mk, other=0.0).to(tl.float32)
    ww = tl.load(w + w_off + o_v, mask=o_v < tl.where(live, V, 0), other=0.0).to(tl.float32)
    if FAMILY == 2 and LOG2_DECAY:
        dd = tl.exp2(tl.load(decay + h_off * K + o_k, mask=mk, other=0.0).to(tl.float32))
    elif FAMILY == 2:
        dd = tl.load(decay + h_off * K + o_k, mask=mk, other=1.0).to(tl.float32)
    else:
        dd = tl.load(decay + h_off, mask=live, other=1.0).to(tl.float32)
    if FAMILY == 0:  # noqa: SIM108  (a constexpr branch: the other side is never compiled)
        bb = dd * 0.0
    else:
        bb = tl.load(beta + h_off, mask=live, other=0.0).to(tl.float32)
    return kk, ww, dd, bb


@triton.jit
def forward(S, kk, ww, dd, bb, FAMILY: tl.constexpr, KAXIS: tl.constexpr):
    """``A S + k wᵀ`` on an fp32 tile holding the key dimension on axis ``KAXIS``: [K, BV] (0, the
    sweeps) or [BV, K] (1, the tensor-core flush, whose tile is Sᵀ)."""
    # (keep this order of the ops: ptxas schedules KDA's sweep worse with the key's broadcast
    # hoisted above the decay)
    if FAMILY == 0:
        S = S * dd + tl.expand_dims(kk, 1 - KAXIS) * tl.expand_dims(ww, KAXIS)
    else:
        if FAMILY == 2:  # noqa: SIM108
            S = S * tl.expand_dims(dd, 1 - KAXIS)
        else:
            S = S * dd
        ks = tl.sum(S * tl.expand_dims(kk, 1 - KAXIS), axis=KAXIS)
        S = S + tl.expand_dims(kk, 1 - KAXIS) * tl.expand_dims(ww - bb * ks, KAXIS)
    return S


@triton.jit
def forward_scaled(S, c, kk, ww, dd, bb, FAMILY: tl.constexpr, KAXIS: tl.constexpr = 0):
    """:func:`forward` for a scalar decay (Mamba-2, GDN) on a tile held as ``c Ŝ`` (key dimension
    on axis ``KAXIS``, as in :func:`forward`): returns the new (Ŝ, c).

    The decay only multiplies the scale, so a token costs the k·Ŝ reduction and one FMA per
    element instead of a multiply more: with c' = c d and u = w − β kᵀ(d S) = w − β c' kᵀŜ,
    ``Ŝ ← Ŝ + k (u / c')ᵀ``. A scale below ``TINY`` is folded into Ŝ first (a product of many
    decays: rare), so neither c nor 1/c under- or overflows, and a zero decay zeroes the tile.
    (KDA's per-channel scales cost more per token than the multiply they save.)"""
    c = c * dd
    if c < TINY:
        S = S * c
        c = c * 0.0 + 1.0
    r = 1.0 / c
    if FAMILY == 0:
        S = S + tl.expand_dims(kk, 1 - KAXIS) * tl.expand_dims(ww * r, KAXIS)
    else:
        ks = tl.sum(S * tl.expand_dims(kk, 1 - KAXIS), axis=KAXIS)
        S = S + tl.expand_dims(kk, 1 - KAXIS) * tl.expand_dims(ww * r - bb * ks, KAXIS)
    return S, c


@triton.jit
def backward(v, c, kk, dd, bb, FAMILY: tl.constexpr):
    """One token of a read's backward sweep on the query, held as ``c v̂`` ([K] vector, scalar
    scale): returns ``k · (c v̂)`` (the coefficient of this token's w in the read) and the query
    pushed one token further back, as (v̂, c).

    A scalar decay (Mamba-2, GDN) only multiplies the scale: ``(v − β (k·v) k) d = c d (v̂ −
    β (k·v̂) k)``, one multiply per token instead of one per element. KDA's per-channel decay goes
    into v̂ (c stays 1)."""
    kv = tl.sum(kk * v, axis=0)
    if FAMILY == 0:
        c_next = c * dd
    elif FAMILY == 1:
        v = v - (bb * kv) * kk
        c_next = c * dd
    else:
        v = (v - (bb * kv) * kk) * dd
        c_next = c
    return kv * c, v, c_next


@triton.jit
def sweep_buffered(
    v, c, acc, k_g, w_h, decay_h, beta_h, j, live, o_k, o_v, K: tl.constexpr, V: tl.constexpr,
    FAMILY: tl.constexpr, LOG2_DECAY: tl.constexpr,
):  # fmt: skip
    """One buffered token ``j`` of a read's backward sweep (``live`` False: the identity) on the
    query ``c v̂`` (see :func:`backward`): returns it pushed past the token, and ``acc`` plus the
    token's w's share of the output. ``k_g``, ``w_h``, ``decay_h``, ``beta_h`` point at the entry
    of this group's / head's buffer that ``j`` counts from (entry 0, or a group's newest token with
    ``j`` ≤ 0), so a token costs a 32-bit offset per pointer rather than 64-bit address
    arithmetic. ``LOG2_DECAY``: ``decay_h`` points at log₂ of the decays (:func:`load_token`)."""
    kk, ww, dd, bb = load_token(
        k_g, w_h, decay_h, beta_h, j * K, j * V, j, o_k, o_v, live, K, V, FAMILY, LOG2_DECAY,
    )  # fmt: skip
    kv, v, c = backward(v, c, kk, dd, bb, FAMILY)
    return v, c, acc + kv * ww


@triton.jit
def step_emit(
    S, q, k, w, decay, beta, skip, out, x_t, i_h, i_g, o_k, o_v, live, H: tl.constexpr, G: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, FAMILY: tl.constexpr, HAS_SKIP: tl.constexpr, KAXIS: tl.constexpr,
):  # fmt: skip
    """Apply input token ``x_t`` to the fp32 tile S (key dimension on axis ``KAXIS``, as in
    :func:`forward`) and store its output ``Sᵀq (+ skip)`` [BV]."""
    kk, ww, dd, bb = load_token(
        k, w, decay, beta, (x_t * G + i_g) * K, (x_t * H + i_h) * V, x_t * H + i_h, o_k, o_v, live, K, V,
        FAMILY,
    )  # fmt: skip
    S = forward(S, kk, ww, dd, bb, FAMILY, KAXIS)
    qq = tl.load(q + (x_t * G + i_g) * K + o_k).to(tl.float32)
    o = tl.sum(S * tl.expand_dims(qq, 1 - KAXIS), axis=KAXIS)
    if HAS_SKIP:
        o += tl.load(skip + (x_t * H + i_h) * V + o_v).to(tl.float32)
    tl.store(out + (x_t * H + i_h) * V + o_v, o.to(out.dtype.element_ty))
    return S


@triton.jit
def bdot(a, b, acc, EMULATE: tl.constexpr):
    """``acc + a @ b`` for bf16 tiles with fp32 accumulation. ``EMULATE`` (the CPU interpreter,
    whose bf16 dot is wrong) multiplies the same bf16 values as fp32."""
    if EMULATE:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def split_bf16(a, TERMS: tl.constexpr):
    """An fp32 tile as ``TERMS`` (2 or 3) bf16 terms ``a1 + a2 (+ a3)``, largest first, 8
    significant bits each (the third is 0 when ``TERMS`` is 2)."""
    a1 = a.to(tl.bfloat16)
    rest = a - a1.to(tl.float32)
    a2 = rest.to(tl.bfloat16)
    if TERMS == 3:  # noqa: SIM108
        a3 = (rest - a2.to(tl.float32)).to(tl.bfloat16)
    else:
        a3 = (rest * 0.0).to(tl.bfloat16)
    return a1, a2, a3


@triton.jit
def dot_fk(a, b, acc, B_BF16: tl.constexpr, EMULATE: tl.constexpr):
    """``acc + a @ b`` on tensor cores, accurate to ~fp32 rounding, for an fp32 ``a`` and keys
    ``b``.

    ``B_BF16``: ``a`` is split into three bf16 terms, each multiplied exactly by the bf16 keys
    with fp32 accumulation (three bf16 passes; the terms come straight from an MMA accumulator
    tile without a trip through shared memory). Otherwise 3xTF32."""
    if B_BF16:
        # largest term first, each used as soon as it is made (fewer values live at once)
        a1 = a.to(tl.bfloat16)
        acc = bdot(a1, b, acc, EMULATE)
        rest = a - a1.to(tl.float32)
        a2 = rest.to(tl.bfloat16)
        acc = bdot(a2, b, acc, EMULATE)
        acc = bdot((rest - a2.to(tl.float32)).to(tl.bfloat16), b, acc, EMULATE)
    else:
        acc = tl.dot(a, b.to(tl.float32), acc, input_precision="tf32x3")
    return acc


@triton.jit
def dot_ff(a, b, acc, TERMS: tl.constexpr, EMULATE: tl.constexpr):
    """``acc + a @ b`` for two fp32 tiles, each split into ``TERMS`` bf16 terms: the products of
    terms weighing at least 2⁻⁸⁽ᵀᴱᴿᴹˢ⁻¹⁾ (3 of them for 2 terms, ~16 bits; 6 for 3, ~fp32
    rounding), smallest first. ``TERMS`` = 1: ``a`` rounded to bf16, ``b`` in two terms, so the
    product of bf16(a) and b to ~16 bits (``mamba2.flush_chunk.sketch_terms``: a sketch stored in
    bf16 or fp8)."""
    SPLIT: tl.constexpr = 3 if TERMS == 3 else 2
    a1, a2, a3 = split_bf16(a, SPLIT)
    b1, b2, b3 = split_bf16(b, SPLIT)
    if TERMS == 3:
        acc = bdot(a3, b1, acc, EMULATE)
        acc = bdot(a2, b2, acc, EMULATE)
        acc = bdot(a1, b3, acc, EMULATE)
    if TERMS > 1:
        acc = bdot(a2, b1, acc, EMULATE)
    acc = bdot(a1, b2, acc, EMULATE)
    return bdot(a1, b1, acc, EMULATE)


@triton.jit
def tile_ptrs(
    head, o_k, o_v, K: tl.constexpr, V: tl.constexpr, VM: tl.constexpr, KAXIS: tl.constexpr = 0
):  # fmt: skip
    """Pointers to rows ``o_k`` and columns ``o_v`` of the [K, V] state at ``head``, stored
    key-major, or value-major (``VM``: the transpose of a contiguous [V, K]), as a tile holding the
    keys on axis ``KAXIS``: [len(o_k), len(o_v)] (0) or [len(o_v), len(o_k)] (1). The two terms are
    added to the pointer one after the other: summed first, as an int32 tile, they cost the sweep
    flush a register per element."""
    if KAXIS == 0:
        if VM:
            return head + o_k[:, None] + o_v[None, :] * K
        else:
            return head + o_k[:, None] * V + o_v[None, :]
    else:
        if VM:
            return head + o_v[:, None] * K + o_k[None, :]
        else:
            return head + o_v[:, None] + o_k[None, :] * V


@triton.jit
def dense_read(v, rd_h, o_k, o_v, V: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr, VM: tl.constexpr):
    """``S_cᵀ v`` [BV] from the read copy of one head (``VM``: stored value-major). ``ROWS`` > 0:
    ROWS rows at a time (a rolled loop; each block's share of ``v`` is gathered from registers), so
    a [ROWS, BV] tile is live instead of [K, BV]."""
    if ROWS == 0:
        rc = tl.load(tile_ptrs(rd_h, o_k, o_v, K, V, VM)).to(tl.float32)
        o = tl.sum(rc * v[:, None], axis=0)
    else:
        o_b = tl.arange(0, ROWS)
        o = tl.zeros([o_v.shape[0]], dtype=tl.float32)
        for k0 in range(0, K, ROWS):
            rc = tl.load(tile_ptrs(rd_h, k0 + o_b, o_v, K, V, VM)).to(tl.float32)
            o += tl.sum(rc * tl.gather(v, k0 + o_b, 0)[:, None], axis=0)
    return o


@triton.jit
def first_map_rows(maps, i_h, o_k, K: tl.constexpr, M: tl.constexpr):
    """The first 8 rows of head ``i_h``'s coefficient map [8, K] (rows past the table's M: 0)."""
    o_r = tl.arange(0, 8)
    rows = tl.load(maps + (i_h * M + o_r[:, None]) * K + o_k[None, :], mask=o_r[:, None] < M, other=0.0)
    return rows.to(tl.float32)


@triton.jit
def checkpoint_read(
    v, rd_h, sk_h, m, pm0, st0, maps, i_h, o_k, o_v, K: tl.constexpr, V: tl.constexpr, M: tl.constexpr,
    SKETCH: tl.constexpr, ROWS: tl.constexpr, EARLY_MAP: tl.constexpr, RD_VM: tl.constexpr,
):  # fmt: skip
    """``S_cᵀ u`` from the read copy (``RD_VM``: stored value-major), or ``(R_{:m} S_c)ᵀ (P u)`` for
    a head of rank m > 0.

    ``pm0`` [8, K] and ``st0`` [8, BV] are the first 8 map and sketch rows, loaded by the caller
    before the buffer work so that their latency overlaps it (``pm0`` only if ``EARLY_MAP``: else
    it is loaded here); rows past 8 follow in chunks of 8 (registers do not grow with the largest
    rank)."""
    if SKETCH:
        if m > 0:
            if not EARLY_MAP:
                pm0 = first_map_rows(maps, i_h, o_k, K, M)
            coeff = tl.sum(pm0 * v[None, :], axis=1)
            o = tl.sum(st0.to(tl.float32) * coeff[:, None], axis=0)
            o_r = tl.arange(0, 8)
            for r0 in range(8, m, 8):
                rows = (r0 + o_r)[:, None] < m
                pm = tl.load(maps + (i_h * M + r0 + o_r[:, None]) * K + o_k[None, :], mask=rows, other=0.0)
                coeff = tl.sum(pm.to(tl.float32) * v[None, :], axis=1)
                st = tl.load(sk_h + (r0 + o_r[:, None]) * V + o_v[None, :], mask=rows, other=0.0)
                o += tl.sum(st.to(tl.float32) * coeff[:, None], axis=0)
        else:
            o = dense_read(v, rd_h, o_k, o_v, V, K, ROWS, RD_VM)
    else:
        o = dense_read(v, rd_h, o_k, o_v, V, K, ROWS, RD_VM)
    return o


@triton.jit
def program_slot(slots):
    """A program's value tile, head and batch entry on the (V / BV, H, B) grid, and the entry's slot
    (int64; negative for padding)."""
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    return i_v, i_h, i_b, tl.load(slots + i_b).to(tl.int64)


@triton.jit
def head_tile(i_v, i_h, H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, BV: tl.constexpr):
    """Head ``i_h``'s key group, the key offsets [K] and value tile ``i_v``'s columns [BV]."""
    return i_h // (H // G), tl.arange(0, K), i_v * BV + tl.arange(0, BV)


@triton.jit
def entry_slot(slots, pos, i_b):
    """Batch entry ``i_b``'s (live, slot, buffered tokens): a padding entry (negative slot) reads
    slot 0 with an empty buffer, and its stores are masked by ``live``."""
    s_in = tl.load(slots + i_b)
    live = s_in >= 0
    return live, tl.maximum(s_in, 0).to(tl.int64), tl.where(live, tl.load(pos + i_b), 0)


@triton.jit
def decay_products(al, al_next, first, AXIS: tl.constexpr):
    """Scalar decays of buffered tokens along ``AXIS``: from ``al`` (α_j, 1 past the n buffered) and
    ``al_next`` (α_{j+1}, 1 past n − 1), ``g_j = α_{j+1}⋯α_{n−1}`` and the whole window's
    ``α_0⋯α_{n−1}`` (``first``: where j = 0)."""
    g = tl.cumprod(al_next, AXIS, reverse=True)
    return g, tl.sum(tl.where(first, g * al, 0.0), axis=AXIS)


@triton.jit
def dependent_launch(PDL: tl.constexpr):
    """Programmatic dependent launch (``PDL``, Hopper and later): wait until the previous kernel
    in the stream has finished and its writes are visible, then let the next one launch. Its
    programs then become resident while this kernel's last ones run, and wait here in turn: the
    launch gap between consecutive decode kernels is hidden. First thing in every kernel, before
    any load: every input may come from the kernel before."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(p):
    """``prefetch.global.L2`` of the 128-byte lines holding the addresses ``p`` (a hint: nothing is
    loaded into registers)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [p], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def prefetch_buffer(
    buf_k, buf_w, buf_decay, buf_beta, hb, gb, n, w_col, K: tl.constexpr, V: tl.constexpr,
    WCOLS: tl.constexpr, C: tl.constexpr, FAMILY: tl.constexpr,
):  # fmt: skip
    """Ask L2 for the first ``n`` entries of a slot's buffer, all at once (``KernelConfig.prefetch``):
    the group's keys [n, K] and the head's decays (contiguous), its betas, and columns
    [w_col, w_col + WCOLS) of its w's [n, V]. Lanes past ``n`` repeat entry 0."""
    KL: tl.constexpr = 128 // (buf_k.dtype.element_ty.primitive_bitwidth // 8)  # keys per line
    o = tl.arange(0, C * K // KL) * KL
    prefetch_l2(buf_k + gb * K + tl.where(o < n * K, o, 0))
    WL: tl.constexpr = 128 // (buf_w.dtype.element_ty.primitive_bitwidth // 8)
    PER_ROW: tl.constexpr = WCOLS // WL if WCOLS >= WL else 1  # lines per entry
    o = tl.arange(0, C * PER_ROW)
    row = tl.where(o // PER_ROW < n, o // PER_ROW, 0)
    prefetch_l2(buf_w + (hb + row) * V + w_col + (o % PER_ROW) * WL)
    if FAMILY == 2:
        DL: tl.constexpr = 128 // (buf_decay.dtype.element_ty.primitive_bitwidth // 8)
        o = tl.arange(0, C * K // DL) * DL
        prefetch_l2(buf_decay + hb * K + tl.where(o < n * K, o, 0))
    else:
        prefetch_l2(buf_decay + hb + tl.arange(0, 1))
    if FAMILY != 0:
        prefetch_l2(buf_beta + hb + tl.arange(0, 1))


@triton.jit
def store_read_copy(S, p_r, read_rows, i_h, ROWS: tl.constexpr):
    """The refreshed read copy of a flushed tile; ``ROWS`` (sketch mode): only for a dense head
    (``read_rows[h]`` = K) — a branch, not a row mask (which costs the token-by-token form twice
    the registers)."""
    if ROWS:
        if tl.load(read_rows + i_h) > 0:
            tl.store(p_r, S.to(p_r.dtype.element_ty))
    else:
        tl.store(p_r, S.to(p_r.dtype.element_ty))
