"""Find the base model's files locally and place them in a converted model directory."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from sketchcal.errors import SketchcalError
from sketchcal.hub.resolve import is_hub_id

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
SKIP_TOP = {"config.json", "README.md", "sketch", "calibration", "plots"}


@dataclass
class BaseModel:
    """Where the base model's files are, or why they are not available."""

    id: str | None  # hub id or path as recorded
    revision: str | None
    path: Path | None  # local directory with config.json, or None
    note: str | None = None  # why neither ``path`` nor ``builtin`` is set
    builtin: str | None = None  # "builtin:NAME": a package model, built in memory (sketchcal.models)


@dataclass
class PlacedFiles:
    mode: str  # "linked" | "copied" | "linked+copied" | "reference"
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def resolve_base(model: str | Path | None, manifest_model: dict) -> BaseModel:
    """Locate the base model without any network access.

    ``model`` (explicit) must be a local directory with a config.json, a hub id present in the local
    Hugging Face cache, or a package model ``builtin:NAME``; anything else is an error. Without it,
    the manifest's ``model.id`` is tried the same way, and when it is not available the result carries
    a note instead of a path.
    """
    rec_id = manifest_model.get("id")
    rev = manifest_model.get("revision")
    if model is not None and str(model).startswith("builtin:"):
        return BaseModel(id=str(model), revision=None, path=None, builtin=str(model))
    if model is None and isinstance(rec_id, str) and rec_id.startswith("builtin:"):
        return BaseModel(id=rec_id, revision=rev, path=None, builtin=rec_id)
    if model is not None:
        p = Path(model).expanduser()
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise SketchcalError(f"--model {model}: no config.json in that directory")
            return BaseModel(id=rec_id if rec_id else str(p), revision=rev, path=p)
        cached = _from_cache(str(model), None)
        if cached is None:
            raise SketchcalError(
                f"--model {model} is neither a local model directory nor in the local Hugging Face "
                "cache; download it first (e.g. huggingface-cli download) or pass its directory"
            )
        return BaseModel(id=str(model), revision=None, path=cached)
    if not rec_id:
        return BaseModel(id=None, revision=rev, path=None, note="the statistics do not name their model")
    p = Path(str(rec_id)).expanduser()
    if p.is_dir() and (p / "config.json").is_file():
        return BaseModel(id=str(rec_id), revision=rev, path=p)
    cached = _from_cache(str(rec_id), rev)
    if cached is not None:
        return BaseModel(id=str(rec_id), revision=rev, path=cached)
    return BaseModel(
        id=str(rec_id),
        revision=rev,
        path=None,
        note=f"base model {rec_id} is not available locally (not a directory, not in the Hugging Face "
        "cache); wrote a reference-only directory — pass --model DIR to include config and weights",
    )


def _from_cache(repo_id: str, revision: str | None) -> Path | None:
    if not is_hub_id(repo_id):
        return None
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except Exception:
        return None
    p = Path(path)
    return p if (p / "config.json").is_file() else None


def has_safetensors(base: Path) -> bool:
    return any(base.glob("*.safetensors"))


def has_pickled_weights(base: Path) -> bool:
    return any(f.suffix in PICKLE_SUFFIXES for f in base.iterdir() if f.is_file())


def place_files(base: Path, dest: Path) -> PlacedFiles:
    """Hard-link (else copy) every file of ``base`` except config.json, README.md, sketchcal's own folders,
    hidden entries and pickled files into ``dest``. The weights are byte-identical to the base."""
    out = PlacedFiles(mode="")
    linked = copied = 0
    skipped_pickles = []
    for src in sorted(base.rglob("*")):
        rel = src.relative_to(base)
        if any(part.startswith(".") for part in rel.parts) or rel.parts[0] in SKIP_TOP or src.is_dir():
            continue
        if src.suffix in PICKLE_SUFFIXES:
            skipped_pickles.append(str(rel))
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        real = src.resolve()  # hub cache snapshots are symlinks into blobs/
        try:
            os.link(real, target)
            linked += 1
        except OSError:
            shutil.copy2(real, target)
            copied += 1
        out.files.append(str(rel))
    out.mode = "linked" if not copied else ("copied" if not linked else "linked+copied")
    if skipped_pickles:
        out.notes.append(
            f"skipped pickled files of the base model ({', '.join(skipped_pickles[:3])}"
            f"{' …' if len(skipped_pickles) > 3 else ''}): sketchcal artifacts hold no pickles"
        )
    return out
