"""Which transformers architectures sketchcal supports, and where their mixers live.

One row per architecture: its ``model_type``, the op family of its recurrent mixers, the
transformers modeling module that defines them and the mixer class. Everything
family-specific (how kernel arguments map to keys, queries and values) is in the family
adapters beside this file.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    model_type: str
    family: str  # "mamba2" | "gdn" | "kda"
    module: str  # transformers modeling module defining the mixer and its kernel functions
    mixer: str  # mixer class name


def _arch(model_type: str, family: str, package: str, mixer: str) -> Architecture:
    return Architecture(model_type, family, f"transformers.models.{package}.modeling_{package}", mixer)


_ROWS = [
    _arch("mamba2", "mamba2", "mamba2", "Mamba2Mixer"),
    _arch("nemotron_h", "mamba2", "nemotron_h", "NemotronHMamba2Mixer"),
    _arch("falcon_h1", "mamba2", "falcon_h1", "FalconH1Mixer"),
    _arch("zamba2", "mamba2", "zamba2", "Zamba2MambaMixer"),
    _arch("granitemoehybrid", "mamba2", "granitemoehybrid", "GraniteMoeHybridMambaLayer"),
    _arch("bamba", "mamba2", "bamba", "BambaMixer"),
    _arch("qwen3_next", "gdn", "qwen3_next", "Qwen3NextGatedDeltaNet"),
    _arch("qwen3_5", "gdn", "qwen3_5", "Qwen3_5GatedDeltaNet"),
    _arch("qwen3_5_text", "gdn", "qwen3_5", "Qwen3_5GatedDeltaNet"),
    _arch("qwen3_5_moe", "gdn", "qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
    _arch("qwen3_5_moe_text", "gdn", "qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
    _arch("olmo_hybrid", "gdn", "olmo_hybrid", "OlmoHybridGatedDeltaNet"),
    _arch("lara_mini", "gdn", "lara_mini", "LaraMiniGatedDeltaNet"),
    _arch("qwen4_exp", "gdn", "qwen4_exp", "Qwen4ExpTextGatedDeltaNet"),
    _arch("qwen4_exp_text", "gdn", "qwen4_exp", "Qwen4ExpTextGatedDeltaNet"),
    _arch("kimi_linear", "kda", "kimi_linear", "KimiLinearDeltaAttention"),
    _arch("bailing_hybrid", "kda", "bailing_hybrid", "BailingHybridDeltaAttention"),
    _arch("glm5_next", "kda", "glm5_next", "Glm5NextTextLinearAttention"),
    _arch("glm5_next_text", "kda", "glm5_next", "Glm5NextTextLinearAttention"),
]

ARCHITECTURES: dict[str, Architecture] = {row.model_type: row for row in _ROWS}

FAMILY_NAMES = {"mamba2": "Mamba-2", "gdn": "GDN", "kda": "KDA"}


def supported_summary() -> str:
    """One line listing the supported model types per family (for error messages)."""
    parts = []
    for fam, label in FAMILY_NAMES.items():
        types = sorted({a.model_type for a in _ROWS if a.family == fam})
        parts.append(f"{label}: {', '.join(types)}")
    return "; ".join(parts)
