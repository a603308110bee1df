"""Decode states on the public kernels: the ``public`` backend of :func:`sketchcal.runtime.enable`.

Standard decoding (the full state read and written at every token) with the fastest public kernel
of the family (:mod:`sketchcal.kernels.public`) in place on a slot pool per layer: the loop an
engine with the best public kernels runs, beside which the triton backend's modes are measured
(``sketchcal bench --e2e``, its ``public`` row). Like the triton backend's
:class:`~sketchcal.runtime.kernel_state.KernelStandardState`, the pool is the only copy of the
state while a :class:`~sketchcal.runtime.graph_decode.GraphDecoder` runs and nothing syncs with
the host; unlike it, a step takes the decode function's own arguments, not
:class:`~sketchcal.kernels.common.StepInputs`, so no input preparation runs before the kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from sketchcal.errors import SketchcalError
from sketchcal.kernels import public
from sketchcal.runtime.state import Checkpoint

NO_DRAFTS = "the public backend does not draft; use backend='triton' for speculative decoding"


class PublicStandardState:
    """One layer's states [B, H, K, V] fp32, stored in the public kernel's layout."""

    mode = "standard"

    def __init__(self, family: str, state: Tensor, *, layer: int | None = None):
        self.family, self.layer = family, layer
        self.value_major = public.VALUE_MAJOR[family]
        b, h, kd, vd = state.shape
        shape = (b, h, vd, kd) if self.value_major else (b, h, kd, vd)
        self.store = state.new_empty(shape, dtype=torch.float32)
        self.state().copy_(state)
        self.slots = torch.arange(b, dtype=torch.int32, device=state.device)
        self.pos = self.flushes = 0

    @property
    def ckpt(self) -> Checkpoint:
        return Checkpoint(self.state(), None, None)

    def state(self) -> Tensor:
        """The current state [B, H, K, V] fp32 (a view of the pool)."""
        return self.store.transpose(-1, -2) if self.value_major else self.store

    def adopt(self, slot: int, donor: PublicStandardState, buffered: int = 0, row: int = 0) -> None:
        """Make row ``slot`` the sequence in row ``row`` of ``donor``."""
        self.state()[slot] = donor.state()[row]

    def step_args(self, named: dict[str, Any]) -> Tensor:
        """Run the decode call's tokens; outputs [B, T, H, V] in the model's dtype."""
        if self.family == "mamba2" and "state" not in named:
            raise SketchcalError(
                "the public backend runs Mamba-2's one-token decode calls only; let the model's own "
                "prefill take whole prompts (prefill=None)"
            )
        if self.family == "gdn":
            return public.gdn_step(self.store, named)
        if self.family == "kda":
            return public.kda_step(self.store, named, self.slots)
        return public.mamba2_step(self.store, named, self.slots)[:, None]

    def step(self, x: Any, out_dtype: torch.dtype | None = None) -> Tensor:
        raise SketchcalError(
            "the public backend runs the model's own decode calls only (no teacher-forced or prefill "
            "steps); use backend='triton' or 'reference'"
        )

    def draft(self, x: Any) -> Tensor:
        raise SketchcalError(NO_DRAFTS)

    def accept(self, k: int) -> None:
        raise SketchcalError(NO_DRAFTS)
