"""Serving-side tensors of the decode kernels: the slot pool, the sketch tables, the rank spread.

Everything here is plain torch and shared by the Triton kernels (``dispatch.py`` runs them), their
float64 references (``common/reference.py``) and the benchmark (``bench.py``).

Dimensions: N pool slots, B batch entries (each addressing one slot, or -1 for padding),
T tokens per call, H state heads (value heads), G groups (heads sharing k and q: Mamba-2
n_groups, GDN key heads, KDA heads, so G = H), K key/state dim, V value dim, C buffer capacity
(tokens held between flushes; a window of L tokens needs C ≥ L − 1, spec decoding needs more),
M rows of the coefficient maps (≥ the largest rank).

Kernel input layout (one call; groups NOT expanded to heads, unlike ``recurrence.StepInputs``
as used by the references): a :class:`~sketchcal.kernels.common.recurrence.StepInputs` with

    k, q    [B, T, G, K]    l2-normalised (q also scaled) for GDN/KDA; B_t, C_t for Mamba-2
    w       [B, T, H, V]    β·v for the delta rules, dt·x for Mamba-2
    decay   [B, T, H]       linear decay (Mamba-2 exp(dt·A), GDN α) or [B, T, H, K] (KDA)
    beta    [B, T, H]       delta rules only
    skip    [B, T, H, V]    added to the output (Mamba-2's D·x) or None

All tensors contiguous; K and V powers of two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

from sketchcal.kernels.common.recurrence import StepInputs, identity_value

FAMILIES = ("mamba2", "gdn", "kda")
# The sketch ranks the kernels support; 0 means dense: the head reads its full read copy (exact).
# Every kernel masks a head's sketch rows by its rank, so any rank runs; these are the ones the
# allocation chooses among: steps of 2 up to 8, where heads whose states are nearly low-rank
# (Mamba-2's) differ, then geometric steps, because the error curves flatten there.
SUPPORTED_RANKS: tuple[int, ...] = (0, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# how a sketch head reads: the offline coefficient map, or one made for each checkpoint at its flush
SKETCH_MAPS: tuple[str, ...] = ("static", "adaptive")


def candidate_ranks(key_dim: int) -> list[int]:
    """The ranks a head of key dim ``key_dim`` may take, dense (0) first, then increasing: the
    supported ``0 < m < K`` (a rank-K sketch reads as many bytes as the dense read and is exact
    too, so dense covers it)."""
    return [0] + [m for m in SUPPORTED_RANKS if 0 < m < key_dim]


def adaptive_candidate_ranks(key_dim: int, value_dim: int) -> list[int]:
    """The ranks an adaptive-sketch head may take, dense (0) first: every r from 1 to 16, then the
    supported ranks above, while a rank-r read, ``r·(K + V)`` values, is below the dense read's
    ``K·V`` (the adaptive kernels mask by any rank; the small ones are where its heads differ)."""
    options = [*range(1, 17), *(m for m in SUPPORTED_RANKS if m > 16)]
    return [0] + [r for r in options if r * (key_dim + value_dim) < key_dim * value_dim]


def check_family(family: str) -> str:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    return family


@dataclass
class DecodePool:
    """States of N sequences ("slots") of one layer, addressed by slot index.

    ``state`` is the only exact, full-precision tensor: in ``standard`` mode it is the state that
    every step reads and writes; in ``replay`` and ``sketch`` mode it is the checkpoint S_c,
    written only at a flush. Layouts (key-major, contiguous; a paged pool, :func:`check_paged`,
    has each slot's part of a tensor contiguous at any slot stride and may store the state
    value-major):

        state      [N, H, K, V] fp32 (a standard pool may store it value-major: see
                   :func:`allocate_pool`)
        read       [N, H, K, V] read copy of the checkpoint (bf16, or fp32 for exact replay);
                   in sketch mode only the dense heads' rows (``read_rows[h]``) are kept fresh
        sketch     [N, H, M, V] sketch mode: R_{:m} S_c per head of rank m (rows ≥ m unused),
                   in the read copy's dtype; every family keeps S_c in the model frame
        buf_k      [N, G, C, K] buffered keys
        buf_w      [N, H, C, V]
        buf_decay  [N, H, C] fp32, or [N, H, C, K] for KDA
        buf_beta   [N, H, C] fp32 (delta rules), else None
        buf_logdecay [N, H, C, K] bf16, KDA unless the read copy is fp32: log₂ of the
                   buffered decays, which the reads use instead of ``buf_decay`` (half its bytes,
                   which are half a KDA token's; a product of decays then carries a relative error of
                   at most |log₂ of the product| · 2⁻⁹ · ln 2, below a bf16 read's own). The flush
                   folds the fp32 decays; an fp32 read copy (exact replay) reads them too.
        workspace  [N, G, (H/G)·M + C + 1] fp32, Mamba-2 sketch pools: what the split sketch
                   read (``mamba2/read_split.py``) hands from its per-group kernel to its per-head
                   one: per (slot, group) each head's coefficients ``P q`` (M per head, head by
                   head), then ``k·q`` of the new token and of the C buffered ones. Scratch, not
                   state: :meth:`tensors` leaves it out and :meth:`clone` gives a fresh one.
    """

    state: Tensor
    read: Tensor | None = None
    sketch: Tensor | None = None
    buf_k: Tensor | None = None
    buf_w: Tensor | None = None
    buf_decay: Tensor | None = None
    buf_beta: Tensor | None = None
    buf_logdecay: Tensor | None = None
    workspace: Tensor | None = None

    @property
    def slots(self) -> int:
        return self.state.shape[0]

    @property
    def heads(self) -> int:
        return self.state.shape[1]

    @property
    def capacity(self) -> int:
        return 0 if self.buf_w is None else self.buf_w.shape[2]

    def tensors(self) -> dict[str, Tensor]:
        """The pool's state (every tensor but the scratch ``workspace``), by field name."""
        return {n: t for n in _STATE_FIELDS if (t := getattr(self, n)) is not None}

    def clone(self) -> DecodePool:
        ws = None if self.workspace is None else torch.zeros_like(self.workspace)
        return DecodePool(**{name: t.clone() for name, t in self.tensors().items()}, workspace=ws)

    def identity_buffer(self, slot: int, n: int) -> None:
        """Make the first ``n`` buffered tokens of ``slot`` identity tokens
        (``recurrence.identity_value``; a log₂ decay of 0): a sequence that takes the slot in the
        middle of a window reads and folds them as nothing, so it joins the other slots' window
        where it stands."""
        for name in ("k", "w", "decay", "beta"):
            t = getattr(self, f"buf_{name}")
            if t is not None:
                t[slot, :, :n] = identity_value(name)
        if self.buf_logdecay is not None:
            self.buf_logdecay[slot, :, :n] = 0.0


