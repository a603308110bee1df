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


def _attn(**kw) -> dict:
    return dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, **kw)


def tiny_config(model_type: str, vocab_size: int = VOCAB) -> tf.PretrainedConfig:
    """A tiny random config for ``model_type`` (a key of :data:`sketchcal.models.ARCHITECTURES`)."""
    v = vocab_size
    base = dict(
        vocab_size=v,
        hidden_size=64,
        intermediate_size=96,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    if model_type == "mamba2":
        return tf.Mamba2Config(
            **{**base, "num_hidden_layers": 2},
            num_heads=8,
            head_dim=16,
            state_size=16,
            n_groups=2,
            expand=2,
            chunk_size=CHUNK,
        )
    if model_type == "nemotron_h":
        return tf.NemotronHConfig(
            **base,
            **_attn(),
            layers_block_type=["mamba", "attention", "mlp", "mamba"],
            mamba_num_heads=8,
            mamba_head_dim=16,
            ssm_state_size=16,
            n_groups=2,
            chunk_size=CHUNK,
        )
    if model_type == "falcon_h1":
        return tf.FalconH1Config(
            **{**base, "num_hidden_layers": 2},
            **_attn(),
            mamba_d_ssm=128,
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_chunk_size=CHUNK,
            ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 2.0],
            ssm_in_multiplier=0.8,
            ssm_out_multiplier=1.1,
        )
    if model_type == "zamba2":
        return tf.Zamba2Config(
            **{**base, "num_hidden_layers": 4},
            mamba_d_state=16,
            mamba_ngroups=2,
            n_mamba_heads=8,
            mamba_headdim=16,
            mamba_expand=2,
            chunk_size=CHUNK,
            num_attention_heads=4,
            num_key_value_heads=4,
            attention_head_dim=32,
            layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
            num_mem_blocks=1,
            use_shared_attention_adapter=False,
            use_mem_rope=False,
        )
    if model_type == "granitemoehybrid":
        return tf.GraniteMoeHybridConfig(
            **{**base, "num_hidden_layers": 3},
            **_attn(),
            layer_types=["mamba", "attention", "mamba"],
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_chunk_size=CHUNK,
            num_local_experts=2,
            num_experts_per_tok=1,
            shared_intermediate_size=96,
        )
    if model_type == "bamba":
        return tf.BambaConfig(
            **{**base, "num_hidden_layers": 3},
            **_attn(),
            attn_layer_indices=[1],
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_chunk_size=CHUNK,
        )
    gdn = dict(
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
    )
    layers3 = ["linear_attention", "full_attention", "linear_attention"]
    if model_type == "qwen3_next":
        return tf.Qwen3NextConfig(
            **{**base, "num_hidden_layers": 3},
            **_attn(),
            **gdn,
            layer_types=layers3,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        )
    if model_type == "qwen3_5_text":
        return tf.Qwen3_5TextConfig(**{**base, "num_hidden_layers": 3}, **_attn(), **gdn, layer_types=layers3)
    if model_type == "qwen3_5_moe_text":
        return tf.Qwen3_5MoeTextConfig(
            **{**base, "num_hidden_layers": 3},
            **_attn(),
            **gdn,
            layer_types=layers3,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        )
    if model_type == "olmo_hybrid":
        return tf.OlmoHybridConfig(
            **{**base, "num_hidden_layers": 3},
            num_attention_heads=4,
            num_key_value_heads=4,
            **{**gdn, "linear_num_key_heads": 4},
            layer_types=layers3,
        )
    kda = dict(linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4)
    mla = dict(
        num_attention_heads=4,
        num_key_value_heads=4,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        kv_lora_rank=16,
        q_lora_rank=None,
    )
    if model_type == "kimi_linear":
        return tf.KimiLinearConfig(
            **{**base, "num_hidden_layers": 3},
            **mla,
            **kda,
            layer_types=layers3,
            num_experts=2,
            num_experts_per_token=1,
            moe_intermediate_size=32,
            first_k_dense_replace=3,
        )
    if model_type == "bailing_hybrid":
        return tf.BailingHybridConfig(
            **{**base, "num_hidden_layers": 3},
            **mla,
            **kda,
            layer_types=layers3,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            first_k_dense_replace=3,
        )
    raise KeyError(model_type)
