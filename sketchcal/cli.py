"""The ``sketchcal`` command line: a thin Typer shell over the Python API."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from sketchcal.errors import SketchcalError

app = typer.Typer(
    name="sketchcal",
    help="Calibrate, convert, verify and benchmark SketchSSM read sketches for hybrid models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """sketchcal: offline calibration for SketchSSM decoding."""


@app.command()
def calibrate(
    model: Annotated[
        str | None, typer.Argument(help="Hub id, local directory or builtin:NAME (default: builtin:tiny-gdn)")
    ] = None,
    out: Annotated[Path, typer.Option(help="Statistics directory to write")] = Path("stats"),
    data: Annotated[
        str | None,
        typer.Option(help="builtin (default), a .txt/.jsonl/.parquet file or folder, or a dataset id"),
    ] = None,
    samples: Annotated[int, typer.Option(help="Calibration samples")] = 64,
    seq_len: Annotated[int, typer.Option(help="Tokens per sample")] = 256,
    gen_tokens: Annotated[
        int, typer.Option(help="Tokens to generate after each sample (0: teacher-forced)")
    ] = 0,
    prompt_len: Annotated[
        int | None, typer.Option(help="Prompt tokens when not generating (default: half the sample)")
    ] = None,
    window: Annotated[int, typer.Option(help="Window length L (tokens per flush)")] = 16,
    heldout_samples: Annotated[int | None, typer.Option(help="Held-out samples (default: samples/8)")] = None,
    heldout_windows: Annotated[int, typer.Option(help="Held-out windows kept verbatim per layer")] = 64,
    batch_size: Annotated[int, typer.Option(help="Samples per batch")] = 8,
    seed: Annotated[int, typer.Option(help="Seed for sample selection and sampling")] = 0,
    chat_template: Annotated[
        bool, typer.Option(help="Wrap samples in the tokenizer's chat template")
    ] = False,
    sample: Annotated[bool, typer.Option("--sample/--greedy", help="Sample generated tokens")] = False,
    temperature: Annotated[float, typer.Option(help="Sampling temperature")] = 1.0,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16, float16")] = "auto",
    device_map: Annotated[
        str | None, typer.Option(help="e.g. auto: split a large model over the GPUs")
    ] = None,
    revision: Annotated[str | None, typer.Option(help="Model revision (branch, tag or commit)")] = None,
    trust_remote_code: Annotated[
        bool, typer.Option(help="Allow the model's own code (only if you trust it)")
    ] = False,
    text_field: Annotated[str, typer.Option(help="Text field of .jsonl/.parquet/dataset rows")] = "text",
    data_revision: Annotated[str | None, typer.Option(help="Dataset revision")] = None,
    resume: Annotated[bool, typer.Option(help="Continue an interrupted run in --out")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace the statistics in --out")] = False,
    save_every: Annotated[int, typer.Option(help="Save progress every N rounds of batches")] = 4,
) -> None:
    """Capture window-aligned state and effective-query statistics of MODEL."""
    from sketchcal import calibrate as run

    run(
        model,
        out=out,
        data=data,
        samples=samples,
        seq_len=seq_len,
        gen_tokens=gen_tokens,
        prompt_len=prompt_len,
        window=window,
        heldout_samples=heldout_samples,
        heldout_windows=heldout_windows,
        batch_size=batch_size,
        seed=seed,
        chat_template=chat_template,
        do_sample=sample,
        temperature=temperature,
        device=device,
        dtype=dtype,
        device_map=device_map,
        revision=revision,
        trust_remote_code=trust_remote_code,
        text_field=text_field,
        data_revision=data_revision,
        resume=resume,
        overwrite=overwrite,
        save_every=save_every,
    )


@app.command()
def convert(
    stats_dir: Annotated[str, typer.Argument(help="Statistics directory written by calibrate, or a Hub id")],
    out: Annotated[Path, typer.Option(help="Model directory to write (must not exist)")],
    rank: Annotated[
        float | None, typer.Option(help="Mean rank over all heads (dense heads count as K)")
    ] = None,
    bytes_per_token: Annotated[
        float | None,
        typer.Option(help="State traffic budget, bytes per sequence and token (instead of --rank)"),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(help="Base model (directory, cached Hub id or builtin:NAME); default: the stats'"),
    ] = None,
    reference_only: Annotated[bool, typer.Option(help="Write config + sketch only, no weights")] = False,
    basis: Annotated[str, typer.Option(help="state (default), or the ablations pca / random")] = "state",
    shrinkage: Annotated[str, typer.Option(help="auto, ledoit_wolf, oas or none")] = "auto",
    seed: Annotated[int, typer.Option(help="Seed of the random-basis ablation")] = 0,
    stats_revision: Annotated[
        str | None, typer.Option(help="Revision of STATS_DIR when it is a Hub id")
    ] = None,
    revision: Annotated[str | None, typer.Option(help="Revision of --model when it is a Hub id")] = None,
) -> None:
    """Fit sketch bases, allocate per-head ranks and write a loadable model directory."""
    from sketchcal.artifact import convert as run
    from sketchcal.artifact.report import print_convert_result
    from sketchcal.ui import console

    if (rank is None) == (bytes_per_token is None):
        raise SketchcalError("give exactly one budget: --rank M or --bytes-per-token B")
    from sketchcal.hub.resolve import is_hub_id, resolve

    if is_hub_id(model):
        model = str(resolve(model, revision=revision))
    result = run(
        resolve(stats_dir, revision=stats_revision),
        rank=rank,
        bytes_per_token=bytes_per_token,
        out=out,
        model=model,
        reference_only=reference_only,
        basis=basis,
        shrinkage=shrinkage,
        seed=seed,
    )
    print_convert_result(result, console=console)


@app.command()
def inspect(
    model_dir: Annotated[Path, typer.Argument(help="Directory written by sketchcal convert")],
    plots_dir: Annotated[
        Path | None, typer.Option(help="Where to write the PNG plots (default DIR/plots)")
    ] = None,
    plots: Annotated[bool, typer.Option(help="Write the rank heatmap and error-vs-rank plots")] = True,
) -> None:
    """Per-layer ranks, predicted errors and bytes of a converted model, with plots."""
    from sketchcal.artifact import inspect as run
    from sketchcal.ui import console

    run(model_dir, plots_dir, plots=plots, console=console)


@app.command()
def bench(
    family: Annotated[str, typer.Option(help="mamba2, gdn or kda")] = "gdn",
    batch: Annotated[int, typer.Option(help="Sequences per decode step")] = 256,
    rank: Annotated[float, typer.Option(help="Mean sketch rank (realistic per-head spread)")] = 8,
    window: Annotated[int, typer.Option(help="Window length L")] = 16,
    read_dtype: Annotated[
        str, typer.Option(help="Read copy and sketch precision: bf16, fp32 or fp8 (e4m3)")
    ] = "bf16",
    pools: Annotated[int, typer.Option(help="State pools rotated for a cold L2")] = 4,
    tune: Annotated[bool, typer.Option(help="Tune launch shapes first")] = False,
    json_out: Annotated[Path | None, typer.Option(help="Also write the results as JSON")] = None,
    staggered: Annotated[
        bool, typer.Option(help="Also time windows in staggered phases (each step flushes ~B/L sequences)")
    ] = False,
) -> None:
    """Time the decode kernels (standard, replay, sketch, public anchor) on a CUDA device."""
    from sketchcal.kernels.bench import main as run

    if family not in ("mamba2", "gdn", "kda"):
        raise SketchcalError(f"unknown --family {family!r}; choose mamba2, gdn or kda")
    run(
        family,
        batch,
        rank,
        window,
        read_dtype,
        pools,
        tune,
        None if json_out is None else str(json_out),
        staggered,
    )


@app.command()
def verify(
    model_dir: Annotated[str, typer.Argument(help="Directory written by sketchcal convert, or a Hub id")],
    baseline: Annotated[
        str | None, typer.Option(help="Full-state model (default: the weights in DIR, else its base)")
    ] = None,
    data: Annotated[
        str | None, typer.Option(help="Held-out text source (default: the built-in corpus)")
    ] = None,
    tokens: Annotated[int, typer.Option(help="Teacher-forced decode tokens per sample")] = 128,
    rank: Annotated[
        list[float] | None, typer.Option(help="Mean-rank budgets to sweep (repeat the option)")
    ] = None,
    prompt: Annotated[int, typer.Option(help="Prompt tokens prefilled before decoding")] = 32,
    samples: Annotated[int, typer.Option(help="Held-out samples")] = 16,
    batch_size: Annotated[int, typer.Option(help="Samples per batch")] = 8,
    read_dtype: Annotated[
        str | None, typer.Option(help="Read copy / sketch precision: fp32, bf16, fp16, fp8")
    ] = None,
    stats: Annotated[
        Path | None, typer.Option(help="Calibration statistics (default: the artifact's provenance)")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Report folder (default DIR/verify)")] = None,
    ablations: Annotated[
        bool, typer.Option(help="Also run PCA, random and shared-precision ablations")
    ] = True,
    retrieval: Annotated[bool, typer.Option(help="Run the associative-recall test")] = True,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda")] = "auto",
    seed: Annotated[int, typer.Option(help="Seed for sample selection")] = 0,
    revision: Annotated[str | None, typer.Option(help="Revision when MODEL_DIR is a Hub id")] = None,
) -> None:
    """Accuracy and traffic of a converted model in standard, replay and sketch modes."""
    from sketchcal.hub.resolve import is_hub_id, resolve
    from sketchcal.verify import verify as run

    if is_hub_id(model_dir) and out is None:
        out = Path("verify-" + model_dir.split("/")[-1])  # never write into the Hugging Face cache
    run(
        resolve(model_dir, revision=revision),
        baseline=baseline,
        data=data,
        tokens=tokens,
        rank=rank or None,
        out=out,
        prompt=prompt,
        samples=samples,
        batch_size=batch_size,
        read_dtype=read_dtype,
        stats=stats,
        ablations=ablations,
        retrieval=retrieval,
        device=device,
        seed=seed,
        command="sketchcal " + " ".join(sys.argv[1:]),
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
        from sketchcal.ui import console

        console.print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
