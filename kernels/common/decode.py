"""Triton decode kernels shared by the three families (a ``FAMILY`` constexpr picks the transition).

Serving API (per family, bound in ``kernels/<family>/decode.py``):

- :func:`standard_step`  read the fp32 state, update it, write it (the baseline);
- :func:`replay_step`    ReplaySSM non-flush step: read copy + buffer, no state write;
- :func:`sketch_step`    SketchSSM non-flush step: the sketch rows ``R_{:m} S_c`` + buffer +
  coefficient map (dense heads: the read copy);
- :func:`flush`          fold the buffered window exactly into the fp32 checkpoint, refresh the
  read copy rows and the sketch;
- :func:`spec_verify`    T draft tokens from checkpoint + buffer, outputs only.

Pool and input layouts are documented in ``pool.py``. Every entry point takes ``slots`` [B]
(int32, -1 = padding: that entry is skipped, its output row left as it was) and, for the window
kernels, ``pos`` [B] int32: the number of tokens already buffered for that slot since its last
flush. Nothing here synchronises with the host or allocates when ``out`` is given, so each call
can be captured in a CUDA graph; the engine keeps ``pos`` (spec decoding: accepting k drafts
advances it by k, rejected entries are overwritten later).

Every family keeps its checkpoint in the model's own frame, so the state is the model's exact
fp32 recurrence and no per-step rotation of k or q is needed. The sketch of a head of rank m is
the separate tensor ``R_{:m} S_c`` (m × V), written by the flush; a sketch read is
``(R_{:m} S_c)ᵀ (P u)`` with the head's model-frame map P.

Math per program (one slot, one head, one tile of BV value columns; n buffered tokens j < n,
``G = K_b K_bᵀ`` the buffer's Gram matrix, ``g_j = α_{j+1}⋯α_{n−1}``):

- step:  S ← A S + k wᵀ, with A S = d⊙S + k(−β kᵀ(d⊙S))ᵀ for the delta rules;
- read:  o = S_cᵀ u + Σ_j c_j w_j, u = M_pᵀ q. The new tokens are swept one by one; the buffer
  then in closed form. Mamba-2: c_j = g_j (k_j·q), u = g_{−1} q. GDN (Gram form): with
  z = (I + U)⁻¹ (K_b q), U_{ji} = β_i G_{ji} (i > j) — a back-substitution on n scalars —
  c_j = g_j z_j and u = g_{−1}(q − K_bᵀ(β⊙z)). KDA: the sequential sweep, which the other families
  can also use (``KernelConfig.chunked=False``: every family's default, faster on the H200).
- flush, token by token (``KernelConfig.chunked=False``; GDN's and KDA's default, faster on the
  H200): :func:`_forward` per buffered token on a [K, BV] tile, scalar decays riding in a separate
  scale (:func:`_forward_scaled`).
- flush, chunked on tensor cores (:func:`_flush_chunk_kernel`, on the tile ``Sᵀ`` [BV, K];
  Mamba-2's default):
  Mamba-2 ``S ← g_{−1} S + K_bᵀ (g⊙W)``; GDN (UT form) ``D = (I + L)⁻¹ (W − (β⊙γ) K_b S)``,
  ``L_{ji} = β_j (α_{i+1}⋯α_j) G_{ji}`` (j > i), ``S ← γ_n S + K_bᵀ (g⊙D)`` with γ_j = α_0⋯α_j;
  KDA the same with per-channel decays and the decayed Gram (:func:`_kda_decayed_gram`).
  ``(I + L)⁻¹`` is the product ``(I − L)(I + L²)(I + L⁴)(I + L⁸)`` (L is nilpotent). The new
  token of a flush call is applied after the chunk.
- flush, persistent Gluon kernels (``KernelConfig.pipelined``), which copy the next head's tiles
  while they fold the current one: Mamba-2's (:mod:`.flush_pipelined`, its default) and KDA's UT
  fold with the Gram on the FMA units and a forward substitution for D
  (``kernels/kda/flush_pipelined.py``).

Precision: the checkpoint stays an fp32 recurrence. Every tensor-core product that feeds it is
fp32-accurate: an fp32 tile split into three bf16 terms times bf16 keys (exact products, fp32
accumulation), two fp32 tiles split into three terms each (the six largest products), or 3xTF32;
products of decays are running products, never ratios (the token-by-token flush's scale is
folded in before its reciprocal passes 2⁶⁴), so nothing overflows. Only a bf16 or fp8 sketch is
written otherwise by the tensor-core flushes: the frame in two bf16 terms times the folded state
rounded to bf16 (:func:`sketch_terms`), then rounded to its dtype. KDA's reads from a bf16 read copy
or sketch take the buffered decays as bf16 log₂ (``DecodePool.buf_logdecay``: half the bytes of the
fp32 decays, a relative error of at most |log₂ of a product of decays| · 2⁻⁹ · ln 2 on it); the
flush always folds the fp32 decays.

Launch: on Hopper and later every kernel is a programmatic dependent launch (:func:`_dependent_launch`,
``USE_PDL``). With ``KernelConfig.prefetch`` a read or a token-by-token flush first asks L2 for the
buffered tokens it will read (:func:`_prefetch_buffer`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from sketchcal.kernels.common.pool import DecodePool, SketchTables, check_family, next_pow2
from sketchcal.kernels.common.recurrence import StepInputs

FAMILY_ID = {"mamba2": 0, "gdn": 1, "kda": 2}


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape: value columns per program and warps per program; ``chunked`` picks the
    closed forms over the buffer (read: Gram form for Mamba-2/GDN; flush: tensor-core chunk) over
    the token-by-token sweeps (KDA's read is always a sweep).

    - ``vec`` (token-by-token flush only; 0 = the compiler's choice) caps the value columns each
      thread holds of the [K, BV] tile: fewer columns per thread put more of each k·S reduction
      inside the thread (fewer shuffles) at the cost of more key rows per thread.
    - ``maxnreg`` (0 = the compiler's choice) caps the registers per thread, for more resident
      warps; what does not fit spills to local memory.
    - ``group`` (token-by-token reads; 0 = every buffer slot, unrolled) sweeps only the live
      buffered tokens, ``group`` per iteration of a rolled loop: less work on a short buffer, one
      load wait per group instead of one per read.
    - ``dense_rows`` (reads; 0 = all K at once) reads a dense head's read copy that many rows at a
      time: the [K, BV] tile otherwise sets the register count of the whole read kernel, the
      sketch heads' branch included.
    - ``early_map`` (sketch reads) loads a head's first 8 coefficient-map rows before the buffer
      sweep, so that their latency overlaps it; False loads them after it, with [8, K] fewer
      values live during the sweep.
    - ``prefetch`` (reads and the token-by-token flush, on a CUDA device) asks L2 for all the
      buffered tokens a program reads as it starts (``prefetch.global.L2``), so that its loop over
      them, which loads a token or a group ahead, finds them there rather than in DRAM. (The
      chunked flush loads its buffer tiles at once anyway.)
    - ``pipelined`` (Mamba-2 and KDA flushes, 0 = off) runs the flush as a persistent Gluon kernel
      on that many programs per SM (``num_warps`` each): Mamba-2's of :mod:`.flush_pipelined` and,
      for KDA with ``chunked``, the UT fold on tensor cores of ``kernels/kda/flush_pipelined.py``
      (4 or 8 warps; a tuning candidate, slower than the sweeps on the H200: BENCHMARKS.md,
      eleventh session) take whole heads (``block_v`` is ignored); without ``chunked``, KDA's
      token-by-token sweep with deferred decays of ``kernels/kda/flush_sweep.py`` (KDA's default)
      takes ``block_v`` value columns of a head at a time, 16 or 8 per warp. It needs a CUDA
      device, bf16 buffered inputs and a Triton with Gluon (:func:`gluon_available`); elsewhere
      (the CPU interpreter, fp32 inputs) the flush takes the chunked kernel, or with ``chunked``
      False the sweep (KDA's: ``SWEEP_FALLBACK``).
    - ``split`` (Mamba-2 sketch steps of one token, 0 = off) runs the read as two kernels
      (:mod:`.read_split`): programs of ``split`` warps compute every head's coefficients once
      per key group (and the group's dots, ``dots`` groups per program), then programs of
      ``num_warps`` warps and ``heads`` heads of one group sum each head's rows. ``dots`` = 0:
      the head kernel computes its group's dots itself, before it waits for the first kernel.
      ``heads`` and ``dots`` are powers of two, clipped to the largest that divides H/G and G.
      The split read needs the pool's ``workspace`` (``allocate_pool`` gives Mamba-2 sketch pools
      one); without it, and for T > 1 (``spec_verify``), the read takes the one-kernel form, for
      which ``maxnreg``, ``group`` and ``early_map`` stand (the two kernels take no register cap)."""

    block_v: int
    num_warps: int
    chunked: bool = True
    vec: int = 0
    maxnreg: int = 0
    group: int = 0
    dense_rows: int = 0
    early_map: bool = True
    prefetch: bool = False
    pipelined: int = 0
    split: int = 0
    heads: int = 1
    dots: int = 1

    def __post_init__(self) -> None:
        for name, zero_ok in (
            ("block_v", False),
            ("num_warps", False),
            ("dense_rows", True),
            ("split", True),
            ("heads", False),
            ("dots", True),
        ):
            n = getattr(self, name)
            if n < 0 or n & (n - 1) or (n == 0 and not zero_ok):
                allowed = "a power of two" + (" or 0" if zero_ok else "")
                raise ValueError(f"KernelConfig.{name} must be {allowed}, got {n}")
        if min(self.vec, self.maxnreg, self.group, self.pipelined) < 0:
            raise ValueError("KernelConfig.vec, maxnreg, group and pipelined must be ≥ 0")


