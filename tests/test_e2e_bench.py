"""The pieces of ``sketchcal bench --e2e`` that run without a GPU: the random bench sketch feeds the
runtime, the Amdahl-bound step removes the recurrent work (and only it), the summary's ratios, the
CLI's refusals. The timings themselves need CUDA (BENCHMARKS.md)."""

from __future__ import annotations

import sys

import pytest
import torch
from test_runtime_triton import DEVICE, L, P, generate, ids_for, rel_max, tiny_model

from sketchcal.cli import main
from sketchcal.models import describe
from sketchcal.runtime.e2e_bench import _summarise, print_e2e, random_artifact, state_work_removed
from sketchcal.runtime.graph_decode import GraphDecoder


@pytest.mark.parametrize("fam", ["gdn", "mamba2", "kda"])
def test_random_sketch_runs_sketch_mode(fam):
    model, spec = tiny_model(fam)
    art = random_artifact(model, rank=4, window=L)
    assert [lay.layer for lay in art.layers] == [s.layer for s in spec.layers]
    for lay, s in zip(art.layers, spec.layers, strict=True):
        assert lay.frame.shape == (s.groups, s.key_dim, s.key_dim)
        eye = torch.eye(s.key_dim).expand(s.groups, -1, -1)
        assert torch.allclose(lay.frame.transpose(-1, -2) @ lay.frame, eye, atol=1e-5)
        assert 0 < lay.ranks.float().mean() <= s.key_dim
    prompt = ids_for(model, 2, P, 5)
    out, states = generate(model, prompt, L + 2, art, "sketch", window=L, backend="reference")
    assert out.sequences.shape == (2, P + L + 2)
    assert all(st.mode == "sketch" and st.flushes == 1 for st in states.values())


@pytest.mark.parametrize("fam", ["gdn", "mamba2"])
def test_bound_step_removes_only_the_recurrent_work(fam):
    """Under ``state_work_removed`` the mixers' decode outputs are zero (pre-gate) while prefill and
    the rest of the model run as before: logits of a prefill are unchanged, decoded ones differ."""
    model, spec = tiny_model(fam)
    ids = ids_for(model, 2, P, 6)
    outs: dict[int, torch.Tensor] = {}
    hooks = [
        m.register_forward_hook(lambda mod, a, o: outs.__setitem__(mod.layer_idx, o))
        for m in spec.mixers(model)
    ]
    try:
        with torch.no_grad():
            want = model(ids).logits
            with state_work_removed(model):
                got = model(ids).logits
                decoded = GraphDecoder(model, graphs=False)
                decoded.release_cache = True
                decoded.generate(ids, 3)
    finally:
        for h in hooks:
            h.remove()
    assert rel_max(got, want) == 0.0
    layer = spec.layers[0].layer
    if fam != "mamba2":  # the gated norm keeps zeros zero; Mamba-2's out_proj sees norm(0)·gate
        assert float(outs[layer].abs().max()) == 0.0
    assert describe(model).family == fam


def test_summary_ratios_and_bound_share():
    steps = {
        "generate": 100.0,
        "own": 30.0,
        "standard": 30.0,
        "sketch": 20.0,
        "bound": 17.5,
        "adaptive": 22.5,
    }
    rows = [dict(batch=4, mode=m, ms_per_step=ms) for m, ms in steps.items()]
    result = {"rows": rows}
    _summarise(result)
    (s,) = result["summary"]
    assert s["vs_generate"]["sketch"] == pytest.approx(5.0)
    assert s["vs_own"]["standard"] == pytest.approx(1.0)
    assert s["sketch_share_of_bound_gain"] == pytest.approx(10.0 / 12.5)
    assert s["adaptive_share_of_bound_gain"] == pytest.approx(7.5 / 12.5)


