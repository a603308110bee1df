"""The statistics directory that ``sketchcal calibrate`` writes and ``convert`` / ``verify`` read.

The one home of the format (docs/stats-format.md, version 2): its file names, tensor names and
layouts, the writer and the reader. Version 2 added the output weights of the reads (``C_fisher``,
``fisher``, ``windows.gamma``); version 1 directories are refused with a one-line error that says
to recalibrate.

Layout::

    manifest.json                       written last; "complete": true marks a finished run
    stats-0000i-of-0000n.safetensors    the sums, in shards of whole layers (at most ~2 GiB each)
    _progress/                          only while a run is unfinished: state.json naming the
                                        cumulative sums after the last completed round
                                        (sums-<round>.safetensors)

Tensors, per mixer layer i and split s ∈ :data:`SPLITS` (H heads, key dim K, value dim V, window L,
R kept windows): the sums :func:`moment_layout` ``layers.{i}.{s}.<name>`` and the verbatim held-out
window sample :func:`window_layout` ``layers.{i}.heldout.windows.<S|u|gamma|mask>``.

Writing: the progress sums are written before the state that points to them, each atomically, so a
crash at any point leaves either the previous consistent progress or the new one. Reading:
:func:`load_stats` validates the manifest and every shard's header (names, shapes, dtypes) up front;
the tensors themselves are read one layer at a time (:meth:`Stats.moments`, :meth:`Stats.windows`)
and checked for NaN/Inf as they are read. Every problem is a one-line
:class:`~sketchcal.errors.SketchcalError`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from sketchcal.errors import SketchcalError, first_line
from sketchcal.fsutil import atomic_path, remove_stale_temporaries, write_json

FORMAT = "sketchcal-stats"
VERSION = 2
MANIFEST = "manifest.json"
PROGRESS = "_progress"
PROGRESS_STATE = "state.json"
SHARD_PREFIX = "stats-"
SHARD_BYTES = 2 * 2**30
SPLITS = ("calib", "heldout")
WINDOWS = "windows"  # the held-out window sample: layers.{i}.heldout.windows.<S|u|gamma|mask>
# what calibrate may replace with --overwrite: its own files (the plot included) and hidden temporaries
_OURS = (MANIFEST, PROGRESS, SHARD_PREFIX, "calibration.png")
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.int64: "I64", torch.uint8: "U8"}


def moment_layout(heads: int, key_dim: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each sum of one (layer, split), by name (see :class:`Moments`)."""
    h, k = heads, key_dim
    f64 = torch.float64
    return {
        "E": ((h, k, k), f64),
        "C": ((h, k, k), f64),
        "C_fisher": ((h, k, k), f64),
        "read_energy": ((h,), f64),
        "fisher": ((h,), f64),
        "E_col4": ((h,), f64),
        "C_col4": ((h,), f64),
        "n_checkpoints": ((1,), torch.int64),
        "n_reads": ((1,), torch.int64),
    }


MOMENT_NAMES = tuple(moment_layout(1, 1))


