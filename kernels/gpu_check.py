"""One-call GPU check: the ``gpu``-marked kernel tests, then the decode benchmark.

Run from the repository root on a CUDA machine (no install needed)::

    python kernels/gpu_check.py tests [-k EXPR]   # pytest -m gpu tests/kernels
    python kernels/gpu_check.py bench [FAMILY…]   # batch 256 (tuned), then 64 and 512
    python kernels/gpu_check.py bench256 [FAMILY…] # batch 256 (tuned) only
    python kernels/gpu_check.py warm FAMILY       # compile every tuning candidate (tiny batch)
    python kernels/gpu_check.py oneshot [SECONDS] # one short device call: see :func:`oneshot`
    python kernels/gpu_check.py final             # bench (tuned at 256, then 64 and 512), then every
                                                  # gpu test with the tuned shapes as the defaults
    python kernels/gpu_check.py probe FAMILY KERNEL SHAPE…   # time launch shapes of one kernel
                                                  # side by side at batch 256: see :func:`probe`

Logs and ``bench.json`` go to ``$OUT`` (default ``./gpu_out``). The public anchors are used when
importable: fla 0.6.0 (``fla-core`` wheel) for GDN and KDA, ``mamba_ssm``'s
``selective_state_update`` for Mamba-2.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
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
        "sketchcal.kernels",
        ROOT / "kernels" / "__init__.py",
        submodule_search_locations=[str(ROOT / "kernels")],
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sketchcal.kernels"] = mod
    spec.loader.exec_module(mod)


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


def warm(family: str) -> None:
    """Compile every tuning candidate of ``family`` (and the anchor) into Triton's on-disk cache
    with a tiny batch, so that a later timed run spends no time compiling."""
    from sketchcal.kernels.bench import run_bench

    t0 = time.time()
    run_bench(family, 8, pools=1, tune=True, replays=1)
    print(f"warm {family}: {time.time() - t0:.0f}s", flush=True)


def oneshot(budget_s: float = 110.0) -> None:
    """Everything one short device call needs, ending inside ``budget_s`` seconds: in parallel,
    the ``gpu`` tests of the window kernels (one process per family, ``tests_<family>.log``) and
    a compile-only warm-up of every tuning candidate (one process per family, ``warm.log``),
    stopped at half the budget; then, alone on the GPU, the tuned batch-256 benchmark of each
    family (``bench.json``, ``summary.txt``)."""
    start = time.time()
    out = out_dir()
    families = ["gdn", "kda", "mamba2"]
    me = [sys.executable, str(Path(__file__).resolve())]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs, logs = [], []
    for family in families:
        for args, log_name in (
            (["tests", "-k", f"{family} and not spec and not standard"], f"tests_{family}.log"),
            (["warm", family], "warm.log"),
        ):
            log = open(out / log_name, "a")  # noqa: SIM115  (closed below)
            logs.append(log)
            procs.append(subprocess.Popen([*me, *args], stdout=log, stderr=subprocess.STDOUT, env=env))
    deadline = start + 0.5 * budget_s
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            print(f"stage 1: stopped pid {proc.pid} ({' '.join(proc.args[2:])}) at the deadline", flush=True)
        else:
            print(f"stage 1: {' '.join(proc.args[2:])} exited {proc.returncode}", flush=True)
    for log in logs:
        log.close()
    print(f"stage 1 (tests + compile) done at {time.time() - start:.0f}s", flush=True)
    run_benches(families, batches=(), deadline=start + budget_s)
    print(f"oneshot done at {time.time() - start:.0f}s", flush=True)


def probe(family: str, kernel: str, shapes: list[str], batch: int = 256) -> dict:
    """Time the default launch shape of ``kernel`` (one of ``bench.TUNED_KERNELS``) and ``shapes``
    (``bench.parse_config``'s short form, e.g. ``64,4,cap=128``) side by side at ``batch``, as the
    tuning of ``bench`` times its candidates, then the windows with the fastest. Prints one line
    per shape; writes ``probe_<family>_<kernel>.json`` to ``$OUT``."""
    from sketchcal.errors import SketchcalError
    from sketchcal.kernels.bench import TUNED_KERNELS, parse_config, run_bench
    from sketchcal.kernels.common.decode import default_config
    from sketchcal.kernels.common.pool import check_family

    check_family(family)
    if kernel not in TUNED_KERNELS:
        raise SketchcalError(f"unknown kernel {kernel!r}; expected one of {', '.join(TUNED_KERNELS)}")
    candidates = [default_config(kernel, family), *(parse_config(s) for s in shapes)]
    r = run_bench(family, batch, tune=True, anchor=False, candidates={kernel: candidates})
    for t in r["tuning"][kernel]:
        shape = {k: v for k, v in t.items() if k != "us"}
        print(f"{family} {kernel} {t['us']:9.2f} us  {shape}", flush=True)
    for err in r["tuning"].get("errors", []):
        print(f"{family} {kernel} failed: {err}", flush=True)
    s = r["speedups"]
    print(
        f"{family} B={batch}: windows with the fastest: replay {s['replay_vs_standard']:.2f}x, "
        f"sketch {s['sketch_vs_standard']:.2f}x",
        flush=True,
    )
    (out_dir() / f"probe_{family}_{kernel}.json").write_text(json.dumps(r, indent=1, default=str))
    return r


def run_benches(
    families: list[str], batches: tuple[int, ...] = (64, 512), deadline: float | None = None
) -> list[dict]:
    """Per family: batch 256 with launch-shape tuning, then ``batches`` with the tuned shapes.
    A family not started 5 s before ``deadline`` (a ``time.time()`` value) is skipped."""
    import torch
    import triton

    from sketchcal.kernels.bench import print_bench, run_bench
    from sketchcal.kernels.common.decode import KernelConfig

    out = out_dir()
    print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}", flush=True)
    results: list[dict] = []
    for family in families:
        t0 = time.time()
        if deadline is not None and t0 > deadline - 5:
            print(f"{family}: skipped, too close to the deadline", flush=True)
            continue
        try:
            r256 = run_bench(family, 256, tune=True)
            print_bench(r256)
            results.append(r256)
            configs = {k: KernelConfig(**v) for k, v in r256["configs"].items()}
            print(
                f"{family}: tuned {r256['configs']} in {time.time() - t0:.0f}s; "
                f"anchor diff {r256['anchor_rel_diff']} {r256['anchor_note']}",
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


def adopt_tuned(results: list[dict]) -> dict:
    """Make the launch shapes tuned at batch 256 the process's ``DEFAULT_CONFIGS`` (so that the
    ``gpu`` tests run afterwards check exactly what was timed); returns them, JSON-able."""
    from sketchcal.kernels.common import decode

    tuned = {}
    for r in results:
        if r["batch"] != 256:
            continue
        for kernel, cfg in r["configs"].items():
            decode.DEFAULT_CONFIGS[(kernel, r["family"])] = decode.KernelConfig(**cfg)
            tuned[f"{kernel}/{r['family']}"] = cfg
    (out_dir() / "tuned_defaults.json").write_text(json.dumps(tuned, indent=1))
    return tuned


def _summary(results: list[dict], out: Path) -> None:
    """One line per result, printed and written to ``summary.txt``."""
    lines = []
    for r in results:
        o, s = r["ops"], r["speedups"]
        anchor = f"{o['anchor']['us']:.1f}us" if "anchor" in o else "n/a"
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
    what = argv[0] if argv else "all"
    families = argv[1:] or ["gdn", "kda", "mamba2"]
    if what in ("tests", "all"):
        code = run_tests(argv[1:] if what == "tests" else None)
        if what == "tests":
            return int(code)
    if what in ("bench", "all"):
        run_benches(families if what == "bench" else ["gdn", "kda", "mamba2"])
    elif what == "bench256":
        run_benches(families, batches=())
    elif what == "warm":
        warm(argv[1])
    elif what == "final":
        adopt_tuned(run_benches(["gdn", "kda", "mamba2"], deadline=time.time() + 420))
        return int(run_tests())
    elif what == "probe":
        if len(argv) < 4:
            print("usage: gpu_check.py probe FAMILY KERNEL SHAPE [SHAPE ...]", file=sys.stderr)
            return 2
        from sketchcal.errors import SketchcalError

        try:
            probe(argv[1], argv[2], argv[3:])
        except (SketchcalError, ValueError) as err:  # an unknown family, kernel or launch shape
            print(f"error: {err}", file=sys.stderr)
            return 2
    elif what == "oneshot":
        oneshot(float(argv[1]) if len(argv) > 1 else 110.0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
