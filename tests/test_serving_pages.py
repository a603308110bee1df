"""The vLLM plugin's page layout and decode branch, without vLLM: pages packed as vLLM packs them
(one byte row per block, the layer's states one after the other), sequences in scattered blocks at
different window positions, padding rows on the null block.

References: the float64 recurrence (replay is exact) and the runtime's own decode state
(:class:`sketchcal.runtime.state.WindowState`, another code path over the same math) for sketch.
"""

from __future__ import annotations

from math import prod

import pytest
import torch

from sketchcal.errors import SketchcalError
from sketchcal.kernels.common import StepInputs, family, recurrence
from sketchcal.kernels.common.pool import random_sketch
from sketchcal.runtime.precision import Precision
from sketchcal.runtime.state import WindowState
from sketchcal.serving.vllm.decode import NULL_BLOCK, WindowDecoder
from sketchcal.serving.vllm.page import PagePlan

H, G, K, V, L = 4, 2, 16, 16, 4
BLOCKS = 7
RANKS = [4, 8, 0, 12]


def pack_pages(shapes, dtypes, blocks: int, device="cpu") -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Raw pages [blocks, bytes] and the per-state views [blocks, *shape], as vLLM binds them."""
    sizes = [prod(s) * d.itemsize for s, d in zip(shapes, dtypes, strict=True)]
    raw = torch.zeros(blocks, sum(sizes) + 24, dtype=torch.uint8, device=device)  # + vLLM's padding
    views, offset = [], 0
    for shape, dtype, size in zip(shapes, dtypes, sizes, strict=True):
        views.append(raw[:, offset : offset + size].view(dtype).view(-1, *shape))
        offset += size
    return raw, views


def random_inputs(fam: str, steps: int, gen: torch.Generator) -> StepInputs:
    """One sequence's inputs in the reference layout [T, H, ...], float32 values (keys shared per group)."""
    k = torch.randn(steps, G, K, generator=gen)
    q = torch.randn(steps, G, K, generator=gen) / K**0.5
    if fam != "mamba2":
        k = k / k.norm(dim=-1, keepdim=True)
    rep = H // G
    dshape = (steps, H, K) if fam == "kda" else (steps, H)
    return StepInputs(
        k=k.repeat_interleave(rep, 1),
        q=q.repeat_interleave(rep, 1),
        w=torch.randn(steps, H, V, generator=gen),
        decay=0.8 + 0.2 * torch.rand(dshape, generator=gen),
        beta=None if fam == "mamba2" else torch.rand(steps, H, generator=gen),
        skip=torch.randn(steps, H, V, generator=gen) if fam == "mamba2" else None,
    )


