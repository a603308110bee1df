"""``sketchcal bench``: decode-kernel speed at real model shapes, on a CUDA device.

For one family and batch size it times, side by side in one run:

- ``standard``: our standard step (read the fp32 state, update, write);
- every public kernel for the same step that imports, each in the state layout it takes (fla's
  ``fused_recurrent`` for GDN and KDA, key-major and value-major; vLLM's and mamba_ssm's
  ``selective_state_update`` for Mamba-2); the fastest is the ``anchor``;
- the ReplaySSM window: (L − 1) replay steps + 1 flush, and the SketchSSM window: (L − 1)
  sketch steps + 1 flush (which also writes the sketch R_{:m} S_c), each per window and per
  component;
- a device-to-device copy (bytes read + bytes written), the bandwidth ceiling;
- with ``staggered``, both windows again with the sequences' windows in staggered phases (each
  step flushes the ~B/L sequences at the end of theirs and reads the others; the flush on a side
  stream beside the reads, and before them on one stream), as continuous batching leaves them
  unless the engine aligns its flushes (one flush of the whole batch runs nearer the bandwidth than
  L flushes of B/L sequences);
- with ``paged``, the window pools laid out as vLLM's pages (``testing.paged``: each slot's part of
  a tensor a page apart, the checkpoint value-major), as the vLLM plugin decodes on a GPU: the forms
  that take slot strides run (``dispatch.PAGED_FORMS``).

Every timing replays a CUDA graph over ``pools`` (≥ 4) independent state pools in turn, so the
state is never L2-resident. Bytes follow the project's byte model (each tensor read or written
once per call: state, read copy or sketch rows, buffered tokens, inputs, outputs).
Speedup = L · standard ÷ window.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace

import torch
from torch import Tensor

from sketchcal.errors import SketchcalError
from sketchcal.kernels import dispatch
from sketchcal.kernels.common.pool import (
    AdaptiveSketch,
    DecodePool,
    SketchTables,
    allocate_pool,
    check_family,
    clip_rank,
    random_sketch,
    rank_spread,
)
from sketchcal.kernels.common.recurrence import StepInputs
from sketchcal.kernels.common.testing import paged as page_layout
from sketchcal.kernels.common.testing import paged_adaptive, random_inputs
from sketchcal.kernels.dispatch import DEFAULT_CONFIGS, KERNEL_OPS, KernelConfig


@dataclass(frozen=True)
class ModelShape:
    name: str
    heads: int
    groups: int
    key_dim: int
    value_dim: int


MODEL_SHAPES = {
    "gdn": ModelShape("Qwen3.5-4B GDN", heads=32, groups=16, key_dim=128, value_dim=128),
    "kda": ModelShape("Kimi-Linear-48B KDA", heads=32, groups=32, key_dim=128, value_dim=128),
    "mamba2": ModelShape("Nemotron-3-Nano Mamba-2", heads=64, groups=8, key_dim=128, value_dim=64),
}

# read copy / sketch precisions (fp8 = e4m3, stored saturated at ±448 as the flush writes it)
READ_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}

# Launch shapes tried with ``tune=True``, per candidate group and family; block_v is clipped to V.
# The standard step keeps one shape. Reads take a dense head's read copy 16 rows at a time
# (``dense_rows``) and sketch reads may load their map rows after the sweep (``early_map``): that
# leaves them at 64-80 registers instead of ~160, so caps down to 64 (32 one-warp programs per SM,
# the most an SM holds) are tried.
_K = KernelConfig
TUNE_CANDIDATES: dict[str, dict[str, list[KernelConfig]]] = {
    # [8 or 16, K] tiles of a value-major state; key-major [K, BV] tiles (block_v 16-128, 1-8
    # warps, register caps) and wider value-major ones (32) were slower in every family
    "standard": {
        f: [_K("standard", bv, nw) for bv, nw in ((8, 1), (8, 2), (8, 4), (16, 1), (16, 8))]
        for f in ("mamba2", "gdn", "kda")
    },
    "replay": {
        "mamba2": [_K("read", 64, 1, maxnreg=96), _K("read", 64, 1, group=4, dense_rows=16)],
        "gdn": [_K("read", 64, 1, group=4, dense_rows=16), _K("read", 128, 1, group=4, dense_rows=16)],
        "kda": [_K("read", 64, 1, group=4, dense_rows=16), _K("read", 128, 1, group=4, dense_rows=16)],
    },
    "sketch": {
        # groups of 3-8 cut the dependent load round trips of a long buffer at ≤ 72 registers, with
        # the map rows loaded after the sweep (and the buffer prefetched into L2 first)
        "mamba2": [
            _K("read", 64, 1, maxnreg=cap, group=g, dense_rows=16, early_map=False, prefetch=pf)
            for cap, g, pf in ((64, 4, False), (64, 6, False), (64, 8, False), (64, 8, True))
        ]
        # the split read: the coefficients once per key group (and the dots, or the head kernel
        # computes them), then the heads' sums, 4 heads per program (the one-kernel fields serve
        # spec_verify)
        + [replace(DEFAULT_CONFIGS[("sketch", "mamba2")], dots=d) for d in (2, 0)],
        # one program per head (V = 128): the sweep is done once, not once per half
        "gdn": [
            _K("read", 128, 1, maxnreg=cap, group=g, dense_rows=16, early_map=False, prefetch=pf)
            for cap, g, pf in ((64, 2, False), (64, 3, False), (72, 4, False), (64, 6, False), (64, 6, True))
        ],
        "kda": [
            _K("read", 128, 1, maxnreg=cap, group=g, dense_rows=16, early_map=False)
            for cap, g in ((64, 2), (72, 2), (72, 3), (72, 4), (72, 6))
        ],
    },
    "flush": {
        # Mamba-2: the chunked flush on tensor cores (a register cap trades a few spills for more
        # resident warps), its persistent Gluon form, and the token-by-token sweep
        "mamba2": [
            _K("chunk", 64, 4),
            _K("chunk", 64, 4, maxnreg=128),
            _K("chunk", 64, 4, maxnreg=120),
            _K("sweep", 16, 1, vec=2, maxnreg=96),
            _K("gluon_chunk", 64, 4, maxnreg=168, per_sm=3),
        ],
        "gdn": [
            _K("sweep", 16, 1, vec=4),
            _K("sweep", 16, 1, vec=2),
            _K("sweep", 16, 1, vec=2, prefetch=True),
        ],
        # KDA: Triton's sweep, and the persistent Gluon sweep with deferred decays: a head per
        # program of 8 warps, or half a head per program of 4
        "kda": [
            _K("sweep", 16, 1, vec=4, maxnreg=128),
            _K("sweep", 16, 1, vec=2),
            _K("sweep", 32, 2, vec=4),
            _K("gluon_sweep", 128, 8, per_sm=1),
            _K("gluon_sweep", 64, 4, per_sm=2),
            _K("gluon_sweep", 64, 4, maxnreg=168, per_sm=3),
        ],
    },
}

# Mamba-2's split sketch read: further launch shapes, not among the tuning candidates; the ``gpu``
# tests check them and ``resources.py`` compiles them.
SPLIT_SHAPES = [
    _K("split_read", 64, 1, dense_rows=16, coef_warps=2, heads=4, dots=0),
    _K("split_read", 64, 1, dense_rows=16, coef_warps=2, heads=4, dots=2),
    _K("split_read", 64, 1, dense_rows=16, coef_warps=2, heads=2, dots=2),
    _K("split_read", 64, 1, dense_rows=16, coef_warps=2, heads=2, dots=0),
]

TUNED_KERNELS = tuple(KERNEL_OPS)

# the short form's keys (parse_config) and the KernelConfig fields they set
_SHORT_KEYS = {
    "vec": "vec",
    "cap": "maxnreg",
    "group": "group",
    "rows": "dense_rows",
    "per_sm": "per_sm",
    "coef_warps": "coef_warps",
    "heads": "heads",
    "dots": "dots",
}
_SHORT_FORM = (
    "FORM,BV,WARPS[,vec=N][,cap=N][,group=N][,rows=N][,per_sm=N][,coef_warps=N][,heads=N][,dots=N]"
    "[,late_map][,prefetch]"
)


def parse_config(text: str) -> KernelConfig:
    """A launch shape from its short form ``FORM,BV,WARPS[,key=N]…[,late_map][,prefetch]``, e.g.
    ``sweep,16,1,vec=2`` or ``chunk,64,4,cap=128``: FORM is one of ``dispatch.FORMS``; ``cap`` is
    ``maxnreg``, ``rows`` is ``dense_rows``, the other keys are the fields' names."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    try:
        form, bv, warps, *rest = words
        opts = {_SHORT_KEYS[k]: int(v) for k, v in (w.split("=", 1) for w in rest if "=" in w)}
        flags = {w for w in rest if "=" not in w}
        if flags - {"late_map", "prefetch"}:
            raise ValueError(f"unknown flags {sorted(flags - {'late_map', 'prefetch'})}")
        return KernelConfig(
            form,
            int(bv),
            int(warps),
            early_map="late_map" not in flags,
            prefetch="prefetch" in flags,
            **opts,
        )
    except (ValueError, KeyError) as err:
        raise SketchcalError(f"launch shape {text!r}: expected {_SHORT_FORM} ({err})") from None


