"""The sketch tensors of a converted model: ``sketch/sketch.safetensors`` (format version 3).

Per mixer layer i (decoder-layer index), with H heads, G groups, key dim K:

| name | shape, dtype | meaning |
|---|---|---|
| ``layers.{i}.frame`` | [G, K, K] f32 | frame R_g (rotated coordinates: ``S' = R_g S``, ``u' = R_g u``) |
| ``layers.{i}.coef`` | [H, M, K] f32 | rotated coefficient maps; rows ``:m_h`` of head h are ``[I_m  Gᵀ]`` |
| ``layers.{i}.ranks`` | [H] i32 | m_h; 0 = dense (read the full state, exact) |

``M = max(1, max_h m_h)``; rows ≥ m_h are zero (a dense head's map is all zero). Head h uses frame
``h // (H // G)``. A read is ``Sᵀu ≈ (R S)_{:m}ᵀ (coef[h, :m] @ (R u))``, or with ``sketch_map`` =
``adaptive`` in config.json the adaptive read of rank m_h on the frame's first m_h rows (the maps
are then not read).

Safetensors metadata (all strings): ``format`` = ``sketchcal-sketch``, ``version`` = ``3``,
``family``, ``window``, ``fingerprint``, ``producer`` (``sketchcal <version>``), ``layers`` (comma-
separated layer indices).

Version 2 added integrity records to the ``sketch_config`` section of config.json: ``files`` (the
sha256 of every ``*.safetensors`` file of the directory: the sketch, the curves, the weights) and
``base_model.weights_fingerprint``. Version 1 directories (no records) still load, unchecked.
Version 3 added ``sketch_config.sketch_map`` (``static`` | ``adaptive``: what the ranks are for);
versions 1 and 2 are static.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from sketchcal import __version__
from sketchcal.errors import SketchcalError, first_line
from sketchcal.integrity import check_files, save_safetensors, short

SKETCH_FORMAT = "sketchcal-sketch"
SKETCH_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # 1: no file hashes; 2: static maps only; 3: ``sketch_map``
SKETCH_DIR = "sketch"
SKETCH_FILE = "sketch/sketch.safetensors"
CONFIG_KEY = "sketch_config"
PRODUCER = {"name": "sketchcal", "version": __version__}


@dataclass
class SketchLayer:
    layer: int
    frame: Tensor  # [G, K, K] f32
    coef: Tensor  # [H, M, K] f32
    ranks: Tensor  # [H] i32

    @property
    def heads(self) -> int:
        return int(self.ranks.shape[0])

    @property
    def groups(self) -> int:
        return int(self.frame.shape[0])

    @property
    def key_dim(self) -> int:
        return int(self.frame.shape[-1])

    def frame_of(self, head: int) -> Tensor:
        return self.frame[head // (self.heads // self.groups)]


@dataclass
class SketchArtifact:
    config: dict[str, Any]  # the ``sketch_config`` section of config.json
    metadata: dict[str, str]
    layers: list[SketchLayer]

    @property
    def fingerprint(self) -> str:
        return self.metadata["fingerprint"]

    @property
    def sketch_map(self) -> str:
        """What the ranks are for: ``static`` or ``adaptive`` (format versions 1–2 are static)."""
        return str(self.config.get("sketch_map", "static"))

    def layer(self, index: int) -> SketchLayer:
        for lay in self.layers:
            if lay.layer == index:
                return lay
        raise KeyError(index)


def write_sketch(
    path: str | Path, layers: list[SketchLayer], *, family: str, window: int, fingerprint: str
) -> None:
    """Write the sketch tensors to ``path`` (a fresh file; callers write inside an atomic directory)."""
    tensors: dict[str, Tensor] = {}
    for lay in layers:
        tensors[f"layers.{lay.layer}.frame"] = lay.frame.to(torch.float32).contiguous()
        tensors[f"layers.{lay.layer}.coef"] = lay.coef.to(torch.float32).contiguous()
        tensors[f"layers.{lay.layer}.ranks"] = lay.ranks.to(torch.int32).contiguous()
    meta = {
        "format": SKETCH_FORMAT,
        "version": str(SKETCH_VERSION),
        "family": family,
        "window": str(window),
        "fingerprint": fingerprint,
        "producer": f"{PRODUCER['name']} {PRODUCER['version']}",
        "layers": ",".join(str(lay.layer) for lay in layers),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, path, metadata=meta)


def read_sketch(model_dir: str | Path, config=None) -> SketchArtifact:
    """Read and validate the sketch of a converted model directory.

    Args:
        model_dir: the directory ``convert`` wrote.
        config: optionally the config (``PretrainedConfig`` or dict) of the model the sketch will be
            used with; its fingerprint must match the sketch's.

    Raises:
        SketchcalError: not a sketch directory, an unsupported version, a damaged file, or a
            fingerprint mismatch.
    """
    d = Path(model_dir)
    cfg_path = d / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise SketchcalError(
            f"{d} has no config.json; not a model directory written by sketchcal convert"
        ) from None
    except (OSError, json.JSONDecodeError) as err:
        raise SketchcalError(f"{cfg_path} is unreadable ({err}); rerun sketchcal convert") from err
    section = cfg.get(CONFIG_KEY)
    if not isinstance(section, dict) or section.get("format") != SKETCH_FORMAT:
        raise SketchcalError(f"{cfg_path} has no {CONFIG_KEY} section; run sketchcal convert first")
    version = section.get("version")
    if version not in READABLE_VERSIONS:
        raise SketchcalError(
            f"{d}: sketch format version {version!r} is not supported (this sketchcal reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}); reconvert or upgrade sketchcal"
        )
    rel = Path(str(section.get("file", SKETCH_FILE)))
    if rel.is_absolute() or ".." in rel.parts:
        raise SketchcalError(f"{cfg_path}: sketch_config.file must be a path inside the model directory")
    f = d / rel
    if not f.is_file():
        raise SketchcalError(f"{f} is missing; the converted model is incomplete, rerun sketchcal convert")
    meta = _header(f)
    if meta is not None and meta.get("format") != SKETCH_FORMAT:
        raise SketchcalError(
            f"{f} is not a sketchcal sketch file; restore this directory's own file or reconvert"
        )
    if meta is not None and meta.get("fingerprint") != section.get("fingerprint"):
        raise SketchcalError(
            f"{f} is not the sketch of {cfg_path}: it was fitted for another model (fingerprint "
            f"{short(meta.get('fingerprint'))}, config.json's {short(section.get('fingerprint'))}); "
            "restore this directory's own file or reconvert"
        )
    if version >= 2:
        files = section.get("files")
        if not isinstance(files, dict) or rel.as_posix() not in files:
            raise SketchcalError(f"{cfg_path} records no sha256 of {rel}; reconvert")
        check_files(d, files, str(cfg_path))
    if meta is None:
        raise SketchcalError(f"cannot read {f}: it is truncated or corrupt; rerun sketchcal convert")
    try:
        with safe_open(str(f), framework="pt") as fh:
            layers = [
                SketchLayer(
                    layer=i,
                    frame=fh.get_tensor(f"layers.{i}.frame"),
                    coef=fh.get_tensor(f"layers.{i}.coef"),
                    ranks=fh.get_tensor(f"layers.{i}.ranks"),
                )
                for i in (int(idx["layer"]) for idx in section["layers"])
            ]
    except Exception as err:
        raise SketchcalError(
            f"cannot read {f}: it is truncated or corrupt ({first_line(err)}); rerun sketchcal convert"
        ) from err
    art = SketchArtifact(config=section, metadata=meta, layers=layers)
    if config is not None:
        check_fingerprint(art, config, what=str(d))
    return art


def _header(path: Path) -> dict[str, str] | None:
    """The safetensors metadata of ``path``, or None when its header cannot be read."""
    try:
        with safe_open(str(path), framework="pt") as fh:
            return dict(fh.metadata() or {})
    except Exception:
        return None


def check_stats(art: SketchArtifact, stats, what: str) -> None:
    """Fail when the statistics ``stats`` (:class:`~sketchcal.formats.stats.Stats`) are not of the
    artifact's model and window, so re-fits from them would describe another sketch."""
    window = int(art.config.get("window", art.metadata.get("window", 0)))
    if stats.fingerprint != art.fingerprint:
        raise SketchcalError(
            f"the statistics in {stats.path} are of another model (fingerprint {short(stats.fingerprint)}, "
            f"{what}: {short(art.fingerprint)}); pass the statistics it was converted from"
        )
    if stats.window != window:
        raise SketchcalError(
            f"the statistics in {stats.path} come from a window-{stats.window} calibration, {what} "
            f"has window {window}; pass the statistics it was converted from"
        )


def check_base_weights(art: SketchArtifact, weights_fingerprint: str | None, source: str) -> None:
    """Fail when the weights loaded from ``source`` are not the base weights the sketch recorded
    (only when both fingerprints are known)."""
    want = (art.config.get("base_model") or {}).get("weights_fingerprint")
    if want and weights_fingerprint and want != weights_fingerprint:
        raise SketchcalError(
            f"{source} has other weights than the base the sketch was converted from (weights fingerprint "
            f"{short(weights_fingerprint)}, recorded {short(want)}); use that base model"
        )


def check_fingerprint(art: SketchArtifact, config, what: str = "the sketch") -> None:
    """Fail with a clear message when ``config`` is not the architecture the sketch was fitted for."""
    from sketchcal.artifact.fingerprint import config_fingerprint

    got = config_fingerprint(config)
    if got != art.fingerprint:
        raise SketchcalError(
            f"{what} was fitted for another model (fingerprint {art.fingerprint[:12]}…, this "
            f"model {got[:12]}…); use the base model it was converted from, or reconvert"
        )
