"""Shared test helpers (tests/ is on sys.path through the pytest config)."""

import torch

ALL_MODEL_TYPES = [
    "mamba2",
    "nemotron_h",
    "falcon_h1",
    "zamba2",
    "granitemoehybrid",
    "bamba",
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "olmo_hybrid",
    "kimi_linear",
    "bailing_hybrid",
]


def build_tiny(model_type: str, seed: int = 0):
    """A tiny random-weight model of ``model_type``, float32, eval mode."""
    import transformers as tf

    from sketchcal.models.tiny import tiny_config

    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