# Defaults by (kernel, family); ``block_v`` is clipped to V: the fastest launch shapes on an H200 at
# batch 256 among ``bench.TUNE_CANDIDATES`` (BENCHMARKS.md, "Decode kernels"), checked there by the
# ``gpu`` tests with exactly these shapes. The token-by-token forms won everywhere but the Mamba-2
# flushes (on tensor cores, the persistent Gluon kernel of flush_pipelined: 3 programs per SM at 168
# registers); KDA's flushes are token by token in a persistent Gluon kernel (kda/flush_sweep.py: half
# a head per program of 4 warps, 3 programs per SM at 168 registers). Mamba-2's sketch read of one
# token is the split form of read_split (its spec_verify reads, the one-kernel form with the other
# fields). ``bench.run_bench(tune=True)`` re-picks them on another device.
DEFAULT_CONFIGS: dict[tuple[str, str], KernelConfig] = {
    ("standard", "mamba2"): KernelConfig(64, 4),
    ("standard", "gdn"): KernelConfig(64, 4),
    ("standard", "kda"): KernelConfig(64, 4),
    ("replay", "mamba2"): KernelConfig(64, 1, chunked=False, group=4, dense_rows=16),
    ("replay", "gdn"): KernelConfig(128, 1, chunked=False, group=4, dense_rows=16),
    ("replay", "kda"): KernelConfig(128, 1, group=4, dense_rows=16),
    ("sketch", "mamba2"): KernelConfig(
        64, 1, chunked=False, maxnreg=64, group=8, dense_rows=16, early_map=False, split=2, heads=4, dots=0
    ),
    ("sketch", "gdn"): KernelConfig(
        128, 1, chunked=False, maxnreg=64, group=6, dense_rows=16, early_map=False, prefetch=True
    ),
    ("sketch", "kda"): KernelConfig(128, 1, maxnreg=64, group=2, dense_rows=16, early_map=False),
    ("flush_replay", "mamba2"): KernelConfig(64, 4, maxnreg=168, pipelined=3),
    ("flush_replay", "gdn"): KernelConfig(16, 1, chunked=False, vec=2, prefetch=True),
    ("flush_replay", "kda"): KernelConfig(64, 4, chunked=False, maxnreg=168, pipelined=3),
    ("flush_sketch", "mamba2"): KernelConfig(64, 4, maxnreg=168, pipelined=3),
    ("flush_sketch", "gdn"): KernelConfig(16, 1, chunked=False, vec=2, prefetch=True),
    ("flush_sketch", "kda"): KernelConfig(64, 4, chunked=False, maxnreg=168, pipelined=3),
}

# The token-by-token flush a pool takes where a config asks for KDA's Gluon sweep and the pool's
# inputs are not bf16 or there is no GPU (KDA's Triton sweep default before the Gluon one)
SWEEP_FALLBACK = KernelConfig(16, 1, chunked=False, vec=4, maxnreg=128)

# Where an fp8 (e4m3) read copy is faster with another shape (tuned for it on the H200, BENCHMARKS.md:
# Mamba-2's replay read unrolled at 96 registers, 48.9 against 58.3 µs at batch 256; the other
# kernels' fp8 winners were within 2% of their bf16 defaults)
FP8_CONFIGS: dict[tuple[str, str], KernelConfig] = {
    ("replay", "mamba2"): KernelConfig(64, 1, chunked=False, maxnreg=96),
}

CHUNK_MIN = 16  # tl.dot needs at least 16 rows/columns: buffer tiles are padded to this


def sketch_terms(sketch_dtype: torch.dtype) -> int:
    """How the tensor-core flushes (chunked, and the Gluon ones of Mamba-2 and KDA) compute the sketch
    ``Sᵀ R_{:m}ᵀ`` stored in ``sketch_dtype`` (``_dot_ff``'s TERMS). fp32: both sides in three
    bf16 terms (exact to fp32 rounding), 3. bf16 or fp8: the folded state rounded to bf16 (what a
    bf16 read copy of it holds) times R in two terms, 1: about 1.5 times the error of storing the
    exact sketch in bf16 (BENCHMARKS.md, run 62: 1.6e-3 against 1.1e-3, relative), for 2 products
    instead of 3."""
    return 3 if sketch_dtype == torch.float32 else 1


def default_config(kernel: str, family: str, read_dtype: torch.dtype | None = None) -> KernelConfig:
    """The default launch shape of ``kernel`` for ``family`` with a read copy of ``read_dtype``
    (None: bf16)."""
    if read_dtype == torch.float8_e4m3fn and (kernel, family) in FP8_CONFIGS:
        return FP8_CONFIGS[(kernel, family)]
    return DEFAULT_CONFIGS[(kernel, family)]


# ----------------------------------------------------------------------------------------------
# Triton building blocks
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_token(
    k,
    w,
    decay,
    beta,
    k_off,
    w_off,
    h_off,
    o_k,
    o_v,
    live,
    K: tl.constexpr,
    V: tl.constexpr,
    FAMILY: tl.constexpr,
    LOG2_DECAY: tl.constexpr = False,
):
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
def _forward(S, kk, ww, dd, bb, FAMILY: tl.constexpr, KAXIS: tl.constexpr):
    """``A S + k wᵀ`` on an fp32 tile holding the key dimension on axis ``KAXIS``: [K, BV] (0, the
    sweeps) or [BV, K] (1, the tensor-core flush, whose tile is Sᵀ)."""
    # (the order of these ops is the one ptxas schedules best: KDA's token-by-token flush ran 5-20%
    # slower on the H200 with the key's broadcast hoisted above the decay)
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


# A window's decay product below this is folded into the tile (see _forward_scaled); KDA's chunked
# flush takes its scaled form while every running product of decays lies in [TINY, HUGE]
TINY = tl.constexpr(2.0**-64)
HUGE = tl.constexpr(2.0**64)


