"""Decode states of one mixer layer on the Triton kernels: a batch's states in one slot pool.

The ``triton`` backend of :func:`sketchcal.runtime.enable`. Each object holds a
:class:`DecodePool` of B slots (slot b = batch entry b) for one layer and one sequence batch, and
implements the protocol of :mod:`sketchcal.runtime.state` (``step``, ``draft``, ``accept``,
``state()``, ``ckpt``, ``pos``, ``flushes``, ``mode``), so :mod:`sketchcal.runtime.patch` drives
both backends alike:

- :class:`KernelStandardState` (``standard``): ``standard_step`` reads and writes the fp32 state
  at every token.
- :class:`KernelWindowState` (``replay``; ``sketch`` with kernel sketch tables): token p = 1..L−1
  after the checkpoint is ``replay_step`` / ``sketch_step`` (``spec_verify`` for several tokens
  of a teacher-forced call), token p = L is the ``flush`` with that token, in place on the pool.
  The first checkpoint (the model's own prefill state) gets its read copy and sketch rows from a
  zero-token flush, so every read copy and sketch comes from the kernels' one formula.

Decoding is lock-step: every batch entry is at the same position, so ``pos`` is a host int and the
int32 ``slots`` / ``pos`` tensors the kernels take are built once per state. A step launches
kernels only: no host synchronisation (no ``.item()``, ``.tolist()``, ``bool(tensor)``).

Inputs arrive as the runtime's :class:`StepInputs` (groups expanded to heads, k, q [B, T, H, K]);
the kernels take groups (k, q [B, T, G, K]): :func:`kernel_inputs` takes every (H/G)-th head.
Window kernels get k, q, w and skip in the buffer dtype (bf16 on CUDA by default, which the Gluon
flushes need; fp32 for exact replay and in the CPU interpreter), decay and beta in fp32. States
are key-major [B, H, K, V] fp32 (the standard pool stores its state value-major and hands out
the [B, H, K, V] view); outputs are returned as fp32 [B, T, H, V], skip included.

Speculative decoding: ``draft(x)`` reads T ≤ L tokens after the committed ones with
``spec_verify`` (appending them to the buffer). Drafts that reach the window end fold it with the
flush token into a second pool (allocated once, sharing nothing with the first) and read the
tokens after it from there; ``accept(k)`` either moves the cursor or, when the flush token is
accepted, swaps the two pools.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from sketchcal.artifact.sketch import SketchLayer
from sketchcal.errors import SketchcalError

# ---- the kernels: every name this backend takes from sketchcal/kernels/ (re-point here when they move) ----
from sketchcal.kernels.common import StepInputs
from sketchcal.kernels.common.pool import AdaptiveSketch, sketch_tables
from sketchcal.kernels.dispatch import (
    CHUNK_MIN,
    STANDARD_VALUE_MAJOR,
    DecodePool,
    allocate_pool,
    flush,
    replay_step,
    sketch_step,
    spec_verify,
    standard_step,
)
from sketchcal.kernels.dispatch import SketchTables as KernelTables

# --------------------------------------------------------------------------------------------------
from sketchcal.models.base import LayerShape
from sketchcal.runtime.precision import Precision, dtype_name, parse_dtype
from sketchcal.runtime.sketch import layer_tables
from sketchcal.runtime.state import Checkpoint, Probe

BUFFER_DTYPES = (torch.float32, torch.bfloat16)
READ_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)  # what the kernels are tested with

__all__ = [
    "BUFFER_DTYPES",
    "READ_DTYPES",
    "KernelStandardState",
    "KernelTables",
    "KernelWindowState",
    "buffer_dtype_for",
    "interpreting",
    "kernel_inputs",
    "kernel_tables",
    "make_kernel_state",
    "unsupported",
]


def interpreting() -> bool:
    """Whether Triton runs its kernels in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unsupported(mode: str, shapes: list[LayerShape], precision: Precision, probe: Probe | None) -> str | None:
    """Why the kernels cannot run this configuration (None: they can)."""
    if precision.shared:
        return "the shared low-precision checkpoint is an ablation of the reference backend"
    if precision.compute_dtype != torch.float32 or precision.state_dtype != torch.float32:
        return "the kernels compute in fp32 with an fp32 state"
    if precision.read_dtype not in READ_DTYPES:
        return f"the kernels read an fp32, bf16 or fp8 copy, not {dtype_name(precision.read_dtype)}"
    if probe is not None and probe.wants_exact:
        return "read-error probes compare each read with the exact one, which only the reference computes"
    for s in shapes:
        for name, d in (("key", s.key_dim), ("value", s.value_dim)):
            if d & (d - 1) or (mode != "standard" and d < CHUNK_MIN):
                return f"layer {s.layer} has {name} dim {d}; the kernels need powers of two ≥ {CHUNK_MIN}"
    return None


