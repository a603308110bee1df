"""Mamba-2 adapter (Mamba2, NemotronH, FalconH1, Zamba2, GraniteMoeHybrid, Bamba).

Prefill calls ``mamba2_chunk_scan(x [B, T, H, P], dt [B, T, H], A [H], B/C [B, T, G, N], ...)``;
decode calls ``mamba2_selective_state_update(state [B, H, P, N], x [B, H, P], dt [B, H, P],
A [H, P, N], B/C [B, G, N], D [H, P], dt_bias [H, P], ...)``. Architecture-specific scalings
(FalconH1's µP multipliers, ...) are applied by the mixer before these calls, so they are
already in the arguments. In the design's notation K = d_state (N), V = head_dim (P),
k = B, q = C, w = dt·x, a = exp(dt·A), and reads add the skip D·x. transformers stores the
state as [B, H, P, N]; we expose it key-major, [B, H, N, P].

The chunked function clamps dt to the model's ``time_step_limit`` and the one-token function does
not; decoded tokens get the one-token dynamics wherever they are converted (``step_dynamics``: the
runtime's decode steps, calibration's decoded tokens), since those are what decoding computes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sketchcal.kernels.common import StepInputs
from sketchcal.models.base import ArgMap, Converted, LayerShape, first_output


class Mamba2Adapter:
    family = "mamba2"
    prefill_fn = "mamba2_chunk_scan"
    decode_fn = "mamba2_selective_state_update"

    def layer_shape(self, mixer: nn.Module) -> LayerShape:
        return LayerShape(
            mixer.layer_idx, mixer.num_heads, mixer.n_groups, mixer.ssm_state_size, mixer.head_dim
        )

    def inputs(
        self, kind: str, args: ArgMap, dtype: torch.dtype = torch.float64, *, step_dynamics: bool = False
    ) -> Converted:
        x, dt, A, B, C, D, dt_bias, state = _terms(args, one_token=kind != "prefill")
        if dt_bias is not None:
            dt = dt + dt_bias.to(dt.dtype)
        if args.get("dt_softplus"):
            dt = F.softplus(dt)
        if kind == "prefill" and not step_dynamics:  # the one-token function applies no dt limit
            lo, hi = args.get("dt_limit", (0.0, float("inf")))
            dt = torch.clamp(dt, min=lo, max=hi)
        dt = dt.float().to(dtype)
        x = x.float().to(dtype)
        rep = x.shape[-2] // B.shape[-2]
        k, q = (t.float().to(dtype).repeat_interleave(rep, dim=-2) for t in (B, C))
        decay = torch.exp(dt * A.float().to(dtype))
        skip = None if D is None else D.float().to(dtype)[:, None] * x
        inputs = StepInputs(k=k, q=q, w=dt[..., None] * x, decay=decay, beta=None, skip=skip)
        return inputs, None if state is None else state.to(dtype).transpose(-1, -2)

    @staticmethod
    def fused_inputs(args: ArgMap, dtype: torch.dtype) -> StepInputs:
        """:meth:`inputs` of a decode step in the kernels' layout, from one Triton kernel
        (:func:`sketchcal.kernels.common.prepare.mamba2_inputs`; ``inputs`` is its reference)."""
        from sketchcal.kernels.common.prepare import mamba2_inputs

        x, dt, A, B, C, D, dt_bias, _ = _terms(args, one_token="state" in args)
        return mamba2_inputs(x, dt, A, B, C, D, dt_bias, softplus=bool(args.get("dt_softplus")), dtype=dtype)

    def pre_gate_output(self, kind: str, result: Any) -> Tensor:
        out = first_output(result)
        return out if kind == "prefill" else out[:, None]


def _terms(args: ArgMap, *, one_token: bool) -> tuple[Tensor, ...]:
    """(x [B, T, H, P], dt [B, T, H], A [H], B, C [B, T, G, N], D [H] or None, dt_bias [H] or None,
    initial state) of a call: a prefill call's arguments as they are; a one-token call's with T = 1
    and the per-head parameters taken from their broadcasts over head_dim / d_state."""
    x, dt, A, B, C = (args[n] for n in ("hidden_states", "dt", "A", "B", "C"))
    D, dt_bias = args.get("D"), args.get("dt_bias")
    if not one_token:
        return x, dt, A, B, C, D, dt_bias, args.get("initial_states")
    D = None if D is None else D[:, 0]
    dt_bias = None if dt_bias is None else dt_bias[:, 0]
    return x[:, None], dt[:, None, :, 0], A[:, 0, 0], B[:, None], C[:, None], D, dt_bias, args.get("state")
