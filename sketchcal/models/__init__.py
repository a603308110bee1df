"""Model adapters: detect a hybrid model's family and tap its recurrent mixers."""

from sketchcal.models.base import FamilyAdapter, LayerShape
from sketchcal.models.capture import MixerCall, MixerTap, use_torch_path
from sketchcal.models.registry import ARCHITECTURES, Architecture, supported_summary
from sketchcal.models.spec import ModelSpec, describe

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "FamilyAdapter",
    "LayerShape",
    "MixerCall",
    "MixerTap",
    "ModelSpec",
    "describe",
    "supported_summary",
    "use_torch_path",
]
