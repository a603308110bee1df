"""Decode attention over a static cache without repeating keys and values per query head.

transformers' SDPA attention (before 5.25) meets a masked grouped-query call by repeating every
key and value head ``num_key_value_groups`` times, so a decode step over a static cache copies the
whole cache per layer ([B, Hkv, T, D] → [B, Hq, T, D]) and reads the copy again: at batch 256 and
1,280 cached positions that is most of a Qwen3.5-4B step. One query token needs none of it: its
Hq heads are Hkv groups of ``rep`` rows that share one mask row, so they are ``rep`` "query
positions" of Hkv heads ([B, Hkv, rep, D]), and SDPA reads each key and value once.

:func:`grouped_decode_attention` does that for one-token calls and hands every other call to
transformers' SDPA function unchanged; :func:`decode_attention` switches a model to it for a block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

NAME = "sketchcal_grouped_decode"


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
