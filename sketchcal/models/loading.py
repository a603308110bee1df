"""Load a model (a Hub id, a local directory, or a built-in tiny model) with its tokenizer."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from sketchcal.errors import SketchcalError
from sketchcal.models.capture import use_torch_path
from sketchcal.models.registry import ARCHITECTURES, supported_summary
from sketchcal.models.spec import ModelSpec, describe

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


def _weights_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return "sha256:" + digest.hexdigest()[:16]


def _load_builtin(name: str, device: str) -> LoadedModel:
    """``builtin:NAME``: the trained demo model in ``assets/models/NAME`` when it ships, else (and
    always for ``builtin:random-NAME``) a small random-weight model of the same architecture
    (:func:`sketchcal.models.tiny.tiny_config`, seed 0)."""
    import transformers as tf

    from sketchcal.models.tiny import tiny_config

    key = name.removeprefix("builtin:")
    base = key.removeprefix("random-")
    if base not in BUILTIN_MODELS:
        names = ", ".join([*BUILTIN_MODELS, *(f"random-{k}" for k in BUILTIN_MODELS)])
        raise SketchcalError(f"unknown built-in model {name!r}; choose one of {names}")
    trained = TRAINED_MODELS / base
    if key == base and (trained / "model.safetensors").is_file():
        tokenizer = tf.AutoTokenizer.from_pretrained(trained)
        model = tf.AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
        if model.config.model_type != BUILTIN_MODELS[base]:
            raise SketchcalError(
                f"{trained} holds a {model.config.model_type} model, expected {BUILTIN_MODELS[base]}; "
                "reinstall sketchcal"
            )
        revision = _weights_digest(trained / "model.safetensors")
    else:
        tokenizer = tf.AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
        config = tiny_config(BUILTIN_MODELS[base], vocab_size=len(tokenizer))
        config.pad_token_id = config.eos_token_id = config.bos_token_id = tokenizer.eos_token_id
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = tf.AutoModelForCausalLM.from_config(config).eval()
        revision = None
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    return LoadedModel(model.to(device), tokenizer, describe(model), f"builtin:{key}", revision)


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
    if model is None or model.startswith("builtin:"):
        loaded = _load_builtin(model or DEFAULT_MODEL, resolve_device(device))
    else:
        loaded = _load_pretrained(model, revision, device, dtype, device_map, trust_remote_code)
    if loaded.device.type == "cpu":
        use_torch_path(loaded.spec)
    return loaded


def _load_pretrained(model, revision, device, dtype, device_map, trust_remote_code) -> LoadedModel:
    import transformers as tf

    if dtype not in DTYPES:
        raise SketchcalError(f"unknown --dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
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
        raise SketchcalError(f"cannot load {model!r}: {str(err).splitlines()[0]}") from err
    if config.model_type not in ARCHITECTURES:
        raise SketchcalError(
            f"unsupported architecture {config.model_type!r}: sketchcal supports {supported_summary()}"
        )
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
    model_id = str(local.resolve()) if local.exists() else model
    return LoadedModel(net, tokenizer, describe(net), model_id, resolved)
