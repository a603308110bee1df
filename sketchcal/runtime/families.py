"""How each family's transformers kernel functions are called and what they return.

The family adapters (:mod:`sketchcal.models`) turn a call's arguments into
:class:`~sketchcal.kernels.common.StepInputs`; this module holds the rest the runtime needs to stand
in for a call: which arguments carry the token dim (to split a prefill), the state argument and its
layout, the shape of the result, and how to run the model's own one-token function over the tokens
of a chunked call (the ``standard`` mode of a teacher-forced forward).

Function contracts (transformers 5.x torch references):

- GDN ``torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size, initial_state,
  output_final_state, use_qk_l2norm_in_kernel)`` and ``torch_recurrent_gated_delta_rule`` (same,
  without chunk_size) return ``(out [B, T, Hv, V] in query's dtype, state [B, H, K, V] or None)``.
  KDA's ``chunk/recurrent_kimi_delta_attention`` have the same contract (g per key channel).
- Mamba-2 ``mamba2_chunk_scan(hidden_states [B, T, H, P], dt [B, T, H], A [H], B, C [B, T, G, N],
  chunk_size, D [H], dt_bias [H], initial_states, dt_softplus, dt_limit, return_final_states)``
  returns ``out`` float32 (with the D skip) or ``(out, state [B, H, P, N])``;
  ``mamba2_selective_state_update(state [B, H, P, N], hidden_states [B, H, P], dt [B, H, P],
  A [H, P, N], B, C [B, G, N], D [H, P], dt_bias [H, P], dt_softplus, z)`` updates ``state`` in place
  and returns ``(Sᵀ C + D x) · silu(z)`` [B, H, P] in hidden_states' dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class FunctionGlue:
    family: str
    token_args: tuple[str, ...]  # prefill-function arguments whose dim 1 is the token dim
    prefill_state: str  # the prefill function's initial-state argument
    decode_state: str  # the decode function's state argument
    final_flag: str  # the prefill function's "return the final state" flag
    value_major: bool  # transformers stores the state as [B, H, V, K] (Mamba-2)

    def num_tokens(self, named: dict[str, Any]) -> int:
        return named[self.token_args[0]].shape[1]

    def batch(self, named: dict[str, Any]) -> int:
        return named[self.token_args[0]].shape[0]

    def to_key_major(self, s: Tensor) -> Tensor:
        return s.transpose(-1, -2) if self.value_major else s

    def from_key_major(self, s: Tensor) -> Tensor:
        return s.transpose(-1, -2) if self.value_major else s

    def slice_tokens(self, named: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
        """The prefill-call arguments restricted to tokens [start, stop)."""
        return {n: v[:, start:stop] if n in self.token_args else v for n, v in named.items()}

    def prefill_result(self, named: dict[str, Any], out: Tensor, state_hf: Tensor | None) -> Any:
        """What the prefill function returns for outputs ``out`` [B, T, H, V] and its final state."""
        if self.family == "mamba2":
            out = out.float()
            return (out, state_hf) if named.get(self.final_flag) else out
        out = out.to(named["query"].dtype)
        return out, state_hf if named.get(self.final_flag) else None

    def decode_result(self, named: dict[str, Any], out: Tensor, state_hf: Tensor) -> Any:
        """What the decode function returns for outputs ``out`` [B, T, H, V] (Mamba-2: T = 1)."""
        if self.family == "mamba2":
            y = out[:, 0].float()
            if named.get("z") is not None:
                y = y * F.silu(named["z"].float())
            return y.to(named["hidden_states"].dtype)
        out = out.to(named["query"].dtype)
        return out, state_hf if named.get(self.final_flag) else None

    def own_steps(
        self, decode_fn: Callable, named: dict[str, Any], state_hf: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Run the model's own one-token function over the tokens of prefill-format ``named``.

        Called the way the mixers call it (leading tensors positional), so a GPU kernel with other
        parameter names works too. Returns the outputs [B, T, H, V] (float32, skip included,
        ungated) and the final state (transformers layout); ``state_hf`` is not modified.
        """
        extra = {n: v for n, v in named.items() if n not in _PREFILL_ONLY and n not in self.token_args}
        if self.family != "mamba2":
            q, k, v = (named[n] for n in ("query", "key", "value"))
            extra = {n: x for n, x in extra.items() if n not in ("use_qk_l2norm_in_kernel",)}
            out, state = decode_fn(
                q,
                k,
                v,
                g=named["g"],
                beta=named["beta"],
                initial_state=state_hf,
                output_final_state=True,
                use_qk_l2norm_in_kernel=named.get("use_qk_l2norm_in_kernel", False),
                **extra,
            )
            return out.float(), state
        state = state_hf.clone()
        head_dim, n = named["hidden_states"].shape[-1], named["B"].shape[-1]
        a = named["A"][:, None, None].expand(-1, head_dim, n)
        d = None if named.get("D") is None else named["D"][:, None].expand(-1, head_dim)
        dt_bias = None if named.get("dt_bias") is None else named["dt_bias"][:, None].expand(-1, head_dim)
        extra = {x: y for x, y in extra.items() if x not in ("A", "D", "dt_bias", "dt_softplus", "z")}
        outs = []
        for t in range(self.num_tokens(named)):
            dt = named["dt"][:, t, :, None].expand(-1, -1, head_dim)
            x, b, c = named["hidden_states"][:, t], named["B"][:, t], named["C"][:, t]
            y = decode_fn(
                state,
                x,
                dt,
                a,
                b,
                c,
                d,
                z=None,
                dt_bias=dt_bias,
                dt_softplus=named.get("dt_softplus", False),
                **extra,
            )
            outs.append(y.float())
        return torch.stack(outs, dim=1), state


# Prefill-only arguments the one-token functions do not take.
_PREFILL_ONLY = frozenset(
    {"chunk_size", "initial_state", "initial_states", "output_final_state", "return_final_states"}
    | {"dt_limit", "cu_seqlens"}
)

_DELTA_TOKENS = ("query", "key", "value", "g", "beta")

GLUES: dict[str, FunctionGlue] = {
    "gdn": FunctionGlue("gdn", _DELTA_TOKENS, "initial_state", "initial_state", "output_final_state", False),
    "kda": FunctionGlue("kda", _DELTA_TOKENS, "initial_state", "initial_state", "output_final_state", False),
    "mamba2": FunctionGlue(
        "mamba2", ("hidden_states", "dt", "B", "C"), "initial_states", "state", "return_final_states", True
    ),
}
