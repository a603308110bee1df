"""verify end to end on builtin:tiny-gdn with synthetic statistics, plus its metrics and retrieval task."""

from __future__ import annotations

import importlib
import json
import math

import numpy as np
import pytest
import torch
from synthetic_stats import write_synthetic_stats

from sketchcal.artifact import config_fingerprint, convert
from sketchcal.errors import SketchcalError
from sketchcal.models.loading import load_model
from sketchcal.verify import verify
from sketchcal.verify.metrics import (
    LENGTH_BUCKETS,
    TokenMetrics,
    kl_per_token,
    length_edges,
    nll_per_token,
    percentile,
)
from sketchcal.verify.retrieval import build_recall, recall_hits

WINDOW = 8


@pytest.fixture(scope="module")
def loaded():
    return load_model("builtin:tiny-gdn", device="cpu")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, loaded):
    root = tmp_path_factory.mktemp("verify")
    layers = [s.as_dict() for s in loaded.spec.layers]
    stats = write_synthetic_stats(
        root / "stats",
        layers,
        fingerprint=config_fingerprint(loaded.model.config),
        model_id="builtin:tiny-gdn",
        model_type=loaded.spec.arch.model_type,
        window=WINDOW,
    )
    convert(stats, rank=4, out=root / "art", model="builtin:tiny-gdn", shrinkage="ledoit_wolf")
    return root


def test_verify_end_to_end(artifact, loaded, tmp_path):
    out = tmp_path / "report"
    res = verify(
        artifact / "art",
        tokens=3 * WINDOW,
        rank=[4, 8],
        out=out,
        prompt=8,
        samples=4,
        batch_size=2,
        stats=artifact / "stats",
        device="cpu",
        progress=False,
    )
    for name in ("verify.json", "report.md", "kl_by_position.png", "kl_by_length.png", "error_by_rank.png"):
        assert (out / name).is_file(), name
    data = json.loads((out / "verify.json").read_text())
    names = [c["name"] for c in data["configs"]]
    assert names[:3] == ["standard", "replay", "sketch"]
    assert {"sketch · pca basis", "sketch · random basis", "sketch · bf16 shared", "sketch · rank 8"} <= set(
        names
    )
    # the sweep re-fits both bases at each budget except the artifact's own (rank 4: the main rows)
    assert "sketch · rank 8 · pca basis" in names and not any(n.startswith("sketch · rank 4") for n in names)
    pca8 = res.config("sketch · rank 8 · pca basis")
    assert pca8.basis == "pca" and pca8.budget == 8 and pca8.group == "rank sweep"
    std, rep, sk = (res.config(n) for n in ("standard", "replay", "sketch"))
    # each static sketch row again as an adaptive sketch at no more read bytes (allocated for it)
    for name, static in (("sketch", sk), ("sketch · rank 8", res.config("sketch · rank 8"))):
        ad = res.config(f"{name} · adaptive map")
        assert ad.sketch_map == "adaptive" and static.sketch_map == "static" and ad.group == "sketch map"
        # as many read bytes; the flush also writes the factors (at most a read per window)
        assert ad.traffic["bytes_per_token"] <= static.traffic["bytes_per_token"] * (1 + 1 / (WINDOW - 1))
        assert ad.read_error != static.read_error and ad.kl_mean > 0
    assert res.config("sketch · rank 8 · adaptive map").mean_rank < res.config("sketch · rank 8").mean_rank
    assert "sketch · pca basis · adaptive map" not in names
    assert rep.kl_mean < 1e-10 and rep.top1_agreement == 1.0 and max(rep.read_error.values()) == 0.0
    assert sk.kl_mean > 0 and min(sk.read_error.values()) > 0 and len(sk.kl_by_position) == WINDOW
    # 3 windows of decoded tokens in 8 equal spans: their mean is the mean KL
    assert len(sk.kl_by_length) == 8 and math.isclose(sum(sk.kl_by_length) / 8, sk.kl_mean, rel_tol=1e-9)
    assert set(sk.read_error) == {s.layer for s in loaded.spec.layers}
    # traffic: the byte model's number for the artifact's ranks, as convert reported it
    cfg = json.loads((artifact / "art" / "config.json").read_text())["sketch_config"]
    assert math.isclose(sk.traffic["reduction_vs_standard"], cfg["summary"]["reduction_vs_standard"])
    # standard perplexity against the plain model's own forward on the same samples
    ids = torch.tensor([row for row in _heldout(loaded, 8 + 3 * WINDOW + 1)])
    with torch.no_grad():
        logits = loaded.model(ids[:, :-1], use_cache=False).logits[:, 8:]
    ppl = math.exp(float(nll_per_token(logits, ids[:, 9:]).mean()))
    assert math.isclose(std.perplexity, ppl, rel_tol=1e-4)
    assert res.retrieval["queries"] == 4 * 3 and std.retrieval_accuracy is not None
    assert res.retrieval["applicable"] and res.retrieval["full_state_accuracy"] == std.retrieval_accuracy
    md = (out / "report.md").read_text()
    assert "sketchcal verify" in md and "| sketch |" in md and "kl_by_position.png" in md


