"""A decode call's inputs in one kernel: a transformers call's arguments → kernel layout.

Delta rules. A GDN or KDA decode call hands its one-token function ``query``/``key`` [B, T, G, K]
(one row per key head, the group), ``value`` [B, T, H, V], the log-decay ``g`` ([B, T, H]; KDA:
[B, T, H, K]) and ``beta`` [B, T, H], in the model's dtype. The kernels take (:class:`StepInputs`,
kernel layout):

- ``k = k̂``, ``q = q̂ / √K`` [B, T, G, K], where ``x̂ = x / √(Σx² + ε)`` when the call asks for the
  l2 norm, else ``x``;
- ``w = β v`` [B, T, H, V];
- ``decay = exp(g)`` and ``beta``, fp32.

Mamba-2. A decode call hands ``selective_state_update`` ``hidden_states`` x [B, H, P], ``dt``
[B, H, P], ``A`` [H, P, N], ``B``/``C`` [B, G, N], ``D`` and ``dt_bias`` [H, P], each constant along
P and N (a prefill call continuing a state: x [B, T, H, P], dt [B, T, H], A, D, dt_bias [H], B/C
[B, T, G, N]). With ``δ = softplus(dt + dt_bias)`` (rounded to the model's dtype at each step, as
the torch function computes it; no softplus unless the call asks): ``k = B``, ``q = C``,
``w = δ x``, ``decay = exp(δ A)``, ``skip = D x``.

k, q, w and skip are stored in ``dtype`` (the window buffer's); everything is computed in fp32. In
torch these are ten to twenty elementwise kernels per layer and step (casts, norms, products,
group expansions), each a launch on the decode step's critical path; here they are one. The torch
form of the same math, :meth:`~sketchcal.models.base.FamilyAdapter.inputs`, is the reference the
tests hold this against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sketchcal.kernels.common.pool import next_pow2
from sketchcal.kernels.common.recurrence import StepInputs

L2NORM_EPS = 1e-6  # transformers' GDN and KDA l2 norms: x / √(Σx² + 1e-6)


@triton.jit
def _prepare_kernel(
    q, k, v, g, beta,  # inputs, contiguous: [BT, G, K], [BT, G, K], [BT, H, V], [BT, H(, K)], [BT, H]
    q_out, k_out, w_out, decay_out, beta_out,
    scale, eps,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, PER_KEY: tl.constexpr,
):  # fmt: skip
    """One program per (token of a sequence, head): the head's w, decay and beta, and, for the
    first head of each group, the group's normalised k and scaled q."""
    bt = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    rep: tl.constexpr = H // G
    ok = tl.arange(0, BK)
    ov = tl.arange(0, BV)
    mk = ok < K
    mv = ov < V
    b = tl.load(beta + bt * H + h).to(tl.float32)
    tl.store(beta_out + bt * H + h, b)
    vv = tl.load(v + (bt * H + h) * V + ov, mask=mv, other=0.0).to(tl.float32)
    tl.store(w_out + (bt * H + h) * V + ov, (b * vv).to(w_out.dtype.element_ty), mask=mv)
    if PER_KEY:
        gg = tl.load(g + (bt * H + h) * K + ok, mask=mk, other=0.0).to(tl.float32)
        tl.store(decay_out + (bt * H + h) * K + ok, tl.exp(gg), mask=mk)
    else:
        tl.store(decay_out + bt * H + h, tl.exp(tl.load(g + bt * H + h).to(tl.float32)))
    if h % rep == 0:
        grp = h // rep
        base = (bt * G + grp) * K
        kk = tl.load(k + base + ok, mask=mk, other=0.0).to(tl.float32)
        qq = tl.load(q + base + ok, mask=mk, other=0.0).to(tl.float32)
        if L2NORM:
            kk = kk / tl.sqrt(tl.sum(kk * kk, axis=0) + eps)
            qq = qq / tl.sqrt(tl.sum(qq * qq, axis=0) + eps)
        tl.store(k_out + base + ok, kk.to(k_out.dtype.element_ty), mask=mk)
        tl.store(q_out + base + ok, (qq * scale).to(q_out.dtype.element_ty), mask=mk)


