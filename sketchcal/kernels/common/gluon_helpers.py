"""Gluon helpers shared by the persistent flushes of Mamba-2 (``mamba2/flush_pipelined.py``) and
KDA (``kda/flush_sweep.py``), and their launcher.

Both kernels run ``per_sm`` programs per SM; each program walks work items ``pid, pid + programs,
…`` (a work item is a head of a batch row, or a part of one), copying the next item's tiles into
shared memory (``cp.async``) while it folds the current one. This module is imported only where
Triton has Gluon (``dispatch.gluon_available``), so the Triton kernels never depend on it.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

# Gluon's names moved between Triton 3.6 and 3.9:
# cp.async into shared memory is ``async_load`` since Triton 3.7
async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# a CTA-wide barrier: ``barrier`` since Triton 3.7
barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def mul(a, b):
    """The combine function of a product scan (``gl.associative_scan``)."""
    return a * b


@gluon.jit
def work_item(slots, pos, item, n_items, H: gl.constexpr):
    """Work item ``item``'s (slot, buffered tokens n); slot -1 for padding or past the end."""
    valid = item < n_items
    i_b = gl.where(valid, item, 0) // H
    return gl.where(valid, gl.load(slots + i_b), -1), gl.load(pos + i_b)


@gluon.jit
def head_flags(ranks, read_rows, item, H: gl.constexpr, SKETCH_OUT: gl.constexpr, ROWS: gl.constexpr):
    """Work item ``item``'s head's rank m (with ``SKETCH_OUT``; else 0) and read-copy flag
    ``read_rows[head]`` (with ``ROWS``; else 0), which the Gluon flushes load ahead of the head's
    stores. Volatile, because a plain load of read-only memory is sunk to its first use: there,
    behind the head's state stores, each would be a round trip to global memory on the critical
    path."""
    i_h = item % H
    m = i_h * 0
    dense = i_h * 0
    if SKETCH_OUT:
        m = gl.load(ranks + i_h, volatile=True)
    if ROWS:
        dense = gl.load(read_rows + i_h, volatile=True)
    return m, dense


@gluon.jit
def store_state(tile, state, rd, dense, offs, HAS_READ: gl.constexpr, ROWS: gl.constexpr):
    """A folded head's state tile at ``state + offs`` (``offs`` in the tile's layout) and, with
    ``HAS_READ``, its read copy at ``rd + offs`` (``ROWS``: only for a dense head, ``dense`` =
    ``read_rows[head]`` > 0, loaded by the caller)."""
    gl.store(state + offs, tile)
    if HAS_READ:
        if ROWS:
            if dense > 0:
                gl.store(rd + offs, tile.to(rd.dtype.element_ty))
        else:
            gl.store(rd + offs, tile.to(rd.dtype.element_ty))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_grid(n_items: int, per_sm: int, device: torch.device) -> tuple[int]:
    """The grid of a persistent kernel: ``per_sm`` programs per SM of ``device``, at most one per
    work item (and at least one program)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (max(1, min(n_items, per_sm * _sm_count(index))),)


def launch_persistent(
    kernel,
    args: tuple,
    frame_terms: torch.Tensor,
    *,
    batch: int,
    per_sm: int,
    num_warps: int,
    maxnreg: int = 0,
    parts: int = 1,
    **constexprs,
) -> None:
    """Launch a persistent Gluon flush ``kernel`` on ``per_sm`` programs per SM (:func:`persistent_grid`)
    over its ``batch`` × H × ``parts`` work items (``parts`` per head): ``args`` are every flush's
    arguments (``common.flush.flush_arguments``), then ``frame_terms`` (``SketchTables.frame_terms``; any
    tensor when not ``SKETCH_OUT``) and the item count; ``constexprs`` the kernel's (H among them)."""
    n_items = batch * constexprs["H"] * parts
    options = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    grid = persistent_grid(n_items, per_sm, args[0].device)
    kernel[grid](*args, frame_terms, n_items, **constexprs, **options)
