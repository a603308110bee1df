"""Float64 checks of the serving-API references (no Triton): product form, sketch frames, ranks."""

import pytest
import torch

from sketchcal.artifact.sketch import SketchLayer
from sketchcal.kernels.common import reference as ref
from sketchcal.kernels.common.pool import (
    SUPPORTED_RANKS,
    DecodePool,
    SketchTables,
    candidate_ranks,
    clip_rank,
    random_frames,
    random_sketch,
    rank_spread,
    sketch_tables,
)
from sketchcal.kernels.common.recurrence import StepInputs, product_form_read
from sketchcal.kernels.common.testing import random_inputs, random_pool

F64 = torch.float64
SHAPES = {"mamba2": (4, 2, 16, 8), "gdn": (4, 2, 16, 8), "kda": (3, 3, 16, 8)}  # H, G, K, V


def _f64_pool(family, slots, capacity, gen):
    h, g, k, v = SHAPES[family]
    pool = random_pool(
        family,
        slots,
        h,
        g,
        k,
        v,
        capacity=capacity,
        read_dtype=torch.float32,
        sketch_rows=8,
        input_dtype=torch.float32,
        generator=gen,
    )
    return DecodePool(**{name: t.to(F64) for name, t in pool.tensors().items()})


def _token(x: StepInputs, t: int) -> StepInputs:
    return x.map(lambda a: a[:, t : t + 1].contiguous())


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_window_equals_standard_steps(family):
    """L−1 replay steps + a flush give the model's own step outputs and the same final state."""
    gen = torch.Generator().manual_seed(0)
    h, g, k, v = SHAPES[family]
    window, batch = 5, 3
    std = _f64_pool(family, batch, 0, gen)
    win = _f64_pool(family, batch, window, gen)
    win.state.copy_(std.state)
    win.read.copy_(std.state)
    slots = torch.tensor([2, 0, 1])
    x = random_inputs(family, batch, window, h, g, k, v, dtype=F64, generator=gen)
    o_std = ref.standard_step(family, std, slots, x)
    outs = []
    for t in range(window - 1):
        outs.append(ref.replay_step(family, win, slots, torch.full((batch,), t), _token(x, t)))
    outs.append(ref.flush(family, win, slots, torch.full((batch,), window - 1), _token(x, window - 1)))
    torch.testing.assert_close(torch.cat(outs, dim=1), o_std, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(win.state, std.state, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(win.read, std.state, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_sketch_read_matches_original_frame(family):
    """The sketch read equals (R S_c)_{:m}ᵀ (P u) + the buffer term (dense heads: S_cᵀ u)."""
    gen = torch.Generator().manual_seed(1)
    h, g, k, v = SHAPES[family]
    ranks = [4, 0, 8, 4][:h]
    frames = torch.linalg.qr(torch.randn(g, k, k, dtype=F64, generator=gen))[0]
    maps = [torch.randn(m, k, dtype=F64, generator=gen) for m in ranks]
    tables = sketch_tables(family, frames, maps, ranks)
    pool = _f64_pool(family, 2, 4, gen)
    slots, pos = torch.tensor([1, -1]), torch.tensor([2, 0])
    x = random_inputs(family, 2, 1, h, g, k, v, dtype=F64, generator=gen)
    # expected, in the model frame: buffer term + (R S_c)_{:m}ᵀ (P u), or S_cᵀ u for a dense head
    s_c = pool.read[1].clone()
    win = ref._window(pool, 1, 2, x, 0, read=True)
    o_buf, u = product_form_read(ref._family(family), torch.zeros_like(s_c), win)
    expect = o_buf[2].clone()
    for head, m in enumerate(ranks):
        if m == 0:
            expect[head] += s_c[head].T @ u[2, head]
        else:
            expect[head] += (frames[head // (h // g)] @ s_c[head])[:m].T @ (maps[head] @ u[2, head])
    # every family stores the sketch R_{:m} S_c beside the model-frame checkpoint
    for head, m in enumerate(ranks):
        if m:
            pool.sketch[1, head, :m] = frames[head // (h // g), :m] @ s_c[head]
    got = ref.sketch_step(family, pool, tables, slots, pos, x)
    torch.testing.assert_close(got[0, 0], expect, rtol=1e-6, atol=1e-6)  # the maps are stored fp32
    assert torch.isnan(got[1]).all()


def test_ranks_and_tables():
    assert sum(rank_spread(32, 8, 128)) == 8 * 32
    assert sum(rank_spread(64, 8, 128)) == 8 * 64
    assert set(rank_spread(64, 8, 128)) <= set(SUPPORTED_RANKS)
    assert rank_spread(8, 0, 128) == [0] * 8
    assert (
        clip_rank(5, 128) == 6
        and clip_rank(7, 128) == 8
        and clip_rank(100, 64) == 0
        and clip_rank(64, 128) == 64
    )
    t = random_sketch("gdn", [4, 8, 0, 12], 2, 16, torch.Generator().manual_seed(0))
    assert t.read_rows.tolist() == [0, 0, 16, 0] and t.maps.shape == (4, 12, 16)
    t = random_sketch("kda", [4, 0], 2, 16, torch.Generator().manual_seed(0))
    assert t.read_rows.tolist() == [0, 16]
    with pytest.raises(ValueError, match="not supported"):
        sketch_tables("gdn", torch.eye(16).expand(2, 16, 16), [torch.zeros(5, 16)] * 2, [5, 5])


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_tables_from_an_artifact_layer(family):
    """``SketchTables.from_layer`` (rotated maps ``coef``, ``P = coef R``) builds the tables of the
    model-frame maps; a flush writes rows r < m of each sketch head and leaves the other rows alone."""
    gen = torch.Generator().manual_seed(5)
    h, g, k, _ = SHAPES[family]
    ranks = [4, 0, 8, 4][:h]
    frames = random_frames(g, k, gen).float()
    coef = torch.zeros(h, max(ranks), k)
    for head, m in enumerate(ranks):
        coef[head, :m] = torch.randn(m, k, generator=gen)
    layer = SketchLayer(0, frames, coef, torch.tensor(ranks, dtype=torch.int32))
    got = SketchTables.from_layer(family, layer)
    p = [coef[head, :m].double() @ frames[head // (h // g)].double() for head, m in enumerate(ranks)]
    want = sketch_tables(family, frames, p, ranks)
    derived = ("group_maps", "group_cols", "group_width", "frame_terms")
    for name in ("ranks", "maps", "frames", "read_rows", *derived):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    rows = got.sketch_rows()
    for head, m in enumerate(ranks):
        assert torch.equal(rows[head, :m], frames[head // (h // g), :m]) and not rows[head, m:].any()
    with pytest.raises(ValueError, match="ranks outside"):
        SketchTables.from_layer(
            family, SketchLayer(0, frames, coef, torch.tensor([9] * h, dtype=torch.int32))
        )

    pool = _f64_pool(family, 2, 4, gen)
    before = pool.sketch.clone()
    ref.flush(family, pool, torch.tensor([1, -1]), torch.tensor([3, 0]), tables=got)
    assert torch.equal(pool.sketch[0], before[0])
    state = pool.state[1]
    for head, m in enumerate(ranks):
        frame = frames[head // (h // g)].double()
        torch.testing.assert_close(pool.sketch[1, head, :m], frame[:m] @ state[head], rtol=1e-12, atol=1e-12)
        assert torch.equal(pool.sketch[1, head, m:], before[1, head, m:])


def test_candidate_ranks():
    assert candidate_ranks(128) == list(SUPPORTED_RANKS)
    assert candidate_ranks(16) == [0, 2, 4, 6, 8, 12]
    assert candidate_ranks(4) == [0, 2]
    assert candidate_ranks(2) == [0]
    assert (
        clip_rank(0, 128) == 0
        and clip_rank(1, 16) == 2
        and clip_rank(12, 16) == 12
        and clip_rank(13, 16) == 0
    )
