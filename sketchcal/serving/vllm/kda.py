"""The served KDA layer (Kimi-Linear): vLLM's ``KimiGatedDeltaNetAttention`` with replay or sketch
decode steps.

The layer's ``_forward`` runs a batch of plain decode rows through
``fused_recurrent_kda_packed_decode(mixed_qkv [B, 2·H·K + H·V] (after the conv), raw_g [1, B, H, K],
raw_beta [1, B, H], A_log [H], dt_bias [H·K], lower_bound, initial_state [N, H, V, K],
state_indices [B])``, imported at each call from ``vllm.models.kimi_k3.nvidia.ops.third_party.kda``;
that call is the served decode step. Its gate is ``g = −exp(A_log)·softplus(raw_g + dt_bias)`` per
key channel (``lower_bound·sigmoid(exp(A_log)·(raw_g + dt_bias))`` with a lower bound), β =
sigmoid(raw_beta); :class:`~sketchcal.models.kda.KdaAdapter` turns it into the design's inputs.
vLLM's state is value-major [N, H, V, K]; the checkpoint is its transpose view.

A batch with prefill rows runs every non-speculative row, decode rows included, through vLLM's
chunked kernel from the state in the page. So before it the buffers of the decode rows are folded
into their checkpoints (the exact current state), and after it every such row restarts its window
from the state vLLM wrote.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention

from sketchcal.errors import SketchcalError
from sketchcal.models.kda import KdaAdapter
from sketchcal.runtime.kernel_state import kernel_inputs
from sketchcal.serving.vllm.layer import ServedLayer


class SketchKimiDeltaAttention(ServedLayer, KimiGatedDeltaNetAttention):
    """``KimiGatedDeltaNetAttention`` whose decode rows run sketchcal's replay or sketch step."""

    adapter = KdaAdapter()
    vllm_decode = ("vllm.models.kimi_k3.nvidia.ops.third_party.kda", "fused_recurrent_kda_packed_decode")

    def layer_dims(self) -> tuple[int, int, int, int]:
        h, d = self.local_num_heads, self.head_dim
        return (h, h, d, d)

    def checkpoint_view(self, state: Tensor) -> Tensor:
        return state.transpose(-1, -2)

    def _forward(self, *args: Any, **kwargs: Any) -> None:
        if self.serving is None:
            return super()._forward(*args, **kwargs)
        with self.vllm_kernels_continue_decode_rows():
            super()._forward(*args, **kwargs)
        return None

    def decode_call(
        self, kind: str, original: Any, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[Tensor, Tensor]:
        """In place of ``fused_recurrent_kda_packed_decode`` for this layer's decode rows."""
        if args or kwargs.get("scale") is not None or kwargs.get("out") is not None:
            raise SketchcalError(
                "fused_recurrent_kda_packed_decode is called in a way this plugin does not know"
            )
        mixed, raw_g = kwargs["mixed_qkv"], kwargs["raw_g"]
        _, b, h, k = raw_g.shape
        v = (mixed.shape[1] - 2 * h * k) // h
        q, key, value = mixed.split([h * k, h * k, h * v], dim=-1)
        gate = raw_g[0].float() + kwargs["dt_bias"].float().view(h, k)
        a = kwargs["A_log"].float().exp()[:, None]
        bound = kwargs.get("lower_bound")
        g = -a * F.softplus(gate) if bound is None else bound * torch.sigmoid(a * gate)
        call = {
            "query": q.reshape(b, 1, h, k),
            "key": key.reshape(b, 1, h, k),
            "value": value.reshape(b, 1, h, v),
            "g": g[:, None],
            "beta": kwargs["raw_beta"][0].float().sigmoid()[:, None],
            "use_qk_l2norm_in_kernel": True,
        }
        x, _ = self.adapter.inputs("decode", call)
        xk = kernel_inputs(x, self.plan.groups, self.serving.buffer_dtype)
        o = self.decoder.step(self.pages(), kwargs["state_indices"].reshape(-1), xk)
        return o[:, 0][None].to(mixed.dtype), kwargs["initial_state"]
