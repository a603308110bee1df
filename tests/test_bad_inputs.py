"""Bad inputs and faults through the CLI: each is one ``error:`` line on stderr, exit status 2, no
traceback, nothing on stdout, and the files that were there before are untouched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from synthetic_stats import gdn_layers, tiny_gdn_model, write_synthetic_stats

from sketchcal.artifact import config_fingerprint, convert
from sketchcal.cli import main
from sketchcal.errors import SketchcalError


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def fails(monkeypatch, capsys, *args: str) -> str:
    """Run ``sketchcal ARGS`` in this process; assert the one-line failure and return that line."""
    monkeypatch.setattr(sys, "argv", ["sketchcal", *map(str, args)])
    monkeypatch.setenv("COLUMNS", "400")
    capsys.readouterr()  # what the test itself printed while preparing the files
    with pytest.raises(SystemExit) as exit_:
        main()
    out, err = capsys.readouterr()
    assert exit_.value.code == 2, err
    assert out == "" and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    return lines[0]


def _mount_tmpfs(path: Path, options: str) -> Path:
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small or read-only tmpfs")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    return path


@pytest.fixture(params=["full", "read-only"])
def bad_fs(request, tmp_path):
    """A 1 MiB filesystem already holding a file (full), or a read-only one; yields (mount, expected)."""
    if request.param == "full":
        mnt = _mount_tmpfs(tmp_path / "full", "size=1m")
        (mnt / "keep.json").write_text('{"mine": 1}')
        expected = "not enough free space"
    else:
        mnt = _mount_tmpfs(tmp_path / "ro", "size=64k,ro")
        expected = "cannot write"
    yield mnt, expected
    subprocess.run(["umount", str(mnt)], check=False)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("bad")
    model = root / "model"
    cfg = tiny_gdn_model(model)
    fp = config_fingerprint(model)
    stats = write_synthetic_stats(
        root / "stats", gdn_layers(cfg), fingerprint=fp, model_id=str(model), window=8
    )
    art = root / "art"
    convert(stats, rank=6, out=art, progress=False)
    return {"root": root, "model": model, "stats": stats, "art": art, "config": cfg, "fp": fp}


def _no_model_load(monkeypatch):
    from sketchcal.calibrate import run as calibrate_run

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(calibrate_run, "load_model", refuse)


def test_calibrate_on_a_full_or_read_only_filesystem_before_the_model_loads(bad_fs, monkeypatch, capsys):
    mnt, expected = bad_fs
    before = _snapshot(mnt)
    _no_model_load(monkeypatch)
    line = fails(monkeypatch, capsys, "calibrate", "--out", mnt / "stats", "--device", "cpu", "--no-progress")
    assert expected in line and str(mnt) in line
    assert _snapshot(mnt) == before and not (mnt / "stats").exists()


def test_convert_on_a_full_or_read_only_filesystem(bad_fs, base, monkeypatch, capsys):
    mnt, expected = bad_fs
    before = _snapshot(mnt)
    line = fails(
        monkeypatch, capsys, "convert", base["stats"], "--rank", "6", "--out", mnt / "art", "--no-progress"
    )
    assert expected in line
    assert _snapshot(mnt) == before and sorted(p.name for p in mnt.iterdir()) == sorted(before)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sample", "--temperature", "0"], "--temperature must be positive when sampling"),
        (["--dtype", "float8"], "--dtype must be one of auto, float32, bfloat16, float16, got 'float8'"),
        (["--window", "1000"], "--window 1000 is longer than the"),
    ],
    ids=["temperature-0", "dtype-float8", "window-1000"],
)
def test_calibrate_refuses_settings_before_any_work(args, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    _no_model_load(monkeypatch)
    line = fails(monkeypatch, capsys, "calibrate", "--out", tmp_path / "stats", "--device", "cpu", *args)
    assert message in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_custom_code_config_names_trust_remote_code(tmp_path, monkeypatch, capsys):
    model = tmp_path / "custom"
    model.mkdir()
    cfg = {"model_type": "my_hybrid", "auto_map": {"AutoConfig": "configuration_my.MyConfig"}}
    (model / "config.json").write_text(json.dumps(cfg))
    before = _snapshot(tmp_path)
    line = fails(monkeypatch, capsys, "calibrate", model, "--out", tmp_path / "stats", "--device", "cpu")
    assert "--trust-remote-code" in line and "auto_map" in line
    assert _snapshot(tmp_path) == before


def test_convert_model_with_the_same_architecture_and_other_weights(base, tmp_path, monkeypatch, capsys):
    other = tmp_path / "other"
    tiny_gdn_model(other, seed=1)
    assert config_fingerprint(other) == base["fp"]  # same architecture: only the weights tell them apart
    out = tmp_path / "art"
    line = fails(
        monkeypatch,
        capsys,
        "convert",
        base["stats"],
        "--model",
        other,
        "--rank",
        "6",
        "--out",
        out,
        "--no-progress",
    )
    assert "other weights" in line and str(other) in line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["other"]


def test_verify_stats_of_another_window(base, tmp_path, monkeypatch, capsys):
    stats16 = write_synthetic_stats(
        tmp_path / "stats16",
        gdn_layers(base["config"]),
        fingerprint=base["fp"],
        model_id=str(base["model"]),
        window=16,
    )
    before = _snapshot(base["art"])
    line = fails(
        monkeypatch,
        capsys,
        "verify",
        base["art"],
        "--stats",
        stats16,
        "--out",
        tmp_path / "v",
        "--device",
        "cpu",
    )
    assert "window-16 calibration" in line and "window 8" in line
    assert _snapshot(base["art"]) == before and not (tmp_path / "v").exists()


def _flip(path: Path, offset_from_end: int = 9) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("rel", ["sketch/sketch.safetensors", "model.safetensors"])
def test_flipped_bytes_are_named_by_inspect_verify_and_the_runtime(rel, base, tmp_path, monkeypatch, capsys):
    import transformers as tf

    import sketchcal.runtime

    art = Path(shutil.copytree(base["art"], tmp_path / "art"))
    target = art / rel
    if target.stat().st_nlink > 1:  # a hard link to the base: flip our own copy, not the base's file
        target.write_bytes(target.read_bytes())
    _flip(target)
    line = fails(monkeypatch, capsys, "inspect", art, "--no-plots")
    assert str(target) in line and "does not match the sha256" in line
    line = fails(
        monkeypatch, capsys, "verify", art, "--out", tmp_path / "v", "--device", "cpu", "--no-progress"
    )
    assert str(target) in line and "does not match the sha256" in line
    model = tf.AutoModelForCausalLM.from_pretrained(base["model"])
    with pytest.raises(SketchcalError, match="does not match the sha256") as err:
        sketchcal.runtime.enable(model, art)
    assert str(target) in str(err.value) and "\n" not in str(err.value)


def test_another_models_sketch_file_is_a_mismatch(base, tmp_path, monkeypatch, capsys):
    other_stats = write_synthetic_stats(
        tmp_path / "ostats", gdn_layers(base["config"]), fingerprint="sha256:" + "ab" * 32, window=8
    )
    other = tmp_path / "other-art"
    convert(other_stats, rank=6, out=other, reference_only=True, progress=False)
    art = Path(shutil.copytree(base["art"], tmp_path / "art"))
    shutil.copyfile(other / "sketch/sketch.safetensors", art / "sketch/sketch.safetensors")
    line = fails(monkeypatch, capsys, "inspect", art, "--no-plots")
    assert "fitted for another model" in line and "truncated or corrupt" not in line


def test_json_on_stdout_and_nothing_else(base, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["sketchcal", "inspect", str(base["art"]), "--no-plots", "--json"])
    with pytest.raises(SystemExit) as exit_:
        main()
    out, err = capsys.readouterr()
    assert exit_.value.code in (0, None), err
    data = json.loads(out)
    assert data["summary"]["mean_rank"] <= 6 + 1e-9 and "Traceback" not in err
