"""Reader of the statistics directory that ``sketchcal calibrate`` writes (docs/stats-format.md).

:func:`load_stats` validates the manifest and every shard's header (names, shapes, dtypes) up
front; the tensors themselves are read one layer at a time (:meth:`Stats.moments`,
:meth:`Stats.windows`) and checked for NaN/Inf as they are read. Every problem is a one-line
:class:`~sketchcal.errors.SketchcalError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from sketchcal.errors import SketchcalError

STATS_FORMAT = "sketchcal-stats"
STATS_VERSION = 1
SPLITS = ("calib", "heldout")
MOMENT_NAMES = ("E", "C", "read_energy", "E_col4", "C_col4", "n_checkpoints", "n_reads")


@dataclass(frozen=True)
class LayerInfo:
    """One mixer layer as listed in the manifest."""

    layer: int  # decoder-layer index in the model
    heads: int  # H
    groups: int  # G; head h belongs to group h // (H // G)
    key_dim: int  # K
    value_dim: int  # V
    shard: str

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.groups

    def group_of(self, head: int) -> int:
        return head // self.heads_per_group


@dataclass
class Moments:
    """The sums of one (layer, split). Shapes: H heads, key dim K."""

    E: Tensor  # [H, K, K] f64, Σ_checkpoints S Sᵀ
    C: Tensor  # [H, K, K] f64, Σ_reads u uᵀ
    read_energy: Tensor  # [H] f64, Σ_reads ‖S_cᵀ u‖²
    E_col4: Tensor  # [H] f64, Σ_checkpoints Σ_v ‖S[:, v]‖⁴
    C_col4: Tensor  # [H] f64, Σ_reads ‖u‖⁴
    n_checkpoints: int
    n_reads: int

    @property
    def E_mean(self) -> Tensor:
        """[H, K, K] ``mean S Sᵀ`` per checkpoint."""
        return self.E / max(self.n_checkpoints, 1)

    @property
    def C_mean(self) -> Tensor:
        """[H, K, K] ``mean u uᵀ`` per read."""
        return self.C / max(self.n_reads, 1)

    @property
    def empty(self) -> bool:
        return self.n_checkpoints <= 0 or self.n_reads <= 0


@dataclass
class HeldoutWindows:
    """The verbatim held-out window sample of one layer."""

    S: Tensor  # [R, H, K, V] f32 checkpoints
    u: Tensor  # [R, L−1, H, K] f32 effective queries
    mask: Tensor  # [R, L−1] bool, True where the read exists

    @property
    def count(self) -> int:
        return int(self.S.shape[0])


@dataclass
class Stats:
    """A validated statistics directory. Tensors are read lazily, layer by layer."""

    path: Path
    manifest: dict[str, Any]
    layers: list[LayerInfo]
    _has_windows: dict[int, bool]

    @property
    def model(self) -> dict[str, Any]:
        return self.manifest["model"]

    @property
    def fingerprint(self) -> str:
        return str(self.model["fingerprint"])

    @property
    def family(self) -> str:
        return str(self.model["family"])

    @property
    def window(self) -> int:
        return int(self.manifest["window"])

    @property
    def model_id(self) -> str | None:
        return self.model.get("id")

    def info(self, layer: int) -> LayerInfo:
        for li in self.layers:
            if li.layer == layer:
                return li
        raise KeyError(layer)

    def has_windows(self, layer: int) -> bool:
        return self._has_windows[layer]

    def _open(self, li: LayerInfo):
        try:
            return safe_open(str(self.path / li.shard), framework="pt")
        except Exception as err:  # safetensors raises its own error types
            raise SketchcalError(
                f"cannot open {li.shard} in {self.path}: it is truncated or corrupt "
                f"({first_line(err)}); rerun sketchcal calibrate"
            ) from err

    def _read(self, fh, li: LayerInfo, name: str) -> Tensor:
        try:
            t = fh.get_tensor(name)
        except Exception as err:
            raise SketchcalError(
                f"cannot read {name} from {li.shard}: the shard is truncated or corrupt "
                f"({first_line(err)}); rerun sketchcal calibrate"
            ) from err
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise SketchcalError(
                f"{name} in {self.path / li.shard} contains NaN or Inf; the calibration "
                "diverged or the file is damaged; recalibrate (e.g. in float32/float64)"
            )
        return t

    def moments(self, layer: int, split: str = "calib") -> Moments:
        """The sums of one layer and split (``calib`` or ``heldout``), checked for NaN/Inf."""
        li = self.info(layer)
        with self._open(li) as fh:
            t = {n: self._read(fh, li, f"layers.{layer}.{split}.{n}") for n in MOMENT_NAMES}
        m = Moments(
            E=t["E"].to(torch.float64),
            C=t["C"].to(torch.float64),
            read_energy=t["read_energy"].to(torch.float64),
            E_col4=t["E_col4"].to(torch.float64),
            C_col4=t["C_col4"].to(torch.float64),
            n_checkpoints=int(t["n_checkpoints"].reshape(-1)[0]),
            n_reads=int(t["n_reads"].reshape(-1)[0]),
        )
        if m.n_checkpoints < 0 or m.n_reads < 0:
            raise SketchcalError(f"negative counts for layer {layer} in {self.path / li.shard}; recalibrate")
        if split == "calib" and m.empty:
            raise SketchcalError(
                f"layer {layer} has no calibration reads in {self.path}: the data produced "
                "no decoded tokens; use longer samples or --gen-tokens"
            )
        return m

    def windows(self, layer: int) -> HeldoutWindows | None:
        """The held-out window sample of one layer, or None when the stats hold none."""
        li = self.info(layer)
        if not self._has_windows[layer]:
            return None
        with self._open(li) as fh:
            s = self._read(fh, li, f"layers.{layer}.heldout.windows.S")
            u = self._read(fh, li, f"layers.{layer}.heldout.windows.u")
            mask = self._read(fh, li, f"layers.{layer}.heldout.windows.mask")
        if s.shape[0] == 0:
            return None
        return HeldoutWindows(S=s, u=u, mask=mask.to(torch.bool))


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:160] if text else type(err).__name__


def _bad_manifest(path: Path, why: str) -> SketchcalError:
    return SketchcalError(
        f"{path / 'manifest.json'}: {why}; rerun sketchcal calibrate (it resumes an unfinished run)"
    )


def _int(d: dict, key: str, where: str, path: Path, minimum: int = 0) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise _bad_manifest(path, f"{where}{key} must be an integer ≥ {minimum}, got {v!r}")
    return v


def _read_manifest(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise SketchcalError(f"statistics directory {path} does not exist")
    if not path.is_dir():
        raise SketchcalError(f"{path} is not a statistics directory (expected a folder with manifest.json)")
    mf = path / "manifest.json"
    if not mf.exists():
        if (path / "_progress").exists():
            raise SketchcalError(
                f"{path} holds an unfinished calibration (no manifest.json yet); "
                "rerun sketchcal calibrate with the same --out to resume it"
            )
        raise SketchcalError(
            f"no manifest.json in {path}: not a statistics directory, or the calibration "
            "did not finish; rerun sketchcal calibrate"
        )
    try:
        manifest = json.loads(mf.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _bad_manifest(path, f"unreadable or truncated JSON ({first_line(err)})") from err
    if not isinstance(manifest, dict):
        raise _bad_manifest(path, "not a JSON object")
    if manifest.get("format") != STATS_FORMAT:
        raise _bad_manifest(path, f"format is {manifest.get('format')!r}, expected {STATS_FORMAT!r}")
    if manifest.get("version") != STATS_VERSION:
        raise SketchcalError(
            f"{mf}: statistics format version {manifest.get('version')!r} is not supported "
            f"(this sketchcal reads version {STATS_VERSION}); recalibrate or upgrade sketchcal"
        )
    if manifest.get("complete") is not True:
        raise _bad_manifest(path, "the calibration is marked incomplete")
    return manifest


def load_stats(stats_dir: str | Path) -> Stats:
    """Open and validate a statistics directory (format version 1).

    Checks: the manifest (present, valid JSON, format/version, ``complete: true``, required
    fields), every shard (present, opens, holds all tensors of its layers with the documented
    shapes and dtypes). Tensor values are checked when read.

    Raises:
        SketchcalError: one line saying what is wrong and what to do.
    """
    path = Path(stats_dir)
    manifest = _read_manifest(path)
    model = manifest.get("model")
    if (
        not isinstance(model, dict)
        or not isinstance(model.get("fingerprint"), str)
        or not model["fingerprint"]
    ):
        raise _bad_manifest(path, "model.fingerprint is missing")
    if model.get("family") not in ("mamba2", "gdn", "kda"):
        raise _bad_manifest(path, f"model.family must be mamba2, gdn or kda, got {model.get('family')!r}")
    window = _int(manifest, "window", "", path, minimum=1)
    entries = manifest.get("layers")
    if not isinstance(entries, list) or not entries:
        raise _bad_manifest(path, "the layer list is missing or empty")
    layers: list[LayerInfo] = []
    for idx, e in enumerate(entries):
        if not isinstance(e, dict):
            raise _bad_manifest(path, f"layers[{idx}] is not an object")
        where = f"layers[{idx}]."
        shard = e.get("shard")
        if not isinstance(shard, str) or not shard or "/" in shard or "\\" in shard or shard.startswith("."):
            raise _bad_manifest(path, f"{where}shard must be a file name, got {shard!r}")
        li = LayerInfo(
            layer=_int(e, "layer", where, path),
            heads=_int(e, "heads", where, path, 1),
            groups=_int(e, "groups", where, path, 1),
            key_dim=_int(e, "key_dim", where, path, 1),
            value_dim=_int(e, "value_dim", where, path, 1),
            shard=shard,
        )
        if li.heads % li.groups:
            raise _bad_manifest(
                path, f"layer {li.layer}: {li.heads} heads do not split into {li.groups} groups"
            )
        layers.append(li)
    if len({li.layer for li in layers}) != len(layers):
        raise _bad_manifest(path, "a layer is listed twice")
    has_windows: dict[int, bool] = {}
    by_shard: dict[str, list[LayerInfo]] = {}
    for li in layers:
        by_shard.setdefault(li.shard, []).append(li)
    for shard, lis in by_shard.items():
        f = path / shard
        if not f.is_file():
            raise SketchcalError(
                f"shard {shard} listed in {path / 'manifest.json'} is missing; "
                "copy the whole statistics directory or rerun sketchcal calibrate"
            )
        try:
            with safe_open(str(f), framework="pt") as fh:
                names = list(fh.keys())  # safe_open is not iterable
                header = {k: (tuple(fh.get_slice(k).get_shape()), fh.get_slice(k).get_dtype()) for k in names}
        except Exception as err:
            raise SketchcalError(
                f"cannot open shard {shard} in {path}: it is truncated or corrupt "
                f"({first_line(err)}); rerun sketchcal calibrate"
            ) from err
        for li in lis:
            has_windows[li.layer] = _check_layer_header(path, shard, li, window, header)
    return Stats(path=path, manifest=manifest, layers=layers, _has_windows=has_windows)


def _check_layer_header(
    path: Path, shard: str, li: LayerInfo, window: int, header: dict[str, tuple[tuple[int, ...], str]]
) -> bool:
    h, k, v = li.heads, li.key_dim, li.value_dim
    expect = {
        "E": ((h, k, k), "F64"),
        "C": ((h, k, k), "F64"),
        "read_energy": ((h,), "F64"),
        "E_col4": ((h,), "F64"),
        "C_col4": ((h,), "F64"),
        "n_checkpoints": ((1,), "I64"),
        "n_reads": ((1,), "I64"),
    }
    for split in SPLITS:
        for name, (shape, dtype) in expect.items():
            key = f"layers.{li.layer}.{split}.{name}"
            if key not in header:
                raise SketchcalError(
                    f"{path / shard} lacks {key}: the shard is incomplete or from another "
                    "run; rerun sketchcal calibrate"
                )
            got_shape, got_dtype = header[key]
            if got_shape != shape or got_dtype != dtype:
                raise SketchcalError(
                    f"{key} in {path / shard} has shape {list(got_shape)} {got_dtype}, "
                    f"expected {list(shape)} {dtype} from the manifest; the statistics do "
                    "not match their manifest"
                )
    names = [f"layers.{li.layer}.heldout.windows.{n}" for n in ("S", "u", "mask")]
    present = [n in header for n in names]
    if not any(present):
        return False
    if not all(present):
        raise SketchcalError(f"{path / shard}: the held-out window sample of layer {li.layer} is incomplete")
    (s_shape, _), (u_shape, _), (m_shape, _) = (header[n] for n in names)
    r = s_shape[0] if s_shape else -1
    if s_shape != (r, h, k, v) or u_shape != (r, window - 1, h, k) or m_shape != (r, window - 1):
        raise SketchcalError(
            f"{path / shard}: held-out windows of layer {li.layer} have shapes "
            f"{list(s_shape)}, {list(u_shape)}, {list(m_shape)}; expected [R, {h}, {k}, {v}], "
            f"[R, {window - 1}, {h}, {k}], [R, {window - 1}]"
        )
    return True