@triton.jit
def _forward_scaled(S, c, kk, ww, dd, bb, FAMILY: tl.constexpr):
    """:func:`_forward` for a scalar decay (Mamba-2, GDN) on a tile held as ``c Ŝ``: returns the
    new (Ŝ, c).

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
        S = S + kk[:, None] * (ww * r)[None, :]
    else:
        ks = tl.sum(S * kk[:, None], axis=0)
        S = S + kk[:, None] * (ww * r - bb * ks)[None, :]
    return S, c


@triton.jit
def _backward(v, c, kk, dd, bb, FAMILY: tl.constexpr):
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
def _sweep_buffered(
    v,
    c,
    acc,
    k_g,
    w_h,
    decay_h,
    beta_h,
    j,
    live,
    o_k,
    o_v,
    K: tl.constexpr,
    V: tl.constexpr,
    FAMILY: tl.constexpr,
    LOG2_DECAY: tl.constexpr,
):
    """One buffered token ``j`` of a read's backward sweep (``live`` False: the identity) on the
    query ``c v̂`` (see :func:`_backward`): returns it pushed past the token, and ``acc`` plus the
    token's w's share of the output. ``k_g``, ``w_h``, ``decay_h``, ``beta_h`` point at the entry
    of this group's / head's buffer that ``j`` counts from (entry 0, or a group's newest token with
    ``j`` ≤ 0), so a token costs a 32-bit offset per pointer rather than 64-bit address
    arithmetic. ``LOG2_DECAY``: ``decay_h`` points at log₂ of the decays (:func:`_load_token`)."""
    kk, ww, dd, bb = _load_token(
        k_g,
        w_h,
        decay_h,
        beta_h,
        j * K,
        j * V,
        j,
        o_k,
        o_v,
        live,
        K,
        V,
        FAMILY,
        LOG2_DECAY,
    )
    kv, v, c = _backward(v, c, kk, dd, bb, FAMILY)
    return v, c, acc + kv * ww


@triton.jit
def _step_emit(
    S,
    q,
    k,
    w,
    decay,
    beta,
    skip,
    out,
    x_t,
    i_h,
    i_g,
    o_k,
    o_v,
    live,
    H: tl.constexpr,
    G: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    FAMILY: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    KAXIS: tl.constexpr,
):
    """Apply input token ``x_t`` to the fp32 tile S (key dimension on axis ``KAXIS``, as in
    :func:`_forward`) and store its output ``Sᵀq (+ skip)`` [BV]."""
    kk, ww, dd, bb = _load_token(
        k,
        w,
        decay,
        beta,
        (x_t * G + i_g) * K,
        (x_t * H + i_h) * V,
        x_t * H + i_h,
        o_k,
        o_v,
        live,
        K,
        V,
        FAMILY,
    )
    S = _forward(S, kk, ww, dd, bb, FAMILY, KAXIS)
    qq = tl.load(q + (x_t * G + i_g) * K + o_k).to(tl.float32)
    o = tl.sum(S * tl.expand_dims(qq, 1 - KAXIS), axis=KAXIS)
    if HAS_SKIP:
        o += tl.load(skip + (x_t * H + i_h) * V + o_v).to(tl.float32)
    tl.store(out + (x_t * H + i_h) * V + o_v, o.to(out.dtype.element_ty))
    return S


@triton.jit
def _bdot(a, b, acc, EMULATE: tl.constexpr):
    """``acc + a @ b`` for bf16 tiles with fp32 accumulation. ``EMULATE`` (the CPU interpreter,
    whose bf16 dot is wrong) multiplies the same bf16 values as fp32."""
    if EMULATE:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _split_bf16(a, TERMS: tl.constexpr):
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
def _dot_fk(a, b, acc, B_BF16: tl.constexpr, EMULATE: tl.constexpr):
    """``acc + a @ b`` on tensor cores, accurate to ~fp32 rounding, for an fp32 ``a`` and keys
    ``b``.

    ``B_BF16``: ``a`` is split into three bf16 terms, each multiplied exactly by the bf16 keys
    with fp32 accumulation (three bf16 passes; the terms come straight from an MMA accumulator
    tile without a trip through shared memory). Otherwise 3xTF32."""
    if B_BF16:
        # largest term first, each used as soon as it is made (fewer values live at once)
        a1 = a.to(tl.bfloat16)
        acc = _bdot(a1, b, acc, EMULATE)
        rest = a - a1.to(tl.float32)
        a2 = rest.to(tl.bfloat16)
        acc = _bdot(a2, b, acc, EMULATE)
        acc = _bdot((rest - a2.to(tl.float32)).to(tl.bfloat16), b, acc, EMULATE)
    else:
        acc = tl.dot(a, b.to(tl.float32), acc, input_precision="tf32x3")
    return acc


@triton.jit
def _dot_ff(a, b, acc, TERMS: tl.constexpr, EMULATE: tl.constexpr):
    """``acc + a @ b`` for two fp32 tiles, each split into ``TERMS`` bf16 terms: the products of
    terms weighing at least 2⁻⁸⁽ᵀᴱᴿᴹˢ⁻¹⁾ (3 of them for 2 terms, ~16 bits; 6 for 3, ~fp32
    rounding), smallest first. ``TERMS`` = 1: ``a`` rounded to bf16, ``b`` in two terms, so the
    product of bf16(a) and b to ~16 bits (:func:`sketch_terms`: a sketch stored in bf16 or fp8)."""
    SPLIT: tl.constexpr = 3 if TERMS == 3 else 2
    a1, a2, a3 = _split_bf16(a, SPLIT)
    b1, b2, b3 = _split_bf16(b, SPLIT)
    if TERMS == 3:
        acc = _bdot(a3, b1, acc, EMULATE)
        acc = _bdot(a2, b2, acc, EMULATE)
        acc = _bdot(a1, b3, acc, EMULATE)
    if TERMS > 1:
        acc = _bdot(a2, b1, acc, EMULATE)
    acc = _bdot(a1, b2, acc, EMULATE)
    return _bdot(a1, b1, acc, EMULATE)


@triton.jit
def _gram(kb, A_BF16: tl.constexpr, EMULATE: tl.constexpr):
    """``K_b K_bᵀ`` [BC, BC] of a [BC, K] key tile (exact products for bf16 keys)."""
    if A_BF16:
        gram = _bdot(kb, tl.trans(kb), tl.zeros((kb.shape[0], kb.shape[0]), dtype=tl.float32), EMULATE)
    else:
        k32 = kb.to(tl.float32)
        gram = tl.dot(k32, tl.trans(k32), input_precision="tf32x3")
    return gram


@triton.jit
def _unit_triangular_inverse(low, o_c, LOG2_BC: tl.constexpr):
    """``(I + L)⁻¹`` for a strictly triangular [BC, BC] ``L``, lower or upper (nilpotent,
    ``L^BC = 0``): ``(I − L)(I + L²)(I + L⁴)⋯``, ``log2(BC) − 1`` squarings, 3xTF32 dots."""
    inv = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0) - low
    pw = low
    for _ in tl.static_range(LOG2_BC - 1):
        pw = tl.dot(pw, pw, input_precision="tf32x3")
        inv = tl.dot(inv, pw, inv, input_precision="tf32x3")
    return inv


@triton.jit
def _dense_read(v, rd_h, o_k, o_v, V: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr):
    """``S_cᵀ v`` [BV] from the read copy of one head. ``ROWS`` > 0: ROWS rows at a time (a rolled
    loop; each block's share of ``v`` is gathered from registers), so a [ROWS, BV] tile is live
    instead of [K, BV]."""
    if ROWS == 0:
        rc = tl.load(rd_h + o_k[:, None] * V + o_v[None, :]).to(tl.float32)
        o = tl.sum(rc * v[:, None], axis=0)
    else:
        o_b = tl.arange(0, ROWS)
        o = tl.zeros([o_v.shape[0]], dtype=tl.float32)
        for k0 in range(0, K, ROWS):
            rc = tl.load(rd_h + (k0 + o_b)[:, None] * V + o_v[None, :]).to(tl.float32)
            o += tl.sum(rc * tl.gather(v, k0 + o_b, 0)[:, None], axis=0)
    return o


@triton.jit
def _first_map_rows(maps, i_h, o_k, K: tl.constexpr, M: tl.constexpr):
    """The first 8 rows of head ``i_h``'s coefficient map [8, K] (rows past the table's M: 0)."""
    o_r = tl.arange(0, 8)
    return tl.load(maps + (i_h * M + o_r[:, None]) * K + o_k[None, :], mask=o_r[:, None] < M, other=0.0)


@triton.jit
def _checkpoint_read(
    v,
    rd_h,
    sk_h,
    m,
    pm0,
    st0,
    maps,
    i_h,
    o_k,
    o_v,
    K: tl.constexpr,
    V: tl.constexpr,
    M: tl.constexpr,
    SKETCH: tl.constexpr,
    ROWS: tl.constexpr,
    EARLY_MAP: tl.constexpr,
):
    """``S_cᵀ u`` from the read copy, or ``(R_{:m} S_c)ᵀ (P u)`` for a head of rank m > 0.

    ``pm0`` [8, K] and ``st0`` [8, BV] are the first 8 map and sketch rows, loaded by the caller
    before the buffer work so that their latency overlaps it (``pm0`` only if ``EARLY_MAP``: else
    it is loaded here); rows past 8 follow in chunks of 8 (registers do not grow with the largest
    rank)."""
    if SKETCH:
        if m > 0:
            if not EARLY_MAP:
                pm0 = _first_map_rows(maps, i_h, o_k, K, M)
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
            o = _dense_read(v, rd_h, o_k, o_v, V, K, ROWS)
    else:
        o = _dense_read(v, rd_h, o_k, o_v, V, K, ROWS)
    return o


@triton.jit
def _buffer_tiles(
    buf_k,
    buf_w,
    buf_decay,
    hb,
    gb,
    n,
    o_c,
    o_k,
    o_v,
    K: tl.constexpr,
    V: tl.constexpr,
):
    """The first ``n`` buffered tokens of one head as tiles (rows ≥ n: identity tokens).

    Returns ``kb`` [BC, K] (the buffer's dtype), ``wb`` [BC, BV] (fp32), ``al`` [BC] (decay, 1
    past n), ``g`` [BC] with ``g_j = α_{j+1}⋯α_{n−1}`` (the decay from after token j to the end)
    and the whole window's decay ``α_0⋯α_{n−1}``; Mamba-2 and GDN (scalar decays)."""
    live = o_c[:, None] < n
    kb = tl.load(buf_k + (gb + o_c[:, None]) * K + o_k[None, :], mask=live, other=0.0)
    wb = tl.load(buf_w + (hb + o_c[:, None]) * V + o_v[None, :], mask=live, other=0.0).to(tl.float32)
    al = tl.load(buf_decay + hb + o_c, mask=o_c < n, other=1.0).to(tl.float32)
    al_next = tl.load(buf_decay + hb + o_c + 1, mask=o_c + 1 < n, other=1.0).to(tl.float32)
    g, total = _decay_products(al, al_next, o_c == 0, 0)
    return kb, wb, al, g, total


