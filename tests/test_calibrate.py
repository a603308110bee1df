"""End-to-end calibration on the built-in tiny models: output format, resume, data parallelism,
and one-line errors that leave nothing behind."""

import errno
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from helpers import calibrate_worker
from safetensors.torch import load_file

import sketchcal
from sketchcal.calibrate import run as run_module
from sketchcal.calibrate.preflight import check_resume
from sketchcal.errors import SketchcalError
from sketchcal.formats.stats import load_stats_tensors

SMALL = dict(
    samples=6, seq_len=64, batch_size=2, heldout_samples=2, heldout_windows=8, device="cpu", progress=False
)


def _tensors(path):
    return load_stats_tensors(path)[1]


@pytest.mark.parametrize("model", ["builtin:tiny-gdn", "builtin:tiny-mamba2", "builtin:tiny-kda"])
def test_calibrate_writes_complete_statistics(tmp_path, model):
    out = tmp_path / "stats"
    manifest = sketchcal.calibrate(model, out=out, window=8, **SMALL)
    assert manifest["complete"] and (out / "manifest.json").exists() and not (out / "_progress").exists()
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["model"]["fingerprint"] == manifest["model"]["fingerprint"]
    assert on_disk["window"] == 8 and on_disk["prompt_len"] == 0  # default: the whole sample is decoded
    tensors = _tensors(out)
    for entry in on_disk["layers"]:
        h, k = entry["heads"], entry["key_dim"]
        for split in ("calib", "heldout"):
            pre = f"layers.{entry['layer']}.{split}."
            assert tensors[pre + "E"].shape == (h, k, k) and tensors[pre + "E"].dtype == torch.float64
            # 64 decoded tokens per sample = 8 windows of 8 from the first token (the first
            # checkpoint is the zero state before it): 8 checkpoints and 8 * 7 reads each
            n = on_disk["samples"][split]
            assert int(tensors[pre + "n_checkpoints"]) == 8 * n
            assert int(tensors[pre + "n_reads"]) == 56 * n
            e = tensors[pre + "E"]
            assert torch.allclose(e, e.transpose(-1, -2)) and torch.linalg.eigvalsh(e).min() > -1e-9
        kept = tensors[f"layers.{entry['layer']}.heldout.windows.S"]
        assert kept.shape == (8, h, k, entry["value_dim"])
    assert on_disk["tokens"]["calib"] == {"prompt": 0, "decode": 6 * 64}


def test_generation_masks_tokens_after_eos(tmp_path):
    out = tmp_path / "stats"
    m = sketchcal.calibrate(out=out, gen_tokens=12, window=4, **{**SMALL, "seq_len": 16})
    assert m["prompt_len"] == 16
    assert 0 < m["tokens"]["calib"]["decode"] <= 6 * 12
    t = _tensors(out)
    # every decoded token after a checkpoint is a read, except the flush (4th) of each window
    reads = int(t["layers.0.calib.n_reads"])
    assert reads <= m["tokens"]["calib"]["decode"] and reads >= m["tokens"]["calib"]["decode"] * 3 // 4 - 6


def test_resumed_run_equals_uninterrupted(tmp_path, monkeypatch):
    full = tmp_path / "full"
    sketchcal.calibrate(out=full, **SMALL)  # never saves progress: the sums are never reloaded

    part = tmp_path / "part"
    real = run_module._Runner.process
    seen = []

    def flaky(self, batch):
        if len(seen) == 2:
            raise KeyboardInterrupt
        seen.append(batch.index)
        return real(self, batch)

    monkeypatch.setattr(run_module._Runner, "process", flaky)
    with pytest.raises(KeyboardInterrupt):
        sketchcal.calibrate(out=part, save_every=1, **SMALL)
    assert not (part / "manifest.json").exists() and (part / "_progress" / "state.json").exists()
    with pytest.raises(SketchcalError, match="not empty"):
        sketchcal.calibrate(out=part, save_every=1, **SMALL)
    # the default --prompt-len (0) does not follow --seq-len; a changed prompt is named too
    differs = "other arguments: --seq-len 64 → 48; rerun"
    with pytest.raises(SketchcalError, match=differs):
        sketchcal.calibrate(out=part, save_every=1, resume=True, **{**SMALL, "seq_len": 48})
    differs = "other arguments: --prompt-len 0 → 8; rerun"
    with pytest.raises(SketchcalError, match=differs):
        sketchcal.calibrate(out=part, save_every=1, resume=True, **{**SMALL, "prompt_len": 8})
    monkeypatch.setattr(run_module._Runner, "process", real)
    # --save-every is not part of the result: resumed with another one, the bytes are the same
    sketchcal.calibrate(out=part, save_every=2, resume=True, **SMALL)

    a, b = _tensors(full), _tensors(part)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize(
    "change, named",
    [
        ({"settings": {"window": 8}}, "--window 16 → 8"),
        ({"settings": {"samples": 64}}, "--samples 32 → 64"),
        ({"settings": {"seed": 1}}, "--seed 0 → 1"),
        ({"settings": {"batch_size": 4}}, "--batch-size 8 → 4"),
        ({"settings": {"model": "builtin:tiny-kda"}}, "MODEL 'builtin:tiny-gdn' → 'builtin:tiny-kda'"),
        ({"settings": {"data": "docs.jsonl"}}, "--data None → 'docs.jsonl'"),
        ({"weights": "sha256:" + "b" * 64}, "model weights 'sha256:aaaaaaaaaaaa…' → 'sha256:bbbbbbbbbbbb…'"),
        ({"data": {"source": "builtin", "sha256": "x2"}}, "data content (the documents' sha256 changed)"),
    ],
)
def test_resume_names_the_argument_that_differs(change, named, tmp_path):
    old = {
        "settings": {
            "model": "builtin:tiny-gdn",
            "data": None,
            "window": 16,
            "samples": 32,
            "seed": 0,
            "batch_size": 8,
        },
        "fingerprint": "sha256:" + "f" * 64,
        "weights": "sha256:" + "a" * 64,
        "data": {"source": "builtin", "sha256": "x1"},
    }
    new = {
        k: {**v, **change[k]} if isinstance(v, dict) and k in change else change.get(k, v)
        for k, v in old.items()
    }
    with pytest.raises(SketchcalError) as err:
        check_resume(old, new, tmp_path)
    message = str(err.value)
    assert f"used other arguments: {named}; rerun" in message and "\n" not in message
    check_resume(old, json.loads(json.dumps(old)), tmp_path)  # the same identity resumes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gloo_two_processes_equal_one(tmp_path):
    single = tmp_path / "single"
    sketchcal.calibrate(out=single, **SMALL)
    dual = tmp_path / "dual"
    mp.spawn(calibrate_worker, args=(_free_port(), str(dual), SMALL), nprocs=2, join=True)
    a, b = _tensors(single), _tensors(dual)
    assert a.keys() == b.keys()
    for name in a:
        if a[name].is_floating_point():
            scale = a[name].abs().max().clamp_min(1e-300)
            assert ((a[name] - b[name]).abs().max() / scale).item() < 1e-12, name
        else:
            assert torch.equal(a[name], b[name]), name
    assert json.loads((dual / "manifest.json").read_text())["timing"]["world_size"] == 2


