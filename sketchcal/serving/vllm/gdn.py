"""The served GDN layer (Qwen3.5, Qwen3-Next): vLLM's ``QwenGatedDeltaNetAttention`` with replay or
sketch decode steps.

vLLM decodes GDN differently on each device; the served decode step replaces the call it makes:

- CPU: the layer's ``cpu_gdn_attention_core`` op runs prefill rows through its chunked kernel and
  decode rows through ``vllm._custom_ops.fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias,
  q, k [1, B, Hk, K], v [1, B, Hv, V], a, b [B, Hv], initial_state_source, initial_state_indices,
  cu_seqlens, use_qk_l2norm_in_kernel)``, which returns [B, 1, Hv, V]. vLLM's CPU kernels keep the
  state key-major in memory (they view the declared [H, V, K] page as [H, K, V]); so does the
  checkpoint here.
- CUDA: ``_forward_core`` (inside vLLM's ``qwen_gdn_attention_core`` op) runs a batch of plain decode
  rows through ``fused_recurrent_gated_delta_rule_packed_decode(mixed_qkv [B, 2·Hk·K + Hv·V] (after
  the conv), a, b [B, Hv], A_log, dt_bias, scale, initial_state, out [B, 1, Hv, V],
  ssm_state_indices [B], use_qk_l2norm_in_kernel)`` when its packed decode is on, which the served
  layer turns on; a batch with prefill rows runs its decode rows through vLLM's own kernels from
  the state in the page, so, as for KDA, their buffers are folded into the checkpoints before it and
  every such row restarts its window after it. The state is value-major [N, H, V, K]; the
  checkpoint is its transpose view.

Either call's gates are transformers' (``g = −exp(A_log)·softplus(a + dt_bias)``, ``β =
sigmoid(b)``), and :class:`~sketchcal.models.gdn.GdnAdapter` turns them into the design's inputs
(l2-normed keys, queries scaled by K^-½, w = β·v).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

from sketchcal.errors import SketchcalError
from sketchcal.models.gdn import GdnAdapter
from sketchcal.runtime.kernel_state import kernel_inputs
from sketchcal.serving.vllm.layer import ServedLayer

CUDA_DECODE = (
    "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn",
    "fused_recurrent_gated_delta_rule_packed_decode",
)
_ARGS = ("A_log", "dt_bias", "q", "k", "v", "a", "b", "initial_state_source", "initial_state_indices")


class SketchQwenGatedDeltaNet(ServedLayer, QwenGatedDeltaNetAttention):
    """``QwenGatedDeltaNetAttention`` whose decode rows run sketchcal's replay or sketch step."""

    vllm_decode = ("vllm._custom_ops", "fused_sigmoid_gating_delta_rule_update_cpu")
    adapter = GdnAdapter()

    def layer_dims(self) -> tuple[int, int, int, int]:
        tp = self.tp_size
        return (self.num_v_heads // tp, self.num_k_heads // tp, self.head_k_dim, self.head_v_dim)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.on_cuda:
            self.enable_packed_recurrent_decode = True  # plain decode batches make the packed call

    @property
    def on_cuda(self) -> bool:
        return self.serving is not None and self.serving.device == "cuda"

    def decode_target(self) -> tuple[str, str]:
        return CUDA_DECODE if self.on_cuda else self.vllm_decode

    def checkpoint_view(self, state: Tensor) -> Tensor:
        if self.on_cuda:
            return state.transpose(-1, -2)
        n, h, v, k = state.shape
        return state.view(n, h, k, v)

    def forward(self, hidden_states: Tensor) -> Tensor:
        if self.serving is None or self.on_cuda:  # on CUDA the served part is _forward_core
            return super().forward(hidden_states)
        with self.base_forward():
            out = super().forward(hidden_states)
        meta = get_forward_context().attn_metadata
        meta = meta.get(self.prefix) if isinstance(meta, dict) else None
        if meta is not None and meta.num_prefills > 0:
            rows = meta.non_spec_state_indices_tensor[meta.num_decodes : meta.num_decodes + meta.num_prefills]
            self.settle(rows, buffered=False)
        return out

    def _forward_core(self, mixed_qkv: Tensor, b: Tensor, a: Tensor, core_attn_out: Tensor) -> None:
        if not self.on_cuda:
            return super()._forward_core(mixed_qkv, b, a, core_attn_out)
        with self.vllm_kernels_continue_decode_rows():
            super()._forward_core(mixed_qkv, b, a, core_attn_out)
        return None

    def decode_call(self, kind: str, original: Any, args: tuple, kwargs: dict[str, Any]) -> Tensor | None:
        """In place of the decode call of this layer's decode rows (one token each): the CPU op, or
        on CUDA the packed decode (its output written into ``out``)."""
        if self.on_cuda:
            return self._packed_decode(args, kwargs)
        named = {**dict(zip(_ARGS, args, strict=False)), **kwargs}
        q, k, v = (named[n].transpose(0, 1) for n in ("q", "k", "v"))  # [B, 1, heads, dim]
        o = self._step(q, k, v, named, named["initial_state_indices"])
        return o.to(named["q"].dtype)

    def _packed_decode(self, args: tuple, kwargs: dict[str, Any]) -> None:
        kd, vd, hk, hv = self.plan.key_dim, self.plan.value_dim, self.plan.groups, self.plan.heads
        scale = kwargs.get("scale")
        if args or kwargs.get("out") is None or (scale is not None and abs(scale - kd**-0.5) > 1e-12):
            raise SketchcalError(
                "fused_recurrent_gated_delta_rule_packed_decode is called in a way this plugin does not know"
            )
        mixed, out = kwargs["mixed_qkv"], kwargs["out"]
        n = mixed.shape[0]
        q, k, v = mixed.split([hk * kd, hk * kd, hv * vd], dim=-1)
        o = self._step(
            q.reshape(n, 1, hk, kd), k.reshape(n, 1, hk, kd), v.reshape(n, 1, hv, vd), kwargs,
            kwargs["ssm_state_indices"],
        )  # fmt: skip
        out.copy_(o.to(out.dtype).view_as(out))
        return None

    def _step(self, q: Tensor, k: Tensor, v: Tensor, named: dict[str, Any], blocks: Tensor) -> Tensor:
        """One served decode token per row from the call's q, k [B, 1, Hk, K], v [B, 1, Hv, V] and
        its gate terms (``a``, ``b`` [B, Hv], ``A_log``, ``dt_bias``); outputs [B, 1, Hv, V] fp32."""
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
        x, _ = self.adapter.inputs("decode", call)
        xk = kernel_inputs(x, self.plan.groups, self.serving.buffer_dtype)
        return self.decoder.step(self.pages(), blocks.reshape(-1), xk)
