"""Triton decode kernels shared by the three families (a ``FAMILY`` constexpr picks the transition).

Serving API (per family, bound in ``kernels/<family>/decode.py``):

- :func:`standard_step`  read the fp32 state, update it, write it (the baseline);
- :func:`replay_step`    ReplaySSM non-flush step: read copy + buffer, no state write;
- :func:`sketch_step`    SketchSSM non-flush step: sketch prefix (Mamba-2/GDN: the first m rows
  of the rotated read copy; KDA: the sketch tensor) + buffer + coefficient map;
- :func:`flush`          fold the buffered window exactly into the fp32 checkpoint, refresh the
  read copy rows (and the KDA sketch);
- :func:`spec_verify`    T draft tokens from checkpoint + buffer, outputs only;
- :func:`rotate_qk`      Mamba-2/GDN sketch mode: k, q into the sketch frame (R_g k).

Pool and input layouts are documented in ``pool.py``. Every entry point takes ``slots`` [B]
(int32, -1 = padding: that entry is skipped, its output row left as it was) and, for the window
kernels, ``pos`` [B] int32: the number of tokens already buffered for that slot since its last
flush. Nothing here synchronises with the host or allocates when ``out`` (and ``scratch`` for
the rotation) are given, so each call can be captured in a CUDA graph; the engine keeps ``pos``
(spec decoding: accepting k drafts advances it by k, rejected entries are overwritten later).

Math per program (one slot, one head, one tile of BV value columns):

- step:       S ← A S + k wᵀ, with A S = d⊙S + k(−β kᵀ(d⊙S))ᵀ for the delta rules;
- read:       o_p = S_cᵀ u_p + Σ_j w_j (k_j · A_{j+1}ᵀ⋯A_pᵀ q_p) by one backward sweep over the
  buffer (``recurrence.product_form_read``), which also yields u_p = M_pᵀ q_p; the checkpoint
  term is the read copy (``replay``) or ``(sketch rows)ᵀ (P u)`` (``sketch``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from sketchcal.kernels.common.pool import (
    ROTATED,
    DecodePool,
    SketchTables,
    check_family,
    next_pow2,
)
from sketchcal.kernels.common.recurrence import StepInputs

FAMILY_ID = {"mamba2": 0, "gdn": 1, "kda": 2}


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape: value columns per program and warps per program."""

    block_v: int
    num_warps: int


# Defaults by (kernel, family); ``block_v`` is clipped to V. The fastest of ``bench.TUNE_CANDIDATES`` on an
# H200 at batch 256 (BENCHMARKS.md, "Decode kernels").
DEFAULT_CONFIGS: dict[tuple[str, str], KernelConfig] = {
    ("standard", "mamba2"): KernelConfig(64, 4),
    ("standard", "gdn"): KernelConfig(64, 4),
    ("standard", "kda"): KernelConfig(64, 4),
    ("read", "mamba2"): KernelConfig(64, 1),
    ("read", "gdn"): KernelConfig(64, 1),
    ("read", "kda"): KernelConfig(64, 1),
    ("flush", "mamba2"): KernelConfig(32, 2),
    ("flush", "gdn"): KernelConfig(16, 1),
    ("flush", "kda"): KernelConfig(16, 1),
    ("flush_sketch", "mamba2"): KernelConfig(32, 4),
    ("flush_sketch", "gdn"): KernelConfig(16, 1),
    ("flush_sketch", "kda"): KernelConfig(32, 4),
}


def default_config(kernel: str, family: str) -> KernelConfig:
    return DEFAULT_CONFIGS[(kernel, family)]


