"""Checks a calibration runs before it loads the model: the output is writable and has room, and a
resumed run has the settings of the one it continues."""

from __future__ import annotations

import math
from typing import Any

from sketchcal.errors import SketchcalError
from sketchcal.formats.stats import SPLITS, moment_layout, window_layout
from sketchcal.fsutil import check_writable
from sketchcal.models import ModelSpec
from sketchcal.settings import CalibrateSettings, cli_flag

MARGIN_BYTES = 2**20  # manifest, progress state and the spectra plot


def stats_bytes(spec: ModelSpec, window: int, heldout_windows: int) -> int:
    """Bytes of the tensors of a statistics directory for ``spec`` (docs/stats-format.md)."""
    total = 0
    for shape in spec.layers:
        layouts = [moment_layout(shape.heads, shape.key_dim)] * len(SPLITS)
        layouts.append(window_layout(heldout_windows, shape.heads, shape.key_dim, shape.value_dim, window))
        for layout in layouts:
            for dims, dtype in layout.values():
                total += math.prod(dims) * dtype.itemsize
    return total


def check_output(settings: CalibrateSettings) -> None:
    """Fail in one line, before the model loads, when ``settings.out`` is not writable or its
    filesystem cannot hold the run: the saved progress and the final shards coexist for a moment,
    and a progress save writes the new sums beside the previous ones, so twice the statistics."""
    from sketchcal.models.loading import model_spec

    s = settings
    spec = model_spec(s.model, revision=s.revision, trust_remote_code=s.trust_remote_code)
    need = 2 * stats_bytes(spec, s.window, s.heldout_windows) + MARGIN_BYTES
    check_writable(s.out, need, f"the statistics in {s.out}")


def _show(value: Any) -> str:
    """A value for a message: long digests shortened, strings quoted."""
    if isinstance(value, str):
        return repr(value[:19] + "…") if len(value) > 40 and " " not in value else repr(value)
    return str(value)


def resume_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between the identity of an interrupted run and of the run resuming it, one item
    per argument, ``"--window 16 → 8"`` (settings), ``"model architecture …"``, ``"data source …"``."""
    diffs = []
    old_s, new_s = old.get("settings", {}), new.get("settings", {})
    for name in sorted(set(old_s) | set(new_s)):
        if old_s.get(name) != new_s.get(name):
            diffs.append(
                f"{cli_flag(CalibrateSettings, name)} {_show(old_s.get(name))} → {_show(new_s.get(name))}"
            )
    for key, label in (("fingerprint", "model architecture"), ("weights", "model weights")):
        if old.get(key) != new.get(key):
            diffs.append(f"{label} {_show(old.get(key))} → {_show(new.get(key))}")
    old_d, new_d = old.get("data") or {}, new.get("data") or {}
    if old_d != new_d:
        # the rest of the data record (sample counts, tokens) follows from the settings above
        for key in ("source", "text_field", "revision"):
            if old_d.get(key) != new_d.get(key):
                diffs.append(f"data {key} {_show(old_d.get(key))} → {_show(new_d.get(key))}")
        if old_d.get("sha256") != new_d.get("sha256"):
            diffs.append("data content (the documents' sha256 changed)")
        if not diffs:
            diffs.append("the data samples drawn")
    return diffs


def check_resume(old: dict[str, Any], new: dict[str, Any], out: Any) -> None:
    """Refuse to resume the interrupted run in ``out`` (identity ``old``) with other settings."""
    if old == new:
        return
    diffs = resume_differences(old, new) or ["the recorded run identity (it predates this sketchcal)"]
    raise SketchcalError(
        f"the interrupted run in {out} used other arguments: {'; '.join(diffs)}; rerun with the "
        "run's arguments, or start again with --overwrite"
    )
