"""Synthetic statistics directories in the calibrate format (test fixtures).

The states and queries are random with a planted structure: per group, states live mostly in a
random low-dimensional subspace and queries in a *different*, partially overlapping one, so the
state-weighted basis, PCA and a random basis differ. Checkpoint scales are log-normal (heavy tails,
as real states). Every sum is computed from the sampled windows, so moments, counts and the
verbatim held-out sample are mutually consistent. Names, layouts and files come from
:mod:`sketchcal.formats.stats`, whose writer lays out one layer per shard here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from sketchcal import __version__
from sketchcal.formats.stats import FORMAT, VERSION, tensor_name, window_layout, write_final
from sketchcal.integrity import weights_fingerprint


def gdn_layers(config) -> list[dict[str, int]]:
    """Layer specs (layer, heads, groups, key_dim, value_dim) of a GDN config (Qwen3-Next style)."""
    types = list(config.layer_types)
    return [
        {
            "layer": i,
            "heads": config.linear_num_value_heads,
            "groups": config.linear_num_key_heads,
            "key_dim": config.linear_key_head_dim,
            "value_dim": config.linear_value_head_dim,
        }
        for i, t in enumerate(types)
        if t == "linear_attention"
    ]


def tiny_gdn_model(path: str | Path, seed: int = 0):
    """Save a tiny random Qwen3-Next model (2 GDN + 1 attention layers) to ``path``; returns its config."""
    import transformers as tf

    cfg = tf.Qwen3NextConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(str(path))
    return cfg


def _random_orthogonal(k: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(k, k, dtype=torch.float64, generator=gen))
    return q * torch.sign(torch.diagonal(r))


def _sample_layer(
    spec: dict[str, int], window: int, n: int, gen: torch.Generator, basis: dict[str, torch.Tensor]
):
    """n windows of one layer: S [n, H, K, V], u [n, L−1, H, K], mask [n, L−1] (float64)."""
    h, g, k, v = spec["heads"], spec["groups"], spec["key_dim"], spec["value_dim"]
    hpg = h // g
    decay_s = torch.exp(-torch.arange(k, dtype=torch.float64) / max(k / 6, 1.0))
    decay_q = torch.exp(-torch.arange(k, dtype=torch.float64) / max(k / 4, 1.0))
    s = torch.empty(n, h, k, v, dtype=torch.float64)
    u = torch.empty(n, window - 1, h, k, dtype=torch.float64)
    for head in range(h):
        grp = head // hpg
        us, uq = basis["state"][grp], basis["query"][grp]
        scale = torch.exp(0.7 * torch.randn(n, 1, 1, dtype=torch.float64, generator=gen))  # log-normal
        z = torch.randn(n, k, v, dtype=torch.float64, generator=gen) * (decay_s * (1 + 0.3 * head))[:, None]
        s[:, head] = scale * (us @ z) + 0.01 * torch.randn(n, k, v, dtype=torch.float64, generator=gen)
        y = torch.randn(n, window - 1, k, dtype=torch.float64, generator=gen) * decay_q
        u[:, :, head] = y @ uq.T
    lengths = torch.randint(0, window, (n,), generator=gen)  # reads kept per window: L−1 mostly
    lengths = torch.where(torch.rand(n, generator=gen, dtype=torch.float64) < 0.8, window - 1, lengths)
    mask = torch.arange(window - 1)[None, :] < lengths[:, None]
    return s, u, mask


def _sums(s: torch.Tensor, u: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The sums of one (layer, split) by name (``sketchcal.formats.stats.moment_layout``)."""
    counted = mask.any(dim=1)  # a checkpoint counts when at least one read follows it
    sc = s[counted]
    mf = mask.to(s.dtype)
    reads = torch.einsum("nhkv,nthk->nthv", s, u)
    col2 = (sc * sc).sum(dim=2)  # [n, H, V]
    un2 = (u * u).sum(-1)  # [n, L−1, H]
    c = torch.einsum("nt,nthk,nthj->hkj", mf, u, u)
    energy = torch.einsum("nt,nthv->h", mf, reads * reads)
    return {  # every read carries output weight γ = 1, so C_fisher = C and fisher = read_energy
        "E": torch.einsum("nhkv,nhjv->hkj", sc, sc),
        "C": c,
        "C_fisher": c.clone(),
        "read_energy": energy,
        "fisher": energy.clone(),
        "E_col4": (col2 * col2).sum(dim=(0, 2)),
        "C_col4": torch.einsum("nt,nth->h", mf, un2 * un2),
        "n_checkpoints": torch.tensor([int(counted.sum())], dtype=torch.int64),
        "n_reads": torch.tensor([int(mask.sum())], dtype=torch.int64),
    }


