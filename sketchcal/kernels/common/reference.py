"""Float64 references of the serving API, over a :class:`~sketchcal.kernels.common.pool.DecodePool`,
the sketch's write and read (:func:`sketch_write`, :func:`sketch_read`), and the adaptive sketch's
flush-time factors and read (:func:`adaptive_factor`, :func:`adaptive_read`), which the reference
runtime (``sketchcal.runtime``) uses too.

Thin wrappers: every number comes from ``recurrence.step`` / ``recurrence.recurrence`` /
``recurrence.product_form_read`` and the two sketch functions, run on one slot's window at a
time. They update the pool in place exactly as the kernels must (casting back to the pool's
dtypes) and return the outputs [B, T, H, V] in float64, NaN for padding entries. Inputs use the
kernel layout documented in ``pool.py`` (k, q per group). Quantisation already present in the
pool (a bf16 read copy or sketch) is read as stored, so a kernel and its reference see the same
numbers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sketchcal.kernels.common.pool import AdaptiveSketch, DecodePool, SketchTables, expand_groups
from sketchcal.kernels.common.recurrence import StepInputs, product_form_read, read, recurrence

F64 = torch.float64


def sketch_write(rows: Tensor, s: Tensor) -> Tensor:
    """The sketch ``(R S)_{:M}`` [..., H, M, V] of states ``s`` [..., H, K, V]; ``rows`` [H, M, K] are
    each head's frame rows, zero past its rank (``SketchTables.sketch_rows``), so those rows are 0.
    Computed in ``s``'s dtype."""
    return torch.einsum("hmk,...hkv->...hmv", rows.to(s.dtype), s)


def sketch_read(
    maps: Tensor, sketch: Tensor, u: Tensor, dense: Tensor | None = None, full: Tensor | None = None
) -> Tensor:
    """Checkpoint term ``(R S)_{:m}ᵀ (P u)`` of reads with effective queries ``u`` [..., P, H, K]
    → [..., P, H, V], from ``sketch`` [..., H, M, V] and the model-frame maps ``maps`` [H, M, K]
    (zero past each head's rank, so a sketch's unused rows never count). Heads where ``dense`` [H]
    (bool) is set read ``full`` [..., H, K, V] (the read copy) exactly instead. Computed in ``u``'s
    dtype."""
    coeff = torch.einsum("hmk,...phk->...phm", maps.to(u.dtype), u)
    out = torch.einsum("...hmv,...phm->...phv", sketch.to(u.dtype), coeff)
    return _dense_reads(out, u, dense, full)


def _dense_reads(out: Tensor, u: Tensor, dense: Tensor | None, full: Tensor | None) -> Tensor:
    """``out`` with the heads where ``dense`` [H] is set read exactly from ``full`` [..., H, K, V]."""
    if dense is not None and full is not None:
        out[..., dense, :] = read(full[..., dense, :, :].to(u.dtype).unsqueeze(-4), u[..., dense, :])
    return out