@triton.jit
def _entry_slot(slots, pos, i_b):
    """Batch entry ``i_b``'s (live, slot, buffered tokens): a padding entry (negative slot) reads
    slot 0 with an empty buffer, and its stores are masked by ``live``."""
    s_in = tl.load(slots + i_b)
    live = s_in >= 0
    return live, tl.maximum(s_in, 0).to(tl.int64), tl.where(live, tl.load(pos + i_b), 0)


@triton.jit
def _decay_products(al, al_next, first, AXIS: tl.constexpr):
    """Scalar decays of buffered tokens along ``AXIS``: from ``al`` (α_j, 1 past the n buffered) and
    ``al_next`` (α_{j+1}, 1 past n − 1), ``g_j = α_{j+1}⋯α_{n−1}`` and the whole window's
    ``α_0⋯α_{n−1}`` (``first``: where j = 0)."""
    g = tl.cumprod(al_next, AXIS, reverse=True)
    return g, tl.sum(tl.where(first, g * al, 0.0), axis=AXIS)


@triton.jit
def _kda_decayed_gram(buf_k, buf_decay, hb, gb, n, o_c, o_k, BC: tl.constexpr, K: tl.constexpr):
    """KDA: ``h[i, j] = H_{ji} = Σ_c k_j k_i α_{i+1}⋯α_j`` (j > i; 0 elsewhere) [BC, BC] over the
    first ``n`` buffered tokens, by a running product (never a ratio, so no decay overflows): row i
    of ``dec`` holds ``k_i ⊙ α_{i+1}⋯α_j`` after token j's decay."""
    dec = tl.zeros((BC, K), dtype=tl.float32)
    h = tl.zeros((BC, BC), dtype=tl.float32)
    for j in range(0, n):
        k_j = tl.load(buf_k + (gb + j) * K + o_k).to(tl.float32)
        dec = dec * tl.load(buf_decay + (hb + j) * K + o_k).to(tl.float32)[None, :]
        h = tl.where(o_c[None, :] == j, tl.sum(dec * k_j[None, :], axis=1)[:, None], h)
        dec = tl.where(o_c[:, None] == j, k_j[None, :], dec)
    return h


