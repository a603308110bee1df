"""``vllm.LLM`` on the shipped Nemotron-H-style demo model, converted at rank 8, through the plugin.

References: vLLM's own decoding of the base model (its prefill, conv and C++ selective-state update),
and sketchcal's transformers runtime in the same mode on the same converted directory (transformers'
own model code, the float32 reference runtime). 4 prompts × 64 greedy tokens: 4 windows of 16.
"""

from __future__ import annotations

import contextlib
import gc
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import ROOT, require_vllm

require_vllm()

import sketchcal  # noqa: E402
from sketchcal.runtime import enabled  # noqa: E402

BASE = ROOT / "sketchcal" / "assets" / "models" / "tiny-mamba2"
TOKENS = 64
TEXTS = ["def parse(path):", "The module provides", "import os\nimport sys\n", "class Queue:"]
# vLLM's own decode and the plugin's replay decode agree to fp32 rounding (3e-6 measured)
ROUNDING = 2e-5


@dataclass
class Served:
    tokens: list[list[int]]
    logprobs: list[list[float]]
    mixers: list  # the model's recurrent layers, as vLLM built them
    state_page: int  # bytes per sequence of one recurrent layer's states (before vLLM pads them)
    page: int  # bytes of the page vLLM allocates per block
    concurrency: float  # sequences of max_model_len vLLM says it can hold


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> Path:
    stats = tmp_path_factory.mktemp("serve") / "stats"
    sketchcal.calibrate(
        "builtin:tiny-mamba2",
        out=stats,
        samples=8,
        seq_len=128,
        heldout_samples=2,
        device="cpu",
        progress=False,
    )
    return stats


@pytest.fixture(scope="module")
def converted(calibrated) -> Path:
    out = calibrated.parent / "model-sketch"
    sketchcal.convert(calibrated, rank=8, out=out, progress=False)
    return out


@pytest.fixture(scope="module")
def converted_adaptive(calibrated) -> Path:
    """The adaptive sketch at the read bytes of static rank 8."""
    out = calibrated.parent / "model-adaptive"
    sketchcal.convert(calibrated, rank=8, sketch_map="adaptive", out=out, progress=False)
    return out


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(BASE)
    return [tok(t).input_ids for t in TEXTS]


def serve(model_dir: Path, prompts: list[list[int]], mode: str | None = None) -> Served:
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
    from vllm.v1.kv_cache_interface import MambaSpec

    options = {} if mode is None else {"additional_config": {"sketchcal": {"mode": mode}}}
    llm = LLM(
        str(model_dir), dtype="float32", max_model_len=128, block_size=16, max_num_seqs=4, enforce_eager=True,
        enable_prefix_caching=False, kv_cache_memory_bytes=32 << 20, seed=0, **options,
    )  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=TOKENS, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        logprobs = [
            [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]
            for o in outs
        ]
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        mixers = [m for m in runner.model.modules() if isinstance(m, MambaMixer2)]
        spec = MambaSpec(
            shapes=tuple(mixers[0].get_state_shape()), dtypes=mixers[0].get_state_dtype(), block_size=1
        )
        cache = llm.llm_engine.vllm_config.cache_config
        return Served(
            tokens,
            logprobs,
            mixers,
            spec.page_size_bytes,
            cache.mamba_page_size_padded,
            cache.kv_cache_max_concurrency,
        )
    finally:
        del llm
        gc.collect()


def runtime_generate(
    model_dir: Path, prompts: list[list[int]], mode: str | None
) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and their log-probabilities from transformers: sketchcal's runtime in ``mode``
    (None: the plain model)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens, logprobs = [], []
    with (
        contextlib.nullcontext()
        if mode is None
        else enabled(model, model_dir, mode=mode, backend="reference")
    ):
        for p in prompts:
            out = model.generate(
                torch.tensor([p]), max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False,
                output_scores=True, return_dict_in_generate=True,
            )  # fmt: skip
            new = out.sequences[0, len(p) :].tolist()
            tokens.append(new)
            logprobs.append(
                [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, new, strict=True)]
            )
    return tokens, logprobs


@pytest.fixture(scope="module")
def runs(converted, converted_adaptive, prompts) -> dict[str, Served]:
    return {
        "standard": serve(BASE, prompts),  # no sketch_config: the plugin changes nothing
        "replay": serve(converted, prompts, "replay"),
        "sketch": serve(converted, prompts),  # the default mode
        "adaptive": serve(converted_adaptive, prompts),  # sketch mode on the adaptive sketch
    }


@pytest.fixture(scope="module")
def implementation_gap(runs, prompts) -> float:
    """How far vLLM's CPU model and transformers' model (same weights, fp32, standard decoding) are
    apart in log-probability over the same greedy tokens (0.03 on this model: their kernels differ by
    more than fp32 rounding): the baseline, with a 10% margin, of every comparison between a vLLM run
    and a transformers run."""
    tokens, logprobs = runtime_generate(BASE, prompts, None)
    assert tokens == runs["standard"].tokens
    return _max_gap(logprobs, runs["standard"].logprobs)


