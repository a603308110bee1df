"""The ``sketchcal`` command line: a thin Typer shell over the Python API.

``calibrate``, ``convert`` and ``verify`` are built from their settings dataclasses
(:mod:`sketchcal.settings`), so every option is written once for the CLI and the API. Nothing heavy
is imported here: each command imports its machinery when it runs, so ``--help`` stays fast.
"""

from __future__ import annotations

import importlib
import inspect as pyinspect
import sys
from collections.abc import Callable
from dataclasses import MISSING
from pathlib import Path
from typing import Annotated, Any

import typer

from sketchcal import __version__
from sketchcal.errors import SketchcalError
from sketchcal.settings import CalibrateSettings, ConvertSettings, VerifySettings, cli_fields

app = typer.Typer(
    name="sketchcal",
    help="Calibrate, convert, verify and benchmark SketchSSM read sketches for hybrid models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: rendering it with rich costs more than the rest of --help
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"sketchcal {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit"),
    ] = False,
) -> None:
    """sketchcal: offline calibration for SketchSSM decoding."""


def _load(target: str) -> Callable[..., Any]:
    """``"module:attr"`` imported when a command runs."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


JSON_HELP = "Print the results as JSON on stdout instead of a table"


def settings_command(
    name: str,
    settings: type,
    target: str,
    help: str,
    *,
    show: Callable[[Any, dict[str, Any], bool], None],
    extra: Callable[[], dict[str, Any]] | None = None,
) -> None:
    """Register command ``name`` whose parameters are the CLI fields of ``settings`` and ``--json``.

    The command calls the API function ``target`` (``"module:function"``) with the parsed values
    (plus ``extra()``: API-only fields the CLI fills in) and prints its result with
    ``show(result, values, as_json)``: a table on stdout, or JSON with ``--json``.
    """

    def command(**values: Any) -> None:
        as_json = values.pop("as_json")
        result = _load(target)(**values, **(extra() if extra else {}))
        show(result, values, as_json)

    params = []
    for f, cli_type in cli_fields(settings):
        meta = f.metadata
        if meta["argument"]:
            info: Any = typer.Argument(help=meta["help"])
        else:
            info = typer.Option(*([meta["flag"]] if meta["flag"] else []), help=meta["help"])
        default = pyinspect.Parameter.empty if f.default is MISSING else f.default
        typed = Annotated[cli_type, info]
        params.append(
            pyinspect.Parameter(f.name, pyinspect.Parameter.KEYWORD_ONLY, default=default, annotation=typed)
        )
    json_flag = Annotated[bool, typer.Option("--json", help=JSON_HELP)]
    params.append(
        pyinspect.Parameter("as_json", pyinspect.Parameter.KEYWORD_ONLY, default=False, annotation=json_flag)
    )
    command.__signature__ = pyinspect.Signature(params)  # type: ignore[attr-defined]
    command.__name__ = name
    app.command(name, help=help)(command)


def _show_calibration(manifest: dict[str, Any], values: dict[str, Any], as_json: bool) -> None:
    from sketchcal.ui import show_calibration

    show_calibration(manifest, Path(values["out"]), as_json)


def _show_convert(result: Any, values: dict[str, Any], as_json: bool) -> None:
    from sketchcal.artifact.report import print_convert_result
    from sketchcal.ui import print_json, results_console

    print_json(result.to_dict()) if as_json else print_convert_result(result, results_console())


def _show_verify(result: Any, values: dict[str, Any], as_json: bool) -> None:
    from sketchcal.ui import print_json, results_console
    from sketchcal.verify.report import print_table

    print_json(result.to_dict()) if as_json else print_table(result, results_console())


settings_command(
    "calibrate",
    CalibrateSettings,
    "sketchcal.calibrate.run:calibrate",
    "Capture window-aligned state and effective-query statistics of MODEL.",
    show=_show_calibration,
)
settings_command(
    "convert",
    ConvertSettings,
    "sketchcal.artifact.convert:convert",
    "Fit sketch bases, allocate per-head ranks and write a loadable model directory.",
    show=_show_convert,
)


@app.command()
def inspect(
    model_dir: Annotated[Path, typer.Argument(help="Directory written by sketchcal convert")],
    plots_dir: Annotated[
        Path | None, typer.Option(help="Where to write the PNG plots (default DIR/plots)")
    ] = None,
    plots: Annotated[bool, typer.Option(help="Write the rank heatmap and error-vs-rank plots")] = True,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Per-layer ranks, predicted errors and bytes of a converted model, with plots."""
    from rich.console import Console

    from sketchcal.artifact import inspect as run
    from sketchcal.ui import print_json, results_console

    result = run(
        model_dir, plots_dir, plots=plots, console=Console(quiet=True) if as_json else results_console()
    )
    if as_json:
        print_json(result.to_dict())


