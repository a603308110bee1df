"""Kimi Delta Attention adapter (KimiLinear, BailingHybrid, GLM-5-Next).

The mixers call ``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention`` with
query/key/value [B, T, H, K], a per-key-channel log-decay ``g`` [B, T, H, K] and ``beta`` [B, T, H].
Every head is its own group.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from sketchcal.models.base import DeltaRuleAdapter, LayerShape


class KdaAdapter(DeltaRuleAdapter):
    family = "kda"
    prefill_fn = "chunk_kimi_delta_attention"
    decode_fn = "recurrent_kimi_delta_attention"

    @staticmethod
    def l2norm(x: Tensor) -> Tensor:
        # transformers' KDA l2norm: x / sqrt(Σx² + 1e-6), in float32 (differs from GDN's rsqrt form)
        return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)

    @staticmethod
    def query_scale(key_dim: int) -> float:
        return 1 / key_dim**0.5

    def layer_shape(self, mixer: nn.Module) -> LayerShape:
        return LayerShape(mixer.layer_idx, mixer.num_heads, mixer.num_heads, mixer.head_dim, mixer.head_dim)