def write_synthetic_stats(
    out: str | Path,
    layers: list[dict[str, int]],
    *,
    fingerprint: str,
    model_id: str = "synthetic/model",
    model_type: str = "qwen3_next",
    family: str = "gdn",
    window: int = 8,
    calib_windows: int = 64,
    heldout_windows: int = 32,
    kept_windows: int = 16,
    seed: int = 0,
    overlap: float = 0.5,
) -> Path:
    """Write a complete statistics directory (docs/stats-format.md, version 1) to ``out``.

    Args:
        out: directory to create (may exist empty).
        layers: specs ``{"layer", "heads", "groups", "key_dim", "value_dim"}`` (e.g. from :func:`gdn_layers`).
        fingerprint: the model fingerprint to record (``config_fingerprint(config)``).
        window: L; calib_windows / heldout_windows: windows per split; kept_windows: held-out windows
            stored verbatim (≤ heldout_windows).
        overlap: how far the query subspace is perturbed away from the state subspace (0: same).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    tokens = {"calib": {"prompt": 0, "decode": 0}, "heldout": {"prompt": 0, "decode": 0}}
    for idx, spec in enumerate(layers):
        k, g = spec["key_dim"], spec["groups"]
        basis = {"state": [], "query": []}
        for _ in range(g):
            us = _random_orthogonal(k, gen)
            noise = torch.randn(k, k, dtype=torch.float64, generator=gen) / math.sqrt(k)
            uq, r = torch.linalg.qr(us + overlap * noise)  # a perturbed copy of the state basis
            basis["state"].append(us)
            basis["query"].append(uq * torch.sign(torch.diagonal(r)))
        for split, n in (("calib", calib_windows), ("heldout", heldout_windows)):
            s, u, mask = _sample_layer(spec, window, n, gen, basis)
            for name, t in _sums(s, u, mask).items():
                tensors[tensor_name(spec["layer"], split, name)] = t
            tokens[split]["decode"] += int(mask.sum()) + n if idx == 0 else 0
            if split == "heldout":
                r = min(kept_windows, n)
                sample = window_layout(r, spec["heads"], spec["key_dim"], spec["value_dim"], window)
                gamma = torch.ones(u.shape[:3], dtype=u.dtype)
                for (name, (_, dt)), t in zip(sample.items(), (s, u, gamma, mask), strict=True):
                    tensors[tensor_name(spec["layer"], split, name)] = t[:r].to(dt)
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "tool": {"name": "sketchcal", "version": __version__},
        "model": {
            "id": model_id,
            "revision": None,
            "model_type": model_type,
            "family": family,
            "fingerprint": fingerprint,
            # as calibrate records it: the weights of a local model directory
            "weights_fingerprint": weights_fingerprint(model_id)[0] if Path(model_id).is_dir() else None,
        },
        "data": {"source": "synthetic", "seed": seed},
        "seed": seed,
        "window": window,
        "seq_len": 0,
        "gen_tokens": 0,
        "prompt_len": 0,
        "tokens": tokens,
        "samples": {"calib": calib_windows, "heldout": heldout_windows},
        "layers": [dict(spec) for spec in layers],
    }
    write_final(out, tensors, manifest, shard_bytes=0)  # one layer per shard
    return out
