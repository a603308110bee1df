"""Load a model (a Hub id, a local directory, or a built-in tiny model) with its tokenizer."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from sketchcal.errors import SketchcalError
from sketchcal.models.capture import use_torch_path
from sketchcal.models.registry import ARCHITECTURES, supported_summary
from sketchcal.models.spec import ModelSpec, describe, describe_config

ASSETS = Path(__file__).resolve().parent.parent / "assets"

# Built-in models: name -> model_type. Trained weights ship in assets/models/<name>/ (recipes/);
# without them, and for builtin:random-<name>, a random-weight tiny config (seed 0) stands in.
BUILTIN_MODELS = {"tiny-gdn": "qwen3_5_text", "tiny-mamba2": "nemotron_h", "tiny-kda": "kimi_linear"}
DEFAULT_MODEL = "builtin:tiny-gdn"
TRAINED_MODELS = ASSETS / "models"

DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object
    spec: ModelSpec
    model_id: str
    revision: str | None
    weights_fingerprint: str | None = None  # sketchcal.integrity; None for in-memory random weights

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SketchcalError(
            f"--device {device} asked for, but no CUDA device is available; use --device cpu"
        )
    return device


def _builtin_paths(name: str) -> tuple[str, str, Path | None]:
    """``(key, base, trained_dir or None)`` of ``builtin:NAME``; an unknown name is a one-line error."""
    key = name.removeprefix("builtin:")
    base = key.removeprefix("random-")
    if base not in BUILTIN_MODELS:
        names = ", ".join([*BUILTIN_MODELS, *(f"random-{k}" for k in BUILTIN_MODELS)])
        raise SketchcalError(f"unknown built-in model {name!r}; choose one of {names}")
    trained = TRAINED_MODELS / base
    return key, base, trained if key == base and (trained / "model.safetensors").is_file() else None


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """transformers' own progress bars off (loading or saving the small built-in models)."""
    from transformers.utils import logging as tf_logging

    was = tf_logging.is_progress_bar_enabled()
    tf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            tf_logging.enable_progress_bar()


def _load_builtin(name: str, device: str, dtype: str = "auto") -> LoadedModel:
    """``builtin:NAME``: the trained demo model in ``assets/models/NAME`` when it ships, else (and
    always for ``builtin:random-NAME``) a small random-weight model of the same architecture
    (:func:`sketchcal.models.tiny.tiny_config`, seed 0). ``dtype`` other than auto casts it."""
    import transformers as tf

    from sketchcal.integrity import weights_fingerprint
    from sketchcal.models.tiny import tiny_config

    key, base, trained = _builtin_paths(name)
    fingerprint = None
    if trained is not None:
        tokenizer = tf.AutoTokenizer.from_pretrained(trained)
        with quiet_progress_bars():  # 14 MiB from the package: no "Loading weights" bar
            model = tf.AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
        if model.config.model_type != BUILTIN_MODELS[base]:
            raise SketchcalError(
                f"{trained} holds a {model.config.model_type} model, expected {BUILTIN_MODELS[base]}; "
                "reinstall sketchcal"
            )
        fingerprint, digests = weights_fingerprint(trained)
        revision = digests["model.safetensors"][:23]  # "sha256:" and 16 hex digits
    else:
        tokenizer = tf.AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
        config = tiny_config(BUILTIN_MODELS[base], vocab_size=len(tokenizer))
        config.pad_token_id = config.eos_token_id = config.bos_token_id = tokenizer.eos_token_id
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = tf.AutoModelForCausalLM.from_config(config).eval()
        revision = None
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    if DTYPES[dtype] != "auto":
        model = model.to(DTYPES[dtype])
    spec = describe(model)
    return LoadedModel(model.to(device), tokenizer, spec, f"builtin:{key}", revision, fingerprint)


