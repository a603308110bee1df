"""convert / inspect end to end on a synthetic statistics directory and a tiny Qwen3-Next model."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from synthetic_stats import gdn_layers, tiny_gdn_model, write_synthetic_stats

from sketchcal.artifact import config_fingerprint, convert, inspect, load_stats, read_sketch
from sketchcal.errors import SketchcalError
from sketchcal.fit.evaluate import compare_shrinkage, heldout_errors
from sketchcal.fit.ranks import SUPPORTED_RANKS, candidate_ranks


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("convert")
    model = root / "model"
    cfg = tiny_gdn_model(model)
    stats = write_synthetic_stats(
        root / "stats", gdn_layers(cfg), fingerprint=config_fingerprint(model), model_id=str(model), window=8
    )
    return {"root": root, "model": model, "stats": stats, "config": cfg}


def copy_stats(base: dict, tmp_path: Path) -> Path:
    return Path(shutil.copytree(base["stats"], tmp_path / "stats"))


def test_convert_end_to_end(base, tmp_path):
    import transformers as tf

    out = tmp_path / "out"
    res = convert(base["stats"], rank=5, out=out)  # no supported rank: uniform ranks cannot meet it
    assert res.weights in ("linked", "copied", "linked+copied")
    assert res.notes == []
    # layout
    for rel in (
        "config.json",
        "sketch/sketch.safetensors",
        "README.md",
        "calibration/stats-manifest.json",
        "calibration/allocation.json",
        "calibration/curves.safetensors",
        "model.safetensors",
    ):
        assert (out / rel).is_file(), rel
    assert not list(out.glob("*.safetensors.partial")) and not list(tmp_path.glob(".out.*"))
    cfg = json.loads((out / "config.json").read_text())
    base_cfg = json.loads((base["model"] / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "sketch_config"} == base_cfg
    sc = cfg["sketch_config"]
    assert sc["format"] == "sketchcal-sketch" and sc["version"] == 3 and sc["producer"]["name"] == "sketchcal"
    assert "sketch_config" not in cfg.get("quantization_config", {})
    assert sc["fingerprint"] == load_stats(base["stats"]).fingerprint
    assert sc["summary"]["mean_rank"] <= 5 + 1e-9
    assert sc["shrinkage"]["method"] == min(
        (m for m, v in res.shrinkage_scores.items() if v is not None), key=lambda m: res.shrinkage_scores[m]
    )
    manifest = json.loads((base["stats"] / "manifest.json").read_text())
    assert json.loads((out / "calibration/stats-manifest.json").read_text()) == manifest
    # weights are the base's, byte for byte (hard link when the file system allows)
    assert (out / "model.safetensors").read_bytes() == (base["model"] / "model.safetensors").read_bytes()
    if res.weights == "linked":
        assert (
            os.stat(out / "model.safetensors").st_ino == os.stat(base["model"] / "model.safetensors").st_ino
        )
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "library_name: transformers" in card and "  - sketchcal" in card
    assert "base_model:" not in card  # the statistics name a local path, which is no Hub id
    assert "mean rank" in card
    # the sketch tensors
    art = read_sketch(out, base["config"])
    stats = load_stats(base["stats"])
    assert [lay.layer for lay in art.layers] == [li.layer for li in stats.layers] == [0, 2]
    kl = 0.0  # Σ_h kl_scale_h · err_h, kl_scale_h = fisher_h / (2 V n_decoded) (γ = 1 in these stats)
    for lay, li in zip(art.layers, stats.layers, strict=True):
        fisher = stats.moments(li.layer, "calib").fisher
        scale = fisher / (2.0 * li.value_dim * stats.decoded_tokens("calib"))
        assert lay.frame.shape == (li.groups, li.key_dim, li.key_dim) and lay.frame.dtype == torch.float32
        assert lay.ranks.shape == (li.heads,) and lay.ranks.dtype == torch.int32
        assert lay.coef.shape[:1] == (li.heads,) and lay.coef.shape[2] == li.key_dim
        for g in range(li.groups):
            assert torch.allclose(lay.frame[g] @ lay.frame[g].T, torch.eye(li.key_dim), atol=1e-5)
        win = stats.windows(li.layer)
        for h, m in enumerate(lay.ranks.tolist()):
            assert m in candidate_ranks(li.key_dim)
            if m == 0:
                continue
            assert torch.allclose(lay.coef[h, :, :m][:m], torch.eye(m))
            assert not lay.coef[h, m:].any()
            # the stored tensors reproduce the measured held-out error of the allocation
            r, p = lay.frame_of(h).double(), lay.coef[h, :m].double()
            s, u = win.S[:, h].double(), win.u[:, :, h].double() * win.mask.unsqueeze(-1)
            exact = torch.einsum("nkv,ntk->ntv", s, u)
            approx = torch.einsum("ntm,nmv->ntv", (u @ r.T) @ p.T, (r @ s)[:, :m])
            kl += float(scale[h]) * float(((exact - approx) ** 2).sum() / (exact**2).sum())
    assert kl == pytest.approx(res.allocation.measured_kl, rel=1e-3)
    # transformers still loads it, with the base weights
    model = tf.AutoModelForCausalLM.from_pretrained(out)
    ref = tf.AutoModelForCausalLM.from_pretrained(base["model"])
    for (n1, p1), (_, p2) in zip(model.state_dict().items(), ref.state_dict().items(), strict=True):
        assert torch.equal(p1, p2), n1
    assert model.config.sketch_config["fingerprint"] == sc["fingerprint"]


def test_inspect_prints_and_plots(base, tmp_path):
    from rich.console import Console

    from sketchcal.artifact import print_convert_result

    out = tmp_path / "out"
    res = convert(base["stats"], rank=8, out=out)
    console = Console(record=True, width=140)
    print_convert_result(res, console)
    text = console.export_text()
    assert "E shrinkage:" in text and "exact optimum" in text and "less than ReplaySSM" in text
    console = Console(record=True, width=140)
    res = inspect(out, tmp_path / "plots", console=console)
    text = console.export_text()
    assert "mean rank" in text and "less than standard" in text
    assert [p.name for p in res.plots] == ["ranks.png", "error_curves.png"]
    for p in res.plots:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [row["layer"] for row in res.layers] == [0, 2]
    assert res.summary["mean_rank"] <= 8 + 1e-9


def test_bytes_budget_and_basis_ablations(base, tmp_path):
    full = convert(base["stats"], rank=16, out=tmp_path / "dense").allocation  # all dense = ReplaySSM traffic
    assert full.predicted_kl == 0.0
    assert full.bytes_per_token == pytest.approx(full.replay_bytes_per_token)
    budget = 0.6 * full.replay_bytes_per_token
    res = convert(base["stats"], bytes_per_token=budget, out=tmp_path / "bytes")
    assert res.allocation.bytes_per_token <= budget
    assert res.allocation.reduction_vs_replay >= 0.4 - 1e-9
    for kind in ("pca", "random"):
        r = convert(base["stats"], rank=8, out=tmp_path / kind, basis=kind, reference_only=True)
        assert r.sketch_config["basis"] == kind


def test_adaptive_sketch_artifact(base, tmp_path):
    """``--sketch-map adaptive``: ranks chosen for the adaptive read at static rank 8's bytes, recorded
    in config.json (format version 3) and the curves; the runtime then reads adaptively by default,
    and an artifact without ``sketch_map`` (version 2) reads static."""
    from rich.console import Console

    from sketchcal.fit.traffic import TrafficModel
    from sketchcal.runtime.patch import _sketch_map

    static = convert(base["stats"], rank=8, out=tmp_path / "static", reference_only=True)
    res = convert(base["stats"], rank=8, out=tmp_path / "ad", reference_only=True, sketch_map="adaptive")
    sc = json.loads((tmp_path / "ad" / "config.json").read_text())["sketch_config"]
    assert sc["version"] == 3 and sc["sketch_map"] == "adaptive" and sc["budget"] == {"rank": 8.0}
    layer = sc["layers"][0]
    k, v, heads = layer["key_dim"], layer["value_dim"], layer["heads"]
    uniform_static = TrafficModel("gdn", k, v, 8).step_bytes(8) * heads * len(sc["layers"])
    assert res.allocation.bytes_per_token <= uniform_static * (1 + 1e-9)
    assert res.allocation.sketch_map == "adaptive" and static.allocation.sketch_map == "static"
    assert res.allocation.mean_rank < static.allocation.mean_rank  # each rank reads K + V values, not V
    curves = load_file(tmp_path / "ad" / "calibration" / "curves.safetensors")
    assert curves["layers.0.adaptive_candidate_ranks"].tolist()[:3] == [0, 1, 2]
    art = read_sketch(tmp_path / "ad")
    assert art.config["sketch_map"] == "adaptive" and _sketch_map(None, art, "sketch") == "adaptive"
    old = read_sketch(tmp_path / "static")
    old.config.pop("sketch_map")
    assert _sketch_map(None, old, "sketch") == "static"
    # inspect plots the adaptive curves the ranks were chosen on (odd ranks are on them)
    console = Console(record=True, width=140)
    shown = inspect(tmp_path / "ad", tmp_path / "plots", console=console)
    assert "adaptive map" in console.export_text() and any(
        m % 2 for row in shown.layers for m in row["ranks"]
    )
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in shown.plots)


def test_reference_only(base, tmp_path):
    out = tmp_path / "ref"
    res = convert(base["stats"], rank=8, out=out, reference_only=True)
    assert res.weights == "reference"
    assert not list(out.glob("*.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_next" and cfg["sketch_config"]["base_model"]["weights"] == "reference"
    assert (out / "sketch/sketch.safetensors").is_file()


def test_model_not_available_falls_back_to_reference(base, tmp_path):
    stats = copy_stats(base, tmp_path)
    mf = json.loads((stats / "manifest.json").read_text())
    mf["model"]["id"] = "no-such-org/no-such-model-xyz"
    (stats / "manifest.json").write_text(json.dumps(mf))
    res = convert(stats, rank=8, out=tmp_path / "out")
    assert res.weights == "reference"
    assert any("not available locally" in n for n in res.notes)
    cfg = json.loads((tmp_path / "out/config.json").read_text())
    assert set(cfg) == {"model_type", "sketch_config"}
    card = (tmp_path / "out/README.md").read_text()
    assert 'base_model: "no-such-org/no-such-model-xyz"' in card and "base_model_relation: adapter" in card


def test_heldout_errors_per_basis(base):
    table = heldout_errors(base["stats"], ranks=[4, 8])
    assert set(table) == {"state", "pca", "random"}
    for m in (4, 8):
        assert table["state"][m] < table["random"][m] and table["pca"][m] < table["random"][m]
    moments = heldout_errors(base["stats"], kinds=("state",), ranks=[4], source="moments")
    assert 0 < moments["state"][4] < 1
    shr = compare_shrinkage(base["stats"], ranks=[4])
    assert set(shr) == {"ledoit_wolf", "oas", "none"}


# --- bad inputs: one-line SketchcalError and no output ---------------------------------------------------


def _rewrite_tensor(stats: Path, name: str, fn) -> None:
    for shard in stats.glob("stats-*.safetensors"):
        t = load_file(str(shard))
        if name in t:
            t[name] = fn(t[name])
            save_file(t, str(shard))
            return
    raise AssertionError(name)


def _other_model(stats, tmp_path):
    d = tmp_path / "other"
    d.mkdir()
    model_dir = Path(json.loads((stats / "manifest.json").read_text())["model"]["id"])
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["linear_num_value_heads"] = 8
    (d / "config.json").write_text(json.dumps(cfg))
    return {"model": d}


def _edit_manifest(key, value):
    def edit(stats: Path, tmp_path: Path) -> dict:
        mf = json.loads((stats / "manifest.json").read_text())
        mf[key] = value
        (stats / "manifest.json").write_text(json.dumps(mf))
        return {}

    return edit


def _nan(stats, tmp_path):
    _rewrite_tensor(
        stats,
        "layers.2.calib.E",
        lambda t: t.index_put_((torch.tensor([0]),) * 3, torch.tensor([float("nan")], dtype=t.dtype)),
    )
    return {}


def _inf_windows(stats, tmp_path):
    _rewrite_tensor(stats, "layers.0.heldout.windows.u", lambda t: t.fill_(float("inf")))
    return {}


def _truncate_manifest(stats, tmp_path):
    text = (stats / "manifest.json").read_text()
    (stats / "manifest.json").write_text(text[: len(text) // 2])
    return {}


def _remove(name):
    def edit(stats, tmp_path):
        (stats / name).unlink()
        return {}

    return edit


def _truncate_shard(stats, tmp_path):
    shard = stats / "stats-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    return {}


def _garbage_shard(stats, tmp_path):
    (stats / "stats-00001-of-00002.safetensors").write_bytes(b"\x00\x01not a safetensors file")
    return {}


def _existing_out(stats, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    return {}


BAD = {
    "fingerprint mismatch": (_other_model, {"rank": 8}, "another model"),
    "nan in moments": (_nan, {"rank": 8}, "NaN or Inf"),
    "inf in windows": (_inf_windows, {"rank": 8}, "NaN or Inf"),
    "rank above K": (None, {"rank": 17}, "exceeds the key dim"),
    "negative rank": (None, {"rank": -4}, "positive"),
    "budget not met": (None, {"rank": 1}, "cannot be met"),
    "bytes budget not met": (None, {"bytes_per_token": 100.0}, "cannot be met"),
    "no budget": (None, {}, "exactly one"),
    "missing manifest": (_remove("manifest.json"), {"rank": 8}, "no manifest.json"),
    "incomplete manifest": (_edit_manifest("complete", False), {"rank": 8}, "incomplete"),
    "manifest without layers": (_edit_manifest("layers", []), {"rank": 8}, "layer list"),
    "truncated manifest": (_truncate_manifest, {"rank": 8}, "truncated JSON"),
    "missing shard": (_remove("stats-00002-of-00002.safetensors"), {"rank": 8}, "is missing"),
    "truncated shard": (_truncate_shard, {"rank": 8}, "truncated or corrupt"),
    "garbage shard": (_garbage_shard, {"rank": 8}, "truncated or corrupt"),
    "output exists": (_existing_out, {"rank": 8}, "already exists"),
    "unknown basis": (None, {"rank": 8, "basis": "svd"}, "basis must be one of"),
    "unknown sketch map": (None, {"rank": 8, "sketch_map": "dynamic"}, "--sketch-map must be one of"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs(base, tmp_path, case):
    edit, kwargs, match = BAD[case]
    stats = copy_stats(base, tmp_path)
    extra = edit(stats, tmp_path) if edit else {}
    out = tmp_path / "out"
    existed = out.exists()
    before = set(tmp_path.iterdir())
    with pytest.raises(SketchcalError, match=match) as info:
        convert(stats, out=out, **kwargs, **extra)
    assert "\n" not in str(info.value)
    assert set(tmp_path.iterdir()) == before  # no partial output, no temp dirs left behind
    if existed:
        assert (out / "keep.txt").read_text() == "mine"
    else:
        assert not out.exists()


def test_read_sketch_rejects_another_model(base, tmp_path):
    import transformers as tf

    out = tmp_path / "out"
    convert(base["stats"], rank=8, out=out, reference_only=True)
    other = tf.Qwen3NextConfig(**{**base["config"].to_dict(), "linear_num_value_heads": 8})
    with pytest.raises(SketchcalError, match="fitted for another model"):
        read_sketch(out, other)


def test_convert_real_calibration_of_a_builtin_model(tmp_path):
    """calibrate → convert → transformers loads the result and computes what the built-in model computes."""
    import transformers as tf

    import sketchcal
    from sketchcal.models.loading import load_model

    stats = tmp_path / "stats"
    sketchcal.calibrate(
        "builtin:tiny-gdn",
        out=stats,
        window=8,
        samples=4,
        seq_len=48,
        batch_size=2,
        heldout_samples=2,
        heldout_windows=4,
        device="cpu",
        progress=False,
    )
    out = tmp_path / "out"
    res = convert(stats, rank=8, out=out)
    assert res.weights == "saved" and res.allocation.mean_rank <= 8
    assert (out / "sketch/sketch.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert "base_model:" not in (out / "README.md").read_text()  # builtin: is not a Hub id
    loaded = tf.AutoModelForCausalLM.from_pretrained(out)
    ref = load_model("builtin:tiny-gdn", device="cpu").model
    ids = torch.arange(1, 20)[None]
    assert torch.allclose(loaded(ids).logits, ref(ids).logits, atol=1e-5)
    read_sketch(out, loaded.config)
    # statistics of this model do not convert against another model
    other = tmp_path / "other"
    tiny_gdn_model(other)
    with pytest.raises(SketchcalError, match="another model"):
        convert(stats, rank=8, out=tmp_path / "out2", model=other)
    assert not (tmp_path / "out2").exists()


def test_model_card_front_matter(tmp_path):
    from sketchcal.artifact.card import model_card
    from sketchcal.fit.allocate import Allocation

    alloc = Allocation(
        budget={"rank": 8.0},
        allocation="output",
        selected_on="held-out windows",
        layers=[],
        mean_rank=8.0,
        predicted_kl=0.01,
        heldout_kl=None,
        measured_kl=0.02,
        bytes_per_token=10.0,
        replay_bytes_per_token=20.0,
        standard_bytes_per_token=40.0,
        optimal=True,
        gap_bound=0.0,
    )
    kw = dict(
        family="gdn",
        window=16,
        allocation=alloc,
        basis="state",
        shrinkage="none",
        stats_manifest={},
        notes=[],
    )
    card = model_card(base_id="org/model", weights="linked", **kw)
    front = card.split("---\n")[1]
    assert 'base_model: "org/model"' in front and "base_model_relation: quantized" in front
    assert "library_name: transformers" in front and "  - sketchssm" in front
    assert "base_model_relation: adapter" in model_card(base_id="org/model", weights="reference", **kw)
    assert "75.00% less" in card  # vs standard
    # base_model is recorded for Hub ids only (sketchcal.hub.resolve.is_hub_id): NAME or NAMESPACE/NAME
    assert 'base_model: "gpt2"' in model_card(base_id="gpt2", weights="linked", **kw)
    for not_hub in ("builtin:tiny-gdn", "./local/dir", "a/b/c", str(tmp_path), "org--x/model"):
        assert "base_model:" not in model_card(base_id=not_hub, weights="linked", **kw), not_hub


def test_dead_head_converts(base, tmp_path):
    """A head whose states are always zero (never used) must not break the fit: it is exact at any rank."""
    stats = copy_stats(base, tmp_path)
    for name in ("E", "E_col4", "read_energy"):
        for split in ("calib", "heldout"):
            _rewrite_tensor(
                stats, f"layers.0.{split}.{name}", lambda t: t.index_fill_(0, torch.tensor([1]), 0.0)
            )
    _rewrite_tensor(stats, "layers.0.heldout.windows.S", lambda t: t.index_fill_(1, torch.tensor([1]), 0.0))
    res = convert(stats, rank=4, out=tmp_path / "out")
    art = read_sketch(tmp_path / "out")
    assert torch.isfinite(art.layers[0].coef).all() and torch.isfinite(art.layers[0].frame).all()
    assert res.allocation.layers[0].ranks[1] == min(m for m in SUPPORTED_RANKS if m)  # the cheapest
