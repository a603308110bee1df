"""Kimi Delta Attention adapter (KimiLinear, BailingHybrid, GLM-5-Next).

The mixers call ``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention`` with
query/key/value [B, T, H, K], a per-key-channel log-decay ``g`` [B, T, H, K] and ``beta`` [B, T, H].
Every head is its own group.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from sketchcal.kernels.common import StepInputs
from sketchcal.models.base import (
    ArgMap,
    Converted,
    LayerShape,
    delta_rule_terms,
    first_output,
    fused_delta_rule_inputs,
)


def _l2norm(x: Tensor) -> Tensor:
    # transformers' KDA l2norm: x / sqrt(Σx² + 1e-6), in float32 (differs from GDN's rsqrt form)
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


class KdaAdapter:
    family = "kda"
    prefill_fn = "chunk_kimi_delta_attention"
    decode_fn = "recurrent_kimi_delta_attention"

    def layer_shape(self, mixer: nn.Module) -> LayerShape:
        return LayerShape(mixer.layer_idx, mixer.num_heads, mixer.num_heads, mixer.head_dim, mixer.head_dim)

    def inputs(
        self, kind: str, args: ArgMap, dtype: torch.dtype = torch.float64, *, step_dynamics: bool = False
    ) -> Converted:  # both functions compute the same dynamics
        q, k, w, beta, decay, state = delta_rule_terms(args, _l2norm, dtype)
        q = q * (1 / q.shape[-1] ** 0.5)
        return StepInputs(k=k.to(dtype), q=q.to(dtype), w=w, decay=decay, beta=beta), state

    fused_inputs = staticmethod(fused_delta_rule_inputs)

    def pre_gate_output(self, kind: str, result: Any) -> Tensor:
        return first_output(result)
