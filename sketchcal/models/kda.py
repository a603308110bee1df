"""Kimi Delta Attention adapter (KimiLinear, BailingHybrid, GLM-5-Next).

The mixers call ``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention`` with
query/key/value [B, T, H, K], a per-key-channel log-decay ``g`` [B, T, H, K] and ``beta`` [B, T, H].
"""

from __future__ import annotations

from torch import nn

from sketchcal.models.base import DeltaRuleAdapter, LayerShape


class KdaAdapter(DeltaRuleAdapter):
    """Every head is its own group, with K = V = ``head_dim``."""

    family = "kda"
    prefill_fn = "chunk_kimi_delta_attention"
    decode_fn = "recurrent_kimi_delta_attention"

    def layer_shape(self, mixer: nn.Module) -> LayerShape:
        return LayerShape(mixer.layer_idx, mixer.num_heads, mixer.num_heads, mixer.head_dim, mixer.head_dim)