@triton.jit
def _dependent_launch(PDL: tl.constexpr):
    """Programmatic dependent launch (``PDL``, Hopper and later): wait until the previous kernel
    in the stream has finished and its writes are visible, then let the next one launch. Its
    programs then become resident while this kernel's last ones run, and wait here in turn: the
    launch gap between consecutive decode kernels is hidden. First thing in every kernel, before
    any load: every input may come from the kernel before."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _prefetch_l2(p):
    """``prefetch.global.L2`` of the 128-byte lines holding the addresses ``p`` (a hint: nothing is
    loaded into registers)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [p], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _prefetch_buffer(
    buf_k,
    buf_w,
    buf_decay,
    buf_beta,
    hb,
    gb,
    n,
    w_col,
    K: tl.constexpr,
    V: tl.constexpr,
    WCOLS: tl.constexpr,
    C: tl.constexpr,
    FAMILY: tl.constexpr,
):
    """Ask L2 for the first ``n`` entries of a slot's buffer, all at once (``KernelConfig.prefetch``):
    the group's keys [n, K] and the head's decays (contiguous), its betas, and columns
    [w_col, w_col + WCOLS) of its w's [n, V]. Lanes past ``n`` repeat entry 0."""
    KL: tl.constexpr = 128 // (buf_k.dtype.element_ty.primitive_bitwidth // 8)  # keys per line
    o = tl.arange(0, C * K // KL) * KL
    _prefetch_l2(buf_k + gb * K + tl.where(o < n * K, o, 0))
    WL: tl.constexpr = 128 // (buf_w.dtype.element_ty.primitive_bitwidth // 8)
    PER_ROW: tl.constexpr = WCOLS // WL if WCOLS >= WL else 1  # lines per entry
    o = tl.arange(0, C * PER_ROW)
    row = tl.where(o // PER_ROW < n, o // PER_ROW, 0)
    _prefetch_l2(buf_w + (hb + row) * V + w_col + (o % PER_ROW) * WL)
    if FAMILY == 2:
        DL: tl.constexpr = 128 // (buf_decay.dtype.element_ty.primitive_bitwidth // 8)
        o = tl.arange(0, C * K // DL) * DL
        _prefetch_l2(buf_decay + hb * K + tl.where(o < n * K, o, 0))
    else:
        _prefetch_l2(buf_decay + hb + tl.arange(0, 1))
    if FAMILY != 0:
        _prefetch_l2(buf_beta + hb + tl.arange(0, 1))


# ----------------------------------------------------------------------------------------------
# Kernels. Grid: (V // BV, H, B).
# ----------------------------------------------------------------------------------------------


@triton.jit
def _standard_kernel(
    state,
    slots,
    q,
    k,
    w,
    decay,
    beta,
    skip,
    out,
    T: tl.constexpr,
    H: tl.constexpr,
    G: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    FAMILY: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    PDL: tl.constexpr,
):
    _dependent_launch(PDL)
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    s = tl.load(slots + i_b).to(tl.int64)
    if s < 0:
        return
    i_g = i_h // (H // G)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    p_s = state + (s * H + i_h) * (K * V) + o_k[:, None] * V + o_v[None, :]
    S = tl.load(p_s, eviction_policy="evict_first")
    live = s >= 0
    for t in tl.static_range(T):
        x_t = i_b * T + t
        S = _step_emit(
            S, q, k, w, decay, beta, skip, out, x_t, i_h, i_g, o_k, o_v, live, H, G, K, V, FAMILY, HAS_SKIP, 0
        )
    tl.store(p_s, S, eviction_policy="evict_first")


@triton.jit
def _read_kernel(
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
    buf_logdecay,
    rd,
    sk,
    ranks,
    maps,
    sk_head_stride,
    T: tl.constexpr,
    H: tl.constexpr,
    G: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    BC: tl.constexpr,
    M: tl.constexpr,
    FAMILY: tl.constexpr,
    SKETCH: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    K_BF16: tl.constexpr,
    EMULATE: tl.constexpr,
    CHUNKED: tl.constexpr,
    GROUP: tl.constexpr,
    DENSE_ROWS: tl.constexpr,
    EARLY_MAP: tl.constexpr,
    PREFETCH: tl.constexpr,
    LOG2_DECAY: tl.constexpr,
    PDL: tl.constexpr,
):
    """The reads (replay, sketch, spec_verify). ``LOG2_DECAY`` (KDA): the buffered decays are read
    as log₂ in bf16 from ``buf_logdecay`` (half the bytes; the flush keeps the fp32 ones), which
    each appended token also gets."""
    _dependent_launch(PDL)
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
    live, s, p = _entry_slot(slots, pos, i_b)
    m = tl.load(ranks + i_h) if SKETCH else 0
    x0 = i_b * T
    k0, w0, d0, b0 = _load_token(
        k,
        w,
        decay,
        beta,
        (x0 * G + i_g) * K,
        (x0 * H + i_h) * V,
        x0 * H + i_h,
        o_k,
        o_v,
        i_b >= 0,
        K,
        V,
        FAMILY,
    )
    q0 = tl.load(q + (x0 * G + i_g) * K + o_k).to(tl.float32)
    if SKETCH and EARLY_MAP:
        pm0 = _first_map_rows(maps, i_h, o_k, K, M)
    else:
        pm0 = tl.zeros([8, K], dtype=tl.float32)
    sk_h = sk + (s * H + i_h) * sk_head_stride
    if SKETCH:
        # the first 8 sketch rows, in flight while the buffer is worked through
        st0 = tl.load(sk_h + o_r8[:, None] * V + o_v[None, :], mask=o_r8[:, None] < m, other=0.0)
    else:
        st0 = tl.zeros([8, BV], dtype=tl.float32)
    hb = (s * H + i_h) * C  # this head's first buffer entry
    gb = (s * G + i_g) * C  # this group's first buffer entry
    read_decays = buf_logdecay if LOG2_DECAY else buf_decay  # the buffered decays as the sweep reads them
    if PREFETCH:
        _prefetch_buffer(buf_k, buf_w, read_decays, buf_beta, hb, gb, p, i_v * BV, K, V, BV, C, FAMILY)
    # append the T new tokens at p, p+1, ...: each program writes its w tile; the first tile writes
    # decay and beta, and the first head of the group its k. Reads below touch entries < p only.
    for t in tl.static_range(T):
        jw = p + t
        ok = (jw < C) & live
        x_t = i_b * T + t
        if t == 0:
            k_new, w_new, d_new, b_new = k0, w0, d0, b0
        else:
            k_new, w_new, d_new, b_new = _load_token(
                k,
                w,
                decay,
                beta,
                (x_t * G + i_g) * K,
                (x_t * H + i_h) * V,
                x_t * H + i_h,
                o_k,
                o_v,
                live,
                K,
                V,
                FAMILY,
            )
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
    rd_h = rd + (s * H + i_h) * (K * V)
    # entry 0 of this group's / head's buffer (the sweeps add 32-bit token offsets)
    DS: tl.constexpr = K if FAMILY == 2 else 1  # decay entries per token
    k_g = buf_k + gb * K
    w_h = buf_w + hb * V
    decay_h = read_decays + hb * DS
    beta_h = buf_beta + hb
    o_c = tl.arange(0, BC)
    if FAMILY != 2 and CHUNKED:
        # the buffered tokens j < p, loaded once as tiles; everything but K_b q is shared by the
        # T reads of this call
        kb, wb, _al, g, total = _buffer_tiles(buf_k, buf_w, buf_decay, hb, gb, p, o_c, o_k, o_v, K, V)
        if FAMILY == 1:
            bt = tl.load(buf_beta + hb + o_c, mask=o_c < p, other=0.0).to(tl.float32)
            # U_{ji} = β_i G_{ji} for i > j: the back-substitution z = (I + U)⁻¹ K_b q
            upper = tl.where(o_c[None, :] > o_c[:, None], _gram(kb, K_BF16, EMULATE) * bt[None, :], 0.0)
    for t in tl.static_range(T):
        x_t = i_b * T + t
        if t == 0:  # noqa: SIM108  (a constexpr branch: the other side is never compiled)
            v = q0
        else:
            v = tl.load(q + (x_t * G + i_g) * K + o_k).to(tl.float32)
        acc = tl.zeros([BV], dtype=tl.float32)
        c = tl.full([], 1.0, tl.float32)  # the query is c v (_backward)
        # the new tokens t..0, one by one
        for i in tl.static_range(T):
            d = T - 1 - i
            if d <= t:
                x_d = i_b * T + d
                if d == 0:
                    kk, ww, dd, bb = k0, w0, d0, b0
                else:
                    kk, ww, dd, bb = _load_token(
                        k,
                        w,
                        decay,
                        beta,
                        (x_d * G + i_g) * K,
                        (x_d * H + i_h) * V,
                        x_d * H + i_h,
                        o_k,
                        o_v,
                        live,
                        K,
                        V,
                        FAMILY,
                    )
                kv, v, c = _backward(v, c, kk, dd, bb, FAMILY)
                acc += kv * ww
        if (FAMILY == 2 or not CHUNKED) and GROUP == 0:
            # the buffered tokens C-1..0 unrolled, dead ones (≥ p) as identities: every load issues
            # up front (the faster form at ~160 registers; at 64-80 the groups below win)
            for i in tl.static_range(C):
                j = C - 1 - i
                v, c, acc = _sweep_buffered(
                    v,
                    c,
                    acc,
                    k_g,
                    w_h,
                    decay_h,
                    beta_h,
                    j,
                    j < p,
                    o_k,
                    o_v,
                    K,
                    V,
                    FAMILY,
                    LOG2_DECAY,
                )
        elif FAMILY == 2 or not CHUNKED:
            # the live tokens p-1..0, GROUP per iteration (the group's loads issue together). The
            # pointers step back GROUP tokens per iteration, so a group's tokens sit at constant
            # offsets from them. The last group runs past token 0 with identities (masked loads:
            # their addresses are never dereferenced).
            k_j, w_j = k_g + (p - 1) * K, w_h + (p - 1) * V
            decay_j, beta_j = decay_h + (p - 1) * DS, beta_h + (p - 1)
            for j0 in range(0, p, GROUP):
                for i in tl.static_range(GROUP):
                    v, c, acc = _sweep_buffered(
                        v,
                        c,
                        acc,
                        k_j,
                        w_j,
                        decay_j,
                        beta_j,
                        -i,
                        i < p - j0,
                        o_k,
                        o_v,
                        K,
                        V,
                        FAMILY,
                        LOG2_DECAY,
                    )
                k_j, w_j = k_j - GROUP * K, w_j - GROUP * V
                decay_j, beta_j = decay_j - GROUP * DS, beta_j - GROUP
        else:
            v = v * c  # the closed form takes the query itself; its scale is the window's decay
            z = tl.sum(kb.to(tl.float32) * v[None, :], axis=1)  # K_b q
            if FAMILY == 1:
                for i in range(0, p):
                    j = p - 1 - i
                    z_j = tl.sum(tl.where(o_c == j, z, 0.0), axis=0)
                    col = tl.sum(tl.where(o_c[None, :] == j, upper, 0.0), axis=1)
                    z = z - col * z_j  # rows < j only: z_j itself is final
                v = v - tl.sum((bt * z)[:, None] * kb.to(tl.float32), axis=0)
            acc += tl.sum((g * z)[:, None] * wb, axis=0)
            c = total
        o = acc + _checkpoint_read(
            v * c,
            rd_h,
            sk_h,
            m,
            pm0,
            st0,
            maps,
            i_h,
            o_k,
            o_v,
            K,
            V,
            M,
            SKETCH,
            DENSE_ROWS,
            EARLY_MAP,
        )
        if HAS_SKIP:
            o += tl.load(skip + (x_t * H + i_h) * V + o_v).to(tl.float32)
        tl.store(out + (x_t * H + i_h) * V + o_v, o.to(out.dtype.element_ty), mask=o_v < tl.where(live, V, 0))


@triton.jit
def _store_read_copy(S, p_r, read_rows, i_h, ROWS: tl.constexpr):
    """The refreshed read copy of a flushed tile; ``ROWS`` (sketch mode): only for a dense head
    (``read_rows[h]`` = K) — a branch, not a row mask (which costs the token-by-token form twice
    the registers)."""
    if ROWS:
        if tl.load(read_rows + i_h) > 0:
            tl.store(p_r, S.to(p_r.dtype.element_ty))
    else:
        tl.store(p_r, S.to(p_r.dtype.element_ty))


@triton.jit
def _flush_kernel(
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
    H: tl.constexpr,
    G: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    FAMILY: tl.constexpr,
    HAS_X: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    HAS_READ: tl.constexpr,
    ROWS: tl.constexpr,
    SKETCH_OUT: tl.constexpr,
    VEC: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    """The token-by-token flush on [K, BV] tiles of S (any family); ``PREFETCH``: see
    ``KernelConfig.prefetch``."""
    _dependent_launch(PDL)
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
    if VEC > 0:
        # a true (smaller) contiguity bound: the tile's layout then gives each thread VEC columns
        o_v = tl.max_contiguous(o_v, VEC)
    live = s >= 0
    hb = (s * H + i_h) * C
    gb = (s * G + i_g) * C
    p_s = state + (s * H + i_h) * (K * V) + o_k[:, None] * V + o_v[None, :]
    if PREFETCH:
        _prefetch_buffer(buf_k, buf_w, buf_decay, buf_beta, hb, gb, n, i_v * BV, K, V, BV, C, FAMILY)
    S = tl.load(p_s, eviction_policy="evict_first")
    # a rolled loop (an unrolled one overflows the instruction cache: ncu showed 59% of the
    # stalls waiting for instructions) that loads token j + 1 while token j is applied (two
    # ahead was slower on the H200); scalar decays go into a separate scale
    # (_forward_scaled), applied once at the end
    kk, ww, dd, bb = _load_token(
        buf_k,
        buf_w,
        buf_decay,
        buf_beta,
        gb * K,
        hb * V,
        hb,
        o_k,
        o_v,
        n > 0,
        K,
        V,
        FAMILY,
    )
    scale = dd * 0.0 + 1.0  # Mamba-2, GDN: the decay product so far (KDA: unused)
    for j in range(0, n):
        kn, wn, dn, bn = _load_token(
            buf_k,
            buf_w,
            buf_decay,
            buf_beta,
            (gb + j + 1) * K,
            (hb + j + 1) * V,
            hb + j + 1,
            o_k,
            o_v,
            j + 1 < n,
            K,
            V,
            FAMILY,
        )
        if FAMILY == 2:  # per-channel decays go straight into the tile
            S = _forward(S, kk, ww, dd, bb, FAMILY, 0)
        else:
            S, scale = _forward_scaled(S, scale, kk, ww, dd, bb, FAMILY)
        kk, ww, dd, bb = kn, wn, dn, bn
    if FAMILY != 2:
        S = S * scale
    if HAS_X:
        S = _step_emit(
            S, q, k, w, decay, beta, skip, out, i_b, i_h, i_g, o_k, o_v, live, H, G, K, V, FAMILY, HAS_SKIP, 0
        )
    tl.store(p_s, S, eviction_policy="evict_first")
    if HAS_READ:
        p_r = rd + (s * H + i_h) * (K * V) + o_k[:, None] * V + o_v[None, :]
        _store_read_copy(S, p_r, read_rows, i_h, ROWS)
    if SKETCH_OUT:
        m = tl.load(ranks + i_h)
        sk_h = sk + (s * H + i_h) * sk_head_stride
        fr_g = frames + i_g * K * K  # R of this head's group, [K, K]
        # row by row on the FMA units: the sweep's tile layout is not a tensor-core operand's,
        # and converting it costs more than the m reductions over K. Row r + 1 of R is loaded
        # while row r is applied.
        rrow = tl.load(fr_g + o_k, mask=o_k < tl.where(m > 0, K, 0), other=0.0)
        for r in range(0, m):
            rnext = tl.load(fr_g + (r + 1) * K + o_k, mask=o_k < tl.where(r + 1 < m, K, 0), other=0.0)
            tl.store(sk_h + r * V + o_v, tl.sum(S * rrow[:, None], axis=0).to(sk.dtype.element_ty))
            rrow = rnext


@triton.jit
def _flush_chunk_kernel(
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
    H: tl.constexpr,
    G: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    BC: tl.constexpr,
    LOG2_BC: tl.constexpr,
    FAMILY: tl.constexpr,
    HAS_X: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    HAS_READ: tl.constexpr,
    ROWS: tl.constexpr,
    SKETCH_OUT: tl.constexpr,
    K_BF16: tl.constexpr,
    SKETCH_TERMS: tl.constexpr,
    EMULATE: tl.constexpr,
    PDL: tl.constexpr,
):
    """The chunked flush on tensor cores. The tile is ``Sᵀ`` [BV, K]: it is the accumulator of the
    update and, split into bf16 terms, the left operand of every product, so it never leaves the
    MMA register layout; the keys and R rows are the right operands."""
    _dependent_launch(PDL)
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
    o_c = tl.arange(0, BC)
    live = s >= 0
    hb = (s * H + i_h) * C
    gb = (s * G + i_g) * C
    p_s = state + (s * H + i_h) * (K * V) + o_k[None, :] * V + o_v[:, None]
    St = tl.load(p_s, eviction_policy="evict_first")
    # a product with zero operands puts the tile in the MMA accumulator layout right after the
    # load (Triton folds the product itself away): every bf16 split below then reaches its product
    # from registers. Without it the loaded tile went to two layouts, each through shared memory.
    St = tl.dot(tl.zeros((BV, 16), dtype=tl.bfloat16), tl.zeros((16, K), dtype=tl.bfloat16), St)
    kb = tl.load(buf_k + (gb + o_c[:, None]) * K + o_k[None, :], mask=o_c[:, None] < n, other=0.0)
    wt = tl.load(buf_w + (hb + o_c[None, :]) * V + o_v[:, None], mask=o_c[None, :] < n, other=0.0)
    wt = wt.to(tl.float32)  # Wᵀ [BV, BC]
    upper = o_c[None, :] > o_c[:, None]
    if FAMILY == 2:
        # S ← B_{n−1} ⊙ S + (K_b ⊙ ρ)ᵀ D, D = (I + L)⁻¹ (W − β ⊙ (K_b ⊙ B) S), L = β ⊙ H (j > i):
        # B_j = α_0⋯α_j and ρ_i = α_{i+1}⋯α_{n−1} per channel, H the decayed Gram
        k32 = kb.to(tl.float32)
        live_c = o_c[:, None] < n
        al = tl.load(buf_decay + (hb + o_c[:, None]) * K + o_k[None, :], mask=live_c, other=1.0)
        al_next = tl.load(
            buf_decay + (hb + o_c[:, None] + 1) * K + o_k[None, :], mask=o_c[:, None] + 1 < n, other=1.0
        )
        al, al_next = al.to(tl.float32), al_next.to(tl.float32)
        bt = tl.load(buf_beta + hb + o_c, mask=o_c < n, other=0.0).to(tl.float32)
        gam = tl.cumprod(al, 0)  # B_j
        total = tl.sum(tl.where(o_c[:, None] == BC - 1, gam, 0.0), axis=0)  # B_{n−1} [K]
        if (tl.min(tl.min(gam, axis=1), axis=0) >= TINY) & (tl.max(tl.max(gam, axis=1), axis=0) <= HUGE):
            # the decays deferred into the running products (kda/flush_sweep.py's scaled sweep, as one
            # chunk): with S = Diag(B_j) Ŝ, token j is d_j = w_j − Ŝᵀ a_j, Ŝ ← Ŝ + u_j d_jᵀ for a_j =
            # β_j B_j ⊙ k_j and u_j = k_j / B_j, so D = (I + L)⁻¹ (W − A Ŝ) with L_{ji} = a_j · u_i
            # (j > i) and S ← Diag(B_{n−1}) (Ŝ + Uᵀ D): no decayed Gram, no per-token decay terms
            a = bt[:, None] * gam * k32
            u = k32 / gam
            low_t = tl.where(upper, tl.dot(u, tl.trans(a), input_precision="tf32x3"), 0.0)  # Lᵀ
            xt = tl.dot(St, tl.trans(a), input_precision="tf32x3")
            inv_t = _unit_triangular_inverse(low_t, o_c, LOG2_BC)  # (I + L)⁻ᵀ
            dt = tl.dot(wt - xt, inv_t, input_precision="tf32x3")
            St = tl.dot(dt, u, St, input_precision="tf32x3") * total[None, :]
        else:  # running products out of range (an underflow, a zero decay): per-channel decay terms
            rho = tl.cumprod(al_next, 0, reverse=True)
            h = _kda_decayed_gram(buf_k, buf_decay, hb, gb, n, o_c, o_k, BC, K)
            low_t = tl.where(upper, bt[None, :] * h, 0.0)  # Lᵀ
            xt = _dot_ff(St, tl.trans(k32 * gam), tl.zeros((BV, BC), dtype=tl.float32), 3, EMULATE)
            inv_t = _unit_triangular_inverse(low_t, o_c, LOG2_BC)  # (I + L)⁻ᵀ
            dt = tl.dot(wt - xt * bt[None, :], inv_t, input_precision="tf32x3")
            St = _dot_ff(dt, k32 * rho, St * total[None, :], 3, EMULATE)
    else:
        # Mamba-2: S ← g_{−1} S + K_bᵀ (g ⊙ W); GDN (UT form): W replaced by
        # D = (I + L)⁻¹ (W − (β⊙γ) K_b S), L_{ji} = β_j (α_{i+1}⋯α_j) G_{ji} (j > i), γ_j = α_0⋯α_j
        al = tl.load(buf_decay + hb + o_c, mask=o_c < n, other=1.0).to(tl.float32)
        al_next = tl.load(buf_decay + hb + o_c + 1, mask=o_c + 1 < n, other=1.0).to(tl.float32)
        g = tl.cumprod(al_next, 0, reverse=True)  # α_{j+1}⋯α_{n−1}
        total = tl.sum(tl.where(o_c == 0, g * al, 0.0), axis=0)
        if FAMILY == 1:
            bt = tl.load(buf_beta + hb + o_c, mask=o_c < n, other=0.0).to(tl.float32)
            # Lᵀ: α_{i+1}⋯α_j at [i, j] (j > i), a running product along the row
            ratio_t = tl.cumprod(tl.where(upper, al[None, :], 1.0), 1)
            low_t = tl.where(upper, (bt[None, :] * ratio_t) * _gram(kb, K_BF16, EMULATE), 0.0)
            xt = _dot_fk(St, tl.trans(kb), tl.zeros((BV, BC), dtype=tl.float32), K_BF16, EMULATE)
            zt = wt - xt * (bt * tl.cumprod(al, 0))[None, :]
            inv_t = _unit_triangular_inverse(low_t, o_c, LOG2_BC)  # (I + L)⁻ᵀ
            wt = tl.dot(zt, inv_t, input_precision="tf32x3")  # Dᵀ
        St = _dot_fk(wt * g[None, :], kb, St * total, K_BF16, EMULATE)
    if HAS_X:
        St = _step_emit(
            St,
            q,
            k,
            w,
            decay,
            beta,
            skip,
            out,
            i_b,
            i_h,
            i_g,
            o_k,
            o_v,
            live,
            H,
            G,
            K,
            V,
            FAMILY,
            HAS_SKIP,
            1,
        )
    tl.store(p_s, St, eviction_policy="evict_first")
    if HAS_READ:
        p_r = rd + (s * H + i_h) * (K * V) + o_k[None, :] * V + o_v[:, None]
        _store_read_copy(St, p_r, read_rows, i_h, ROWS)
    if SKETCH_OUT:
        # (R_{:m} S)ᵀ = Sᵀ R_{:m}ᵀ, 16 rows of R at a time
        m = tl.load(ranks + i_h)
        o_r = tl.arange(0, 16)
        for r0 in range(0, m, 16):
            rows = (r0 + o_r) < m
            p_rm = frames + (i_g * K + r0 + o_r[:, None]) * K + o_k[None, :]
            rm = tl.load(p_rm, mask=rows[:, None], other=0.0)
            skt = _dot_ff(St, tl.trans(rm), tl.zeros((BV, 16), dtype=tl.float32), SKETCH_TERMS, EMULATE)
            p_sk = sk + (s * H + i_h) * sk_head_stride + (r0 + o_r[None, :]) * V + o_v[:, None]
            tl.store(p_sk, skt.to(sk.dtype.element_ty), mask=rows[None, :])


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _dims(family: str, x: StepInputs, heads: int) -> tuple[int, int, int, int, int, int]:
    """(B, T, G, K, V, H) after checking the kernel-layout inputs."""
    check_family(family)
    b, t, g, kd = x.k.shape
    vd = x.w.shape[-1]
    if x.q.shape != x.k.shape or x.w.shape != (b, t, heads, vd):
        raise ValueError(
            f"inputs: k, q must be [B, T, G, K] and w [B, T, H={heads}, V]; got "
            f"k {tuple(x.k.shape)}, q {tuple(x.q.shape)}, w {tuple(x.w.shape)}"
        )
    dshape = (b, t, heads, kd) if family == "kda" else (b, t, heads)
    if x.decay.shape != dshape:
        raise ValueError(f"inputs: decay must be {list(dshape)}, got {list(x.decay.shape)}")
    if family != "mamba2" and (x.beta is None or x.beta.shape != (b, t, heads)):
        raise ValueError("inputs: the delta rules need beta [B, T, H]")
    if heads % g:
        raise ValueError(f"heads ({heads}) must be a multiple of groups ({g})")
    for name, tensor in (
        ("k", x.k),
        ("q", x.q),
        ("w", x.w),
        ("decay", x.decay),
        ("beta", x.beta),
        ("skip", x.skip),
    ):
        if tensor is not None and not tensor.is_contiguous():
            raise ValueError(f"inputs: {name} must be contiguous")
    if not (x.k.is_cuda or _interpreting()):
        raise RuntimeError("the decode kernels need a CUDA device (or TRITON_INTERPRET=1 on the CPU)")
    return b, t, g, kd, vd, heads


# Programmatic dependent launch of the decode kernels on Hopper and later (see _dependent_launch);
# False launches them plainly (the comparison in BENCHMARKS.md).
USE_PDL = True


@functools.cache
def _pdl_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _launch_options(cfg: KernelConfig, device: torch.device | None = None) -> dict:
    """Triton launch (and compile) options of a launch shape; with ``device``, also the ``PDL``
    constexpr and its launch option."""
    opts = {"num_warps": cfg.num_warps, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {})}
    if device is not None:
        pdl = USE_PDL and device.type == "cuda" and not _interpreting()
        pdl = pdl and _pdl_device(torch.cuda.current_device() if device.index is None else device.index)
        opts.update(PDL=pdl, **({"launch_pdl": True} if pdl else {}))
    return opts


def _prefetch(cfg: KernelConfig) -> bool:
    """``cfg.prefetch`` where it can run: the CPU interpreter runs no inline PTX (and no result
    depends on a prefetch)."""
    return cfg.prefetch and not _interpreting()


def _read_options(cfg: KernelConfig, kd: int) -> dict:
    """The read kernel's constexprs that come from its launch shape."""
    return dict(
        CHUNKED=cfg.chunked,
        GROUP=cfg.group,
        DENSE_ROWS=min(cfg.dense_rows, kd),
        EARLY_MAP=cfg.early_map,
        PREFETCH=_prefetch(cfg),
    )


def _block_v(cfg: KernelConfig, vd: int) -> int:
    return max(1, min(cfg.block_v, vd))


def _out(out: Tensor | None, x: StepInputs, heads: int, tokens: int) -> Tensor:
    b = x.w.shape[0]
    shape = (b, tokens, heads, x.w.shape[-1])
    if out is None:
        return torch.empty(shape, dtype=x.w.dtype, device=x.w.device)
    if tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {list(shape)} tensor")
    return out


def _beta(x: StepInputs) -> Tensor:
    return x.beta if x.beta is not None else x.decay  # never read for Mamba-2


def _window_pool(pool: DecodePool, sketch: bool) -> tuple[int, int]:
    """Checks a window pool for the read and flush kernels; returns (K, V)."""
    if pool.buf_w is None:
        raise ValueError("a window pool (capacity > 0) is needed")
    if sketch and pool.sketch is None:
        raise ValueError("sketch mode needs a pool with a sketch tensor (allocate_pool(sketch_rows=M))")
    kd, vd = pool.state.shape[2:]
    if kd < CHUNK_MIN or vd < CHUNK_MIN:
        raise ValueError(f"the window kernels need K, V ≥ {CHUNK_MIN} (tensor-core tiles); K={kd}, V={vd}")
    return kd, vd


def _buffer_block(capacity: int) -> int:
    """Rows of the buffer tiles: the capacity padded to a power of two ≥ 16."""
    return max(CHUNK_MIN, next_pow2(capacity))


@functools.cache
def gluon_available() -> bool:
    """Whether this Triton has the Gluon names the Gluon flushes use (:mod:`.flush_pipelined`, which
    KDA's imports from; Triton 3.6 and 3.9 have them); without them the flushes that asked for
    ``KernelConfig.pipelined`` take the Triton kernels."""
    try:
        from sketchcal.kernels.common import flush_pipelined  # noqa: F401
    except (ImportError, AttributeError):
        return False
    return True


def _pipelined(cfg: KernelConfig, family: str, pool: DecodePool) -> bool:
    """Whether the flush runs as a persistent Gluon kernel (``KernelConfig.pipelined``): Mamba-2's
    (:mod:`.flush_pipelined`) or KDA's (``kernels/kda/flush_pipelined.py``, for the pools its
    layouts cover)."""
    if not (
        cfg.pipelined > 0
        and family in ("mamba2", "kda")
        and pool.state.is_cuda
        and not _interpreting()
        and pool.buf_k.dtype == pool.buf_w.dtype == torch.bfloat16
        and gluon_available()
    ):
        return False
    if family == "kda":
        from sketchcal.kernels.kda import flush_pipelined, flush_sweep

        _, h, kd, vd = pool.state.shape
        kernel = flush_pipelined if cfg.chunked else flush_sweep
        return kernel.usable(h, pool.buf_k.shape[1], kd, vd, pool.capacity, cfg.num_warps, _block_v(cfg, vd))
    return True


def _keys_bf16(pool: DecodePool) -> bool:
    """bf16 buffered keys enter tensor-core dots as they are (exact); others as 3xTF32."""
    return pool.buf_k.dtype == torch.bfloat16


def standard_step(
    family: str,
    state: Tensor | DecodePool,
    slots: Tensor,
    x: StepInputs,
    out: Tensor | None = None,
    *,
    config: KernelConfig | None = None,
) -> Tensor:
    """The baseline: ``S ← A S + k wᵀ``, ``o = Sᵀ q (+ skip)`` for each of the T tokens in turn,
    in place on ``state`` [N, H, K, V] fp32 at the slots given. Returns ``out`` [B, T, H, V]."""
    state = state.state if isinstance(state, DecodePool) else state
    heads = state.shape[1]
    b, t, g, kd, vd, h = _dims(family, x, heads)
    cfg = config or default_config("standard", family)
    bv = _block_v(cfg, vd)
    out = _out(out, x, h, t)
    _standard_kernel[(vd // bv, h, b)](
        state,
        slots,
        x.q,
        x.k,
        x.w,
        x.decay,
        _beta(x),
        x.skip if x.skip is not None else x.w,
        out,
        T=t,
        H=h,
        G=g,
        K=kd,
        V=vd,
        BV=bv,
        FAMILY=FAMILY_ID[family],
        HAS_SKIP=x.skip is not None,
        **_launch_options(cfg, state.device),
    )
    return out


def spec_verify(
    family: str,
    pool: DecodePool,
    slots: Tensor,
    pos: Tensor,
    x: StepInputs,
    out: Tensor | None = None,
    *,
    tables: SketchTables | None = None,
    config: KernelConfig | None = None,
) -> Tensor:
    """Outputs of T tokens following the ``pos[b]`` buffered ones, read from the checkpoint's read
    copy (``tables`` None: replay) or its sketch, plus the buffer; no state is materialised or
    written. The T tokens are appended to the buffer at ``pos[b]`` (entries past the capacity are
    dropped: keep ``pos + T ≤ C``). Returns ``out`` [B, T, H, V]."""
    heads = pool.heads
    b, t, g, kd, vd, h = _dims(family, x, heads)
    sketch = tables is not None
    _window_pool(pool, sketch)
    if pool.read is None:
        raise ValueError("a window pool with a read copy is needed")
    cfg = config or default_config("sketch" if sketch else "replay", family, pool.read.dtype)
    bv = _block_v(cfg, vd)
    out = _out(out, x, h, t)
    if sketch and cfg.split:
        from sketchcal.kernels.common import read_split

        if read_split.usable(family, pool, tables, t):
            read_split.launch(pool, tables, slots, pos, x, out, cfg, bv, min(cfg.dense_rows, kd))
            return out
    sk = pool.sketch if sketch else pool.read
    m_rows = tables.map_rows if sketch else 1
    _read_kernel[(vd // bv, h, b)](
        slots,
        pos,
        x.q,
        x.k,
        x.w,
        x.decay,
        _beta(x),
        x.skip if x.skip is not None else x.w,
        out,
        pool.buf_k,
        pool.buf_w,
        pool.buf_decay,
        pool.buf_beta if pool.buf_beta is not None else pool.buf_decay,
        pool.buf_logdecay if pool.buf_logdecay is not None else pool.buf_decay,
        pool.read,
        sk,
        tables.ranks if sketch else slots,
        tables.maps if sketch else pool.buf_decay,
        sk.shape[2] * sk.shape[3],
        T=t,
        H=h,
        G=g,
        K=kd,
        V=vd,
        BV=bv,
        C=pool.capacity,
        BC=_buffer_block(pool.capacity),
        M=m_rows,
        FAMILY=FAMILY_ID[family],
        SKETCH=sketch,
        HAS_SKIP=x.skip is not None,
        K_BF16=_keys_bf16(pool),
        EMULATE=_interpreting(),
        LOG2_DECAY=pool.buf_logdecay is not None,
        **_read_options(cfg, kd),
        **_launch_options(cfg, pool.state.device),
    )
    return out


def replay_step(
    family: str,
    pool: DecodePool,
    slots: Tensor,
    pos: Tensor,
    x: StepInputs,
    out: Tensor | None = None,
    *,
    config: KernelConfig | None = None,
) -> Tensor:
    """ReplaySSM non-flush step (T = 1): read copy + buffer; no state write."""
    return spec_verify(family, pool, slots, pos, x, out, config=config)


def sketch_step(
    family: str,
    pool: DecodePool,
    tables: SketchTables,
    slots: Tensor,
    pos: Tensor,
    x: StepInputs,
    out: Tensor | None = None,
    *,
    config: KernelConfig | None = None,
) -> Tensor:
    """SketchSSM non-flush step (T = 1): sketch rows + buffer + coefficient map; dense (rank-0)
    heads read the full read copy."""
    return spec_verify(family, pool, slots, pos, x, out, tables=tables, config=config)


def flush(
    family: str,
    pool: DecodePool,
    slots: Tensor,
    pos: Tensor,
    x: StepInputs | None = None,
    out: Tensor | None = None,
    *,
    tables: SketchTables | None = None,
    config: KernelConfig | None = None,
) -> Tensor | None:
    """Fold the ``pos[b]`` buffered tokens, then ``x``'s single token if given (its output is
    returned), exactly into the fp32 checkpoint ``pool.state``; refresh the read copy: every row
    (``tables`` None, replay mode) or ``tables.read_rows`` per head (sketch mode: the dense
    heads), and in sketch mode the sketch ``R_{:m} S_c`` of each head of rank m > 0. The caller
    then resets ``pos`` to 0."""
    heads = pool.heads
    sketch = tables is not None
    kd, vd = _window_pool(pool, sketch)
    g = pool.buf_k.shape[1]
    if x is not None:
        b, t, g, kd, vd, _ = _dims(family, x, heads)
        if t != 1:
            raise ValueError("flush takes at most one new token")
        out = _out(out, x, heads, 1)
    else:
        b = slots.shape[0]
    read_dtype = pool.read.dtype if pool.read is not None else None
    cfg = config or default_config("flush_sketch" if sketch else "flush_replay", family, read_dtype)
    if family == "kda" and cfg.pipelined and not cfg.chunked and not _pipelined(cfg, family, pool):
        cfg = SWEEP_FALLBACK  # a pool the Gluon sweep cannot take (fp32 inputs, the CPU): Triton's sweep
    bv = max(_block_v(cfg, vd), CHUNK_MIN if cfg.chunked else 1)  # tl.dot needs 16 rows
    sk = pool.sketch if sketch else pool.state
    xs = x if x is not None else StepInputs(pool.buf_k, pool.buf_k, pool.buf_w, pool.buf_decay, pool.buf_beta)
    dummy = pool.buf_decay
    args = (
        pool.state,
        slots,
        pos,
        xs.q,
        xs.k,
        xs.w,
        xs.decay,
        _beta(xs),
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
    common = dict(
        H=heads,
        G=g,
        K=kd,
        V=vd,
        BV=bv,
        C=pool.capacity,
        FAMILY=FAMILY_ID[family],
        HAS_X=x is not None,
        HAS_SKIP=x is not None and x.skip is not None,
        HAS_READ=pool.read is not None,
        ROWS=sketch,
        SKETCH_OUT=sketch,
        **_launch_options(cfg, pool.state.device),
    )
    grid = (vd // bv, heads, b)
    terms = sketch_terms(sk.dtype)
    if family == "kda" and _pipelined(cfg, family, pool):
        from sketchcal.kernels.kda import flush_pipelined, flush_sweep

        options = dict(
            H=heads,
            K=kd,
            V=vd,
            C=pool.capacity,
            HAS_X=common["HAS_X"],
            HAS_SKIP=common["HAS_SKIP"],
            HAS_READ=common["HAS_READ"],
            ROWS=sketch,
            SKETCH_OUT=sketch,
            batch=b,
            per_sm=cfg.pipelined,
            num_warps=cfg.num_warps,
            maxnreg=cfg.maxnreg,
        )
        if cfg.chunked:
            terms_or_dummy = tables.frame_terms if sketch else dummy
            flush_pipelined.launch(args, terms_or_dummy, SKETCH_TERMS=terms, **options)
        else:
            flush_sweep.launch(args, dummy, VB=_block_v(cfg, vd), **options)
    elif _pipelined(cfg, family, pool):
        from sketchcal.kernels.common import flush_pipelined

        flush_pipelined.launch(
            args,
            tables.frame_terms if sketch else dummy,
            H=heads,
            G=g,
            K=kd,
            V=vd,
            C=pool.capacity,
            BC=_buffer_block(pool.capacity),
            HAS_X=common["HAS_X"],
            HAS_SKIP=common["HAS_SKIP"],
            HAS_READ=common["HAS_READ"],
            ROWS=sketch,
            SKETCH_OUT=sketch,
            SKETCH_TERMS=terms,
            batch=b,
            per_sm=cfg.pipelined,
            num_warps=cfg.num_warps,
            maxnreg=cfg.maxnreg,
        )
    elif cfg.chunked:
        bc = _buffer_block(pool.capacity)
        _flush_chunk_kernel[grid](
            *args,
            BC=bc,
            LOG2_BC=bc.bit_length() - 1,
            K_BF16=_keys_bf16(pool),
            SKETCH_TERMS=terms,
            EMULATE=_interpreting(),
            **common,
        )
    else:
        _flush_kernel[grid](*args, VEC=cfg.vec, PREFETCH=_prefetch(cfg), **common)
    return out