def short_form(cfg: KernelConfig) -> str:
    """The short form of a launch shape (:func:`parse_config`'s inverse): the fields that differ
    from their defaults."""
    keys = {field: key for key, field in _SHORT_KEYS.items()}
    default = {f.name: f.default for f in fields(KernelConfig)}
    words = [cfg.form, str(cfg.block_v), str(cfg.num_warps)]
    words += [f"{keys[f]}={getattr(cfg, f)}" for f in keys if getattr(cfg, f) != default[f]]
    words += ["late_map"] * (not cfg.early_map) + ["prefetch"] * cfg.prefetch
    return ",".join(words)


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------


class _Timer:
    """Median time of ``fn`` (µs per call): CUDA graph replays timed by events on a GPU; a plain
    wall clock for the CPU dry run (``TRITON_INTERPRET=1``, used by the tests)."""

    def __init__(self, cuda: bool, replays: int = 10):
        self.cuda = cuda
        self.replays = replays

    def __call__(self, fn: Callable[[], None], calls: int) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6 / calls
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # compile and warm outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        del graph
        return statistics.median(times) / calls


def copy_bandwidth(device, nbytes: int = 1 << 30, replays: int = 20) -> float:
    """Device-to-device copy bandwidth in TB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    # eager, not graph-captured: a captured copy becomes a memcpy node on the copy engine (slower)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return 2 * nbytes / (statistics.median(times) * 1e-6) / 1e12


# ----------------------------------------------------------------------------------------------
# byte model
# ----------------------------------------------------------------------------------------------


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class ByteModel:
    """Bytes each call moves through device memory, for one layer and B sequences."""

    family: str
    batch: int
    shape: ModelShape
    ranks: list[int]
    read_bytes: int = 2  # read copy / sketch element
    input_bytes: int = 2
    split: bool = False  # Mamba-2's sketch read in two kernels, through the pool's workspace
    split_dots: bool = True  # ... the group's dots through it too (KernelConfig.dots > 0)

    @property
    def _h(self):
        s = self.shape
        return s.heads, s.groups, s.key_dim, s.value_dim

    def _entry(self, decay_bytes: int) -> int:
        """One token's k, w and beta, per sequence, plus ``decay_bytes`` per decay value."""
        h, g, kd, vd = self._h
        decays = h * kd if self.family == "kda" else h
        beta = 0 if self.family == "mamba2" else h * 4
        return g * kd * self.input_bytes + h * vd * self.input_bytes + decays * decay_bytes + beta

    @property
    def _log2_decays(self) -> bool:
        """KDA pools keep bf16 log₂ decays for the reads unless the read copy is fp32."""
        return self.family == "kda" and self.read_bytes < 4

    def token(self) -> int:
        """One token as a step appends it to the buffer: fp32 decays, and their bf16 log₂ where the
        pool keeps them (``DecodePool.buf_logdecay``)."""
        return self._entry(4 + (2 if self._log2_decays else 0))

    def read_token(self) -> int:
        """One buffered token as a read loads it (the log₂ decays where the pool keeps them)."""
        return self._entry(2 if self._log2_decays else 4)

    def flush_token(self) -> int:
        """One buffered token as the flush loads it, or a new token's inputs: fp32 decays."""
        return self._entry(4)

    def io(self) -> int:
        """Inputs read and outputs written by one call for one token, per sequence."""
        h, g, kd, vd = self._h
        skip = h * vd * self.input_bytes if self.family == "mamba2" else 0
        return self.flush_token() + g * kd * self.input_bytes + skip + h * vd * self.input_bytes

    def state(self) -> int:
        h, _, kd, vd = self._h
        return h * kd * vd * 4

    def standard(self) -> int:
        return self.batch * (2 * self.state() + self.io())

    def replay_step(self, p: int) -> int:
        h, _, kd, vd = self._h
        return self.batch * (h * kd * vd * self.read_bytes + p * self.read_token() + self.token() + self.io())

    def sketch_step(self, p: int) -> int:
        _, _, kd, vd = self._h
        rows = sum(m if m > 0 else kd for m in self.ranks)
        maps = sum(self.ranks) * kd * 4  # shared by the batch: read once
        per_seq = rows * vd * self.read_bytes + p * self.read_token() + self.token() + self.io()
        if self.split:  # the coefficients (and dots), written by one kernel and read by the next
            dots = self.shape.groups * (p + 1) if self.split_dots else 0
            per_seq += 2 * 4 * (dots + sum(self.ranks))
        return self.batch * per_seq + maps

    def flush(self, n: int, sketch: bool) -> int:
        h, _, kd, vd = self._h
        # rows refreshed: the whole read copy (replay); the sketch's m rows per sketch head and the
        # whole read copy of a dense head (sketch)
        rows = h * kd if not sketch else sum(m if m > 0 else kd for m in self.ranks)
        per_seq = 2 * self.state() + rows * vd * self.read_bytes + n * self.flush_token() + self.io()
        return self.batch * per_seq

    def window(self, window: int, sketch: bool) -> int:
        step = self.sketch_step if sketch else self.replay_step
        return sum(step(p) for p in range(window - 1)) + self.flush(window - 1, sketch)


