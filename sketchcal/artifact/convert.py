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
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from sketchcal.artifact.card import model_card
from sketchcal.artifact.fingerprint import config_fingerprint, load_config
from sketchcal.artifact.modelsrc import has_pickled_weights, has_safetensors, place_files, resolve_base
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
from sketchcal.fit.basis import BASIS_KINDS
from sketchcal.fit.evaluate import fit_all
from sketchcal.fit.layer import COEF_KINDS, LayerFit
from sketchcal.fit.ranks import SUPPORTED_RANKS
from sketchcal.fit.shrinkage import SHRINKAGE_METHODS
from sketchcal.fit.traffic import TrafficModel, dtype_bytes
from sketchcal.formats.stats import Stats, load_stats
from sketchcal.fsutil import atomic_dir, finite_json

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
    shrinkage_scores: dict[str, float | None]  # held-out error of the allocation per estimator tried
    notes: list[str] = field(default_factory=list)


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SketchcalError(f"--{name} must be one of {', '.join(allowed)}, got {value!r}")


def convert(
    stats_dir: str | Path,
    rank: float | None = None,
    bytes_per_token: float | None = None,
    out: str | Path | None = None,
    model: str | Path | None = None,
    reference_only: bool = False,
    basis: str = "state",
    *,
    coef: str = "state",
    shrinkage: str = "auto",
    read_dtype: str = "float32",
    buffer_dtype: str = "bfloat16",
    seed: int = 0,
) -> ConvertResult:
    """Fit sketch bases from a statistics directory, allocate per-head ranks and write a model directory.

    Args:
        stats_dir: the directory ``sketchcal calibrate`` wrote (docs/stats-format.md).
        rank: mean rank budget over all heads of all layers (dense heads count as K). Exactly one of
            ``rank`` / ``bytes_per_token``.
        bytes_per_token: state-traffic budget in bytes per sequence and decoded token, all mixer
            layers together (byte model: :mod:`sketchcal.fit.traffic`).
        out: output directory; must not exist.
        model: local directory, locally cached hub id, or ``builtin:NAME`` package model to take config
            and weights from; default: the statistics' model id if it is available locally. Its
            fingerprint must match the statistics'. Weights of a local directory are hard-linked
            (else copied); a built-in model is saved.
        reference_only: write config + sketch only, referring to the base model for the weights.
            Also the fallback (with a note) when no base model is available locally.
        basis: ``"state"`` (state-weighted), or the ablations ``"pca"`` (E = I) and ``"random"``.
        coef: ``"state"`` (state-weighted least-squares maps) or ``"projection"`` (E = I ablation).
        shrinkage: E estimator, ``"ledoit_wolf"``, ``"oas"``, ``"none"``, or ``"auto"`` (default): fit
            with each and keep the one whose allocation has the lowest held-out error (measured on the
            held-out windows, else predicted from the held-out moments); all scores are recorded.
        read_dtype: dtype of the read copy / sketch (``float32``: the fp32 checkpoint serves reads;
            ``bfloat16`` / ``fp8``: two precisions). Only the byte model uses it.
        buffer_dtype: dtype of the ReplaySSM buffer entries (byte model only).
        seed: seed of the random basis.

    Returns:
        :class:`ConvertResult`; ``result.notes`` holds things the user should read (fallbacks).

    Raises:
        SketchcalError: bad statistics (missing/truncated/NaN/incomplete), a fingerprint mismatch
            with ``model``, an invalid or unreachable budget, or an existing ``out``. Nothing is
            written in any of those cases.
    """
    if out is None:
        raise SketchcalError("give an output directory (--out DIR)")
    out = Path(out)
    if out.exists():
        raise SketchcalError(f"{out} already exists; choose another --out or remove it first")
    _choice("basis", basis, BASIS_KINDS)
    _choice("coef", coef, COEF_KINDS)
    _choice("shrinkage", shrinkage, ("auto", *SHRINKAGE_METHODS))
    try:
        read_bytes, buffer_bytes = dtype_bytes(read_dtype), dtype_bytes(buffer_dtype)
    except ValueError as err:
        raise SketchcalError(str(err)) from None
    stats = load_stats(stats_dir)
    validate_budget(rank, bytes_per_token, max(li.key_dim for li in stats.layers))

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
    if base_cfg is not None:
        fp = config_fingerprint(base_cfg)
        if fp != stats.fingerprint:
            where = base.builtin or base.path
            raise SketchcalError(
                f"the statistics in {stats.path} come from another model: their fingerprint "
                f"{stats.fingerprint[:12]}… differs from {where}'s {fp[:12]}…; calibrate this "
                "model or pass the model the statistics were taken on"
            )
    weights = "reference"
    if not reference_only and builtin is not None:
        weights = "saved"
    elif not reference_only and base.path is not None:
        if has_safetensors(base.path):
            weights = "full"
        elif has_pickled_weights(base.path):
            notes.append(
                f"base model {base.path} has only pickled weights; wrote a reference-only directory "
                "(convert the base to safetensors to include the weights)"
            )
        else:
            notes.append(f"base model {base.path} has no weight files; wrote a reference-only directory")

    traffic = [
        TrafficModel(
            family=stats.family,
            key_dim=li.key_dim,
            value_dim=li.value_dim,
            window=stats.window,
            heads_per_group=li.heads_per_group,
            state_bytes=4,
            read_bytes=read_bytes,
            buffer_bytes=buffer_bytes,
        )
        for li in stats.layers
    ]
    fits, alloc, chosen, scores = _fit_and_allocate(
        stats, traffic, rank, bytes_per_token, basis, coef, shrinkage, seed
    )
    notes.extend(alloc.notes)
    if any(f.measured is None for f in fits):
        notes.append(
            "the statistics hold no held-out window sample for some layers: their measured error is n/a"
        )

    layers = [
        SketchLayer(
            layer=f.layer,
            frame=f.frames,
            coef=f.coef_maps(la.ranks),
            ranks=torch.tensor(la.ranks, dtype=torch.int32),
        )
        for f, la in zip(fits, alloc.layers, strict=True)
    ]
    shrink_info = {
        "method": chosen,
        "selected_by": "held-out error of the allocation" if len(scores) > 1 else "given",
        "heldout_error": scores,
    }
    section = _sketch_config(
        stats,
        base.id,
        base.revision,
        weights,
        alloc,
        traffic,
        basis,
        coef,
        shrink_info,
        read_dtype,
        buffer_dtype,
    )
    # Provenance: verify re-fits ablations and rank sweeps from these statistics.
    section["calibration"] = {"stats_dir": str(Path(stats_dir).resolve())}
    with atomic_dir(out) as tmp:
        placed_mode = "reference"
        if weights == "full":
            placed = place_files(base.path, tmp)
            placed_mode = placed.mode
            notes.extend(placed.notes)
        elif weights == "saved":
            builtin.model.save_pretrained(str(tmp))
            builtin.tokenizer.save_pretrained(str(tmp))
            placed_mode = "saved"
        section["base_model"]["weights"] = placed_mode
        if weights == "saved":
            config = json.loads((tmp / "config.json").read_text())
        elif base.path is not None:
            config = json.loads((base.path / "config.json").read_text())  # the base's own file, unchanged
        elif base_cfg is not None:
            config = json.loads(base_cfg.to_json_string(use_diff=True))
        else:
            config = {"model_type": stats.model.get("model_type")}
        if CONFIG_KEY in config:
            notes.append("the base config already had a sketch_config section; replaced it")
        config[CONFIG_KEY] = section
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_sketch(
            tmp / SKETCH_FILE, layers, family=stats.family, window=stats.window, fingerprint=stats.fingerprint
        )
        (tmp / "calibration").mkdir()
        (tmp / MANIFEST_COPY).write_text(json.dumps(stats.manifest, indent=2) + "\n")
        (tmp / ALLOCATION_FILE).write_text(json.dumps(finite_json(alloc.to_dict()), indent=2) + "\n")
        _write_curves(tmp / CURVES_FILE, fits)
        (tmp / "README.md").write_text(
            model_card(
                base_id=base.id,
                family=stats.family,
                window=stats.window,
                allocation=alloc,
                weights=placed_mode,
                basis=basis,
                shrinkage=chosen,
                stats_manifest=stats.manifest,
                notes=notes,
            )
        )
    return ConvertResult(
        out=out,
        allocation=alloc,
        weights=placed_mode,
        base_model=base.id,
        sketch_config=section,
        shrinkage=chosen,
        shrinkage_scores=scores,
        notes=notes,
    )


