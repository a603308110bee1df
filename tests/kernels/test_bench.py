"""``sketchcal bench``'s driver, dry-run on the CPU through the Triton interpreter at a tiny shape:
every tuning candidate launches, the fastest is kept, and speedups are window ratios."""

import pytest

from sketchcal.errors import SketchcalError
from sketchcal.kernels import bench

V = 32


def _distinct(candidates: list[tuple]) -> set[tuple]:
    """Launch shapes after ``block_v`` is clipped to V (defaults: chunked, vec 0, maxnreg 0)."""
    return {(min(c[0], V), c[1], *(list(c[2:]) + [True, 0, 0][len(c) - 2:])) for c in candidates}


@pytest.mark.parametrize("family", ["gdn", "kda", "mamba2"])
def test_tuned_dry_run_tries_every_candidate(family):
    shape = bench.ModelShape("tiny", heads=2, groups=2 if family == "kda" else 1, key_dim=16, value_dim=V)
    window = 4
    r = bench.run_bench(
        family, 2, rank=4, window=window, pools=1, shape=shape, tune=True, anchor=False, replays=1,
        _cpu_dry_run=True,
    )
    for kernel, group in (("replay", "read"), ("sketch", "read"), ("flush_replay", "flush")):
        tried = r["tuning"][kernel]
        fields = ("block_v", "num_warps", "chunked", "vec", "maxnreg")
        assert {tuple(t[f] for f in fields) for t in tried} == _distinct(bench.TUNE_CANDIDATES[group][family])
        best = min(tried, key=lambda t: t["us"])
        assert r["configs"][kernel] == {f: best[f] for f in fields}
    o = r["ops"]
    for mode in ("replay", "sketch"):  # a window is timed as one graph of L - 1 steps and a flush
        assert r["speedups"][f"{mode}_vs_standard"] == pytest.approx(
            window * o["standard"]["us"] / o[f"{mode}_window"]["us"], rel=1e-6
        )


def test_bad_window_is_one_clear_error():
    with pytest.raises(SketchcalError, match="--window"):
        bench.run_bench("gdn", 2, window=1, _cpu_dry_run=True)
