"""The delta rules' decode inputs in one kernel: a transformers call's arguments → kernel layout.

A GDN or KDA decode call hands its one-token function ``query``/``key`` [B, T, G, K] (one row per
key head, the group), ``value`` [B, T, H, V], the log-decay ``g`` ([B, T, H]; KDA: [B, T, H, K])
and ``beta`` [B, T, H], in the model's dtype. The kernels take (:class:`StepInputs`, kernel
layout):

- ``k = k̂``, ``q = q̂ / √K`` [B, T, G, K], where ``x̂ = x / √(Σx² + ε)`` when the call asks for the
  l2 norm, else ``x``;
- ``w = β v`` [B, T, H, V];
- ``decay = exp(g)`` and ``beta``, fp32.

k, q and w are stored in ``dtype`` (the window buffer's); everything is computed in fp32. In torch
these are some twenty elementwise kernels per layer and step (casts, norms, products), each a
launch on the decode step's critical path; here they are one. The torch form of the same math,
:meth:`~sketchcal.models.base.FamilyAdapter.inputs`, is the reference the tests hold this against.
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