# --- bad inputs: a one-line error, nothing written -------------------------------------------


def _assert_clean(err, out):
    assert "\n" not in str(err.value)
    assert not out.exists() or not (out / "manifest.json").exists()


def test_unknown_architecture(tmp_path):
    import transformers as tf

    model_dir = tmp_path / "llama"
    cfg = tf.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    tf.LlamaForCausalLM(cfg).save_pretrained(model_dir)
    out = tmp_path / "stats"
    with pytest.raises(SketchcalError, match="unsupported architecture 'llama'") as err:
        sketchcal.calibrate(str(model_dir), out=out, **SMALL)
    _assert_clean(err, out)
    assert not out.exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 1}, "--window must be at least 2"),
        ({"prompt_len": 64}, "leaves no decoded tokens"),
        ({"samples": 0}, "--samples must be positive"),
        ({"samples": 100000}, "enough for"),
        ({"model": "builtin:tiny-rwkv"}, "unknown built-in model"),
        ({"model": "./no/such/dir"}, "does not exist"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, message):
    out = tmp_path / "stats"
    with pytest.raises(SketchcalError, match=message) as err:
        sketchcal.calibrate(out=out, **{**SMALL, **kwargs})
    _assert_clean(err, out)
    assert not out.exists()


def test_non_empty_directory_refused_and_overwrite_keeps_foreign_files(tmp_path):
    out = tmp_path / "stats"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SketchcalError, match="not empty"):
        sketchcal.calibrate(out=out, **SMALL)
    with pytest.raises(SketchcalError, match="did not write"):
        sketchcal.calibrate(out=out, overwrite=True, **SMALL)
    assert (out / "notes.txt").read_text() == "mine"
    with pytest.raises(SketchcalError, match="no interrupted run"):
        sketchcal.calibrate(out=tmp_path / "other", resume=True, **SMALL)


def test_nan_statistics(tmp_path, monkeypatch):
    from sketchcal.models import loading

    real = loading.load_model

    def poisoned(*args, **kwargs):
        loaded = real(*args, **kwargs)
        with torch.no_grad():
            mixer = loaded.spec.mixers(loaded.model)[0]
            next(m for m in mixer.modules() if isinstance(m, torch.nn.Linear)).weight.fill_(float("nan"))
        return loaded

    monkeypatch.setattr(run_module, "load_model", poisoned)
    out = tmp_path / "stats"
    with pytest.raises(SketchcalError, match="NaN or Inf in the statistics of layer") as err:
        sketchcal.calibrate(out=out, **SMALL)
    _assert_clean(err, out)
    assert not out.exists()


def test_full_disk(tmp_path, monkeypatch):
    from sketchcal.formats import stats as stats_format

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(stats_format, "save_file", full)
    out = tmp_path / "stats"
    with pytest.raises(SketchcalError, match="no space left") as err:
        sketchcal.calibrate(out=out, **SMALL)
    _assert_clean(err, out)
    leftovers = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
    assert leftovers == []


def test_cli_error_is_one_line(tmp_path):
    out = tmp_path / "stats"
    out.mkdir()
    (out / "x").write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "sketchcal", "calibrate", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "COLUMNS": "300"},
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "not empty" in lines[0]


def test_shards_are_safetensors_only(tmp_path):
    out = tmp_path / "s"
    sketchcal.calibrate(out=out, **SMALL)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["calibration.png", "manifest.json", "stats-00001-of-00001.safetensors"]
    assert load_file(str(out / names[2]))
