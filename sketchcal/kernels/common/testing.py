"""Random pools and inputs in the kernel layouts (``pool.py``), for the tests and the benchmark.

Values follow the models' ranges: l2-normalised keys (queries also scaled by K^-½) and β in
(0, 1) for the delta rules, decays in (0.8, 1), so states stay bounded over many steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sketchcal.kernels.common.pool import AdaptiveSketch, DecodePool, allocate_pool
from sketchcal.kernels.common.recurrence import StepInputs


def _rand(shape, generator, device, low=None, high=None) -> Tensor:
    """Normal (or uniform in [low, high)) samples; drawn on ``device`` directly when no
    generator is given (large benchmark pools), else on the CPU for reproducibility."""
    where = "cpu" if generator is not None else device
    if low is None:
        x = torch.randn(shape, generator=generator, device=where)
    else:
        x = low + (high - low) * torch.rand(shape, generator=generator, device=where)
    return x.to(device)


def random_inputs(
    family: str, batch: int, tokens: int, heads: int, groups: int, key_dim: int, value_dim: int, *,
    dtype: torch.dtype = torch.bfloat16, device="cpu", generator: torch.Generator | None = None,
    skip: bool | None = None,
) -> StepInputs:  # fmt: skip
    """Kernel-layout inputs [B, T, ...]; ``skip`` defaults to True for Mamba-2 only."""
    g = generator
    b, t, h, gr, kd, vd = batch, tokens, heads, groups, key_dim, value_dim
    dev = device
    k = _rand((b, t, gr, kd), g, dev)
    q = _rand((b, t, gr, kd), g, dev)
    v = _rand((b, t, h, vd), g, dev)
    beta = None
    if family == "mamba2":
        k, q = 0.3 * k, 0.3 * q
        w = 0.5 * v
    else:
        k = torch.nn.functional.normalize(k, dim=-1)
        q = torch.nn.functional.normalize(q, dim=-1) * kd**-0.5
        beta = _rand((b, t, h), g, dev, 0.1, 0.9)
        w = beta[..., None] * v
    dshape = (b, t, h, kd) if family == "kda" else (b, t, h)
    decay = _rand(dshape, g, dev, 0.8, 1.0)
    if skip is None:
        skip = family == "mamba2"
    sk = 0.5 * _rand((b, t, h, vd), g, dev) if skip else None
    x = StepInputs(k=k, q=q, w=w, decay=decay, beta=beta, skip=sk)
    return StepInputs(
        k=x.k.to(device, dtype), q=x.q.to(device, dtype), w=x.w.to(device, dtype), decay=x.decay.to(device),
        beta=None if beta is None else x.beta.to(device),
        skip=None if sk is None else x.skip.to(device, dtype),
    )  # fmt: skip


def random_pool(
    family: str, slots: int, heads: int, groups: int, key_dim: int, value_dim: int, *, capacity: int = 0,
    read_dtype: torch.dtype | None = torch.bfloat16, sketch_rows: int = 0,
    input_dtype: torch.dtype = torch.bfloat16, device="cpu", generator: torch.Generator | None = None,
) -> DecodePool:  # fmt: skip
    """A pool with random states, read copy = the state cast to ``read_dtype``, random buffered
    tokens in every entry and a random sketch."""
    pool = allocate_pool(
        family, slots, heads, groups, key_dim, value_dim, capacity=capacity, read_dtype=read_dtype,
        sketch_rows=sketch_rows, input_dtype=input_dtype, device=device,
    )  # fmt: skip
    pool.state.copy_(0.3 * _rand(pool.state.shape, generator, device))
    if pool.read is not None:
        pool.read.copy_(pool.state)
    if pool.sketch is not None:
        pool.sketch.copy_(0.3 * _rand(pool.sketch.shape, generator, device))
    if capacity > 0:
        x = random_inputs(
            family, slots, capacity, heads, groups, key_dim, value_dim, dtype=input_dtype, device=device,
            generator=generator, skip=False,
        )  # fmt: skip
        pool.buf_k.copy_(x.k.transpose(1, 2))
        pool.buf_w.copy_(x.w.transpose(1, 2))
        pool.buf_decay.copy_(x.decay.transpose(1, 2))
        if pool.buf_logdecay is not None:
            pool.buf_logdecay.copy_(pool.buf_decay.log2())
        if pool.buf_beta is not None:
            pool.buf_beta.copy_(x.beta.transpose(1, 2))
    return pool


def paged(pool: DecodePool, *, lead_bytes: int = 64) -> DecodePool:
    """The same values in the layout of vLLM's pages: one byte page per slot that holds
    ``lead_bytes`` of something else (vLLM's conv state), then each tensor's slot part, one after
    the other; the state value-major (vLLM's layout), and the read copy the state itself when it is
    fp32 (as the plugin's pages keep it); a Mamba-2 sketch pool's workspace too."""
    return paged_adaptive(pool, None, lead_bytes=lead_bytes)[0]


def paged_adaptive(
    pool: DecodePool, adaptive: AdaptiveSketch | None, *, lead_bytes: int = 64
) -> tuple[DecodePool, AdaptiveSketch | None]:
    """:func:`paged`, with the adaptive factors ``adaptive`` (if given) in the same pages: Qᵀ in
    the pool's sketch rows (:meth:`AdaptiveSketch.allocate`), P_S after the pool's tensors (as the
    plugin's pages keep them)."""
    tensors = pool.tensors()
    if pool.workspace is not None:
        tensors["workspace"] = pool.workspace
    if tensors.get("read") is not None and tensors["read"].dtype == torch.float32:
        del tensors["read"]
    if adaptive is not None:
        if adaptive.rows is not pool.sketch:
            raise ValueError("paged_adaptive lays out factors whose Qᵀ is the pool's sketch")
        tensors["adaptive_maps"] = adaptive.maps
    parts = {name: t[0].numel() * t.element_size() for name, t in tensors.items()}
    page = lead_bytes + sum(-(-b // 16) * 16 for b in parts.values())
    raw = torch.zeros(pool.slots, page, dtype=torch.uint8, device=pool.state.device)
    out, offset = {}, lead_bytes
    for name, t in tensors.items():
        size = t.element_size()
        flat = raw.view(t.dtype)[:, offset // size : (offset + parts[name]) // size]
        if name == "state":  # [N, H, V, K] in the page, seen as [N, H, K, V]
            n, h, kd, vd = t.shape
            view = flat.view(n, h, vd, kd).transpose(-1, -2)
        else:
            view = flat.view(t.shape)
        view.copy_(t)
        out[name] = view
        offset += -(-parts[name] // 16) * 16
    if "read" not in out and pool.read is not None:
        out["read"] = out["state"]
    factors = None
    if adaptive is not None:
        factors = AdaptiveSketch(adaptive.tables, out["sketch"], out.pop("adaptive_maps"))
    return DecodePool(**out), factors
