"""Launch one decode kernel a few times at the benchmark's shapes, for a profiler to attach to.

Run from the repository root on a CUDA machine, under Nsight Compute for example::

    ncu --clock-control none --set full -k regex:_read_kernel --launch-skip 2 --launch-count 1 \\
        python3 kernels/profile_ops.py gdn sketch_step

``OP`` is one of ``standard``, ``replay_step``, ``sketch_step``, ``replay_flush``,
``sketch_flush``. The window kernels run with ``pos`` = 8 buffered tokens (a mid-window step;
``--pos`` sets another), the flushes with 15. Each op is launched three times (the first
compiles), with the default launch shape except for the fields the options give (``--block-v``,
``--warps``, ``--form``, ``--vec``, ``--maxnreg``, ``--group``, ``--dense-rows``, ``--map``,
``--prefetch``, ``--pipelined`` (the flushes' Gluon kernels: ``_flush_pipelined_kernel``,
``_flush_kda_kernel``), and for Mamba-2's split sketch read ``--split``, ``--heads`` and ``--dots``:
its kernels are ``_group_kernel`` and ``_head_kernel``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import bootstrap


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("family")
    ap.add_argument("op")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--pos", type=int, help="buffered tokens of the window kernels (default 8)")
    ap.add_argument("--block-v", type=int)
    ap.add_argument("--warps", type=int)
    ap.add_argument("--form", choices=("chunked", "sweep"), help="closed (chunked) or token-by-token form")
    ap.add_argument("--vec", type=int, help="value columns per thread of a token-by-token flush tile")
    ap.add_argument("--maxnreg", type=int, help="register cap per thread")
    ap.add_argument("--group", type=int, help="reads: live tokens per sweep iteration (0: all unrolled)")
    ap.add_argument("--dense-rows", type=int, help="reads: read-copy rows per dense-read iteration (0: all)")
    ap.add_argument("--map", choices=["early", "late"], help="sketch reads: map rows before/after the sweep")
    ap.add_argument("--prefetch", choices=["on", "off"], help="reads, sweep flush: buffer into L2 first")
    ap.add_argument("--split", type=int, help="Mamba-2 sketch step: warps of the split read's group kernel")
    ap.add_argument("--heads", type=int, help="the split read: heads per program of its head kernel")
    ap.add_argument("--dots", type=int, help="the split read: key groups per dot program of its group kernel")
    ap.add_argument("--pipelined", type=int, help="flushes: programs per SM of the Gluon kernel (0: off)")
    args = ap.parse_args()
    bootstrap()
    import torch

    from sketchcal.kernels.bench import MODEL_SHAPES
    from sketchcal.kernels.common import decode
    from sketchcal.kernels.common.pool import random_sketch, rank_spread
    from sketchcal.kernels.common.testing import random_inputs, random_pool

    family, b = args.family, args.batch
    shape = MODEL_SHAPES[family]
    h, g, kd, vd = shape.heads, shape.groups, shape.key_dim, shape.value_dim
    tables = random_sketch(family, rank_spread(h, 8, kd), g, kd, torch.Generator().manual_seed(0)).to("cuda")
    pool = random_pool(family, b, h, g, kd, vd, capacity=16, sketch_rows=tables.map_rows, device="cuda")
    slots = torch.arange(b, dtype=torch.int32, device="cuda")
    x = random_inputs(family, b, 1, h, g, kd, vd, device="cuda")
    out = torch.empty_like(x.w)
    kind = {
        "standard": "standard",
        "replay_step": "replay",
        "sketch_step": "sketch",
        "replay_flush": "flush_replay",
        "sketch_flush": "flush_sketch",
    }[args.op]
    base = decode.default_config(kind, family)
    given = dict(
        block_v=args.block_v,
        num_warps=args.warps,
        vec=args.vec,
        maxnreg=args.maxnreg,
        group=args.group,
        dense_rows=args.dense_rows,
        chunked=None if args.form is None else args.form == "chunked",
        early_map=None if args.map is None else args.map == "early",
        prefetch=None if args.prefetch is None else args.prefetch == "on",
        split=args.split,
        heads=args.heads,
        dots=args.dots,
        pipelined=args.pipelined,
    )
    cfg = replace(base, **{k: v for k, v in given.items() if v is not None})  # the default, as overridden
    n = 15 if "flush" in args.op else (8 if args.pos is None else args.pos)
    pos = torch.full((b,), n, dtype=torch.int32, device="cuda")
    for _ in range(3):
        if args.op == "standard":
            decode.standard_step(family, pool.state, slots, x, out, config=cfg)
        elif args.op == "replay_step":
            decode.replay_step(family, pool, slots, pos, x, out, config=cfg)
        elif args.op == "sketch_step":
            decode.sketch_step(family, pool, tables, slots, pos, x, out, config=cfg)
        elif args.op == "replay_flush":
            decode.flush(family, pool, slots, pos, x, out, config=cfg)
        else:
            decode.flush(family, pool, slots, pos, x, out, tables=tables, config=cfg)
    torch.cuda.synchronize()
    print(f"{family} {args.op} {cfg}: ok")


if __name__ == "__main__":
    main()