_STATE_FIELDS = tuple(f.name for f in fields(DecodePool) if f.name != "workspace")


def rows_contiguous(t: Tensor) -> bool:
    """Whether each slot's part ``t[n]`` of a pool tensor [N, ...] is contiguous: the slot stride
    may be anything (a page in vLLM's KV pool holds other tensors between two slots' parts)."""
    inner = t.shape[1:]
    expected = [1] * len(inner)
    for i in range(len(inner) - 2, -1, -1):
        expected[i] = expected[i + 1] * inner[i + 1]
    return all(n == 1 or st == e for n, st, e in zip(inner, t.stride()[1:], expected, strict=True))


def value_major(t: Tensor) -> bool:
    """Whether a [N, H, K, V] state is stored value-major: each slot's part is the transpose of a
    contiguous [H, V, K] (vLLM's layout of every family's recurrent state)."""
    return rows_contiguous(t.transpose(-1, -2)) and not rows_contiguous(t)


def is_dense(pool: DecodePool) -> bool:
    """Whether every tensor of ``pool`` (scratch included) is a contiguous [N, ...] array, the state
    key-major: what every kernel form indexes. Other pools (:func:`check_paged`) are served by the
    forms that take slot strides (``dispatch.PAGED_FORMS``)."""
    return all(
        t is None or t.is_contiguous() for t in (*(getattr(pool, n) for n in _STATE_FIELDS), pool.workspace)
    )


