"""The served GDN layer (Qwen3.5, Qwen3-Next): vLLM's ``QwenGatedDeltaNetAttention`` with replay or
sketch decode steps.

On a CPU vLLM runs the layer's conv and recurrence in its ``cpu_gdn_attention_core`` op: prefill
rows through its chunked kernel, decode rows through
``vllm._custom_ops.fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k [1, B, Hk, K],
v [1, B, Hv, V], a, b [B, Hv], initial_state_source, initial_state_indices, cu_seqlens,
use_qk_l2norm_in_kernel)``, which returns [B, 1, Hv, V]. That call is the served decode step: the
gates are transformers' (``g = −exp(A_log)·softplus(a + dt_bias)``, ``β = sigmoid(b)``), and
:class:`~sketchcal.models.gdn.GdnAdapter` turns the call into the design's inputs (l2-normed keys,
queries scaled by K^-½, w = β·v). vLLM's CPU kernels keep the state key-major in memory (they view
the declared [H, V, K] page as [H, K, V]); so does the checkpoint here.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

from sketchcal.models.gdn import GdnAdapter
from sketchcal.runtime.kernel_state import kernel_inputs
from sketchcal.serving.vllm.layer import ServedLayer

DECODE_MODULE = "vllm._custom_ops"
DECODE_FUNCTION = "fused_sigmoid_gating_delta_rule_update_cpu"
_ARGS = ("A_log", "dt_bias", "q", "k", "v", "a", "b", "initial_state_source", "initial_state_indices")
_ADAPTER = GdnAdapter()


class SketchQwenGatedDeltaNet(ServedLayer, QwenGatedDeltaNetAttention):
    """``QwenGatedDeltaNetAttention`` whose decode rows run sketchcal's replay or sketch step."""

    decode_module, decode_function = DECODE_MODULE, DECODE_FUNCTION

    def layer_dims(self) -> tuple[int, int, int, int]:
        tp = self.tp_size
        return (self.num_v_heads // tp, self.num_k_heads // tp, self.head_k_dim, self.head_v_dim)

    def checkpoint_view(self, state: Tensor) -> Tensor:
        n, h, v, k = state.shape
        return state.view(n, h, k, v)

    def forward(self, hidden_states: Tensor) -> Tensor:
        if self.serving is None:
            return super().forward(hidden_states)
        with self.base_forward():
            out = super().forward(hidden_states)
        meta = get_forward_context().attn_metadata
        meta = meta.get(self.prefix) if isinstance(meta, dict) else None
        if meta is not None and meta.num_prefills > 0:
            rows = meta.non_spec_state_indices_tensor[meta.num_decodes : meta.num_decodes + meta.num_prefills]
            self.settle(rows, buffered=False)
        return out

    def decode_call(self, kind: str, original: Any, args: tuple, kwargs: dict[str, Any]) -> Tensor:
        """In place of the CPU decode op for this layer's decode rows (one token each)."""
        named = {**dict(zip(_ARGS, args, strict=False)), **kwargs}
        q, k, v = (named[n].transpose(0, 1) for n in ("q", "k", "v"))  # [B, 1, heads, dim]
        a, b = named["a"].float(), named["b"].float()
        g = -named["A_log"].float().exp() * F.softplus(a + named["dt_bias"].float())
        call = {
            "query": q,
            "key": k,
            "value": v,
            "g": g[:, None],
            "beta": b.sigmoid()[:, None],
            "use_qk_l2norm_in_kernel": named.get("use_qk_l2norm_in_kernel", False),
        }
        x, _ = _ADAPTER.inputs("decode", call)
        xk = kernel_inputs(x, self.plan.groups, self.serving.buffer_dtype)
        pool, cursor = self.pool()
        o = self.decoder.step(pool, cursor, named["initial_state_indices"].reshape(-1), xk)
        return o.to(named["q"].dtype)
