"""The options of ``calibrate``, ``convert`` and ``verify``, written once for the CLI and the Python API.

Each command has one frozen dataclass. A field carries its default and, in its metadata, the help
text and how the command line spells it (see :func:`option`); ``sketchcal.cli`` builds the Typer
command from the fields and the API function (``sketchcal.calibrate(model, **options)``...) builds the
same dataclass from its keywords, so both check the same values with the same one-line
:class:`~sketchcal.errors.SketchcalError`. Value checks that need the numerical modules (basis kinds,
dtype names) import them when a settings object is made, never when this module is imported: the CLI
imports it before any command runs.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import types
import typing
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from sketchcal.errors import SketchcalError


def option(
    default: Any = MISSING,
    help: str = "",
    *,
    flag: str | None = None,
    argument: bool = False,
    cli: bool = True,
    cli_type: Any = None,
    defines_run: bool = True,
) -> Any:
    """A settings field.

    Args:
        default: the default (omitted: required).
        help: the one-line help text of the CLI.
        flag: the CLI's declaration when it is not ``--field-name`` (e.g. ``"--sample/--greedy"``).
        argument: a positional CLI argument instead of an option.
        cli: False for an API-only field (no CLI option).
        cli_type: the type the CLI parses when it differs from the field's (e.g. a list for a tuple).
        defines_run: part of what identifies a calibration run (a resumed run must match it).

    It returns a ``dataclasses.field``; ruff's RUF009 cannot see that, hence its ``noqa`` on the
    fields whose type is not an immutable builtin.
    """
    meta = {
        "help": help,
        "flag": flag,
        "argument": argument,
        "cli": cli,
        "cli_type": cli_type,
        "defines_run": defines_run,
    }
    return field(default=default, metadata=meta)


def _types_in(hint: Any) -> tuple[Any, ...]:
    return typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)


class CommandSettings:
    """Base of the per-command settings: coerces paths, then runs the subclass's :meth:`check`."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):  # type: ignore[arg-type]
            value, kinds = getattr(self, f.name), _types_in(hints[f.name])
            if isinstance(value, str) and Path in kinds:
                self._set(f.name, Path(value))
            elif isinstance(value, os.PathLike) and str in kinds and Path not in kinds:
                self._set(f.name, os.fspath(value))
        self.check()

    def check(self) -> None:
        """Raise a one-line :class:`SketchcalError` for a value no run can use."""

    def _set(self, name: str, value: Any) -> None:
        """Replace a field while the (frozen) object is being made."""
        object.__setattr__(self, name, value)


def cli_fields(settings: type) -> list[tuple[Field, Any]]:
    """The fields the CLI exposes, each with the type the CLI parses, in declaration order."""
    hints = typing.get_type_hints(settings)
    return [(f, f.metadata["cli_type"] or hints[f.name]) for f in fields(settings) if f.metadata["cli"]]


def cli_flag(settings: type, name: str) -> str:
    """How the command line spells field ``name`` of ``settings``: ``--seq-len``, ``--sample/--greedy``,
    or the argument's name in capitals."""
    f = next(f for f in fields(settings) if f.name == name)
    if f.metadata["argument"]:
        return name.upper()
    return f.metadata["flag"] or "--" + name.replace("_", "-")


def api_signature(settings: type, positional: str) -> inspect.Signature:
    """The signature ``fn(positional, *, option=default, ...)`` of an API function over ``settings``
    (set as its ``__signature__``, so ``help()`` and IDEs show the real keywords)."""
    hints = typing.get_type_hints(settings)
    params = []
    for f in fields(settings):
        default = inspect.Parameter.empty if f.default is MISSING else f.default
        kind = inspect.Parameter.KEYWORD_ONLY
        if f.name == positional:
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        params.append(inspect.Parameter(f.name, kind, default=default, annotation=hints[f.name]))
    params.sort(key=lambda p: p.kind)
    return inspect.Signature(params)


SAMPLES_CPU = 64  # calibration samples by default on the CPU
SAMPLES_GPU = 256  # and on a GPU


def _positive(settings: CommandSettings, *names: str) -> None:
    for name in names:
        value = getattr(settings, name)
        if value < 1:
            raise SketchcalError(f"--{name.replace('_', '-')} must be positive (got {value})")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SketchcalError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, got {value!r}")


