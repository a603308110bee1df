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
        if kind == "prefill":
            x, dt, A, B, C = (args[n] for n in ("hidden_states", "dt", "A", "B", "C"))
            D, state = args.get("D"), args.get("initial_states")
        else:  # one token, per-head parameters broadcast over head_dim / d_state
            x, dt, B, C = (
                args["hidden_states"][:, None],
                args["dt"][:, None, :, 0],
                args["B"][:, None],
                args["C"][:, None],
            )
            A = args["A"][:, 0, 0]
            D, state = args.get("D"), args.get("state")
            D = None if D is None else D[:, 0]
        dt_bias = args.get("dt_bias")
        if dt_bias is not None:
            dt_bias = dt_bias if kind == "prefill" else dt_bias[:, 0]
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

        return mamba2_inputs(args, dtype)

    def pre_gate_output(self, kind: str, result: Any) -> Tensor:
        out = first_output(result)
        return out if kind == "prefill" else out[:, None]