def buffer_dtype_for(
    value: str | torch.dtype | None, device: torch.device, artifact_dtype: str | None
) -> torch.dtype:
    """The dtype of the buffered inputs: ``value``, else fp32 in the interpreter, else the artifact's
    ``traffic.buffer_dtype``, else bf16."""
    if value is None:
        if device.type != "cuda":
            return torch.float32
        value = artifact_dtype or "bf16"
    dtype = parse_dtype(value, "buffer dtype")
    if dtype not in BUFFER_DTYPES:
        raise SketchcalError(f"the triton backend buffers fp32 or bf16 inputs, not {dtype_name(dtype)}")
    return dtype


def kernel_tables(layer: SketchLayer, family: str, *, heads: int, key_dim: int, device) -> KernelTables:
    """The kernels' sketch tables of an artifact layer (validated against the model layer's shape).

    The maps are the runtime's ``P_h = coef_h R_g`` (model frame); a head of full rank K reads its
    read copy (rank 0, the same read); other ranks must be sizes the kernels support.
    """
    ref = layer_tables(layer, family=family, heads=heads, key_dim=key_dim)
    ranks = [0 if m >= key_dim else m for m in ref.ranks.tolist()]
    try:
        tables = sketch_tables(family, layer.frame.to(torch.float64), ref.maps.to(torch.float64), ranks)
    except ValueError as err:
        msg = f"sketch layer {layer.layer}: {err}; reconvert it or use backend='reference'"
        raise SketchcalError(msg) from None
    return tables.to(device)


def kernel_inputs(x: StepInputs, groups: int, dtype: torch.dtype) -> StepInputs:
    """Runtime-layout inputs (k, q per head) → kernel layout (k, q per group), contiguous: k, q, w and
    skip in ``dtype``, decay and beta in fp32. Kernel-layout inputs already in those dtypes (an
    adapter's ``fused_inputs``) pass through without a copy."""
    rep = x.num_heads // groups

    def cast(t: Tensor | None, dt: torch.dtype) -> Tensor | None:
        return None if t is None else t.to(dt).contiguous()

    return StepInputs(
        k=cast(x.k[:, :, ::rep], dtype),
        q=cast(x.q[:, :, ::rep], dtype),
        w=cast(x.w, dtype),
        decay=cast(x.decay, torch.float32),
        beta=cast(x.beta, torch.float32),
        skip=cast(x.skip, dtype),
    )


def _tokens(x: StepInputs, start: int, stop: int) -> StepInputs:
    """Tokens [start, stop) of kernel-layout inputs, contiguous (the kernels' requirement)."""
    if start == 0 and stop == x.num_tokens:
        return x
    return x.tokens(slice(start, stop)).map(Tensor.contiguous)


def _joined(outs: list[Tensor], out_dtype: torch.dtype | None) -> Tensor:
    """The outputs of consecutive kernel calls along T, in ``out_dtype`` (None: as they are)."""
    return _as(outs[0] if len(outs) == 1 else torch.cat(outs, dim=1), out_dtype)