def adaptive_factor(rows: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """Flush-time factors of the adaptive sketch of states ``s`` [..., H, K, V] on the offline bases
    ``rows`` [H, M, K] (each head's basis Bᵀ, zero past its rank, as ``SketchTables.sketch_rows``).

    Per head: ``Mₛ = Sᵀ B`` [V, M]; ``Q`` [V, M] = its left singular vectors, largest first, an
    orthonormal basis of span(Sᵀ B) (the issue's ``orth(Mₛ)``; a kernel may take it from the M × M
    Gram and a Cholesky factor), columns past the rank of Mₛ zero (a head's unused rows, a
    rank-deficient state, M > V); ``P_S = Qᵀ Sᵀ`` [M, K]. Returns ``(Q, P_S)``: [..., H, V, M] and
    [..., H, M, K] in ``s``'s dtype, computed in float64 (the singular vectors of a direction
    σ < σ_max·max(V, M)·2⁻⁵² are dropped as noise). The read ``Q (P_S u)`` (:func:`adaptive_read`)
    is ``Sᵀu`` projected orthogonally onto span(Sᵀ B).
    """
    sd = s.to(F64)
    m = torch.einsum("...hkv,hmk->...hvm", sd, rows.to(F64))
    u, sigma, _ = torch.linalg.svd(m, full_matrices=False)  # u [..., V, min(V, M)]
    tol = sigma[..., :1] * max(m.shape[-2:]) * torch.finfo(F64).eps
    q = u * (sigma > tol).to(F64).unsqueeze(-2)
    q = torch.nn.functional.pad(q, (0, m.shape[-1] - q.shape[-1]))
    p = torch.einsum("...hvm,...hkv->...hmk", q, sd)
    return q.to(s.dtype), p.to(s.dtype)


def adaptive_read(
    q: Tensor, p: Tensor, u: Tensor, dense: Tensor | None = None, full: Tensor | None = None
) -> Tensor:
    """Checkpoint term ``Q (P_S u)`` of reads with effective queries ``u`` [..., P, H, K] →
    [..., P, H, V], from the flush's factors ``q`` [..., H, V, M] and ``p`` [..., H, M, K]
    (:func:`adaptive_factor`). Heads where ``dense`` [H] is set read ``full`` [..., H, K, V] exactly,
    as in :func:`sketch_read`. Computed in ``u``'s dtype."""
    coeff = torch.einsum("...hmk,...phk->...phm", p.to(u.dtype), u)
    out = torch.einsum("...hvm,...phm->...phv", q.to(u.dtype), coeff)
    return _dense_reads(out, u, dense, full)


def _stored(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` as stored in a read copy or sketch of ``dtype``: rounded to nearest even; fp8 saturates
    at its largest finite value, as the kernels' conversion does (the rule of
    ``sketchcal.runtime.precision.store``, not imported: the kernels run without the runtime's
    transformers dependency)."""
    if dtype.itemsize == 1 and dtype.is_floating_point:
        fmax = torch.finfo(dtype).max
        t = t.clamp(-fmax, fmax)
    return t.to(dtype)


def _family(name: str):
    from sketchcal.kernels.common import family

    return family(name)


def _entries(x: StepInputs, b: int) -> StepInputs:
    """Batch entry ``b`` of kernel-layout inputs, float64, shape [T, ...]."""
    return x.map(lambda t: t[b].to(F64))


def _buffered(pool: DecodePool, s: int, n: int, skip: bool, read: bool) -> StepInputs:
    """The first ``n`` buffered tokens of slot ``s`` in kernel layout ([n, G, K], ...); their
    queries and skips are zero (their outputs are never used). ``read``: the decays as a read
    sees them (from ``buf_logdecay`` where the pool has it)."""
    k = pool.buf_k[s, :, :n].transpose(0, 1).to(F64)
    w = pool.buf_w[s, :, :n].transpose(0, 1).to(F64)
    if read and pool.buf_logdecay is not None:
        decay = torch.exp2(pool.buf_logdecay[s, :, :n].to(F64))
    else:
        decay = pool.buf_decay[s, :, :n].to(F64)
    return StepInputs(
        k=k, q=torch.zeros_like(k), w=w, decay=decay.transpose(0, 1),
        beta=None if pool.buf_beta is None else pool.buf_beta[s, :, :n].transpose(0, 1).to(F64),
        skip=torch.zeros_like(w) if skip else None,
    )  # fmt: skip


def _concat(a: StepInputs, b: StepInputs | None) -> StepInputs:
    if b is None:
        return a
    return StepInputs(
        **{
            name: None if getattr(a, name) is None else torch.cat([getattr(a, name), getattr(b, name)], dim=0)
            for name in ("k", "q", "w", "decay", "beta", "skip")
        }
    )


def _window(pool: DecodePool, s: int, n: int, x: StepInputs | None, b: int, read: bool) -> StepInputs:
    """Buffered tokens [0, n) of slot ``s`` followed by batch entry ``b`` of ``x``, in reference
    layout (groups expanded to heads), float64; ``read`` as for :func:`_buffered`."""
    has_skip = x is not None and x.skip is not None
    win = _concat(_buffered(pool, s, n, has_skip, read), None if x is None else _entries(x, b))
    return expand_groups(win, pool.heads)


def _store_tokens(pool: DecodePool, s: int, p: int, x: StepInputs, b: int) -> None:
    """Append batch entry ``b`` of ``x`` to slot ``s``'s buffer at positions p, p+1, ...
    (entries past the capacity are dropped)."""
    for t in range(x.num_tokens):
        j = p + t
        if j >= pool.capacity:
            break
        pool.buf_k[s, :, j] = x.k[b, t].to(pool.buf_k.dtype)
        pool.buf_w[s, :, j] = x.w[b, t].to(pool.buf_w.dtype)
        pool.buf_decay[s, :, j] = x.decay[b, t].to(pool.buf_decay.dtype)
        if pool.buf_logdecay is not None:
            pool.buf_logdecay[s, :, j] = x.decay[b, t].float().log2().to(pool.buf_logdecay.dtype)
        if pool.buf_beta is not None:
            pool.buf_beta[s, :, j] = x.beta[b, t].to(pool.buf_beta.dtype)


def _outputs(x: StepInputs, heads: int) -> Tensor:
    b, t = x.w.shape[:2]
    return torch.full((b, t, heads, x.w.shape[-1]), float("nan"), dtype=F64, device=x.w.device)


def standard_step(family: str, pool: DecodePool, slots: Tensor, x: StepInputs) -> Tensor:
    """Read, update and write ``pool.state`` for each addressed slot (T tokens in sequence)."""
    fam = _family(family)
    out = _outputs(x, pool.heads)
    for b, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        o, st = recurrence(fam, expand_groups(_entries(x, b), pool.heads), pool.state[s].to(F64))
        pool.state[s] = st.to(pool.state.dtype)
        out[b] = o
    return out


def spec_verify(
    family: str, pool: DecodePool, slots: Tensor, pos: Tensor, x: StepInputs,
    tables: SketchTables | None = None, adaptive: AdaptiveSketch | None = None,
) -> Tensor:  # fmt: skip
    """Outputs of T tokens after the ``pos[b]`` buffered ones, from checkpoint + buffer, without
    materialising a state; the T tokens are appended to the buffer. ``tables`` None reads the
    full read copy (replay), else the sketch; ``adaptive``: each slot's adaptive factors
    (:func:`adaptive_read`; its ``tables`` are the layer's)."""
    if adaptive is not None:
        tables = adaptive.tables
    fam = _family(family)
    out = _outputs(x, pool.heads)
    nt = x.num_tokens
    for b, (s, p) in enumerate(zip(slots.tolist(), pos.tolist(), strict=True)):
        if s < 0:
            continue
        win = _window(pool, s, p, x, b, read=True)
        if tables is None:
            o, _ = product_form_read(fam, pool.read[s].to(F64), win)
        else:
            o, u = product_form_read(fam, torch.zeros_like(pool.state[s], dtype=F64), win)
            full = None if pool.read is None else pool.read[s]
            if adaptive is None:
                sketch = pool.sketch[s, :, : tables.map_rows]
                o = o + sketch_read(tables.maps, sketch, u, tables.ranks == 0, full)
            else:
                q = adaptive.rows[s].transpose(-1, -2)
                o = o + adaptive_read(q, adaptive.maps[s], u, tables.ranks == 0, full)
        out[b] = o[p : p + nt]
        _store_tokens(pool, s, p, x, b)
    return out


def replay_step(family: str, pool: DecodePool, slots: Tensor, pos: Tensor, x: StepInputs) -> Tensor:
    """Non-flush ReplaySSM step: read copy + buffer; the token joins the buffer at ``pos``."""
    return spec_verify(family, pool, slots, pos, x)


def sketch_step(
    family: str, pool: DecodePool, tables: SketchTables, slots: Tensor, pos: Tensor, x: StepInputs,
    adaptive: AdaptiveSketch | None = None,
) -> Tensor:  # fmt: skip
    """Non-flush SketchSSM step: sketch rows R_{:m} S_c + buffer (dense heads: the read copy), or
    with ``adaptive`` each slot's adaptive factors."""
    return spec_verify(family, pool, slots, pos, x, tables, adaptive)


def flush(
    family: str, pool: DecodePool, slots: Tensor, pos: Tensor, x: StepInputs | None = None,
    tables: SketchTables | None = None, adaptive: AdaptiveSketch | None = None,
) -> Tensor | None:  # fmt: skip
    """Fold the ``pos[b]`` buffered tokens (then ``x``'s one token, if given, whose output is
    returned) exactly into the fp32 checkpoint; refresh the read copy (all rows, or
    ``tables.read_rows``) and, with ``tables``, the sketch R_{:m} S_c of every head of rank m;
    with ``adaptive``, then the slot's adaptive factors of the new checkpoint
    (:func:`adaptive_factor`, stored as ``adaptive.rows`` = Qᵀ and ``adaptive.maps`` = P_S)."""
    if adaptive is not None:
        tables = adaptive.tables
    fam = _family(family)
    out = None if x is None else _outputs(x, pool.heads)
    bases = None if tables is None else tables.sketch_rows()  # [H, M, K], the same for every slot
    for b, (s, n) in enumerate(zip(slots.tolist(), pos.tolist(), strict=True)):
        if s < 0:
            continue
        win = _window(pool, s, n, x, b, read=False)
        o, st = recurrence(fam, win, pool.state[s].to(F64))
        pool.state[s] = st.to(pool.state.dtype)
        if out is not None:
            out[b] = o[-1:]
        if pool.read is not None:
            rows = [pool.state.shape[2]] * pool.heads if tables is None else tables.read_rows.tolist()
            for h, r in enumerate(rows):
                pool.read[s, h, :r] = _stored(st[h, :r], pool.read.dtype)
        if tables is not None and pool.sketch is not None:  # rows past a head's rank stay as they are
            old = pool.sketch[s, :, : tables.map_rows]
            new = _stored(sketch_write(bases, st), pool.sketch.dtype)
            old.copy_(torch.where(tables.rank_mask()[..., None], new, old))
        if adaptive is not None:
            q, p = adaptive_factor(bases, st)
            adaptive.rows[s] = _stored(q.transpose(-1, -2), adaptive.rows.dtype)
            adaptive.maps[s] = _stored(p, adaptive.maps.dtype)
    return out