def _score(alloc: Allocation) -> float | None:
    """Held-out error of an allocation: measured on the windows when available, else from held-out moments."""
    return alloc.measured_error if alloc.measured_error is not None else alloc.heldout_predicted_error


def _fit_and_allocate(
    stats: Stats,
    traffic: list[TrafficModel],
    rank,
    bytes_per_token,
    basis: str,
    coef: str,
    shrinkage: str,
    seed: int,
):
    """Fit and allocate; with ``shrinkage="auto"`` once per estimator, keeping the one whose allocation has
    the lowest held-out error. Returns ``(fits, allocation, method, {method: held-out error})``."""
    from sketchcal.ui import progress_bar

    methods = SHRINKAGE_METHODS if shrinkage == "auto" else (shrinkage,)
    best = None
    scores: dict[str, float | None] = {}
    with progress_bar() as bar:
        task = bar.add_task("fitting bases", total=len(methods) * len(stats.layers))
        for meth in methods:
            fits = fit_all(
                stats, basis=basis, coef=coef, shrinkage=meth, seed=seed, on_layer=lambda _: bar.advance(task)
            )
            alloc = allocate(fits, traffic, rank=rank, bytes_per_token=bytes_per_token)
            score = _score(alloc)
            scores[meth] = score
            if best is None or (score is not None and (best[3] is None or score < best[3])):
                best = (fits, alloc, meth, score)
    fits, alloc, meth, score = best
    if shrinkage == "auto" and score is None:
        alloc.notes.append(f"no held-out data to choose the E shrinkage; used {meth}")
    return fits, alloc, meth, scores


def _sketch_config(
    stats: Stats,
    base_id,
    base_rev,
    weights,
    alloc: Allocation,
    traffic: list[TrafficModel],
    basis,
    coef,
    shrinkage,
    read_dtype,
    buffer_dtype,
) -> dict[str, Any]:
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
        "base_model": {"id": base_id, "revision": base_rev, "weights": weights},
        "basis": basis,
        "coef": coef,
        "shrinkage": shrinkage,
        "supported_ranks": list(SUPPORTED_RANKS),
        "traffic": {"state_dtype": "float32", "read_dtype": read_dtype, "buffer_dtype": buffer_dtype},
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
        t[p + "shrinkage"] = f.shrinkage.to(torch.float32)
        t[p + "eigvals"] = f.eigvals.to(torch.float32)
    save_file(
        {k: v.contiguous() for k, v in t.items()},
        str(path),
        metadata={"format": "sketchcal-curves", "version": "1"},
    )