def _as(out: Tensor, dtype: torch.dtype | None) -> Tensor:
    return out if dtype is None else out.to(dtype)


class KernelStandardState:
    """The full fp32 state in a standard pool, read and written by ``standard_step`` at every token."""

    mode = "standard"
    input_dtype = torch.float32  # of k, q and w (the kernels' layout; see kernel_inputs)

    def __init__(
        self, family: str, state: Tensor, *, groups: int, layer: int | None = None, probe: Probe | None = None
    ):
        b, h, kd, vd = state.shape
        self.family, self.groups, self.layer, self.probe = family, groups, layer, probe
        self.pool = allocate_pool(
            family, b, h, groups, kd, vd, value_major=STANDARD_VALUE_MAJOR, device=state.device
        )
        self.pool.state.copy_(state)
        self.slots = torch.arange(b, dtype=torch.int32, device=state.device)
        self.pos = self.flushes = 0
        self._saved: Tensor | None = None  # [T + 1, B, H, K, V]: the state before and after each draft

    @property
    def ckpt(self) -> Checkpoint:
        return Checkpoint(self.pool.state, None, None)

    def step(self, x: StepInputs, out_dtype: torch.dtype | None = torch.float32) -> Tensor:
        """Feed T tokens in sequence; outputs [B, T, H, V] in ``out_dtype`` (None: the kernel's, fp32)."""
        self._saved = None
        xk = kernel_inputs(x, self.groups, self.input_dtype)
        return _as(standard_step(self.family, self.pool, self.slots, xk), out_dtype)

    def draft(self, x: StepInputs) -> Tensor:
        """Outputs of T draft tokens, one kernel call each; the T + 1 states are kept for :meth:`accept`."""
        t = x.num_tokens
        xk = kernel_inputs(x, self.groups, torch.float32)
        self._saved = self.pool.state.new_empty((t + 1, *self.pool.state.shape))
        self._saved[0].copy_(self.pool.state)
        outs = []
        for i in range(t):
            outs.append(standard_step(self.family, self.pool, self.slots, _tokens(xk, i, i + 1)))
            self._saved[i + 1].copy_(self.pool.state)
        return torch.cat(outs, dim=1).float()

    def accept(self, k: int) -> None:
        drafted = 0 if self._saved is None else self._saved.shape[0] - 1
        if not 0 <= k <= drafted:
            raise SketchcalError(f"accept({k}): between 0 and the {drafted} drafted tokens")
        if self._saved is not None:
            self.pool.state.copy_(self._saved[k])
        self._saved = None

    def state(self) -> Tensor:
        """The current state [B, H, K, V] fp32 (a view: the pool may store it value-major)."""
        return self.pool.state

    def adopt(self, slot: int, donor: KernelState, buffered: int = 0, row: int = 0) -> None:
        """Make row ``slot`` the sequence in row ``row`` of ``donor``."""
        self.pool.state[slot] = donor.state()[row]


