"""Gated DeltaNet adapter (Qwen3-Next, Qwen3.5 dense and MoE, OlmoHybrid, ...).

The mixers call ``torch_chunk_gated_delta_rule`` (prefill) and ``torch_recurrent_gated_delta_rule``
(decode) with query/key [B, T, Hk, K], value [B, T, Hv, V], log-decay ``g`` and ``beta`` [B, T, Hv].
Key heads are the groups; each serves Hv/Hk consecutive value heads.
"""

from __future__ import annotations

from torch import nn

from sketchcal.models.base import DeltaRuleAdapter, LayerShape


class GdnAdapter(DeltaRuleAdapter):
    family = "gdn"
    prefill_fn = "torch_chunk_gated_delta_rule"
    decode_fn = "torch_recurrent_gated_delta_rule"
    rsqrt_form = True

    def layer_shape(self, mixer: nn.Module) -> LayerShape:
        heads, groups = mixer.num_v_heads, mixer.num_k_heads  # the key heads are the groups
        return LayerShape(mixer.layer_idx, heads, groups, mixer.head_k_dim, mixer.head_v_dim)
