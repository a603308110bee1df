"""Lay a layer's tokens out in decode windows, as a serving engine would.

The state after the prompt is the first checkpoint; every L tokens after it form a window whose
L-th token is the flush. The sequence is padded in front (and at the end) with identity tokens so
that window boundaries fall on the prompt end; identity tokens leave the state untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from sketchcal.kernels.common import StepInputs
from sketchcal.kernels.common.recurrence import identity_tokens


@dataclass
class WindowLayout:
    """Inputs reshaped to windows: every field [B, W, L, H, ...]; ``valid`` [B, W, L]; ``gamma``
    [B, W, L, H], the output weight of each token's read (zero on padding).

    Windows ``first_decode`` onward follow the prompt; the ones before only build its state.
    """

    inputs: StepInputs
    valid: Tensor
    gamma: Tensor
    first_decode: int

    @property
    def num_windows(self) -> int:
        return self.valid.shape[1]


def _pad_tokens(t: Tensor, tdim: int, front: int, back: int) -> Tensor:
    pad = [0, 0] * (t.dim() - tdim - 1) + [front, back]
    return F.pad(t, pad)


def to_windows(
    x: StepInputs, valid: Tensor, prompt_end: int, window: int, gamma: Tensor | None = None
) -> WindowLayout:
    """Split ``x`` ([B, T, H, ...]) into windows aligned to ``prompt_end``.

    ``valid`` [B, T] marks real tokens (False: padding, or tokens after end-of-sequence);
    invalid tokens become identity transitions. ``gamma`` [B, T, H]: each token's output weight
    (default 1).
    """
    b, t = valid.shape
    front = (-prompt_end) % window
    back = (-(front + t)) % window
    if gamma is None:
        gamma = x.k.new_ones(b, t, x.num_heads)
    gamma = _pad_tokens(gamma.to(x.k), 1, front, back)
    x = x.map(lambda f: _pad_tokens(f, 1, front, back))
    valid = F.pad(valid, (front, back), value=False)
    x = identity_tokens(x, valid)
    n = valid.shape[1] // window
    x = x.map(lambda f: f.reshape(b, n, window, *f.shape[2:]))
    gamma = gamma.reshape(b, n, window, -1)
    return WindowLayout(x, valid.reshape(b, n, window), gamma, (front + prompt_end) // window)
