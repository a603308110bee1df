"""The statistics directory on disk: final shards + manifest, and resumable progress.

Layout (docs/stats-format.md): ``manifest.json`` (written last), ``stats-0000i-of-0000n.safetensors``
and, while a run is unfinished, ``_progress/`` holding the cumulative sums after the last
completed round (``sums-<round>.safetensors``) and ``state.json`` naming it. The sums file is
written before the state that points to it, each atomically, so a crash at any point leaves either
the previous consistent progress or the new one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from sketchcal.errors import SketchcalError
from sketchcal.fsutil import atomic_path, write_json

FORMAT = "sketchcal-stats"
VERSION = 1
MANIFEST = "manifest.json"
PROGRESS = "_progress"
_SHARD_BYTES = 2 * 2**30
_OURS = (MANIFEST, PROGRESS, "stats-", "calibration.png")


def _is_ours(name: str) -> bool:
    return any(name == o or name.startswith(o) for o in _OURS) or name.startswith(".")


def prepare_out_dir(out: Path, *, resume: bool, overwrite: bool, clear: bool = True) -> None:
    """Refuse a non-empty directory unless resuming or overwriting a statistics directory.

    With ``clear=False`` only checks; call again with ``clear=True`` once the model and data have
    loaded, so that a failed start never destroys the previous statistics.
    """
    if resume and overwrite:
        raise SketchcalError("--resume and --overwrite contradict each other; give one")
    if out.exists() and not out.is_dir():
        raise SketchcalError(f"{out} exists and is not a directory; choose another --out")
    entries = sorted(p.name for p in out.iterdir()) if out.exists() else []
    if resume:
        if (out / MANIFEST).exists() and read_manifest(out).get("complete"):
            raise SketchcalError(f"{out} already holds a complete calibration; nothing to resume")
        if not (out / PROGRESS / "state.json").exists():
            raise SketchcalError(f"{out} has no interrupted run to resume; drop --resume to start one")
        return
    if not entries:
        return
    if not overwrite:
        raise SketchcalError(
            f"{out} is not empty; pass --resume to continue a run or --overwrite to replace it"
        )
    foreign = [name for name in entries if not _is_ours(name)]
    if foreign:
        raise SketchcalError(
            f"--overwrite refused: {out} holds files sketchcal did not write ({', '.join(foreign[:3])}); "
            "choose an empty directory"
        )
    for name in entries if clear else []:
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def read_manifest(out: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SketchcalError(f"{out / MANIFEST} is missing or unreadable; rerun calibrate") from err
    if manifest.get("format") != FORMAT:
        raise SketchcalError(f"{out} is not a sketchcal statistics directory")
    return manifest


def save_progress(
    out: Path, round_done: int, tensors: dict[str, torch.Tensor], state: dict[str, Any]
) -> None:
    """Record the cumulative sums after ``round_done`` rounds; the previous progress stays valid
    until the new state file is in place."""
    prog = out / PROGRESS
    prog.mkdir(parents=True, exist_ok=True)
    name = f"sums-{round_done:07d}.safetensors"
    with atomic_path(prog / name) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    write_json(prog / "state.json", {**state, "round_done": round_done, "sums": name})
    for old in prog.glob("sums-*.safetensors"):
        if old.name != name:
            old.unlink()


def load_progress(out: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    prog = out / PROGRESS
    try:
        state = json.loads((prog / "state.json").read_text())
        tensors = load_file(str(prog / state["sums"]))
    except (OSError, KeyError, json.JSONDecodeError, SafetensorError) as err:
        raise SketchcalError(f"the progress in {prog} is damaged; rerun with --overwrite") from err
    return state, tensors


def write_final(out: Path, tensors: dict[str, torch.Tensor], manifest: dict[str, Any]) -> dict[str, Any]:
    """Write the shards (whole layers each, at most ~2 GiB), then the manifest, then drop progress."""
    layers = manifest["layers"]
    by_layer: dict[int, dict[str, torch.Tensor]] = {entry["layer"]: {} for entry in layers}
    for name, t in tensors.items():
        by_layer[int(name.split(".")[1])][name] = t.contiguous()
    groups: list[list[int]] = [[]]
    size = 0
    for entry in layers:
        nbytes = sum(t.numel() * t.element_size() for t in by_layer[entry["layer"]].values())
        if groups[-1] and size + nbytes > _SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(entry["layer"])
        size += nbytes
    for i, group in enumerate(groups):
        shard = f"stats-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        with atomic_path(out / shard) as tmp:
            save_file({k: v for layer in group for k, v in by_layer[layer].items()}, str(tmp))
        for entry in layers:
            if entry["layer"] in group:
                entry["shard"] = shard
    manifest = {**manifest, "complete": True}
    write_json(out / MANIFEST, manifest)
    shutil.rmtree(out / PROGRESS, ignore_errors=True)
    return manifest


def load_stats_tensors(out: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a finished statistics directory: (manifest, all tensors)."""
    manifest = read_manifest(out)
    if not manifest.get("complete"):
        raise SketchcalError(f"{out} holds an unfinished calibration; run calibrate --resume first")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted({entry["shard"] for entry in manifest["layers"]}):
        try:
            tensors.update(load_file(str(out / shard)))
        except (OSError, SafetensorError) as err:
            raise SketchcalError(f"{out / shard} is missing or truncated; rerun calibrate") from err
    return manifest, tensors
