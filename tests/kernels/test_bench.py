"""``sketchcal bench``'s driver, dry-run on the CPU through the Triton interpreter at a tiny shape:
every tuning candidate launches, the fastest is kept, and speedups are window ratios."""

from dataclasses import asdict, astuple, replace
from dataclasses import fields as dataclass_fields

import pytest
import torch

from sketchcal.errors import SketchcalError
from sketchcal.kernels import bench, dispatch
from sketchcal.kernels.dispatch import KernelConfig

V = 32


def _distinct(candidates: list) -> set[tuple]:
    """Launch shapes after ``block_v`` is clipped to V."""
    return {astuple(replace(c, block_v=min(c.block_v, V))) for c in candidates}


@pytest.mark.parametrize("family", ["gdn", "kda", "mamba2"])
def test_tuned_dry_run_tries_every_candidate(family):
    shape = bench.ModelShape("tiny", heads=2, groups=2 if family == "kda" else 1, key_dim=16, value_dim=V)
    window = 4
    r = bench.run_bench(
        family,
        2,
        rank=4,
        window=window,
        pools=1,
        shape=shape,
        tune=True,
        anchor=False,
        replays=1,
        _cpu_dry_run=True,
    )
    for kernel, group in (("replay", "replay"), ("sketch", "sketch"), ("flush_replay", "flush")):
        tried = r["tuning"][kernel]
        fields = tuple(f.name for f in dataclass_fields(KernelConfig))
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


def test_candidates_tune_only_the_kernels_named():
    """``candidates`` replaces the tuning lists: only the named kernel is tuned, among exactly the
    shapes given; the others keep their defaults."""
    shape = bench.ModelShape("tiny", heads=2, groups=1, key_dim=16, value_dim=V)
    given = [bench.parse_config("sweep,16,1,vec=2"), bench.parse_config("sweep,16,1,prefetch")]
    r = bench.run_bench(
        "gdn",
        2,
        rank=4,
        window=3,
        pools=1,
        shape=shape,
        tune=True,
        anchor=False,
        replays=1,
        candidates={"flush_sketch": given},
        _cpu_dry_run=True,
    )
    assert set(r["tuning"]) == {"flush_sketch"}
    fields = tuple(f.name for f in dataclass_fields(KernelConfig))
    assert {tuple(t[f] for f in fields) for t in r["tuning"]["flush_sketch"]} == _distinct(given)
    assert r["configs"]["sketch"] == asdict(dispatch.default_config("sketch", "gdn"))


@pytest.mark.parametrize("candidates", [{"flush": [KernelConfig("sweep", 16, 1)]}, {"sketch": []}])
def test_bad_candidates_are_one_clear_error(candidates):
    with pytest.raises(SketchcalError, match="candidates"):
        bench.run_bench("gdn", 2, tune=True, candidates=candidates, _cpu_dry_run=True)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("sweep,16,1,vec=2", KernelConfig("sweep", 16, 1, vec=2)),
        ("chunk,64,4,cap=128", KernelConfig("chunk", 64, 4, maxnreg=128)),
        (
            "read,128,1,cap=64,group=2,rows=16,late_map",
            KernelConfig("read", 128, 1, maxnreg=64, group=2, dense_rows=16, early_map=False),
        ),
        ("sweep,16,1,vec=2,prefetch", KernelConfig("sweep", 16, 1, vec=2, prefetch=True)),
        ("gluon_sweep,64,4,per_sm=2,cap=168", KernelConfig("gluon_sweep", 64, 4, per_sm=2, maxnreg=168)),
        (
            "split_read,64,1,coef_warps=2,heads=4,dots=0",
            KernelConfig("split_read", 64, 1, coef_warps=2, heads=4, dots=0),
        ),
    ],
)
def test_parse_config(text, want):
    assert bench.parse_config(text) == want


def test_short_form_round_trips_every_candidate():
    shapes = [c for kinds in bench.TUNE_CANDIDATES.values() for cands in kinds.values() for c in cands]
    shapes += [*bench.SPLIT_SHAPES, *dispatch.DEFAULT_CONFIGS.values(), *dispatch.FP8_CONFIGS.values()]
    for cfg in shapes:
        assert bench.parse_config(bench.short_form(cfg)) == cfg


