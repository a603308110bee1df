"""The fastest public decode kernel of each family, run in place on a slot pool from the model's own
decode arguments: the recurrent step of the ``public`` row of ``sketchcal bench --e2e`` (what a
serving engine with the best public kernels does per layer and token).

Each kernel is called as its library calls it, in the state layout where it is fastest
(BENCHMARKS.md, "Decode kernels"), and writes the new state over the old one:

- GDN: fla's fused recurrent gated delta rule with the value-major state ([N, H, V, K],
  ``state_v_first``), launched with fla's own shape (8 value rows, one warp) and its final state
  written over its initial one. fla's wrapper writes a fresh final-state tensor instead; in place
  is what an engine does (vLLM's GDN decode does it), the same bytes without the copy back.
- KDA: fla's ``fused_recurrent_kda_fwd`` with the key-major state ([N, H, K, V]), in place at
  ``ssm_state_indices``.
- Mamba-2: ``selective_state_update`` (vLLM's Triton kernel, else mamba_ssm's) with the
  value-major state ([N, H, P, N_state]), in place at ``state_batch_indices``.

Arguments arrive as transformers passes them to the family's decode function (T = 1 token):
GDN / KDA ``query``, ``key`` [B, T, Hk, K], ``value`` [B, T, H, V], ``g`` [B, T, H] (GDN) or
[B, T, H, K] (KDA), ``beta`` [B, T, H], ``use_qk_l2norm_in_kernel``; Mamba-2 ``hidden_states``
[B, H, P], ``dt``, ``A``, ``B``, ``C``, ``D``, ``dt_bias``, ``dt_softplus``, ``z``. Every call
returns the outputs [B, T, H, V] (Mamba-2 [B, H, P]). Each function raises ``ImportError`` when its
library is not installed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

# the state layout each family's public kernel runs in (True: value-major)
VALUE_MAJOR = {"gdn": True, "kda": False, "mamba2": True}


def gdn_step(state: Tensor, args: dict[str, Any]) -> Tensor:
    """fla's GDN decode, in place on the value-major ``state`` [B, H, V, K] fp32 (contiguous)."""
    import triton
    from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_fwd_kernel

    q, k, v, g, beta = (args[n].contiguous() for n in ("query", "key", "value", "g", "beta"))
    b, t, hk, kd = k.shape
    h, vd = v.shape[2], v.shape[3]
    bv = min(8, triton.next_power_of_2(vd))  # fla's launch shape
    o = torch.empty_like(v)
    fused_recurrent_gated_delta_rule_fwd_kernel[(triton.cdiv(vd, bv) * b * h,)](
        q=q, k=k, v=v, g=g, gk=None, gv=None, beta=beta, A_log=None, dt_bias=None, o=o,
        h0=state, ht=state, cu_seqlens=None, scale=kd**-0.5, T=t, H=hk, HV=h, K=kd, V=vd,
        BK=triton.next_power_of_2(kd), BV=bv, IS_BETA_HEADWISE=True,
        USE_QK_L2NORM_IN_KERNEL=bool(args.get("use_qk_l2norm_in_kernel")), APPLY_BETA_SIGMOID=False,
        ALLOW_NEG_EIGVAL=False, STATE_V_FIRST=True, num_warps=1, num_stages=3,
    )  # fmt: skip
    return o


def kda_step(state: Tensor, args: dict[str, Any], slots: Tensor) -> Tensor:
    """fla's KDA decode, in place on the key-major ``state`` [N, H, K, V] fp32 at ``slots`` [B]."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    q, k, v, g, beta = (args[n].contiguous() for n in ("query", "key", "value", "g", "beta"))
    out = fused_recurrent_kda_fwd(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        initial_state=state,
        inplace_final_state=True,
        ssm_state_indices=slots,
        use_qk_l2norm_in_kernel=bool(args.get("use_qk_l2norm_in_kernel")),
    )
    return out[0]


def _selective_state_update() -> tuple[Callable, dict]:
    """vLLM's ``selective_state_update`` (with the keywords it needs here), else mamba_ssm's."""
    try:
        from vllm.model_executor.layers.mamba.ops.mamba_ssm import selective_state_update

        return selective_state_update, dict(null_block_id=-1)  # slot 0 is a sequence, not a null block
    except ImportError:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update

        return selective_state_update, {}


def mamba2_step(state: Tensor, args: dict[str, Any], slots: Tensor) -> Tensor:
    """``selective_state_update``, in place on the value-major ``state`` [N, H, P, N_state] fp32 at
    ``slots`` [B]; returns y [B, H, P]."""
    ssu, extra = _selective_state_update()
    x = args["hidden_states"]
    if "null_block_id" in extra:
        extra = dict(extra, out=torch.empty_like(x))
    y = ssu(
        state,
        x,
        args["dt"],
        args["A"],
        args["B"],
        args["C"],
        D=args.get("D"),
        z=args.get("z"),
        dt_bias=args.get("dt_bias"),
        dt_softplus=bool(args.get("dt_softplus")),
        state_batch_indices=slots,
        **extra,
    )
    return extra["out"] if y is None else y


def available(family: str) -> str | None:
    """Why the family's public kernel cannot run here (None: it can)."""
    try:
        if family == "mamba2":
            _selective_state_update()
        elif family == "gdn":
            from fla.ops.gated_delta_rule.fused_recurrent import (  # noqa: F401
                fused_recurrent_gated_delta_rule_fwd_kernel,
            )
        else:
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd  # noqa: F401
    except ImportError as err:
        library = "vLLM or mamba_ssm" if family == "mamba2" else "flash-linear-attention"
        return f"the public {family} decode kernel needs {library} ({err})"
    return None
