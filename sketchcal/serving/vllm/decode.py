"""The decode branch of a served layer: replay or sketch steps and flushes over its pages.

Each decode row addresses a block id (its sequence's page); the null block (0) pads a batch and
is skipped (so is a negative id). Per row, the cursor ``p`` in the page says how many tokens are
buffered since the last flush: a token with ``p < L − 1`` is a read (``replay_step`` /
``sketch_step``: the checkpoint term from the read copy or the sketch, plus the buffer; the token
joins the buffer), the token with ``p = L − 1`` is the flush (the buffered tokens and this one
folded exactly into the fp32 checkpoint, whose read copy and sketch are refreshed, and with the
adaptive sketch the factors of its map). Rows at different cursors share one call: each op skips
the rows given as slot −1.

The ops share one serving API: on a CUDA device the Triton kernels of
:mod:`sketchcal.kernels.dispatch` (a view of vLLM's pages steps over a whole page from one block to
the next, and the checkpoint is value-major: the kernels take such a pool as a paged pool, served
by the forms that take slot strides, ``dispatch.PAGED_FORMS``), elsewhere their float64 oracle
:mod:`sketchcal.kernels.common.reference`, the math the transformers runtime is tested against.
Nothing here synchronises with the host, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sketchcal.kernels import dispatch
from sketchcal.kernels.common import reference
from sketchcal.kernels.common.pool import AdaptiveSketch, SketchTables
from sketchcal.kernels.common.recurrence import StepInputs
from sketchcal.serving.vllm.page import Pages

NULL_BLOCK = 0  # vLLM's padding rows address block 0, which no sequence owns


def ops_for(device: torch.device):
    """The module whose ``replay_step`` / ``sketch_step`` / ``flush`` run on ``device``: the Triton
    kernels on CUDA, the float64 reference elsewhere."""
    return dispatch if device.type == "cuda" else reference


class WindowDecoder:
    """The window decode of one layer: ``family``, window ``L``, sketch ``tables`` (None: replay),
    read through their static maps or, ``adaptive``, through the maps each flush makes."""

    def __init__(self, family: str, window: int, tables: SketchTables | None, *, adaptive: bool = False):
        if adaptive and tables is None:
            raise ValueError("the adaptive sketch needs the layer's sketch tables")
        self.family, self.window, self.tables, self.adaptive = family, window, tables, adaptive

    def _factors(self, pages: Pages) -> AdaptiveSketch | None:
        if not self.adaptive:
            return None
        if pages.factors is None:
            raise ValueError("the adaptive sketch's pages hold no factors (PagePlan(adaptive=True))")
        return AdaptiveSketch(self.tables, *pages.factors)

    def step(self, pages: Pages, blocks: Tensor, x: StepInputs) -> Tensor:
        """One decode token per row: ``blocks`` [B] block ids (0 = padding), ``x`` kernel-layout
        inputs with T = 1. Returns the outputs [B, 1, H, V] (float32, skip included; padding rows 0);
        the cursors of the live rows advance (to 0 after a flush)."""
        pool, cursor, adaptive = pages.pool, pages.cursor, self._factors(pages)
        live = blocks > NULL_BLOCK
        index = torch.where(live, blocks, 0).long()
        slots = torch.where(live, blocks, -1).to(torch.int32)
        pos = torch.where(live, cursor[index], 0).to(torch.int32)
        flushing = live & (pos == self.window - 1)
        read_slots = torch.where(flushing, -1, slots)
        flush_slots = torch.where(flushing, slots, -1)
        ops = ops_for(pool.state.device)
        if self.tables is None:
            o_read = ops.replay_step(self.family, pool, read_slots, pos, x)
        else:
            o_read = ops.sketch_step(self.family, pool, self.tables, read_slots, pos, x, adaptive=adaptive)
        o_flush = ops.flush(self.family, pool, flush_slots, pos, x, tables=self.tables, adaptive=adaptive)
        rows = (-1, 1, 1, 1)
        out = torch.where(flushing.view(rows), o_flush.float(), o_read.float())
        out = torch.where(live.view(rows), out, 0.0)
        nxt = torch.where(flushing, 0, pos + 1).to(cursor.dtype)
        cursor[index] = torch.where(live, nxt, cursor[index])
        return out

    def settle(self, pages: Pages, blocks: Tensor, *, buffered: bool) -> None:
        """Make the checkpoint of each row's sequence its exact current state and restart its window.

        ``buffered`` False (after vLLM's prefill wrote the state): the buffer is empty; the read copy
        and sketch (and adaptive factors) are written from the new checkpoint. True (before vLLM's
        own chunked path continues a decoding sequence): the buffered tokens are folded into the
        checkpoint first. Cursors become 0."""
        if blocks.numel() == 0:
            return
        pool, cursor, adaptive = pages.pool, pages.cursor, self._factors(pages)
        live = blocks > NULL_BLOCK
        index = torch.where(live, blocks, 0).long()
        slots = torch.where(live, blocks, -1).to(torch.int32)
        pos = torch.where(live, cursor[index], 0) if buffered else torch.zeros_like(slots)
        ops_for(pool.state.device).flush(
            self.family, pool, slots, pos.to(torch.int32), tables=self.tables, adaptive=adaptive
        )
        cursor[index] = torch.where(live, 0, cursor[index]).to(cursor.dtype)
