"""One-call GPU check: the ``gpu``-marked kernel tests, then the decode benchmark.

Run from the repository root on a CUDA machine (no install needed)::

    python kernels/gpu_check.py tests            # pytest -m gpu tests/kernels
    python kernels/gpu_check.py bench [FAMILY…]  # batch 256 (tuned), then 64 and 512

Logs and ``bench.json`` go to ``$OUT`` (default ``./gpu_out``). The public anchors are used when
importable: fla 0.6.0 (``fla-core`` wheel) for GDN and KDA, ``mamba_ssm``'s
``selective_state_update`` for Mamba-2.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bootstrap() -> None:
    """Make ``sketchcal.kernels`` importable from a plain checkout (kernels/ is installed as
    ``sketchcal.kernels``) without running the package's ``__init__``."""
    if "sketchcal.kernels" in sys.modules:
        return
    pkg = types.ModuleType("sketchcal")
    pkg.__path__ = [str(ROOT / "sketchcal")]
    sys.modules.setdefault("sketchcal", pkg)
    spec = importlib.util.spec_from_file_location(
        "sketchcal.kernels", ROOT / "kernels" / "__init__.py",
        submodule_search_locations=[str(ROOT / "kernels")],
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sketchcal.kernels"] = mod
    spec.loader.exec_module(mod)


def out_dir() -> Path:
    out = Path(os.environ.get("OUT", "gpu_out"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def run_tests() -> int:
    import pytest

    return pytest.main(
        ["-q", "-m", "gpu", str(ROOT / "tests" / "kernels"), "--noconftest", "-p", "no:cacheprovider",
         "-rf", "--junitxml", str(out_dir() / "gpu_tests.xml")]
    )


def run_benches(families: list[str]) -> None:
    import torch
    import triton

    from sketchcal.kernels.bench import print_bench, run_bench
    from sketchcal.kernels.common.decode import KernelConfig

    out = out_dir()
    print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}", flush=True)
    results = []
    summary = []
    for family in families:
        t0 = time.time()
        try:
            r256 = run_bench(family, 256, tune=True)
            print_bench(r256)
            results.append(r256)
            configs = {k: KernelConfig(**v) for k, v in r256["configs"].items()}
            print(f"{family}: tuned {r256['configs']} in {time.time() - t0:.0f}s; "
                  f"anchor diff {r256['anchor_rel_diff']} {r256['anchor_note']}", flush=True)
            for batch in (64, 512):
                r = run_bench(family, batch, configs=configs)
                print_bench(r)
                results.append(r)
        except Exception:
            traceback.print_exc()
        with open(out / "bench.json", "w") as fh:
            json.dump(results, fh, indent=1, default=str)
    for r in results:
        o, s = r["ops"], r["speedups"]
        anchor = f"{o['anchor']['us']:.1f}us" if "anchor" in o else "n/a"
        summary.append(
            f"{r['family']:6s} B={r['batch']:3d} copy={r['copy_tbps']:.2f}TB/s "
            f"std={o['standard']['us']:.1f}us ({o['standard']['frac_copy']:.0%} of copy) anchor={anchor}"
            f" replay_win={s['replay_vs_standard']:.2f}x sketch_win={s['sketch_vs_standard']:.2f}x "
            f"sk/rep={s['sketch_vs_replay']:.2f}x "
            f"step(rep/sk)={o['replay_step']['us']:.1f}/{o['sketch_step']['us']:.1f}us "
            f"flush(rep/sk)={o['replay_flush']['us']:.1f}/{o['sketch_flush']['us']:.1f}us"
        )
    text = "\n".join(summary)
    (out / "summary.txt").write_text(text + "\n")
    print(text, flush=True)


def main(argv: list[str]) -> int:
    bootstrap()
    what = argv[0] if argv else "all"
    if what in ("tests", "all"):
        code = run_tests()
        if what == "tests":
            return int(code)
    if what in ("bench", "all"):
        run_benches(argv[1:] or ["gdn", "kda", "mamba2"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