def load_model(
    model: str | None = None,
    *,
    revision: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    device_map: str | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load ``model`` for calibration or evaluation.

    ``model``: a Hub id, a local directory, or ``builtin:NAME`` (None = the package default).
    The architecture is checked from the config before any weights are read. On the CPU the
    mixers are bound to transformers' torch references.
    """
    if dtype not in DTYPES:
        raise SketchcalError(f"unknown --dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if model is None or model.startswith("builtin:"):
        loaded = _load_builtin(model or DEFAULT_MODEL, resolve_device(device), dtype)
    else:
        loaded = _load_pretrained(model, revision, device, dtype, device_map, trust_remote_code)
    if loaded.device.type == "cpu":
        use_torch_path(loaded.spec)
    return loaded


def _load_config(model: str, revision: str | None, trust_remote_code: bool):
    """The config of a Hub id or local directory, checked to be a supported architecture (no weights
    are read). Every failure is a one-line error; custom code (``auto_map``) names --trust-remote-code."""
    import transformers as tf

    from sketchcal.hub.resolve import is_hub_id

    local = Path(model).expanduser()
    if not local.exists() and not is_hub_id(model):
        raise SketchcalError(f"model directory {model} does not exist; give a local directory or a Hub id")
    try:
        config = tf.AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    except OSError as err:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = (
            "it is not in the local cache and HF_HUB_OFFLINE=1" if offline else "check the id or your network"
        )
        raise SketchcalError(f"cannot load the config of {model!r}: {hint}") from err
    except ValueError as err:
        if not trust_remote_code and _names_custom_code(model, revision):
            raise SketchcalError(
                f"{model!r} needs its own code (its config.json has an auto_map for a model type "
                "transformers does not know); pass --trust-remote-code if you trust that code"
            ) from err
        raise SketchcalError(f"cannot load {model!r}: {str(err).splitlines()[0]}") from err
    if config.model_type not in ARCHITECTURES:
        raise SketchcalError(
            f"unsupported architecture {config.model_type!r}: sketchcal supports {supported_summary()}"
        )
    return config


def _names_custom_code(model: str, revision: str | None) -> bool:
    from transformers import PretrainedConfig

    try:
        raw, _ = PretrainedConfig.get_config_dict(model, revision=revision)
    except Exception:
        return False
    return bool(raw.get("auto_map"))


def model_spec(
    model: str | None, *, revision: str | None = None, trust_remote_code: bool = False
) -> ModelSpec:
    """The :class:`ModelSpec` of ``model`` from its config alone (built on the ``meta`` device: no
    weights read, no memory allocated), to size outputs before the model loads."""
    import transformers as tf

    from sketchcal.models.tiny import tiny_config

    if model is None or model.startswith("builtin:"):
        _, base, trained = _builtin_paths(model or DEFAULT_MODEL)
        if trained is not None:
            config = tf.AutoConfig.from_pretrained(trained)
        else:
            config = tiny_config(BUILTIN_MODELS[base], vocab_size=len(_builtin_tokenizer()))
    else:
        config = _load_config(model, revision, trust_remote_code)
    return describe_config(config)


def _builtin_tokenizer():
    import transformers as tf

    return tf.AutoTokenizer.from_pretrained(ASSETS / "tokenizer")


def _snapshot_dir(model: str, revision: str | None) -> Path | None:
    """The local directory transformers loaded ``model``'s files from (a directory, or the Hub cache's
    snapshot), or None when it cannot be found."""
    local = Path(model).expanduser()
    if local.is_dir():
        return local
    try:
        from transformers.utils import cached_file

        cfg = cached_file(
            model, "config.json", revision=revision, _raise_exceptions_for_missing_entries=False
        )
    except Exception:
        return None
    return Path(cfg).parent if cfg else None


def _load_pretrained(model, revision, device, dtype, device_map, trust_remote_code) -> LoadedModel:
    import transformers as tf

    from sketchcal.integrity import weights_fingerprint

    config = _load_config(model, revision, trust_remote_code)
    kwargs = dict(revision=revision, trust_remote_code=trust_remote_code, dtype=DTYPES[dtype])
    if device_map:
        kwargs["device_map"] = device_map
    net = tf.AutoModelForCausalLM.from_pretrained(model, **kwargs).eval()
    if not device_map:
        net = net.to(resolve_device(device))
    tokenizer = tf.AutoTokenizer.from_pretrained(
        model, revision=revision, trust_remote_code=trust_remote_code
    )
    resolved = getattr(config, "_commit_hash", None) or revision
    local = Path(model).expanduser()
    model_id = str(local.resolve()) if local.exists() else model
    snapshot = _snapshot_dir(model, revision)
    fingerprint = weights_fingerprint(snapshot)[0] if snapshot is not None else None
    return LoadedModel(net, tokenizer, describe(net), model_id, resolved, fingerprint)
