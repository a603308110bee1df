"""``convert``: fit bases, allocate ranks and write a loadable model directory with its sketch.

Output layout (``OUT/``, built under a temporary name and renamed into place at the end):

```
config.json                      the base config, unchanged, plus a top-level "sketch_config" section
sketch/sketch.safetensors        frames, coefficient maps, ranks (see sketchcal.artifact.sketch)
README.md                        model card (base_model, base_model_relation, tags, allocation summary)
calibration/stats-manifest.json  copy of the statistics manifest (provenance)
calibration/allocation.json      the allocation summary, per layer
calibration/curves.safetensors   per-layer error curves (for inspect)
*.safetensors, tokenizer ...     the base model's files, hard-linked (else copied); absent when reference-only
```

:func:`convert` is three steps, each usable alone: :func:`resolve_inputs` (statistics, base model,
checks; reads only) → :func:`fit_sketch` (bases and per-head ranks under the budget, in memory) →
:func:`write_artifact` (the directory, atomically). ``verify`` re-fits its rank sweeps and ablations
with :func:`fit_sketch` and :func:`sketch_section` without writing anything.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sketchcal.artifact.card import model_card
from sketchcal.artifact.fingerprint import config_fingerprint, load_config
from sketchcal.artifact.modelsrc import (
    BaseModel,
    has_pickled_weights,
    has_safetensors,
    place_files,
    resolve_base,
)
from sketchcal.artifact.sketch import (
    CONFIG_KEY,
    PRODUCER,
    SKETCH_FILE,
    SKETCH_FORMAT,
    SKETCH_VERSION,
    SketchLayer,
    write_sketch,
)
from sketchcal.errors import SketchcalError, first_line
from sketchcal.fit.allocate import Allocation, allocate, validate_budget
from sketchcal.fit.evaluate import fit_all
from sketchcal.fit.layer import LayerFit
from sketchcal.fit.ranks import SUPPORTED_RANKS
from sketchcal.fit.shrinkage import SHRINKAGE_METHODS
from sketchcal.fit.traffic import TrafficModel, dtype_bytes
from sketchcal.formats.stats import Stats, load_stats
from sketchcal.fsutil import atomic_dir, check_writable, finite_json
from sketchcal.integrity import save_safetensors, short, tensor_file_digests, weights_fingerprint
from sketchcal.settings import ConvertSettings, api_signature

if TYPE_CHECKING:
    from sketchcal.models.loading import LoadedModel

CURVES_FILE = "calibration/curves.safetensors"
ALLOCATION_FILE = "calibration/allocation.json"
MANIFEST_COPY = "calibration/stats-manifest.json"


@dataclass
class ConvertResult:
    """What :func:`convert` wrote."""

    out: Path
    allocation: Allocation
    weights: str  # "linked" | "copied" | "linked+copied" | "saved" (built-in model) | "reference"
    base_model: str | None
    sketch_config: dict[str, Any]
    shrinkage: str  # the E estimator used
    shrinkage_scores: dict[str, float | None]  # held-out predicted KL of the allocation per estimator tried
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: what ``sketchcal convert --json`` prints."""
        return {
            "out": str(self.out),
            "weights": self.weights,
            "base_model": self.base_model,
            "shrinkage": self.shrinkage,
            "shrinkage_scores": self.shrinkage_scores,
            "allocation": finite_json(self.allocation.to_dict()),
            "sketch_config": self.sketch_config,
            "notes": self.notes,
        }


def convert(stats_dir: str | Path, **options: Any) -> ConvertResult:
    """Fit sketch bases from a statistics directory, allocate per-head ranks and write a model directory.

    ``stats_dir``: the directory ``sketchcal calibrate`` wrote (docs/stats-format.md), or a Hub id.
    The options are the fields of :class:`~sketchcal.settings.ConvertSettings` (``out``, exactly one
    of ``rank`` / ``bytes_per_token``, ``model``, ``reference_only``, ``basis``, ...), the same as
    ``sketchcal convert``'s.

    Returns:
        :class:`ConvertResult`; ``result.notes`` holds things the user should read (fallbacks).

    Raises:
        SketchcalError: bad statistics (missing/truncated/NaN/incomplete), a fingerprint mismatch
            with ``model``, an invalid or unreachable budget, or an existing ``out``. Nothing is
            written in any of those cases.
    """
    settings = ConvertSettings(stats_dir=stats_dir, **options)
    inputs = resolve_inputs(settings)
    fit = fit_sketch(
        inputs.stats,
        inputs.traffic,
        SketchChoices.of(settings),
        rank=settings.rank,
        bytes_per_token=settings.bytes_per_token,
        progress=settings.progress,
    )
    return write_artifact(inputs, fit)


