"""The served GDN and KDA layers, one layer at a time, in a vLLM forward context.

Each test builds vLLM's layer class (swapped for the served one) from a vLLM config of a small
Qwen3-Next / Kimi-Linear directory with a synthetic sketch, binds a raw page per block as vLLM's
runner does (``bind_kv_cache``), and drives it with hand-built attention metadata: several sequences
in scattered blocks, one padding row on the null block, window flushes at different steps.

References:
- GDN: the same layer class with the plugin off (vLLM's own CPU kernels: prefill, conv and the
  decode recurrence), on the same weights and inputs; replay must decode as it does.
- KDA (vLLM's KDA kernels are Triton only, which vLLM cannot run on a CPU): transformers'
  Kimi-Linear functions, its forget gate and its ``recurrent_kimi_delta_attention``, run on the
  arguments the layer's decode calls receive, from the state in the page.
- Sketch mode, both: the runtime's :class:`~sketchcal.runtime.state.WindowState` (float64) on the
  same decode inputs, from the state vLLM's prefill wrote.
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT, require_vllm, write_synthetic_sketch

require_vllm()

from sketchcal.kernels.common import StepInputs  # noqa: E402
from sketchcal.kernels.common.pool import expand_groups  # noqa: E402
from sketchcal.runtime.precision import Precision  # noqa: E402
from sketchcal.runtime.state import WindowState  # noqa: E402
from sketchcal.serving.vllm.models import use_served_layer  # noqa: E402

WINDOW = 4
TOKENIZER = ROOT / "sketchcal" / "assets" / "models" / "tiny-gdn"


def model_dir(
    tmp: Path, model_type: str, architecture: str, sketch_map: str = "static", **sizes: int
) -> Path:
    import json

    from sketchcal.models.tiny import tiny_config

    out = tmp / model_type
    cfg = tiny_config(model_type)
    for name, value in sizes.items():
        setattr(cfg, name, value)
    cfg.save_pretrained(out)
    data = json.loads((out / "config.json").read_text())
    data["architectures"] = [architecture]
    (out / "config.json").write_text(json.dumps(data))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TOKENIZER / name, out / name)
    write_synthetic_sketch(out, rank=8, window=WINDOW, sketch_map=sketch_map)
    return out


def engine_config(model: Path, mode: str, dtype: str) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(model), dtype=dtype, enforce_eager=True, enable_prefix_caching=False, max_model_len=256,
        additional_config={"sketchcal": {"mode": mode}},
    )  # fmt: skip
    return args.create_engine_config()


@contextlib.contextmanager
def current(vllm_config: Any):
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    with set_current_vllm_config(vllm_config):
        if not model_parallel_is_initialized():
            init_distributed_environment(1, 0, "tcp://127.0.0.1:29517", 0, backend="gloo")
            initialize_model_parallel(1, 1)
        yield


def build(cls: type, vllm_config: Any, prefix: str, source: torch.nn.Module | None = None) -> torch.nn.Module:
    """``cls`` built and given weights: random, or ``source``'s (before :func:`finish`)."""
    from vllm.utils.torch_utils import set_default_torch_dtype

    with current(vllm_config), set_default_torch_dtype(vllm_config.model_config.dtype):
        layer = cls(vllm_config.model_config.hf_config, vllm_config, prefix=prefix)
        if source is None:
            gen = torch.Generator().manual_seed(0)
            for name, p in layer.named_parameters():
                if name.endswith("A_log"):
                    p.data.copy_(torch.empty(p.shape, dtype=p.dtype).uniform_(1, 8, generator=gen).log())
                elif "norm" in name:
                    p.data.fill_(1.0)
                else:
                    p.data.copy_(0.2 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        else:
            layer.load_state_dict(source.state_dict())
    return layer


def finish(layer: torch.nn.Module, vllm_config: Any) -> None:
    """What vLLM's loader and runner do next: post-process the weights (on a CPU: pack them) and
    bind one zeroed page per block."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with current(vllm_config):
        process_weights_after_loading(layer, vllm_config.model_config, torch.device("cpu"))
        spec = layer.get_kv_cache_spec(vllm_config)
        layer.bind_kv_cache(torch.zeros(BLOCKS, 1, 1, spec.page_size_bytes, dtype=torch.int8))


BLOCKS = 8


@dataclass
class Recorder:
    """The served decode steps of a layer: per call the block ids, the kernel-layout inputs and the
    outputs (sequence rows only)."""

    calls: list[tuple[torch.Tensor, StepInputs, torch.Tensor]] = field(default_factory=list)

    def attach(self, layer) -> None:
        step = layer.decoder.step

        def recording(pages, blocks, x):
            out = step(pages, blocks, x)
            self.calls.append((blocks.clone(), x.map(torch.clone), out.clone()))
            return out

        layer.decoder.step = recording

    def sequence(self, block: int) -> tuple[StepInputs, torch.Tensor]:
        """Block ``block``'s decode inputs [1, T, ...] (kernel layout) and outputs [1, T, H, V]."""
        xs, outs = [], []
        for blocks, x, out in self.calls:
            row = (blocks == block).nonzero()
            if len(row):
                r = int(row[0, 0])
                xs.append(x.map(lambda t, r=r: t[r : r + 1]))
                outs.append(out[r : r + 1])
        cat = {n: None if getattr(xs[0], n) is None else torch.cat([getattr(x, n) for x in xs], 1)
               for n in ("k", "q", "w", "decay", "beta", "skip")}  # fmt: skip
        return StepInputs(**cat), torch.cat(outs, 1)


def window_reference(layer, block: int, state: torch.Tensor, recorder: Recorder) -> None:
    """The block's served outputs against the runtime's WindowState from ``state`` [H, K, V] (sketch
    tables and map from the layer), float64, on the inputs the layer decoded."""
    x, got = recorder.sequence(block)
    heads = layer.plan.heads
    f64 = Precision(compute_dtype=torch.float64)
    ref = WindowState(
        layer.plan.family, state.double()[None], window=WINDOW, precision=f64, tables=layer.decoder.tables,
        sketch_map="adaptive" if layer.decoder.adaptive else "static",
    )  # fmt: skip
    want = ref.step(expand_groups(x.to(torch.float64), heads))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def assert_kernels_take(layer) -> None:
    """The pool over the pages vLLM bound is one the Triton kernels index, as the CUDA decode branch
    hands it to them: every tensor's slot parts contiguous and a page apart (not a dense pool), the
    checkpoint the transpose of vLLM's value-major recurrent state."""
    from dataclasses import replace

    from sketchcal.kernels.common.pool import check_paged, is_dense, value_major

    pool = layer.pages().pool
    cuda_state = layer.kv_cache[1].transpose(-1, -2)  # vLLM's [N, H, V, K], seen key-major
    assert value_major(cuda_state) and not is_dense(pool)
    read = cuda_state if pool.read is pool.state else pool.read
    check_paged(replace(pool, state=cuda_state, read=read))


# ---- GDN ---------------------------------------------------------------------------------------


def gdn_metadata(decodes: list[int], prefills: list[tuple[int, int]]) -> Any:
    """GDNAttentionMetadata of a batch: decode rows (block ids, one token each), then prefill rows
    (block id, tokens); no speculative rows."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    lens = [1] * len(decodes) + [n for _, n in prefills]
    blocks = decodes + [b for b, _ in prefills]
    loc = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return GDNAttentionMetadata(
        num_prefills=len(prefills), num_prefill_tokens=sum(n for _, n in prefills), num_decodes=len(decodes),
        num_decode_tokens=len(decodes), num_spec_decodes=0, num_spec_decode_tokens=0,
        num_actual_tokens=sum(lens),
        has_initial_state=torch.tensor([True] * len(decodes) + [False] * len(prefills)),
        non_spec_query_start_loc=loc, non_spec_state_indices_tensor=torch.tensor(blocks, dtype=torch.int32),
    )  # fmt: skip


def run_gdn(layer, vllm_config, meta, hidden: torch.Tensor) -> torch.Tensor:
    from vllm.forward_context import set_forward_context

    with current(vllm_config), set_forward_context({layer.prefix: meta}, vllm_config), torch.inference_mode():
        return layer(hidden)


def _gdn_dir(tmp: Path, sketch_map: str) -> Path:
    # the head dims of real models (and of builtin:tiny-gdn): vLLM's CPU kernels take only some
    sizes = dict(linear_key_head_dim=128, linear_value_head_dim=128)
    return model_dir(tmp, "qwen3_next", "Qwen3NextForCausalLM", sketch_map, **sizes)


@pytest.fixture(scope="module")
def gdn_dirs(tmp_path_factory) -> dict[str, Path]:
    """The converted model directory of each sketch map."""
    return {m: _gdn_dir(tmp_path_factory.mktemp(f"gdn-{m}"), m) for m in ("static", "adaptive")}


def sketch_map_of(mode: str) -> str:
    return "adaptive" if mode == "adaptive" else "static"


def served_mode(mode: str) -> str:
    """The plugin mode a test mode serves in: ``adaptive`` is sketch mode on an adaptive sketch."""
    return "sketch" if mode == "adaptive" else mode


@pytest.mark.parametrize("mode", ["replay", "sketch", "adaptive"])
def test_gdn_layer(gdn_dirs, mode):
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    use_served_layer("gdn")
    prefix = "model.layers.0.linear_attn"
    model = gdn_dirs[sketch_map_of(mode)]
    served_cfg, std_cfg = (
        engine_config(model, served_mode(mode), "bfloat16"),
        engine_config(model, "standard", "bfloat16"),
    )
    served = build(QwenGatedDeltaNetAttention, served_cfg, prefix)
    std = build(QwenGatedDeltaNetAttention, std_cfg, prefix, source=served)
    finish(served, served_cfg)
    finish(std, std_cfg)
    assert served.serving is not None and served.serving.mode == served_mode(mode) and std.serving is None
    assert served.decoder.adaptive == (mode == "adaptive") and served.plan.adaptive == (mode == "adaptive")
    recorder = Recorder()
    recorder.attach(served)
    hidden_size = served_cfg.model_config.hf_config.hidden_size
    gen = torch.Generator().manual_seed(1)

    def inputs(n: int) -> torch.Tensor:
        return torch.randn(n, hidden_size, generator=gen).to(torch.bfloat16)

    # prefill blocks 3 and 6; then decode them, block 5 joins with its prefill at step 3 (a mixed batch)
    prompts = {3: 6, 6: 9, 5: 4}
    states: dict[int, torch.Tensor] = {}
    h = inputs(15)
    meta = gdn_metadata([], [(3, 6), (6, 9)])
    torch.testing.assert_close(run_gdn(served, served_cfg, meta, h), run_gdn(std, std_cfg, meta, h))
    pool, cursor, _ = served.pages()
    assert_kernels_take(served)
    states.update({b: pool.state[b].clone() for b in (3, 6)})
    assert cursor[3] == cursor[6] == 0
    decoding = [3, 6]
    for step in range(2 * WINDOW + 3):
        joining = [(5, prompts[5])] if step == 3 else []
        h = inputs(len(decoding) + sum(n for _, n in joining))
        # the served layer also gets a padding row on the null block
        pad = torch.zeros(1, hidden_size, dtype=torch.bfloat16)
        got = run_gdn(
            served,
            served_cfg,
            gdn_metadata([*decoding, 0], joining),
            torch.cat([h[: len(decoding)], pad, h[len(decoding) :]]),
        )
        want = run_gdn(std, std_cfg, gdn_metadata(decoding, joining), h)
        live = torch.cat([got[: len(decoding)], got[len(decoding) + 1 :]])
        if mode == "replay":
            # both in bf16 (vLLM's CPU GDN runs bf16 activations): agreement to a few bf16 roundings
            assert float((live.float() - want.float()).norm() / want.float().norm()) < 1e-2
        if joining:
            states[5] = served.pages().pool.state[5].clone()
            decoding = [*decoding, 5]
    for block in (3, 6, 5):
        window_reference(served, block, states[block], recorder)
    pool, cursor, _ = served.pages()
    assert cursor[0] == 0 and not pool.buf_w[0].any()  # the null block was never written


def test_gdn_cuda_decode_call_unpacks_the_packed_decode(gdn_dirs):
    """On CUDA vLLM makes the GDN decode call with q, k and v packed in one row per sequence
    (``fused_recurrent_gated_delta_rule_packed_decode``): the served layer's unpacking of it decodes
    what its CPU call (q, k, v apart) decodes, through a flush, on two layers with the same pages."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    from sketchcal.errors import SketchcalError

    use_served_layer("gdn")
    cfgs = [
        engine_config(gdn_dirs["static"], "sketch", "bfloat16") for _ in range(2)
    ]  # one per layer of one name
    prefix = "model.layers.0.linear_attn"
    split = build(QwenGatedDeltaNetAttention, cfgs[0], prefix)
    packed = build(QwenGatedDeltaNetAttention, cfgs[1], prefix, source=split)
    finish(split, cfgs[0])
    finish(packed, cfgs[1])
    hk, hv, kd, vd = split.plan.groups, split.plan.heads, split.plan.key_dim, split.plan.value_dim
    gen = torch.Generator().manual_seed(3)
    state = 0.3 * torch.randn(hv, kd, vd, generator=gen)
    for layer in (split, packed):
        pool = layer.pages().pool
        pool.state[3], pool.state[5] = state, -state
        layer.settle(torch.tensor([3, 5]), buffered=False)
    blocks = torch.tensor([3, 0, 5], dtype=torch.int32)  # a padding row between two sequences

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    for _ in range(WINDOW + 1):  # through a flush
        q, k, v = rand(3, hk, kd), rand(3, hk, kd), rand(3, hv, vd)
        gates = dict(a=rand(3, hv), b=rand(3, hv), A_log=split.A_log, dt_bias=split.dt_bias)
        gates["use_qk_l2norm_in_kernel"] = True
        want = split.decode_call(
            "decode", None, (), dict(gates, q=q[None], k=k[None], v=v[None], initial_state_indices=blocks)
        )
        out = torch.full((3, 1, hv, vd), float("nan"), dtype=torch.bfloat16)
        mixed = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=-1)
        call = dict(gates, mixed_qkv=mixed, scale=kd**-0.5, out=out, ssm_state_indices=blocks)
        assert packed._packed_decode((), call) is None
        torch.testing.assert_close(out, want.view_as(out), rtol=0, atol=0)
    with pytest.raises(SketchcalError, match="does not know"):
        packed._packed_decode((), dict(call, scale=0.5))


