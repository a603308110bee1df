"""One layer's sketch at run time: write the sketch at a flush, read through it between flushes.

The tables are the kernels' :class:`~sketchcal.kernels.common.pool.SketchTables`, built once per
layer from the artifact (:func:`layer_tables`). Per head h of group g: frame ``R_g`` [K, K], rank
``m_h`` (0 = dense) and the model-frame map ``P_h = coef_h R_g`` [M, K] (fp32, as the kernels read
it). A read is

    Sᵀu ≈ (R_g S)_{:m}ᵀ (P_h u)_{:m}

The runtime stores the sketch ``(R_g S_c)_{:M}`` [B, H, M, V] (rows ≥ m_h zeroed) in the read
precision at each flush, for every family. (For Mamba-2 and GDN a serving kernel can instead run
the recurrence in the rotated frame and read a prefix of the stored state; the numbers are the
same up to rounding, and the byte model counts that layout.) Dense heads read their full read copy.
The write and the read are ``sketchcal.kernels.common.reference.sketch_write`` / ``sketch_read``.

The **adaptive** sketch (``sketch_map="adaptive"``, :class:`AdaptiveTables`) keeps the bases and
ranks but no offline map: each flush factors the new checkpoint S_c of every head of rank m into
``Q`` [V, m] (an orthonormal basis of span(S_cᵀ B), B = the frame's first m rows) and
``P_S = Qᵀ S_cᵀ`` [m, K], stored in the read precision; a read is ``Q (P_S u)``, the exact read
projected onto that span (``reference.adaptive_factor`` / ``adaptive_read``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from sketchcal.artifact.sketch import SketchLayer
from sketchcal.errors import SketchcalError
from sketchcal.kernels.common.pool import SKETCH_MAPS, SketchTables
from sketchcal.kernels.common.reference import adaptive_factor, adaptive_read, sketch_read, sketch_write
from sketchcal.runtime.precision import store

__all__ = ["SKETCH_MAPS", "AdaptiveTables", "ComputeTables", "SketchTables", "compute_tables", "layer_tables"]


def layer_tables(
    layer: SketchLayer, *, family: str, heads: int, key_dim: int, device: torch.device | str | None = None
) -> SketchTables:
    """Validate the artifact layer ``layer`` against the model layer's shape (``heads``, ``key_dim``)
    and build its tables on ``device``."""
    if layer.heads != heads or layer.key_dim != key_dim or heads % layer.groups:
        raise SketchcalError(
            f"sketch layer {layer.layer} has {layer.heads} heads in {layer.groups} groups of key dim "
            f"{layer.key_dim}, the model layer {heads} heads of key dim {key_dim}; reconvert the sketch"
        )
    try:
        tables = SketchTables.from_layer(family, layer)
    except ValueError as err:
        raise SketchcalError(f"sketch layer {layer.layer}: {err}; reconvert the sketch") from None
    return tables if device is None else tables.to(device)


@dataclass(frozen=True)
class HeadTables:
    """What every sketch read of a layer needs, in the reference runtime's compute dtype: H heads,
    K key dim, M stored rows: ``rows`` [H, M, K] (``SketchTables.sketch_rows``: each head's basis
    rows, zero past its rank), ``dense`` [H] bool (heads that read their full read copy)."""

    rows: Tensor
    dense: Tensor
    has_dense: bool

    @staticmethod
    def fields_of(tables: SketchTables, dtype: torch.dtype) -> dict[str, Any]:
        dense = tables.ranks == 0
        return {"rows": tables.sketch_rows().to(dtype), "dense": dense, "has_dense": bool(dense.any())}

    def dense_heads(self, full: Tensor | None) -> Tensor | None:
        """``dense`` where some head is dense and its read copy ``full`` is given, else None."""
        return self.dense if self.has_dense and full is not None else None


@dataclass(frozen=True)
class ComputeTables(HeadTables):
    """A layer's :class:`SketchTables` cast once to the reference runtime's compute dtype: the
    :class:`HeadTables` fields and ``maps`` [H, M, K] (``SketchTables.maps``)."""

    maps: Tensor

    @classmethod
    def of(cls, tables: SketchTables, dtype: torch.dtype) -> ComputeTables:
        return cls(**cls.fields_of(tables, dtype), maps=tables.maps.to(dtype))

    def write(self, s: Tensor) -> Tensor:
        """The sketch ``(R S)_{:M}`` [..., H, M, V] of states ``s`` [..., H, K, V] (rows ≥ m_h are 0)."""
        return sketch_write(self.rows, s)

    def stored(self, s: Tensor, dtype: torch.dtype) -> Tensor:
        """:meth:`write`, stored in ``dtype`` (what a checkpoint keeps for its reads)."""
        return store(self.write(s), dtype)

    def read(self, sketch: Tensor, full: Tensor | None, u: Tensor) -> Tensor:
        """Checkpoint term of the reads for effective queries ``u`` [B, P, H, K] → [B, P, H, V].

        ``sketch`` [B, H, M, V]; ``full`` [B, H, K, V] the dense heads' read copy (None when no head
        is dense). Both are cast to ``u``'s dtype.
        """
        return sketch_read(self.maps, sketch, u, self.dense_heads(full), full)


@dataclass(frozen=True)
class AdaptiveTables(HeadTables):
    """A layer's adaptive sketch: the :class:`HeadTables` fields (the bases, no maps). A checkpoint
    keeps the flush's factors ``(Q, P_S)``: [B, H, V, M], [B, H, M, K]."""

    @classmethod
    def of(cls, tables: SketchTables, dtype: torch.dtype) -> AdaptiveTables:
        return cls(**cls.fields_of(tables, dtype))

    def stored(self, s: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The flush's factors ``(Q, P_S)`` of states ``s`` [B, H, K, V], stored in ``dtype``."""
        q, p = adaptive_factor(self.rows, s)
        return store(q, dtype), store(p, dtype)

    def read(self, sketch: tuple[Tensor, Tensor], full: Tensor | None, u: Tensor) -> Tensor:
        """Checkpoint term ``Q (P_S u)`` for effective queries ``u`` [B, P, H, K] → [B, P, H, V];
        dense heads read ``full`` [B, H, K, V] (as :meth:`ComputeTables.read`)."""
        q, p = sketch
        return adaptive_read(q, p, u, self.dense_heads(full), full)


def compute_tables(
    tables: SketchTables, dtype: torch.dtype, sketch_map: str
) -> ComputeTables | AdaptiveTables:
    """The reference runtime's tables of ``sketch_map`` (one of :data:`SKETCH_MAPS`)."""
    if sketch_map not in SKETCH_MAPS:
        raise SketchcalError(f"sketch map must be one of {', '.join(SKETCH_MAPS)}, got {sketch_map!r}")
    return AdaptiveTables.of(tables, dtype) if sketch_map == "adaptive" else ComputeTables.of(tables, dtype)
