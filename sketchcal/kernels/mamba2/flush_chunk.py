"""Mamba-2's chunked flush on tensor cores: the fallback of its Gluon flush where Gluon cannot run
(the CPU interpreter, fp32 buffered inputs, a Triton without Gluon), and a tuning candidate.

Per program (grid ``(V / BV, H, B)``), with the ``n`` buffered tokens' keys ``K_b`` [BC, K], values
``W`` [BC, BV] and decays ``α`` (rows ≥ n: identity tokens),

    Sᵀ ← (α_0⋯α_{n−1}) Sᵀ + (g ⊙ W)ᵀ K_b,   g_j = α_{j+1}⋯α_{n−1},

on the tile ``Sᵀ`` [BV, K]: it is the accumulator of the update and, split into bf16 terms, the
left operand of every product, so it never leaves the MMA register layout; the keys and R rows are
the right operands. ``(g ⊙ W)ᵀ`` enters in three bf16 terms times bf16 keys (exact products, fp32
accumulation; fp32 keys: 3xTF32). Then the new token (on the same tile), the state store, the read
copy and the sketch ``Sᵀ R_{:m}ᵀ``, 16 rows of R at a time, as :func:`sketch_terms` defines it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sketchcal.kernels.common.flush import flush_arguments, flush_flags
from sketchcal.kernels.common.pool import DecodePool, SketchTables
from sketchcal.kernels.common.recurrence import StepInputs
from sketchcal.kernels.common.triton_helpers import (
    CHUNK_MIN,
    buffer_block,
    clip_block_v,
    dependent_launch,
    dot_ff,
    dot_fk,
    interpreting,
    keys_bf16,
    launch_options,
    program_slot,
    step_emit,
    store_read_copy,
)


def sketch_terms(sketch_dtype: torch.dtype) -> int:
    """How Mamba-2's tensor-core flushes (this one and the Gluon one) compute the sketch
    ``Sᵀ R_{:m}ᵀ`` stored in ``sketch_dtype`` (``dot_ff``'s TERMS). fp32: both sides in three bf16
    terms (exact to fp32 rounding), 3. bf16 or fp8: the folded state rounded to bf16 (what a bf16
    read copy of it holds) times R in two terms, 1: about 1.5 times the error of storing the exact
    sketch in bf16, for 2 products instead of 3."""
    return 3 if sketch_dtype == torch.float32 else 1


@triton.jit
def _flush_chunk_kernel(
    state, slots, pos, q, k, w, decay, beta, skip, out, buf_k, buf_w, buf_decay, buf_beta,  # flush_arguments
    rd, read_rows, sk, ranks, frames, sk_head_stride,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    BC: tl.constexpr, HAS_X: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_READ: tl.constexpr, ROWS: tl.constexpr,
    SKETCH_OUT: tl.constexpr, K_BF16: tl.constexpr, SKETCH_TERMS: tl.constexpr, EMULATE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Mamba-2's chunked flush on tensor cores (see the module docstring)."""
    dependent_launch(PDL)
    i_v, i_h, i_b, s = program_slot(slots)
    if s < 0:
        return
    n = tl.load(pos + i_b)
    o_c = tl.arange(0, BC)
    i_g = i_h // (H // G)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
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
    # S ← g_{−1} S + K_bᵀ (g ⊙ W), g_j = α_{j+1}⋯α_{n−1}
    al = tl.load(buf_decay + hb + o_c, mask=o_c < n, other=1.0).to(tl.float32)
    al_next = tl.load(buf_decay + hb + o_c + 1, mask=o_c + 1 < n, other=1.0).to(tl.float32)
    g = tl.cumprod(al_next, 0, reverse=True)  # α_{j+1}⋯α_{n−1}
    total = tl.sum(tl.where(o_c == 0, g * al, 0.0), axis=0)
    St = dot_fk(wt * g[None, :], kb, St * total, K_BF16, EMULATE)
    if HAS_X:
        St = step_emit(
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
            0,  # Mamba-2
            HAS_SKIP,
            1,
        )
    tl.store(p_s, St, eviction_policy="evict_first")
    if HAS_READ:
        p_r = rd + (s * H + i_h) * (K * V) + o_k[None, :] * V + o_v[:, None]
        store_read_copy(St, p_r, read_rows, i_h, ROWS)
    if SKETCH_OUT:
        # (R_{:m} S)ᵀ = Sᵀ R_{:m}ᵀ, 16 rows of R at a time
        m = tl.load(ranks + i_h)
        o_r = tl.arange(0, 16)
        for r0 in range(0, m, 16):
            rows = (r0 + o_r) < m
            p_rm = frames + (i_g * K + r0 + o_r[:, None]) * K + o_k[None, :]
            rm = tl.load(p_rm, mask=rows[:, None], other=0.0)
            skt = dot_ff(St, tl.trans(rm), tl.zeros((BV, 16), dtype=tl.float32), SKETCH_TERMS, EMULATE)
            p_sk = sk + (s * H + i_h) * sk_head_stride + (r0 + o_r[None, :]) * V + o_v[:, None]
            tl.store(p_sk, skt.to(sk.dtype.element_ty), mask=rows[None, :])


def launch(
    family: str, pool: DecodePool, tables: SketchTables | None, slots: Tensor, pos: Tensor,
    x: StepInputs | None, out: Tensor | None, cfg,
) -> None:  # fmt: skip
    """:func:`_flush_chunk_kernel` over (V / BV, H, B), BV at least 16 (``tl.dot``'s minimum), for
    a checked Mamba-2 window pool (and new token)."""
    h, g = pool.heads, pool.buf_k.shape[1]
    kd, vd = pool.state.shape[2:]
    bv = max(clip_block_v(cfg.block_v, vd), CHUNK_MIN)
    sk = pool.sketch if tables is not None else pool.state
    _flush_chunk_kernel[(vd // bv, h, slots.shape[0])](
        *flush_arguments(pool, tables, slots, pos, x, out), H=h, G=g, K=kd, V=vd, BV=bv, C=pool.capacity,
        BC=buffer_block(pool.capacity), **flush_flags(pool, tables, x), K_BF16=keys_bf16(pool),
        SKETCH_TERMS=sketch_terms(sk.dtype), EMULATE=interpreting(),
        **launch_options(cfg.num_warps, cfg.maxnreg, pool.state.device),
    )  # fmt: skip