convert.__signature__ = api_signature(ConvertSettings, "stats_dir")  # type: ignore[attr-defined]


@dataclass(frozen=True)
class SketchChoices:
    """How a sketch is fitted and what its byte model counts, besides its budget: the fields of
    ``sketch_config`` that :func:`fit_sketch` and :func:`sketch_section` take (docs/sketch-format.md)."""

    basis: str = "state"  # state | pca | random
    coef: str = "state"  # state (least-squares maps) | projection
    shrinkage: str = "auto"  # an E estimator, or auto: the one with the lowest held-out predicted KL
    allocation: str = "output"  # output (least predicted KL) | uniform
    sketch_map: str = "static"  # static | adaptive (the ranks are the adaptive read's)
    read_dtype: str = "float32"
    buffer_dtype: str = "bfloat16"
    seed: int = 0  # of the random-basis ablation

    @classmethod
    def of(cls, settings: Any) -> SketchChoices:
        """The choices among ``settings``' fields (a :class:`ConvertSettings`)."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})

    @classmethod
    def of_section(cls, section: dict[str, Any]) -> SketchChoices:
        """The choices a written ``sketch_config`` section records (defaults where an older one is silent)."""
        shrink = section.get("shrinkage")
        traffic = section.get("traffic") or {}
        default = cls()
        return cls(
            basis=section.get("basis", default.basis),
            coef=section.get("coef", default.coef),
            shrinkage=shrink.get("method", default.shrinkage)
            if isinstance(shrink, dict)
            else default.shrinkage,
            allocation=section.get("allocation", default.allocation),
            sketch_map=section.get("sketch_map", default.sketch_map),
            read_dtype=traffic.get("read_dtype", default.read_dtype),
            buffer_dtype=traffic.get("buffer_dtype", default.buffer_dtype),
        )


@dataclass
class ConvertInputs:
    """What :func:`resolve_inputs` found and checked: everything the fit and the writer need."""

    settings: ConvertSettings
    stats_dir: Path  # local (a Hub id is fetched first)
    stats: Stats
    base: BaseModel
    base_config: Any | None  # the base model's PretrainedConfig, when one was found
    builtin: LoadedModel | None  # a package model (builtin:NAME), built in memory
    weights: str  # what write_artifact places: "full" (the base's files) | "saved" (builtin) | "reference"
    traffic: list[TrafficModel]  # the byte model of each layer, in stats.layers order
    notes: list[str] = field(default_factory=list)
    base_weights_fingerprint: str | None = None  # sketchcal.integrity, of the base's weight files
    base_digests: dict[str, str] = field(default_factory=dict)  # base weight file name -> sha256


@dataclass
class SketchFit:
    """What :func:`fit_sketch` returns: the fitted layers, their allocation and the sketch tensors."""

    fits: list[LayerFit]
    allocation: Allocation
    shrinkage: str  # the E estimator kept
    shrinkage_scores: dict[str, float | None]  # held-out predicted KL of the allocation per estimator tried
    layers: list[SketchLayer]  # frames and coefficient maps in float32, ranks in int32 (as stored)
    notes: list[str] = field(default_factory=list)


def traffic_models(
    family: str, layers: Iterable[Any], window: int, read_dtype: str, buffer_dtype: str
) -> list[TrafficModel]:
    """The byte model of each layer (``key_dim``, ``value_dim``, ``heads_per_group`` attributes: a
    :class:`~sketchcal.formats.stats.LayerInfo` or a model's layer shape), fp32 checkpoints."""
    try:
        read_bytes, buffer_bytes = dtype_bytes(read_dtype), dtype_bytes(buffer_dtype)
    except ValueError as err:
        raise SketchcalError(str(err)) from None
    return [
        TrafficModel(
            family=family,
            key_dim=li.key_dim,
            value_dim=li.value_dim,
            window=window,
            heads_per_group=li.heads_per_group,
            state_bytes=4,
            read_bytes=read_bytes,
            buffer_bytes=buffer_bytes,
        )
        for li in layers
    ]


def resolve_inputs(settings: ConvertSettings) -> ConvertInputs:
    """Find and check everything a conversion reads; nothing is written.

    Fetches a Hub id given as ``stats_dir`` (or ``model``), loads and checks the statistics and the
    budget against their key dims, locates the base model without network access (a directory, the
    Hugging Face cache or ``builtin:NAME``), checks its fingerprint against the statistics', and
    decides what ``write_artifact`` will place for the weights.

    Raises:
        SketchcalError: bad statistics (missing/truncated/NaN/incomplete), a budget above the key dim,
            an unreadable base config or a fingerprint mismatch.
    """
    from sketchcal.hub.resolve import is_hub_id, resolve

    s = settings
    stats_dir = resolve(s.stats_dir, revision=s.stats_revision)
    model = str(resolve(s.model, revision=s.revision)) if is_hub_id(s.model) else s.model
    stats = load_stats(stats_dir)
    validate_budget(s.rank, s.bytes_per_token, max(li.key_dim for li in stats.layers))

    notes: list[str] = []
    base = resolve_base(model, stats.model)
    base_cfg = None
    builtin = None
    if base.builtin is not None:
        from sketchcal.models.loading import load_model

        builtin = load_model(base.builtin, device="cpu")
        base_cfg = builtin.model.config
    elif base.path is not None:
        try:
            base_cfg = load_config(base.path)
        except Exception as err:
            raise SketchcalError(
                f"cannot read the config of base model {base.path}: {first_line(err)}"
            ) from err
    elif base.note:
        notes.append(base.note)
    where = base.builtin or base.path
    if base_cfg is not None:
        fp = config_fingerprint(base_cfg)
        if fp != stats.fingerprint:
            raise SketchcalError(
                f"the statistics in {stats.path} come from another model: their fingerprint "
                f"{stats.fingerprint[:12]}… differs from {where}'s {fp[:12]}…; calibrate this "
                "model or pass the model the statistics were taken on"
            )
    base_fp, base_digests = None, {}
    if builtin is not None:
        base_fp = builtin.weights_fingerprint
    elif base.path is not None:
        base_fp, base_digests = weights_fingerprint(base.path)
    recorded = stats.model.get("weights_fingerprint")
    if recorded and base_fp and recorded != base_fp:
        raise SketchcalError(
            f"the statistics in {stats.path} were taken on other weights than {where} (same architecture, "
            f"weights fingerprint {short(recorded)} vs {short(base_fp)}); pass the model the statistics "
            "were taken on (--model), or calibrate this one"
        )
    if base_fp and not recorded and "weights_fingerprint" not in stats.model:
        notes.append(
            "the statistics record no weights fingerprint (older sketchcal): "
            "the base weights were not checked"
        )
    weights = "reference"
    if not s.reference_only and builtin is not None:
        weights = "saved"
    elif not s.reference_only and base.path is not None:
        if has_safetensors(base.path):
            weights = "full"
        elif has_pickled_weights(base.path):
            notes.append(
                f"base model {base.path} has only pickled weights; wrote a reference-only directory "
                "(convert the base to safetensors to include the weights)"
            )
        else:
            notes.append(f"base model {base.path} has no weight files; wrote a reference-only directory")
    traffic = traffic_models(stats.family, stats.layers, stats.window, s.read_dtype, s.buffer_dtype)
    check_writable(s.out, _output_bytes(stats, base, builtin, weights, s.out), f"the converted model {s.out}")
    return ConvertInputs(
        s, stats_dir, stats, base, base_cfg, builtin, weights, traffic, notes, base_fp, base_digests
    )


def _output_bytes(stats: Stats, base: BaseModel, builtin: LoadedModel | None, weights: str, out: Path) -> int:
    """An upper bound of the bytes a conversion writes: the sketch (coefficient maps at full rank),
    the curves, and the weights when they are saved or copied (hard links cost nothing)."""
    sketch = sum(
        4 * li.key_dim * li.key_dim * (li.heads + li.groups) + 64 * li.heads * 4 for li in stats.layers
    )
    placed = 0
    if weights == "saved" and builtin is not None:
        placed = sum(p.numel() * p.element_size() for p in builtin.model.parameters()) + 8 * 2**20
    elif weights == "full" and base.path is not None:
        target = out.absolute().parent
        while not target.exists():
            target = target.parent
        if base.path.resolve().stat().st_dev != target.stat().st_dev:  # no hard links across devices
            placed = sum(f.resolve().stat().st_size for f in base.path.rglob("*") if f.is_file())
    return sketch + placed + 2**20


def fit_sketch(
    stats: Stats,
    traffic: list[TrafficModel],
    choices: SketchChoices,
    *,
    rank: float | None = None,
    bytes_per_token: float | None = None,
    progress: bool = True,
) -> SketchFit:
    """Fit the bases of every layer of ``stats`` and allocate per-head ranks under one budget.

    With ``choices.shrinkage="auto"`` the layers are fitted once per E estimator and the one whose
    allocation has the lowest held-out predicted KL is kept. ``choices.allocation``: ``"output"``
    (minimum predicted KL) or ``"uniform"`` (:func:`~sketchcal.fit.allocate.allocate`). The result
    holds the sketch tensors as they are stored, so it can be written (:func:`write_artifact`) or used
    in memory (``verify``'s re-fits).
    """
    from sketchcal.ui import progress_bar

    c = choices
    methods = SHRINKAGE_METHODS if c.shrinkage == "auto" else (c.shrinkage,)
    best = None
    scores: dict[str, float | None] = {}
    with progress_bar(enabled=progress) as bar:
        task = bar.add_task("fitting bases", total=len(methods) * len(stats.layers))
        for meth in methods:
            fits = fit_all(
                stats,
                basis=c.basis,
                coef=c.coef,
                shrinkage=meth,
                seed=c.seed,
                adaptive=c.sketch_map == "adaptive",
                on_layer=lambda _: bar.advance(task),
            )
            alloc = allocate(
                fits,
                traffic,
                rank=rank,
                bytes_per_token=bytes_per_token,
                allocation=c.allocation,
                sketch_map=c.sketch_map,
            )
            score = alloc.heldout_score
            scores[meth] = score
            if best is None or (score is not None and (best[3] is None or score < best[3])):
                best = (fits, alloc, meth, score)
    fits, alloc, meth, score = best
    if c.shrinkage == "auto" and score is None:
        alloc.notes.append(f"no held-out data to choose the E shrinkage; used {meth}")
    notes = list(alloc.notes)
    if any(f.measured is None for f in fits):
        notes.append(
            "the statistics hold no held-out window sample for some layers: their measured error is n/a"
        )
    layers = [
        SketchLayer(
            layer=f.layer,
            frame=f.frames.to(torch.float32),
            coef=f.coef_maps(la.ranks).to(torch.float32),
            ranks=torch.tensor(la.ranks, dtype=torch.int32),
        )
        for f, la in zip(fits, alloc.layers, strict=True)
    ]
    return SketchFit(fits, alloc, meth, scores, layers, notes)


def sketch_section(
    stats: Stats, fit: SketchFit, choices: SketchChoices, base_model: dict[str, Any]
) -> dict[str, Any]:
    """The ``sketch_config`` section of config.json for ``fit`` (docs/sketch-format.md), without the
    calibration provenance and the file hashes, which only a written artifact records.

    ``base_model``: ``{"id", "revision", "weights", "weights_fingerprint"}`` of the base model."""
    alloc = fit.allocation
    summary = finite_json(
        {k: v for k, v in alloc.to_dict().items() if k not in ("layers", "notes", "budget")}
    )
    return {
        "format": SKETCH_FORMAT,
        "version": SKETCH_VERSION,
        "producer": dict(PRODUCER),
        "file": SKETCH_FILE,
        "family": stats.family,
        "window": stats.window,
        "fingerprint": stats.fingerprint,
        "base_model": {k: base_model.get(k) for k in ("id", "revision", "weights", "weights_fingerprint")},
        "basis": choices.basis,
        "coef": choices.coef,
        "allocation": alloc.allocation,
        "sketch_map": alloc.sketch_map,
        "shrinkage": {
            "method": fit.shrinkage,
            "selected_by": "held-out predicted KL of the allocation"
            if len(fit.shrinkage_scores) > 1
            else "given",
            "heldout_kl": fit.shrinkage_scores,
        },
        "supported_ranks": list(SUPPORTED_RANKS),
        "traffic": {
            "state_dtype": "float32",
            "read_dtype": choices.read_dtype,
            "buffer_dtype": choices.buffer_dtype,
        },
        "budget": alloc.budget,
        "summary": summary,
        "layers": [
            {
                "layer": li.layer,
                "heads": li.heads,
                "groups": li.groups,
                "key_dim": li.key_dim,
                "value_dim": li.value_dim,
                "ranks": la.ranks,
            }
            for li, la in zip(stats.layers, alloc.layers, strict=True)
        ],
    }


def write_artifact(inputs: ConvertInputs, fit: SketchFit) -> ConvertResult:
    """Write the model directory ``inputs.settings.out`` for ``fit``, atomically (built under a
    temporary name beside it and renamed into place; on any error nothing is left behind).

    Places the base model's files as ``inputs.weights`` says (hard links, else copies; or the saved
    built-in model), writes config.json with its ``sketch_config`` section, the sketch tensors, the
    calibration provenance and curves, and the model card. Returns what was written.
    """
    s, stats, base = inputs.settings, inputs.stats, inputs.base
    notes = [*inputs.notes, *fit.notes]
    alloc = fit.allocation
    base_model = {
        "id": base.id,
        "revision": base.revision,
        "weights": inputs.weights,
        "weights_fingerprint": inputs.base_weights_fingerprint,
    }
    section = sketch_section(stats, fit, SketchChoices.of(s), base_model)
    # Provenance: verify re-fits ablations and rank sweeps from these statistics.
    section["calibration"] = {"stats_dir": str(inputs.stats_dir.resolve())}
    with atomic_dir(s.out) as tmp:
        placed_mode = "reference"
        if inputs.weights == "full":
            placed = place_files(base.path, tmp)
            placed_mode = placed.mode
            notes.extend(placed.notes)
        elif inputs.weights == "saved":
            from sketchcal.models.loading import quiet_progress_bars

            with quiet_progress_bars():
                inputs.builtin.model.save_pretrained(str(tmp))
            inputs.builtin.tokenizer.save_pretrained(str(tmp))
            placed_mode = "saved"
        section["base_model"]["weights"] = placed_mode
        if inputs.weights == "saved":
            config = json.loads((tmp / "config.json").read_text())
        elif base.path is not None:
            config = json.loads((base.path / "config.json").read_text())  # the base's own file, unchanged
        elif inputs.base_config is not None:
            config = json.loads(inputs.base_config.to_json_string(use_diff=True))
        else:
            config = {"model_type": stats.model.get("model_type")}
        if CONFIG_KEY in config:
            notes.append("the base config already had a sketch_config section; replaced it")
        write_sketch(
            tmp / SKETCH_FILE,
            fit.layers,
            family=stats.family,
            window=stats.window,
            fingerprint=stats.fingerprint,
        )
        (tmp / "calibration").mkdir()
        (tmp / MANIFEST_COPY).write_text(json.dumps(stats.manifest, indent=2) + "\n")
        (tmp / ALLOCATION_FILE).write_text(json.dumps(finite_json(alloc.to_dict()), indent=2) + "\n")
        _write_curves(tmp / CURVES_FILE, fit.fits)
        section["files"] = tensor_file_digests(tmp, inputs.base_digests if inputs.weights == "full" else {})
        config[CONFIG_KEY] = section
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "README.md").write_text(
            model_card(
                base_id=base.id,
                family=stats.family,
                window=stats.window,
                allocation=alloc,
                weights=placed_mode,
                basis=s.basis,
                shrinkage=fit.shrinkage,
                stats_manifest=stats.manifest,
                notes=notes,
            )
        )
    return ConvertResult(
        out=s.out,
        allocation=alloc,
        weights=placed_mode,
        base_model=base.id,
        sketch_config=section,
        shrinkage=fit.shrinkage,
        shrinkage_scores=fit.shrinkage_scores,
        notes=notes,
    )


def _write_curves(path: Path, fits: list[LayerFit]) -> None:
    t: dict[str, torch.Tensor] = {}
    for f in fits:
        p = f"layers.{f.layer}."
        t[p + "candidate_ranks"] = torch.tensor(f.ranks, dtype=torch.int32)
        t[p + "predicted"] = f.predicted.to(torch.float32)
        if f.heldout_predicted is not None:
            t[p + "heldout_predicted"] = f.heldout_predicted.to(torch.float32)
        if f.measured is not None:
            t[p + "measured"] = f.measured.to(torch.float32)
        if f.adaptive_measured is not None:
            t[p + "adaptive_candidate_ranks"] = torch.tensor(f.adaptive_ranks, dtype=torch.int32)
            t[p + "adaptive_measured"] = f.adaptive_measured.to(torch.float32)
        t[p + "kl_scale"] = f.kl_scale.to(torch.float32)
        t[p + "shrinkage"] = f.shrinkage.to(torch.float32)
        t[p + "eigvals"] = f.eigvals.to(torch.float32)
    meta = {"format": "sketchcal-curves", "version": "1"}
    save_safetensors({k: v.contiguous() for k, v in t.items()}, path, metadata=meta)
