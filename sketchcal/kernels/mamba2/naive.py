"""Mamba-2 float64 reference: ``A_t = a_t I`` with ``a_t = exp(dt_t · A)``.

Per head: K = d_state, V = head_dim; k = B_t and q = C_t (shared by the heads of a group),
w = dt_t · x_t, and the read adds the skip ``D · x_t``.
"""

from __future__ import annotations

import torch
from torch import Tensor


class Mamba2:
    name = "mamba2"

    def apply(self, s: Tensor, k: Tensor, decay: Tensor, beta: Tensor | None) -> Tensor:
        return decay[..., None, None] * s

    def apply_t(self, u: Tensor, k: Tensor, decay: Tensor, beta: Tensor | None) -> Tensor:
        return decay[..., None] * u

    def matrix(self, k: Tensor, decay: Tensor, beta: Tensor | None) -> Tensor:
        eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
        return decay[..., None, None] * eye


FAMILY = Mamba2()