def kernel_layout(xs: list[StepInputs], t: int) -> StepInputs:
    """Token t of several sequences as one kernel-layout batch [B, 1, ...] (keys per group)."""
    tok = [x.tokens(slice(t, t + 1)) for x in xs]
    cat = {n: None if getattr(tok[0], n) is None else torch.stack([getattr(x, n) for x in tok]) for n in
           ("k", "q", "w", "decay", "beta", "skip")}  # fmt: skip
    cat["k"], cat["q"] = cat["k"][:, :, :: H // G].contiguous(), cat["q"][:, :, :: H // G].contiguous()
    return StepInputs(**cat)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fam", ["mamba2", "gdn", "kda"])
@pytest.mark.parametrize("mode", ["replay", "sketch", "adaptive"])
def test_pages_decode_as_the_reference(fam, mode, device):
    """On a CPU the decode branch runs the float64 reference, on CUDA the Triton kernels (a paged
    pool: the read, the sweep and the adaptive sketch's factors); fp32 pages, so both are held to
    fp32 rounding (the adaptive factors on CUDA come from TF32 products: 1e-4)."""
    gen = torch.Generator().manual_seed(0)
    adaptive = mode == "adaptive"
    tables = None if mode == "replay" else random_sketch(fam, RANKS, G, K, gen)
    rows = 0 if tables is None else tables.map_rows
    served = tables
    if adaptive:  # a page wider than this layer's rows (another layer's), as the plugin pads them
        rows += 2
        served = tables.with_map_rows(rows)
    # on CUDA a Mamba-2 sketch page holds the split read's workspace, as the plugin's does
    workspace = device == "cuda" and fam == "mamba2" and rows > 0 and not adaptive
    plan = PagePlan(
        fam, H, G, K, V, L, torch.float32, torch.float32, rows, workspace=workspace, adaptive=adaptive
    )
    # vLLM's own states first: a conv state and the recurrent state, value-major [H, V, K] like Mamba-2's
    shapes, dtypes = ((3, 8), (H, V, K), *plan.shapes), (torch.float32,) * 2 + plan.dtypes
    raw, views = pack_pages(shapes, dtypes, BLOCKS, device)
    pages = plan.pages(views[1].transpose(-1, -2), views[2:])
    pool, cursor = pages.pool, pages.cursor
    decoder = WindowDecoder(fam, L, None if served is None else served.to(device), adaptive=adaptive)

    # three sequences in blocks 5, 2, 3, starting at steps 0, 2 and 5 from random states
    blocks, starts, steps = [5, 2, 3], [0, 2, 5], 14
    xs = [random_inputs(fam, steps, gen) for _ in blocks]
    s0 = [torch.randn(H, K, V, generator=gen) * 0.3 for _ in blocks]
    fam_ref = family(fam)
    sketch_map = "adaptive" if adaptive else "static"
    refs = [WindowState(fam, s.double()[None], window=L, precision=Precision(compute_dtype=torch.float64),
                        tables=tables, sketch_map=sketch_map) for s in s0]  # fmt: skip
    outs: list[list[torch.Tensor]] = [[] for _ in blocks]
    views[0][NULL_BLOCK] = 7.0  # whatever the null block holds stays there
    null_before = raw[NULL_BLOCK].clone()
    for step in range(steps):
        for i, (b, start) in enumerate(zip(blocks, starts, strict=True)):
            if step == start:  # vLLM's prefill wrote the state; the window restarts
                cursor[b] = 3  # a stale cursor from the block's previous owner
                views[1][b] = s0[i].transpose(-1, -2)
                decoder.settle(pages, torch.tensor([b], device=device), buffered=False)
        live = [i for i, start in enumerate(starts) if step >= start]
        order = live[::-1]  # rows in any order, with padding rows between them
        rows = [blocks[i] for i in order]
        batch = kernel_layout([xs[i].tokens(slice(step - starts[i], None)) for i in order], 0)
        batch = batch.map(lambda t: torch.cat([t, t.new_zeros((2, *t.shape[1:]))]))  # two padding rows
        ids = torch.tensor([*rows, NULL_BLOCK, -1], device=device)  # vLLM pads with the null block (or -1)
        out = decoder.step(pages, ids, batch.map(lambda t: t.to(device))).cpu()
        assert torch.equal(out[len(rows) :], torch.zeros_like(out[len(rows) :]))
        for r, i in enumerate(order):
            outs[i].append(out[r, 0])
            assert int(cursor[blocks[i]]) == (step - starts[i] + 1) % L
    assert torch.equal(raw[NULL_BLOCK], null_before)
    for i in range(len(blocks)):
        x = xs[i].tokens(slice(0, steps - starts[i])).map(lambda t: t[None].double())
        got = torch.stack(outs[i]).double()
        if mode == "replay":  # exact: the plain recurrence from the same state
            want, _ = recurrence(fam_ref, x, s0[i].double()[None])
        else:
            want = refs[i].step(x)
        tol = 1e-4 if adaptive and device == "cuda" else 1e-5
        torch.testing.assert_close(got, want[0], rtol=tol, atol=tol)
        # the checkpoint in the page is the exact state at the last flush
        n = (steps - starts[i]) // L * L
        _, s_flush = recurrence(fam_ref, x.tokens(slice(0, n)), s0[i].double()[None])
        torch.testing.assert_close(pool.state[blocks[i]].cpu().double(), s_flush[0], rtol=1e-5, atol=1e-5)


def test_fold_before_vllm_continues_a_sequence():
    """``settle(buffered=True)`` folds the buffer into the checkpoint: the exact current state."""
    gen = torch.Generator().manual_seed(1)
    plan = PagePlan("gdn", H, G, K, V, L, torch.float32, torch.float32, 0)
    _, views = pack_pages(((H, V, K), *plan.shapes), (torch.float32, *plan.dtypes), BLOCKS)
    pages = plan.pages(views[0].transpose(-1, -2), views[1:])
    pool, cursor = pages.pool, pages.cursor
    dec = WindowDecoder("gdn", L, None)
    s0 = torch.randn(H, K, V, generator=gen) * 0.3
    views[0][4] = s0.transpose(-1, -2)
    dec.settle(pages, torch.tensor([4]), buffered=False)
    x = random_inputs("gdn", 2, gen)
    for t in range(2):
        dec.step(pages, torch.tensor([4]), kernel_layout([x], t))
    assert int(cursor[4]) == 2
    dec.settle(pages, torch.tensor([4]), buffered=True)
    _, want = recurrence(family("gdn"), x.map(lambda t: t[None].double()), s0.double()[None])
    torch.testing.assert_close(pool.state[4].double(), want[0], rtol=1e-5, atol=1e-5)
    assert int(cursor[4]) == 0


def test_page_plan_layout():
    plan = PagePlan("kda", H, G, K, V, L, torch.bfloat16, torch.bfloat16, 8)
    names = [n for n, _, _ in plan.entries()]
    assert names == ["read", "sketch", "buf_k", "buf_w", "buf_decay", "buf_beta", "buf_logdecay", "cursor"]
    read_and_sketch = (H * K * V + H * 8 * V) * 2
    # keys and values (bf16), decays and betas (fp32), log₂ decays (bf16)
    buffers = L * (G * K + H * V) * 2 + L * H * K * 4 + L * H * 4 + L * H * K * 2
    want = read_and_sketch + buffers + 4
    assert plan.extra_bytes() == want
    scratch = PagePlan("mamba2", H, G, K, V, L, torch.bfloat16, torch.bfloat16, 8, workspace=True)
    assert [n for n, _, _ in scratch.entries()][-2:] == ["workspace", "cursor"]
    # per group: each of its heads' 8 coefficients, the dots of the L buffered tokens and the new one
    assert dict((n, s) for n, s, _ in scratch.entries())["workspace"] == (G, H // G * 8 + L + 1)
    fp32 = PagePlan("mamba2", H, G, K, V, L, torch.float32, torch.float32, 0)
    assert [n for n, _, _ in fp32.entries()] == ["buf_k", "buf_w", "buf_decay", "cursor"]  # reads S_c itself
    _, views = pack_pages(((H, V, K), *fp32.shapes), (torch.bfloat16, *fp32.dtypes), 2)
    with pytest.raises(SketchcalError, match="--mamba-ssm-cache-dtype float32"):
        fp32.pages(views[0].transpose(-1, -2), views[1:])


@pytest.mark.parametrize("model_type", ["qwen3_next", "nemotron_h", "kimi_linear"])
def test_synthetic_sketch_of_the_plugin_tests_is_a_valid_artifact(tmp_path, model_type):
    """The plugin's tests (run only with vLLM) build their converted models with this helper; the
    artifact reader must accept it, and still catch a changed byte, so they test the plugin and not
    a stale artifact format."""
    from helpers import write_synthetic_sketch

    from sketchcal.artifact.sketch import SKETCH_FILE, read_sketch
    from sketchcal.models.tiny import tiny_config

    tiny_config(model_type).save_pretrained(tmp_path)
    write_synthetic_sketch(tmp_path, rank=8)
    art = read_sketch(tmp_path, config=tmp_path)
    assert art.layers and all(int(lay.ranks.min()) == 8 for lay in art.layers)
    f = tmp_path / SKETCH_FILE
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(SketchcalError):
        read_sketch(tmp_path, config=tmp_path)


def _engine_config(architecture: str, device: str):
    """The parts of a vLLM config ``serve_settings`` reads before it opens the model (stand-ins:
    these refusals come first)."""
    from types import SimpleNamespace as NS

    model = NS(model="m", revision=None, architecture=architecture, hf_config=NS(sketch_config={}))
    return NS(
        model_config=model,
        additional_config={},
        cache_config=NS(enable_prefix_caching=False, mamba_cache_mode="none"),
        parallel_config=NS(tensor_parallel_size=1),
        speculative_config=None,
        device_config=NS(device_type=device),
    )


@pytest.mark.parametrize(
    ("architecture", "device", "says"),
    [
        ("Qwen3_5ForCausalLM", "xpu", "a CPU or an NVIDIA GPU, not xpu"),
        ("NemotronHForCausalLM", "cuda", "built for NVIDIA GPUs, not ROCm"),
    ],
)
def test_devices_the_plugin_does_not_serve_are_refused(architecture, device, says, monkeypatch):
    from sketchcal.serving.vllm.settings import serve_settings

    monkeypatch.setattr(torch.version, "hip", "6.4")  # a ROCm build: vLLM's device type is still cuda

    with pytest.raises(SketchcalError, match=says) as err:
        serve_settings(_engine_config(architecture, device))
    assert "\n" not in str(err.value)


@pytest.mark.gpu
@pytest.mark.parametrize("adaptive", [False, True], ids=["static", "adaptive"])
@pytest.mark.parametrize("fam", ["mamba2", "gdn", "kda"])
def test_page_decode_replays_in_a_cuda_graph_gpu(fam, adaptive):
    """The CUDA decode branch as vLLM's CUDA graphs run it: one step captured, then replayed over
    more than a window (reads and a flush, rows at different cursors, a padding row) with new inputs
    copied in, gives the outputs and pages of the same steps run eagerly on a copy of the pages."""
    gen = torch.Generator().manual_seed(5)
    tables = random_sketch(fam, RANKS, G, K, gen).to("cuda")
    bf16 = torch.bfloat16
    workspace = fam == "mamba2" and not adaptive
    plan = PagePlan(fam, H, G, K, V, L, bf16, bf16, tables.map_rows, workspace=workspace, adaptive=adaptive)
    shapes, dtypes = ((3, 8), (H, V, K), *plan.shapes), (torch.float32,) * 2 + plan.dtypes
    raws, decoders, paged = [], [], []
    for _ in range(2):  # graph-replayed and eager, from the same pages
        raw, views = pack_pages(shapes, dtypes, BLOCKS, "cuda")
        raws.append((raw, views))
        paged.append(plan.pages(views[1].transpose(-1, -2), views[2:]))
        decoders.append(WindowDecoder(fam, L, tables, adaptive=adaptive))
    blocks = torch.tensor([5, 2, NULL_BLOCK, 3], device="cuda")
    for (_, views), pages, dec in zip(raws, paged, decoders, strict=True):
        for b, start in ((5, 0), (2, 1), (3, 3)):
            views[1][b] = (0.3 * torch.randn(H, V, K, generator=torch.Generator().manual_seed(b))).cuda()
            dec.settle(pages, torch.tensor([b], device="cuda"), buffered=False)
            pages.cursor[b] = start  # rows at different window positions (their buffers hold zeros)
    steps = [kernel_layout([random_inputs(fam, 1, gen) for _ in blocks], 0) for _ in range(L + 2)]
    names = ("k", "q", "w", "decay", "beta", "skip")

    def on_cuda(x: StepInputs) -> StepInputs:  # bf16 but the decays and betas, as the kernels take them
        dtype = {n: torch.float32 if n in ("decay", "beta") else bf16 for n in names}
        return StepInputs(
            **{n: None if getattr(x, n) is None else getattr(x, n).to("cuda", dtype[n]) for n in names}
        )

    steps = [on_cuda(x) for x in steps]
    static = steps[0].map(torch.clone)
    pages, dec = paged[0], decoders[0]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture, on a throwaway copy
        warm_raw = raws[0][0].clone()
        dec.step(pages, blocks, static)
        raws[0][0].copy_(warm_raw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dec.step(pages, blocks, static)
    for x in steps:
        for name in names:
            if getattr(x, name) is not None:
                getattr(static, name).copy_(getattr(x, name))
        graph.replay()
        want = decoders[1].step(paged[1], blocks, x)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(raws[0][0], raws[1][0], rtol=0, atol=0)