def _heldout(loaded, seq_len: int) -> list[list[int]]:
    from sketchcal.data import build_samples

    return build_samples(loaded.tokenizer, None, num_samples=1, seq_len=seq_len, heldout_samples=4).heldout


def test_an_adaptive_artifact_is_verified_against_the_static_map_at_its_bytes(artifact, tmp_path):
    """An adaptive artifact's rows read adaptively; each has a ``· static map`` row, the static
    allocation at its bytes; ``--sketch-map static`` re-runs the sketch as that static allocation."""
    convert(artifact / "stats", rank=4, out=tmp_path / "ad", model="builtin:tiny-gdn", sketch_map="adaptive")
    opts = dict(
        tokens=3 * WINDOW, prompt=8, samples=2, retrieval=False, plots=False, device="cpu", progress=False
    )
    res = verify(tmp_path / "ad", out=tmp_path / "r1", stats=artifact / "stats", **opts)
    sk, static = res.config("sketch"), res.config("sketch · static map")
    assert sk.sketch_map == "adaptive" and static.sketch_map == "static" and static.group == "sketch map"
    assert res.config("sketch · uniform ranks").sketch_map == "adaptive"
    assert static.traffic["bytes_per_token"] <= sk.traffic["bytes_per_token"] * (1 + 1e-9)
    assert sk.mean_rank < static.mean_rank and sk.kl_mean != static.kl_mean
    res = verify(
        tmp_path / "ad",
        out=tmp_path / "r2",
        stats=artifact / "stats",
        sketch_map="static",
        ablations=False,
        **opts,
    )
    again = res.config("sketch")
    assert again.sketch_map == "static" and again.mean_rank == static.mean_rank
    assert again.kl_mean == pytest.approx(static.kl_mean, rel=1e-6)


def test_recall_is_not_applicable_where_the_full_state_model_fails_it(artifact, tmp_path, monkeypatch):
    """A model that answers (almost) no recall query with its full state gets no recall column: the
    sketch rows' recall would say nothing about the sketch."""
    run = importlib.import_module("sketchcal.verify.run")

    def no_hits(logits, query_pos, answers, prompt):
        return torch.zeros_like(recall_hits(logits, query_pos, answers, prompt))

    monkeypatch.setattr(run, "recall_hits", no_hits)
    out = tmp_path / "report"
    res = verify(
        artifact / "art", tokens=2 * WINDOW, rank=[], prompt=8, samples=2, batch_size=2, out=out,
        device="cpu", progress=False, ablations=False,
    )  # fmt: skip
    assert not res.retrieval["applicable"] and res.retrieval["full_state_accuracy"] == 0.0
    assert all(c.retrieval_accuracy is None for c in res.configs)
    assert any("recall: not applicable" in n for n in res.notes)
    assert "not applicable" in (out / "report.md").read_text()


def test_a_data_file_is_evaluated_whole(artifact, tmp_path):
    """verify --data FILE draws from every document of the file (not a held-out tenth of it), and too
    few tokens for --samples is an error that names verify's options."""
    docs = [f"document {i}: " + " ".join(f"word{j}" for j in range(40)) for i in range(12)]
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    res = verify(
        artifact / "art", data=str(path), tokens=WINDOW, rank=[], prompt=4, samples=2, batch_size=2,
        out=tmp_path / "r", device="cpu", progress=False, ablations=False, retrieval=False,
    )  # fmt: skip
    assert res.data["documents"]["heldout"] == len(docs) and res.data["heldout_rule"] == "every document"
    with pytest.raises(SketchcalError, match=r"lower --samples to \d+ .*a shorter --tokens"):
        verify(artifact / "art", data=str(path), tokens=WINDOW, samples=10_000, device="cpu", progress=False)


