"""One layer's sketch tables at run time: write the sketch at a flush, read through it between flushes.

From the artifact (:mod:`sketchcal.artifact.sketch`): per head h of group g, frame ``R_g`` [K, K],
rotated map ``coef_h`` [M, K] and rank ``m_h`` (0 = dense). With ``P_h = coef_h R_g`` (acting on
unrotated effective queries) a read is

    Sᵀu ≈ (R_g S)_{:m}ᵀ (P_h u)_{:m}

The runtime stores the sketch ``(R_g S_c)_{:M}`` [B, H, M, V] (rows ≥ m_h zeroed) in the read
precision at each flush, for every family. (For Mamba-2 and GDN a serving kernel can instead run
the recurrence in the rotated frame and read a prefix of the stored state; the numbers are the
same up to rounding, and the byte model counts that layout.) Dense heads read their full read copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sketchcal.artifact.sketch import SketchLayer
from sketchcal.errors import SketchcalError
from sketchcal.kernels.common.recurrence import read


@dataclass
class SketchTables:
    """Per-layer tables in the compute dtype. H heads, K key dim, M stored rows."""

    ranks: Tensor  # [H] int64, 0 = dense
    frames: Tensor  # [H, M, K]: R_{g(h), :M}, rows of the frame that make the sketch
    maps: Tensor  # [H, M, K]: P_h = coef_h R_g, zero on rows ≥ m_h
    dense: Tensor  # [H] bool

    @classmethod
    def from_layer(
        cls, layer: SketchLayer, *, heads: int, key_dim: int, device=None, dtype=torch.float32
    ) -> SketchTables:
        """Validate ``layer`` against the model layer's shape and build the tables."""
        if layer.heads != heads or layer.key_dim != key_dim or heads % layer.groups:
            raise SketchcalError(
                f"sketch layer {layer.layer} has {layer.heads} heads in {layer.groups} groups of key dim "
                f"{layer.key_dim}, the model layer {heads} heads of key dim {key_dim}; reconvert the sketch"
            )
        ranks = layer.ranks.to(torch.int64)
        rows = layer.coef.shape[1]
        if int(ranks.min()) < 0 or int(ranks.max()) > min(rows, key_dim):
            raise SketchcalError(f"sketch layer {layer.layer} has ranks outside [0, {min(rows, key_dim)}]")
        f64 = torch.float64
        per_group = heads // layer.groups
        frames = layer.frame.to(f64).repeat_interleave(per_group, dim=0)  # [H, K, K]
        mask = (torch.arange(rows)[None, :] < ranks[:, None]).to(f64)  # [H, M]
        maps = torch.einsum("hmj,hjk->hmk", layer.coef.to(f64), frames) * mask[..., None]
        sketch_rows = frames[:, :rows] * mask[..., None]
        return cls(
            ranks=ranks.to(device),
            frames=sketch_rows.to(device=device, dtype=dtype),
            maps=maps.to(device=device, dtype=dtype),
            dense=(ranks == 0).to(device),
        )

    @property
    def rows(self) -> int:
        return self.frames.shape[1]

    @property
    def has_dense(self) -> bool:
        return bool(self.dense.any())

    def write(self, s: Tensor) -> Tensor:
        """The sketch ``(R S)_{:M}`` [..., H, M, V] of states ``s`` [..., H, K, V] (rows ≥ m_h are 0)."""
        return torch.einsum("hmk,...hkv->...hmv", self.frames.to(s.dtype), s)

    def read(self, sketch: Tensor, full: Tensor | None, u: Tensor) -> Tensor:
        """Checkpoint term of the reads for effective queries ``u`` [B, P, H, K] → [B, P, H, V].

        ``sketch`` [B, H, M, V]; ``full`` [B, H, K, V] the dense heads' read copy (None when no head
        is dense). Both are cast to ``u``'s dtype.
        """
        coeff = torch.einsum("hmk,bphk->bphm", self.maps.to(u.dtype), u)
        out = torch.einsum("bhmv,bphm->bphv", sketch.to(u.dtype), coeff)
        if full is not None and self.has_dense:
            dense = self.dense
            exact = read(full[:, dense].to(u.dtype).unsqueeze(1), u[:, :, dense])
            out[:, :, dense] = exact
        return out