@app.command()
def bench(
    model: Annotated[
        str | None,
        typer.Argument(
            help="--e2e only: a real config with random weights (qwen3.5-4b, nemotron-3-nano, "
            "kimi-linear-48b), a converted model directory, or a model id / builtin:NAME"
        ),
    ] = None,
    e2e: Annotated[
        bool, typer.Option(help="Time whole-model decoding (tokens/s) instead of the kernels")
    ] = False,
    family: Annotated[str, typer.Option(help="Kernels: mamba2, gdn or kda")] = "gdn",
    batch: Annotated[str, typer.Option(help="Sequences per decode step; several as 64,256,512")] = "256",
    rank: Annotated[float, typer.Option(help="Mean sketch rank (realistic per-head spread)")] = 8,
    window: Annotated[int, typer.Option(help="Window length L")] = 16,
    read_dtype: Annotated[
        str, typer.Option(help="Kernels: read copy and sketch precision, bf16, fp32 or fp8 (e4m3)")
    ] = "bf16",
    pools: Annotated[int, typer.Option(help="Kernels: state pools rotated for a cold L2")] = 4,
    tune: Annotated[bool, typer.Option(help="Kernels: tune launch shapes first")] = False,
    staggered: Annotated[
        bool, typer.Option(help="Kernels: also time windows in staggered phases (each step flushes ~B/L)")
    ] = False,
    paged: Annotated[
        bool, typer.Option(help="Kernels: window pools laid out as vLLM's pages (the plugin's GPU path)")
    ] = False,
    prompt_len: Annotated[int, typer.Option(help="--e2e: prompt tokens per sequence")] = 1024,
    new_tokens: Annotated[int, typer.Option(help="--e2e: decoded tokens per sequence")] = 256,
    modes: Annotated[
        str,
        typer.Option(
            help="--e2e: comma-separated among generate,own,public,standard,replay,sketch,bound,adaptive"
        ),
    ] = "generate,own,public,standard,replay,sketch,bound",
    layers: Annotated[int | None, typer.Option(help="--e2e: cut kimi-linear-48b to this many layers")] = None,
    prefill_rows: Annotated[
        int | None, typer.Option(help="--e2e: prefill the recurrent layers this many sequences at a time")
    ] = None,
    json_out: Annotated[Path | None, typer.Option(help="Also write the results as JSON")] = None,
) -> None:
    """Time decoding on a CUDA device: the decode kernels of one layer (standard, replay, sketch,
    the public kernels), or with --e2e whole models (tokens/s of generate(), the graph decoder with
    the model's own kernels, with the best public kernels and with ours, and the Amdahl bound)."""
    import json as _json

    from sketchcal.fsutil import write_bytes

    try:
        batches = [int(b) for b in batch.split(",")]
    except ValueError:
        raise SketchcalError(f"--batch takes integers separated by commas, got {batch!r}") from None
    if not batches or min(batches) < 1:
        raise SketchcalError("--batch must be positive")
    if e2e:
        from sketchcal.runtime.e2e_bench import print_e2e, run_e2e

        if model is None:
            raise SketchcalError(
                "--e2e needs a MODEL: a real config name, a converted directory or a model id"
            )
        result = run_e2e(
            model,
            batches,
            prompt=prompt_len,
            new=new_tokens,
            rank=rank,
            window=window,
            modes=tuple(m for m in modes.split(",") if m),
            layers=layers,
            prefill_rows=prefill_rows,
        )
        print_e2e(result)
        results: object = result
    else:
        from sketchcal.kernels.bench import print_bench, run_bench

        if model is not None:
            raise SketchcalError("a MODEL argument is for --e2e; the kernel benchmark takes --family")
        if family not in ("mamba2", "gdn", "kda"):
            raise SketchcalError(f"unknown --family {family!r}; choose mamba2, gdn or kda")
        results = []
        for b in batches:
            r = run_bench(
                family, b, rank, window, read_dtype, pools, tune=tune, staggered=staggered, paged=paged
            )
            print_bench(r)
            results.append(r)
        results = results[0] if len(results) == 1 else results
    if json_out is not None:
        write_bytes(json_out, _json.dumps(results, indent=1, default=str).encode())


settings_command(
    "verify",
    VerifySettings,
    "sketchcal.verify.run:verify",
    "Accuracy and traffic of a converted model in standard, replay and sketch modes.",
    show=_show_verify,
    extra=lambda: {"command": "sketchcal " + " ".join(sys.argv[1:])},
)


@app.command()
def push(
    model_dir: Annotated[Path, typer.Argument(help="Directory written by sketchcal convert")],
    repo_id: Annotated[str, typer.Option(help="Hub model repo NAMESPACE/NAME (created if missing)")],
    private: Annotated[bool, typer.Option(help="Create the repo private (only when it is new)")] = False,
    revision: Annotated[str | None, typer.Option(help="Branch to commit to (default main)")] = None,
    dry_run: Annotated[bool, typer.Option(help="List the files and sizes; upload nothing")] = False,
    verify_report: Annotated[
        Path | None, typer.Option(help="verify.json to put in the card (default DIR/verify/verify.json)")
    ] = None,
    base_model: Annotated[
        str | None, typer.Option(help="Hub id for the card's base_model (default: the sketch's base)")
    ] = None,
    commit_message: Annotated[str | None, typer.Option(help="Commit message")] = None,
) -> None:
    """Upload a converted model to the Hugging Face Hub in one commit, with a model card."""
    from sketchcal.hub import print_push_result
    from sketchcal.hub import push as run
    from sketchcal.ui import console

    result = run(
        model_dir,
        repo_id,
        private=private,
        revision=revision,
        dry_run=dry_run,
        verify_report=verify_report,
        base_model=base_model,
        commit_message=commit_message,
    )
    print_push_result(result, console)


@app.command(
    "lm-eval",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
def lm_eval_command(ctx: typer.Context) -> None:
    """Run lm-evaluation-harness with the sketchcal model registered; all arguments go to lm-eval.

    Example: sketchcal lm-eval --model_args pretrained=DIR,mode=sketch --tasks hellaswag
    (--model sketchcal is added when no --model is given).
    """
    from sketchcal.hub.lm_eval_model import main as run

    run(list(ctx.args))


def main() -> None:
    """Console entry point: user errors are one line on stderr and exit status 2."""
    try:
        app()
    except SketchcalError as err:
        from rich.console import Console

        Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