def check_paged(pool: DecodePool) -> None:
    """Check the layout of a window pool whose tensors are views of per-slot pages (each slot's part
    contiguous, any slot stride); its state, and its read copy when that is the state, may be
    value-major.

    Raises:
        ValueError: a tensor whose slot parts are not contiguous."""
    for name, t in pool.tensors().items():
        vm_ok = name == "state" or (name == "read" and t is pool.state)
        if not (rows_contiguous(t) or (vm_ok and value_major(t))):
            layouts = "contiguous or value-major" if vm_ok else "contiguous"
            raise ValueError(f"pool.{name}: each slot's part must be {layouts}, got strides {t.stride()}")


def slot_strides(pool: DecodePool, *names: str, fallback: Tensor | None = None) -> tuple[int, ...]:
    """The slot strides (elements) of the pool tensors ``names``; an absent one takes ``fallback``'s
    (the placeholder a kernel is given in its place)."""
    out = []
    for name in names:
        t = getattr(pool, name)
        out.append((t if t is not None else fallback).stride(0))
    return tuple(out)


def workspace_layout(heads_per_group: int, map_rows: int, capacity: int) -> tuple[int, int]:
    """(row width, offset of the dots) of a Mamba-2 sketch pool's ``workspace`` row: each of a
    group's heads' ``map_rows`` coefficients, then the dots of the new token and ``capacity``
    buffered ones."""
    dots = heads_per_group * map_rows
    return dots + capacity + 1, dots