def test_verify_errors(artifact, tmp_path):
    with pytest.raises(SketchcalError, match=r"config\.json"):
        verify(tmp_path, device="cpu", progress=False)
    # an artifact whose calibration statistics have moved away
    import json
    import shutil

    moved = tmp_path / "moved"
    shutil.copytree(artifact / "art", moved)
    cfg = json.loads((moved / "config.json").read_text())
    cfg["sketch_config"]["calibration"] = {"stats_dir": str(tmp_path / "gone")}
    (moved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SketchcalError, match="statistics"):
        verify(moved, rank=[8], tokens=8, samples=1, device="cpu", progress=False, out=tmp_path / "r")


def test_metrics_against_torch():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 7, 11, generator=g), torch.randn(5, 7, 11, generator=g)
    want = torch.nn.functional.kl_div(
        torch.log_softmax(b.double(), -1),
        torch.log_softmax(a.double(), -1),
        log_target=True,
        reduction="none",
    ).sum(-1)
    assert torch.allclose(kl_per_token(a, b), want)
    t = torch.randint(0, 11, (5, 7), generator=g)
    nll = torch.nn.functional.cross_entropy(b.double().reshape(-1, 11), t.flatten(), reduction="none")
    assert torch.allclose(nll_per_token(b, t).flatten(), nll)
    v = torch.rand(1000, generator=g, dtype=torch.float64)
    assert math.isclose(percentile(v, 0.99), float(np.quantile(v.numpy(), 0.99)))
    # KL along the sequence: two batches of 7 decoded positions in spans [0, 2), [2, 4), [4, 7)
    meter = TokenMetrics(window=4)
    pos = torch.arange(7) % 4 + 1
    meter.add(a[:3], b[:3], t[:3], pos)
    meter.add(a[3:], b[3:], t[3:], pos)
    assert length_edges(7, 3) == [0, 2, 4, 7] and length_edges(2, 8) == [0, 1, 2]
    spans = [want[:, lo:hi].mean().item() for lo, hi in ((0, 2), (2, 4), (4, 7))]
    assert np.allclose(meter.by_length(3), spans)
    assert len(meter.summary()["kl_by_length"]) == min(7, LENGTH_BUCKETS)


def test_recall_task_is_well_formed(loaded):
    prefixes = [[5, 6, 7]] * 3
    rs = build_recall(loaded.tokenizer, prefixes, 64, seed=1)
    assert rs.ids.shape == (3, 3 + 64)
    for n in range(3):
        seq = rs.ids[n].tolist()
        for pos, ans in zip(rs.query_pos[n].tolist(), rs.answers[n].tolist(), strict=True):
            assert seq[pos + 1] == ans  # teacher-forced answer right after the queried key
            first = seq.index(seq[pos], 3)
            assert first < pos and seq[first + 1] == ans  # the pair appeared before
    logits = torch.zeros(3, 64, len(loaded.tokenizer))  # argmax 0: never a word token
    hits = recall_hits(logits, rs.query_pos, rs.answers, 3)
    assert hits.shape == rs.answers.shape and not hits.any()
    # held-out text decoded first: the pairs and queries fill the rest, after it
    text = [[100 + n] * 40 for n in range(3)]
    long = build_recall(loaded.tokenizer, prefixes, 40 + 64, seed=1, text=text)
    assert long.ids.shape == (3, 3 + 104) and long.n_pairs == rs.n_pairs
    assert long.ids[:, 3:43].tolist() == text and torch.equal(long.query_pos, rs.query_pos + 40)
    assert torch.equal(long.ids[:, 43:], rs.ids[:, 3:]) and torch.equal(long.answers, rs.answers)


def test_refits_in_memory_equal_a_written_conversion(artifact, tmp_path):
    """verify's re-fits hold exactly what ``convert`` writes for the same budget and basis."""
    from sketchcal.artifact import load_stats, read_sketch
    from sketchcal.verify.run import Refits

    art = read_sketch(artifact / "art")
    refits = Refits(load_stats(artifact / "stats"), art)
    rank, basis = 6, "pca"
    mem = refits(rank, basis)
    assert refits(rank, basis) is mem  # fitted once
    convert(
        artifact / "stats",
        rank=rank,
        basis=basis,
        out=tmp_path / basis,
        reference_only=True,
        shrinkage="ledoit_wolf",
        progress=False,
    )
    disk = read_sketch(tmp_path / basis)
    assert mem.fingerprint == disk.fingerprint
    assert mem.config == {k: v for k, v in disk.config.items() if k not in ("calibration", "files")}
    for a, b in zip(mem.layers, disk.layers, strict=True):
        assert a.layer == b.layer and a.frame.dtype == b.frame.dtype == torch.float32
        for name in ("frame", "coef", "ranks"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (a.layer, name)
