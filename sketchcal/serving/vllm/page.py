"""The page of one served recurrent layer in vLLM's KV pool, and the slot pool that views it.

vLLM gives each recurrent layer one page per sequence (per block id), holding the states the layer
declares (``get_state_shape`` / ``get_state_dtype``), packed one after the other. A served layer
keeps vLLM's own states first (the conv state and the recurrent state: the latter, written by
vLLM's prefill, is the fp32 checkpoint ``S_c``) and appends, per sequence, in the layouts of
:class:`sketchcal.kernels.common.pool.DecodePool` without the slot dim (H heads, G groups, K key
dim, V value dim, C = L buffered tokens for a window of L, M sketch rows):

    read          [H, K, V]  read copy of the checkpoint, in the read dtype (absent when that is
                             fp32: the checkpoint is then read directly)
    sketch        [H, M, V]  sketch mode: R_{:m} S_c per head, in the read dtype (the adaptive
                             sketch: replaced at each flush by Qᵀ of the checkpoint)
    adaptive_maps [H, M, K]  the adaptive sketch: P_S of the checkpoint (``kernels.common.adaptive``)
    buf_k         [G, C, K]  buffered keys, buffer dtype
    buf_w         [H, C, V]  buffered values (β·v, or dt·x for Mamba-2), buffer dtype
    buf_decay     [H, C]     fp32 ([H, C, K] for KDA)
    buf_beta      [H, C]     fp32, delta rules only
    buf_logdecay  [H, C, K]  bf16 log₂ decays, KDA with a low-precision read copy
    workspace     [G, W]     fp32 scratch of Mamba-2's split sketch read on CUDA
                             (``DecodePool.workspace``)
    cursor        [1]        int32: tokens buffered since the last flush (0 .. L−1)

:func:`PagePlan.pages` turns the layer's bound page views (each [N, ...] over N block ids) into
:class:`Pages`: a ``DecodePool`` over block ids, the cursor column [N] and the adaptive factors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import NamedTuple

import torch
from torch import Tensor

from sketchcal.errors import SketchcalError
from sketchcal.kernels.common.pool import DecodePool, workspace_layout

Entry = tuple[str, tuple[int, ...], torch.dtype]


def check_checkpoint_dtype(dtype: torch.dtype) -> None:
    """Refuse a recurrent state vLLM keeps in another dtype than fp32 (the exact checkpoint)."""
    if dtype != torch.float32:
        raise SketchcalError(
            f"the recurrent state is {dtype}; sketchcal keeps an fp32 checkpoint: pass "
            "--mamba-ssm-cache-dtype float32"
        )


class Pages(NamedTuple):
    """A served layer's pages as the decode reads them: ``pool`` over block ids, ``cursor`` [N]
    int32, and for the adaptive sketch ``factors``: (Qᵀ [N, H, M, V], the pool's sketch; P_S
    [N, H, M, K]), else None."""

    pool: DecodePool
    cursor: Tensor
    factors: tuple[Tensor, Tensor] | None = None


@dataclass(frozen=True)
class PagePlan:
    """The tensors a served layer appends to its vLLM page (see the module docstring)."""

    family: str
    heads: int
    groups: int
    key_dim: int
    value_dim: int
    window: int
    read_dtype: torch.dtype
    buffer_dtype: torch.dtype
    map_rows: int  # 0 in replay mode
    workspace: bool = False  # Mamba-2's split sketch read on CUDA: its per-slot scratch
    adaptive: bool = False  # sketch mode with the adaptive sketch: its factors per sequence

    @property
    def capacity(self) -> int:
        """Buffer entries per head: L (the flush token itself is folded without being buffered, so L − 1
        would do; the kernels' own pools use L)."""
        return self.window

    def entries(self) -> tuple[Entry, ...]:
        h, g, k, v, c = self.heads, self.groups, self.key_dim, self.value_dim, self.capacity
        out: list[Entry] = []
        if self.read_dtype != torch.float32:
            out.append(("read", (h, k, v), self.read_dtype))
        if self.map_rows > 0:
            out.append(("sketch", (h, self.map_rows, v), self.read_dtype))
            if self.adaptive:
                out.append(("adaptive_maps", (h, self.map_rows, k), self.read_dtype))
        out.append(("buf_k", (g, c, k), self.buffer_dtype))
        out.append(("buf_w", (h, c, v), self.buffer_dtype))
        out.append(("buf_decay", (h, c, k) if self.family == "kda" else (h, c), torch.float32))
        if self.family != "mamba2":
            out.append(("buf_beta", (h, c), torch.float32))
        if self.family == "kda" and self.read_dtype != torch.float32:
            out.append(("buf_logdecay", (h, c, k), torch.bfloat16))
        if self.workspace:
            width, _ = workspace_layout(h // g, self.map_rows, c)
            out.append(("workspace", (g, width), torch.float32))
        out.append(("cursor", (1,), torch.int32))
        for name, shape, dtype in out:  # each view must start at an offset its dtype can address
            if prod(shape) * dtype.itemsize % 4:
                raise SketchcalError(f"page tensor {name} {shape} is not a multiple of 4 bytes")
        return tuple(out)

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(shape for _, shape, _ in self.entries())

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(dtype for _, _, dtype in self.entries())

    def extra_bytes(self) -> int:
        """Bytes per sequence this plan adds to the layer's page."""
        return sum(prod(shape) * dtype.itemsize for _, shape, dtype in self.entries())

    def pages(self, checkpoint: Tensor, views: Sequence[Tensor]) -> Pages:
        """The slot pool over block ids, the cursors [N] int32 and the adaptive factors.

        ``checkpoint``: the recurrent state seen key-major, [N, H, K, V] fp32 (a view of vLLM's own
        state tensor); ``views``: the tensors of :meth:`entries`, in order, each [N, *shape].
        """
        entries = self.entries()
        if len(views) != len(entries):
            raise SketchcalError(f"the page has {len(views)} sketchcal tensors, the plan {len(entries)}")
        named = {}
        for (name, shape, dtype), t in zip(entries, views, strict=True):
            if tuple(t.shape[1:]) != shape or t.dtype != dtype:
                raise SketchcalError(
                    f"page tensor {name} is {tuple(t.shape[1:])} {t.dtype}, expected {shape} {dtype}"
                )
            named[name] = t
        check_checkpoint_dtype(checkpoint.dtype)
        cursor = named.pop("cursor")[:, 0]
        read = named.pop("read", checkpoint)
        factors = None
        if self.adaptive and self.map_rows > 0:
            factors = named["sketch"], named.pop("adaptive_maps")
        return Pages(DecodePool(state=checkpoint, read=read, **named), cursor, factors)
