"""The standard decode step (the baseline), shared by the three families.

Per program (grid ``(V / BV, H, B)``): one slot's fp32 state tile of BV value columns, read
once, advanced through the T tokens ``S ← A S + k wᵀ``, ``o = Sᵀ q (+ skip)`` each, and written
back. Inputs in the kernel layout of ``common/pool.py``.

The state is the logical [N, H, K, V] fp32 tensor in either storage order: key-major (contiguous;
the tile is [K, BV]) or value-major (the transpose of a contiguous [N, H, V, K], the layout vLLM
and fla's ``state_v_first`` keep; the tile is [BV, K], so each value column's k·S and q·S
reductions run along contiguous keys). ``allocate_pool(..., value_major=True)`` makes the second.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from sketchcal.kernels.common.recurrence import StepInputs
from sketchcal.kernels.common.triton_helpers import (
    FAMILY_ID,
    beta_or_placeholder,
    clip_block_v,
    dependent_launch,
    head_tile,
    launch_options,
    program_slot,
    step_emit,
)


@triton.jit
def _standard_kernel(
    state, slots, q, k, w, decay, beta, skip, out,
    T: tl.constexpr, H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    FAMILY: tl.constexpr, HAS_SKIP: tl.constexpr, VALUE_MAJOR: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    dependent_launch(PDL)
    i_v, i_h, i_b, s = program_slot(slots)
    if s < 0:
        return
    i_g, o_k, o_v = head_tile(i_v, i_h, H, G, K, BV)
    if VALUE_MAJOR:  # [BV, K] tile of the [V, K] head state
        p_s = state + (s * H + i_h) * (K * V) + o_v[:, None] * K + o_k[None, :]
    else:  # [K, BV] tile of the [K, V] head state
        p_s = state + (s * H + i_h) * (K * V) + o_k[:, None] * V + o_v[None, :]
    S = tl.load(p_s)  # no eviction hint: evict_first was slower (BENCHMARKS.md, forms tried)
    live = s >= 0
    for t in tl.static_range(T):
        x_t = i_b * T + t
        S = step_emit(
            S, q, k, w, decay, beta, skip, out, x_t, i_h, i_g, o_k, o_v, live, H, G, K, V, FAMILY, HAS_SKIP,
            1 if VALUE_MAJOR else 0,
        )  # fmt: skip
    tl.store(p_s, S)


def launch(family: str, state: Tensor, slots: Tensor, x: StepInputs, out: Tensor, cfg) -> None:
    """:func:`_standard_kernel` over (V / BV, H, B) for a checked ``state`` [N, H, K, V] (either
    storage order: contiguous, or the transpose of a contiguous [N, H, V, K]) and inputs."""
    if not (state.is_contiguous() or state.transpose(-1, -2).is_contiguous()):
        raise ValueError(
            "the state must be a contiguous [N, H, K, V] tensor or the transpose of a contiguous [N, H, V, K]"
        )
    b, t, g, kd = x.k.shape
    h, vd = state.shape[1], state.shape[3]
    bv = clip_block_v(cfg.block_v, vd)
    _standard_kernel[(vd // bv, h, b)](
        state, slots, x.q, x.k, x.w, x.decay, beta_or_placeholder(x), x.skip if x.skip is not None else x.w,
        out, T=t, H=h, G=g, K=kd, V=vd, BV=bv, FAMILY=FAMILY_ID[family], HAS_SKIP=x.skip is not None,
        VALUE_MAJOR=not state.is_contiguous(), **launch_options(cfg.num_warps, cfg.maxnreg, state.device),
    )  # fmt: skip