class KernelWindowState:
    """ReplaySSM (``tables`` None) or SketchSSM state of a batch in a window pool, flushed every L tokens."""

    def __init__(
        self,
        family: str,
        checkpoint: Tensor,
        *,
        groups: int,
        window: int,
        precision: Precision = Precision(),
        tables: KernelTables | None = None,
        buffer_dtype: torch.dtype = torch.float32,
        layer: int | None = None,
        probe: Probe | None = None,
        adaptive: bool = False,
    ):
        if window < 1:
            raise SketchcalError(f"window must be at least 1, got {window}")
        b = checkpoint.shape[0]
        dev = checkpoint.device
        self.family, self.groups, self.window, self.precision = family, groups, window, precision
        self.tables, self.buffer_dtype, self.layer, self.probe = tables, buffer_dtype, layer, probe
        self.adaptive = adaptive and tables is not None
        self.pool = self._allocate(checkpoint)
        self.pool.state.copy_(checkpoint)
        self.slots = torch.arange(b, dtype=torch.int32, device=dev)
        self._pos = [torch.full((b,), p, dtype=torch.int32, device=dev) for p in range(window)]
        # the adaptive sketch's per-slot factors, one set per pool (a draft past the window folds
        # into the second pool)
        self._factors: dict[int, AdaptiveSketch] = {}
        flush(
            family, self.pool, self.slots, self._pos[0], tables=tables, adaptive=self._factors_of(self.pool)
        )
        self.pos = 0  # tokens buffered since the checkpoint (committed)
        self.flushes = 0
        self._next: DecodePool | None = None  # the pool a draft past the window end folds into
        self._drafted = 0
        self._crossed = False

    @property
    def mode(self) -> str:
        return "replay" if self.tables is None else "sketch"

    def _factors_of(self, pool: DecodePool) -> AdaptiveSketch | None:
        """``pool``'s adaptive factors (allocated on first use), or None for the static sketch."""
        if not self.adaptive:
            return None
        key = id(pool.state)
        if key not in self._factors:
            self._factors[key] = AdaptiveSketch.allocate(self.tables, pool)
        return self._factors[key]

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype of k, q and w in the kernels' layout (the buffer's)."""
        return self.buffer_dtype

    @property
    def ckpt(self) -> Checkpoint:
        return Checkpoint(self.pool.state, self.pool.read, self.pool.sketch)

    def _allocate(self, like: Tensor) -> DecodePool:
        b, h, kd, vd = like.shape
        return allocate_pool(
            self.family,
            b,
            h,
            self.groups,
            kd,
            vd,
            capacity=self.window,
            read_dtype=self.precision.read_dtype,
            sketch_rows=0 if self.tables is None else self.tables.map_rows,
            input_dtype=self.buffer_dtype,
            device=like.device,
        )

    # ---- kernel calls ------------------------------------------------------------------------

    def _read(self, pool: DecodePool, pos: int, x: StepInputs) -> Tensor:
        """Non-flush outputs of ``x``'s tokens after ``pos`` buffered ones; they join the buffer."""
        p = self._pos[pos]
        factors = self._factors_of(pool)
        if x.num_tokens > 1:
            return spec_verify(self.family, pool, self.slots, p, x, tables=self.tables, adaptive=factors)
        if self.tables is None:
            return replay_step(self.family, pool, self.slots, p, x)
        return sketch_step(self.family, pool, self.tables, self.slots, p, x, adaptive=factors)

    def _flush(self, pool: DecodePool, x: StepInputs) -> Tensor:
        """The flush token: fold the L − 1 buffered tokens and ``x`` into ``pool``'s checkpoint."""
        factors = self._factors_of(pool)
        return flush(
            self.family, pool, self.slots, self._pos[self.window - 1], x, tables=self.tables, adaptive=factors
        )

    def _committed_flush(self) -> None:
        self.flushes += 1
        if self.probe is not None:
            self.probe.on_flush(self.layer, self.pool.state)

    # ---- decoding ----------------------------------------------------------------------------

    def step(self, x: StepInputs, out_dtype: torch.dtype | None = torch.float32) -> Tensor:
        """Feed T tokens (any T) as decode steps, flushing in place; outputs [B, T, H, V] in
        ``out_dtype`` (None: the kernels', the buffer dtype)."""
        self._drafted, self._crossed = 0, False
        xk = kernel_inputs(x, self.groups, self.buffer_dtype)
        outs, start, total = [], 0, xk.num_tokens
        while start < total:
            n = min(total - start, self.window - 1 - self.pos)  # non-flush tokens before the flush
            if n > 0:
                outs.append(self._read(self.pool, self.pos, _tokens(xk, start, start + n)))
                self.pos, start = self.pos + n, start + n
            if start < total:  # the flush token
                outs.append(self._flush(self.pool, _tokens(xk, start, start + 1)))
                self.pos, start = 0, start + 1
                self._committed_flush()
        return _joined(outs, out_dtype)

    def draft(self, x: StepInputs) -> Tensor:
        """Append T (1 ≤ T ≤ L) tokens after the committed ones; returns their outputs [B, T, H, V].

        Earlier unaccepted drafts are discarded. Drafts reaching the window end fold it into the
        second pool, which :meth:`accept` makes current if the flush token is accepted.
        """
        t = x.num_tokens
        if not 1 <= t <= self.window:
            raise SketchcalError(f"draft: between 1 and the window ({self.window}) tokens at a time, got {t}")
        xk = kernel_inputs(x, self.groups, self.buffer_dtype)
        before = min(t, self.window - 1 - self.pos)  # non-flush tokens of the current window
        outs = []
        if before > 0:
            outs.append(self._read(self.pool, self.pos, _tokens(xk, 0, before)))
        self._crossed = t > before
        if self._crossed:
            if self._next is None:
                self._next = self._allocate(self.pool.state)
            nxt = self._next
            nxt.state.copy_(self.pool.state)
            folding = replace(self.pool, state=nxt.state, read=nxt.read, sketch=nxt.sketch)  # this buffer
            outs.append(self._flush(folding, _tokens(xk, before, before + 1)))
            if t > before + 1:
                outs.append(self._read(nxt, 0, _tokens(xk, before + 1, t)))
        self._drafted = t
        return _joined(outs, torch.float32)

    def accept(self, k: int) -> None:
        """Keep the first ``k`` drafted tokens (0 ≤ k ≤ T); the rest are forgotten (a cursor move)."""
        if not 0 <= k <= self._drafted:
            raise SketchcalError(f"accept({k}): between 0 and the {self._drafted} drafted tokens")
        p = self.pos + k
        if p >= self.window:
            assert self._crossed and self._next is not None
            self.pool, self._next = self._next, self.pool
            self.pos = p - self.window
            self._committed_flush()
        else:
            self.pos = p
        self._drafted, self._crossed = 0, False

    def adopt(self, slot: int, donor: KernelState, buffered: int, row: int = 0) -> None:
        """Make row ``slot`` the sequence in row ``row`` of ``donor``, ``buffered`` tokens into this
        batch's window: the donor's exact state becomes the row's checkpoint (its read copy, sketch
        and adaptive factors written by a flush of that row alone), and the row's buffered tokens
        become identity tokens (``DecodePool.identity_buffer``), so its first window ends with the
        batch's."""
        self.pool.state[slot] = donor.state()[row]
        self.pool.identity_buffer(slot, buffered)
        slots = torch.where(self.slots == slot, self.slots, -1)
        flush(
            self.family, self.pool, slots, torch.zeros_like(slots), tables=self.tables,
            adaptive=self._factors_of(self.pool),
        )  # fmt: skip

    def state(self) -> Tensor:
        """The exact current state [B, H, K, V] fp32: the buffer folded into a copy of the pool."""
        if self.pos == 0:
            return self.pool.state
        scratch = self.pool.clone()
        flush(self.family, scratch, self.slots, self._pos[self.pos], tables=self.tables)
        return scratch.state


KernelState = KernelStandardState | KernelWindowState


def make_kernel_state(
    mode: str,
    family: str,
    state: Tensor,
    *,
    groups: int,
    tables: KernelTables | None = None,
    **options: Any,
) -> KernelState:
    """A kernel decode state in ``mode`` starting from ``state`` [B, H, K, V] fp32 (the first checkpoint).

    ``options`` are the state's own keywords (``layer``, ``probe``; for the window modes also
    ``window``, ``precision``, ``buffer_dtype``, which ``standard`` mode has no use for).
    """
    if mode == "standard":
        for unused in ("window", "precision", "buffer_dtype", "adaptive"):
            options.pop(unused, None)
        return KernelStandardState(family, state, groups=groups, **options)
    if mode == "sketch" and tables is None:
        raise SketchcalError("sketch mode needs the sketch tables of the layer (a converted model)")
    window_tables = tables if mode == "sketch" else None
    return KernelWindowState(family, state, groups=groups, tables=window_tables, **options)
