"""Triton decode kernels against the float64 serving references.

On the CPU the kernels run under ``TRITON_INTERPRET=1`` at small shapes; the ``gpu`` tests run
the real model shapes. Every case poisons the outputs (NaN), addresses a permuted subset of the
pool with a padding entry, and checks that padding rows and unaddressed slots are untouched.
Tolerances (relative, ‖got − ref‖ / ‖ref‖): 1e-5 for fp32 results (the state always; outputs
and read copies in the fp32 cases), 1e-2 for bf16 outputs and read copies.
"""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from sketchcal.kernels import dispatch
from sketchcal.kernels.common import reference as ref
from sketchcal.kernels.common import triton_helpers
from sketchcal.kernels.common.pool import SketchTables, random_sketch, rank_spread
from sketchcal.kernels.common.testing import paged as as_pages
from sketchcal.kernels.common.testing import random_inputs, random_pool

FAMILIES = ["mamba2", "gdn", "kda"]
CPU_SHAPES = {  # H, G, K, V
    "mamba2": [(4, 2, 16, 16), (2, 1, 32, 16)],
    "gdn": [(4, 2, 16, 32), (2, 2, 32, 16)],
    "kda": [(4, 4, 16, 16), (2, 2, 32, 16)],
}
GPU_SHAPES = {"mamba2": (64, 8, 128, 64), "gdn": (32, 16, 128, 128), "kda": (32, 32, 128, 128)}
OPS = ["standard", "standard_vm", "replay", "sketch", "flush", "flush_sketch", "spec", "spec_sketch"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# an fp8 (e4m3) read copy and sketch, with bf16 inputs and outputs
FP8 = torch.float8_e4m3fn


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _ranks(heads: int, key_dim: int, real: bool) -> list[int]:
    """Per-head ranks of a case: one dense head and ranks that are no multiple of 4 among them."""
    if real:
        ranks = rank_spread(heads, 8, key_dim)
        ranks[1:4] = [0, 2, 6]
        return ranks
    pattern = [0, 2, 4, 6, 8, 12]  # the two CPU shapes (4 and 2 heads) cover every rank below 16
    return [pattern[(i + heads) % len(pattern)] for i in range(heads)]


def _unaddressed(slots: torch.Tensor, n_slots: int) -> list[int]:
    """The pool slots of ``range(n_slots)`` that ``slots`` does not address."""
    return [s for s in range(n_slots) if s not in slots.tolist()]


def run_case(
    family: str,
    op: str,
    shape,
    dtype_name: str,
    device,
    seed: int = 0,
    real: bool = False,
    config=None,
    fp32_tol: float = 1e-5,
    tokens: int | None = None,
    capacity: int | None = None,
    paged: bool = False,
):
    h, g, kd, vd = shape
    dtype = DTYPES.get(dtype_name, torch.bfloat16)
    read_dtype = FP8 if dtype_name == "fp8" else dtype
    gen = torch.Generator().manual_seed(seed)
    n_slots, cap = 7, capacity or (16 if real else 5)
    slots = torch.tensor([4, -1, 0, 6, 2], dtype=torch.int32, device=device)
    b = slots.numel()
    tokens = tokens or (3 if op.startswith("spec") else 1)
    sketch = op.endswith("sketch")
    tables = random_sketch(family, _ranks(h, kd, real), g, kd, gen).to(device)
    pool = random_pool(
        family,
        n_slots,
        h,
        g,
        kd,
        vd,
        capacity=cap,
        read_dtype=read_dtype,
        sketch_rows=tables.map_rows,
        input_dtype=dtype,
        device=device,
        generator=gen,
    )
    x = random_inputs(family, b, tokens, h, g, kd, vd, dtype=dtype, device=device, generator=gen)
    top = cap + 1 if op.startswith("flush") else cap - tokens + 1
    pos = torch.randint(0, top, (b,), generator=gen, dtype=torch.int32).to(device)
    out = torch.full((b, tokens, h, vd), float("nan"), dtype=dtype, device=device)
    if op == "standard_vm":  # the same values, stored value-major
        pool = replace(pool, state=pool.state.transpose(-1, -2).contiguous().transpose(-1, -2))
    if paged:  # the same values in vLLM's page layout
        pool = as_pages(pool)
    before, want_pool = pool.clone(), pool.clone()
    if pool.read is pool.state:  # an fp32 page's read copy is its checkpoint
        want_pool.read = want_pool.state
    if op.startswith("standard"):
        got = dispatch.standard_step(family, pool, slots, x, out)
        want = ref.standard_step(family, want_pool, slots, x)
    elif op in ("replay", "sketch", "spec", "spec_sketch"):
        got = dispatch.spec_verify(
            family, pool, slots, pos, x, out, tables=tables if sketch else None, config=config
        )
        want = ref.spec_verify(family, want_pool, slots, pos, x, tables if sketch else None)
    else:
        got = dispatch.flush(
            family, pool, slots, pos, x, out, tables=tables if sketch else None, config=config
        )
        want = ref.flush(family, want_pool, slots, pos, x, tables if sketch else None)
    assert got is out
    live = slots >= 0
    assert torch.isnan(out[~live].float()).all(), "padding outputs must be left untouched"
    out_tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert not torch.isnan(out[live].float()).any(), "every live output must be written"
    assert _rel(out[live], want[live]) <= out_tol
    untouched = _unaddressed(slots, n_slots)
    for name, t in pool.tensors().items():
        old = before.tensors()[name]
        assert torch.equal(t[untouched], old[untouched]), f"{name}: unaddressed slot changed"
        exp = want_pool.tensors()[name]
        tol = fp32_tol if t.dtype in (torch.float32, torch.float64) or name.startswith("buf") else 1e-2
        if name == "buf_logdecay":  # log₂ on the device and in torch may differ in the last bit
            assert torch.allclose(t.float(), exp.float(), rtol=2**-7, atol=0), f"{name} differs"
        elif name.startswith("buf"):
            assert torch.equal(t, exp), f"{name} differs from the reference"
        elif not torch.equal(t, exp):
            assert _rel(t, exp) <= tol, f"{name}: {_rel(t, exp):.2e}"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape_id", [0, 1])
@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_cpu(family, shape_id, op, dtype):
    run_case(family, op, CPU_SHAPES[family][shape_id], dtype, "cpu", seed=shape_id)


@pytest.mark.parametrize("op", ["spec", "spec_sketch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_long_verify_in_several_launches_cpu(family, op):
    """More tokens than one read launch takes (``READ_TOKENS_PER_LAUNCH``): the later launches find
    the earlier tokens in the buffer, and the outputs and buffers are the reference's."""
    tokens = 2 * dispatch.READ_TOKENS_PER_LAUNCH + 1
    run_case(family, op, CPU_SHAPES[family][1], "fp32", "cpu", seed=9, tokens=tokens, capacity=tokens + 3)


@pytest.mark.parametrize("op", ["replay", "sketch", "spec_sketch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_reads_cpu(family, op):
    """Reads from an fp8 (e4m3) read copy and sketch. The flush's fp8 stores are checked by the
    ``gpu`` tests only: the CPU interpreter rounds fp32 to fp8 wrongly next to powers of two
    (−0.49 → −0.25), the device's conversion (``cvt.rn.satfinite``) does not."""
    run_case(family, op, CPU_SHAPES[family][0], "fp8", "cpu", seed=8)


@pytest.mark.parametrize("op", ["flush", "flush_sketch"])
def test_mamba2_sweep_flush_cpu(op):
    """Mamba-2's flush token by token (the ``sweep`` form, a tuning candidate; its default is the
    chunked fold)."""
    config = dispatch.KernelConfig("sweep", 16, 1)
    run_case("mamba2", op, CPU_SHAPES["mamba2"][1], "fp32", "cpu", seed=4, config=config)


@pytest.mark.parametrize("op", ["sketch", "flush_sketch"])
def test_register_cap_cpu(op):
    """A register cap (``KernelConfig.maxnreg``, a tuning candidate) reaches the launch; the
    interpreter ignores it, the ``gpu`` tests check the capped builds at the real shapes."""
    form = "sweep" if op.startswith("flush") else "read"
    config = dispatch.KernelConfig(form, 16, 1, maxnreg=96)
    run_case("gdn", op, CPU_SHAPES["gdn"][0], "fp32", "cpu", seed=5, config=config)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("op", ["replay", "sketch", "spec_sketch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_read_sweep_cpu(family, op, group):
    """The read's sweep over the live tokens only, ``group`` per rolled iteration
    (``KernelConfig.group``): buffers of 0..capacity tokens, so groups end early, fill up and
    run past token 0."""
    config = dispatch.KernelConfig("read", 16, 1, group=group)
    run_case(family, op, CPU_SHAPES[family][1], "fp32", "cpu", seed=6 + group, config=config)


@pytest.mark.parametrize("early_map", [True, False])
@pytest.mark.parametrize("op", ["sketch", "spec_sketch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_map_rows_early_or_late_cpu(family, op, early_map):
    """The first 8 coefficient-map rows loaded before the buffer sweep or after it
    (``KernelConfig.early_map``); ranks up to 12 need a second chunk of rows either way."""
    config = dispatch.KernelConfig("read", 16, 1, early_map=early_map, dense_rows=16)
    run_case(family, op, CPU_SHAPES[family][0], "fp32", "cpu", seed=12, config=config)


@pytest.mark.parametrize("heads,dots", [(1, 1), (2, 1), (1, 2), (2, 0)])
@pytest.mark.parametrize("dtype", [*DTYPES, "fp8"])
@pytest.mark.parametrize("shape_id", [0, 1])
def test_split_sketch_read_cpu(shape_id, dtype, heads, dots):
    """Mamba-2's sketch step as two kernels (the ``split_read`` form: the group's dots, ``dots``
    key groups per program (0: in the second kernel), and coefficients, then each head's sum,
    ``heads`` heads per program), ranks 0 (dense), 4, 8 and 12 (a second chunk of rows), buffers
    of 0..capacity − 1 tokens."""
    config = dispatch.KernelConfig("split_read", 16, 1, coef_warps=1, heads=heads, dots=dots, dense_rows=8)
    shape = CPU_SHAPES["mamba2"][shape_id]
    run_case("mamba2", "sketch", shape, dtype, "cpu", seed=20 + shape_id, config=config)


@pytest.mark.parametrize("dots", [2, 0])
def test_split_sketch_read_many_entries_cpu(dots):
    """The split read over more batch entries than one coefficient tile holds (``read_split.ROWS``),
    padding among them, groups of different widths, both groups' dots in one program (or in the
    head kernel, the coefficient programs appending the keys), two programs per head (BV = V / 2),
    buffers up to full: outputs and buffers against the reference, and the slots not addressed
    untouched."""
    from sketchcal.kernels.mamba2 import read_split

    h, g, kd, vd = 8, 2, 16, 16
    gen = torch.Generator().manual_seed(25)
    tables = random_sketch("mamba2", [4, 0, 12, 8, 8, 4, 4, 0], g, kd, gen)
    n_slots, cap = read_split.ROWS + 12, 16  # buffers more than half full too
    pool = random_pool(
        "mamba2", n_slots, h, g, kd, vd, capacity=cap, sketch_rows=tables.map_rows, generator=gen
    )
    slots = torch.randperm(n_slots, generator=gen)[: read_split.ROWS + 6].to(torch.int32)
    slots[[3, read_split.ROWS + 2]] = -1
    b = slots.numel()
    x = random_inputs("mamba2", b, 1, h, g, kd, vd, generator=gen)
    pos = torch.randint(0, cap, (b,), generator=gen, dtype=torch.int32)
    out = torch.full((b, 1, h, vd), float("nan"), dtype=torch.bfloat16)
    before, want_pool = pool.clone(), pool.clone()
    config = dispatch.KernelConfig("split_read", vd // 2, 1, heads=2, dots=dots)
    dispatch.sketch_step("mamba2", pool, tables, slots, pos, x, out, config=config)
    want = ref.spec_verify("mamba2", want_pool, slots, pos, x, tables)
    live = slots >= 0
    assert torch.isnan(out[~live].float()).all()
    assert _rel(out[live], want[live]) <= 1e-2
    untouched = _unaddressed(slots, n_slots)
    for name, t in pool.tensors().items():
        assert torch.equal(t, want_pool.tensors()[name]), name
        assert torch.equal(t[untouched], before.tensors()[name][untouched]), name


@pytest.mark.parametrize("shape", [(4, 2, 16, 16), (6, 3, 16, 16)], ids=["2-heads-per-group", "3-groups"])
def test_split_heads_and_dots_clipped_to_the_groups_cpu(shape):
    """``heads`` = 4 and ``dots`` = 2 on groups they do not divide (2 heads per group; 3 groups)
    run as the largest power of two that does, and give the reference's outputs."""
    config = dispatch.KernelConfig("split_read", 16, 1, heads=4, dots=2, dense_rows=8)
    run_case("mamba2", "sketch", shape, "bf16", "cpu", seed=26, config=config)


def test_split_sketch_read_falls_back_to_one_kernel(monkeypatch):
    """Where the split read cannot run (several tokens, a pool without a workspace) the one-kernel
    read runs instead, and gives the reference's outputs."""
    from sketchcal.kernels.mamba2 import read_split

    calls = []
    monkeypatch.setattr(read_split, "launch", lambda *a, **k: calls.append(a))
    config = dispatch.KernelConfig("split_read", 16, 1)
    run_case("mamba2", "spec_sketch", CPU_SHAPES["mamba2"][0], "bf16", "cpu", seed=23, config=config)
    assert not calls
    h, g, kd, vd = CPU_SHAPES["mamba2"][0]
    gen = torch.Generator().manual_seed(24)
    tables = random_sketch("mamba2", _ranks(h, kd, False), g, kd, gen)
    pool = random_pool("mamba2", 3, h, g, kd, vd, capacity=4, sketch_rows=tables.map_rows, generator=gen)
    assert pool.workspace is not None and pool.clone().workspace is not None
    pool.workspace = None
    slots, pos = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int32)
    x = random_inputs("mamba2", 2, 1, h, g, kd, vd, generator=gen)
    want = ref.spec_verify("mamba2", pool.clone(), slots, pos, x, tables)
    got = dispatch.sketch_step("mamba2", pool, tables, slots, pos, x, config=config)
    assert not calls and _rel(got, want) <= 1e-2


def test_default_mamba2_sketch_step_is_the_split_read(monkeypatch):
    """Mamba-2's default sketch step of one token takes the split read (the default launch shape has
    the ``split_read`` form, and the pool its workspace); ``spec_verify`` keeps the one-kernel read."""
    from sketchcal.kernels.mamba2 import read_split

    calls = []
    real = read_split.launch
    monkeypatch.setattr(read_split, "launch", lambda *a, **k: calls.append(a) or real(*a, **k))
    run_case("mamba2", "sketch", CPU_SHAPES["mamba2"][0], "bf16", "cpu", seed=27)
    assert calls
    calls.clear()
    run_case("mamba2", "spec_sketch", CPU_SHAPES["mamba2"][0], "bf16", "cpu", seed=28)
    assert not calls


def test_packed_group_maps_hold_each_heads_rows():
    """``SketchTables.group_maps``: row c of group g is row r of head h's map where
    ``group_cols[g, c] = (h mod H/G) · M + r``; the other families get none."""
    h, g, kd = 8, 2, 32
    ranks = [4, 0, 12, 8, 24, 4, 0, 8]
    tables = random_sketch("mamba2", ranks, g, kd, torch.Generator().manual_seed(3))
    m_rows, per_group = tables.map_rows, h // g
    assert tables.group_width.tolist() == [24, 36]
    assert tables.group_maps.shape == (g, 36, kd)
    for gi in range(g):
        seen = 0
        for c in range(tables.group_maps.shape[1]):
            dst = int(tables.group_cols[gi, c])
            if c >= tables.group_width[gi]:
                assert dst == -1 and not tables.group_maps[gi, c].any()
                continue
            head, r = gi * per_group + dst // m_rows, dst % m_rows
            assert r < ranks[head]
            assert torch.equal(tables.group_maps[gi, c], tables.maps[head, r])
            seen += 1
        assert seen == sum(ranks[gi * per_group : (gi + 1) * per_group])
    assert random_sketch("gdn", ranks, g, kd).group_maps is None


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("family", "config"),
    [
        ("mamba2", dispatch.default_config("flush_sketch", "mamba2")),
        ("mamba2", dispatch.KernelConfig("chunk", 64, 4)),
    ],
    ids=["mamba2-gluon", "mamba2-chunked"],
)
def test_tensor_core_flush_sketches_the_bf16_state_gpu(family, config):
    """A bf16 sketch from the tensor-core flushes (Mamba-2's Gluon default, the chunked one) is
    ``flush_chunk.sketch_terms``'s: R_{:m} (two bf16 terms) times the folded state rounded to bf16.
    Against that definition, computed in float64 from the reference's folded state, only values
    at a rounding boundary differ (by their last bit); against the exact sketch (the
    reference's) every value carries the state's rounding too. Real shape, ranks 4-24 (a second
    chunk of 16 rows), 3 of 5 slots flushed with 15, 7 and 0 buffered tokens. (The CPU
    interpreter truncates to bf16 where the GPU rounds to nearest, so this holds on a GPU only.)"""
    h, g, kd, vd = GPU_SHAPES[family]
    gen = torch.Generator().manual_seed(31)
    ranks = _ranks(h, kd, True)
    tables = random_sketch(family, ranks, g, kd, gen).to("cuda")
    pool = random_pool(
        family, 5, h, g, kd, vd, capacity=16, sketch_rows=tables.map_rows, device="cuda", generator=gen
    )
    slots = torch.tensor([4, 1, 3], dtype=torch.int32, device="cuda")
    pos = torch.tensor([15, 7, 0], dtype=torch.int32, device="cuda")
    x = random_inputs(family, 3, 1, h, g, kd, vd, device="cuda", generator=gen)
    want = pool.clone()
    ref.flush(family, want, slots, pos, x, tables)
    dispatch.flush(family, pool, slots, pos, x, torch.empty_like(x.w), tables=tables, config=config)
    got, exact, defined = [], [], []
    for s in slots.long().tolist():
        for head, m in enumerate(ranks):
            if m:
                frame = tables.frames[head // (h // g), :m].double()
                state = want.state[s, head].to(torch.bfloat16).double()
                defined.append((frame @ state).to(torch.bfloat16).double())
                got.append(pool.sketch[s, head, :m].double())
                exact.append(want.sketch[s, head, :m].double())
    got, exact, defined = torch.cat(got), torch.cat(exact), torch.cat(defined)
    assert _rel(got, defined) <= 5e-4 < 1e-3 <= _rel(got, exact) <= 4e-3


@pytest.mark.parametrize("kd", [32, 40])
def test_frame_terms_sum_to_the_frames(kd):
    """``SketchTables.frame_terms`` [G, ⌈K/16⌉, 3, 16, K]: chunk c's three bf16 terms of row r sum
    to row 16c + r of the group's frame in float64 (exact: each term is the rounding of what
    the ones before it leave), each smaller than the one before; rows past K are zero."""
    tables = random_sketch("mamba2", [4, 8, 0, 12], 2, kd, torch.Generator().manual_seed(4))
    terms = tables.frame_terms
    chunks = -(-kd // 16)
    assert terms.shape == (2, chunks, 3, 16, kd) and terms.dtype == torch.bfloat16
    rows = terms.double().sum(2).reshape(2, chunks * 16, kd)
    assert torch.equal(rows[:, :kd], tables.frames.double())
    assert not rows[:, kd:].any()
    big, mid, small = terms.double().abs().unbind(2)
    assert (mid <= big * 2**-7).all() and (small <= mid * 2**-7).all()
    assert random_sketch("gdn", [4, 8], 1, kd).frame_terms is None


@pytest.mark.parametrize("rows", [0, 8])
@pytest.mark.parametrize("op", ["replay", "sketch", "spec_sketch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_dense_read_by_rows_cpu(family, op, rows):
    """A dense head's read copy read ``dense_rows`` rows at a time (each block's share of the
    query gathered from registers) or whole: several blocks per head at K = 32."""
    config = dispatch.KernelConfig("read", 16, 1, dense_rows=rows)
    run_case(family, op, CPU_SHAPES[family][1], "fp32", "cpu", seed=9, config=config)


@pytest.mark.parametrize("op", ["flush", "flush_sketch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_narrow_sweep_flush_cpu(family, op):
    """The token-by-token flush on tiles of 8 value columns (fewer registers; the chunked form
    needs 16 for its dots)."""
    config = dispatch.KernelConfig("sweep", 8, 1, vec=2)
    run_case(family, op, CPU_SHAPES[family][1], "fp32", "cpu", seed=10, config=config)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("block_v", "warps"), [(16, 1), (32, 2)])
@pytest.mark.parametrize("op", ["flush", "flush_sketch"])
def test_chunked_flush_cpu(op, block_v, warps, dtype):
    """Mamba-2's tensor-core flush on Sᵀ tiles: bf16 keys (the fp32 operand split into three bf16
    terms) and fp32 keys (3xTF32), one or two value tiles per head at V = 32. The fp32 results are
    held to 1e-6, ten times tighter than elsewhere: both flush forms land near 1e-7, and a split
    that dropped its third bf16 term (~16 bits) would still pass 1e-5."""
    config = dispatch.KernelConfig("chunk", block_v, warps)
    run_case("mamba2", op, CPU_SHAPES["mamba2"][0], dtype, "cpu", seed=13, config=config, fp32_tol=1e-6)


@pytest.mark.parametrize(
    ("family", "form", "vec"),
    [(f, "sweep", v) for f in FAMILIES for v in (0, 2)] + [("mamba2", "chunk", 0)],
)
def test_flush_tiny_and_zero_decays_cpu(family, form, vec):
    """The token-by-token flush keeps the window's decay product apart from the tile (a scale
    folded in when it gets tiny); Mamba-2's chunked one builds running products of decays. Decays whose
    product underflows (1e-30 twice) and an exact zero decay (the state before it forgotten) must
    still give the float64 reference."""
    h, g, kd, vd = CPU_SHAPES[family][1]
    gen = torch.Generator().manual_seed(11)
    pool = random_pool(family, 4, h, g, kd, vd, capacity=6, input_dtype=torch.float32, generator=gen)
    pool.buf_decay[0, :, 1:3] = 1e-30
    pool.buf_decay[1, :, 2] = 0.0
    pool.buf_decay[2, 0, 4] = 1e-25  # one head only
    slots = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    pos = torch.tensor([6, 5, 6, 0], dtype=torch.int32)
    got, want = pool.clone(), pool.clone()
    config = dispatch.KernelConfig(form, 16, 1, vec=vec)
    dispatch.flush(family, got, slots, pos, config=config)
    ref.flush(family, want, slots, pos)
    assert torch.isfinite(got.state).all()
    assert _rel(got.state, want.state) <= 1e-5
    for s in range(3):
        assert _rel(got.state[s], want.state[s]) <= 1e-5


def test_bf16_read_copy_is_close_to_exact():
    """A bf16 read copy costs at most bf16 accuracy against the exact fp32 checkpoint."""
    family, (h, g, kd, vd) = "gdn", CPU_SHAPES["gdn"][0]
    gen = torch.Generator().manual_seed(5)
    pool = random_pool(
        family,
        3,
        h,
        g,
        kd,
        vd,
        capacity=4,
        read_dtype=torch.bfloat16,
        input_dtype=torch.float32,
        generator=gen,
    )
    slots, pos = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 2, 3], dtype=torch.int32)
    x = random_inputs(family, 3, 1, h, g, kd, vd, dtype=torch.float32, generator=gen)
    got = dispatch.replay_step(family, pool.clone(), slots, pos, x)
    exact = pool.clone()
    exact.read = exact.state.clone()
    want = ref.replay_step(family, exact, slots, pos, x)
    assert _rel(got, want) <= 1e-2


def _kda_window_pool(gen, read_dtype=torch.bfloat16):
    h, g, kd, vd = CPU_SHAPES["kda"][0]
    pool = random_pool(
        "kda", 3, h, g, kd, vd, capacity=8, read_dtype=read_dtype, input_dtype=torch.float32, generator=gen
    )
    x = random_inputs("kda", 3, 1, h, g, kd, vd, dtype=torch.float32, generator=gen)
    slots, pos = torch.tensor([2, 0, 1], dtype=torch.int32), torch.tensor([8, 5, 0], dtype=torch.int32)
    return pool, x, slots, pos


def test_kda_reads_take_log2_decays_and_the_flush_fp32_ones():
    """With a bf16 read copy a KDA pool keeps log₂ of its buffered decays in bf16: the reads take
    them, the flush folds the fp32 decays. Each plane is spoiled in turn where the other should be
    used: the results must not move."""
    pool, x, slots, pos = _kda_window_pool(torch.Generator().manual_seed(21))
    assert pool.buf_logdecay is not None and pool.buf_logdecay.dtype == torch.bfloat16
    spoilt = pool.clone()
    spoilt.buf_decay.mul_(0.5)
    got = dispatch.replay_step("kda", spoilt, slots, pos[[1, 1, 2]], x)
    want = ref.replay_step("kda", pool.clone(), slots, pos[[1, 1, 2]], x)
    assert _rel(got, want) <= 1e-2
    spoilt = pool.clone()
    spoilt.buf_logdecay.fill_(-1.0)
    dispatch.flush("kda", spoilt, slots, pos)
    want = pool.clone()
    ref.flush("kda", want, slots, pos)
    assert _rel(spoilt.state, want.state) <= 1e-5


def test_kda_log2_decays_cost_a_read_less_than_bf16():
    """The float64 reference read through the bf16 log₂ decays against the exact fp32 decays, over
    a full buffer of decays near 1 (where bf16 decays themselves would be off by up to 2⁻⁹ per
    token): within 1e-4, far below a bf16 read copy's own rounding."""
    gen = torch.Generator().manual_seed(22)
    pool, x, slots, pos = _kda_window_pool(gen)
    pool.buf_decay.copy_(1.0 - 0.02 * torch.rand(pool.buf_decay.shape, generator=gen))
    pool.buf_logdecay.copy_(pool.buf_decay.log2())
    pool.read = pool.state.clone()  # exact checkpoint: only the decays differ
    exact = pool.clone()
    exact.buf_logdecay = None
    got = ref.replay_step("kda", pool, slots, pos, x)
    want = ref.replay_step("kda", exact, slots, pos, x)
    rounded = exact.clone()
    rounded.buf_decay = rounded.buf_decay.bfloat16().float()
    assert _rel(got, want) <= 1e-4 < _rel(ref.replay_step("kda", rounded, slots, pos, x), want)


def test_exact_replay_pool_has_no_log2_decays():
    """An fp32 read copy (exact replay) reads the fp32 decays: no log₂ plane is allocated."""
    pool, *_ = _kda_window_pool(torch.Generator().manual_seed(23), read_dtype=torch.float32)
    assert pool.buf_logdecay is None


@pytest.mark.parametrize("field", ["maps", "frames"])
def test_low_precision_tables_are_refused(field):
    tables = random_sketch("gdn", [0, 4], 1, 16, torch.Generator().manual_seed(0))
    parts = dict(ranks=tables.ranks, maps=tables.maps, frames=tables.frames, read_rows=tables.read_rows)
    parts[field] = parts[field].to(torch.bfloat16)
    with pytest.raises(ValueError, match=field):
        SketchTables("gdn", **parts)


def test_partial_read_rows_are_refused():
    tables = random_sketch("gdn", [0, 4], 1, 16, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="read_rows"):
        SketchTables("gdn", tables.ranks, tables.maps, tables.frames, torch.tensor([8, 0], dtype=torch.int32))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(dense_rows=12), "dense_rows"),
        (dict(block_v=48), "block_v"),
        (dict(num_warps=0), "num_warps"),
        (dict(group=-1), "group"),
        (dict(form="bogus"), "form"),
        (dict(form="gluon_sweep"), "per_sm"),
        (dict(coef_warps=0), "coef_warps"),
    ],
)
def test_bad_launch_shapes_are_refused(kwargs, field):
    args = dict(form="read", block_v=64, num_warps=1) | kwargs
    with pytest.raises(ValueError, match=field):
        dispatch.KernelConfig(**args)


@pytest.mark.parametrize(
    ("family", "op", "form"),
    [("gdn", "flush", "chunk"), ("kda", "sketch", "split_read"), ("gdn", "replay", "sweep")],
)
def test_a_form_that_does_not_serve_the_kernel_is_refused(family, op, form):
    """A config naming a kernel of another op or another family is one clear error, not a launch."""
    with pytest.raises(ValueError, match="does not run"):
        run_case(family, op, CPU_SHAPES[family][0], "fp32", "cpu", config=dispatch.KernelConfig(form, 16, 1))


def test_bad_inputs_raise():
    family, (h, g, kd, vd) = "kda", CPU_SHAPES["kda"][0]
    pool = random_pool(family, 2, h, g, kd, vd)
    x = random_inputs(family, 2, 1, h, g, kd, vd)
    x.decay = x.decay[..., 0].contiguous()
    with pytest.raises(ValueError, match="decay"):
        dispatch.standard_step(family, pool, torch.tensor([0, 1], dtype=torch.int32), x)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", ["replay", "sketch", "flush", "flush_sketch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_paged_pool_cpu(family, op, dtype):
    """vLLM's pages: every tensor's slot parts a page apart, the checkpoint value-major (and the
    read copy when it is fp32); the default kernels hand over to the read and the sweep."""
    run_case(family, op, CPU_SHAPES[family][0], dtype, "cpu", paged=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", ["replay", "sketch", "flush", "flush_sketch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_paged_pool_gpu(family, op, dtype):
    run_case(family, op, GPU_SHAPES[family], dtype, "cuda", real=True, paged=True)


def test_paged_pools_take_the_forms_that_take_slot_strides():
    tables = random_sketch("mamba2", [4, 4, 8, 8], 2, 16)
    dense = random_pool("mamba2", 3, 4, 2, 16, 16, capacity=4, sketch_rows=tables.map_rows)
    pool = as_pages(dense)
    for kernel in ("replay", "sketch", "flush_replay", "flush_sketch"):
        cfg = dispatch.default_config(kernel, "mamba2")
        assert dispatch.runnable(cfg, "mamba2", pool, tables, 1).form in dispatch.PAGED_FORMS
    split = dispatch.default_config("sketch", "mamba2")
    assert dispatch.runnable(split, "mamba2", dense, tables, 1) == split  # a dense pool: the table's


def test_a_pool_with_strided_slot_parts_is_refused():
    pool = random_pool("gdn", 3, 2, 2, 16, 16, capacity=4)
    pool = replace(pool, buf_w=pool.buf_w.transpose(2, 3).contiguous().transpose(2, 3))
    x = random_inputs("gdn", 1, 1, 2, 2, 16, 16)
    zero = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"pool\.buf_w: each slot's part must be contiguous"):
        dispatch.replay_step("gdn", pool, zero, zero, x)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("op", "dtype"),
    [(op, dt) for op in OPS for dt in (*DTYPES, "fp8") if not (op.startswith("spec") and dt != "fp32")],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_gpu(family, op, dtype):
    run_case(family, op, GPU_SHAPES[family], dtype, "cuda", seed=7, real=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", ["flush", "flush_sketch"])
@pytest.mark.parametrize("shape", [(16, 1), (64, 4)])
def test_chunked_flush_gpu(shape, op, dtype):
    """Mamba-2's tensor-core flush (its Gluon flush's fallback) at the real shape: one-warp
    16-column tiles and 4-warp 64-column tiles, held to 1e-6 like on the CPU."""
    config = dispatch.KernelConfig("chunk", *shape)
    run_case(
        "mamba2", op, GPU_SHAPES["mamba2"], dtype, "cuda", seed=17, real=True, config=config, fp32_tol=1e-6
    )


def _split_shapes() -> list[dispatch.KernelConfig]:
    from sketchcal.kernels.bench import SPLIT_SHAPES

    return SPLIT_SHAPES


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [*DTYPES, "fp8"])
@pytest.mark.parametrize("config", _split_shapes(), ids=str)
def test_split_sketch_read_gpu(config, dtype):
    """The split Mamba-2 sketch read at the real shape (a dense head, ranks 4-24, 0-15 tokens),
    in each shape ``bench.SPLIT_SHAPES`` lists."""
    run_case("mamba2", "sketch", GPU_SHAPES["mamba2"], dtype, "cuda", seed=21, real=True, config=config)


def test_pipelined_flush_needs_gluon(monkeypatch):
    """Where Triton has no Gluon, a CUDA pool's Mamba-2 flush takes the chunked kernel."""
    bf16 = SimpleNamespace(dtype=torch.bfloat16)
    cuda_pool = SimpleNamespace(state=SimpleNamespace(is_cuda=True), buf_k=bf16, buf_w=bf16)
    config = dispatch.KernelConfig("gluon_chunk", 64, 4, per_sm=3)
    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(dispatch, "is_dense", lambda pool: True)  # the stand-in is a dense pool
    assert dispatch.gluon_available()  # this Triton has it: the CUDA pool would take the Gluon kernel
    assert dispatch.gluon_flush_runs(config, "mamba2", cuda_pool)
    assert not dispatch.gluon_flush_runs(config, "gdn", cuda_pool)
    assert not dispatch.gluon_flush_runs(replace(config, form="chunk"), "mamba2", cuda_pool)
    assert dispatch.runnable(config, "mamba2", cuda_pool, None, 1) == config
    monkeypatch.setattr(dispatch, "gluon_available", lambda: False)
    assert not dispatch.gluon_flush_runs(config, "mamba2", cuda_pool)
    assert dispatch.runnable(config, "mamba2", cuda_pool, None, 1) == replace(config, form="chunk")


def test_persistent_grid_is_programs_per_sm_at_most_one_per_item(monkeypatch):
    from sketchcal.kernels.common import gluon_helpers

    monkeypatch.setattr(gluon_helpers, "_sm_count", lambda index: 132)
    dev = torch.device("cuda", 0)
    assert gluon_helpers.persistent_grid(8192, 1, dev) == (132,)
    assert gluon_helpers.persistent_grid(8192, 3, dev) == (396,)
    assert gluon_helpers.persistent_grid(200, 3, dev) == (200,)
    assert gluon_helpers.persistent_grid(0, 3, dev) == (1,)


def test_gluon_flush_launchers_pass_the_grid_and_shape(monkeypatch):
    """The persistent launcher and both Gluon flushes' launchers (host code, which the ``gpu``
    tests otherwise cover alone): the kernel runs on the persistent grid with the flush arguments,
    the frame terms, the item count and the shape constants, against stand-ins that record the
    launch."""
    from sketchcal.kernels.common import gluon_helpers
    from sketchcal.kernels.common.flush import flush_arguments
    from sketchcal.kernels.kda import flush_sweep
    from sketchcal.kernels.mamba2 import flush_pipelined

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))

    monkeypatch.setattr(gluon_helpers, "_sm_count", lambda index: 132)
    args = (SimpleNamespace(device=torch.device("cuda", 0)), "slots")
    flags = dict(HAS_X=True, HAS_SKIP=False, HAS_READ=True, ROWS=True, SKETCH_OUT=True, SKETCH_TERMS=1)
    shape = dict(H=64, G=8, K=128, V=64, C=16, BC=16)
    gluon_helpers.launch_persistent(
        Recorder(), args, "terms", batch=256, per_sm=3, num_warps=4, maxnreg=168, **shape, **flags
    )
    gluon_helpers.launch_persistent(Recorder(), args, "terms", batch=2, per_sm=1, num_warps=8, parts=2, H=32)
    (grid_m, args_m, kw_m), (grid_k, args_k, kw_k) = launches
    assert grid_m == (396,) and args_m == (*args, "terms", 256 * 64)
    assert kw_m == dict(**shape, **flags, num_warps=4, maxnreg=168)
    assert grid_k == (128,) and args_k == (*args, "terms", 2 * 32 * 2) and kw_k == dict(H=32, num_warps=8)

    # the modules' launchers, on a CPU pool: what they hand to launch_persistent
    calls = []
    for module in (gluon_helpers, flush_sweep):  # (Mamba-2's calls it through gluon_helpers)
        monkeypatch.setattr(module, "launch_persistent", lambda kernel, *a, **k: calls.append((kernel, a, k)))
    gen = torch.Generator().manual_seed(0)
    for family, (h, g, kd, vd), config in (
        ("mamba2", (8, 2, 32, 16), dispatch.KernelConfig("gluon_chunk", 64, 4, maxnreg=168, per_sm=3)),
        ("kda", (4, 4, 32, 64), dispatch.KernelConfig("gluon_sweep", 32, 2, per_sm=2)),
    ):
        tables = random_sketch(family, [4, 0, 8, 12] * (h // 4), g, kd, gen)
        pool = random_pool(family, 3, h, g, kd, vd, capacity=16, sketch_rows=tables.map_rows, generator=gen)
        slots, pos = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([5, 16], dtype=torch.int32)
        module = flush_pipelined if family == "mamba2" else flush_sweep
        module.launch(family, pool, tables, slots, pos, None, None, config)
        kernel, (fargs, terms), kw = calls.pop()
        want_args = flush_arguments(pool, tables, slots, pos, None, None)
        assert all(a is b or a == b for a, b in zip(fargs, want_args, strict=True))
        flags = dict(HAS_X=False, HAS_SKIP=False, HAS_READ=True, ROWS=True, SKETCH_OUT=True)
        launch = dict(batch=2, per_sm=config.per_sm, num_warps=config.num_warps, maxnreg=config.maxnreg)
        if family == "mamba2":
            assert kernel is flush_pipelined._flush_pipelined_kernel and terms is tables.frame_terms
            assert kw == dict(H=h, G=g, K=kd, V=vd, C=16, BC=16, **flags, SKETCH_TERMS=1, **launch)
        else:  # two work items of 32 value columns per head; 16 frame rows fit two programs per SM
            assert kernel is flush_sweep._flush_kda_sweep_kernel and terms is pool.buf_decay
            assert kw == dict(H=h, K=kd, V=vd, C=16, **flags, VB=32, BC=16, MR=16, parts=2, **launch)


def test_kda_gluon_flush_takes_the_pools_its_layouts_cover(monkeypatch):
    """KDA's Gluon sweep takes 16 or 8 value columns per warp (a head in V / block_v work items), K
    a multiple of 32, one head per group and at most 16 buffered tokens; other pools take Triton's
    sweep (``SWEEP_FALLBACK``)."""
    monkeypatch.setattr(dispatch, "interpreting", lambda: False)
    monkeypatch.setattr(dispatch, "is_dense", lambda pool: True)  # the stand-ins are dense pools

    def pool(h=32, g=32, kd=128, vd=128, cap=16):
        bf16 = SimpleNamespace(dtype=torch.bfloat16, shape=(1, g, cap, kd))
        return SimpleNamespace(
            state=SimpleNamespace(is_cuda=True, shape=(1, h, kd, vd)),
            buf_k=bf16,
            buf_w=SimpleNamespace(dtype=torch.bfloat16),
            capacity=cap,
        )

    def cfg(block_v, warps, per_sm, **kw):
        return dispatch.KernelConfig("gluon_sweep", block_v, warps, per_sm=per_sm, **kw)

    runs = dispatch.gluon_flush_runs
    sweep8, sweep4 = cfg(128, 8, 1), cfg(64, 4, 2)
    assert runs(sweep8, "kda", pool()) and runs(sweep4, "kda", pool(vd=64))
    assert runs(sweep4, "kda", pool())  # two items per head
    assert not runs(sweep4, "kda", pool(vd=96))  # not a whole number of items
    assert runs(sweep8, "kda", pool(vd=64))  # block_v clipped to V: 8 columns per warp
    assert runs(cfg(32, 4, 4), "kda", pool())  # 8 per warp
    assert not runs(cfg(16, 4, 4), "kda", pool())  # 4 per warp
    assert not runs(cfg(64, 16, 1), "kda", pool(vd=256))
    assert not runs(sweep8, "kda", pool(kd=48))
    assert not runs(sweep8, "kda", pool(cap=17))
    assert not runs(sweep8, "kda", pool(g=16))
    assert not runs(sweep8, "gdn", pool())
    assert dispatch.runnable(sweep8, "kda", pool(cap=17), None, 1) == dispatch.SWEEP_FALLBACK
    assert dispatch.runnable(sweep8, "kda", pool(), None, 1) == sweep8


@pytest.mark.parametrize(("family", "form"), [("mamba2", "gluon_chunk"), ("kda", "gluon_sweep")])
@pytest.mark.parametrize("op", ["flush", "flush_sketch"])
def test_pipelined_flush_falls_back_on_the_cpu(family, form, op):
    """The Gluon flushes cannot run in the interpreter: asked for, the flush takes the Triton
    fallback (Mamba-2's chunked flush, KDA's sweep), which matches the reference."""
    config = dispatch.KernelConfig(form, 16, 1, per_sm=2)
    h, g, kd, vd = CPU_SHAPES[family][0]
    pool = random_pool(family, 1, h, g, kd, vd, capacity=4)
    assert not dispatch.gluon_flush_runs(config, family, pool)
    assert dispatch.runnable(config, family, pool, None, 1).form == (
        "chunk" if family == "mamba2" else "sweep"
    )
    run_case(family, op, CPU_SHAPES[family][0], "bf16", "cpu", seed=3, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [*DTYPES, "fp8"])
@pytest.mark.parametrize("op", ["flush", "flush_sketch"])
@pytest.mark.parametrize("shape", [(1, 0), (2, 0), (2, 168), (3, 0)])
def test_pipelined_flush_gpu(shape, op, dtype):
    """Mamba-2's persistent Gluon flush at the real shape, 1-3 programs per SM (a program walks
    several heads, so the copy ring wraps), with and without a register cap, held to 1e-6 like the
    chunked flush. fp32 inputs take the chunked kernel instead (checked here too)."""
    per_sm, cap = shape
    config = dispatch.KernelConfig("gluon_chunk", 64, 4, per_sm=per_sm, maxnreg=cap)
    h, g, kd, vd = GPU_SHAPES["mamba2"]
    inputs = DTYPES.get(dtype, torch.bfloat16)
    probe = random_pool("mamba2", 1, h, g, kd, vd, capacity=16, input_dtype=inputs, device="cuda")
    assert dispatch.gluon_flush_runs(config, "mamba2", probe) == (dtype != "fp32")
    run_case(
        "mamba2", op, GPU_SHAPES["mamba2"], dtype, "cuda", seed=19, real=True, config=config, fp32_tol=1e-6
    )


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["flush", "flush_sketch"])
def test_pipelined_flush_many_heads_per_program_gpu(op):
    """A batch of 64 on one program per SM: each program folds about 30 heads through its copy
    ring, against the float64 reference."""
    _many_heads_per_program("mamba2", op, 16, dispatch.KernelConfig("gluon_chunk", 64, 4, per_sm=1))


def _many_heads_per_program(family, op, capacity, config, cyclic=False, ranks=None):
    """A batch of 64 entries (one padding) of an 80-slot pool at the real shape, flushed with
    ``config`` (which must run its Gluon kernel) against the float64 reference: states to 1e-6,
    read copies, sketches and outputs to bf16 tolerance; padding outputs and unaddressed slots
    untouched. Buffered tokens: random up to ``capacity``, or every length in turn (``cyclic``).
    ``ranks``: the heads' ranks (default: the benchmark's spread, one head dense)."""
    h, g, kd, vd = GPU_SHAPES[family]
    gen = torch.Generator().manual_seed(23)
    tables = random_sketch(family, ranks or _ranks(h, kd, True), g, kd, gen).to("cuda")
    sketch = op.endswith("sketch")
    pool = random_pool(
        family, 80, h, g, kd, vd, capacity=capacity, sketch_rows=tables.map_rows, device="cuda", generator=gen
    )
    assert dispatch.gluon_flush_runs(config, family, pool)
    slots = torch.randperm(80, generator=gen)[:64].to(torch.int32).cuda()
    slots[5] = -1
    if cyclic:
        pos = (torch.arange(64, dtype=torch.int32) % (capacity + 1)).cuda()
    else:
        pos = torch.randint(0, capacity + 1, (64,), generator=gen, dtype=torch.int32).cuda()
    x = random_inputs(family, 64, 1, h, g, kd, vd, device="cuda", generator=gen)
    got, out = _clone(pool), torch.full_like(x.w, float("nan"))
    dispatch.flush(family, got, slots, pos, x, out, tables=tables if sketch else None, config=config)
    want = _clone(pool)
    o_want = ref.flush(family, want, slots, pos, x, tables if sketch else None)
    live = slots >= 0
    assert _rel(out[live], o_want[live]) <= 1e-2 and torch.isnan(out[~live].float()).all()
    for f in ("state", "read", "sketch"):
        a, b = getattr(got, f), getattr(want, f)
        if a is not None:
            tol = 1e-6 if a.dtype == torch.float32 else 1e-2
            assert _rel(a, b) <= tol, f
    untouched = _unaddressed(slots, 80)
    assert torch.equal(got.state[untouched], pool.state[untouched])


# KDA's persistent sweep with deferred decays (sketchcal/kernels/kda/flush_sweep.py), work items of block_v
# value columns: 16 per warp at 8 warps (a head per item), one program per SM; at 4 warps (half a
# head), two or three programs per SM; at 2 warps (a quarter), four. 8 per warp: half a head on 8
# warps, a quarter on 4, four programs per SM
KDA_SWEEP = [
    dispatch.KernelConfig("gluon_sweep", 128, 8, per_sm=1),
    dispatch.KernelConfig("gluon_sweep", 64, 4, per_sm=2),
    dispatch.KernelConfig("gluon_sweep", 64, 4, maxnreg=168, per_sm=3),
    dispatch.KernelConfig("gluon_sweep", 32, 2, per_sm=4),
    dispatch.KernelConfig("gluon_sweep", 64, 8, maxnreg=128, per_sm=2),
    dispatch.KernelConfig("gluon_sweep", 32, 4, maxnreg=128, per_sm=4),
]
SWEEP_IDS = ["sweep", "sweep_half", "sweep_half3", "sweep_quarter", "sweep_half_cw8", "sweep_quarter_cw8"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [*DTYPES, "fp8"])
@pytest.mark.parametrize("op", ["flush", "flush_sketch"])
@pytest.mark.parametrize("config", KDA_SWEEP, ids=SWEEP_IDS)
def test_pipelined_kda_flush_gpu(config, op, dtype):
    """KDA's persistent Gluon sweep with deferred decays at the real shape, held to 1e-6 like
    Mamba-2's. fp32 inputs take Triton's sweep instead (checked here too)."""
    h, g, kd, vd = GPU_SHAPES["kda"]
    inputs = DTYPES.get(dtype, torch.bfloat16)
    probe = random_pool("kda", 1, h, g, kd, vd, capacity=16, input_dtype=inputs, device="cuda")
    assert dispatch.gluon_flush_runs(config, "kda", probe) == (dtype != "fp32")
    run_case("kda", op, GPU_SHAPES["kda"], dtype, "cuda", seed=19, real=True, config=config, fp32_tol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("config", KDA_SWEEP, ids=SWEEP_IDS)
def test_pipelined_kda_flush_tiny_and_zero_decays_gpu(config):
    """The deferred-decay sweep falls back to the direct sweep for a head whose running products
    leave [2⁻⁶⁴, 2⁶⁴]: decays whose product underflows, an exact zero decay, and one head's tiny
    decay must still give the reference. Slot 4's decays (0.1 throughout: products down to
    1e-16 ≈ 2⁻⁵³) stay on the scaled path, whose reciprocals then reach 2⁵³."""
    h, g, kd, vd = GPU_SHAPES["kda"]
    gen = torch.Generator().manual_seed(11)
    pool = random_pool("kda", 5, h, g, kd, vd, capacity=16, device="cuda", generator=gen)
    assert dispatch.gluon_flush_runs(config, "kda", pool)
    pool.buf_decay[0, :, 1:3] = 1e-30
    pool.buf_decay[1, :, 2] = 0.0
    pool.buf_decay[2, 0, 4] = 1e-25
    pool.buf_decay[3, :, 5, ::2] = 1e-38  # half the channels only
    pool.buf_decay[4] = 0.1
    slots = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32, device="cuda")
    pos = torch.tensor([16, 15, 16, 9, 16], dtype=torch.int32, device="cuda")
    got, want = pool.clone(), pool.clone()
    dispatch.flush("kda", got, slots, pos, config=config)
    ref.flush("kda", want, slots, pos)
    assert torch.isfinite(got.state).all()
    for s in range(5):
        assert _rel(got.state[s], want.state[s]) <= 1e-6, s


@pytest.mark.gpu
@pytest.mark.parametrize("config", KDA_SWEEP, ids=SWEEP_IDS)
def test_kda_sweep_flush_new_token_tiny_decays_gpu(config):
    """The deferred-decay sweep multiplies the flush's new token's decay into the window's final scale:
    a tiny one after a window of 0.1s (products down to 1e-46, below fp32's normals), an exact zero
    on one channel, and a small one after a window of 0.5s must still give the reference, states and
    outputs; a slot with no buffered token too."""
    h, g, kd, vd = GPU_SHAPES["kda"]
    gen = torch.Generator().manual_seed(13)
    pool = random_pool("kda", 4, h, g, kd, vd, capacity=16, device="cuda", generator=gen)
    assert dispatch.gluon_flush_runs(config, "kda", pool)
    x = random_inputs("kda", 4, 1, h, g, kd, vd, device="cuda", generator=gen)
    pool.buf_decay[0] = 0.1
    x.decay[0] = 1e-30
    x.decay[1, ..., 3] = 0.0
    pool.buf_decay[2] = 0.5
    x.decay[2] = 1e-3
    slots = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device="cuda")
    pos = torch.tensor([16, 12, 16, 0], dtype=torch.int32, device="cuda")
    got, want = pool.clone(), pool.clone()
    out = torch.full_like(x.w, float("nan"))
    dispatch.flush("kda", got, slots, pos, x, out, config=config)
    o_want = ref.flush("kda", want, slots, pos, x)
    assert torch.isfinite(got.state).all()
    for s in range(4):
        assert _rel(got.state[s], want.state[s]) <= 1e-6, s
        assert _rel(out[s].float(), o_want[s].float()) <= 1e-2, s


@pytest.mark.gpu
@pytest.mark.parametrize("config", KDA_SWEEP, ids=SWEEP_IDS)
@pytest.mark.parametrize("capacity", [16, 11])
@pytest.mark.parametrize("op", ["flush", "flush_sketch"])
def test_kda_sweep_flush_many_heads_per_program_gpu(op, capacity, config):
    """The persistent deferred-decay sweep (about 16 work items per program) against the float64
    reference, buffers of every length up to the capacity (a full window, or a shorter one)."""
    _many_heads_per_program("kda", op, capacity, config, cyclic=True)


@pytest.mark.gpu
@pytest.mark.parametrize("config", KDA_SWEEP, ids=SWEEP_IDS)
def test_kda_sweep_flush_odd_ranks_gpu(config):
    """The sweep flush copies a head's frame rows into shared memory 8 or 16 at a time: ranks up to
    the largest supported (64: eight rounds of 8), ranks that are no multiple of that count (2, 6,
    12, 24, 48), and dense heads, against the float64 reference."""
    h = GPU_SHAPES["kda"][0]
    ranks = [[4, 12, 0, 48, 64, 24, 8, 16, 32, 2, 6][i % 11] for i in range(h)]
    _many_heads_per_program("kda", "flush_sketch", 16, config, cyclic=True, ranks=ranks)


def _candidates() -> list[tuple[str, str, dispatch.KernelConfig]]:
    from sketchcal.kernels.bench import TUNE_CANDIDATES

    cases = []
    for family in FAMILIES:
        for op, group in (("sketch", "sketch"), ("flush_sketch", "flush")):
            cases += [(family, op, cand) for cand in TUNE_CANDIDATES[group][family]]
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize(("family", "op", "cand"), _candidates())
def test_tuning_candidates_gpu(family, op, cand):
    """Every launch shape the benchmark may pick (and make a default) is right at the real shape."""
    config = replace(cand, block_v=min(cand.block_v, GPU_SHAPES[family][3]))
    run_case(family, op, GPU_SHAPES[family], "bf16", "cuda", seed=11, real=True, config=config)


POOL_TENSORS = ("state", "read", "sketch", "buf_k", "buf_w", "buf_decay", "buf_beta", "buf_logdecay")


def _clone(pool):
    tensors = {f: getattr(pool, f) for f in POOL_TENSORS}
    return replace(pool, **{f: t.clone() for f, t in tensors.items() if t is not None})


def _window(family, pool, tables, slots, xs, outs) -> None:
    """One SketchSSM window: len(xs) − 1 sketch steps, then the flush with the last token."""
    n = len(xs) - 1
    b = slots.numel()
    for t in range(n):
        pos = torch.full((b,), t, dtype=torch.int32, device=slots.device)
        dispatch.sketch_step(family, pool, tables, slots, pos, xs[t], outs[t])
    pos = torch.full((b,), n, dtype=torch.int32, device=slots.device)
    dispatch.flush(family, pool, slots, pos, xs[n], outs[n], tables=tables)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_window_in_cuda_graph_with_dependent_launch_gpu(family, monkeypatch):
    """A whole window (15 sketch steps and the flush) captured in a CUDA graph with programmatic
    dependent launch (each kernel's programs may start while the previous kernel runs) leaves the
    pool and the outputs bit for bit as plain launches do: every kernel waits for its
    predecessor before its first load."""
    h, g, kd, vd = GPU_SHAPES[family]
    gen = torch.Generator().manual_seed(5)
    tables = random_sketch(family, _ranks(h, kd, True), g, kd, gen).to("cuda")
    batch, cap = 256, 16
    pool = random_pool(
        family, batch, h, g, kd, vd, capacity=cap, sketch_rows=tables.map_rows, device="cuda", generator=gen
    )
    slots = torch.randperm(batch, generator=gen).to(torch.int32).cuda()
    slots[3] = -1
    xs = [random_inputs(family, batch, 1, h, g, kd, vd, device="cuda", generator=gen) for _ in range(cap)]
    runs = {}
    for pdl in (False, True):
        monkeypatch.setattr(triton_helpers, "USE_PDL", pdl)
        p, outs = _clone(pool), [torch.full_like(x.w, float("nan")) for x in xs]
        if pdl:
            _window(family, _clone(pool), tables, slots, xs, [o.clone() for o in outs])  # compile first
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                _window(family, p, tables, slots, xs, outs)
            graph.replay()
        else:
            _window(family, p, tables, slots, xs, outs)
        torch.cuda.synchronize()
        runs[pdl] = (p, outs)
    (plain, o_plain), (dep, o_dep) = runs[False], runs[True]
    for f in POOL_TENSORS:
        if getattr(plain, f) is not None:
            assert torch.equal(getattr(plain, f), getattr(dep, f)), f
    live = slots >= 0
    for t, (a, b) in enumerate(zip(o_plain, o_dep, strict=True)):
        assert torch.equal(a[live], b[live]), f"output of token {t}"
    assert not torch.equal(plain.state, pool.state)  # the window did fold into the checkpoint


def test_value_major_state_is_for_the_standard_step_only():
    """A value-major state runs the standard step; ``allocate_pool`` makes no value-major window
    pool, one made by hand (as vLLM's pages hold it) reads as the key-major one, and a state in
    neither storage order is refused."""
    family, (h, g, kd, vd) = "gdn", CPU_SHAPES["gdn"][0]
    with pytest.raises(ValueError, match="standard pool"):
        dispatch.allocate_pool(family, 2, h, g, kd, vd, capacity=4, value_major=True)
    pool = random_pool(family, 2, h, g, kd, vd, capacity=4)
    slots, pos = torch.tensor([0, 1], dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    x = random_inputs(family, 2, 1, h, g, kd, vd)
    vm = replace(pool, state=pool.state.transpose(-1, -2).contiguous().transpose(-1, -2))
    torch.testing.assert_close(
        dispatch.replay_step(family, vm, slots, pos, x), dispatch.replay_step(family, pool, slots, pos, x)
    )
    odd = torch.zeros(2, kd, h, vd).permute(0, 2, 1, 3)  # [N, H, K, V] with heads inside keys
    with pytest.raises(ValueError, match="contiguous"):
        dispatch.standard_step(family, odd, slots, x)
    standard = dispatch.allocate_pool(family, 2, h, g, kd, vd, value_major=True)
    assert standard.state.shape == (2, h, kd, vd) and standard.state.transpose(-1, -2).is_contiguous()