@pytest.mark.parametrize(
    "text",
    [
        "sweep,16",
        "sweep,16,1,bogus",
        "bogus,16,1",
        "16,1,sweep",
        "sweep,16,1,foo=3",
        "sweep,x,1",
        "sweep,48,1",
    ],
)
def test_bad_launch_shape_text_is_one_clear_error(text):
    with pytest.raises(SketchcalError, match="launch shape"):
        bench.parse_config(text)


def _touched(t, index=None) -> int:
    """Bytes of ``t`` (or of ``t[index]``)."""
    if t is None:
        return 0
    part = t if index is None else t[index]
    return part.numel() * part.element_size()


@pytest.mark.parametrize("read_dtype", ["bf16", "fp32", "fp8"])
@pytest.mark.parametrize("family", ["gdn", "kda", "mamba2"])
def test_byte_model_counts_the_tensors_each_call_touches(family, read_dtype):
    """The benchmark's byte model against a count over the tensors of a real pool: a read of p
    buffered tokens, a flush of n, and the standard step."""
    from sketchcal.kernels.common.pool import allocate_pool, random_sketch, rank_spread
    from sketchcal.kernels.common.testing import random_inputs

    h, kd, vd, batch, cap = 4, 16, 8, 3, 6
    g = h if family == "kda" else 2
    shape = bench.ModelShape("tiny", heads=h, groups=g, key_dim=kd, value_dim=vd)
    ranks = rank_spread(h, 8, kd)
    rd = bench.READ_DTYPES[read_dtype]
    tables = random_sketch(family, ranks, g, kd)
    pool = allocate_pool(
        family, batch, h, g, kd, vd, capacity=cap, read_dtype=rd, sketch_rows=tables.map_rows
    )
    x = random_inputs(family, batch, 1, h, g, kd, vd)
    bm = bench.ByteModel(family, batch, shape, ranks, read_bytes=rd.itemsize)
    inputs = sum(_touched(t) for t in (x.k, x.q, x.w, x.decay, x.beta, x.skip)) + _touched(x.w)  # + out
    entry = (slice(None), slice(None), 3)  # one buffer entry of every slot
    appended = sum(_touched(t, entry) for name, t in pool.tensors().items() if name.startswith("buf"))
    read_decays = pool.buf_logdecay if pool.buf_logdecay is not None else pool.buf_decay
    sketch_rows = sum(_touched(pool.sketch, (slice(None), head, slice(0, m))) for head, m in enumerate(ranks))
    maps = sum(ranks) * kd * 4  # read once for the whole batch
    for p in (0, 3):
        first = (slice(None), slice(None), slice(0, p))
        buffered = sum(_touched(t, first) for t in (pool.buf_k, pool.buf_w, read_decays, pool.buf_beta))
        assert bm.sketch_step(p) == sketch_rows + buffered + appended + inputs + maps
        assert bm.replay_step(p) == _touched(pool.read) + buffered + appended + inputs
    n = 5
    folded = sum(
        _touched(t, (slice(None), slice(None), slice(0, n)))
        for t in (pool.buf_k, pool.buf_w, pool.buf_decay, pool.buf_beta)
    )
    assert bm.flush(n, sketch=False) == 2 * _touched(pool.state) + _touched(pool.read) + folded + inputs
    assert bm.standard() == 2 * _touched(pool.state) + inputs
    if family == "mamba2":  # the split read also writes and reads the workspace's dots and coefficients
        split = bench.ByteModel(family, batch, shape, ranks, read_bytes=rd.itemsize, split=True)
        no_dots = bench.ByteModel(
            family, batch, shape, ranks, read_bytes=rd.itemsize, split=True, split_dots=False
        )  # the head kernel computes them
        dots = (h // g) * tables.map_rows
        for p in (0, 3):
            coefficients = batch * sum(ranks) * pool.workspace.element_size()
            used = _touched(pool.workspace, (slice(None), slice(None), slice(dots, dots + p + 1)))
            assert split.sketch_step(p) == bm.sketch_step(p) + 2 * (used + coefficients)
            assert no_dots.sketch_step(p) == bm.sketch_step(p) + 2 * coefficients


def test_fp8_read_copy_dry_run():
    """The benchmark builds and runs fp8 (e4m3) pools: read copy and sketch."""
    shape = bench.ModelShape("tiny", heads=2, groups=2, key_dim=16, value_dim=V)
    r = bench.run_bench(
        "kda",
        2,
        rank=4,
        window=3,
        read_dtype="fp8",
        pools=1,
        shape=shape,
        anchor=False,
        replays=1,
        _cpu_dry_run=True,
    )
    assert (
        r["ops"]["replay_step"]["bytes"]
        < bench.run_bench(
            "kda", 2, rank=4, window=3, pools=1, shape=shape, anchor=False, replays=1, _cpu_dry_run=True
        )["ops"]["replay_step"]["bytes"]
    )


def test_split_sketch_read_dry_run():
    """The benchmark runs Mamba-2's split sketch read when given it, and counts its workspace: the
    coefficients, and the dots unless the head kernel computes them (``dots=0``)."""
    shape = bench.ModelShape("tiny", heads=8, groups=2, key_dim=16, value_dim=V)
    kw = dict(rank=4, window=3, pools=1, shape=shape, anchor=False, replays=1, _cpu_dry_run=True)
    split = KernelConfig("split_read", 16, 1, heads=4, dots=1)
    one_kernel = replace(dispatch.default_config("sketch", "mamba2"), form="read")
    one = bench.run_bench("mamba2", 2, configs={"sketch": one_kernel}, **kw)["ops"]["sketch_step"]["bytes"]
    coefficients = sum(bench.rank_spread(8, 4, 16))
    # batch 2 × (written + read) 4-byte values: Σ m coefficients, and 2 groups × (p + 1) dots
    # (p = 0, 1: 1.5 on average)
    for dots, values in ((1, 2 * 1.5 + coefficients), (0, coefficients)):
        r = bench.run_bench("mamba2", 2, configs={"sketch": replace(split, dots=dots)}, **kw)
        assert (r["configs"]["sketch"]["form"], r["configs"]["sketch"]["dots"]) == ("split_read", dots)
        assert r["ops"]["sketch_step"]["bytes"] - one == 2 * 2 * 4 * values


@pytest.mark.parametrize(("batch", "window"), [(5, 4), (16, 16), (33, 16), (3, 8)])
def test_staggered_schedule_walks_every_slot_through_one_window(batch, window):
    """Against a per-slot counter stepped by hand: slot b starts at pos b mod L, reads and moves on,
    or flushes at pos L − 1 and starts over; each step's flush and read sets split the batch."""
    slots = torch.arange(100, 100 + batch, dtype=torch.int32)
    pos = {int(s): b % window for b, s in enumerate(slots)}
    flushes = dict.fromkeys(pos, 0)
    for fslots, rslots, rpos in bench.staggered_schedule(slots, window):
        assert sorted(fslots.tolist() + rslots.tolist()) == sorted(pos)
        assert all(pos[s] == window - 1 for s in fslots.tolist())
        assert rpos.tolist() == [pos[s] for s in rslots.tolist()] and rpos.dtype == torch.int32
        for s in pos:
            flushes[s] += s in fslots.tolist()
            pos[s] = 0 if pos[s] == window - 1 else pos[s] + 1
    assert all(n == 1 for n in flushes.values())
    assert pos == {int(s): b % window for b, s in enumerate(slots)}  # a whole window: back to the start


def test_staggered_dry_run_times_both_schedules_and_counts_a_window_of_bytes():
    shape = bench.ModelShape("tiny", heads=2, groups=1, key_dim=16, value_dim=V)
    r = bench.run_bench(
        "mamba2",
        5,
        rank=4,
        window=4,
        pools=1,
        shape=shape,
        anchor=False,
        replays=1,
        staggered=True,
        _cpu_dry_run=True,
    )
    o = r["ops"]
    for mode in ("replay", "sketch"):
        for op in (f"{mode}_staggered", f"{mode}_staggered_serial"):
            assert o[op]["bytes"] == o[f"{mode}_window"]["bytes"]  # every slot still does one window
            assert r["speedups"][f"{op}_vs_standard"] == pytest.approx(
                4 * o["standard"]["us"] / o[op]["us"], rel=1e-6
            )
    assert (
        "replay_staggered"
        not in bench.run_bench(
            "mamba2", 2, rank=4, window=2, pools=1, shape=shape, anchor=False, replays=1, _cpu_dry_run=True
        )["ops"]
    )


def test_fp8_pools_take_the_shapes_tuned_for_fp8():
    """An fp8 read copy gets ``FP8_CONFIGS`` where there is one, the bf16 defaults elsewhere; the
    benchmark reports the shapes the kernels will use."""
    fp8 = bench.READ_DTYPES["fp8"]
    assert dispatch.FP8_CONFIGS, "nothing tuned for fp8"
    for (kernel, family), cfg in dispatch.FP8_CONFIGS.items():
        assert cfg != dispatch.DEFAULT_CONFIGS[(kernel, family)]
        assert dispatch.default_config(kernel, family, fp8) == cfg
        for other in (None, torch.bfloat16, torch.float32):
            assert (
                dispatch.default_config(kernel, family, other) == dispatch.DEFAULT_CONFIGS[(kernel, family)]
            )
        assert bench._configs(family, None, fp8)[kernel] == cfg
    assert bench._configs("gdn", None, fp8)["sketch"] == dispatch.DEFAULT_CONFIGS[("sketch", "gdn")]


def test_paged_dry_run_runs_the_forms_that_take_slot_strides():
    """``--paged`` times the window on pools laid out as vLLM's pages: the configs it reports are
    the ones that run there."""
    shape = bench.ModelShape("tiny", heads=4, groups=2, key_dim=16, value_dim=V)
    r = bench.run_bench(
        "mamba2", 2, rank=4, window=4, pools=1, shape=shape, anchor=False, replays=1, paged=True,
        _cpu_dry_run=True,
    )  # fmt: skip
    assert r["paged"]
    forms = {k: c["form"] for k, c in r["configs"].items()}
    assert forms == {
        "standard": "standard",
        "replay": "read",
        "sketch": "split_read",  # its workspace is in the page
        "flush_replay": "sweep",
        "flush_sketch": "sweep",
    }
    with pytest.raises(SketchcalError, match="drop --tune"):
        bench.run_bench("gdn", 2, tune=True, paged=True, _cpu_dry_run=True)


@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_adaptive_dry_run_times_the_adaptive_window_at_the_static_read_bytes(family):
    """Beside the static sketch the benchmark times the adaptive one, at the ranks that read no more
    bytes (``fit.traffic.adaptive_ranks``), on its own pools; a paged run on pools laid out as vLLM's
    pages, the factors in them."""
    from sketchcal.fit.traffic import adaptive_ranks

    shape = bench.ModelShape("tiny", heads=4, groups=2, key_dim=16, value_dim=V)
    kw = dict(rank=8, window=3, pools=1, shape=shape, anchor=False, replays=1, _cpu_dry_run=True)
    r = bench.run_bench(family, 2, **kw)
    ops, s = r["ops"], r["speedups"]
    assert {"adaptive_step", "adaptive_flush", "adaptive_window"} <= set(ops)
    want = adaptive_ranks(r["ranks"], 16, V)
    assert ops["adaptive_window"]["mean_rank"] == sum(want) / len(want) < r["mean_rank"]
    assert ops["adaptive_flush"]["bytes"] > ops["sketch_flush"]["bytes"]
    assert s["adaptive_vs_sketch"] == pytest.approx(ops["sketch_window"]["us"] / ops["adaptive_window"]["us"])
    assert "adaptive_window" in bench.run_bench(family, 2, paged=True, **kw)["ops"]
