"""Grouped decode attention against brute force, and a model decoding through it."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from sketchcal.models.tiny import tiny_config
from sketchcal.runtime import attention
from sketchcal.runtime.attention import decode_attention, grouped_decode_attention
from sketchcal.runtime.graph_decode import GraphDecoder


class _Module(torch.nn.Module):
    def __init__(self, rep: int):
        super().__init__()
        self.num_key_value_groups = rep
        self.is_causal = True


def _brute_force(q, k, v, mask, scale):
    """float64 softmax(q kᵀ · scale + mask) v with every key/value head repeated per query head."""
    rep = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(rep, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = (
            scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
        )
    return (scores.softmax(-1) @ v).transpose(1, 2)  # [B, Tq, Hq, Dv]


@pytest.mark.parametrize("rep", [1, 2, 4])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_one_token_matches_brute_force(rep, mask_kind):
    gen = torch.Generator().manual_seed(rep)
    b, kv, t, d, dv = 3, 2, 11, 16, 8
    q = torch.randn(b, kv * rep, 1, d, generator=gen)
    k = torch.randn(b, kv, t, d, generator=gen)
    v = torch.randn(b, kv, t, dv, generator=gen)
    keep = torch.rand(b, 1, 1, t, generator=gen) > 0.3
    keep[..., 0] = True  # every row attends somewhere
    mask = {"none": None, "bool": keep, "float": torch.where(keep, 0.0, -1e9)}[mask_kind]
    out, weights = grouped_decode_attention(_Module(rep), q, k, v, mask, scaling=0.3)
    assert weights is None and out.shape == (b, 1, kv * rep, dv)
    torch.testing.assert_close(out.double(), _brute_force(q, k, v, mask, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rep", [1, 2])
def test_rows_at_their_own_positions(rep):
    """Under ``row_positions`` a one-token call ignores the model's mask: row b attends to cache
    positions ≤ positions[b]; a static cache layer patched by ``write_at_row_positions`` writes
    each row's token at its own position and leaves the rest."""
    gen = torch.Generator().manual_seed(7)
    b, kv, t, d = 3, 2, 9, 8
    positions = torch.tensor([0, 5, 8])
    q = torch.randn(b, kv * rep, 1, d, generator=gen)
    k, v = torch.randn(b, kv, t, d, generator=gen), torch.randn(b, kv, t, d, generator=gen)
    wrong = torch.ones(b, 1, 1, t, dtype=torch.bool)  # the model's mask: everything
    with attention.row_positions(positions):
        out, _ = grouped_decode_attention(_Module(rep), q, k, v, wrong, scaling=0.4)
    keep = (torch.arange(t)[None, :] <= positions[:, None]).view(b, 1, 1, t)
    torch.testing.assert_close(out.double(), _brute_force(q, k, v, keep, 0.4), atol=1e-5, rtol=1e-5)

    layer = type("Layer", (), {})()
    layer.keys, layer.values = k.clone(), v.clone()
    restore = attention.write_at_row_positions(type("Cache", (), {"layers": [layer]})(), positions)
    new_k, new_v = torch.randn(b, kv, 1, d, generator=gen), torch.randn(b, kv, 1, d, generator=gen)
    got_k, got_v = layer.update(new_k, new_v)
    for row, pos in enumerate(positions.tolist()):
        assert torch.equal(got_k[row, :, pos], new_k[row, :, 0]) and torch.equal(
            got_v[row, :, pos], new_v[row, :, 0]
        )
        others = [j for j in range(t) if j != pos]
        assert torch.equal(got_k[row][:, others], k[row][:, others])
    restore()
    assert not hasattr(layer, "update")


def test_prefill_is_transformers_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 4, 5, 8, generator=gen),
        torch.randn(2, 2, 5, 8, generator=gen),
        torch.randn(2, 2, 5, 8, generator=gen),
    )
    ours = grouped_decode_attention(_Module(2), q, k, v, None, scaling=0.5)[0]
    assert torch.equal(ours, sdpa_attention_forward(_Module(2), q, k, v, None, scaling=0.5)[0])


def _static_steps(model, ids, steps: int) -> torch.Tensor:
    """Logits [B, 1 + steps, vocab]: the prompt's last position, then ``steps`` teacher-forced
    one-token forwards over a ``StaticCache`` (the next prompt-like token ids)."""
    cache = tf.StaticCache(config=model.config, max_cache_len=ids.shape[1] + steps)
    prompt, follow = ids[:, :-steps], ids[:, -steps:]
    logits = [model(prompt, past_key_values=cache, use_cache=True).logits[:, -1:]]
    for t in range(steps):
        logits.append(model(follow[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_model_decodes_through_it(model_type, monkeypatch):
    """One-token steps over a static cache: every attention call of a step goes through the grouped
    function and the logits equal the model's own SDPA ones; the model is restored after."""
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
    ids = torch.randint(0, 2000, (3, 13))
    with torch.no_grad():
        expected = _static_steps(model, ids, 4)
    attention._register()
    calls = []
    registered = tf.AttentionInterface._global_mapping[attention.NAME]

    def counting(module, query, *args, **kwargs):
        calls.append(query.shape[2])
        return registered(module, query, *args, **kwargs)

    monkeypatch.setitem(tf.AttentionInterface._global_mapping, attention.NAME, counting)
    with torch.no_grad(), decode_attention(model) as switched:
        got = _static_steps(model, ids, 4)
    assert switched and model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert calls.count(1) == 4 * calls.count(9) > 0  # four one-token steps per prefill call


def test_graph_decoder_decodes_through_it():
    """The graph decoder's greedy tokens (eager here) are ``generate()``'s."""
    torch.manual_seed(1)
    model = tf.AutoModelForCausalLM.from_config(tiny_config("qwen3_5_text")).eval()
    ids = torch.randint(0, 2000, (2, 9))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert torch.equal(GraphDecoder(model, graphs=False).generate(ids, 5), expected)


def test_other_implementations_left_alone():
    model = tf.AutoModelForCausalLM.from_config(tiny_config("qwen3_5_text"), attn_implementation="eager")
    with decode_attention(model) as switched:
        assert not switched and model.config._attn_implementation == "eager"
