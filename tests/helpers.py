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


def calibrate_worker(rank: int, port: int, out: str, kwargs: dict) -> None:
    """One rank of a 2-process gloo calibration (a module-level function, so spawn can pickle it)."""
    import os

    import sketchcal

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    sketchcal.calibrate(out=out, **kwargs)
    torch.distributed.destroy_process_group()
