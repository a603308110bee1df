"""The configs of real hybrid models, for random-weight stand-ins of their real shapes.

Speed depends on the shapes, not the weights: ``sketchcal bench --e2e`` and the calibration
benchmark build these with random weights instead of downloading checkpoints.

- ``qwen3.5-4b``: Qwen3.5-4B's text model, 32 layers (24 GDN with 16 key / 32 value heads,
  K = V = 128; 8 gated attention layers).
- ``nemotron-3-nano``: Nemotron-3-Nano-30B-A3B, 52 layers (23 Mamba-2 with 64 heads of dim 64,
  8 groups, d_state 128; 23 MoE with 128 experts, 6 per token; 6 attention layers).
- ``kimi-linear-48b``: Kimi-Linear-48B-A3B's layer shapes (KDA with 32 heads, K = V = 128; MLA;
  MoE with 256 experts, 8 per token), cut to ``layers`` layers (default 8: 7 KDA + 1 MLA), since
  the 27-layer model and its states do not fit one GPU at large batches.
"""

from __future__ import annotations

import transformers as tf

from sketchcal.errors import SketchcalError
from sketchcal.models.tiny import attention_fields, gdn_fields, text_fields

QWEN35_4B = dict(
    **text_fields(2560, 9216, 248320, 4096),
    **attention_fields(16, 4, 256),
    **gdn_fields(16, 32, 128, 128),
    num_hidden_layers=32,
)
QWEN35_4B_LAYERS = (["linear_attention"] * 3 + ["full_attention"]) * 8

NEMOTRON_3_NANO = dict(
    vocab_size=131072,
    hidden_size=2688,
    hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    num_attention_heads=32,
    num_key_value_heads=2,
    head_dim=128,
    mamba_num_heads=64,
    mamba_head_dim=64,
    ssm_state_size=128,
    n_groups=8,
    conv_kernel=4,
    expand=2,
    chunk_size=128,
    n_routed_experts=128,
    num_experts_per_tok=6,
    moe_intermediate_size=1856,
    moe_shared_expert_intermediate_size=3712,
    intermediate_size=1856,
    routed_scaling_factor=2.5,
    max_position_embeddings=8192,
)

KIMI_LINEAR_48B = dict(max_position_embeddings=8192)  # the config class's defaults are this model's

REAL_CONFIGS = ("qwen3.5-4b", "nemotron-3-nano", "kimi-linear-48b")


def real_config(name: str, layers: int | None = None) -> tf.PretrainedConfig:
    """The config of ``name`` (one of :data:`REAL_CONFIGS`); ``layers`` cuts Kimi-Linear's depth."""
    if name == "qwen3.5-4b":
        return tf.Qwen3_5TextConfig(**QWEN35_4B, layer_types=QWEN35_4B_LAYERS)
    if name == "nemotron-3-nano":
        return tf.NemotronHConfig(**NEMOTRON_3_NANO)
    if name == "kimi-linear-48b":
        return tf.KimiLinearConfig(**KIMI_LINEAR_48B, num_hidden_layers=layers or 8)
    raise SketchcalError(f"unknown model config {name!r}; choose one of {', '.join(REAL_CONFIGS)}")