# ----------------------------------------------------------------------------------------------
# anchors (public kernels, run side by side)
# ----------------------------------------------------------------------------------------------


AnchorRun = tuple[Callable[[int, int], None], Callable[[], float]]


def _anchors(
    family: str, pools: list[DecodePool], xs: list[StepInputs], slots: torch.Tensor, raw: dict
) -> dict[str, AnchorRun | str]:
    """The public kernels for the same step, by name: ``(run, check)`` each, or a string saying why
    it is unavailable. ``run(pool_index, token_index)`` launches it on its own copy of that pool's
    state (in the layout it is fastest in); ``check()`` runs it once on a copy of pool 0 and returns
    its output's relative difference from our standard step on the same state and inputs.

    GDN and KDA: fla's ``fused_recurrent`` with the key-major state (``[N, H, K, V]``, ours) and with
    the value-major state (``state_v_first``, ``[N, H, V, K]``, the layout vLLM keeps). Mamba-2:
    ``selective_state_update`` of mamba_ssm and of vLLM, both value-major (``[N, H, head_dim,
    d_state]``)."""
    if family in ("gdn", "kda"):
        return {
            f"fla {layout}": _fla_anchor(family, pools, xs, slots, layout == "value-major")
            for layout in ("key-major", "value-major")
        }
    return {name: _ssu_anchor(name, pools, xs, slots, raw) for name in ("mamba_ssm", "vLLM")}