def delta_rule_inputs(
    query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, *, l2norm: bool, dtype: torch.dtype
) -> StepInputs:
    """Kernel-layout :class:`StepInputs` of a GDN / KDA call (shapes in the module docstring): k, q
    [B, T, G, K] and w [B, T, H, V] in ``dtype``, decay [B, T, H] or [B, T, H, K] and beta [B, T, H]
    fp32, all contiguous."""
    b, t, grp, kd = key.shape
    heads, vd = value.shape[-2:]
    per_key = g.dim() == 4
    if query.shape != key.shape or value.shape[:2] != (b, t) or heads % grp:
        raise ValueError(
            f"query/key must be [B, T, G, K] and value [B, T, H, V] with G dividing H; got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    dshape = (b, t, heads, kd) if per_key else (b, t, heads)
    if tuple(g.shape) != dshape or tuple(beta.shape) != (b, t, heads):
        got = f"{list(g.shape)}, {list(beta.shape)}"
        raise ValueError(f"g must be {list(dshape)} and beta [B, T, H]; got {got}")
    q_in, k_in, v_in, g_in, b_in = (x.contiguous() for x in (query, key, value, g, beta))
    k_out = torch.empty((b, t, grp, kd), dtype=dtype, device=key.device)
    q_out = torch.empty_like(k_out)
    w_out = torch.empty((b, t, heads, vd), dtype=dtype, device=key.device)
    decay = torch.empty(dshape, dtype=torch.float32, device=key.device)
    beta_out = torch.empty((b, t, heads), dtype=torch.float32, device=key.device)
    if b * t:
        _prepare_kernel[(b * t, heads)](
            q_in, k_in, v_in, g_in, b_in, q_out, k_out, w_out, decay, beta_out,
            kd**-0.5, L2NORM_EPS,
            H=heads, G=grp, K=kd, V=vd, BK=next_pow2(kd), BV=next_pow2(vd), L2NORM=l2norm, PER_KEY=per_key,
            num_warps=1 if max(kd, vd) <= 128 else 2,
        )  # fmt: skip
    return StepInputs(k=k_out, q=q_out, w=w_out, decay=decay, beta=beta_out)


@triton.jit
def _softplus(x):
    """torch's softplus (threshold 20): log(1 + eˣ), with log1p's accuracy where eˣ is small."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    d = u - 1.0
    lp = tl.where(d == 0.0, e, tl.log(u) * (e / tl.where(d == 0.0, 1.0, d)))
    return tl.where(x > 20.0, x, lp)


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (to nearest, ties to even) and back, as torch rounds a result.
    bf16 by its bits: the CPU interpreter's casts to bf16 truncate."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        out = bits.to(tl.float32, bitcast=True)
    else:
        out = x.to(dtype).to(tl.float32)
    return out


@triton.jit
def _mamba2_prepare_kernel(
    x, dt, a, d, dt_bias, bmat, cmat,  # x [BT, H, P], bmat/cmat [BT, G, N] contiguous; the rest strided
    k_out, q_out, w_out, decay_out, skip_out,
    s_dt, s_dth, s_a, s_d, s_bias,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BP: tl.constexpr, BN: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """One program per (token of a sequence, head): the head's decay, w and skip, and, for the
    first head of each group, the group's k and q."""
    bt = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    rep: tl.constexpr = H // G
    model_dtype = dt.dtype.element_ty
    delta = tl.load(dt + bt * s_dt + h * s_dth).to(tl.float32)
    if HAS_BIAS:  # dt + dt_bias in the model's dtype, as the torch function adds them
        delta = _rounded(delta + tl.load(dt_bias + h * s_bias).to(tl.float32), model_dtype)
    if SOFTPLUS:
        delta = _rounded(_softplus(delta), model_dtype)
    tl.store(decay_out + bt * H + h, tl.exp(delta * tl.load(a + h * s_a).to(tl.float32)))
    op = tl.arange(0, BP)
    mp = op < P
    xx = tl.load(x + (bt * H + h) * P + op, mask=mp, other=0.0).to(tl.float32)
    tl.store(w_out + (bt * H + h) * P + op, (delta * xx).to(w_out.dtype.element_ty), mask=mp)
    if HAS_D:
        dd = tl.load(d + h * s_d).to(tl.float32)
        tl.store(skip_out + (bt * H + h) * P + op, (dd * xx).to(skip_out.dtype.element_ty), mask=mp)
    if h % rep == 0:
        on = tl.arange(0, BN)
        mn = on < N
        base = (bt * G + h // rep) * N
        tl.store(k_out + base + on, tl.load(bmat + base + on, mask=mn).to(k_out.dtype.element_ty), mask=mn)
        tl.store(q_out + base + on, tl.load(cmat + base + on, mask=mn).to(q_out.dtype.element_ty), mask=mn)


def mamba2_inputs(
    x: Tensor, dt: Tensor, a: Tensor, bm: Tensor, cm: Tensor, d: Tensor | None, bias: Tensor | None, *,
    softplus: bool, dtype: torch.dtype,
) -> StepInputs:  # fmt: skip
    """Kernel-layout :class:`StepInputs` of a Mamba-2 call's x [B, T, H, P], dt [B, T, H], A [H],
    B, C [B, T, G, N], D and dt_bias [H] (or None; a one-token call's per-head parameters taken from
    their broadcasts by the adapter): k, q [B, T, G, N], w and skip [B, T, H, P] in ``dtype``, decay
    [B, T, H] fp32, all contiguous."""
    b, t, heads, pd = x.shape
    grp, nd = bm.shape[-2:]
    if heads % grp or tuple(bm.shape) != (b, t, grp, nd) or cm.shape != bm.shape:
        raise ValueError(
            f"x must be [B, T, H, P] and B, C [B, T, G, N] with G dividing H; got x {tuple(x.shape)}, "
            f"B {tuple(bm.shape)}, C {tuple(cm.shape)}"
        )
    dt2 = dt.reshape(b * t, heads)
    x_in, b_in, c_in = (v.contiguous() for v in (x, bm, cm))
    k_out = torch.empty((b, t, grp, nd), dtype=dtype, device=x.device)
    q_out = torch.empty_like(k_out)
    w_out = torch.empty((b, t, heads, pd), dtype=dtype, device=x.device)
    skip = None if d is None else torch.empty_like(w_out)
    decay = torch.empty((b, t, heads), dtype=torch.float32, device=x.device)
    if b * t:
        _mamba2_prepare_kernel[(b * t, heads)](
            x_in, dt2, a, a if d is None else d, a if bias is None else bias, b_in, c_in,
            k_out, q_out, w_out, decay, w_out if skip is None else skip,
            dt2.stride(0), dt2.stride(1), a.stride(0), 0 if d is None else d.stride(0),
            0 if bias is None else bias.stride(0),
            H=heads, G=grp, P=pd, N=nd, BP=next_pow2(pd), BN=next_pow2(nd),
            SOFTPLUS=softplus, HAS_D=d is not None, HAS_BIAS=bias is not None,
            num_warps=1,
        )  # fmt: skip
    return StepInputs(k=k_out, q=q_out, w=w_out, decay=decay, beta=None, skip=skip)
