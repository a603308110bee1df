"""Which decode kernel runs, and the serving entry points that run it.

Serving API (family first; pool and input layouts in ``common/pool.py``):

- :func:`standard_step`  read the fp32 state, update it, write it (the baseline);
- :func:`replay_step`    ReplaySSM non-flush step: read copy + buffer, no state write;
- :func:`sketch_step`    SketchSSM non-flush step: the sketch rows ``R_{:m} S_c`` + buffer +
  coefficient map (dense heads: the read copy);
- :func:`flush`          fold the buffered window exactly into the fp32 checkpoint, refresh the
  read copy rows and the sketch;
- :func:`spec_verify`    T draft tokens from checkpoint + buffer, outputs only.

Every entry point takes ``slots`` [B] (int32, -1 = padding: that entry is skipped, its output row
left as it was) and, for the window kernels, ``pos`` [B] int32: the number of tokens already
buffered for that slot since its last flush. Nothing synchronises with the host or allocates when
``out`` is given, so each call can be captured in a CUDA graph; the engine keeps ``pos`` (spec
decoding: accepting k drafts advances it by k, rejected entries are overwritten later).

Dispatch: a call's :class:`KernelConfig` (``config``, or :func:`default_config`) names its kernel
in ``form``; :data:`FORMS` maps each form to the module whose ``launch`` runs it, and
:data:`DEFAULT_CONFIGS` is the table of what runs by default per (kernel, family), with the launch
shape, tuned on an H200 at batch 256 (``bench.run_bench(tune=True)`` re-picks them on another
device). Where a form cannot run it hands over to a fallback (:func:`runnable`): Mamba-2's split
read to the one-kernel read (several tokens, a pool without a workspace), a Gluon flush to a Triton
one (the CPU interpreter, fp32 buffered inputs, a Triton without Gluon, a pool the KDA kernel's
layouts do not cover): Mamba-2's chunked flush with the same shape, KDA's sweep
(:data:`SWEEP_FALLBACK`). A paged pool (each slot's part of a tensor contiguous, any slot stride,
the checkpoint possibly value-major: vLLM's pages, ``pool.check_paged``) is served by the forms that
take slot strides (:data:`PAGED_FORMS`): the reads and the sweep. The adaptive sketch's reads (each
slot's own factors, ``common/adaptive.py``, in a dense or a paged pool) run the one-kernel read.

Every family keeps its checkpoint in the model's own frame, so the state is the model's exact fp32
recurrence and no per-step rotation of k or q is needed. The sketch of a head of rank m is the
separate tensor ``R_{:m} S_c`` (m × V), written by the flush; a sketch read is
``(R_{:m} S_c)ᵀ (P u)`` with the head's model-frame map P. KDA's reads from a bf16 read copy or
sketch take the buffered decays as bf16 log₂ (``DecodePool.buf_logdecay``); the flush always folds
the fp32 decays.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from sketchcal.kernels.common.adaptive import factor
from sketchcal.kernels.common.pool import (
    FAMILIES,
    AdaptiveSketch,
    DecodePool,
    SketchTables,
    allocate_pool,
    check_family,
    check_paged,
    is_dense,
)
from sketchcal.kernels.common.recurrence import StepInputs
from sketchcal.kernels.common.triton_helpers import CHUNK_MIN, clip_block_v, interpreting

__all__ = [
    "DEFAULT_CONFIGS",
    "FORMS",
    "FP8_CONFIGS",
    "STANDARD_VALUE_MAJOR",
    "SWEEP_FALLBACK",
    "DecodePool",
    "KernelConfig",
    "SketchTables",
    "allocate_pool",
    "default_config",
    "flush",
    "replay_step",
    "sketch_step",
    "spec_verify",
    "standard_step",
]


@dataclass(frozen=True)
class Form:
    """A kernel: the module (under ``sketchcal.kernels``) whose ``launch`` runs it, imported on
    first use; the op it serves (``standard``, ``read`` or ``flush``) and the families it serves."""

    module: str
    op: str
    families: tuple[str, ...]


FORMS: dict[str, Form] = {
    "standard": Form("common.standard", "standard", FAMILIES),
    # the one-kernel read: a backward sweep over the new and buffered tokens, one checkpoint read
    "read": Form("common.read", "read", FAMILIES),
    # Mamba-2's sketch read of one token in two kernels: per key group, then per head
    "split_read": Form("mamba2.read_split", "read", ("mamba2",)),
    # the token-by-token flush in Triton
    "sweep": Form("common.flush", "flush", FAMILIES),
    # Mamba-2's chunked flush on tensor cores, in Triton
    "chunk": Form("mamba2.flush_chunk", "flush", ("mamba2",)),
    # Mamba-2's chunked flush as a persistent Gluon kernel
    "gluon_chunk": Form("mamba2.flush_pipelined", "flush", ("mamba2",)),
    # KDA's token-by-token flush with deferred decays as a persistent Gluon kernel
    "gluon_sweep": Form("kda.flush_sweep", "flush", ("kda",)),
}

# what each entry of the tables is run by
KERNEL_OPS = {
    "standard": "standard",
    "replay": "read",
    "sketch": "read",
    "flush_replay": "flush",
    "flush_sketch": "flush",
}
GLUON_FORMS = ("gluon_chunk", "gluon_sweep")


@dataclass(frozen=True)
class KernelConfig:
    """A kernel (``form``, one of :data:`FORMS`) and its launch shape: value columns per program
    (``block_v``, clipped to V) and warps per program. The other fields shape the forms they name
    and are ignored by the rest.

    - ``vec`` (``sweep``; 0 = the compiler's choice) caps the value columns each thread holds of
      the [K, BV] tile: fewer columns per thread put more of each k·S reduction inside the thread
      (fewer shuffles) at the cost of more key rows per thread.
    - ``maxnreg`` (0 = the compiler's choice; not ``split_read``) caps the registers per thread,
      for more resident warps; what does not fit spills to local memory.
    - ``group`` (``read``; 0 = every buffer slot, unrolled) sweeps only the live buffered tokens,
      ``group`` per iteration of a rolled loop: less work on a short buffer, one load wait per
      group instead of one per read.
    - ``dense_rows`` (reads; 0 = all K at once) reads a dense head's read copy that many rows at a
      time: the [K, BV] tile otherwise sets the register count of the whole read kernel, the
      sketch heads' branch included.
    - ``early_map`` (``read``, sketch mode) loads a head's first 8 coefficient-map rows before the
      buffer sweep, so that their latency overlaps it; False loads them after it, with [8, K] fewer
      values live during the sweep.
    - ``prefetch`` (``read`` and ``sweep``, on a CUDA device) asks L2 for all the buffered tokens a
      program reads as it starts (``prefetch.global.L2``), so that its loop over them, which loads
      a token or a group ahead, finds them there rather than in DRAM.
    - ``per_sm`` (the Gluon forms, at least 1) runs that many programs of the persistent kernel per
      SM: ``gluon_chunk`` takes whole heads (``block_v`` is ignored), ``gluon_sweep`` ``block_v``
      value columns of a head at a time, 16 or 8 per warp.
    - ``coef_warps``, ``heads``, ``dots`` (``split_read``): programs of ``coef_warps`` warps
      compute every head's coefficients once per key group (and the group's dots, ``dots`` groups
      per program), then programs of ``num_warps`` warps and ``heads`` heads of one group sum each
      head's rows. ``dots`` = 0: the head kernel computes its group's dots itself, before it waits
      for the first kernel. ``heads`` and ``dots`` are powers of two, clipped to the largest that
      divides H/G and G.
    """

    form: str
    block_v: int
    num_warps: int
    vec: int = 0
    maxnreg: int = 0
    group: int = 0
    dense_rows: int = 0
    early_map: bool = True
    prefetch: bool = False
    per_sm: int = 0
    coef_warps: int = 1
    heads: int = 1
    dots: int = 1

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"KernelConfig.form must be one of {', '.join(FORMS)}, got {self.form!r}")
        for name, zero_ok in (
            ("block_v", False),
            ("num_warps", False),
            ("dense_rows", True),
            ("coef_warps", False),
            ("heads", False),
            ("dots", True),
        ):
            n = getattr(self, name)
            if n < 0 or n & (n - 1) or (n == 0 and not zero_ok):
                allowed = "a power of two" + (" or 0" if zero_ok else "")
                raise ValueError(f"KernelConfig.{name} must be {allowed}, got {n}")
        if min(self.vec, self.maxnreg, self.group, self.per_sm) < 0:
            raise ValueError("KernelConfig.vec, maxnreg, group and per_sm must be ≥ 0")
        if self.form in GLUON_FORMS and self.per_sm < 1:
            raise ValueError(f"KernelConfig.per_sm must be ≥ 1 for the {self.form} form")


_K = KernelConfig

# The table: what runs by default, per (kernel, family). Launch shapes are the fastest on an H200 at
# batch 256 among ``bench.TUNE_CANDIDATES`` (BENCHMARKS.md, "Decode kernels"), checked there by the
# ``gpu`` tests with exactly these shapes. The standard step's shapes are for a value-major state
# (STANDARD_VALUE_MAJOR), which is faster than key-major in every family.
STANDARD_VALUE_MAJOR = True
DEFAULT_CONFIGS: dict[tuple[str, str], KernelConfig] = {
    ("standard", "mamba2"): _K("standard", 16, 8),
    ("standard", "gdn"): _K("standard", 8, 2),
    ("standard", "kda"): _K("standard", 8, 2),
    ("replay", "mamba2"): _K("read", 64, 1, group=4, dense_rows=16),
    ("replay", "gdn"): _K("read", 128, 1, group=4, dense_rows=16),
    ("replay", "kda"): _K("read", 128, 1, group=4, dense_rows=16),
    # (the split read runs one token; spec_verify takes the one-kernel read with these fields)
    ("sketch", "mamba2"): _K(
        "split_read",
        64,
        1,
        maxnreg=64,
        group=8,
        dense_rows=16,
        early_map=False,
        coef_warps=2,
        heads=4,
        dots=0,
    ),
    ("sketch", "gdn"): _K("read", 128, 1, maxnreg=64, group=6, dense_rows=16, early_map=False, prefetch=True),
    ("sketch", "kda"): _K("read", 128, 1, maxnreg=64, group=2, dense_rows=16, early_map=False),
    ("flush_replay", "mamba2"): _K("gluon_chunk", 64, 4, maxnreg=168, per_sm=3),
    ("flush_replay", "gdn"): _K("sweep", 16, 1, vec=2, prefetch=True),
    ("flush_replay", "kda"): _K("gluon_sweep", 64, 4, maxnreg=168, per_sm=3),
    ("flush_sketch", "mamba2"): _K("gluon_chunk", 64, 4, maxnreg=168, per_sm=3),
    ("flush_sketch", "gdn"): _K("sweep", 16, 1, vec=2, prefetch=True),
    ("flush_sketch", "kda"): _K("gluon_sweep", 64, 4, maxnreg=168, per_sm=3),
}

# Where an fp8 (e4m3) read copy is faster with another shape (tuned for it on the H200)
FP8_CONFIGS: dict[tuple[str, str], KernelConfig] = {
    ("replay", "mamba2"): _K("read", 64, 1, maxnreg=96),
}

# KDA's flush where its Gluon sweep cannot run, and every family's on a paged pool: Triton's sweep
SWEEP_FALLBACK = _K("sweep", 16, 1, vec=4, maxnreg=128)
# the forms that index a pool by slot strides (vLLM's pages: see ``pool.check_paged``)
PAGED_FORMS = ("read", "split_read", "sweep")


def default_config(kernel: str, family: str, read_dtype: torch.dtype | None = None) -> KernelConfig:
    """The default kernel and launch shape of ``kernel`` (a key of :data:`KERNEL_OPS`) for
    ``family`` with a read copy of ``read_dtype`` (None: bf16)."""
    if read_dtype == torch.float8_e4m3fn and (kernel, family) in FP8_CONFIGS:
        return FP8_CONFIGS[(kernel, family)]
    return DEFAULT_CONFIGS[(kernel, family)]


@functools.cache
def gluon_available() -> bool:
    """Whether this Triton has the Gluon names the Gluon flushes use (Triton 3.6 and 3.9 have
    them); without them a Gluon form runs its Triton fallback."""
    try:
        from sketchcal.kernels.common import gluon_helpers  # noqa: F401
    except (ImportError, AttributeError):
        return False
    return True


def gluon_flush_runs(cfg: KernelConfig, family: str, pool: DecodePool) -> bool:
    """Whether ``cfg`` names a Gluon flush of ``family`` that can run on ``pool``: a CUDA device,
    bf16 buffered inputs, a Triton with Gluon, and for KDA's sweep a pool its layouts cover."""
    if not (
        cfg.form in GLUON_FORMS
        and family in FORMS[cfg.form].families
        and pool.state.is_cuda
        and not interpreting()
        and pool.buf_k.dtype == pool.buf_w.dtype == torch.bfloat16
        and gluon_available()
    ):
        return False
    if cfg.form == "gluon_sweep":
        from sketchcal.kernels.kda import flush_sweep

        _, h, kd, vd = pool.state.shape
        block_v = clip_block_v(cfg.block_v, vd)
        return flush_sweep.usable(h, pool.buf_k.shape[1], kd, vd, pool.capacity, cfg.num_warps, block_v)
    return True


def runnable(
    cfg: KernelConfig, family: str, pool: DecodePool, tables: SketchTables | None, tokens: int, *,
    adaptive: bool = False,
) -> KernelConfig:  # fmt: skip
    """``cfg``, or its fallback where its kernel cannot run on this call (see the module docstring)."""
    if adaptive:  # per-slot maps: only the one-kernel read takes them
        return replace(cfg, form="read")
    if not is_dense(pool) and cfg.form not in PAGED_FORMS:
        return replace(cfg, form="read") if FORMS[cfg.form].op == "read" else SWEEP_FALLBACK
    if cfg.form == "split_read":
        from sketchcal.kernels.mamba2 import read_split

        return cfg if read_split.usable(family, pool, tables, tokens) else replace(cfg, form="read")
    if cfg.form in GLUON_FORMS and not gluon_flush_runs(cfg, family, pool):
        return replace(cfg, form="chunk") if cfg.form == "gluon_chunk" else SWEEP_FALLBACK
    return cfg


def _launcher(cfg: KernelConfig, kernel: str, family: str):
    """The ``launch`` function of ``cfg``'s form, checked to serve ``kernel`` for ``family``."""
    form = FORMS[cfg.form]
    if form.op != KERNEL_OPS[kernel] or family not in form.families:
        serving = [n for n, f in FORMS.items() if f.op == KERNEL_OPS[kernel] and family in f.families]
        raise ValueError(
            f"KernelConfig.form {cfg.form!r} does not run the {kernel} kernel of {family}; "
            f"use one of {', '.join(serving)}"
        )
    return importlib.import_module(f"sketchcal.kernels.{form.module}").launch


# ----------------------------------------------------------------------------------------------
# input checks
# ----------------------------------------------------------------------------------------------


def _dims(family: str, x: StepInputs, heads: int) -> tuple[int, int, int, int, int, int]:
    """(B, T, G, K, V, H) after checking the kernel-layout inputs."""
    check_family(family)
    b, t, g, kd = x.k.shape
    vd = x.w.shape[-1]
    if x.q.shape != x.k.shape or x.w.shape != (b, t, heads, vd):
        raise ValueError(
            f"inputs: k, q must be [B, T, G, K] and w [B, T, H={heads}, V]; got "
            f"k {tuple(x.k.shape)}, q {tuple(x.q.shape)}, w {tuple(x.w.shape)}"
        )
    dshape = (b, t, heads, kd) if family == "kda" else (b, t, heads)
    if x.decay.shape != dshape:
        raise ValueError(f"inputs: decay must be {list(dshape)}, got {list(x.decay.shape)}")
    if family != "mamba2" and (x.beta is None or x.beta.shape != (b, t, heads)):
        raise ValueError("inputs: the delta rules need beta [B, T, H]")
    if heads % g:
        raise ValueError(f"heads ({heads}) must be a multiple of groups ({g})")
    for name, tensor in (
        ("k", x.k),
        ("q", x.q),
        ("w", x.w),
        ("decay", x.decay),
        ("beta", x.beta),
        ("skip", x.skip),
    ):
        if tensor is not None and not tensor.is_contiguous():
            raise ValueError(f"inputs: {name} must be contiguous")
    if not (x.k.is_cuda or interpreting()):
        raise RuntimeError("the decode kernels need a CUDA device (or TRITON_INTERPRET=1 on the CPU)")
    return b, t, g, kd, vd, heads


def _out(out: Tensor | None, x: StepInputs, heads: int, tokens: int) -> Tensor:
    b = x.w.shape[0]
    shape = (b, tokens, heads, x.w.shape[-1])
    if out is None:
        return torch.empty(shape, dtype=x.w.dtype, device=x.w.device)
    if tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {list(shape)} tensor")
    return out


def _window_pool(pool: DecodePool, sketch: bool) -> tuple[int, int]:
    """Checks a window pool for the read and flush kernels; returns (K, V)."""
    if pool.buf_w is None:
        raise ValueError("a window pool (capacity > 0) is needed")
    if sketch and pool.sketch is None:
        raise ValueError("sketch mode needs a pool with a sketch tensor (allocate_pool(sketch_rows=M))")
    if not is_dense(pool):
        check_paged(pool)
    kd, vd = pool.state.shape[2:]
    if kd < CHUNK_MIN or vd < CHUNK_MIN:
        raise ValueError(f"the window kernels need K, V ≥ {CHUNK_MIN} (tensor-core tiles); K={kd}, V={vd}")
    return kd, vd


# ----------------------------------------------------------------------------------------------
# entry points
# ----------------------------------------------------------------------------------------------


def standard_step(
    family: str, state: Tensor | DecodePool, slots: Tensor, x: StepInputs, out: Tensor | None = None, *,
    config: KernelConfig | None = None,
) -> Tensor:  # fmt: skip
    """The baseline: ``S ← A S + k wᵀ``, ``o = Sᵀ q (+ skip)`` for each of the T tokens in turn,
    in place on ``state`` [N, H, K, V] fp32 at the slots given, stored key-major or value-major
    (``allocate_pool(value_major=True)``). Returns ``out`` [B, T, H, V]."""
    state = state.state if isinstance(state, DecodePool) else state
    _, t, _, _, _, h = _dims(family, x, state.shape[1])
    cfg = config or default_config("standard", family)
    out = _out(out, x, h, t)
    _launcher(cfg, "standard", family)(family, state, slots, x, out, cfg)
    return out


# The read kernel unrolls its T new tokens, and per token the buffer sweep and the checkpoint read,
# so its build time grows quickly with T (a 15-token sketch read took minutes to build); longer
# calls are read in launches of at most this many tokens.
READ_TOKENS_PER_LAUNCH = 4


def spec_verify(
    family: str, pool: DecodePool, slots: Tensor, pos: Tensor, x: StepInputs, out: Tensor | None = None, *,
    tables: SketchTables | None = None, config: KernelConfig | None = None,
    adaptive: AdaptiveSketch | None = None,
) -> Tensor:  # fmt: skip
    """Outputs of T tokens following the ``pos[b]`` buffered ones, read from the checkpoint's read
    copy (``tables`` None: replay), its sketch, or with ``adaptive`` its adaptive factors (the
    one-kernel read), plus the buffer; no state is materialised or written. The T
    tokens are appended to the buffer at ``pos[b]`` (entries past the capacity are dropped: keep
    ``pos + T ≤ C``). Returns ``out`` [B, T, H, V]."""
    _, t, _, _, _, h = _dims(family, x, pool.heads)
    if adaptive is not None:
        tables = _adaptive_tables(pool, adaptive)
    sketch = tables is not None
    _window_pool(pool, sketch)
    if pool.read is None:
        raise ValueError("a window pool with a read copy is needed")
    kernel = "sketch" if sketch else "replay"
    cfg = config or default_config(kernel, family, pool.read.dtype)
    _launcher(cfg, kernel, family)  # the config's own form must serve this kernel
    out = _out(out, x, h, t)
    extra = {} if adaptive is None else {"adaptive": adaptive}  # (runnable picks the form taking it)
    if t <= READ_TOKENS_PER_LAUNCH:
        cfg = runnable(cfg, family, pool, tables, t, adaptive=adaptive is not None)
        _launcher(cfg, kernel, family)(family, pool, tables, slots, pos, x, out, cfg, **extra)
        return out
    # a later chunk finds the earlier chunks' tokens in the buffer: the same sums as one launch
    for start in range(0, t, READ_TOKENS_PER_LAUNCH):
        stop = min(start + READ_TOKENS_PER_LAUNCH, t)
        part = x.tokens(slice(start, stop)).map(Tensor.contiguous)
        part_out = out[:, start:stop].contiguous()  # padding entries keep what out holds
        part_cfg = runnable(cfg, family, pool, tables, stop - start, adaptive=adaptive is not None)
        launch = _launcher(part_cfg, kernel, family)
        launch(family, pool, tables, slots, pos + start, part, part_out, part_cfg, **extra)
        out[:, start:stop].copy_(part_out)
    return out


def replay_step(
    family: str, pool: DecodePool, slots: Tensor, pos: Tensor, x: StepInputs, out: Tensor | None = None, *,
    config: KernelConfig | None = None,
) -> Tensor:  # fmt: skip
    """ReplaySSM non-flush step (T = 1): read copy + buffer; no state write."""
    return spec_verify(family, pool, slots, pos, x, out, config=config)


def sketch_step(
    family: str, pool: DecodePool, tables: SketchTables, slots: Tensor, pos: Tensor, x: StepInputs,
    out: Tensor | None = None, *, config: KernelConfig | None = None, adaptive: AdaptiveSketch | None = None,
) -> Tensor:  # fmt: skip
    """SketchSSM non-flush step (T = 1): sketch rows + buffer + coefficient map (``adaptive``: each
    slot's own factors); dense (rank-0) heads read the full read copy."""
    return spec_verify(family, pool, slots, pos, x, out, tables=tables, config=config, adaptive=adaptive)


def flush(
    family: str, pool: DecodePool, slots: Tensor, pos: Tensor, x: StepInputs | None = None,
    out: Tensor | None = None, *, tables: SketchTables | None = None, config: KernelConfig | None = None,
    adaptive: AdaptiveSketch | None = None,
) -> Tensor | None:  # fmt: skip
    """Fold the ``pos[b]`` buffered tokens, then ``x``'s single token if given (its output is
    returned), exactly into the fp32 checkpoint ``pool.state``; refresh the read copy: every row
    (``tables`` None, replay mode) or ``tables.read_rows`` per head (sketch mode: the dense
    heads), and in sketch mode the sketch ``R_{:m} S_c`` of each head of rank m > 0; with
    ``adaptive``, then each flushed slot's adaptive factors (``common.adaptive.factor``). The
    caller then resets ``pos`` to 0."""
    if adaptive is not None:
        tables = _adaptive_tables(pool, adaptive)
    sketch = tables is not None
    _window_pool(pool, sketch)
    if x is not None:
        _, t, _, _, _, _ = _dims(family, x, pool.heads)
        if t != 1:
            raise ValueError("flush takes at most one new token")
        out = _out(out, x, pool.heads, 1)
    else:
        check_family(family)
    kernel = "flush_sketch" if sketch else "flush_replay"
    read_dtype = pool.read.dtype if pool.read is not None else None
    cfg = config or default_config(kernel, family, read_dtype)
    _launcher(cfg, kernel, family)
    cfg = runnable(cfg, family, pool, tables, 1)
    _launcher(cfg, kernel, family)(family, pool, tables, slots, pos, x, out, cfg)
    if adaptive is not None:
        factor(pool, adaptive, slots)
    return out


def _adaptive_tables(pool: DecodePool, adaptive: AdaptiveSketch) -> SketchTables:
    adaptive.check(pool)
    return adaptive.tables
