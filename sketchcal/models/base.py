"""What every family adapter provides, and the shapes it reports."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from sketchcal.kernels.common import StepInputs

ArgMap = dict[str, Any]  # a kernel function call's arguments by name (defaults applied)
Converted = tuple[StepInputs, Tensor | None]  # the call's kernel inputs and initial state


@dataclass(frozen=True)
class LayerShape:
    """One recurrent mixer layer: H state heads in G groups, each state K×V (key-major)."""

    layer: int
    heads: int
    groups: int
    key_dim: int
    value_dim: int

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.groups

    def as_dict(self) -> dict[str, int]:
        return {
            "layer": self.layer,
            "heads": self.heads,
            "groups": self.groups,
            "key_dim": self.key_dim,
            "value_dim": self.value_dim,
        }


def first_output(result: Any) -> Tensor:
    """The output tensor of a kernel function that may also return its final state."""
    return result[0] if isinstance(result, tuple) else result


def delta_rule_terms(
    args: dict[str, Any], l2norm: Callable[[Tensor], Tensor], dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """What a delta-rule kernel function (GDN, KDA) computes from its arguments before its own query
    scaling: ``(q, k, w, beta, decay, initial_state)`` with q, k in float32 (l2-normed by ``l2norm``
    when the call asks for it), ``beta`` [B, T, H], ``decay = exp(g)`` and ``w = β v`` in ``dtype``,
    and the initial state in ``dtype`` or None."""
    q, k, v = (args[n].float() for n in ("query", "key", "value"))
    if args.get("use_qk_l2norm_in_kernel"):
        q, k = l2norm(q), l2norm(k)
    beta = args["beta"].float().to(dtype)
    decay = args["g"].float().to(dtype).exp()
    state = args.get("initial_state")
    return q, k, beta[..., None] * v.to(dtype), beta, decay, None if state is None else state.to(dtype)


def fused_delta_rule_inputs(args: dict[str, Any], dtype: torch.dtype) -> StepInputs:
    """A GDN / KDA call's decode inputs in the kernels' layout (k, q per group; k, q, w in
    ``dtype``), from one Triton kernel (:mod:`sketchcal.kernels.common.prepare`); the adapters'
    ``inputs`` is its reference."""
    from sketchcal.kernels.common.prepare import delta_rule_inputs

    names = ("query", "key", "value", "g", "beta")
    l2norm = bool(args.get("use_qk_l2norm_in_kernel"))
    return delta_rule_inputs(*(args[n] for n in names), l2norm=l2norm, dtype=dtype)


class DeltaRuleAdapter:
    """What the GDN and KDA adapters share: both families' kernel functions take query and key
    [B, T, Hk, K], value [B, T, H, V], a log-decay ``g`` and ``beta`` [B, T, H], and compute the
    same dynamics in prefill and decode. A subclass names its functions and its layer shape, and
    says which of transformers' two l2-norm and query-scale forms the family uses (their rounding
    differs)."""

    family: str
    prefill_fn: str
    decode_fn: str
    rsqrt_form = False  # x / sqrt(Σx² + ε) and 1 / K^½ (KDA); True: x·rsqrt(Σx² + ε) and K^-½ (GDN)

    def l2norm(self, x: Tensor) -> Tensor:
        """transformers' l2 norm of the family, in float32 (ε = 1e-6)."""
        sq = (x * x).sum(dim=-1, keepdim=True) + 1e-6
        return x * torch.rsqrt(sq) if self.rsqrt_form else x / torch.sqrt(sq)

    def query_scale(self, key_dim: int) -> float:
        return key_dim**-0.5 if self.rsqrt_form else 1 / key_dim**0.5

    def inputs(
        self, kind: str, args: ArgMap, dtype: torch.dtype = torch.float64, *, step_dynamics: bool = False
    ) -> Converted:  # both functions compute the same dynamics
        q, k, w, beta, decay, state = delta_rule_terms(args, self.l2norm, dtype)
        q = q * self.query_scale(q.shape[-1])
        rep = w.shape[-2] // k.shape[-2]  # value heads per key head (1: every head its own group)
        q, k = (t.repeat_interleave(rep, dim=-2).to(dtype) if rep > 1 else t.to(dtype) for t in (q, k))
        return StepInputs(k=k, q=q, w=w, decay=decay, beta=beta), state

    fused_inputs = staticmethod(fused_delta_rule_inputs)

    def pre_gate_output(self, kind: str, result: Any) -> Tensor:
        return first_output(result)


class FamilyAdapter(Protocol):
    """Maps the arguments of a family's transformers kernel functions to :class:`StepInputs`.

    ``prefill_fn`` / ``decode_fn`` name the module-level functions the mixers call (chunked prefill
    and single-token decode). The conversions replay the functions' own preprocessing (l2 norms,
    query scaling, dt softplus and limits, group expansion) and return tensors of ``dtype`` (float64
    for the references and capture, float32 for the kernels, which take no more) in the
    design's key-major layout: k, q [B, T, H, K]; w [B, T, H, V]; decay [B, T, H] or [B, T, H, K].
    The delta-rule adapters also have ``fused_inputs(args, dtype)``: the same inputs in the decode
    kernels' layout, from one Triton kernel (the triton backend's path; ``inputs`` is its reference).
    """

    family: str
    prefill_fn: str
    decode_fn: str

    def layer_shape(self, mixer: nn.Module) -> LayerShape: ...

    def inputs(
        self, kind: str, args: ArgMap, dtype: torch.dtype = torch.float64, *, step_dynamics: bool = False
    ) -> Converted:
        """``(inputs, initial_state)``; the state is key-major [B, H, K, V] ``dtype``, or None.

        ``step_dynamics``: convert a chunked call's tokens as the one-token function would compute
        them (where the two differ: Mamba-2's chunked function limits dt, its step does not)."""
        ...

    def pre_gate_output(self, kind: str, result: Any) -> Tensor:
        """The function's output before any gate, [B, T, H, V]."""
        ...
