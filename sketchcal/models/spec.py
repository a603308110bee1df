"""Detect a loaded model's architecture and describe its recurrent layers."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from torch import nn

from sketchcal.errors import SketchcalError
from sketchcal.models.base import FamilyAdapter, LayerShape
from sketchcal.models.gdn import GdnAdapter
from sketchcal.models.kda import KdaAdapter
from sketchcal.models.mamba2 import Mamba2Adapter
from sketchcal.models.registry import ARCHITECTURES, Architecture, supported_summary

ADAPTERS: dict[str, FamilyAdapter] = {"mamba2": Mamba2Adapter(), "gdn": GdnAdapter(), "kda": KdaAdapter()}


@dataclass
class ModelSpec:
    """A supported model: its architecture row, family adapter and recurrent layers (by index)."""

    arch: Architecture
    layers: list[LayerShape]
    config_summary: dict = field(default_factory=dict)

    @property
    def family(self) -> str:
        return self.arch.family

    @property
    def adapter(self) -> FamilyAdapter:
        return ADAPTERS[self.arch.family]

    def mixers(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in model.modules() if type(m).__name__ == self.arch.mixer]

    @property
    def fingerprint(self) -> str:
        """sha256 of the architecture-defining facts: model type, sizes, and every mixer's shape."""
        blob = json.dumps(
            {
                "model_type": self.arch.model_type,
                **self.config_summary,
                "layers": [s.as_dict() for s in self.layers],
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()


def _config_summary(config) -> dict:
    text = getattr(config, "get_text_config", lambda: config)()
    return {
        "vocab_size": getattr(text, "vocab_size", None),
        "hidden_size": getattr(text, "hidden_size", None),
        "num_hidden_layers": getattr(text, "num_hidden_layers", None),
    }


def describe(model: nn.Module) -> ModelSpec:
    """Find the family and the recurrent mixer layers of ``model``.

    Raises :class:`SketchcalError` for an unknown architecture or a model without such layers.
    """
    config = model.config
    model_type = getattr(config, "model_type", None)
    arch = ARCHITECTURES.get(model_type)
    if arch is None:
        name = ", ".join(getattr(config, "architectures", None) or [type(model).__name__])
        raise SketchcalError(
            f"unsupported architecture {model_type!r} ({name}): sketchcal supports {supported_summary()}"
        )
    adapter = ADAPTERS[arch.family]
    spec = ModelSpec(arch=arch, layers=[], config_summary=_config_summary(config))
    spec.layers = sorted((adapter.layer_shape(m) for m in spec.mixers(model)), key=lambda s: s.layer)
    if not spec.layers:
        raise SketchcalError(
            f"{model_type} model has no linear-attention or Mamba-2 layers (only attention?): "
            f"nothing to calibrate; sketchcal supports {supported_summary()}"
        )
    return spec


def describe_config(config) -> ModelSpec:
    """:func:`describe` of the model ``config`` defines, built on the ``meta`` device (no weights
    read, no memory allocated)."""
    import torch
    import transformers as tf

    if getattr(config, "model_type", None) not in ARCHITECTURES:
        name = ", ".join(getattr(config, "architectures", None) or ["?"])
        raise SketchcalError(
            f"unsupported architecture {getattr(config, 'model_type', None)!r} ({name}): "
            f"sketchcal supports {supported_summary()}"
        )
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    return describe(model)
