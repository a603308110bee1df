"""The adaptive sketch on the kernels against the float64 reference.

Two things are checked, each against a reference that does not share the kernels' math:
- the flush's factors: ``Q (P_S u)`` from what ``dispatch.flush(..., adaptive=...)`` stores equals
  ``reference.adaptive_read`` of ``reference.adaptive_factor`` (an SVD in float64) of the
  reference's own flushed state, for random queries;
- the read: ``dispatch.spec_verify(..., adaptive=...)`` equals ``reference.spec_verify`` run per
  batch entry with that slot's stored factors as its map and sketch rows (the float64 product form).
On the CPU under ``TRITON_INTERPRET=1`` at small shapes; the ``gpu`` test at the real shapes.
"""

from dataclasses import replace

import pytest
import torch

from sketchcal.kernels import dispatch
from sketchcal.kernels.common import reference as ref
from sketchcal.kernels.common.pool import AdaptiveSketch, random_sketch, rank_spread
from sketchcal.kernels.common.testing import paged_adaptive, random_inputs, random_pool

FAMILIES = ["mamba2", "gdn", "kda"]
CPU_SHAPES = {"mamba2": (4, 2, 16, 16), "gdn": (4, 2, 16, 32), "kda": (4, 4, 16, 16)}  # H, G, K, V
GPU_SHAPES = {"mamba2": (64, 8, 128, 64), "gdn": (32, 16, 128, 128), "kda": (32, 32, 128, 128)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def run_adaptive(
    family: str, shape, dtype_name: str, device, real: bool, seed: int = 0, layout: str = "dense"
) -> None:
    h, g, kd, vd = shape
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    ranks = rank_spread(h, 4, kd) if real else [[0, 2, 4, 6][i % 4] for i in range(h)]
    ranks[1] = 0  # a dense head
    tables = random_sketch(family, ranks, g, kd, gen).to(device)
    n_slots, cap = 7, 16 if real else 5
    pool = random_pool(
        family, n_slots, h, g, kd, vd, capacity=cap, read_dtype=dtype, sketch_rows=tables.map_rows,
        input_dtype=dtype, device=device, generator=gen,
    )  # fmt: skip
    slots = torch.tensor([4, -1, 0, 6, 2], dtype=torch.int32, device=device)
    b = slots.numel()
    pos = torch.randint(0, cap + 1, (b,), generator=gen, dtype=torch.int32).to(device)
    adaptive = AdaptiveSketch.allocate(tables, pool)
    if layout == "paged":  # vLLM's pages: the factors in them too, the state value-major
        pool, adaptive = paged_adaptive(pool, adaptive)
    want_pool = pool.clone()

    # the flush and its factors
    dispatch.flush(family, pool, slots, pos, adaptive=adaptive)
    ref.flush(family, want_pool, slots, pos, tables=tables)
    live = [s for s in slots.tolist() if s >= 0]
    assert _rel(pool.state[live], want_pool.state[live]) <= 1e-5
    q_ref, p_ref = ref.adaptive_factor(tables.sketch_rows().cpu(), want_pool.state[live].cpu())
    u = torch.randn(len(live), 3, h, kd, generator=gen, dtype=torch.float64)
    dense = (tables.ranks == 0).cpu()
    want = ref.adaptive_read(q_ref.double(), p_ref.double(), u.unsqueeze(1))[:, 0]
    rows, maps = adaptive.rows[live].cpu().double(), adaptive.maps[live].cpu().double()
    got = ref.adaptive_read(rows.transpose(-1, -2), maps, u.unsqueeze(1))[:, 0]
    factor_tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert _rel(got[..., ~dense, :], want[..., ~dense, :]) <= factor_tol
    assert not adaptive.rows[live][:, dense].any() and not adaptive.maps[live][:, dense].any()

    # a read of T tokens after the flush, from the stored factors
    tokens = 2
    pos0 = torch.zeros(b, dtype=torch.int32, device=device)
    x = random_inputs(family, b, tokens, h, g, kd, vd, dtype=dtype, device=device, generator=gen)
    out = torch.full((b, tokens, h, vd), float("nan"), dtype=dtype, device=device)
    want_pool = pool.clone()
    dispatch.spec_verify(family, pool, slots, pos0, x, out, adaptive=adaptive)
    assert torch.isnan(out[slots < 0].float()).all(), "padding outputs must be left untouched"
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        entry_tables = replace(tables, maps=adaptive.maps[s].float())
        entry_pool = want_pool.clone()
        entry_pool.sketch[s, :, : tables.map_rows] = adaptive.rows[s]
        one = slice(i, i + 1)
        want_out = ref.spec_verify(family, entry_pool, slots[one], pos0[one], x.tokens(slice(None)).map(
            lambda t, one=one: t[one]
        ), entry_tables)  # fmt: skip
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert _rel(out[i], want_out[0]) <= tol, f"entry {i} (slot {s})"


@pytest.mark.parametrize("layout", ["dense", "paged"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_adaptive_flush_and_read_cpu(family, dtype, layout):
    run_adaptive(family, CPU_SHAPES[family], dtype, "cpu", real=False, seed=3, layout=layout)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dense", "paged"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_adaptive_flush_and_read_gpu(family, dtype, layout):
    run_adaptive(family, GPU_SHAPES[family], dtype, "cuda", real=True, seed=5, layout=layout)


def test_adaptive_sketch_refuses_factors_of_another_pool():
    h, g, kd, vd = CPU_SHAPES["gdn"]
    tables = random_sketch("gdn", [2, 0, 4, 6], g, kd, torch.Generator().manual_seed(0))
    pool = random_pool("gdn", 3, h, g, kd, vd, capacity=4, sketch_rows=tables.map_rows)
    other = random_pool("gdn", 5, h, g, kd, vd, capacity=4, sketch_rows=tables.map_rows)
    slots, pos = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"adaptive rows must be \[3, 4, 6, 32\]"):
        dispatch.flush("gdn", pool, slots, pos, adaptive=AdaptiveSketch.allocate(tables, other))


def test_adaptive_sketch_refuses_an_fp8_sketch():
    h, g, kd, vd = CPU_SHAPES["gdn"]
    tables = random_sketch("gdn", [2, 0, 4, 6], g, kd, torch.Generator().manual_seed(0))
    pool = random_pool(
        "gdn", 3, h, g, kd, vd, capacity=4, read_dtype=torch.float8_e4m3fn, sketch_rows=tables.map_rows
    )
    with pytest.raises(ValueError, match="bf16 or fp32"):
        AdaptiveSketch.allocate(tables, pool)