# ----------------------------------------------------------------------------------------------
# Triton building blocks
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_token(
    k, w, decay, beta, k_off, w_off, h_off, o_k, o_v, live,
    K: tl.constexpr, V: tl.constexpr, FAMILY: tl.constexpr,
):
    """One token's (k [K], w [BV], decay, beta) as fp32; a masked-off token (``live`` False)
    comes back as the identity transition (k = w = 0, decay = 1, beta = 0)."""
    # vector masks come from one comparison each (the interpreter rejects broadcast scalar masks)
    mk = o_k < tl.where(live, K, 0)
    kk = tl.load(k + k_off + o_k, mask=mk, other=0.0).to(tl.float32)
    ww = tl.load(w + w_off + o_v, mask=o_v < tl.where(live, V, 0), other=0.0).to(tl.float32)
    if FAMILY == 2:
        dd = tl.load(decay + h_off * K + o_k, mask=mk, other=1.0).to(tl.float32)
    else:
        dd = tl.load(decay + h_off, mask=live, other=1.0).to(tl.float32)
    if FAMILY == 0:  # noqa: SIM108  (a constexpr branch: the other side is never compiled)
        bb = dd * 0.0
    else:
        bb = tl.load(beta + h_off, mask=live, other=0.0).to(tl.float32)
    return kk, ww, dd, bb


@triton.jit
def _forward(S, kk, ww, dd, bb, FAMILY: tl.constexpr):
    """``A S + k wᵀ`` on a [K, BV] fp32 tile."""
    if FAMILY == 0:
        S = S * dd + kk[:, None] * ww[None, :]
    else:
        if FAMILY == 2:  # noqa: SIM108
            S = S * dd[:, None]
        else:
            S = S * dd
        ks = tl.sum(S * kk[:, None], axis=0)
        S = S + kk[:, None] * (ww - bb * ks)[None, :]
    return S


@triton.jit
def _backward(v, kk, dd, bb, FAMILY: tl.constexpr):
    """``(k · v, Aᵀ v)`` for a [K] vector: the coefficient of this token's w in the read, and
    the query pushed one token further back."""
    kv = tl.sum(kk * v, axis=0)
    if FAMILY == 0:  # noqa: SIM108
        v = v * dd
    else:
        v = (v - (bb * kv) * kk) * dd
    return kv, v


@triton.jit
def _dense_read(v, rd_h, o_k, o_v, V: tl.constexpr):
    rc = tl.load(rd_h + o_k[:, None] * V + o_v[None, :]).to(tl.float32)
    return tl.sum(rc * v[:, None], axis=0)


@triton.jit
def _checkpoint_read(
    v, rd_h, sk_h, ranks, maps, i_h, o_k, o_v,
    K: tl.constexpr, V: tl.constexpr, M: tl.constexpr, BM: tl.constexpr, SKETCH: tl.constexpr,
):
    """``S_cᵀ u`` from the read copy, or ``(sketch rows)ᵀ (P u)`` for a head of rank m > 0."""
    if SKETCH:
        m = tl.load(ranks + i_h)
        if m > 0:
            o_m = tl.arange(0, BM)
            rows = o_m[:, None] < m
            pm = tl.load(maps + (i_h * M + o_m[:, None]) * K + o_k[None, :], mask=rows, other=0.0)
            coeff = tl.sum(pm.to(tl.float32) * v[None, :], axis=1)
            st = tl.load(sk_h + o_m[:, None] * V + o_v[None, :], mask=rows, other=0.0).to(tl.float32)
            o = tl.sum(st * coeff[:, None], axis=0)
        else:
            o = _dense_read(v, rd_h, o_k, o_v, V)
    else:
        o = _dense_read(v, rd_h, o_k, o_v, V)
    return o


# ----------------------------------------------------------------------------------------------
# Kernels. Grid: (V // BV, H, B).
# ----------------------------------------------------------------------------------------------


@triton.jit
def _standard_kernel(
    state, slots, q, k, w, decay, beta, skip, out,
    T: tl.constexpr, H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BV: tl.constexpr, FAMILY: tl.constexpr, HAS_SKIP: tl.constexpr,
):
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
        kk, ww, dd, bb = _load_token(
            k, w, decay, beta, (x_t * G + i_g) * K, (x_t * H + i_h) * V, x_t * H + i_h,
            o_k, o_v, live, K, V, FAMILY,
        )
        S = _forward(S, kk, ww, dd, bb, FAMILY)
        qq = tl.load(q + (x_t * G + i_g) * K + o_k).to(tl.float32)
        o = tl.sum(S * qq[:, None], axis=0)
        if HAS_SKIP:
            o += tl.load(skip + (x_t * H + i_h) * V + o_v).to(tl.float32)
        tl.store(out + (x_t * H + i_h) * V + o_v, o.to(out.dtype.element_ty))
    tl.store(p_s, S, eviction_policy="evict_first")


