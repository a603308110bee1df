"""Family-independent reference math for ``S_t = A_t S_{t-1} + k_t w_tᵀ`` and ``o_t = S_tᵀ q_t``.

Every family (Mamba-2, GDN, KDA) differs only in its transition ``A_t``; a :class:`Family`
says how to apply ``A_t`` and ``A_tᵀ``. Everything else (the plain recurrence, the ReplaySSM
product form) is written once here, for any float dtype; the tests and the
calibration run it in float64.

Layouts, key-major, groups already expanded to heads:

    k, q    [..., T, H, K]
    w       [..., T, H, V]      (β·v for delta rules, dt·x for Mamba-2)
    decay   [..., T, H]         scalar per head (Mamba-2, GDN) or
            [..., T, H, K]      per key channel (KDA); linear scale, not log
    beta    [..., T, H]         or None (Mamba-2)
    skip    [..., T, H, V]      term added to every read (Mamba-2's D·x) or None
    state   [..., H, K, V]
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Protocol

import torch
from torch import Tensor


class Family(Protocol):
    """How one family's transition ``A_t`` acts; shapes as in the module docstring, no T dim."""

    name: str

    def apply(self, s: Tensor, k: Tensor, decay: Tensor, beta: Tensor | None) -> Tensor:
        """``A s`` for ``s`` of shape [..., H, K, N] (any N)."""
        ...

    def apply_t(self, u: Tensor, k: Tensor, decay: Tensor, beta: Tensor | None) -> Tensor:
        """``Aᵀ u`` for ``u`` of shape [..., H, K]."""
        ...

    def matrix(self, k: Tensor, decay: Tensor, beta: Tensor | None) -> Tensor:
        """The explicit transition, [..., H, K, K] (for brute-force checks)."""
        ...


@dataclass
class StepInputs:
    """Per-token inputs of one mixer layer in the design's key-major layout (see module docstring)."""

    k: Tensor
    q: Tensor
    w: Tensor
    decay: Tensor
    beta: Tensor | None = None
    skip: Tensor | None = None

    # the dims (fields without annotations: not dataclass fields)
    num_tokens = property(lambda self: self.k.shape[-3], doc="T, the tokens per sequence")
    num_heads = property(lambda self: self.k.shape[-2], doc="H (G for kernel-layout keys)")
    key_dim = property(lambda self: self.k.shape[-1], doc="K")
    value_dim = property(lambda self: self.w.shape[-1], doc="V")

    def map(self, fn) -> StepInputs:
        """Apply ``fn`` to every tensor field (None stays None)."""
        present = [f.name for f in fields(self) if getattr(self, f.name) is not None]
        changed = {name: fn(getattr(self, name)) for name in present}
        return replace(self, **changed)

    def to(self, *args, **kwargs) -> StepInputs:
        return self.map(lambda t: t.to(*args, **kwargs))

    def tokens(self, index) -> StepInputs:
        """Select tokens along the T dim (``index``: int or slice); T sits right after the batch dims."""
        tdim = self.k.dim() - 3
        return self.map(lambda t: t[(slice(None),) * tdim + (index,)])


def identity_value(name: str) -> float:
    """The value of input ``name`` (a :class:`StepInputs` field) in an identity token: decay 1,
    everything else (k, q, w, beta, skip) 0, so ``A_t = I`` and the token adds nothing."""
    return 1.0 if name == "decay" else 0.0


def identity_tokens(x: StepInputs, valid: Tensor) -> StepInputs:
    """Replace the tokens where ``valid`` ([..., T] bool) is False by identity transitions
    (:func:`identity_value`): padding then leaves the state untouched in every family.
    """
    out = {}
    for f in fields(x):
        t = getattr(x, f.name)
        if t is None:
            continue
        m = valid.reshape(valid.shape + (1,) * (t.dim() - valid.dim()))
        out[f.name] = torch.where(m, t, torch.full_like(t, identity_value(f.name)))
    return replace(x, **out)


def step(family: Family, s: Tensor, x: StepInputs) -> Tensor:
    """One token: ``A s + k wᵀ``. ``x`` holds one token (no T dim); ``s`` is [..., H, K, V]."""
    return family.apply(s, x.k, x.decay, x.beta) + x.k.unsqueeze(-1) * x.w.unsqueeze(-2)


def read(s: Tensor, q: Tensor) -> Tensor:
    """``Sᵀ q``: [..., H, K, V] × [..., H, K] → [..., H, V]."""
    return torch.einsum("...kv,...k->...v", s, q)


def recurrence(family: Family, x: StepInputs, s0: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Token-by-token recurrence. Returns the outputs [..., T, H, V] and the final state.

    Outputs are ``S_tᵀ q_t`` plus ``skip`` where present.
    """
    lead = x.k.shape[:-3]
    h, kd, vd = x.num_heads, x.key_dim, x.value_dim
    s = s0 if s0 is not None else x.k.new_zeros(*lead, h, kd, vd)
    outs = []
    for t in range(x.num_tokens):
        xt = x.tokens(t)
        s = step(family, s, xt)
        outs.append(read(s, xt.q))
    o = torch.stack(outs, dim=len(lead)) if outs else x.w.new_zeros(*lead, 0, h, vd)
    if x.skip is not None:
        o = o + x.skip
    return o, s


def effective_queries(family: Family, x: StepInputs) -> Tensor:
    """``u_p = M_pᵀ q_p`` for the p-th token after a checkpoint (p = 1..P), [..., P, H, K].

    ``M_p = A_p ⋯ A_1``, so ``u_p = A_1ᵀ ⋯ A_pᵀ q_p``: one backward sweep over the window.
    """
    return product_form_read(family, None, x)[1]


def product_form_read(family: Family, s_c: Tensor | None, x: StepInputs) -> tuple[Tensor | None, Tensor]:
    """ReplaySSM read of a window from its checkpoint, without materialising any state.

    ``x`` holds the P tokens after the checkpoint ``s_c`` ([..., H, K, V]). For every p:
    ``o_p = S_cᵀ u_p + W_pᵀ q_p`` where ``W_pᵀ q_p = Σ_{j≤p} w_j (k_j · A_{j+1}ᵀ⋯A_pᵀ q_p)``.
    Both terms come from one backward sweep, so the checkpoint is read once per token.

    Returns ``(o, u)``: outputs [..., P, H, V] (None when ``s_c`` is None) and the effective
    queries [..., P, H, K].
    """
    tdim = x.k.dim() - 3
    p_len = x.num_tokens
    v = x.q.clone()  # v[p] becomes A_{j+1}ᵀ⋯A_pᵀ q_p as j runs down from p
    buf = torch.zeros_like(x.w) if s_c is not None else None
    for j in range(p_len - 1, -1, -1):
        xj = x.tokens(j)
        tail = v.narrow(tdim, j, p_len - j)  # reads p ≥ j (0-based) have reached token j
        if buf is not None:
            coef = torch.einsum("...phk,...hk->...ph", tail, xj.k)
            buf.narrow(tdim, j, p_len - j).add_(coef.unsqueeze(-1) * xj.w.unsqueeze(tdim))
        # the token's transition, broadcast over the reads that have reached it
        new_tail = family.apply_t(
            tail,
            xj.k.unsqueeze(tdim),
            xj.decay.unsqueeze(tdim),
            None if xj.beta is None else xj.beta.unsqueeze(tdim),
        )
        v = torch.cat([v.narrow(tdim, 0, j), new_tail], dim=tdim)
    if s_c is None:
        return None, v
    o = torch.einsum("...hkv,...phk->...phv", s_c, v) + buf
    if x.skip is not None:
        o = o + x.skip
    return o, v
