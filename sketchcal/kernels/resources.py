"""Registers and spills of the decode kernels, compiled offline for a CUDA target (no GPU needed).

With the package installed (``pip install -e .``)::

    python -m sketchcal.kernels.resources            # every kernel, default launch shapes, sm_90
    python -m sketchcal.kernels.resources check      # compile every default, tuning candidate and
                                                     # fallback, both modes, 1 and 3 tokens; exit 1
                                                     # if any fails
    python -m sketchcal.kernels.resources read gdn read,64,1,group=4 [replay]

The last form is one build: KERNEL FAMILY SHAPE (``bench.parse_config``'s short form), KERNEL one
of standard, read, flush, or split_group / split_heads (Mamba-2's split_read).

Prints one line per build: kernel, family, mode, launch shape, registers per thread, stack
bytes (spills), and the occupancy those registers allow (warps per SM out of 64, from the 64 K-register
file). Triton's ``ptxas`` does the register allocation, so the numbers are those the device gets
from the same Triton version (the device may run another).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from sketchcal.kernels.bench import MODEL_SHAPES, parse_config, short_form
from sketchcal.kernels.common.pool import random_sketch, rank_spread, workspace_layout
from sketchcal.kernels.common.triton_helpers import (
    CHUNK_MIN,
    FAMILY_ID,
    clip_block_v,
    launch_options,
    prefetch_enabled,
)
from sketchcal.kernels.dispatch import STANDARD_VALUE_MAJOR, SWEEP_FALLBACK, KernelConfig, default_config
from sketchcal.kernels.mamba2.flush_chunk import sketch_terms

TARGET = GPUTarget("cuda", 90, 32)
PTR = {
    "slots": "*i32",
    "pos": "*i32",
    "ranks": "*i32",
    "read_rows": "*i32",
    "q": "*bf16",
    "k": "*bf16",
    "w": "*bf16",
    "skip": "*bf16",
    "out": "*bf16",
    "buf_k": "*bf16",
    "buf_w": "*bf16",
    "buf_logdecay": "*bf16",
    "rd": "*bf16",
    "sk": "*bf16",
    "frames": "*fp32",
    "maps": "*fp32",
    "frame_terms": "*bf16",
    "sk_head_stride": "i32",
    "n_items": "i32",
    "B": "i32",
    "group_cols": "*i32",
    "group_width": "*i32",
}


def _compile(
    fn, consts: dict, num_warps: int, maxnreg: int = 0, gluon: bool = False, types: dict | None = None
):
    pdl = not gluon and "PDL" in fn.arg_names  # as launched on a Hopper device: dependent launch
    if pdl:
        consts = dict(consts, PDL=True)
    # ss_*: slot strides (int32); ``types`` overrides PTR for this build
    ptr = {**PTR, **(types or {})}
    sig = {
        n: "constexpr" if n in consts else "i32" if n.startswith("ss_") else ptr.get(n, "*fp32")
        for n in fn.arg_names
    }
    # as at a real launch: every pointer (torch allocations) and the strides are 16-divisible
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(fn.arg_names)
        if n not in consts and n != "n_items"
    }
    source = (GluonASTSource if gluon else ASTSource)(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    options = launch_options(num_warps, maxnreg)
    if pdl:
        options["launch_pdl"] = True
    return triton.compile(source, target=TARGET, options=options)


LAYOUTS = ("dense", "paged", "adaptive", "adaptive_paged")


def build(
    kernel: str, family: str, cfg: KernelConfig | None, sketch: bool = True, tokens: int = 1,
    layout: str = "dense",
):  # fmt: skip
    """Compile the kernel of ``cfg.form`` that serves ``kernel`` (``standard``, ``read``,
    ``split_group`` / ``split_heads`` (the two kernels of Mamba-2's split read), ``flush`` or
    ``factor`` (the adaptive sketch's; ``cfg`` None: it has no launch config)) at the benchmark
    shape of ``family``; returns Triton's compiled kernel. ``tokens`` > 1: the standard step or
    read over that many tokens (``spec_verify``). ``layout`` (the reads, the sweep flush and the
    factor kernel): the pool's, one of :data:`LAYOUTS` (``paged``: vLLM's pages, the checkpoint
    value-major; ``adaptive``: the adaptive sketch's per-slot factors)."""
    paged = layout in ("paged", "adaptive_paged")
    adaptive = layout in ("adaptive", "adaptive_paged")
    s = MODEL_SHAPES[family]
    if kernel == "factor":
        from sketchcal.kernels.common import adaptive as AD

        m = 32  # the benchmark's widest rank (two warps above 16 rows, as the launcher picks)
        consts = dict(
            K=s.key_dim, V=s.value_dim, M=m, MP=m, SM=m, BK=32, TOL=AD.TOL, PRECISION="tf32",
            STATE_VM=paged,
        )  # fmt: skip
        bf16 = dict(sketch="*bf16", rows="*bf16", maps="*bf16")
        return _compile(AD._factor_kernel, consts, 2, types=bf16)
    bv = clip_block_v(cfg.block_v, s.value_dim)
    dims = dict(H=s.heads, G=s.groups, K=s.key_dim, V=s.value_dim)
    common = dict(dims, BV=bv, FAMILY=FAMILY_ID[family], HAS_SKIP=family == "mamba2")
    nw, cap = cfg.num_warps, cfg.maxnreg
    if kernel == "standard":
        from sketchcal.kernels.common import standard

        consts = dict(T=tokens, VALUE_MAJOR=STANDARD_VALUE_MAJOR, **common)  # as the standard pools hold it
        return _compile(standard._standard_kernel, consts, nw, cap)
    if kernel in ("split_group", "split_heads"):  # Mamba-2's split sketch read, bf16
        from sketchcal.kernels.mamba2 import read_split as RS

        # the benchmark's tables (mean rank 8): their map rows and widest group
        tables = random_sketch(family, rank_spread(s.heads, 8, s.key_dim), s.groups, s.key_dim)
        hg, m_rows, r = s.heads // s.groups, tables.map_rows, tables.group_maps.shape[1]
        width, dots = workspace_layout(hg, m_rows, 16)
        layout = dict(G=s.groups, K=s.key_dim, C=16, BC=16, M=m_rows, WS=width, DOTS=dots)
        clip = RS._dividing_power_of_two  # heads and dots as the launchers clip them
        if kernel == "split_group":
            consts = {n: v for n, v in layout.items() if n != "M"}
            consts.update(
                R=r,
                RB=RS.COLUMNS,
                BB=RS.ROWS,
                DG=clip(max(cfg.dots, 1), s.groups),
                NO_DOTS=cfg.dots == 0,
                Q_BF16=True,
                EMULATE=False,
                PAGED=False,
            )
            return _compile(RS._group_kernel, consts, cfg.coef_warps)
        consts = dict(
            layout,
            H=s.heads,
            V=s.value_dim,
            BV=bv,
            HP=clip(cfg.heads, hg),
            DOTS_HERE=cfg.dots == 0,
            HAS_SKIP=True,
            DENSE_ROWS=min(cfg.dense_rows, s.key_dim),
            PAGED=False,
            RD_VM=False,
        )
        return _compile(RS._head_kernel, consts, nw)
    if kernel == "read":
        from sketchcal.kernels.common import read

        # as the benchmark's bf16 pools: KDA's reads take the log₂ decays
        consts = dict(
            T=tokens,
            C=16,
            M=32,
            SKETCH=sketch,
            LOG2_DECAY=family == "kda",
            PAGED=paged,
            RD_VM=False,
            SLOT_MAPS=adaptive,
            **read.read_options(cfg, s.key_dim),
            **common,
        )
        return _compile(read._read_kernel, consts, nw, cap, types={"maps": "*bf16"} if adaptive else None)
    flags = dict(HAS_X=True, HAS_READ=True, ROWS=sketch, SKETCH_OUT=sketch, HAS_SKIP=family == "mamba2")
    terms = dict(SKETCH_TERMS=sketch_terms(torch.bfloat16))  # a bf16 sketch, as the benchmark's
    if cfg.form == "gluon_chunk":
        from sketchcal.kernels.mamba2 import flush_pipelined

        consts = dict(dims, C=16, BC=16, **flags, **terms)
        return _compile(flush_pipelined._flush_pipelined_kernel, consts, nw, cap, gluon=True)
    if cfg.form == "gluon_sweep":
        from sketchcal.kernels.kda import flush_sweep

        mr = flush_sweep.frame_rows(cfg.per_sm, s.key_dim, bv)
        consts = dict(H=s.heads, K=s.key_dim, V=s.value_dim, C=16, BC=16, MR=mr, VB=bv, **flags)
        return _compile(flush_sweep._flush_kda_sweep_kernel, consts, nw, cap, gluon=True)
    if cfg.form == "chunk":
        from sketchcal.kernels.mamba2 import flush_chunk

        consts = dict(dims, BV=max(bv, CHUNK_MIN), C=16, BC=16, **flags, K_BF16=True, **terms, EMULATE=False)
        return _compile(flush_chunk._flush_chunk_kernel, consts, nw, cap)
    from sketchcal.kernels.common import flush

    prefetch = prefetch_enabled(cfg.prefetch)
    strides = dict(PAGED=paged, ST_VM=paged, RD_VM=False)
    consts = dict(common, C=16, **flags, VEC=cfg.vec, PREFETCH=prefetch, **strides)
    return _compile(flush._flush_kernel, consts, nw, cap)


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, spill bytes) from ``cuobjdump --dump-resource-usage``."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        text = subprocess.run(
            [str(tool), "--dump-resource-usage", fh.name], capture_output=True, text=True, check=True
        ).stdout
    regs = int(re.search(r"REG:(\d+)", text).group(1))
    stack = int(re.search(r"STACK:(\d+)", text).group(1))
    return regs, stack


def report(kernel: str, family: str, cfg: KernelConfig, sketch: bool = True) -> str:
    regs, spills = resource_usage(build(kernel, family, cfg, sketch).asm["cubin"])
    # the 64 K-register file, 64 warps and 32 resident programs per SM (sm_90)
    nw = cfg.coef_warps if kernel == "split_group" else cfg.num_warps
    warps = min(64, 32 * nw, (65536 // max(1, regs * 32)) // nw * nw)
    mode = ("sketch" if sketch else "replay") if kernel != "standard" else "-"
    return (
        f"{kernel:11s} {family:6s} {mode:6s} {short_form(cfg):48s} regs={regs:3d} stack={spills:5d}B  "
        f"occupancy≤{warps}/64 warps"
    )


def builds() -> list[tuple[str, str, KernelConfig | None, bool, int, str]]:
    """Every launch the package can make at the benchmark shapes, without repeats: (kernel, family,
    config, sketch mode, tokens, layout). The defaults and every tuning candidate, in both modes; the
    reads and the standard step also over 3 tokens, as ``spec_verify`` runs them; the default reads,
    the sweep flush and the factor kernel on the other layouts (vLLM's pages, the adaptive sketch)."""
    from sketchcal.kernels.bench import TUNE_CANDIDATES

    out: list[tuple[str, str, KernelConfig | None, bool, int, str]] = []
    for family in ("gdn", "kda", "mamba2"):
        for tokens in (1, 3):
            for cfg in {default_config("standard", family), *TUNE_CANDIDATES["standard"][family]}:
                out.append(("standard", family, cfg, False, tokens, "dense"))
            for sketch in (False, True):
                mode = "sketch" if sketch else "replay"
                for cfg in {default_config(mode, family), *TUNE_CANDIDATES[mode][family]}:
                    out.append(("read", family, cfg, sketch, tokens, "dense"))
        if family == "mamba2":
            from sketchcal.kernels.bench import SPLIT_SHAPES

            parts = ("split_group", "split_heads")
            split = {default_config("sketch", family), *TUNE_CANDIDATES["sketch"][family], *SPLIT_SHAPES}
            out += [
                (part, family, cfg, True, 1, "dense")
                for cfg in split
                if cfg.form == "split_read"
                for part in parts
            ]
        for sketch in (False, True):
            kind = "flush_sketch" if sketch else "flush_replay"
            flushes = {default_config(kind, family), *TUNE_CANDIDATES["flush"][family]}
            # and the Triton kernels the Gluon ones fall back to
            flushes |= {replace(c, form="chunk") for c in flushes if c.form == "gluon_chunk"}
            flushes |= {SWEEP_FALLBACK for c in flushes if c.form == "gluon_sweep"}
            out += [("flush", family, cfg, sketch, 1, "dense") for cfg in flushes]
        # vLLM's pages (the forms that take slot strides) and the adaptive sketch (its factor kernel
        # has no launch config)
        replay_read = replace(default_config("replay", family), form="read")
        sketch_read = replace(default_config("sketch", family), form="read")
        for tokens in (1, 3):
            out.append(("read", family, replay_read, False, tokens, "paged"))
            out += [("read", family, sketch_read, True, tokens, layout) for layout in LAYOUTS[1:]]
        out += [("flush", family, SWEEP_FALLBACK, sketch, 1, "paged") for sketch in (False, True)]
        out += [("factor", family, None, True, 1, layout) for layout in ("dense", "paged")]
    return out


def check() -> int:
    """Compile everything :func:`builds` lists; print one line per failure; the number failed. This
    catches what the CPU interpreter lets through (a constexpr assigned twice, a type only the
    compiler checks) without a GPU."""
    todo = builds()
    failed = 0
    for kernel, family, cfg, sketch, tokens, layout in todo:
        try:
            build(kernel, family, cfg, sketch, tokens, layout)
        except Exception as e:  # report every failing build, then exit non-zero
            failed += 1
            first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            mode = "sketch" if sketch else "replay"
            print(
                f"FAILED {kernel} {family} {mode} {layout} tokens={tokens} {cfg}: "
                f"{type(e).__name__}: {first}",
                flush=True,
            )
    print(f"{len(todo) - failed} of {len(todo)} builds compiled", flush=True)
    return failed


def main(argv: list[str]) -> None:
    if argv == ["check"]:
        sys.exit(1 if check() else 0)
    if argv:
        kernel, family, shape, *rest = argv
        print(report(kernel, family, parse_config(shape), sketch="replay" not in rest), flush=True)
        return
    for family in ("gdn", "kda", "mamba2"):
        print(report("standard", family, default_config("standard", family)), flush=True)
        for sketch in (False, True):
            mode = "sketch" if sketch else "replay"
            print(report("read", family, default_config(mode, family), sketch), flush=True)
            kind = f"flush_{mode}"
            print(report("flush", family, default_config(kind, family), sketch), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