def _max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def test_without_a_sketch_vllm_is_unchanged(runs):
    std = runs["standard"]
    assert std.mixers and all(getattr(m, "serving", None) is None for m in std.mixers)
    # vLLM's own page: conv state (conv_kernel − 1) × conv_dim and the state H × P × N, fp32
    conv_dim = 8 * 64 + 2 * 2 * 128
    assert std.state_page == (3 * conv_dim + 8 * 64 * 128) * 4


def test_replay_decodes_the_standard_tokens(runs, converted, prompts, implementation_gap):
    replay, std = runs["replay"], runs["standard"]
    assert all(m.serving is not None and m.serving.mode == "replay" for m in replay.mixers)
    assert all(len(t) == TOKENS for t in replay.tokens)
    assert replay.tokens == std.tokens
    assert _max_gap(replay.logprobs, std.logprobs) < ROUNDING
    rt_tokens, rt_logprobs = runtime_generate(converted, prompts, "replay")
    assert replay.tokens == rt_tokens
    assert _max_gap(replay.logprobs, rt_logprobs) <= 1.1 * implementation_gap


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def test_sketch_matches_the_runtime_sketch(runs, converted, prompts, implementation_gap):
    sketch, replay = runs["sketch"], runs["replay"]
    assert all(m.serving is not None and m.serving.mode == "sketch" for m in sketch.mixers)
    rt_tokens, rt_logprobs = runtime_generate(converted, prompts, "sketch")
    assert sketch.tokens == rt_tokens
    assert _max_gap(sketch.logprobs, rt_logprobs) <= 1.1 * implementation_gap
    # What the sketch reads change (sketch − replay log-probabilities, over the tokens both modes
    # decode alike) is the same in vLLM and in the runtime: the gap between the two
    # implementations cancels in it, and what is left is small against the change itself.
    _, rt_replay = runtime_generate(converted, prompts, "replay")
    effect, disagreement = 0.0, 0.0
    for i in range(len(prompts)):
        n = _common_prefix(sketch.tokens[i], replay.tokens[i])
        for t in range(n):
            served = sketch.logprobs[i][t] - replay.logprobs[i][t]
            runtime = rt_logprobs[i][t] - rt_replay[i][t]
            effect, disagreement = max(effect, abs(runtime)), max(disagreement, abs(served - runtime))
    assert effect > 1e-2  # the sketch path is taken
    assert disagreement < 0.02 * effect


def test_adaptive_sketch_matches_the_runtime_adaptive_sketch(
    runs, converted_adaptive, prompts, implementation_gap
):
    """The adaptive sketch served (each flush makes its checkpoint's map in the page) decodes what
    the transformers runtime decodes on the same directory; it reads other numbers than the static
    sketch (its greedy tokens or log-probabilities differ)."""
    adaptive, sketch = runs["adaptive"], runs["sketch"]
    assert all(m.serving is not None and m.serving.adaptive for m in adaptive.mixers)
    rt_tokens, rt_logprobs = runtime_generate(converted_adaptive, prompts, "sketch")
    assert adaptive.tokens == rt_tokens
    assert _max_gap(adaptive.logprobs, rt_logprobs) <= 1.1 * implementation_gap
    assert adaptive.tokens != sketch.tokens or _max_gap(adaptive.logprobs, sketch.logprobs) > 1e-3


def test_page_accounting(runs, converted):
    std, replay, sketch = runs["standard"], runs["replay"], runs["sketch"]
    heads, groups, k, v, window = 8, 2, 128, 64, 16
    buffers = window * (groups * k + heads * v + heads) * 4 + 4  # keys, values, decays (fp32), cursor
    rows = max(int(lay.coef.shape[1]) for lay in sketch.mixers[0].serving.artifact.layers)
    assert replay.state_page == std.state_page + buffers
    assert sketch.state_page == replay.state_page + heads * rows * v * 4
    # the adaptive sketch's page: its sketch rows (Qᵀ after each flush) and P_S [H, M, K] per sequence
    adaptive = runs["adaptive"]
    ad_rows = max(int(lay.coef.shape[1]) for lay in adaptive.mixers[0].serving.artifact.layers)
    assert adaptive.state_page == replay.state_page + heads * ad_rows * (v + k) * 4
    # vLLM pads every recurrent page to an attention block of whole 16-token steps; the sequences it
    # can hold fall as that page grows
    for run in (std, replay, sketch):
        assert run.page >= run.state_page
    assert std.concurrency > sketch.concurrency
    assert std.concurrency / sketch.concurrency == pytest.approx(sketch.page / std.page, rel=0.02)
    assert math.isfinite(replay.concurrency)