def test_table_without_a_generate_row():
    """A batch measured without ``generate`` (it runs out of memory first at large batches) shows "–"
    in its "× generate" column, not a number; a row that failed says why."""
    from rich.console import Console

    rows = [
        dict(batch=8, mode=m, ms_per_step=ms, prefill_s=1.0, peak_gib=2.0, tokens_per_s=8e3 / ms)
        for m, ms in (("own", 30.0), ("public", 18.0), ("standard", 20.0), ("sketch", 15.0), ("bound", 14.0))
    ]
    rows.append(dict(batch=8, mode="replay", error="out of GPU memory"))
    result = dict(
        model="m", family="gdn", recurrent_layers=3, layers=4, dtype="bf16", prompt=4, new=40, window=16,
        mean_rank=8.0, device="cpu", rows=rows,
    )  # fmt: skip
    _summarise(result)
    console = Console(record=True, width=200)
    print_e2e(result, console)
    text = console.export_text()
    assert "nan" not in text
    sketch = next(line for line in text.splitlines() if " sketch " in line)
    assert "– " in sketch and "2.00" in sketch and "1.20" in sketch  # no × generate; × own, × public
    assert "out of GPU memory" in text and "the sketch gets 83% of the Amdahl-bound gain" in text
    assert "--prefill-rows N" in " ".join(text.split())  # the hint, once a row ran out of memory


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the refusal without a GPU")
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["qwen3.5-4b", "--e2e", "--batch", "2"], "CUDA device"),
        (["--batch", "64,x"], "--batch"),
        (["qwen3.5-4b"], "--e2e"),
        (["--e2e"], "MODEL"),
        (["nemotron-3-nano", "--e2e", "--prefill-rows", "0"], "--prefill-rows"),
    ],
)
def test_bench_refusals_are_one_line(monkeypatch, capsys, args, says):
    monkeypatch.setattr(sys, "argv", ["sketchcal", "bench", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and says in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("fam", ["gdn", "mamba2"])
def test_prefill_in_rows_changes_nothing_but_the_batching(fam):
    """The prefill function run one sequence at a time: the same logits, the same greedy tokens with
    a runtime enabled inside it, and every call split (the wrapped function sees batches of 1)."""
    import functools
    import importlib

    from sketchcal.models.capture import torch_reference
    from sketchcal.runtime.e2e_bench import prefill_in_rows

    model, spec = tiny_model(fam)
    ids = ids_for(model, 3, P, 8)
    module = importlib.import_module(spec.arch.module)
    name = spec.adapter.prefill_fn
    seen: list[int] = []
    original = getattr(module, name)

    @functools.wraps(torch_reference(original))
    def counting(*args, **kwargs):
        seen.append(args[0].shape[0] if args else next(iter(kwargs.values())).shape[0])
        return original(*args, **kwargs)

    with torch.no_grad():
        want = model(ids).logits
        plain, _ = generate(model, ids, L + 2, None, "replay", window=L, backend="reference")
        setattr(module, name, counting)
        try:
            with prefill_in_rows(model, 1):
                got = model(ids).logits
                rows, _ = generate(model, ids, L + 2, None, "replay", window=L, backend="reference")
        finally:
            setattr(module, name, original)
    assert getattr(module, name) is original
    assert len(seen) == 2 * 3 and set(seen) == {1}  # both prefills, each split in three
    assert rel_max(got, want) <= 1e-6
    assert torch.equal(rows.sequences, plain.sequences)


def test_adaptive_mode_reads_the_sketch_bytes():
    """The ``adaptive`` mode's sketch: a static artifact re-ranked to read no more bytes; an adaptive
    artifact as it is."""
    from sketchcal.runtime.e2e_bench import adaptive_at_bytes_of

    model, spec = tiny_model("gdn")
    art = random_artifact(model, 8.0, 16)
    ad = adaptive_at_bytes_of(model, art)
    assert ad.config["sketch_map"] == "adaptive" and art.sketch_map == "static"
    shape = spec.layers[0]
    for lay, lay_ad in zip(art.layers, ad.layers, strict=True):
        static_values = sum(lay.ranks.tolist()) * shape.value_dim
        assert 0 < sum(lay_ad.ranks.tolist()) * (shape.key_dim + shape.value_dim) <= static_values
    assert adaptive_at_bytes_of(model, ad) is ad
