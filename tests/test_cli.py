"""The seams between the CLI and the Python API: one settings object per command, lazy imports."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys

import pytest
import typer
from helpers import ROOT
from typer.testing import CliRunner

import sketchcal
from sketchcal.cli import app
from sketchcal.errors import SketchcalError
from sketchcal.settings import CalibrateSettings, ConvertSettings, VerifySettings

HEAVY = ("torch", "transformers", "triton", "matplotlib", "safetensors", "numpy")


def _python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_cli_import_and_help_load_no_numerical_stack():
    heavy = f"sorted(m for m in {HEAVY!r} if m in sys.modules)"
    assert _python(f"import sys, sketchcal.cli; print({heavy})").strip() == "[]"
    assert _python(f"import sys, sketchcal; print({heavy})").strip() == "[]"
    for args in (["--help"], ["calibrate", "--help"], ["convert", "--help"], ["verify", "--help"]):
        out = _python(
            "import sys\n"
            f"sys.argv = ['sketchcal', *{args!r}]\n"
            "from sketchcal.cli import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            f"print({heavy})"
        )
        assert out.strip().splitlines()[-1] == "[]", args
        assert "Usage:" in out


def test_version():
    proc = subprocess.run(
        [sys.executable, "-m", "sketchcal", "--version"],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout == f"sketchcal {sketchcal.__version__}\n"


def _options(command: str) -> set[str]:
    click_cmd = typer.main.get_command(app).commands[command]
    return {opt for p in click_cmd.params for opt in (*p.opts, *p.secondary_opts)}


# every flag the commands had before their options moved into settings dataclasses
KEPT_FLAGS = {
    "calibrate": """--out --data --samples --seq-len --gen-tokens --prompt-len --window --heldout-samples
        --heldout-windows --batch-size --seed --chat-template --no-chat-template --sample --greedy
        --temperature --device --dtype --device-map --revision --trust-remote-code
        --no-trust-remote-code --text-field --data-revision --resume --no-resume --overwrite
        --no-overwrite --save-every""",
    "convert": """--out --rank --bytes-per-token --model --reference-only --no-reference-only --basis
        --shrinkage --seed --stats-revision --revision""",
    "verify": """--baseline --data --tokens --rank --prompt --samples --batch-size --read-dtype --stats
        --out --ablations --no-ablations --retrieval --no-retrieval --device --seed --revision""",
}


@pytest.mark.parametrize("command", list(KEPT_FLAGS))
def test_existing_flags_kept(command):
    assert set(KEPT_FLAGS[command].split()) <= _options(command)


@pytest.mark.parametrize(
    ("name", "settings"),
    [("calibrate", CalibrateSettings), ("convert", ConvertSettings), ("verify", VerifySettings)],
)
def test_api_signature_is_the_settings(name, settings):
    params = inspect.signature(getattr(sketchcal, name)).parameters
    assert list(params) == [f.name for f in dataclasses.fields(settings)]
    for f in dataclasses.fields(settings):
        if f.default is not dataclasses.MISSING:
            assert params[f.name].default == f.default, f.name


def test_api_names_stay_functions_when_subpackages_load():
    for name in ("calibrate", "verify"):  # what the import system does when a subpackage first loads
        __import__(f"sketchcal.{name}.run")
        setattr(sketchcal, name, sys.modules[f"sketchcal.{name}"])
    for name in ("calibrate", "convert", "verify", "inspect", "push"):
        assert inspect.isfunction(getattr(sketchcal, name)), name
    with pytest.raises(AttributeError):
        sketchcal.no_such_function  # noqa: B018


class _Captured(Exception):
    pass


def _capture(monkeypatch, module: str, attr: str) -> list:
    import importlib

    seen: list = []

    def fake(settings, *rest):
        seen.append(settings)
        raise _Captured

    monkeypatch.setattr(importlib.import_module(module), attr, fake)
    return seen


def _cli_settings(monkeypatch, module, attr, args):
    seen = _capture(monkeypatch, module, attr)
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, _Captured), result.output
    return seen[0]


def _api_settings(monkeypatch, module, attr, fn, *args, **kwargs):
    seen = _capture(monkeypatch, module, attr)
    with pytest.raises(_Captured):
        fn(*args, **kwargs)
    return seen[0]


def test_cli_and_api_build_the_same_settings(monkeypatch, tmp_path):
    out = tmp_path / "x"
    cli = _cli_settings(
        monkeypatch,
        "sketchcal.calibrate.run",
        "run_calibration",
        ["calibrate", "builtin:tiny-kda", "--out", str(out), "--samples", "5", "--sample", "--window", "8"],
    )
    api = _api_settings(
        monkeypatch,
        "sketchcal.calibrate.run",
        "run_calibration",
        sketchcal.calibrate,
        "builtin:tiny-kda",
        out=str(out),
        samples=5,
        do_sample=True,
        window=8,
    )
    assert cli == api and cli.out == out and cli.prompt_len == 0 and cli.heldout_samples == 1
    assert "out" not in cli.run_identity() and cli.run_identity()["do_sample"] is True

    args = ["convert", "stats", "--out", str(out), "--bytes-per-token", "100", "--basis", "pca"]
    cli = _cli_settings(monkeypatch, "sketchcal.artifact.convert", "resolve_inputs", args)
    api = _api_settings(
        monkeypatch,
        "sketchcal.artifact.convert",
        "resolve_inputs",
        sketchcal.convert,
        "stats",
        out=out,
        bytes_per_token=100,
        basis="pca",
    )
    assert cli == api and cli.rank is None and cli.shrinkage == "auto"

    args = ["verify", "model-sketch", "--rank", "4", "--rank", "16", "--no-ablations"]
    cli = _cli_settings(monkeypatch, "sketchcal.verify.run", "run_verify", args)
    api = _api_settings(
        monkeypatch, "sketchcal.verify.run", "run_verify", sketchcal.verify, "model-sketch", rank=[4, 16],
        ablations=False, command=cli.command,
    )  # fmt: skip
    assert cli == api and cli.rank == (4.0, 16.0) and cli.command.startswith("sketchcal ")
    assert VerifySettings("d", rank=8).rank == (8.0,) and VerifySettings("d").rank == ()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: CalibrateSettings(window=1), "--window must be at least 2"),
        (lambda: CalibrateSettings(save_every=0), "--save-every must be positive"),
        (lambda: CalibrateSettings(seq_len=64, prompt_len=64), "leaves no decoded tokens"),
        (lambda: ConvertSettings("s", rank=8), "give an output directory"),
        (lambda: ConvertSettings("s", out="o"), "exactly one budget"),
        (lambda: ConvertSettings("s", out="o", rank=8, bytes_per_token=9), "exactly one budget"),
        (lambda: ConvertSettings("s", out="o", rank=-1), "positive"),
        (lambda: ConvertSettings("s", out="o", rank=8, coef="svd"), "--coef must be one of"),
        (lambda: ConvertSettings("s", out="o", rank=8, shrinkage="x"), "--shrinkage must be one of"),
        (lambda: ConvertSettings("s", out="o", rank=8, read_dtype="int3"), "--read-dtype"),
        (lambda: VerifySettings("d", tokens=0), "--tokens must be positive"),
        (lambda: VerifySettings("d", prompt=-1), "--prompt must not be negative"),
        (lambda: VerifySettings("d", rank=[4, 0]), "--rank budgets must be positive"),
        (lambda: VerifySettings("d", read_dtype="int3"), "--read-dtype must be one of"),
        (lambda: VerifySettings("d", stats="/no/such/stats"), "does not exist"),
    ],
)
def test_settings_refuse_bad_values_in_one_line(build, message):
    with pytest.raises(SketchcalError, match=message) as err:
        build()
    assert "\n" not in str(err.value)


def test_cli_bad_value_is_one_line_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "sketchcal", "convert", "stats", "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "300"},
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "exactly one budget" in lines[0]
    assert not (tmp_path / "o").exists()


def test_convert_command_end_to_end_results_on_stdout(tmp_path):
    from synthetic_stats import gdn_layers, tiny_gdn_model, write_synthetic_stats

    from sketchcal.artifact import config_fingerprint, read_sketch

    model = tmp_path / "model"
    cfg = tiny_gdn_model(model)
    fp = config_fingerprint(model)
    stats = write_synthetic_stats(
        tmp_path / "stats", gdn_layers(cfg), fingerprint=fp, model_id=str(model), window=8
    )
    out = tmp_path / "out"
    args = ["convert", str(stats), "--rank", "6", "--out", str(out), "--shrinkage", "oas", "--no-progress"]
    proc = subprocess.run(
        [sys.executable, "-m", "sketchcal", *args, "--reference-only"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "E shrinkage:" in proc.stdout and "E shrinkage:" not in proc.stderr
    art = read_sketch(out, cfg)
    assert art.config["shrinkage"]["method"] == "oas" and art.config["base_model"]["weights"] == "reference"
    assert art.config["summary"]["mean_rank"] <= 6 + 1e-9