def allocate_pool(
    family: str,
    slots: int,
    heads: int,
    groups: int,
    key_dim: int,
    value_dim: int,
    *,
    capacity: int = 0,
    read_dtype: torch.dtype | None = torch.bfloat16,
    sketch_rows: int = 0,
    input_dtype: torch.dtype = torch.bfloat16,
    value_major: bool = False,
    device: torch.device | str = "cpu",
) -> DecodePool:
    """Zero-initialised pool. ``capacity`` = 0 gives a standard-mode pool (state only);
    ``read_dtype`` None skips the read copy; ``sketch_rows`` > 0 adds the sketch tensor
    (sketch mode; M = ``SketchTables.map_rows``). ``value_major`` (standard pools only) stores the
    state as a contiguous [N, H, V, K] and hands it out transposed: ``pool.state`` is still the
    logical [N, H, K, V]."""
    check_family(family)
    if heads % groups:
        raise ValueError(f"heads ({heads}) must be a multiple of groups ({groups})")
    for name, d in (("key_dim", key_dim), ("value_dim", value_dim)):
        if d < 1 or d & (d - 1):
            raise ValueError(f"{name} must be a power of two, got {d}")
    if value_major and capacity > 0:
        raise ValueError("only a standard pool (capacity 0) can hold its state value-major")
    z = dict(device=device)
    if value_major:
        state = torch.zeros(slots, heads, value_dim, key_dim, dtype=torch.float32, **z).transpose(-1, -2)
    else:
        state = torch.zeros(slots, heads, key_dim, value_dim, dtype=torch.float32, **z)
    pool = DecodePool(state=state)
    if capacity > 0:
        if read_dtype is not None:
            pool.read = torch.zeros(slots, heads, key_dim, value_dim, dtype=read_dtype, **z)
        pool.buf_k = torch.zeros(slots, groups, capacity, key_dim, dtype=input_dtype, **z)
        pool.buf_w = torch.zeros(slots, heads, capacity, value_dim, dtype=input_dtype, **z)
        dshape = (slots, heads, capacity) + ((key_dim,) if family == "kda" else ())
        pool.buf_decay = torch.ones(dshape, dtype=torch.float32, **z)
        if family != "mamba2":
            pool.buf_beta = torch.zeros(slots, heads, capacity, dtype=torch.float32, **z)
        if family == "kda" and read_dtype != torch.float32:
            pool.buf_logdecay = torch.zeros(dshape, dtype=torch.bfloat16, **z)  # log₂ 1
    if sketch_rows > 0:
        sk_dtype = read_dtype or torch.bfloat16
        pool.sketch = torch.zeros(slots, heads, sketch_rows, value_dim, dtype=sk_dtype, **z)
        if family == "mamba2" and capacity > 0:
            width, _ = workspace_layout(heads // groups, sketch_rows, capacity)
            pool.workspace = torch.zeros(slots, groups, width, dtype=torch.float32, **z)
    return pool


@dataclass
class SketchTables:
    """One layer's sketch, in the layouts the kernels read; built once per layer, from an artifact
    layer (:meth:`from_layer`) or from model-frame maps (:func:`sketch_tables`). The reference
    runtime reads the same tables (``sketchcal.runtime.sketch.ComputeTables``: cast to its compute
    dtype); the reads' math is ``reference.sketch_write`` / ``reference.sketch_read``.

        ranks      [H] int32, m per head (0 = dense: read the full read copy)
        maps       [H, M, K] fp32 coefficient maps P (model frame: they act on the effective
                   query u of the model's own recurrence); rows ≥ m zero
        frames     [G, K, K] fp32 orthogonal frames R (row i = i-th basis direction); the flush
                   writes the sketch R_{:m} S_c of each head of rank m
        read_rows  [H] int32, rows of the read copy a sketch-mode flush refreshes
                   (K for a dense head, 0 for a sketch head, whose sketch is separate)

    Mamba-2 only (derived from the above at construction, for the split sketch read of
    ``mamba2/read_split.py``, whose group kernel computes the coefficients of all a group's heads together):

        group_maps   [G, R, K] fp32: the maps of a group's heads packed one after the other (rows
                     r < m of head h); R is the widest group's Σ m, rows past a group's own
                     are zero
        group_cols   [G, R] int32: where each row's coefficient goes in a workspace row
                     (``(h mod H/G) · M + r``), -1 past the group's rows
        group_width  [G] int32: Σ m over the group's heads

    Mamba-2 and KDA (for the sketch of Mamba-2's Gluon flush, ``mamba2/flush_pipelined.py``, which
    copies a group's first chunk into shared memory as it is; KDA's flushes read ``frames``):

        frame_terms  [G, ⌈K/16⌉, 3, 16, K] bf16: the frames in chunks of 16 rows, each chunk as
                     three bf16 terms (largest first; their sum is R exact to fp32 rounding); rows
                     past K are zero
    """

    family: str
    ranks: Tensor
    maps: Tensor
    frames: Tensor
    read_rows: Tensor
    group_maps: Tensor | None = field(default=None, init=False)
    group_cols: Tensor | None = field(default=None, init=False)
    group_width: Tensor | None = field(default=None, init=False)
    frame_terms: Tensor | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        # checked once here, not per step (that would be a host sync): the flush refreshes a
        # head's read copy whole or not at all
        for name in ("maps", "frames"):
            if getattr(self, name).dtype != torch.float32:
                raise ValueError(
                    f"SketchTables.{name} must be float32 (the kernels read them as such), "
                    f"got {getattr(self, name).dtype}"
                )
        key_dim = self.frames.shape[-1]
        bad = sorted(set(self.read_rows.tolist()) - {0, key_dim})
        if bad:
            raise ValueError(f"read_rows must be {key_dim} (a dense head) or 0 per head, got {bad}")
        if self.family == "mamba2":
            self._pack_group_maps()
        if self.family in ("mamba2", "kda"):
            self._split_frames()

    def _split_frames(self) -> None:
        groups, key_dim = self.frames.shape[0], self.frames.shape[-1]
        chunks = -(-key_dim // 16)
        rows = torch.zeros(groups, chunks * 16, key_dim, dtype=torch.float32, device=self.frames.device)
        rows[:, :key_dim] = self.frames
        terms, rest = [], rows
        for _ in range(3):
            terms.append(rest.to(torch.bfloat16))
            rest = rest - terms[-1].float()
        # [G, chunks·16, K] × 3 → [G, chunks, 3, 16, K]
        self.frame_terms = torch.stack([t.view(groups, chunks, 16, key_dim) for t in terms], 2).contiguous()

    def _pack_group_maps(self) -> None:
        groups, key_dim = self.frames.shape[0], self.frames.shape[-1]
        ranks = self.ranks.tolist()
        per_group = len(ranks) // groups
        widths = [sum(ranks[g * per_group : (g + 1) * per_group]) for g in range(groups)]
        width = max(1, max(widths))
        dev = self.maps.device
        packed = torch.zeros(groups, width, key_dim, dtype=torch.float32, device=dev)
        cols = torch.full((groups, width), -1, dtype=torch.int32)
        for g in range(groups):
            c = 0
            for i in range(per_group):
                m = ranks[g * per_group + i]
                packed[g, c : c + m] = self.maps[g * per_group + i, :m]
                cols[g, c : c + m] = i * self.map_rows + torch.arange(m, dtype=torch.int32)
                c += m
        self.group_maps = packed
        self.group_cols = cols.to(dev)
        self.group_width = torch.tensor(widths, dtype=torch.int32, device=dev)

    @classmethod
    def from_layer(cls, family: str, layer) -> SketchTables:
        """The tables of an artifact layer (``sketchcal.artifact.sketch.SketchLayer``: frames ``frame``
        [G, K, K], rotated maps ``coef`` [H, M, K], ``ranks`` [H]), on the layer's device.

        The model-frame maps are ``P_h = coef_h R_g`` (computed in float64, stored fp32), rows ≥ m_h
        zero. Any rank 0 ≤ m_h ≤ min(M, K) is taken (the reference runtime reads any rank; a
        converted model holds only :func:`candidate_ranks`, the ones the kernels launch).

        Raises:
            ValueError: the layer's tensors do not fit together.
        """
        check_family(family)
        frame, coef = layer.frame, layer.coef
        ranks = torch.as_tensor(layer.ranks).to(torch.int64).cpu()
        h, rows = ranks.numel(), coef.shape[1]
        g, k = frame.shape[0], frame.shape[-1]
        if frame.shape != (g, k, k) or coef.shape != (h, rows, k) or h % g:
            raise ValueError(
                f"frames {tuple(frame.shape)} and maps {tuple(coef.shape)} do not fit {h} heads "
                "(expected [G, K, K] and [H, M, K] with G dividing H)"
            )
        if h and (int(ranks.min()) < 0 or int(ranks.max()) > min(rows, k)):
            raise ValueError(f"ranks outside [0, {min(rows, k)}]")
        frames = frame.to(torch.float64).repeat_interleave(h // g, dim=0)  # [H, K, K]
        maps = torch.einsum("hmj,hjk->hmk", coef.to(torch.float64), frames)
        return _tables(family, frame, maps * _rank_mask(ranks, rows).to(maps)[..., None], ranks)

    @property
    def map_rows(self) -> int:
        return self.maps.shape[1]

    def sketch_rows(self) -> Tensor:
        """[H, M, K] fp32: rows ``i < m_h`` of head h are rows i of its group's frame, the rest zero;
        the sketch of a state S [H, K, V] is ``sketch_rows() @ S`` (``reference.sketch_write``)."""
        heads, groups = self.ranks.numel(), self.frames.shape[0]
        rows = self.frames.repeat_interleave(heads // groups, dim=0)[:, : self.map_rows]
        return rows * self.rank_mask().to(rows)[..., None]

    def rank_mask(self) -> Tensor:
        """[H, M] bool: True on the rows a head's rank uses (``r < m_h``)."""
        return _rank_mask(self.ranks, self.map_rows)

    def to(self, device) -> SketchTables:
        return SketchTables(
            self.family, *(t.to(device) for t in (self.ranks, self.maps, self.frames, self.read_rows))
        )

    def with_map_rows(self, rows: int) -> SketchTables:
        """These tables with ``rows`` ≥ :attr:`map_rows` map rows (the new ones zero): the M of a
        pool whose sketch is shared by layers of different widest ranks (vLLM's one page size)."""
        if rows < self.map_rows:
            raise ValueError(f"the tables have {self.map_rows} map rows, more than {rows}")
        maps = torch.nn.functional.pad(self.maps, (0, 0, 0, rows - self.map_rows))
        return SketchTables(self.family, self.ranks, maps, self.frames, self.read_rows)


@dataclass
class AdaptiveSketch:
    """A layer's adaptive sketch over a pool of N slots: the static tables (bases, ranks, dense
    heads) and the per-slot factors each flush writes (``common/adaptive.py`` has the math).

        tables  the layer's :class:`SketchTables` (its ``maps`` are not read)
        rows    [N, H, M, V] Qᵀ per slot, in the pool's sketch dtype, M = ``tables.map_rows``: the
                pool's sketch itself (:meth:`allocate`), whose rows T = R_{:m} S_c a flush writes and
                the factor kernel then replaces by Qᵀ (each program reads its head's T whole first)
        maps    [N, H, M, K] P_S per slot, as ``rows``

    Each tensor is a contiguous array or, in a paged pool, a view of its pages (each slot's part
    contiguous, any slot stride: vLLM's pages).
    """

    tables: SketchTables
    rows: Tensor
    maps: Tensor

    @classmethod
    def allocate(cls, tables: SketchTables, pool: DecodePool) -> AdaptiveSketch:
        """The factors of ``pool`` (a window pool with ``tables.map_rows`` sketch rows): Qᵀ over its
        sketch, P_S zero, in its sketch's dtype and on its device."""
        check_adaptive_pool(pool)
        n, h, kd, _ = pool.state.shape
        m = tables.map_rows
        if pool.sketch.shape[2] != m:
            raise ValueError(
                f"the adaptive sketch keeps Qᵀ in the pool's sketch rows: the pool needs {m} of them "
                f"(tables.map_rows, or SketchTables.with_map_rows), it has {pool.sketch.shape[2]}"
            )
        return cls(tables, pool.sketch, pool.sketch.new_zeros(n, h, m, kd))

    def check(self, pool: DecodePool) -> None:
        """Raise ValueError unless ``pool`` can hold an adaptive sketch (:func:`check_adaptive_pool`)
        and these factors are shaped and placed for it."""
        check_adaptive_pool(pool)
        n, h, kd, vd = pool.state.shape
        m = self.tables.map_rows
        for name, t, shape in (("rows", self.rows, (n, h, m, vd)), ("maps", self.maps, (n, h, m, kd))):
            if tuple(t.shape) != shape or t.device != pool.state.device or not rows_contiguous(t):
                raise ValueError(
                    f"adaptive {name} must be {list(shape)} on {pool.state.device} with each slot's part "
                    f"contiguous, got {list(t.shape)} on {t.device} (AdaptiveSketch.allocate makes them)"
                )


def check_adaptive_pool(pool: DecodePool) -> None:
    """Raise ValueError unless ``pool`` can hold an adaptive sketch: sketch rows in bf16 or fp32,
    a power-of-two value dim."""
    if pool.sketch is None:
        raise ValueError("the adaptive sketch needs a pool with sketch rows (sketch mode)")
    if pool.sketch.dtype.itemsize == 1:
        raise ValueError("the adaptive sketch keeps its factors in bf16 or fp32; use a bf16 read copy")
    vd = pool.state.shape[-1]
    if vd & (vd - 1):
        raise ValueError(f"the adaptive sketch's kernels take a power-of-two value dim, got V={vd}")


def _rank_mask(ranks: Tensor, rows: int) -> Tensor:
    return torch.arange(rows, device=ranks.device)[None, :] < ranks[:, None]


def _tables(family: str, frames: Tensor, maps: Tensor, ranks: Tensor) -> SketchTables:
    """SketchTables on ``frames``' device from model-frame ``maps`` [H, M, K] (rows ≥ m zero) and
    ``ranks`` [H] (CPU)."""
    dense = ranks == 0
    rows = torch.where(dense, torch.full_like(ranks, frames.shape[-1]), torch.zeros_like(ranks))
    dev = frames.device
    return SketchTables(
        family,
        ranks.to(torch.int32).to(dev),
        maps.to(device=dev, dtype=torch.float32),
        frames.to(torch.float32).contiguous(),
        rows.to(torch.int32).to(dev),
    )


def clip_rank(rank: int, key_dim: int) -> int:
    """Snap a requested rank up to the next of :func:`candidate_ranks` (none above: dense, 0)."""
    if rank <= 0:
        return 0
    return next((m for m in candidate_ranks(key_dim) if m >= rank), 0)


def sketch_tables(family: str, frames: Tensor, maps: Tensor | list[Tensor], ranks) -> SketchTables:
    """:class:`SketchTables` from model-frame maps, for the ranks the kernels support (tests and
    benchmarks; a converted model's layer: :meth:`SketchTables.from_layer`).

    ``frames`` [G, K, K] (R per group); ``maps`` either a list of per-head [m_h, K] tensors or a
    padded [H, M, K] tensor, each P mapping a model-frame effective query u to sketch
    coordinates; ``ranks`` [H] (0 = dense), each one of :func:`candidate_ranks`.
    """
    check_family(family)
    ranks_t = torch.as_tensor(ranks, dtype=torch.int64).cpu()
    h = ranks_t.numel()
    g, k = frames.shape[0], frames.shape[-1]
    if frames.shape != (g, k, k) or h % g:
        raise ValueError(f"frames must be [G, K, K] with G dividing H={h}, got {tuple(frames.shape)}")
    for r in ranks_t.tolist():
        if r not in candidate_ranks(k):
            raise ValueError(f"rank {r} is not supported for K={k}; use one of {SUPPORTED_RANKS} below K")
    m_rows = max(1, int(ranks_t.max()))
    out = torch.zeros(h, m_rows, k, dtype=torch.float64, device=frames.device)
    for head in range(h):
        m = int(ranks_t[head])
        if m == 0:
            continue
        p = (maps[head] if isinstance(maps, list) else maps[head, :m]).to(torch.float64)
        if p.shape != (m, k):
            raise ValueError(f"head {head}: map must be [{m}, {k}], got {tuple(p.shape)}")
        out[head, :m] = p
    return _tables(family, frames, out, ranks_t)


def random_frames(groups: int, key_dim: int, generator: torch.Generator | None = None) -> Tensor:
    """Random orthogonal frames [G, K, K] (float64), for tests and benchmarks."""
    a = torch.randn(groups, key_dim, key_dim, dtype=torch.float64, generator=generator)
    q, r = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)


def random_sketch(
    family: str, ranks, groups: int, key_dim: int, generator: torch.Generator | None = None
) -> SketchTables:
    """Random frames and maps of the calibrated shape ``P = [I_m  Gᵀ] R`` (tests, benchmarks)."""
    ranks = [int(r) for r in ranks]
    frames = random_frames(groups, key_dim, generator)
    h = len(ranks)
    maps = []
    for head, m in enumerate(ranks):
        tail = 0.1 * torch.randn(key_dim - m, m, dtype=torch.float64, generator=generator)
        pm = torch.cat([torch.eye(m, dtype=torch.float64), tail.T], dim=1)
        maps.append(pm @ frames[head // (h // groups)])
    return sketch_tables(family, frames, maps, ranks)


def rank_spread(heads: int, mean: float, key_dim: int) -> list[int]:
    """A realistic spread of per-head ranks around ``mean`` (what a knapsack allocation gives:
    most heads small, a few large), from the supported set; deterministic.

    The template for mean 8 is, per 32 heads, 15×4, 10×8, 3×12, 2×16, 2×24; other means scale it
    and snap to the supported set. ``mean`` ≤ 0 or ≥ K gives all-dense heads (0).
    """
    if mean <= 0 or mean >= key_dim:
        return [0] * heads
    template = [4] * 15 + [8] * 10 + [12] * 3 + [16] * 2 + [24] * 2
    scale = mean / 8.0
    ranks = [clip_rank(max(1, round(template[(i * 32) // heads] * scale)), key_dim) for i in range(heads)]
    # interleave deterministically so neighbouring heads differ (as calibrated layers do)
    g = torch.Generator().manual_seed(1234)
    perm = torch.randperm(heads, generator=g).tolist()
    return [ranks[i] for i in perm]


def expand_groups(x: StepInputs, heads: int) -> StepInputs:
    """Kernel-layout inputs (k, q per group) → reference layout (k, q per head)."""
    groups = x.k.shape[-2]
    if groups == heads:
        return x
    rep = heads // groups
    out = x.map(lambda t: t)
    out.k = x.k.repeat_interleave(rep, dim=-2)
    out.q = x.q.repeat_interleave(rep, dim=-2)
    return out


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << math.ceil(math.log2(n))
