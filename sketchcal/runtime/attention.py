"""Decode attention over a static cache without repeating keys and values per query head.

transformers' SDPA attention (before 5.25) meets a masked grouped-query call by repeating every
key and value head ``num_key_value_groups`` times, so a decode step over a static cache copies the
whole cache per layer ([B, Hkv, T, D] → [B, Hq, T, D]) and reads the copy again: at batch 256 and
1,280 cached positions that is most of a Qwen3.5-4B step. One query token needs none of it: its
Hq heads are Hkv groups of ``rep`` rows that share one mask row, so they are ``rep`` "query
positions" of Hkv heads ([B, Hkv, rep, D]), and SDPA reads each key and value once.

:func:`grouped_decode_attention` does that for one-token calls and hands every other call to
transformers' SDPA function unchanged; :func:`decode_attention` switches a model to it for a block.

Rows at their own positions (:func:`row_positions`, the graph decoder's slots): each row of a
batch writes its new key and value at its own position ``positions[b]`` of a static cache
(:func:`write_at_row_positions`) and attends to its positions ``≤ positions[b]``, in place of the
model's mask, which assumes one position for the whole batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

NAME = "sketchcal_grouped_decode"
_ROW_POSITIONS: Tensor | None = None  # set by row_positions(): [B] int64, each row's query position


def grouped_decode_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: query [B, Hq, Tq, D], key / value [B, Hkv, Tk, D]
    (Dv for value), mask None or broadcastable to [B, 1, Tq, Tk] (bool: True attends; float: added).
    Returns ([B, Tq, Hq, Dv], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, q_heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    rep = q_heads // kv_heads
    if _ROW_POSITIONS is not None and q_len == 1:  # each row up to its own position
        keys = torch.arange(key.shape[2], device=key.device)
        attention_mask = (keys[None, :] <= _ROW_POSITIONS[:, None]).view(batch, 1, 1, -1)
    plain = q_len != 1 or rep == 1 or dropout > 0 or kwargs.get("s_aux") is not None
    if plain or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    mask = attention_mask
    if mask is not None:
        mask = mask[:, :1] if mask.shape[1] == q_heads else mask  # shared by all heads of a row
        mask = mask.expand(batch, 1, rep, mask.shape[-1])  # one row per grouped query head
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, kv_heads, rep, dim), key, value, attn_mask=mask, scale=scaling
    )  # [B, Hkv, rep, Dv]
    return out.reshape(batch, q_heads, 1, -1).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(NAME, grouped_decode_attention)
        AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # SDPA's masks


@contextlib.contextmanager
def decode_attention(model: nn.Module) -> Iterator[bool]:
    """Run ``model``'s SDPA attention layers with :func:`grouped_decode_attention` inside the block.

    Yields whether it switched: models on another implementation (eager, flash) are left as they are.
    """
    config = model.config
    before = getattr(config, "_attn_implementation", None)
    if before != "sdpa":
        yield False
        return
    _register()
    model.set_attn_implementation(NAME)
    try:
        yield True
    finally:
        model.set_attn_implementation(before)


@contextlib.contextmanager
def row_positions(positions: Tensor) -> Iterator[None]:
    """Inside, one-token calls of :func:`grouped_decode_attention` let row b attend to cache
    positions ``≤ positions[b]`` ([B] int64, read when the call runs: a CUDA graph captured inside
    reads the tensor's current values at each replay)."""
    global _ROW_POSITIONS
    before, _ROW_POSITIONS = _ROW_POSITIONS, positions
    try:
        yield
    finally:
        _ROW_POSITIONS = before


def write_at_row_positions(cache: Any, positions: Tensor) -> Callable[[], None]:
    """Make the static attention layers of ``cache`` (initialised by a prefill) write a one-token
    update of row b at position ``positions[b]`` ([B] int64) instead of one position for all rows;
    returns the function that restores them. Layers without static keys and values (recurrent
    ones) are left alone."""
    patched = []
    for layer in getattr(cache, "layers", []):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not (isinstance(keys, Tensor) and isinstance(values, Tensor) and keys.ndim == 4):
            continue

        def update(k: Tensor, v: Tensor, *args: Any, _keys=keys, _values=values, **kwargs: Any):
            if k.shape[-2] != 1:
                raise ValueError("a cache written at row positions takes one token per call")
            for store, new in ((_keys, k), (_values, v)):
                at = positions.view(-1, 1, 1, 1).expand(-1, store.shape[1], 1, store.shape[-1])
                store.scatter_(2, at, new.to(store.dtype))
            return _keys, _values

        layer.update = update
        patched.append(layer)

    def restore() -> None:
        for layer in patched:
            del layer.update

    return restore
