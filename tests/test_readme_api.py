"""The README's quickstart (its shell block and its Python API), run as the README writes it with
smaller sizes, offline, in tmp_path; and its CPU torch line is a command."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from helpers import ROOT

import sketchcal
from sketchcal.calibrate import run as calibrate_run
from sketchcal.verify import run as verify_run


def readme_python_api() -> str:
    """The code block under "The same from Python:" in README.md."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"The same from Python:\n\n```python\n(.*?)```", text, re.S)
    assert match, "README.md lost its Python API block"
    return match.group(1)


def test_readme_python_api_runs(tmp_path, monkeypatch):
    code = readme_python_api()
    for call in ("sketchcal.calibrate(", "sketchcal.convert(", "sketchcal.verify("):
        assert call in code
    real_calibrate, real_verify = calibrate_run.run_calibration, verify_run.run_verify
    seen = {}

    def small_calibration(settings):  # the README's call, fewer and shorter samples
        seen["calibrate"] = settings
        settings = dataclasses.replace(settings, prompt_len=None, heldout_samples=None)  # re-derived
        small = dataclasses.replace(
            settings,
            samples=4,
            seq_len=48,
            prompt_len=None,
            heldout_samples=None,
            batch_size=2,
            progress=False,
        )
        return real_calibrate(small)

    def small_verify(settings):
        seen["verify"] = settings
        small = dataclasses.replace(settings, tokens=16, prompt=8, samples=2, device="cpu", progress=False)
        return real_verify(small)

    monkeypatch.setattr(calibrate_run, "run_calibration", small_calibration)
    monkeypatch.setattr(verify_run, "run_verify", small_verify)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)

    assert seen["calibrate"].model == "builtin:tiny-kda" and seen["calibrate"].samples == 32
    assert seen["verify"].model_dir == "model-sketch"
    manifest, result, report = scope["manifest"], scope["result"], scope["report"]
    assert manifest["complete"] and manifest["model"]["id"] == "builtin:tiny-kda"
    assert json.loads(Path("stats/manifest.json").read_text())["model"] == manifest["model"]
    assert result.out == Path("model-sketch") and result.allocation.mean_rank <= 8 + 1e-9
    assert Path("model-sketch/sketch/sketch.safetensors").is_file()
    assert [c.name for c in report.configs][:3] == ["standard", "replay", "sketch"]
    assert report.family == "kda" and Path("model-sketch/verify/verify.json").is_file()

    # the rest of the exported API on the same directory
    summary = sketchcal.inspect("model-sketch", plots=False)
    assert summary.summary["mean_rank"] == pytest.approx(result.allocation.mean_rank)
    planned = sketchcal.push("model-sketch", "user/model-sketchssm", dry_run=True)
    assert planned.dry_run and any(f.path_in_repo == "sketch/sketch.safetensors" for f in planned.files)


# extra options per command that shrink the quickstart to test sizes; the README's own arguments stay
SMALL_FLAGS = {
    "calibrate": "--samples 4 --seq-len 48 --batch-size 2 --heldout-samples 2 --device cpu --no-progress",
    "convert": "--no-progress",
    "verify": "--tokens 16 --prompt 8 --samples 2 --device cpu --no-progress --no-plots",
}


def readme_block(after: str, lang: str = "bash") -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(re.escape(after) + r".*?```" + lang + r"\n(.*?)```", text, re.S)
    assert match, f"README.md lost its {lang} block after {after!r}"
    return match.group(1)


def test_readme_quickstart_shell_block_runs(tmp_path, monkeypatch, capsys):
    import shlex
    import sys

    from sketchcal.cli import main

    lines = [shlex.split(line, comments=True) for line in readme_block("## Quickstart").splitlines()]
    commands = [words for words in lines if words]
    assert [c[:2] for c in commands] == [
        ["sketchcal", "calibrate"],
        ["sketchcal", "convert"],
        ["sketchcal", "verify"],
    ]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")
    for words in commands:
        argv = [*words, *SMALL_FLAGS[words[1]].split()]
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit) as exit_:
            main()
        out, err = capsys.readouterr()
        assert exit_.value.code in (0, None), f"{shlex.join(argv)}: {err}"
        assert "Traceback" not in err
    assert json.loads(Path("stats/manifest.json").read_text())["complete"]
    assert Path("sketch/sketch/sketch.safetensors").is_file()
    assert "sketch · pca basis" in out and "standard" in out  # verify's table, on stdout
    assert Path("sketch/verify/verify.json").is_file()


def test_readme_cpu_torch_line_is_a_command():
    import shlex

    block = readme_block("install a CPU build of torch first")
    (words,) = [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]
    assert words[:3] == ["pip", "install", "torch"]
    assert words[words.index("--index-url") + 1] == "https://download.pytorch.org/whl/cpu"
