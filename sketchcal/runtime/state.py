"""Decode-state objects of one mixer layer for a batch of sequences, in the three modes.

Inputs are :class:`~sketchcal.kernels.common.StepInputs` in the reference layout (groups expanded
to heads): k, q [B, T, H, K]; w [B, T, H, V]; decay [B, T, H] or [B, T, H, K]; beta [B, T, H] or
None; skip [B, T, H, V] or None. States are key-major [B, H, K, V]. Outputs are [B, T, H, V] in the
compute dtype and include the skip term.

- :class:`StandardState` (``standard``): the per-step recurrence; the state is read and written
  every token.
- :class:`WindowState` (``replay``; ``sketch`` when given :class:`SketchTables`): an exact
  checkpoint plus a buffer of the inputs since it. Token p = 1..L−1 after the checkpoint is read as
  ``S_cᵀ u_p + W_pᵀ q_p`` (``product_form_read``) with the checkpoint term from the read copy
  (replay) or the sketch; token p = L is the flush: the window is folded exactly into the next
  checkpoint by the recurrence and that token reads the exact new state. Nothing is written
  between flushes, and the sketch never enters a checkpoint.

Speculative decoding: ``draft(x)`` appends T ≤ L tokens and returns their outputs, computed from
checkpoint and buffer; ``accept(k)`` keeps the first k (0 ≤ k ≤ T) and moves the cursor. A draft
that reaches the window end computes the next checkpoint (the flush the sequential path would do at
that token) and keeps it pending; it is committed only when the flush token is accepted. Rejected
entries are overwritten by the next draft. ``step(x)`` (any T) is draft + accept of everything.

Every number comes from :mod:`sketchcal.kernels.common.recurrence` (``recurrence``,
``product_form_read``, ``read``); this module only moves tensors around them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from sketchcal.errors import SketchcalError
from sketchcal.kernels.common import Family, StepInputs, product_form_read, recurrence
from sketchcal.kernels.common import family as family_of
from sketchcal.kernels.common.pool import SketchTables
from sketchcal.kernels.common.recurrence import identity_value, read
from sketchcal.runtime.precision import Precision, store
from sketchcal.runtime.sketch import compute_tables

MODES = ("standard", "replay", "sketch")
DEFAULT_WINDOW = 16
_BUFFERED = ("k", "w", "decay", "beta")


class Probe(Protocol):
    """Observer of a decode state (verify's read-error meter, tests' flush recorder).

    ``wants_exact``: also compute the exact checkpoint read for every served one. Reads are
    reported when computed (speculative drafts included, accepted or not); flushes when committed.
    """

    wants_exact: bool

    def on_read(self, layer: int | None, positions: Tensor, approx: Tensor, exact: Tensor | None) -> None:
        """Non-flush reads at ``positions`` [n] (p in 1..L−1): their checkpoint terms ``S_cᵀu``
        [B, n, H, V] as served (read copy or sketch) and exact (the checkpoint itself)."""
        ...

    def on_flush(self, layer: int | None, checkpoint: Tensor) -> None:
        """A committed flush; ``checkpoint`` [B, H, K, V] as stored."""
        ...


def _family(family: Family | str) -> Family:
    return family_of(family) if isinstance(family, str) else family


class StandardState:
    """The full state, read and written at every token (the baseline)."""

    mode = "standard"

    def __init__(
        self,
        family: Family | str,
        state: Tensor,
        *,
        precision: Precision = Precision(),
        layer: int | None = None,
        probe: Probe | None = None,
    ):
        self.family = _family(family)
        self.precision = precision
        self.layer, self.probe = layer, probe
        self.s = store(state, precision.checkpoint_dtype)
        self._drafts: list[Tensor] = []

    def step(self, x: StepInputs) -> Tensor:
        """Feed T tokens one by one; returns their outputs [B, T, H, V]."""
        cd = self.precision.compute_dtype
        o, s = recurrence(self.family, x.to(cd), self.s.to(cd))
        self.s = store(s, self.precision.checkpoint_dtype)
        return o

    def draft(self, x: StepInputs) -> Tensor:
        """Outputs of T draft tokens; the T intermediate states are kept (standard decoding must)."""
        cd = self.precision.compute_dtype
        x = x.to(cd)
        s = self.s.to(cd)
        outs, self._drafts = [], []
        for t in range(x.num_tokens):
            o, s = recurrence(self.family, x.tokens(slice(t, t + 1)), s)
            outs.append(o)
            self._drafts.append(store(s, self.precision.checkpoint_dtype))
        return torch.cat(outs, dim=1)

    def accept(self, k: int) -> None:
        if not 0 <= k <= len(self._drafts):
            raise SketchcalError(f"accept({k}): between 0 and the {len(self._drafts)} drafted tokens")
        if k:
            self.s = self._drafts[k - 1]
        self._drafts = []

    def state(self) -> Tensor:
        """The current state [B, H, K, V] as stored."""
        return self.s

    def adopt(self, slot: int, donor: StandardState, buffered: int = 0, row: int = 0) -> None:
        """Make row ``slot`` the sequence in row ``row`` of ``donor``."""
        self.s[slot] = donor.state()[row].to(self.s.dtype)


@dataclass
class Checkpoint:
    """A checkpoint and what reads use between flushes (all [B, H, ·, V])."""

    state: Tensor  # the exact state, checkpoint dtype
    read_copy: Tensor | None  # two precisions: the state in the read dtype
    sketch: Tensor | tuple[Tensor, Tensor] | None  # sketch mode: (R S)_{:M}, or adaptive (Q, P_S); read dtype

    @property
    def full(self) -> Tensor:
        """What a dense read uses: the read copy, else the checkpoint itself."""
        return self.read_copy if self.read_copy is not None else self.state


class WindowState:
    """ReplaySSM (``tables`` None) or SketchSSM state: a checkpoint + buffer, flushed every L tokens."""

    def __init__(
        self,
        family: Family | str,
        checkpoint: Tensor,
        *,
        window: int = DEFAULT_WINDOW,
        precision: Precision = Precision(),
        tables: SketchTables | None = None,
        sketch_map: str = "static",
        layer: int | None = None,
        probe: Probe | None = None,
    ):
        if window < 1:
            raise SketchcalError(f"window must be at least 1, got {window}")
        self.family = _family(family)
        self.window, self.precision, self.tables = window, precision, tables
        self.sketch_map = sketch_map  # static: the artifact's maps; adaptive: maps made at each flush
        self._sketch = None if tables is None else compute_tables(tables, precision.compute_dtype, sketch_map)
        self.layer, self.probe = layer, probe
        self.ckpt = self._make_checkpoint(checkpoint.to(precision.compute_dtype))
        self.pos = 0  # tokens buffered since the checkpoint (committed)
        self.flushes = 0
        self._buf: dict[str, Tensor | None] | None = None
        self._pending: Checkpoint | None = None
        self._drafted = 0
        self._zeros = torch.zeros_like(checkpoint, dtype=precision.compute_dtype)

    @property
    def mode(self) -> str:
        return "replay" if self.tables is None else "sketch"

    # ---- storage ---------------------------------------------------------------------------

    def _make_checkpoint(self, s: Tensor) -> Checkpoint:
        p = self.precision
        state = store(s, p.checkpoint_dtype)
        exact = state.to(p.compute_dtype)
        read_copy = store(exact, p.read_dtype) if p.separate_read_copy else None
        sketch = None if self._sketch is None else self._sketch.stored(exact, p.read_dtype)
        return Checkpoint(state, read_copy, sketch)

    def _put(self, at: int, x: StepInputs) -> None:
        """Write x's tokens into the buffer at positions at, at+1, ... (allocated on first use)."""
        if self._buf is None:
            cap = 2 * self.window
            self._buf = {
                n: None
                if getattr(x, n) is None
                else getattr(x, n).new_zeros((x.k.shape[0], cap, *getattr(x, n).shape[2:]))
                for n in _BUFFERED
            }
        t = x.num_tokens
        for n in _BUFFERED:
            if self._buf[n] is not None:
                self._buf[n][:, at : at + t] = getattr(x, n)

    def _window(self, n_buf: int, x: StepInputs) -> StepInputs:
        """Buffered tokens [0, n_buf) (their reads are not needed: q = 0) followed by ``x``."""
        if n_buf == 0:
            return x
        buf = {n: None if self._buf[n] is None else self._buf[n][:, :n_buf] for n in _BUFFERED}
        q = x.q.new_zeros((x.q.shape[0], n_buf, *x.q.shape[2:]))
        skip = None if x.skip is None else x.skip.new_zeros((x.skip.shape[0], n_buf, *x.skip.shape[2:]))
        head = StepInputs(q=q, skip=skip, **buf)
        return StepInputs(
            **{
                n: None if getattr(x, n) is None else torch.cat([getattr(head, n), getattr(x, n)], dim=1)
                for n in ("k", "q", "w", "decay", "beta", "skip")
            }
        )

    # ---- reads -----------------------------------------------------------------------------

    def _checkpoint_term(self, ckpt: Checkpoint, u: Tensor) -> Tensor:
        """``S_cᵀ u`` as served: from the read copy (replay) or the sketch. u [B, n, H, K]."""
        if self._sketch is None:
            return read(ckpt.full.to(u.dtype).unsqueeze(1), u)
        return self._sketch.read(ckpt.sketch, ckpt.full if self._sketch.has_dense else None, u)

    def _reads(self, ckpt: Checkpoint, n_buf: int, x: StepInputs, first_pos: int) -> Tensor:
        """Non-flush outputs of the tokens ``x`` that follow ``n_buf`` buffered ones after ``ckpt``."""
        win = self._window(n_buf, x)
        # zero checkpoint: the product form then gives the buffer term (+ skip) and u in one sweep
        o_buf, u = product_form_read(self.family, self._zeros, win)
        o_buf, u = o_buf[:, n_buf:], u[:, n_buf:]
        term = self._checkpoint_term(ckpt, u)
        if self.probe is not None:
            exact = read(ckpt.state.to(u.dtype).unsqueeze(1), u) if self.probe.wants_exact else None
            positions = torch.arange(first_pos, first_pos + x.num_tokens)
            self.probe.on_read(self.layer, positions, term, exact)
        return o_buf + term

    # ---- decoding --------------------------------------------------------------------------

    def draft(self, x: StepInputs) -> Tensor:
        """Append T (1 ≤ T ≤ L) tokens after the committed ones; returns their outputs [B, T, H, V].

        Earlier unaccepted drafts are discarded. No state is materialised unless the drafts reach the
        window end, where the next checkpoint is computed and kept pending until :meth:`accept`.
        """
        t = x.num_tokens
        if not 1 <= t <= self.window:
            raise SketchcalError(f"draft: between 1 and the window ({self.window}) tokens at a time, got {t}")
        x = x.to(self.precision.compute_dtype)
        self._pending = None
        p0, length = self.pos, self.window
        self._put(p0, x)
        before = min(t, length - 1 - p0)  # non-flush tokens of the current window
        outs = []
        if before > 0:
            outs.append(self._reads(self.ckpt, p0, x.tokens(slice(0, before)), p0 + 1))
        if t > before:  # token ``before`` is the flush token (p = L)
            win = self._window(p0, x.tokens(slice(0, before + 1)))
            o, s_new = recurrence(self.family, win, self.ckpt.state.to(self.precision.compute_dtype))
            outs.append(o[:, -1:])
            self._pending = self._make_checkpoint(s_new)
            rest = x.tokens(slice(before + 1, t))
            if rest.num_tokens:
                outs.append(self._reads(self._pending, 0, rest, 1))
        self._drafted = t
        return torch.cat(outs, dim=1)

    def accept(self, k: int) -> None:
        """Keep the first ``k`` drafted tokens (0 ≤ k ≤ T); the rest are forgotten (a cursor move)."""
        if not 0 <= k <= self._drafted:
            raise SketchcalError(f"accept({k}): between 0 and the {self._drafted} drafted tokens")
        p = self.pos + k
        if p >= self.window:
            assert self._pending is not None
            self.ckpt = self._pending
            n = p - self.window
            if n:  # accepted tokens after the flush start the next window
                for t in self._buf.values():
                    if t is not None:
                        t[:, :n] = t[:, self.window : self.window + n].clone()
            self.pos = n
            self.flushes += 1
            if self.probe is not None:
                self.probe.on_flush(self.layer, self.ckpt.state)
        else:
            self.pos = p
        self._pending, self._drafted = None, 0

    def step(self, x: StepInputs) -> Tensor:
        """Feed T tokens (any T) as decode steps; outputs [B, T, H, V]."""
        outs, start = [], 0
        while start < x.num_tokens:
            n = min(x.num_tokens - start, self.window - self.pos)  # up to and including the next flush
            outs.append(self.draft(x.tokens(slice(start, start + n))))
            self.accept(n)
            start += n
        return torch.cat(outs, dim=1)

    def adopt(self, slot: int, donor: DecodeState, buffered: int, row: int = 0) -> None:
        """Make row ``slot`` the sequence in row ``row`` of ``donor``, ``buffered`` tokens into this
        batch's window (its :attr:`pos`): the donor's exact state becomes the row's checkpoint, and
        the row's buffered tokens become identity tokens (``recurrence.identity_value``), so its
        first window ends with the batch's."""
        new = self._make_checkpoint(donor.state()[row : row + 1].to(self.precision.compute_dtype))
        for old, fresh in ((self.ckpt.state, new.state), (self.ckpt.read_copy, new.read_copy)):
            if old is not None:
                old[slot] = fresh[0]
        if isinstance(self.ckpt.sketch, tuple):
            for old, fresh in zip(self.ckpt.sketch, new.sketch, strict=True):
                old[slot] = fresh[0]
        elif self.ckpt.sketch is not None:
            self.ckpt.sketch[slot] = new.sketch[0]
        for name, t in (self._buf or {}).items():
            if t is not None:
                t[slot, :buffered] = identity_value(name)

    def state(self) -> Tensor:
        """The exact current state [B, H, K, V] (compute dtype), materialised for checks."""
        cd = self.precision.compute_dtype
        s = self.ckpt.state.to(cd)
        if self.pos == 0:
            return s
        buf = {n: None if self._buf[n] is None else self._buf[n][:, : self.pos] for n in _BUFFERED}
        x = StepInputs(q=torch.zeros_like(buf["k"]), **buf)
        return recurrence(self.family, x, s)[1]


DecodeState = StandardState | WindowState


def make_state(
    mode: str,
    family: Family | str,
    state: Tensor,
    *,
    tables: SketchTables | None = None,
    **options: Any,
) -> DecodeState:
    """A decode state in ``mode`` starting from ``state`` [B, H, K, V] (the first checkpoint).

    ``options`` are the state's own keywords: ``precision``, ``layer``, ``probe``, ``window`` and
    ``sketch_map`` (which ``standard`` mode has no use for); ``tables`` are the sketch's, for
    ``sketch`` mode, read through their static maps or adaptively (``sketch_map="adaptive"``).
    """
    if mode != "sketch":
        options.pop("sketch_map", None)
    if mode == "standard":
        options.pop("window", None)
        return StandardState(family, state, **options)
    if mode == "replay":
        return WindowState(family, state, **options)
    if mode == "sketch":
        if tables is None:
            raise SketchcalError("sketch mode needs the sketch tables of the layer (a converted model)")
        return WindowState(family, state, tables=tables, **options)
    raise SketchcalError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
