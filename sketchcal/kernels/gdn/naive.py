"""Gated DeltaNet float64 reference: ``A_t = α_t (I − β_t k_t k_tᵀ)``.

k and q are l2-normalised (q also scaled by K^-½) and shared by the value heads of a key head;
w = β_t v_t. ``A_t`` is symmetric, so ``A_tᵀ u = A_t u``.
"""

from __future__ import annotations

import torch
from torch import Tensor


class GatedDeltaNet:
    name = "gdn"

    def apply(self, s: Tensor, k: Tensor, decay: Tensor, beta: Tensor | None) -> Tensor:
        kts = torch.einsum("...k,...kn->...n", k, s)
        erased = s - (beta[..., None] * k)[..., :, None] * kts[..., None, :]
        return decay[..., None, None] * erased

    def apply_t(self, u: Tensor, k: Tensor, decay: Tensor, beta: Tensor | None) -> Tensor:
        ku = (k * u).sum(-1, keepdim=True)
        return decay[..., None] * (u - beta[..., None] * k * ku)

    def matrix(self, k: Tensor, decay: Tensor, beta: Tensor | None) -> Tensor:
        eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
        outer = k[..., :, None] * k[..., None, :]
        return decay[..., None, None] * (eye - beta[..., None, None] * outer)


FAMILY = GatedDeltaNet()
