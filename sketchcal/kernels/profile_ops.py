"""Launch one decode kernel a few times at the benchmark's shapes, for a profiler to attach to.

Run from the repository root on a CUDA machine, under Nsight Compute for example::

    ncu --set full -k regex:_read_kernel --launch-skip 2 --launch-count 1 \\
        python3 sketchcal/kernels/profile_ops.py gdn sketch_step

``OP`` is one of ``standard``, ``replay_step``, ``sketch_step``, ``replay_flush``,
``sketch_flush``. The window kernels run with ``--pos`` buffered tokens (default 8, a mid-window
step), the flushes with 15. Each op is launched three times (the first compiles) with its default
kernel and launch shape, or with ``--config`` (``bench.parse_config``'s short form, e.g.
``chunk,64,4,cap=128``). The kernels' names, for ``ncu -k``: ``_standard_kernel``, ``_read_kernel``,
``_group_kernel`` and ``_head_kernel`` (``split_read``), ``_flush_kernel`` (``sweep``),
``_flush_chunk_kernel``, ``_flush_pipelined_kernel`` (``gluon_chunk``),
``_flush_kda_sweep_kernel`` (``gluon_sweep``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import bootstrap

KERNELS = {
    "standard": "standard",
    "replay_step": "replay",
    "sketch_step": "sketch",
    "replay_flush": "flush_replay",
    "sketch_flush": "flush_sketch",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family", choices=("mamba2", "gdn", "kda"))
    ap.add_argument("op", choices=tuple(KERNELS))
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--pos", type=int, default=8, help="buffered tokens of the steps (flushes: 15)")
    ap.add_argument("--config", help="kernel and launch shape, e.g. 'read,128,1,group=4' (default: the op's)")
    args = ap.parse_args()
    bootstrap()
    import torch

    from sketchcal.kernels import dispatch
    from sketchcal.kernels.bench import MODEL_SHAPES, parse_config
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
    cfg = parse_config(args.config) if args.config else dispatch.default_config(KERNELS[args.op], family)
    n = 15 if "flush" in args.op else args.pos
    pos = torch.full((b,), n, dtype=torch.int32, device="cuda")
    for _ in range(3):
        if args.op == "standard":
            dispatch.standard_step(family, pool.state, slots, x, out, config=cfg)
        elif args.op == "replay_step":
            dispatch.replay_step(family, pool, slots, pos, x, out, config=cfg)
        elif args.op == "sketch_step":
            dispatch.sketch_step(family, pool, tables, slots, pos, x, out, config=cfg)
        else:
            sketch = tables if args.op == "sketch_flush" else None
            dispatch.flush(family, pool, slots, pos, x, out, tables=sketch, config=cfg)
    torch.cuda.synchronize()
    print(f"{family} {args.op} {cfg}: ok")


if __name__ == "__main__":
    main()