# ---- KDA ---------------------------------------------------------------------------------------


def kda_gate(raw_g: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """transformers' Kimi-Linear forget gate on the layer's gate projection ``raw_g`` [1, T, H, D]:
    its own module, with the projections before it taken out."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForgetGate

    h, d = raw_g.shape[-2:]
    gate = KimiLinearForgetGate.__new__(KimiLinearForgetGate)
    torch.nn.Module.__init__(gate)
    gate.head_dim, gate.num_heads = d, h
    gate.f_a_proj = gate.f_b_proj = torch.nn.Identity()
    gate.dt_bias = torch.nn.Parameter(dt_bias.float().reshape(-1).clone(), requires_grad=False)
    gate.A_log = torch.nn.Parameter(a_log.float().view(1, 1, h, 1).clone(), requires_grad=False)
    return gate(raw_g.reshape(*raw_g.shape[:2], h * d))


def kda_steps(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' recurrent KDA (its torch function) from the key-major ``state`` [1, H, K, V]."""
    from transformers.models.kimi_linear import modeling_kimi_linear as mkl

    from sketchcal.models.capture import torch_reference

    fn = torch_reference(mkl.recurrent_kimi_delta_attention)
    return fn(q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)


def chunked_prefill_stand_in(q, k, v, raw_g, raw_beta, A_log, g_bias, initial_state, cu_seqlens, **_):
    """vLLM's chunked KDA prefill (Triton only: vLLM cannot run it on a CPU), written with
    transformers' functions: per sequence, the gate and the recurrence from its initial state
    [N, H, V, K] (vLLM's layout). Returns the outputs [1, T, H, V] and the final states; the
    initial states are kept in ``STARTS``."""
    STARTS.append(initial_state.clone())
    outs, finals = [], []
    bounds = cu_seqlens.tolist()
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        g = kda_gate(raw_g[:, a:b], A_log, g_bias)
        beta = raw_beta[:, a:b].float().sigmoid()
        o, s = kda_steps(
            q[:, a:b], k[:, a:b], v[:, a:b], g, beta, initial_state[i : i + 1].transpose(-1, -2).float()
        )
        outs.append(o)
        finals.append(s.transpose(-1, -2))
    return torch.cat(outs, 1), torch.cat(finals)


STARTS: list[torch.Tensor] = []


def gather_stand_in(
    state: torch.Tensor, indices: torch.Tensor, has_initial_state: torch.Tensor
) -> torch.Tensor:
    """vLLM's ``gather_initial_states`` (a Triton kernel) in torch: the rows of ``state`` at
    ``indices``, zero where a sequence has no initial state."""
    rows = state[indices.long()]
    return torch.where(has_initial_state.view(-1, *[1] * (rows.dim() - 1)), rows, 0)


@pytest.fixture(scope="module")
def kda_dirs(tmp_path_factory) -> dict[str, Path]:
    return {m: _kda_dir(tmp_path_factory.mktemp(f"kda-{m}"), m) for m in ("static", "adaptive")}


def _kda_dir(tmp: Path, sketch_map: str) -> Path:
    import json

    out = model_dir(tmp, "kimi_linear", "KimiLinearForCausalLM", sketch_map)
    cfg = json.loads((out / "config.json").read_text())
    kinds = cfg["layer_types"]
    # vLLM 0.32 reads Kimi-Linear's original config section (1-based layer numbers)
    cfg["linear_attn_config"] = {
        "kda_layers": [i + 1 for i, t in enumerate(kinds) if t == "linear_attention"],
        "full_attn_layers": [i + 1 for i, t in enumerate(kinds) if t != "linear_attention"],
        "head_dim": cfg["linear_head_dim"],
        "num_heads": cfg["linear_num_heads"],
        "short_conv_kernel_size": cfg["linear_conv_kernel_dim"],
    }
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("mode", ["replay", "sketch", "adaptive"])
def test_kda_layer(kda_dirs, mode, monkeypatch):
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.mamba.gdn import kimi_gdn_linear_attn
    from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import KimiGatedDeltaNetAttention
    from vllm.models.kimi_k3.nvidia.ops.third_party import kda as vllm_kda

    use_served_layer("kda")
    # vLLM's KDA prefill is Triton only: stand-ins in torch (transformers' functions) run it here
    monkeypatch.setattr(vllm_kda, "chunk_kda_with_fused_gate", chunked_prefill_stand_in)
    monkeypatch.setattr(kimi_gdn_linear_attn, "gather_initial_states", gather_stand_in)
    prefix = "model.layers.0.self_attn"
    cfg = engine_config(kda_dirs[sketch_map_of(mode)], served_mode(mode), "float32")
    layer = build(KimiGatedDeltaNetAttention, cfg, prefix)
    finish(layer, cfg)
    assert layer.serving is not None and layer.serving.mode == served_mode(mode)
    assert layer.decoder.adaptive == (mode == "adaptive")
    calls: list[dict[str, torch.Tensor]] = []
    decode_call = layer.decode_call

    def recording(kind, original, args, kwargs):
        calls.append({n: t.clone() for n, t in kwargs.items() if isinstance(t, torch.Tensor)})
        out = decode_call(kind, original, args, kwargs)
        calls[-1]["out"] = out[0][0].clone()
        return out

    layer.decode_call = recording
    recorder = Recorder()
    recorder.attach(layer)
    hidden_size = cfg.model_config.hf_config.hidden_size
    gen = torch.Generator().manual_seed(2)

    def forward(decodes: list[int], prefills: list[tuple[int, int]]) -> torch.Tensor:
        n = len(decodes) + sum(t for _, t in prefills)
        meta = gdn_metadata(decodes, prefills)
        with current(cfg), set_forward_context({prefix: meta}, cfg), torch.inference_mode():
            return layer(torch.randn(n, hidden_size, generator=gen), torch.zeros(n, dtype=torch.long))

    STARTS.clear()
    forward([], [(3, 5), (6, 7)])
    pool = layer.pages().pool
    assert_kernels_take(layer)
    states = {b: pool.state[b].clone() for b in (3, 6)}
    decoding, pad = [3, 6], [0]
    for step in range(2 * WINDOW + 3):
        if step == 3:  # a mixed batch: vLLM's chunked path continues 3 and 6 and prefills 5
            forward(decoding, [(5, 4)])
            folded = {b: layer.pages().pool.state[b].clone() for b in (3, 5, 6)}
            decoding = [*decoding, 5]
            continue
        forward([*decoding, *pad], [])
    pool, cursor, _ = layer.pages()
    assert cursor[0] == 0 and not pool.buf_w[0].any()  # the padding rows never touched the null block
    if mode != "replay":
        for block in (3, 6):  # their windows up to the mixed batch, and from there on
            window_reference(layer, block, states[block], _Before(recorder, 3))
            window_reference(layer, block, folded[block], _After(recorder, 3))
        window_reference(layer, 5, folded[5], _After(recorder, 3))
        return
    # replay: every decode step is transformers' standard KDA step; the state runs on through the
    # mixed batch
    h = layer.local_num_heads
    for row, block in enumerate((3, 6)):
        s = states[block][None].float()
        rows = [(c, int(torch.nonzero(c["state_indices"] == block)[0, 0])) for c in calls
                if (c["state_indices"] == block).any()]  # fmt: skip
        assert len(rows) == 2 * WINDOW + 2
        for i, (c, r) in enumerate(rows):
            if i == 3:  # the mixed batch ran between the third and fourth decode call: vLLM's chunked
                # path started from the exact state (the buffer folded into the checkpoint)
                torch.testing.assert_close(STARTS[1][row].transpose(-1, -2)[None], s, rtol=1e-5, atol=1e-6)
                s = folded[block][None].float()
            q, k, v = c["mixed_qkv"][r : r + 1].split([h * layer.head_dim] * 3, dim=-1)
            shape = (1, 1, h, layer.head_dim)
            g = kda_gate(c["raw_g"][:, r : r + 1], c["A_log"], c["dt_bias"])
            beta = c["raw_beta"][:, r : r + 1].float().sigmoid()
            o, s = kda_steps(q.view(shape), k.view(shape), v.view(shape), g, beta, s)
            torch.testing.assert_close(c["out"][r].float(), o[0, 0].float(), rtol=1e-4, atol=1e-5)


class _Before(Recorder):
    def __init__(self, rec: Recorder, calls: int):
        super().__init__(rec.calls[:calls])


class _After(Recorder):
    def __init__(self, rec: Recorder, calls: int):
        super().__init__(rec.calls[calls:])