def _check_against_standard(family, launch, pool: DecodePool, slots, x: StepInputs, value_major: bool):
    st = pool.state.clone()
    theirs = launch(st.transpose(-1, -2).contiguous() if value_major else st.clone(), 0).float()
    ours = dispatch.standard_step(family, st, slots, x).float().reshape(theirs.shape)
    return ((theirs - ours).norm() / ours.norm()).item()


def _fla_anchor(family: str, pools, xs, slots, value_major: bool) -> AnchorRun | str:
    try:
        if family == "gdn":
            from fla.ops.gated_delta_rule.fused_recurrent import (
                fused_recurrent_gated_delta_rule_fwd as fla_fn,
            )
        else:
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_fn
    except Exception as err:
        return f"fla not importable ({type(err).__name__}: {err})"
    args = []
    for x in xs:
        v = (x.w.float() / x.beta[..., None]).to(x.w.dtype)
        args.append(dict(q=x.q, k=x.k, v=v, g=x.decay.log().contiguous(), beta=x.beta.contiguous()))
    states = [p.state.transpose(-1, -2).contiguous() if value_major else p.state for p in pools]
    outs = [torch.empty_like(xs[0].w) for _ in pools]

    def launch(state: torch.Tensor, t: int, out: torch.Tensor | None = None) -> torch.Tensor:
        common = dict(scale=1.0, initial_state=state, state_v_first=value_major)
        if family == "gdn":  # fla's GDN kernel writes a fresh final state (same bytes)
            return fla_fn(**args[t], **common, output_final_state=True)[0]
        out = torch.empty_like(xs[0].w) if out is None else out
        return fla_fn(**args[t], **common, inplace_final_state=True, ssm_state_indices=slots, out=out)[0]

    def run(i: int, t: int) -> None:
        launch(states[i], t, outs[i])

    def check() -> float:
        return _check_against_standard(family, launch, pools[0], slots, xs[0], value_major)

    return run, check


def _ssu_anchor(name: str, pools, xs, slots, raw: dict) -> AnchorRun | str:
    """Mamba-2's ``selective_state_update`` (mamba_ssm's or vLLM's Triton kernel)."""
    try:
        if name == "vLLM":
            from vllm.model_executor.layers.mamba.ops.mamba_ssm import selective_state_update

            # our slot 0 is a real sequence, not vLLM's null block; vLLM writes a preallocated output
            extra = dict(null_block_id=-1, out=torch.empty_like(raw["x"][0]))
        else:
            from mamba_ssm.ops.triton.selective_state_update import selective_state_update

            extra = {}
    except Exception as err:
        return f"{name} not importable ({type(err).__name__}: {err})"
    h, kd, vd = pools[0].heads, pools[0].state.shape[2], pools[0].state.shape[3]
    states = [p.state.transpose(-1, -2).contiguous() for p in pools]
    a_mat = raw["A"][:, None, None].expand(h, vd, kd)
    d_vec = raw["D"][:, None].expand(h, vd)
    dt_bias = torch.zeros(h, device=slots.device)[:, None].expand(h, vd)
    args = [
        dict(x=raw["x"][t], dt=raw["dt"][t][:, :, None].expand(-1, -1, vd), B=x.k[:, 0], C=x.q[:, 0])
        for t, x in enumerate(xs)
    ]

    def launch(state: torch.Tensor, t: int) -> torch.Tensor:
        y = selective_state_update(
            state,
            A=a_mat,
            D=d_vec,
            dt_bias=dt_bias,
            dt_softplus=True,
            state_batch_indices=slots,
            **args[t],
            **extra,
        )
        return extra["out"] if y is None else y

    def run(i: int, t: int) -> None:
        launch(states[i], t)

    def check() -> float:
        return _check_against_standard("mamba2", launch, pools[0], slots, xs[0], True)

    return run, check


def _mamba_raw(xs: list[StepInputs], heads: int, device) -> dict:
    """Mamba-2 raw inputs (x, dt before softplus, A, D) and our inputs made consistent with them:
    decay = exp(softplus(dt)·A), w = softplus(dt)·x, skip = D·x."""
    a = -torch.rand(heads, device=device) - 0.5
    d = torch.randn(heads, device=device)
    raw = dict(A=a, D=d, x=[], dt=[])
    for x in xs:
        xin = x.w[:, 0].clone()
        dt_raw = (torch.randn(x.w.shape[0], heads, device=device) - 2.0).to(xin.dtype)
        dt = torch.nn.functional.softplus(dt_raw.float())
        x.decay.copy_(torch.exp(dt * a)[:, None])
        x.w.copy_((dt[..., None] * xin.float())[:, None].to(x.w.dtype))
        x.skip.copy_((d[:, None] * xin.float())[:, None].to(x.skip.dtype))
        raw["x"].append(xin)
        raw["dt"].append(dt_raw)
    return raw


