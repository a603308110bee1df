"""Kimi Delta Attention float64 reference: ``A_t = (I − β_t k_t k_tᵀ) Diag(α_t)``.

α_t is a per-key-channel decay ([..., H, K]); the decay acts first, then the delta-rule erase.
``A_tᵀ u = α_t ⊙ (u − β_t k_t (k_t · u))``. Each head is its own group.
"""

from __future__ import annotations

import torch
from torch import Tensor


class KimiDeltaAttention:
    name = "kda"

    def apply(self, s: Tensor, k: Tensor, decay: Tensor, beta: Tensor | None) -> Tensor:
        s = decay[..., :, None] * s
        kts = torch.einsum("...k,...kn->...n", k, s)
        return s - (beta[..., None] * k)[..., :, None] * kts[..., None, :]

    def apply_t(self, u: Tensor, k: Tensor, decay: Tensor, beta: Tensor | None) -> Tensor:
        ku = (k * u).sum(-1, keepdim=True)
        return decay * (u - beta[..., None] * k * ku)

    def matrix(self, k: Tensor, decay: Tensor, beta: Tensor | None) -> Tensor:
        eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
        outer = k[..., :, None] * k[..., None, :]
        return (eye - beta[..., None, None] * outer) * decay[..., None, :]


FAMILY = KimiDeltaAttention()
