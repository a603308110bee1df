"""The served Mamba-2 mixer (Nemotron-H, Falcon-H1, Granite-4.0-H): vLLM's ``MambaMixer2`` with
replay or sketch decode steps.

vLLM's ``MambaMixer2.conv_ssm_forward`` runs the conv and prefill of a batch and calls
``selective_state_update(ssm_state, x [B, H, P], dt [B, H, P], A [H, P, N], B, C [B, G, N],
D [H, P], dt_bias [H, P], dt_softplus=True, state_batch_indices=blocks, out=[B, H, P], ...)`` for its
decode rows, z = None (the gate is applied by the norm after). That call has the contract of
transformers' ``mamba2_selective_state_update``, so :class:`~sketchcal.models.mamba2.Mamba2Adapter`
turns it into the design's inputs (k = B, q = C, w = dt·x, decay = exp(dt·A), skip = D·x). vLLM's
state is [N, H, P, N_s] (value-major); the checkpoint is its transpose view [N, H, N_s, P].
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

from sketchcal.models.mamba2 import Mamba2Adapter
from sketchcal.runtime.kernel_state import kernel_inputs
from sketchcal.serving.vllm.layer import ServedLayer


class SketchMambaMixer2(ServedLayer, MambaMixer2):
    """``MambaMixer2`` whose decode rows run sketchcal's replay or sketch step."""

    vllm_decode = ("vllm.model_executor.layers.mamba.mamba_mixer2", "selective_state_update")
    adapter = Mamba2Adapter()

    def layer_dims(self) -> tuple[int, int, int, int]:
        return (self.num_heads, self.n_groups, self.ssm_state_size, self.head_dim)

    def checkpoint_view(self, state: Tensor) -> Tensor:
        return state.transpose(-1, -2)

    def conv_ssm_forward(self, projected_states: Tensor, output: Tensor) -> Any:
        if self.serving is None:
            return super().conv_ssm_forward(projected_states, output)
        with self.base_forward():
            result = super().conv_ssm_forward(projected_states, output)
        meta = get_forward_context().attn_metadata
        meta = meta.get(self.prefix) if isinstance(meta, dict) else None
        if meta is not None and meta.num_prefills > 0:
            self.settle(meta.state_indices_tensor_p, buffered=False)
        return result

    def decode_call(self, kind: str, original: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        """In place of ``selective_state_update`` for this layer's decode rows (one token each)."""
        names = ("state", "hidden_states", "dt", "A", "B", "C", "D", "dt_bias")
        named = dict(zip(names, args, strict=False))
        named.update({k: v for k, v in kwargs.items() if k in names or k == "dt_softplus"})
        named.pop("state")  # the whole pool: the step reads its own views
        out = kwargs["out"]
        x, _ = self.adapter.inputs("decode", named)
        xk = kernel_inputs(x, self.n_groups, self.serving.buffer_dtype)
        o = self.decoder.step(self.pages(), kwargs["state_batch_indices"].reshape(-1), xk)
        out.copy_(o[:, 0].to(out.dtype).view_as(out))