@dataclass(frozen=True)
class CalibrateSettings(CommandSettings):
    """Options of ``sketchcal calibrate`` / :func:`sketchcal.calibrate`.

    Samples are ``seq_len`` tokens of ``data``. With ``gen_tokens`` > 0 each sample is a prompt followed
    by that many generated tokens, and only those are decoded; otherwise the first ``prompt_len``
    tokens (default 0: the whole sample is decoded, in windows from its first token) are the prompt
    and the rest is teacher-forced. Windows of ``window`` tokens start at the end of the prompt.
    ``samples`` defaults to :data:`SAMPLES_CPU` on the CPU and :data:`SAMPLES_GPU` on a GPU (see
    :meth:`for_device`). Every ``save_every`` rounds of batches the progress is saved, so an
    interrupted run continues with ``resume=True``. ``prompt_len`` and ``heldout_samples`` hold
    their resolved values once the object exists (``heldout_samples`` once ``samples`` does).
    """

    model: str | None = option(
        None, "Hub id, local directory or builtin:NAME (default: builtin:tiny-gdn)", argument=True
    )
    out: Path = option(Path("stats"), "Statistics directory to write", defines_run=False)  # noqa: RUF009
    data: str | None = option(
        None, "builtin (default), a .txt/.jsonl/.parquet file or folder, or a dataset id"
    )
    samples: int | None = option(
        None, f"Calibration samples (default {SAMPLES_CPU} on the CPU, {SAMPLES_GPU} on a GPU)"
    )
    seq_len: int = option(512, "Tokens per sample")
    gen_tokens: int = option(0, "Tokens to generate after each sample (0: teacher-forced)")
    prompt_len: int | None = option(
        None, "Prompt tokens when not generating (default 0: every token is decoded)"
    )
    window: int = option(16, "Window length L (tokens per flush)")
    heldout_samples: int | None = option(None, "Held-out samples (default: samples/8)")
    heldout_windows: int = option(64, "Held-out windows kept verbatim per layer")
    batch_size: int = option(8, "Samples per batch")
    seed: int = option(0, "Seed for sample selection and sampling")
    chat_template: bool = option(False, "Wrap samples in the tokenizer's chat template")
    do_sample: bool = option(False, "Sample generated tokens", flag="--sample/--greedy")
    temperature: float = option(1.0, "Sampling temperature")
    device: str = option("auto", "auto, cpu, cuda, cuda:N", defines_run=False)
    dtype: str = option("auto", "auto, float32, bfloat16, float16")
    device_map: str | None = option(None, "e.g. auto: split a large model over the GPUs", defines_run=False)
    revision: str | None = option(None, "Model revision (branch, tag or commit)")
    trust_remote_code: bool = option(
        False, "Allow the model's own code (only if you trust it)", defines_run=False
    )
    text_field: str = option("text", "Text field of .jsonl/.parquet/dataset rows")
    data_revision: str | None = option(None, "Dataset revision")
    resume: bool = option(False, "Continue an interrupted run in --out", defines_run=False)
    overwrite: bool = option(False, "Replace the statistics in --out", defines_run=False)
    save_every: int = option(4, "Save progress every N rounds of batches", defines_run=False)
    progress: bool = option(True, "Show a progress bar", defines_run=False)

    def check(self) -> None:
        if self.window < 2:
            raise SketchcalError(f"--window must be at least 2 (got {self.window})")
        _positive(
            self, "seq_len", "batch_size", "save_every", *(("samples",) if self.samples is not None else ())
        )
        if self.gen_tokens < 0 or self.heldout_windows < 0 or (self.heldout_samples or 0) < 0:
            raise SketchcalError("--gen-tokens, --heldout-samples and --heldout-windows must not be negative")
        if self.gen_tokens == 0 and self.prompt_len is not None and not 0 <= self.prompt_len < self.seq_len:
            raise SketchcalError(
                f"--prompt-len {self.prompt_len} leaves no decoded tokens in samples of {self.seq_len}; "
                "make it smaller than --seq-len or generate tokens with --gen-tokens"
            )
        if self.prompt_len is None:
            self._set("prompt_len", self.seq_len if self.gen_tokens > 0 else 0)
        decoded = self.gen_tokens if self.gen_tokens > 0 else self.seq_len - self.prompt_len
        if self.window > decoded:
            how = "--gen-tokens" if self.gen_tokens > 0 else "--seq-len minus --prompt-len"
            raise SketchcalError(
                f"--window {self.window} is longer than the {decoded} tokens each sample decodes ({how}), "
                "so no window would complete; lower --window or decode more tokens"
            )
        if self.do_sample and not (math.isfinite(self.temperature) and self.temperature > 0):
            raise SketchcalError(
                f"--temperature must be positive when sampling (got {self.temperature}); "
                "for greedy decoding pass --greedy instead of --sample"
            )
        from sketchcal.models.loading import DTYPES

        _choice("dtype", self.dtype, tuple(DTYPES))
        if self.heldout_samples is None and self.samples is not None:
            self._set("heldout_samples", max(1, self.samples // 8))

    def for_device(self, device: str) -> CalibrateSettings:
        """These settings with ``samples`` resolved for the resolved ``device`` (``cpu``, ``cuda:N``)."""
        if self.samples is not None:
            return self
        samples = SAMPLES_GPU if device.startswith("cuda") else SAMPLES_CPU
        return dataclasses.replace(self, samples=samples)

    def run_identity(self) -> dict[str, Any]:
        """The fields that define the run's result: a resumed run must have the same."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata["defines_run"]}


@dataclass(frozen=True)
class ConvertSettings(CommandSettings):
    """Options of ``sketchcal convert`` / :func:`sketchcal.convert`.

    Exactly one budget: ``rank`` (mean rank over all heads of all layers, dense heads count as K) or
    ``bytes_per_token`` (state traffic per sequence and decoded token, all mixer layers together; the
    byte model is :mod:`sketchcal.fit.traffic`). ``allocation="output"`` gives each head the rank
    that lowers the predicted KL most for its bytes; ``"uniform"`` gives every head the same rank.
    ``model`` defaults to the statistics' model when it is available locally; its fingerprint must
    match the statistics'. ``shrinkage="auto"`` fits with each E estimator and keeps the one whose
    allocation has the lowest held-out predicted KL. ``read_dtype`` and ``buffer_dtype`` only enter
    the byte model.
    """

    stats_dir: str = option(help="Statistics directory written by calibrate, or a Hub id", argument=True)
    out: Path | None = option(None, "Model directory to write (must not exist)")  # noqa: RUF009
    rank: float | None = option(None, "Mean rank over all heads (dense heads count as K)")
    bytes_per_token: float | None = option(
        None, "State traffic budget, bytes per sequence and token (instead of --rank)"
    )
    model: str | None = option(
        None, "Base model (directory, cached Hub id or builtin:NAME); default: the stats'"
    )
    reference_only: bool = option(False, "Write config + sketch only, no weights")
    allocation: str = option("output", "output (least predicted KL, default), or the ablation uniform")
    sketch_map: str = option(
        "static",
        "static (offline maps, default) or adaptive (a map made for each checkpoint at its flush; "
        "--rank M then means static rank M's bytes)",
    )
    basis: str = option("state", "state (default), or the ablations pca / random")
    coef: str = option("state", "state (least-squares maps), or the ablation projection (E = I)")
    shrinkage: str = option("auto", "auto, ledoit_wolf, oas or none")
    read_dtype: str = option("float32", "Read copy / sketch precision of the byte model: float32, bf16, fp8")
    buffer_dtype: str = option("bfloat16", "ReplaySSM buffer precision of the byte model")
    seed: int = option(0, "Seed of the random-basis ablation")
    stats_revision: str | None = option(None, "Revision of STATS_DIR when it is a Hub id")
    revision: str | None = option(None, "Revision of --model when it is a Hub id")
    progress: bool = option(True, "Show a progress bar")

    def check(self) -> None:
        from sketchcal.fit.allocate import ALLOCATIONS, validate_budget
        from sketchcal.fit.basis import BASIS_KINDS
        from sketchcal.fit.layer import COEF_KINDS
        from sketchcal.fit.ranks import SKETCH_MAPS
        from sketchcal.fit.shrinkage import SHRINKAGE_METHODS
        from sketchcal.fit.traffic import dtype_bytes

        if self.out is None:
            raise SketchcalError("give an output directory (--out DIR)")
        if self.out.exists():
            raise SketchcalError(f"{self.out} already exists; choose another --out or remove it first")
        validate_budget(self.rank, self.bytes_per_token, math.inf)  # the key dim is checked on the stats
        _choice("allocation", self.allocation, ALLOCATIONS)
        _choice("sketch_map", self.sketch_map, SKETCH_MAPS)
        _choice("basis", self.basis, BASIS_KINDS)
        _choice("coef", self.coef, COEF_KINDS)
        _choice("shrinkage", self.shrinkage, ("auto", *SHRINKAGE_METHODS))
        for name in ("read_dtype", "buffer_dtype"):
            try:
                dtype_bytes(getattr(self, name))
            except ValueError as err:
                raise SketchcalError(f"--{name.replace('_', '-')}: {err}") from None


@dataclass(frozen=True)
class VerifySettings(CommandSettings):
    """Options of ``sketchcal verify`` / :func:`sketchcal.verify`.

    ``baseline`` (Hub id, directory, ``builtin:NAME``) supplies the weights every mode runs; default:
    the weights in ``model_dir``, else its base model. ``data`` is read as ``calibrate --data`` (only its
    held-out split). Each ``rank`` budget re-fits the sketch from the calibration statistics
    (``stats``, default: the artifact's provenance). ``command`` is the command line the report shows
    (default: the equivalent CLI call).
    """

    model_dir: str = option(help="Directory written by sketchcal convert, or a Hub id", argument=True)
    baseline: str | None = option(None, "Full-state model (default: the weights in DIR, else its base)")
    data: str | None = option(None, "Held-out text source (default: the built-in corpus)")
    tokens: int = option(512, "Teacher-forced decode tokens per sample (at least calibration's --seq-len)")
    rank: tuple[float, ...] = option(
        (), "Mean-rank budgets to sweep (repeat the option)", cli_type=list[float] | None
    )
    prompt: int = option(16, "Prompt tokens prefilled before decoding")
    samples: int = option(16, "Held-out samples")
    batch_size: int = option(8, "Samples per batch")
    read_dtype: str | None = option(None, "Read copy / sketch precision: fp32, bf16, fp16, fp8")
    stats: Path | None = option(None, "Calibration statistics (default: the artifact's)")  # noqa: RUF009
    out: Path | None = option(None, "Report folder (default DIR/verify, or verify-NAME)")  # noqa: RUF009
    ablations: bool = option(True, "Also run PCA, random and shared-precision ablations")
    sketch_map: str | None = option(
        None,
        "Sketch reads: static (offline maps) or adaptive (maps made at each flush); default: the artifact's",
    )
    retrieval: bool = option(True, "Run the associative-recall test")
    plots: bool = option(True, "Write the PNG plots")
    device: str = option("auto", "auto, cpu, cuda")
    dtype: str = option("float32", "Compute dtype of every row: float32 (default), bfloat16, float16, auto")
    seed: int = option(0, "Seed for sample selection")
    text_field: str = option("text", "Text field of .jsonl/.parquet/dataset rows")
    data_revision: str | None = option(None, "Dataset revision")
    revision: str | None = option(None, "Revision when MODEL_DIR is a Hub id")
    command: str | None = option(None, cli=False)
    progress: bool = option(True, "Show a progress bar")

    def check(self) -> None:
        rank = self.rank
        ranks = () if rank is None else (rank,) if isinstance(rank, int | float) else tuple(rank)
        self._set("rank", tuple(float(r) for r in ranks))
        _positive(self, "tokens", "samples", "batch_size")
        if self.prompt < 0:
            raise SketchcalError(f"--prompt must not be negative (got {self.prompt})")
        if any(not math.isfinite(r) or r <= 0 for r in self.rank):
            raise SketchcalError("--rank budgets must be positive")
        if self.stats is not None and not self.stats.is_dir():
            raise SketchcalError(f"statistics directory {self.stats} does not exist")
        if self.read_dtype is not None:
            from sketchcal.runtime.precision import parse_dtype

            parse_dtype(self.read_dtype)
        from sketchcal.models.loading import DTYPES

        _choice("dtype", self.dtype, tuple(DTYPES))
        if self.sketch_map is not None:
            from sketchcal.runtime.sketch import SKETCH_MAPS

            if self.sketch_map not in SKETCH_MAPS:
                raise SketchcalError(
                    f"--sketch-map must be {' or '.join(SKETCH_MAPS)}, got {self.sketch_map!r}"
                )
