"""Gated DeltaNet adapter (Qwen3-Next, Qwen3.5 dense and MoE, OlmoHybrid, ...).

The mixers call ``torch_chunk_gated_delta_rule`` (prefill) and ``torch_recurrent_gated_delta_rule``
(decode) with query/key [B, T, Hk, K], value [B, T, Hv, V], log-decay ``g`` and ``beta`` [B, T, Hv].
Key heads are the groups; each serves Hv/Hk consecutive value heads.
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
    # transformers' GDN l2norm: x · rsqrt(Σx² + 1e-6), in float32
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


class GdnAdapter:
    family = "gdn"
    prefill_fn = "torch_chunk_gated_delta_rule"
    decode_fn = "torch_recurrent_gated_delta_rule"

    def layer_shape(self, mixer: nn.Module) -> LayerShape:
        heads, groups = mixer.num_v_heads, mixer.num_k_heads  # the key heads are the groups
        return LayerShape(mixer.layer_idx, heads, groups, mixer.head_k_dim, mixer.head_v_dim)

    def inputs(
        self, kind: str, args: ArgMap, dtype: torch.dtype = torch.float64, *, step_dynamics: bool = False
    ) -> Converted:  # both functions compute the same dynamics
        q, k, w, beta, decay, state = delta_rule_terms(args, _l2norm, dtype)
        q = q * q.shape[-1] ** -0.5
        rep = w.shape[-2] // k.shape[-2]  # value heads per key head
        q, k = (t.repeat_interleave(rep, dim=-2).to(dtype) for t in (q, k))
        return StepInputs(k=k, q=q, w=w, decay=decay, beta=beta), state

    fused_inputs = staticmethod(fused_delta_rule_inputs)

    def pre_gate_output(self, kind: str, result: Any) -> Tensor:
        return first_output(result)