def window_layout(
    count: int, heads: int, key_dim: int, value_dim: int, window: int
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of the held-out window sample of ``count`` windows, by name ``windows.*``
    (see :class:`HeldoutWindows`)."""
    r, h, k, v, p = count, heads, key_dim, value_dim, window - 1
    return {
        f"{WINDOWS}.S": ((r, h, k, v), torch.float32),
        f"{WINDOWS}.u": ((r, p, h, k), torch.float32),
        f"{WINDOWS}.gamma": ((r, p, h), torch.float32),
        f"{WINDOWS}.mask": ((r, p), torch.uint8),
    }


def tensor_name(layer: int, split: str, name: str) -> str:
    """``layers.{layer}.{split}.{name}``, e.g. ``layers.3.calib.E`` or ``layers.3.heldout.windows.S``."""
    return f"layers.{layer}.{split}.{name}"


def layer_of(name: str) -> int:
    """The layer index in a tensor name of :func:`tensor_name`."""
    return int(name.split(".")[1])


def shard_name(index: int, count: int) -> str:
    """File name of shard ``index`` (1-based) of ``count``."""
    return f"{SHARD_PREFIX}{index:05d}-of-{count:05d}.safetensors"


# ---------------------------------------------------------------------------------------------
# Writing


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
    remove_stale_temporaries(out)  # of writers killed in an earlier run
    entries = sorted(p.name for p in out.iterdir()) if out.exists() else []
    if PROGRESS in entries and not (out / PROGRESS / PROGRESS_STATE).exists():
        # a run killed before its first save: nothing to resume, nothing to keep
        if clear and not resume:
            shutil.rmtree(out / PROGRESS, ignore_errors=True)
        entries.remove(PROGRESS)
    if resume:
        if (out / MANIFEST).exists() and read_manifest(out, require_complete=False).get("complete"):
            raise SketchcalError(f"{out} already holds a complete calibration; nothing to resume")
        if not (out / PROGRESS / PROGRESS_STATE).exists():
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
    write_json(prog / PROGRESS_STATE, {**state, "round_done": round_done, "sums": name})
    for old in prog.glob("sums-*.safetensors"):
        if old.name != name:
            old.unlink()


def load_progress(out: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The state and cumulative sums of an interrupted run (:func:`save_progress`)."""
    prog = out / PROGRESS
    try:
        state = json.loads((prog / PROGRESS_STATE).read_text())
        tensors = load_file(str(prog / state["sums"]))
    except (OSError, KeyError, json.JSONDecodeError, SafetensorError) as err:
        raise SketchcalError(f"the progress in {prog} is damaged; rerun with --overwrite") from err
    return state, tensors


def write_final(
    out: Path,
    tensors: dict[str, torch.Tensor],
    manifest: dict[str, Any],
    *,
    shard_bytes: int = SHARD_BYTES,
) -> dict[str, Any]:
    """Write the shards (whole layers each, at most ``shard_bytes`` unless one layer is larger),
    then the manifest (``"complete": true``, each layer entry given its ``shard``), then drop the
    progress. ``manifest["layers"]`` lists ``{"layer", "heads", "groups", "key_dim", "value_dim"}``;
    returns the manifest as written."""
    layers = manifest["layers"]
    by_layer: dict[int, dict[str, torch.Tensor]] = {entry["layer"]: {} for entry in layers}
    for name, t in tensors.items():
        by_layer[layer_of(name)][name] = t.contiguous()
    groups: list[list[int]] = [[]]
    size = 0
    for entry in layers:
        nbytes = sum(t.numel() * t.element_size() for t in by_layer[entry["layer"]].values())
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry["layer"])
        size += nbytes
    for i, group in enumerate(groups):
        shard = shard_name(i + 1, len(groups))
        with atomic_path(out / shard) as tmp:
            save_file({k: v for layer in group for k, v in by_layer[layer].items()}, str(tmp))
        for entry in layers:
            if entry["layer"] in group:
                entry["shard"] = shard
    manifest = {**manifest, "complete": True}
    write_json(out / MANIFEST, manifest)
    shutil.rmtree(out / PROGRESS, ignore_errors=True)
    return manifest


# ---------------------------------------------------------------------------------------------
# Reading


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
    C_fisher: Tensor  # [H, K, K] f64, Σ_reads γ u uᵀ (γ: the read's output weight)
    read_energy: Tensor  # [H] f64, Σ_reads ‖S_cᵀ u‖²
    fisher: Tensor  # [H] f64, Σ_reads γ ‖S_cᵀ u‖²
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
    def C_fisher_mean(self) -> Tensor:
        """[H, K, K] ``mean γ u uᵀ`` per read."""
        return self.C_fisher / max(self.n_reads, 1)

    @property
    def empty(self) -> bool:
        return self.n_checkpoints <= 0 or self.n_reads <= 0