# ----------------------------------------------------------------------------------------------
# the benchmark
# ----------------------------------------------------------------------------------------------


def _configs(
    family: str, configs: dict[str, KernelConfig] | None, read_dtype: torch.dtype
) -> dict[str, KernelConfig]:
    out = {kernel: dispatch.default_config(kernel, family, read_dtype) for kernel in TUNED_KERNELS}
    out.update(configs or {})
    return out


def staggered_schedule(slots: torch.Tensor, window: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    """The steps of one window with the sequences' windows in staggered phases, as continuous
    batching leaves them when an engine does not align its flushes: entry b starts its window at
    step b mod L. Per step t: (the slots that flush, ending their window; the slots that read;
    their ``pos``). Over the L steps each slot flushes once and reads once at each pos < L − 1."""
    phase = torch.arange(len(slots), device=slots.device) % window
    steps = []
    for t in range(window):
        p = ((t + phase) % window).to(torch.int32)
        due = p == window - 1
        steps.append((slots[due], slots[~due], p[~due].contiguous()))
    return steps


def run_bench(
    family: str,
    batch: int,
    rank: float = 8,
    window: int = 16,
    read_dtype: str = "bf16",
    pools: int = 4,
    *,
    shape: ModelShape | None = None,
    anchor: bool = True,
    tune: bool = False,
    configs: dict[str, KernelConfig] | None = None,
    candidates: dict[str, list[KernelConfig]] | None = None,
    replays: int = 10,
    seed: int = 0,
    staggered: bool = False,
    paged: bool = False,
    _cpu_dry_run: bool = False,
) -> dict:
    """Time the decode kernels of ``family`` at ``batch`` sequences; see the module docstring.

    ``rank`` is the mean per-head rank (spread by :func:`rank_spread`; 0 = all heads dense),
    ``window`` the window length L, ``read_dtype`` the read copy's dtype (``bf16``, ``fp32`` or ``fp8``),
    ``pools`` the number of state pools rotated through (≥ 4 keeps the L2 cold), ``tune`` tries
    the launch shapes in ``TUNE_CANDIDATES`` first and keeps the fastest; ``candidates`` (with
    ``tune``) replaces those lists: only the kernels it names (of ``TUNED_KERNELS``) are tuned, the
    others keep their default (or ``configs``) shape. Returns a JSON-able dict.
    Raises :class:`SketchcalError` without a CUDA device.
    """
    check_family(family)
    cuda = torch.cuda.is_available() and not _cpu_dry_run
    if not cuda and not _cpu_dry_run:
        raise SketchcalError(
            "sketchcal bench needs a CUDA device and none is visible to torch; run it on a GPU machine"
        )
    if window < 2:
        raise SketchcalError(f"--window must be at least 2, got {window}")
    if read_dtype not in READ_DTYPES:
        raise SketchcalError(f"--read-dtype must be one of {', '.join(READ_DTYPES)}, got {read_dtype!r}")
    if pools < 1 or batch < 1:
        raise SketchcalError("--batch and --pools must be positive")
    if paged and tune:
        raise SketchcalError("--paged times the forms paged pools run; drop --tune")
    if candidates is not None and (set(candidates) - set(TUNED_KERNELS) or not all(candidates.values())):
        raise SketchcalError(
            f"candidates: give a non-empty list per kernel, kernels among {', '.join(TUNED_KERNELS)}"
        )
    shape = shape or MODEL_SHAPES[family]
    dev = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(seed)
    h, g, kd, vd = shape.heads, shape.groups, shape.key_dim, shape.value_dim
    ranks = rank_spread(h, rank, kd)
    tables: SketchTables = random_sketch(family, ranks, g, kd, torch.Generator().manual_seed(seed)).to(dev)
    rd = READ_DTYPES[read_dtype]
    slots = torch.arange(batch, dtype=torch.int32, device=dev)
    pos = [torch.full((batch,), p, dtype=torch.int32, device=dev) for p in range(window)]

    def make_pool() -> DecodePool:
        pool = allocate_pool(
            family,
            batch,
            h,
            g,
            kd,
            vd,
            capacity=window,
            read_dtype=rd,
            sketch_rows=tables.map_rows,
            device=dev,
        )
        pool.state.normal_(0.0, 0.3)
        pool.read.copy_(pool.state)
        if pool.sketch is not None:  # (drawn in fp32: torch has no fp8 normal_)
            pool.sketch.copy_(0.3 * torch.randn(pool.sketch.shape, device=dev))
        return pool

    dense = [make_pool() for _ in range(pools)]
    # the window's pools; the public kernels take the dense ones' states, in their own layouts
    plist = [page_layout(p) for p in dense] if paged else dense
    xs = [random_inputs(family, batch, 1, h, g, kd, vd, device=dev) for _ in range(window)]
    outs = [torch.empty_like(xs[0].w) for _ in range(pools)]
    raw = _mamba_raw(xs, h, dev) if family == "mamba2" else {}
    timer = _Timer(cuda, replays)
    cfg = _configs(family, configs, rd)
    if paged:  # what runs on a paged pool
        cfg = {
            k: c if k == "standard" else dispatch.runnable(c, family, plist[0], tables, 1)
            for k, c in cfg.items()
        }

    # the standard step's own copies of the states, in standard pools as the runtime keeps them
    std_states = [
        allocate_pool(
            family, batch, h, g, kd, vd, value_major=dispatch.STANDARD_VALUE_MAJOR, device=dev
        ).state.copy_(p.state)
        for p in plist
    ]

    def standard_fn(c: KernelConfig, steps: int = window) -> Callable[[], None]:
        def fn() -> None:
            for t in range(steps):
                for i, state in enumerate(std_states):
                    dispatch.standard_step(family, state, slots, xs[t], outs[i], config=c)

        return fn

    def steps_fn(sketch: bool, c: KernelConfig) -> Callable[[], None]:
        def fn() -> None:
            for t in range(window - 1):
                for i, pool in enumerate(plist):
                    if sketch:
                        dispatch.sketch_step(family, pool, tables, slots, pos[t], xs[t], outs[i], config=c)
                    else:
                        dispatch.replay_step(family, pool, slots, pos[t], xs[t], outs[i], config=c)

        return fn

    def flush_fn(sketch: bool, c: KernelConfig) -> Callable[[], None]:
        def fn() -> None:
            for i, pool in enumerate(plist):
                dispatch.flush(
                    family,
                    pool,
                    slots,
                    pos[window - 1],
                    xs[window - 1],
                    outs[i],
                    tables=tables if sketch else None,
                    config=c,
                )

        return fn

    lanes = (
        [
            (
                fs,
                random_inputs(family, len(fs), 1, h, g, kd, vd, device=dev),
                rs,
                rp,
                random_inputs(family, len(rs), 1, h, g, kd, vd, device=dev),
            )
            for fs, rs, rp in staggered_schedule(slots, window)
        ]
        if staggered
        else []
    )
    lane_outs = [
        [(torch.empty_like(fx.w), torch.empty_like(rx.w)) for _, fx, _, _, rx in lanes] for _ in plist
    ]
    side = torch.cuda.Stream() if cuda and staggered else None

    def staggered_fn(sketch: bool, overlap: bool) -> Callable[[], None]:
        """One window in staggered phases (:func:`staggered_schedule`): each step's flush on a side
        stream beside its reads, forked and joined within the step (``overlap``), or before them."""
        name = "sketch" if sketch else "replay"
        c_read, c_flush = cfg[name], cfg[f"flush_{name}"]
        tab = tables if sketch else None
        last = pos[window - 1]

        def fn() -> None:
            fork = torch.cuda.current_stream() if overlap and side is not None else None
            for t, (fslots, fx, rslots, rpos, rx) in enumerate(lanes):
                for i, pool in enumerate(plist):
                    fo, ro = lane_outs[i][t]
                    if fork is not None:
                        side.wait_stream(fork)
                    with torch.cuda.stream(side) if fork is not None else contextlib.nullcontext():
                        if len(fslots):
                            dispatch.flush(
                                family, pool, fslots, last[: len(fslots)], fx, fo, tables=tab, config=c_flush
                            )
                    if len(rslots):
                        dispatch.spec_verify(family, pool, rslots, rpos, rx, ro, tables=tab, config=c_read)
                    if fork is not None:
                        fork.wait_stream(side)

        return fn

    def window_fn(sketch: bool) -> Callable[[], None]:
        steps = steps_fn(sketch, cfg["sketch" if sketch else "replay"])
        fl = flush_fn(sketch, cfg["flush_sketch" if sketch else "flush_replay"])

        def fn() -> None:
            steps()
            fl()

        return fn

    tuning: dict[str, list] = {}
    if tune:
        for kernel, kind, make, calls in (
            ("standard", "standard", lambda c: standard_fn(c, 2), 2 * pools),
            ("replay", "replay", lambda c: steps_fn(False, c), (window - 1) * pools),
            ("sketch", "sketch", lambda c: steps_fn(True, c), (window - 1) * pools),
            ("flush_replay", "flush", lambda c: flush_fn(False, c), pools),
            ("flush_sketch", "flush", lambda c: flush_fn(True, c), pools),
        ):
            if candidates is not None and kernel not in candidates:
                continue
            seen, trials = set(), []
            for cand in TUNE_CANDIDATES[kind][family] if candidates is None else candidates[kernel]:
                c = replace(cand, block_v=min(cand.block_v, vd))
                if c in seen:
                    continue
                seen.add(c)
                try:
                    trials.append((timer(make(c), calls), c))
                except Exception as err:
                    trials.append((math.inf, c))
                    tuning.setdefault("errors", []).append(f"{kernel} {c}: {type(err).__name__}")
            best = min(trials, key=lambda tc: tc[0])
            cfg[kernel] = best[1]
            tuning[kernel] = [dict(us=round(t, 2), **asdict(c)) for t, c in trials]

    bm = ByteModel(
        family,
        batch,
        shape,
        ranks,
        read_bytes=_nbytes(rd),
        split=cfg["sketch"].form == "split_read",
        split_dots=cfg["sketch"].dots > 0,
    )
    copy_tbps = copy_bandwidth(dev) if cuda else float("nan")
    ops: dict[str, dict] = {}

    def record(name: str, us: float, nbytes: int) -> None:
        tbps = nbytes / (us * 1e-6) / 1e12 if us > 0 else float("nan")
        ops[name] = dict(us=us, bytes=nbytes, tbps=tbps, frac_copy=tbps / copy_tbps)

    record("standard", timer(standard_fn(cfg["standard"]), window * pools), bm.standard())
    anchors: dict[str, dict] = {}
    if anchor:
        found = _anchors(family, dense, xs, slots, raw) if cuda else {"all": "skipped in the CPU dry run"}
        for name, got in found.items():
            if isinstance(got, str):
                anchors[name] = dict(note=got)
                continue
            run, check = got

            def anchor_fn(run=run) -> None:
                for t in range(window):
                    for i in range(pools):
                        run(i, t)

            try:
                diff = check()
                anchors[name] = dict(us=timer(anchor_fn, window * pools), rel_diff=diff)
            except Exception as err:
                anchors[name] = dict(note=f"failed: {type(err).__name__}: {err}")
        timed = {n: a for n, a in anchors.items() if "us" in a}
        if timed:  # the fastest public kernel is the anchor
            best = min(timed, key=lambda n: timed[n]["us"])
            record("anchor", timed[best]["us"], bm.standard())
            ops["anchor"]["kernel"] = best
    mean_step = {
        sk: sum((bm.sketch_step if sk else bm.replay_step)(p) for p in range(window - 1)) // (window - 1)
        for sk in (False, True)
    }
    for sketch, name in ((False, "replay"), (True, "sketch")):
        record(f"{name}_step", timer(steps_fn(sketch, cfg[name]), (window - 1) * pools), mean_step[sketch])
        flush_us = timer(flush_fn(sketch, cfg[f"flush_{name}"]), pools)
        record(f"{name}_flush", flush_us, bm.flush(window - 1, sketch))
        record(f"{name}_window", timer(window_fn(sketch), pools), bm.window(window, sketch))
        if staggered:
            for suffix, overlap in (("staggered", True), ("staggered_serial", False)):
                us = timer(staggered_fn(sketch, overlap), pools)
                record(f"{name}_{suffix}", us, bm.window(window, sketch))
    if any(ranks) and rd.itemsize > 1:  # (the adaptive sketch: bf16 / fp32 pools)
        _time_adaptive(
            family, ranks, shape, make_pool, slots, pos, xs, outs, cfg, timer, record, ops, window, paged
        )
    std_window = window * ops["standard"]["us"]
    anchor_us = ops["anchor"]["us"] if "anchor" in ops else None
    result = {
        "family": family,
        "model": shape.name,
        "shape": asdict(shape),
        "batch": batch,
        "window": window,
        "read_dtype": read_dtype,
        "pools": pools,
        "ranks": ranks,
        "mean_rank": sum(ranks) / len(ranks),
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu (dry run)",
        "torch": torch.__version__,
        "copy_tbps": copy_tbps,
        "paged": paged,
        "configs": {k: asdict(v) for k, v in cfg.items()},
        "tuning": tuning,
        "ops": ops,
        "anchors": anchors,
        "windows_us": dict(
            standard=std_window, replay=ops["replay_window"]["us"], sketch=ops["sketch_window"]["us"]
        ),
        "speedups": dict(
            replay_vs_standard=std_window / ops["replay_window"]["us"],
            sketch_vs_standard=std_window / ops["sketch_window"]["us"],
            sketch_vs_replay=ops["replay_window"]["us"] / ops["sketch_window"]["us"],
            standard_vs_anchor=anchor_us / ops["standard"]["us"] if anchor_us else None,
            sketch_vs_anchor=window * anchor_us / ops["sketch_window"]["us"] if anchor_us else None,
            replay_vs_anchor=window * anchor_us / ops["replay_window"]["us"] if anchor_us else None,
            **{f"{op}_vs_standard": std_window / ops[op]["us"] for op in ops if "_staggered" in op},
            **(
                {
                    "adaptive_vs_standard": std_window / ops["adaptive_window"]["us"],
                    "adaptive_vs_sketch": ops["sketch_window"]["us"] / ops["adaptive_window"]["us"],
                }
                if "adaptive_window" in ops
                else {}
            ),
        ),
    }
    return result


def _time_adaptive(
    family: str, ranks: list[int], shape: ModelShape, make_pool, slots, pos, xs, outs, cfg, timer, record,
    ops: dict, window: int, paged: bool,
) -> None:  # fmt: skip
    """The adaptive sketch's step, flush (its factors included) and window, at the ranks that read
    the static sketch's bytes (``fit.traffic.adaptive_ranks``), on pools of their own (``paged``:
    laid out as vLLM's pages, the factors in them). Its bytes are the static window's plus the
    flush's extra pass over the checkpoint."""
    from sketchcal.fit.traffic import adaptive_ranks

    kd, vd = shape.key_dim, shape.value_dim
    a_ranks = adaptive_ranks(ranks, kd, vd)
    snapped = [clip_rank(r, kd) for r in a_ranks]
    tables = random_sketch(family, snapped, shape.groups, kd, torch.Generator().manual_seed(1))
    tables = replace(tables, ranks=torch.tensor(a_ranks, dtype=torch.int32)).to(slots.device)
    a_pools, sketches = [], []
    for _ in outs:
        pool = make_pool()
        tables = tables.with_map_rows(pool.sketch.shape[2])  # (Qᵀ takes the static sketch's rows)
        sketch = AdaptiveSketch.allocate(tables, pool)
        pool, sketch = paged_adaptive(pool, sketch) if paged else (pool, sketch)
        a_pools.append(pool)
        sketches.append(sketch)
    c_read, c_flush = cfg["sketch"], cfg["flush_sketch"]  # (dispatch reads adaptively in one kernel)

    def steps() -> None:
        for t in range(window - 1):
            for i, pool in enumerate(a_pools):
                dispatch.spec_verify(
                    family, pool, slots, pos[t], xs[t], outs[i], config=c_read, adaptive=sketches[i]
                )

    def flush() -> None:
        for i, pool in enumerate(a_pools):
            dispatch.flush(
                family, pool, slots, pos[window - 1], xs[window - 1], outs[i], config=c_flush,
                adaptive=sketches[i],
            )  # fmt: skip

    def window_fn() -> None:
        steps()
        flush()

    n = len(a_pools)
    pass_bytes = a_pools[0].state.numel() * a_pools[0].state.element_size()
    record("adaptive_step", timer(steps, (window - 1) * n), ops["sketch_step"]["bytes"])
    record("adaptive_flush", timer(flush, n), ops["sketch_flush"]["bytes"] + pass_bytes)
    record("adaptive_window", timer(window_fn, n), ops["sketch_window"]["bytes"] + pass_bytes)
    ops["adaptive_window"]["mean_rank"] = sum(a_ranks) / len(a_ranks)


def print_bench(result: dict, console=None) -> None:
    """A rich table of one :func:`run_bench` result."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    s = result["speedups"]
    title = (
        f"{result['model']} · batch {result['batch']} · L={result['window']} · mean rank "
        f"{result['mean_rank']:.1f} · {result['device']} · copy {result['copy_tbps']:.2f} TB/s"
        + (" · vLLM page layout" if result.get("paged") else "")
    )
    table = Table(title=title)
    for col in ("op", "µs", "MB", "TB/s", "of copy"):
        table.add_column(col, justify="right" if col != "op" else "left")
    for name, op in result["ops"].items():
        table.add_row(
            name, f"{op['us']:.1f}", f"{op['bytes'] / 1e6:.1f}", f"{op['tbps']:.2f}", f"{op['frac_copy']:.0%}"
        )
    console.print(table)
    console.print(
        f"window speedup over standard: replay {s['replay_vs_standard']:.2f}×, sketch "
        f"{s['sketch_vs_standard']:.2f}× (sketch vs replay {s['sketch_vs_replay']:.2f}×)"
    )
    if "adaptive_vs_standard" in s:
        mean = result["ops"]["adaptive_window"]["mean_rank"]
        console.print(
            f"adaptive sketch (mean rank {mean:.1f}, the static sketch's read bytes): window "
            f"{s['adaptive_vs_standard']:.2f}× over standard, {s['adaptive_vs_sketch']:.0%} of the static "
            "sketch window's speed"
        )
    std_us = result["ops"]["standard"]["us"]
    for name, a in result["anchors"].items():
        if "us" in a:
            console.print(
                f"public kernel {name}: {a['us']:.1f} µs, {a['us'] / std_us:.2f}× our standard step's time "
                f"(output vs ours: {a['rel_diff']:.1e} relative)"
            )
        else:
            console.print(f"public kernel {name}: {a['note']}")
    if "anchor" in result["ops"]:
        best = result["ops"]["anchor"]
        console.print(
            f"fastest public kernel: {best['kernel']}; sketch window vs it: "
            f"{s['sketch_vs_anchor']:.2f}×, replay window vs it: {s['replay_vs_anchor']:.2f}×"
        )
    if "sketch_staggered_vs_standard" in s:
        console.print(
            f"staggered phases (each step flushes ~B/L slots beside the others' reads): replay "
            f"{s['replay_staggered_vs_standard']:.2f}×, sketch {s['sketch_staggered_vs_standard']:.2f}× "
            f"(flush, then the reads, on one stream: {s['replay_staggered_serial_vs_standard']:.2f}×, "
            f"{s['sketch_staggered_serial_vs_standard']:.2f}×)"
        )
