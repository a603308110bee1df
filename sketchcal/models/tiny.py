"""Tiny random-weight configs of every supported architecture (tests and the offline default).

Sizes are small enough for a CPU test to run prefill + generate in well under a second, while
keeping every structural feature: grouped keys (several heads per group), hybrid layer patterns
(attention interleaved with the linear mixers) and chunked prefill (``chunk_size`` smaller than
the test sequences, so prefills cross chunk boundaries).
"""

from __future__ import annotations

import transformers as tf

VOCAB = 2048
CHUNK = 16  # Mamba-2 chunk size used by the tiny configs (GDN/KDA chunk at 64 inside transformers)


def text_fields(hidden: int, intermediate: int, vocab: int, max_positions: int) -> dict:
    """The config fields of a text model's trunk (tied embeddings)."""
    trunk = dict(hidden_size=hidden, intermediate_size=intermediate, max_position_embeddings=max_positions)
    return dict(vocab_size=vocab, tie_word_embeddings=True, **trunk)


def attention_fields(heads: int, kv_heads: int, head_dim: int, **kw) -> dict:
    return dict(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, **kw)


def gdn_fields(key_heads: int, value_heads: int, key_dim: int, value_dim: int) -> dict:
    """The GDN mixer fields of a Qwen3-Next style config (``linear_*``), conv kernel 4."""
    heads = dict(linear_num_key_heads=key_heads, linear_num_value_heads=value_heads)
    return dict(
        linear_key_head_dim=key_dim, linear_value_head_dim=value_dim, linear_conv_kernel_dim=4, **heads
    )


def _mamba(names: str, **kw) -> dict:
    """The tiny Mamba-2 mixer (8 heads of dim 16 in 2 groups, state 16, chunks of ``CHUNK``) under a
    config's own names, given as ``"heads head_dim groups state chunk"``."""
    return dict(zip(names.split(), (8, 16, 2, 16, CHUNK), strict=True), **kw)


# most Mamba-2 hybrids spell the mixer's fields this way
_MAMBA_NAMES = "mamba_n_heads mamba_d_head mamba_n_groups mamba_d_state mamba_chunk_size"
_LAYERS3 = ["linear_attention", "full_attention", "linear_attention"]


def tiny_config(model_type: str, vocab_size: int = VOCAB) -> tf.PretrainedConfig:
    """A tiny random config for ``model_type`` (a key of :data:`sketchcal.models.ARCHITECTURES`)."""
    base = dict(**text_fields(64, 96, vocab_size, 1024), pad_token_id=0, bos_token_id=0, eos_token_id=0)
    attn = attention_fields(4, 2, 16)
    gdn = dict(**gdn_fields(2, 4, 16, 16), layer_types=_LAYERS3)
    moe = dict(num_experts=2, moe_intermediate_size=32)
    qwen_moe = dict(**moe, num_experts_per_tok=1, shared_expert_intermediate_size=32)
    mla = dict(qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=16, q_lora_rank=None)
    kda = dict(linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4, layer_types=_LAYERS3)
    kimi = dict(**kda, **mla, num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=3, **moe)
    zamba_attn = dict(num_attention_heads=4, num_key_value_heads=4, attention_head_dim=32)
    zamba_mem = dict(num_mem_blocks=1, use_shared_attention_adapter=False, use_mem_rope=False)
    falcon_ssm = dict(
        ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 2.0], ssm_in_multiplier=0.8, ssm_out_multiplier=1.1
    )
    granite_moe = dict(num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=96)
    configs: dict[
        str, tuple[str, int | None, dict]
    ] = {  # class, decoder layers (None: from the pattern), fields
        "mamba2": ("Mamba2Config", 2, _mamba("num_heads head_dim n_groups state_size chunk_size", expand=2)),
        "nemotron_h": (
            "NemotronHConfig",
            None,
            dict(
                **attn,
                **_mamba("mamba_num_heads mamba_head_dim n_groups ssm_state_size chunk_size"),
                layers_block_type=["mamba", "attention", "mlp", "mamba"],
            ),
        ),
        "falcon_h1": (
            "FalconH1Config",
            2,
            dict(**attn, mamba_d_ssm=128, **_mamba(_MAMBA_NAMES), **falcon_ssm),
        ),
        "zamba2": (
            "Zamba2Config",
            4,
            dict(
                **_mamba(
                    "n_mamba_heads mamba_headdim mamba_ngroups mamba_d_state chunk_size", mamba_expand=2
                ),
                **zamba_attn,
                **zamba_mem,
                layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
            ),
        ),
        "granitemoehybrid": (
            "GraniteMoeHybridConfig",
            3,
            dict(**attn, layer_types=["mamba", "attention", "mamba"], **granite_moe, **_mamba(_MAMBA_NAMES)),
        ),
        "bamba": ("BambaConfig", 3, dict(**attn, attn_layer_indices=[1], **_mamba(_MAMBA_NAMES))),
        "qwen3_next": ("Qwen3NextConfig", 3, dict(**attn, **gdn, **qwen_moe)),
        "qwen3_5_text": ("Qwen3_5TextConfig", 3, dict(**attn, **gdn)),
        "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", 3, dict(**attn, **gdn, **qwen_moe)),
        "olmo_hybrid": (
            "OlmoHybridConfig",
            3,
            dict(num_attention_heads=4, num_key_value_heads=4, **{**gdn, "linear_num_key_heads": 4}),
        ),
        "kimi_linear": ("KimiLinearConfig", 3, dict(**kimi, num_experts_per_token=1)),
        "bailing_hybrid": ("BailingHybridConfig", 3, dict(**kimi, num_experts_per_tok=1)),
    }
    cls, layers, fields = configs[model_type]
    if layers is not None:
        fields = {"num_hidden_layers": layers, **fields}
    return getattr(tf, cls)(**base, **fields)