@triton.jit
def _read_kernel(
    slots, pos, q, k, w, decay, beta, skip, out,
    buf_k, buf_w, buf_decay, buf_beta,
    rd, sk, ranks, maps, sk_head_stride,
    T: tl.constexpr, H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BV: tl.constexpr, C: tl.constexpr, M: tl.constexpr, BM: tl.constexpr,
    FAMILY: tl.constexpr, SKETCH: tl.constexpr, HAS_SKIP: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    s = tl.load(slots + i_b).to(tl.int64)
    if s < 0:
        return
    p = tl.load(pos + i_b)
    i_g = i_h // (H // G)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    live = s >= 0
    hb = (s * H + i_h) * C  # this head's first buffer entry
    gb = (s * G + i_g) * C  # this group's first buffer entry
    # append the T new tokens at p, p+1, ...: each program writes its w tile; the first tile writes
    # decay and beta, and the first head of the group its k. Reads below touch entries < p only.
    for t in tl.static_range(T):
        jw = p + t
        ok = jw < C
        x_t = i_b * T + t
        w_new = tl.load(w + (x_t * H + i_h) * V + o_v)
        tl.store(buf_w + (hb + jw) * V + o_v, w_new.to(buf_w.dtype.element_ty), mask=o_v < tl.where(ok, V, 0))
        if i_v == 0:
            if FAMILY == 2:
                d_new = tl.load(decay + (x_t * H + i_h) * K + o_k)
                mk = o_k < tl.where(ok, K, 0)
                tl.store(buf_decay + (hb + jw) * K + o_k, d_new.to(buf_decay.dtype.element_ty), mask=mk)
            else:
                d_new = tl.load(decay + x_t * H + i_h)
                tl.store(buf_decay + hb + jw, d_new.to(buf_decay.dtype.element_ty), mask=ok)
            if FAMILY != 0:
                b_new = tl.load(beta + x_t * H + i_h)
                tl.store(buf_beta + hb + jw, b_new.to(buf_beta.dtype.element_ty), mask=ok)
            if i_h % (H // G) == 0:
                k_new = tl.load(k + (x_t * G + i_g) * K + o_k)
                mk = o_k < tl.where(ok, K, 0)
                tl.store(buf_k + (gb + jw) * K + o_k, k_new.to(buf_k.dtype.element_ty), mask=mk)
    rd_h = rd + (s * H + i_h) * (K * V)
    sk_h = sk + (s * H + i_h) * sk_head_stride
    for t in tl.static_range(T):
        x_t = i_b * T + t
        v = tl.load(q + (x_t * G + i_g) * K + o_k).to(tl.float32)
        acc = tl.zeros([BV], dtype=tl.float32)
        # backward sweep: the new tokens t..0, then the buffered ones p-1..0
        for i in tl.static_range(T):
            d = T - 1 - i
            if d <= t:
                x_d = i_b * T + d
                kk, ww, dd, bb = _load_token(
                    k, w, decay, beta, (x_d * G + i_g) * K, (x_d * H + i_h) * V, x_d * H + i_h,
                    o_k, o_v, live, K, V, FAMILY,
                )
                kv, v = _backward(v, kk, dd, bb, FAMILY)
                acc += kv * ww
        for i in tl.static_range(C):
            j = C - 1 - i
            kk, ww, dd, bb = _load_token(
                buf_k, buf_w, buf_decay, buf_beta, (gb + j) * K, (hb + j) * V, hb + j,
                o_k, o_v, j < p, K, V, FAMILY,
            )
            kv, v = _backward(v, kk, dd, bb, FAMILY)
            acc += kv * ww
        o = acc + _checkpoint_read(v, rd_h, sk_h, ranks, maps, i_h, o_k, o_v, K, V, M, BM, SKETCH)
        if HAS_SKIP:
            o += tl.load(skip + (x_t * H + i_h) * V + o_v).to(tl.float32)
        tl.store(out + (x_t * H + i_h) * V + o_v, o.to(out.dtype.element_ty))


@triton.jit
def _flush_kernel(
    state, slots, pos, q, k, w, decay, beta, skip, out,
    buf_k, buf_w, buf_decay, buf_beta,
    rd, read_rows, sk, ranks, frames, sk_head_stride,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, BM: tl.constexpr, FAMILY: tl.constexpr, HAS_X: tl.constexpr, HAS_SKIP: tl.constexpr,
    HAS_READ: tl.constexpr, ROWS: tl.constexpr, SKETCH_OUT: tl.constexpr,
):
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
    live = s >= 0
    hb = (s * H + i_h) * C
    gb = (s * G + i_g) * C
    p_s = state + (s * H + i_h) * (K * V) + o_k[:, None] * V + o_v[None, :]
    S = tl.load(p_s, eviction_policy="evict_first")
    for j in tl.static_range(C):
        kk, ww, dd, bb = _load_token(
            buf_k, buf_w, buf_decay, buf_beta, (gb + j) * K, (hb + j) * V, hb + j,
            o_k, o_v, j < n, K, V, FAMILY,
        )
        S = _forward(S, kk, ww, dd, bb, FAMILY)
    if HAS_X:
        kk, ww, dd, bb = _load_token(
            k, w, decay, beta, (i_b * G + i_g) * K, (i_b * H + i_h) * V, i_b * H + i_h,
            o_k, o_v, live, K, V, FAMILY,
        )
        S = _forward(S, kk, ww, dd, bb, FAMILY)
        qq = tl.load(q + (i_b * G + i_g) * K + o_k).to(tl.float32)
        o = tl.sum(S * qq[:, None], axis=0)
        if HAS_SKIP:
            o += tl.load(skip + (i_b * H + i_h) * V + o_v).to(tl.float32)
        tl.store(out + (i_b * H + i_h) * V + o_v, o.to(out.dtype.element_ty))
    tl.store(p_s, S, eviction_policy="evict_first")
    if HAS_READ:
        p_r = rd + (s * H + i_h) * (K * V) + o_k[:, None] * V + o_v[None, :]
        if ROWS:
            r = tl.load(read_rows + i_h)
            tl.store(p_r, S.to(rd.dtype.element_ty), mask=o_k[:, None] < r)
        else:
            tl.store(p_r, S.to(rd.dtype.element_ty))
    if SKETCH_OUT:
        m = tl.load(ranks + i_h)
        if m > 0:
            o_m = tl.arange(0, BM)
            rows = o_m[:, None] < m
            rm = tl.load(frames + (i_g * K + o_m[:, None]) * K + o_k[None, :], mask=rows, other=0.0)
            sk_t = tl.dot(rm, S, input_precision="ieee")
            p_sk = sk + (s * H + i_h) * sk_head_stride + o_m[:, None] * V + o_v[None, :]
            tl.store(p_sk, sk_t.to(sk.dtype.element_ty), mask=rows)


@triton.jit
def _rotate_kernel(k, q, frames, k_out, q_out, n_rows, G: tl.constexpr, K: tl.constexpr, BR: tl.constexpr):
    """``x ← R_g x`` for the k and q rows of one group; grid (cdiv(B·T, BR), G)."""
    i_r = tl.program_id(0)
    i_g = tl.program_id(1)
    o_r = i_r * BR + tl.arange(0, BR)
    o_k = tl.arange(0, K)
    rmask = o_r[:, None] < n_rows
    r_t = tl.trans(tl.load(frames + i_g * (K * K) + o_k[:, None] * K + o_k[None, :]))  # coalesced, then Rᵀ
    off = (o_r[:, None] * G + i_g) * K + o_k[None, :]
    xk = tl.load(k + off, mask=rmask, other=0.0).to(tl.float32)
    tl.store(k_out + off, tl.dot(xk, r_t, input_precision="ieee").to(k_out.dtype.element_ty), mask=rmask)
    xq = tl.load(q + off, mask=rmask, other=0.0).to(tl.float32)
    tl.store(q_out + off, tl.dot(xq, r_t, input_precision="ieee").to(q_out.dtype.element_ty), mask=rmask)


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
        raise ValueError(f"inputs: k, q must be [B, T, G, K] and w [B, T, H={heads}, V]; got "
                         f"k {tuple(x.k.shape)}, q {tuple(x.q.shape)}, w {tuple(x.w.shape)}")
    dshape = (b, t, heads, kd) if family == "kda" else (b, t, heads)
    if x.decay.shape != dshape:
        raise ValueError(f"inputs: decay must be {list(dshape)}, got {list(x.decay.shape)}")
    if family != "mamba2" and (x.beta is None or x.beta.shape != (b, t, heads)):
        raise ValueError("inputs: the delta rules need beta [B, T, H]")
    if heads % g:
        raise ValueError(f"heads ({heads}) must be a multiple of groups ({g})")
    for name, tensor in (("k", x.k), ("q", x.q), ("w", x.w), ("decay", x.decay), ("beta", x.beta),
                         ("skip", x.skip)):
        if tensor is not None and not tensor.is_contiguous():
            raise ValueError(f"inputs: {name} must be contiguous")
    if not (x.k.is_cuda or _interpreting()):
        raise RuntimeError("the decode kernels need a CUDA device (or TRITON_INTERPRET=1 on the CPU)")
    return b, t, g, kd, vd, heads


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
        state, slots, x.q, x.k, x.w, x.decay, _beta(x), x.skip if x.skip is not None else x.w, out,
        T=t, H=h, G=g, K=kd, V=vd, BV=bv, FAMILY=FAMILY_ID[family], HAS_SKIP=x.skip is not None,
        num_warps=cfg.num_warps,
    )
    return out


def rotate_qk(
    x: StepInputs, tables: SketchTables, scratch: tuple[Tensor, Tensor] | None = None
) -> StepInputs:
    """Mamba-2/GDN sketch mode: the inputs with ``k, q`` replaced by ``R_g k, R_g q`` written into
    ``scratch`` = (k_out, q_out) (allocated when None). Other fields are shared, not copied."""
    b, t, g, kd = x.k.shape
    if scratch is None:
        scratch = (torch.empty_like(x.k), torch.empty_like(x.q))
    k_out, q_out = scratch
    if k_out.shape != x.k.shape or q_out.shape != x.q.shape:
        raise ValueError("scratch must match the shapes of k and q")
    br = 16
    _rotate_kernel[(triton.cdiv(b * t, br), g)](
        x.k, x.q, tables.frames, k_out, q_out, b * t, G=g, K=kd, BR=br, num_warps=4
    )
    return replace(x, k=k_out, q=q_out)


def _sketch_frame(family: str, x: StepInputs, tables: SketchTables | None, scratch) -> StepInputs:
    if tables is None or family not in ROTATED:
        return x
    return rotate_qk(x, tables, scratch)


def spec_verify(
    family: str,
    pool: DecodePool,
    slots: Tensor,
    pos: Tensor,
    x: StepInputs,
    out: Tensor | None = None,
    *,
    tables: SketchTables | None = None,
    scratch: tuple[Tensor, Tensor] | None = None,
    config: KernelConfig | None = None,
) -> Tensor:
    """Outputs of T tokens following the ``pos[b]`` buffered ones, read from the checkpoint's read
    copy (``tables`` None: replay) or its sketch, plus the buffer; no state is materialised or
    written. The T tokens are appended to the buffer at ``pos[b]`` (entries past the capacity are
    dropped: keep ``pos + T ≤ C``). With ``tables`` for Mamba-2/GDN, ``x`` is in the model frame
    and is rotated first (into ``scratch``). Returns ``out`` [B, T, H, V]."""
    heads = pool.heads
    b, t, g, kd, vd, h = _dims(family, x, heads)
    if pool.read is None or pool.buf_w is None:
        raise ValueError("a window pool (capacity > 0, with a read copy) is needed")
    x = _sketch_frame(family, x, tables, scratch)
    cfg = config or default_config("read", family)
    bv = _block_v(cfg, vd)
    out = _out(out, x, h, t)
    sketch = tables is not None
    if sketch and not tables.rotated and pool.sketch is None:
        raise ValueError("KDA sketch mode needs a pool with a sketch tensor (allocate_pool(sketch_rows=M))")
    sk = pool.read if not sketch or tables.rotated else pool.sketch
    sk_head_stride = sk.shape[2] * sk.shape[3]
    m_rows = tables.map_rows if sketch else 1
    _read_kernel[(vd // bv, h, b)](
        slots, pos, x.q, x.k, x.w, x.decay, _beta(x), x.skip if x.skip is not None else x.w, out,
        pool.buf_k, pool.buf_w, pool.buf_decay,
        pool.buf_beta if pool.buf_beta is not None else pool.buf_decay,
        pool.read, sk, tables.ranks if sketch else slots, tables.maps if sketch else pool.buf_decay,
        sk_head_stride,
        T=t, H=h, G=g, K=kd, V=vd, BV=bv, C=pool.capacity, M=m_rows, BM=next_pow2(m_rows),
        FAMILY=FAMILY_ID[family], SKETCH=sketch, HAS_SKIP=x.skip is not None,
        num_warps=cfg.num_warps,
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
    scratch: tuple[Tensor, Tensor] | None = None,
    config: KernelConfig | None = None,
) -> Tensor:
    """SketchSSM non-flush step (T = 1): sketch prefix (or KDA sketch) + buffer + coefficient map;
    dense (rank-0) heads read the full read copy."""
    return spec_verify(family, pool, slots, pos, x, out, tables=tables, scratch=scratch, config=config)


def flush(
    family: str,
    pool: DecodePool,
    slots: Tensor,
    pos: Tensor,
    x: StepInputs | None = None,
    out: Tensor | None = None,
    *,
    tables: SketchTables | None = None,
    scratch: tuple[Tensor, Tensor] | None = None,
    config: KernelConfig | None = None,
) -> Tensor | None:
    """Fold the ``pos[b]`` buffered tokens, then ``x``'s single token if given (its output is
    returned), exactly into the fp32 checkpoint ``pool.state``; refresh the read copy: every row
    (``tables`` None, replay mode) or ``tables.read_rows`` per head (sketch mode), and for KDA
    the sketch ``R_{:m} S_c`` of each head of rank m > 0. The caller then resets ``pos`` to 0."""
    heads = pool.heads
    if pool.buf_w is None:
        raise ValueError("a window pool (capacity > 0) is needed")
    kd, vd = pool.state.shape[2:]
    g = pool.buf_k.shape[1]
    if x is not None:
        b, t, g, kd, vd, _ = _dims(family, x, heads)
        if t != 1:
            raise ValueError("flush takes at most one new token")
        x = _sketch_frame(family, x, tables, scratch)
        out = _out(out, x, heads, 1)
    else:
        b = slots.shape[0]
    cfg = config or default_config("flush" if tables is None else "flush_sketch", family)
    bv = _block_v(cfg, vd)
    sketch_out = tables is not None and not tables.rotated and pool.sketch is not None
    if sketch_out:
        bv = max(bv, 16)  # tl.dot needs 16 columns
    m_rows = tables.map_rows if tables is not None else 1
    sk = pool.sketch if sketch_out else pool.state
    xs = x if x is not None else StepInputs(pool.buf_k, pool.buf_k, pool.buf_w, pool.buf_decay, pool.buf_beta)
    dummy = pool.buf_decay
    _flush_kernel[(vd // bv, heads, b)](
        pool.state, slots, pos, xs.q, xs.k, xs.w, xs.decay, _beta(xs),
        xs.skip if xs.skip is not None else xs.w, out if out is not None else dummy,
        pool.buf_k, pool.buf_w, pool.buf_decay, pool.buf_beta if pool.buf_beta is not None else dummy,
        pool.read if pool.read is not None else pool.state,
        tables.read_rows if tables is not None else slots,
        sk, tables.ranks if tables is not None else slots, tables.frames if tables is not None else dummy,
        sk.shape[2] * sk.shape[3],
        H=heads, G=g, K=kd, V=vd, BV=bv, C=pool.capacity, BM=max(16, next_pow2(m_rows)),
        FAMILY=FAMILY_ID[family], HAS_X=x is not None, HAS_SKIP=x is not None and x.skip is not None,
        HAS_READ=pool.read is not None, ROWS=tables is not None, SKETCH_OUT=sketch_out,
        num_warps=cfg.num_warps,
    )
    return out
