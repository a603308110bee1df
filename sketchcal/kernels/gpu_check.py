"""Run the ``gpu`` kernel tests or the decode benchmark on a CUDA machine, from a plain checkout.

Run from the repository root (no install needed: :func:`bootstrap` puts the repository root on
``sys.path``)::

    python sketchcal/kernels/gpu_check.py tests [PYTEST_ARGS…]  # pytest -m gpu tests/kernels
    python sketchcal/kernels/gpu_check.py bench [FAMILY…]  # per family: batch 256 tuned, then 64, 512
    python sketchcal/kernels/gpu_check.py                  # both

Results go to ``$OUT`` (default ``./gpu_out``): ``gpu_tests.xml`` (JUnit), ``bench.json`` and
``summary.txt`` (one line per benchmark). The public kernels are timed beside ours when they
import (``sketchcal.kernels.bench``: fla for GDN and KDA, mamba_ssm and vLLM for Mamba-2).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root


def bootstrap() -> None:
    """Make ``sketchcal.kernels`` importable from a plain checkout (the repository root on ``sys.path``)."""
    if importlib.util.find_spec("sketchcal") is None and str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def out_dir() -> Path:
    out = Path(os.environ.get("OUT", "gpu_out"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def run_tests(extra: list[str] | None = None) -> int:
    """``pytest -m gpu tests/kernels`` plus ``extra`` arguments (e.g. ``-k EXPR``)."""
    import pytest

    args = ["-q", "-m", "gpu", str(ROOT / "tests" / "kernels"), "--noconftest", "-p", "no:cacheprovider"]
    if extra:
        args += ["-rA", *extra]
    else:
        args += ["-rf", "--junitxml", str(out_dir() / "gpu_tests.xml")]
    return pytest.main(args)


def run_benches(families: list[str], batches: tuple[int, ...] = (64, 512)) -> list[dict]:
    """Per family: batch 256 with launch-shape tuning, then ``batches`` with the tuned shapes."""
    import torch
    import triton

    from sketchcal.kernels.bench import print_bench, run_bench
    from sketchcal.kernels.dispatch import KernelConfig

    out = out_dir()
    print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}", flush=True)
    results: list[dict] = []
    for family in families:
        t0 = time.time()
        try:
            r256 = run_bench(family, 256, tune=True)
            print_bench(r256)
            results.append(r256)
            configs = {k: KernelConfig(**v) for k, v in r256["configs"].items()}
            print(
                f"{family}: tuned {r256['configs']} in {time.time() - t0:.0f}s; "
                f"public kernels {json.dumps(r256['anchors'])}",
                flush=True,
            )
            print(f"{family}: tuning {json.dumps(r256['tuning'])}", flush=True)
            for batch in batches:
                r = run_bench(family, batch, configs=configs)
                print_bench(r)
                results.append(r)
        except Exception:
            traceback.print_exc()
        with open(out / "bench.json", "w") as fh:
            json.dump(results, fh, indent=1, default=str)
        _summary(results, out)
    return results


def _summary(results: list[dict], out: Path) -> None:
    """One line per result, printed and written to ``summary.txt``."""
    lines = []
    for r in results:
        o, s = r["ops"], r["speedups"]
        anchor = f"{o['anchor']['us']:.1f}us ({o['anchor']['kernel']})" if "anchor" in o else "n/a"
        lines.append(
            f"{r['family']:6s} B={r['batch']:3d} copy={r['copy_tbps']:.2f}TB/s "
            f"std={o['standard']['us']:.1f}us ({o['standard']['frac_copy']:.0%} of copy) anchor={anchor}"
            f" replay_win={s['replay_vs_standard']:.2f}x sketch_win={s['sketch_vs_standard']:.2f}x "
            f"sk/rep={s['sketch_vs_replay']:.2f}x "
            f"step(rep/sk)={o['replay_step']['us']:.1f}/{o['sketch_step']['us']:.1f}us "
            f"flush(rep/sk)={o['replay_flush']['us']:.1f}/{o['sketch_flush']['us']:.1f}us "
            f"win(rep/sk)={o['replay_window']['us']:.0f}/{o['sketch_window']['us']:.0f}us"
        )
    text = "\n".join(lines)
    (out / "summary.txt").write_text(text + "\n")
    print(text, flush=True)


def main(argv: list[str]) -> int:
    bootstrap()
    what, rest = (argv[0], argv[1:]) if argv else ("all", [])
    if what == "tests":
        return int(run_tests(rest))
    if what == "bench":
        run_benches(rest or ["gdn", "kda", "mamba2"])
        return 0
    if what == "all":
        code = run_tests()
        run_benches(["gdn", "kda", "mamba2"])
        return int(code)
    print("usage: gpu_check.py [tests [PYTEST_ARGS…] | bench [FAMILY…]]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