@dataclass
class HeldoutWindows:
    """The verbatim held-out window sample of one layer."""

    S: Tensor  # [R, H, K, V] f32 checkpoints
    u: Tensor  # [R, L−1, H, K] f32 effective queries
    gamma: Tensor  # [R, L−1, H] f32 output weights of the reads
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

    def decoded_tokens(self, split: str) -> int | None:
        """Decoded (non-prompt) tokens of ``split`` in the manifest's counts; None when absent."""
        n = ((self.manifest.get("tokens") or {}).get(split) or {}).get("decode")
        return int(n) if n else None

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
            t = {n: self._read(fh, li, tensor_name(layer, split, n)) for n in MOMENT_NAMES}
        m = Moments(
            E=t["E"].to(torch.float64),
            C=t["C"].to(torch.float64),
            C_fisher=t["C_fisher"].to(torch.float64),
            read_energy=t["read_energy"].to(torch.float64),
            fisher=t["fisher"].to(torch.float64),
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
            s, u, gamma, mask = (
                self._read(fh, li, tensor_name(layer, "heldout", n))
                for n in window_layout(0, li.heads, li.key_dim, li.value_dim, self.window)
            )
        if s.shape[0] == 0:
            return None
        return HeldoutWindows(S=s, u=u, gamma=gamma, mask=mask.to(torch.bool))


def _bad_manifest(path: Path, why: str) -> SketchcalError:
    return SketchcalError(
        f"{path / MANIFEST}: {why}; rerun sketchcal calibrate (it resumes an unfinished run)"
    )


def _int(d: dict, key: str, where: str, path: Path, minimum: int = 0) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise _bad_manifest(path, f"{where}{key} must be an integer ≥ {minimum}, got {v!r}")
    return v


def read_manifest(path: Path, *, require_complete: bool = True) -> dict[str, Any]:
    """The validated manifest of the statistics directory ``path`` (format and version checked)."""
    if not path.exists():
        raise SketchcalError(f"statistics directory {path} does not exist")
    if not path.is_dir():
        raise SketchcalError(f"{path} is not a statistics directory (expected a folder with {MANIFEST})")
    mf = path / MANIFEST
    if not mf.exists():
        if (path / PROGRESS).exists():
            raise SketchcalError(
                f"{path} holds an unfinished calibration (no {MANIFEST} yet); "
                "rerun sketchcal calibrate with the same --out to resume it"
            )
        raise SketchcalError(
            f"no {MANIFEST} in {path}: not a statistics directory, or the calibration "
            "did not finish; rerun sketchcal calibrate"
        )
    try:
        manifest = json.loads(mf.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _bad_manifest(path, f"unreadable or truncated JSON ({first_line(err)})") from err
    if not isinstance(manifest, dict):
        raise _bad_manifest(path, "not a JSON object")
    if manifest.get("format") != FORMAT:
        raise _bad_manifest(path, f"format is {manifest.get('format')!r}, expected {FORMAT!r}")
    if manifest.get("version") == 1:
        raise SketchcalError(
            f"{mf}: statistics format version 1 holds no output weights of the reads, which the rank "
            f"allocation now needs; recalibrate (sketchcal calibrate) to write version {VERSION}"
        )
    if manifest.get("version") != VERSION:
        raise SketchcalError(
            f"{mf}: statistics format version {manifest.get('version')!r} is not supported "
            f"(this sketchcal reads version {VERSION}); recalibrate or upgrade sketchcal"
        )
    if require_complete and manifest.get("complete") is not True:
        raise _bad_manifest(path, "the calibration is marked incomplete")
    return manifest


def load_stats(stats_dir: str | Path) -> Stats:
    """Open and validate a statistics directory (format version 2).

    Checks: the manifest (present, valid JSON, format/version, ``complete: true``, required
    fields), every shard (present, opens, holds all tensors of its layers with the documented
    shapes and dtypes). Tensor values are checked when read.

    Raises:
        SketchcalError: one line saying what is wrong and what to do.
    """
    path = Path(stats_dir)
    manifest = read_manifest(path)
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
                f"shard {shard} listed in {path / MANIFEST} is missing; "
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
    expect = {name: (shape, _SAFETENSORS_DTYPES[dt]) for name, (shape, dt) in moment_layout(h, k).items()}
    for split in SPLITS:
        for name, (shape, dtype) in expect.items():
            key = tensor_name(li.layer, split, name)
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
    names = [tensor_name(li.layer, "heldout", n) for n in window_layout(0, h, k, v, window)]
    present = [n in header for n in names]
    if not any(present):
        return False
    if not all(present):
        raise SketchcalError(f"{path / shard}: the held-out window sample of layer {li.layer} is incomplete")
    (s_shape, _), (u_shape, _), (g_shape, _), (m_shape, _) = (header[n] for n in names)
    r = s_shape[0] if s_shape else -1
    if (
        s_shape != (r, h, k, v)
        or u_shape != (r, window - 1, h, k)
        or g_shape != (r, window - 1, h)
        or m_shape != (r, window - 1)
    ):
        raise SketchcalError(
            f"{path / shard}: held-out windows of layer {li.layer} have shapes "
            f"{list(s_shape)}, {list(u_shape)}, {list(g_shape)}, {list(m_shape)}; expected "
            f"[R, {h}, {k}, {v}], [R, {window - 1}, {h}, {k}], [R, {window - 1}, {h}], [R, {window - 1}]"
        )
    return True


def load_stats_tensors(path: str | Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Every tensor of a finished statistics directory at once: (manifest, tensors by name)."""
    path = Path(path)
    manifest = read_manifest(path)
    tensors: dict[str, Tensor] = {}
    for shard in sorted({entry["shard"] for entry in manifest["layers"]}):
        try:
            tensors.update(load_file(str(path / shard)))
        except (OSError, SafetensorError) as err:
            raise SketchcalError(
                f"{path / shard} is missing or truncated; rerun sketchcal calibrate"
            ) from err
    return manifest, tensors
