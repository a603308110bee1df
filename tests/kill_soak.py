"""kill -9 soak: interrupt calibrate and convert at random moments, resume, compare with uninterrupted runs.

Usage: ``python tests/kill_soak.py WORKDIR [--calibrate-kills N] [--convert-kills N] [--seed S]``.
Prints one JSON line (the kill points and the checks) and exits 0 when every check passed.

Each run is a forked child of this process (which has imported sketchcal but run no torch
operation, so forking is safe), killed with SIGKILL after a random delay drawn over the length of an
uninterrupted run. A killed calibration is continued with ``--resume`` when it saved progress, else
started again in the same directory, each attempt with a random ``save_every`` (which must not
change the result); a killed conversion is started again. At the end the statistics tensors and
every file of the converted directory must equal those of the uninterrupted runs bit for bit, and
no temporary file may be left anywhere under WORKDIR.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

CALIBRATION = dict(
    model="builtin:tiny-gdn", samples=12, seq_len=64, batch_size=2, heldout_samples=2, heldout_windows=4,
    window=8, device="cpu", progress=False,
)  # fmt: skip
CONVERSION = dict(rank=8, shrinkage="oas", progress=False)


def _child(fn) -> int:
    """Run ``fn`` in a forked child; return its pid (the child exits 0 on success, 1 on an error)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import torch

            torch.set_num_threads(1)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            fn()
            code = 0
        finally:
            os._exit(code)
    return pid


def _run(fn, kill_after: float | None = None) -> tuple[bool, bool]:
    """Run ``fn`` in a child: (finished with status 0, was killed). With ``kill_after``, the child is
    sent SIGKILL after that many seconds unless it has finished."""
    t0 = time.monotonic()
    pid = _child(fn)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0, False
        if kill_after is not None and time.monotonic() - t0 >= kill_after:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)  # reap it: a zombie would still count as a live writer
            return False, True
        time.sleep(0.005)


def _timed(fn) -> float:
    t0 = time.monotonic()
    ok, _ = _run(fn)
    assert ok, "an uninterrupted run failed"
    return time.monotonic() - t0


def _calibrate(out: Path, save_every: int, resume: bool):
    def fn():
        import sketchcal

        sketchcal.calibrate(out=out, save_every=save_every, resume=resume, **CALIBRATION)

    return fn


def _convert(stats: Path, out: Path):
    def fn():
        import sketchcal

        sketchcal.convert(stats, out=out, **CONVERSION)

    return fn


def _stats_tensors(path: Path) -> dict:
    from sketchcal.formats.stats import load_stats_tensors

    return load_stats_tensors(path)[1]


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*"))


def soak(work: Path, calibrate_kills: int, convert_kills: int, seed: int) -> dict:
    """Kill calibrations until ``calibrate_kills`` kills happened, then conversions likewise; every
    chain of attempts is carried to completion and compared with the uninterrupted run."""
    rng = random.Random(seed)
    work.mkdir(parents=True, exist_ok=True)
    ref_stats, ref_art = work / "ref-stats", work / "ref-art"
    t_cal = _timed(_calibrate(ref_stats, save_every=4, resume=False))
    t_conv = _timed(_convert(ref_stats, ref_art))
    ref_tensors, ref_files = _stats_tensors(ref_stats), _files(ref_art)
    report: dict = {"seed": seed, "seconds": {"calibrate": t_cal, "convert": t_conv}}
    report["calibrate"], report["convert"] = [], []
    failures: list[str] = []

    kills = chain = 0
    while kills < calibrate_kills:
        stats = work / f"stats-{chain}"
        while True:
            resume = (stats / "_progress" / "state.json").is_file()
            save_every = rng.choice([1, 2, 3])
            delay = rng.uniform(0.05, t_cal) if kills < calibrate_kills else None
            ok, killed = _run(_calibrate(stats, save_every, resume), delay)
            report["calibrate"].append(
                {"chain": chain, "resume": resume, "save_every": save_every, "kill_after_s": delay,
                 "killed": killed}
            )  # fmt: skip
            kills += killed
            if ok:
                break
            if not killed:
                failures.append(f"calibration attempt in {stats.name} failed without being killed")
                break
        got = _stats_tensors(stats)
        if got.keys() != ref_tensors.keys() or any(not got[k].equal(ref_tensors[k]) for k in got):
            failures.append(f"{stats.name} differs from the uninterrupted calibration")
        if (stats / "_progress").exists():
            failures.append(f"{stats.name}/_progress left behind")
        chain += 1

    kills = chain = 0
    while kills < convert_kills:
        art = work / f"art-{chain}"
        while True:
            delay = rng.uniform(0.05, t_conv) if kills < convert_kills else None
            ok, killed = _run(_convert(ref_stats, art), delay)
            report["convert"].append({"chain": chain, "kill_after_s": delay, "killed": killed})
            kills += killed
            if ok:
                break
            if not killed:
                failures.append(f"conversion into {art.name} failed without being killed")
                break
            if art.exists():
                failures.append(f"a killed conversion left {art.name} under the requested name")
        got_files = _files(art)
        differing = sorted(
            k for k in ref_files.keys() | got_files.keys() if ref_files.get(k) != got_files.get(k)
        )
        if differing:
            failures.append(f"{art.name} differs from the uninterrupted conversion in {', '.join(differing)}")
        chain += 1

    report["kills"] = {
        "calibrate": sum(r["killed"] for r in report["calibrate"]),
        "convert": sum(r["killed"] for r in report["convert"]),
    }
    report["leftovers"] = _leftovers(work)
    failures += [f"temporary left behind: {p}" for p in report["leftovers"]]
    report["failures"] = failures
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workdir", type=Path)
    p.add_argument("--calibrate-kills", type=int, default=7)
    p.add_argument("--convert-kills", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    # imported once here, before forking, instead of in every child
    import sketchcal.artifact.convert
    import sketchcal.calibrate.run  # noqa: F401

    report = soak(args.workdir, args.calibrate_kills, args.convert_kills, args.seed)
    print(json.dumps(report))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
