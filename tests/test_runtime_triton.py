"""The runtime's ``triton`` backend (decode kernels over a slot pool per layer) inside transformers models.

References: the ``reference`` backend (torch decode states, the same fp32 math in another order) and
the model's own decode (``generate()`` with no runtime). Without CUDA the kernels run in the Triton
interpreter (``TRITON_INTERPRET=1``, set before any kernel is defined) on tiny one-mixer models
(K = V = 16, two heads per group but for KDA, batch 2, window 4); with CUDA the same tests run on
the device,
and the ``gpu`` tests run the shipped demo models at batch 64 with an artifact converted at rank 8
from a quick calibration. Exactness checks buffer fp32 inputs (``buffer_dtype="fp32"``), so that
replay must agree with the reference to fp32 rounding; the bf16 buffers CUDA defaults to are
checked on their own.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from synthetic_stats import write_synthetic_stats

from sketchcal.artifact.convert import convert
from sketchcal.artifact.sketch import SketchLayer, read_sketch
from sketchcal.errors import SketchcalError
from sketchcal.kernels.common import StepInputs, family, recurrence
from sketchcal.kernels.common.recurrence import identity_tokens
from sketchcal.models import describe, use_torch_path
from sketchcal.runtime import Precision, enable, enabled, layer_tables, make_state
from sketchcal.runtime.graph_decode import GraphDecoder
from sketchcal.runtime.kernel_state import kernel_tables, make_kernel_state
from sketchcal.verify.metrics import kl_per_token

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FAMILIES = ["gdn", "mamba2", "kda"]
P, L, TOKENS = 4, 4, 13  # prefill tokens, window, sequence length (two flushes, then a 1-token read)
EXACT = {"buffer_dtype": "fp32"}
# one recurrent mixer (H heads in G groups, K = V = 16) and one attention layer per family
TINY = {
    "gdn": ("qwen3_5_text", {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}),
    "mamba2": (
        "nemotron_h",
        {"num_hidden_layers": 2, "layers_block_type": ["mamba", "attention"], "mamba_num_heads": 4},
    ),
    "kda": (
        "kimi_linear",
        {
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_heads": 2,
            "first_k_dense_replace": 2,
        },
    ),
}


def rel_max(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| / max |want|."""
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def tiny_model(fam: str):
    import transformers as tf

    from sketchcal.models.tiny import tiny_config

    model_type, overrides = TINY[fam]
    base = tiny_config(model_type)
    kwargs = {k: v for k, v in base.to_dict().items() if k != "mlp_layer_types"}  # re-derived
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(type(base)(**{**kwargs, **overrides})).eval()
    spec = describe(model)
    with torch.no_grad():  # long memory, and a mixer output that moves the logits (as trained models)
        for mixer in spec.mixers(model):
            for name, p in mixer.named_parameters():
                if name.endswith("A_log"):
                    p.fill_(math.log(0.02))
                if fam == "mamba2" and name == "D":
                    p.zero_()
                if fam == "mamba2" and name == "out_proj.weight":
                    p.mul_(30)
    model.to(DEVICE)
    if DEVICE == "cpu":
        use_torch_path(spec)
    return model, spec


def converted(spec, root, window: int) -> object:
    """``sketchcal convert`` at mean rank 8 on synthetic statistics of the model's layers."""
    stats = write_synthetic_stats(
        root / "stats",
        [s.as_dict() for s in spec.layers],
        fingerprint=spec.fingerprint,
        model_type=spec.arch.model_type,
        family=spec.family,
        window=window,
    )
    convert(stats, rank=8, out=root / "art", reference_only=True, shrinkage="ledoit_wolf")
    return read_sketch(root / "art")


@pytest.fixture(scope="module", params=FAMILIES)
def fam_model(request, tmp_path_factory):
    model, spec = tiny_model(request.param)
    art = converted(spec, tmp_path_factory.mktemp(request.param), L)
    ranks = {m for lay in art.layers for m in lay.ranks.tolist()}
    assert 0 < max(ranks) < spec.layers[0].key_dim  # the sketch heads read a sketch
    return request.param, model, spec, art


def forward(model, ids, art, mode: str, backend: str, window: int = L, **kw):
    """Teacher-forced logits and mixer outputs (per layer): P tokens of the model's own prefill,
    then decode steps in ``mode``."""
    mixers = describe(model).mixers(model)
    outs: dict[int, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda mod, a, o: outs.__setitem__(mod.layer_idx, o)) for m in mixers]
    try:
        with (
            torch.no_grad(),
            enabled(model, art, mode, prefill=P, window=window, backend=backend, **kw) as rt,
        ):
            logits = model(ids, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    assert rt.backend == backend
    if not (mode == "standard" and backend == "reference"):  # that one runs the model's own steps
        assert rt.last_states.keys() == outs.keys()
    for st in rt.last_states.values():  # every layer decoded in this mode, on this backend
        assert st.mode == mode and type(st).__name__.startswith("Kernel") == (backend == "triton")
        if mode != "standard":
            assert st.flushes == (ids.shape[1] - P) // window
    return logits, outs


def ids_for(model, batch: int, tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (batch, tokens), generator=gen).to(DEVICE)


def generate(model, prompt, new: int, *args, **kw):
    """Greedy tokens [B, P + new]: the model's own decoding (no ``args``), or in a runtime's mode
    (then also the runtime's decode states of the sequence)."""
    opts = {"max_new_tokens": new, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    attention = torch.ones_like(prompt)
    if not args:
        return model.generate(prompt, attention_mask=attention, **opts)
    with torch.no_grad(), enabled(model, *args, **kw) as rt:
        out = model.generate(prompt, attention_mask=attention, return_dict_in_generate=True, **opts)
    assert rt.backend == kw["backend"]
    return out, rt.states(out.past_key_values)


# ---- checks shared by the CPU (interpreter) tests and the gpu tests -------------------------------


def check_replay(model, art, ids, window: int, new: int, tol: float) -> None:
    """Teacher-forced replay logits and mixer outputs within fp32 rounding of the reference backend;
    greedy tokens decoded in replay mode identical to the model's own decoding, and the cache holds
    the last checkpoint."""
    want, want_mix = forward(model, ids, art, "replay", "reference", window)
    got, got_mix = forward(model, ids, art, "replay", "triton", window, **EXACT)
    assert rel_max(got, want) <= tol
    for layer, o in want_mix.items():
        assert rel_max(got_mix[layer], o) <= tol, layer
    prompt = ids[:, :P]
    plain = generate(model, prompt, new)
    out, states = generate(model, prompt, new, art, "replay", backend="triton", **EXACT)
    assert torch.equal(out.sequences, plain)
    value_major = describe(model).family == "mamba2"  # transformers keeps Mamba-2 states [B, H, V, K]
    for layer, st in states.items():  # generate feeds new − 1 tokens as decode steps
        assert st.flushes == (new - 1) // window and st.pos == (new - 1) % window
        cached = out.past_key_values.layers[layer].recurrent_states[0]  # transformers ≥ 5.17
        assert torch.equal(cached.transpose(-1, -2) if value_major else cached, st.ckpt.state)


def check_sketch(model, art, ids, window: int, kl_max: float, **opts) -> None:
    """Sketch mode on the two backends: KL(reference ‖ triton) per next token, and mixer outputs
    within fp32 rounding of each other, far closer than the sketch is to the exact read. ``opts``
    go to both (``sketch_map``)."""
    want, want_mix = forward(model, ids, art, "sketch", "reference", window, **opts)
    got, got_mix = forward(model, ids, art, "sketch", "triton", window, **EXACT, **opts)
    _, replay_mix = forward(model, ids, art, "replay", "reference", window)
    assert float(kl_per_token(want[:, P:], got[:, P:]).mean()) <= kl_max
    for layer, o in want_mix.items():
        err = rel_max(got_mix[layer][:, P:], o[:, P:])
        assert err <= 1e-4 and 100 * err < rel_max(replay_mix[layer][:, P:], o[:, P:]), layer


# ---- CPU (interpreter) and small-CUDA tests -------------------------------------------------------


def test_replay_matches_the_reference_backend_and_decodes_the_same_tokens(fam_model):
    _, model, _, art = fam_model
    check_replay(model, art, ids_for(model, 2, TOKENS, 1), L, new=L + 2, tol=1e-4)


def test_sketch_kl_to_the_reference_backend(fam_model):
    _, model, _, art = fam_model
    check_sketch(model, art, ids_for(model, 2, TOKENS, 2), L, kl_max=1e-4)


def test_adaptive_sketch_kl_to_the_reference_backend(fam_model):
    """The adaptive sketch on the kernels (factors made by each flush's kernel) against the
    reference backend's (an SVD per flush, float64)."""
    _, model, _, art = fam_model
    check_sketch(model, art, ids_for(model, 2, TOKENS, 4), L, kl_max=1e-4, sketch_map="adaptive")


def test_standard_mode_is_the_models_own_decode(fam_model):
    _, model, _, _ = fam_model
    ids = ids_for(model, 2, TOKENS, 3)
    want, want_mix = forward(model, ids, None, "standard", "reference")  # the model's own steps
    got, got_mix = forward(model, ids, None, "standard", "triton")
    assert rel_max(got, want) <= 1e-4
    for layer, o in want_mix.items():
        assert rel_max(got_mix[layer], o) <= 1e-4, layer
    prompt, new = ids[:, :P], 3
    out, states = generate(model, prompt, new, None, "standard", backend="triton")
    assert torch.equal(out.sequences, generate(model, prompt, new))
    assert all(st.mode == "standard" for st in states.values())


# ---- the graph decoder (StaticCache, the pool, one graph per window phase on CUDA) -----------------


def graph_generate(model, prompt, new: int, *args, **kw) -> torch.Tensor:
    """Greedy tokens [B, P + new] from :class:`GraphDecoder` (eager off CUDA), with the model's own
    decode (no ``args``) or in a runtime's mode; the runtime is left as it was found."""
    if not args:
        return GraphDecoder(model).generate(prompt, new)
    with enabled(model, *args, **kw) as rt:
        out = GraphDecoder(model).generate(prompt, new)
        assert rt.mirror_cache  # restored
    return out


def check_graph_decoder(model, art, prompt, new: int, window: int) -> None:
    """The decoder's tokens: the model's own decode equal to ``generate()``; replay (fp32 buffers)
    equal to both; sketch equal to ``generate()`` in sketch mode on the same backend."""
    plain = generate(model, prompt, new)
    assert torch.equal(graph_generate(model, prompt, new), plain)
    kw = dict(window=window, backend="triton", **EXACT)
    assert torch.equal(graph_generate(model, prompt, new, art, "replay", **kw), plain)
    sketch, _ = generate(model, prompt, new, art, "sketch", **kw)
    assert torch.equal(graph_generate(model, prompt, new, art, "sketch", **kw), sketch.sequences)


def check_public(model, prompt, new: int) -> None:
    """The public backend (the family's public kernel in place on a slot pool) decodes the model's
    own greedy tokens, in ``generate()`` and in the graph decoder, with every layer on it."""
    plain = generate(model, prompt, new)
    out, states = generate(model, prompt, new, None, "standard", backend="public")
    assert torch.equal(out.sequences, plain)
    assert states and all(type(s).__name__ == "PublicStandardState" for s in states.values())
    assert torch.equal(graph_generate(model, prompt, new, None, "standard", backend="public"), plain)
    rows = [prompt[0, :3], prompt[1], prompt[0, :5]]  # a stream through two slots, as check_serve's
    counts = [4, new, 3]
    alone = [generate(model, q[None], n)[0, q.numel() :] for q, n in zip(rows, counts, strict=True)]
    assert _equal(serve(model, rows, counts, None, "standard", backend="public"), alone)


def public_or_skip(fam: str) -> None:
    from sketchcal.kernels import public

    why = public.available(fam)
    if why is not None:
        pytest.skip(why)
    if fam != "gdn" and DEVICE == "cpu":  # fla's KDA kernel crashes the interpreter, vLLM's needs CUDA
        pytest.skip("only fla's GDN decode kernel runs in the Triton interpreter")


def test_public_backend_decodes_the_models_tokens(fam_model):
    fam, model, _, _ = fam_model
    public_or_skip(fam)
    check_public(model, ids_for(model, 2, P + 3, 23), 2 * L + 3)


def test_public_backend_refusals():
    """Modes other than standard, and a machine without the family's library, are one-line errors."""
    from sketchcal.kernels import public

    model, _ = tiny_model("mamba2")
    with pytest.raises(SketchcalError, match="standard decoding only"):
        enable(model, None, "replay", backend="public")
    if public.available("mamba2") is not None:
        with pytest.raises(SketchcalError, match="vLLM or mamba_ssm"):
            enable(model, None, "standard", backend="public")


def test_graph_decoder_decodes_the_same_tokens(fam_model):
    _, model, _, art = fam_model
    check_graph_decoder(model, art, ids_for(model, 2, P + 3, 21), 2 * L + 3, L)


def serve(model, prompts, counts, *args, **kw) -> list[torch.Tensor]:
    """:meth:`GraphDecoder.serve` at batch 2 (eager off CUDA, CUDA graphs on it), with the model's
    own decode (no ``args``) or in a runtime's mode."""
    if not args:
        return GraphDecoder(model).serve(prompts, counts, batch=2)
    with enabled(model, *args, **kw):
        return GraphDecoder(model).serve(prompts, counts, batch=2)


def check_serve(model, art, window: int) -> None:
    """A stream of prompts through two slots decodes what each prompt decodes alone: the model's own
    decode and replay with sequences taking slots in the middle of windows; sketch with every
    sequence taking it at a window start (each takes 1 + a multiple of L tokens)."""
    lengths = (3, 3, 5, 5, 6)  # prompts of one length that take slots at one step prefill together
    prompts = [ids_for(model, 1, n, 40 + i)[0] for i, n in enumerate(lengths)]
    counts = [4, 4, 2 * window + 3, 1, 7]
    alone = [generate(model, q[None], n)[0, q.numel() :] for q, n in zip(prompts, counts, strict=True)]
    assert _equal(serve(model, prompts, counts), alone)
    # stop tokens: a sequence ends at its first one (kept), and its slot goes to the next prompt
    stop = {int(alone[1][2]), int(alone[4][0])}
    cut = [a[: next((i + 1 for i, t in enumerate(a.tolist()) if t in stop), a.numel())] for a in alone]
    assert any(c.numel() < a.numel() for c, a in zip(cut, alone, strict=True))
    assert _equal(GraphDecoder(model).serve(prompts, counts, batch=2, stop_tokens=stop), cut)
    kw = dict(window=window, backend="triton", **EXACT)
    assert _equal(serve(model, prompts, counts, art, "replay", **kw), alone)
    counts = [window + 1, 2 * window + 1, 1, window + 1, 1]
    sketch = [
        generate(model, q[None], n, art, "sketch", **kw)[0].sequences[0, q.numel() :]
        for q, n in zip(prompts, counts, strict=True)
    ]
    assert _equal(serve(model, prompts, counts, art, "sketch", **kw), sketch)


def _equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_graph_decoder_serves_a_stream_of_prompts(fam_model):
    _, model, _, art = fam_model
    check_serve(model, art, L)


def test_graph_decoder_keeps_the_state_in_the_pool_only(fam_model):
    """With a runtime the cache's recurrent tensors are released: the pool is the one copy."""
    from transformers import StaticCache

    _, model, spec, art = fam_model
    seen = []
    original = StaticCache.__init__

    def spy(self, *a, **k):
        original(self, *a, **k)
        seen.append(self)

    StaticCache.__init__ = spy
    try:
        graph_generate(model, ids_for(model, 2, P, 22), L + 1, art, "sketch", window=L, backend="triton")
    finally:
        StaticCache.__init__ = original
    (cache,) = seen
    for shape in spec.layers:
        assert cache.layers[shape.layer].recurrent_states[0].numel() == 0


def test_graph_decoder_refusals():
    model, _ = tiny_model("gdn")
    with pytest.raises(SketchcalError, match="CUDA device") as err:
        GraphDecoder(model.cpu(), graphs=True)
    assert "\n" not in str(err.value)
    model.to(DEVICE)
    with enabled(model, None, "replay", backend="reference"):
        if DEVICE == "cuda":
            with pytest.raises(SketchcalError, match="backend='triton'"):
                GraphDecoder(model, graphs=True)
        with pytest.raises(SketchcalError, match="max_new_tokens"):
            GraphDecoder(model, graphs=False).generate(ids_for(model, 1, 4, 0), 0)
        ids = ids_for(model, 2, 4, 0)
        padded = torch.ones_like(ids)
        padded[0, 0] = 0
        with pytest.raises(SketchcalError, match="without padding"):
            GraphDecoder(model, graphs=False).generate(ids, 2, attention_mask=padded)
    prompt = ids_for(model, 1, 4, 0)[0]
    bad = [
        (([], 2), "at least one prompt"),
        (([prompt], [2, 3]), "one max_new_tokens per prompt"),
        (([prompt[None]], 2), "1-D tensor"),
        (([prompt[:0]], 2), "at least one token"),
        (([prompt], 0), "at least 1"),
    ]
    for (prompts, counts), says in bad:
        with pytest.raises(SketchcalError, match=says) as err:
            GraphDecoder(model, graphs=False).serve(prompts, counts, batch=2)
        assert "\n" not in str(err.value)
    model.set_attn_implementation("eager")
    try:
        with pytest.raises(SketchcalError, match="attn_implementation='sdpa'"):
            GraphDecoder(model, graphs=False).serve([prompt], 2, batch=1)
    finally:
        model.set_attn_implementation("sdpa")


# ---- speculative drafts: kernel states against reference states (no model) ----------------------


def grouped_inputs(fam: str, t: int, seed: int, b: int = 2, h: int = 4, g: int = 2, k: int = 16, v: int = 16):
    """Random fp32 inputs in the runtime layout whose keys and queries are shared by each group's heads."""
    gen = torch.Generator().manual_seed(seed)
    kk, q = torch.randn(b, t, g, k, generator=gen), torch.randn(b, t, g, k, generator=gen)
    rnd = torch.rand(b, t, h, generator=gen)
    vals = torch.randn(b, t, h, v, generator=gen)
    if fam == "mamba2":
        kk, q, beta = 0.3 * kk, 0.3 * q, None
        w, skip = 0.1 * vals, 0.5 * vals
    else:
        kk = torch.nn.functional.normalize(kk, dim=-1)
        q = torch.nn.functional.normalize(q, dim=-1) * k**-0.5
        beta, w, skip = 0.1 + 0.8 * rnd, (0.1 + 0.8 * rnd)[..., None] * vals, None
    dshape = (b, t, h, k) if fam == "kda" else (b, t, h)
    decay = 0.8 + 0.2 * torch.rand(dshape, generator=gen)
    rep = h // g
    x = StepInputs(kk.repeat_interleave(rep, 2), q.repeat_interleave(rep, 2), w, decay, beta, skip)
    return x.to(DEVICE)


def sketch_layer(heads: int, groups: int, key_dim: int, ranks: list[int], seed: int = 0) -> SketchLayer:
    """Random frames and rotated maps ``[I_m  Gᵀ]`` (the calibrated shape)."""
    gen = torch.Generator().manual_seed(seed)
    frame = torch.linalg.qr(torch.randn(groups, key_dim, key_dim, generator=gen))[0]
    coef = torch.zeros(heads, max(ranks), key_dim)
    for h, m in enumerate(ranks):
        coef[h, :m, :m] = torch.eye(m)
        coef[h, :m, m:] = 0.1 * torch.randn(m, key_dim - m, generator=gen)
    return SketchLayer(0, frame, coef, torch.tensor(ranks, dtype=torch.int32))


def cat_tokens(a: StepInputs, b: StepInputs) -> StepInputs:
    return StepInputs(
        **{
            n: None if getattr(a, n) is None else torch.cat([getattr(a, n), getattr(b, n)], dim=1)
            for n in ("k", "q", "w", "decay", "beta", "skip")
        }
    )


@pytest.mark.parametrize(
    ("fam", "mode", "sketch_map"),
    [("gdn", "replay", "static"), ("kda", "sketch", "static"), ("mamba2", "sketch", "adaptive"),
     ("gdn", "standard", "static")],
)  # fmt: skip
def test_adopt_makes_a_row_the_lone_sequence_mid_window(fam, mode, sketch_map):
    """A batch of two rows, ``p`` tokens into its window, adopts a lone sequence into row 1 (the
    graph decoder's slot replacement), on the reference and the kernel states alike: row 1 then
    decodes what the lone sequence decodes after ``p`` tokens that leave its state as it is (replay
    and standard: what the float64 recurrence gives from its state), row 0 what it decodes without
    the adoption."""
    h, g, k, p = 4, 2, 16, 2
    seed = {"gdn": 4, "mamba2": 5, "kda": 6}[fam]
    x_pre, x = grouped_inputs(fam, p, seed), grouped_inputs(fam, 2 * L + 1, seed + 10)
    gen = torch.Generator().manual_seed(seed)
    s0, s_lone = (0.3 * torch.randn(b, h, k, k, generator=gen).to(DEVICE) for b in (2, 1))
    layer = sketch_layer(h, g, k, [0, 4, 8, 12])
    sketch, adaptive = mode == "sketch", sketch_map == "adaptive"
    ref_tables = layer_tables(layer, family=fam, heads=h, key_dim=k, device=DEVICE) if sketch else None
    tables = kernel_tables(layer, fam, heads=h, key_dim=k, device=DEVICE) if sketch else None

    def states(s: torch.Tensor) -> tuple:
        ref = make_state(mode, fam, s, window=L, tables=ref_tables, sketch_map=sketch_map)
        kernel = make_kernel_state(
            mode, fam, s, groups=g, window=L, tables=ref_tables if adaptive else tables, adaptive=adaptive
        )
        return ref, kernel

    row1 = x.map(lambda t: t[1:2])
    exact, _ = recurrence(family(fam), row1.to(torch.float64), s_lone.double())
    for batch, control, lone in zip(states(s0), states(s0), states(s_lone), strict=True):
        batch.step(x_pre)
        control.step(x_pre)
        batch.adopt(1, lone, p)
        got, want0 = batch.step(x), control.step(x)
        assert rel_max(got[0], want0[0]) <= 1e-6
        lone_pre = x_pre.map(lambda t: t[:1])
        lone.step(identity_tokens(lone_pre, torch.zeros(lone_pre.k.shape[:2], dtype=torch.bool)))
        want1 = lone.step(row1)
        assert rel_max(got[1], want1[0]) <= 1e-5
        if not sketch:
            assert rel_max(got[1], exact[0]) <= 1e-5


@pytest.mark.parametrize(
    ("fam", "mode", "sketch_map"),
    [("gdn", "sketch", "static"), ("kda", "replay", "static"), ("mamba2", "standard", "static"),
     ("mamba2", "sketch", "adaptive")],
)  # fmt: skip
def test_drafts_and_accepts_match_the_reference_state(fam, mode, sketch_map):
    """Random drafts of 1..L tokens, some garbage after the accepted ones, crossing window ends:
    the kernel state serves what the reference state serves and ends in the same checkpoint (the
    adaptive sketch: drafts past the window end read the factors of the pool they fold into)."""
    h, g, k = 4, 2, 16
    n, seed = 3 * L, {"gdn": 1, "mamba2": 2, "kda": 3}[fam]
    x = grouped_inputs(fam, n, seed)
    s0 = 0.3 * torch.randn(2, h, k, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    layer = sketch_layer(h, g, k, [0, 4, 8, 12])
    ref_tables = (
        layer_tables(layer, family=fam, heads=h, key_dim=k, device=DEVICE) if mode == "sketch" else None
    )
    tables = kernel_tables(layer, fam, heads=h, key_dim=k, device=DEVICE) if mode == "sketch" else None
    ref = make_state(mode, fam, s0, window=L, tables=ref_tables, sketch_map=sketch_map)
    want = ref.step(x)
    adaptive = sketch_map == "adaptive"
    spec = make_kernel_state(
        mode, fam, s0, groups=g, window=L, tables=ref_tables if adaptive else tables, adaptive=adaptive
    )
    gen = torch.Generator().manual_seed(seed)
    cursor, rounds, crossed = 0, 0, 0
    while cursor < n:
        t = int(torch.randint(1, L + 1, (1,), generator=gen))
        keep = min(int(torch.randint(0, t + 1, (1,), generator=gen)), n - cursor)
        if rounds % 2:  # the kept drafts are right, the rest garbage the target rejects
            draft = cat_tokens(
                x.tokens(slice(cursor, cursor + keep)), grouped_inputs(fam, t - keep, 100 + rounds)
            )
            checked = keep
        else:  # drafts all right (as far as the sequence goes), only ``keep`` accepted
            draft = x.tokens(slice(cursor, min(cursor + t, n)))
            checked = draft.num_tokens
        crossed += mode != "standard" and spec.pos + draft.num_tokens >= L
        out = spec.draft(draft)
        assert out.shape == (2, draft.num_tokens, h, k)
        if checked:
            assert rel_max(out[:, :checked], want[:, cursor : cursor + checked]) <= 1e-5
        spec.accept(keep)
        cursor += keep
        rounds += 1
    assert rounds > 5 and (mode == "standard" or crossed > 1)
    assert rel_max(spec.state(), ref.state()) <= 1e-5
    if mode != "standard":
        assert spec.pos == ref.pos and spec.flushes == ref.flushes == n // L
        assert rel_max(spec.ckpt.state, ref.ckpt.state) <= 1e-5
    with pytest.raises(SketchcalError, match="accept"):
        spec.accept(1)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["standard", "replay", "sketch"])
@pytest.mark.parametrize("fam", FAMILIES)
def test_decode_steps_never_wait_for_the_host_gpu(fam, mode):
    """At the demo models' head dims, with the CUDA defaults (bf16 buffers, bf16 read copy and
    sketch), a step of one token launches kernels only: CUDA's sync check raises on any host wait."""
    h, g, k, v = {"gdn": (4, 2, 128, 128), "mamba2": (8, 2, 128, 64), "kda": (2, 2, 128, 128)}[fam]
    x = grouped_inputs(fam, 3 * L, 5, h=h, g=g, k=k, v=v)
    s0 = 0.3 * torch.randn(2, h, k, v, device=DEVICE)
    tables = None
    if mode == "sketch":
        ranks = [[0, 8, 16, 32][i % 4] for i in range(h)]
        tables = kernel_tables(sketch_layer(h, g, k, ranks), fam, heads=h, key_dim=k, device=DEVICE)
    st = make_kernel_state(
        mode, fam, s0, groups=g, window=L, precision=Precision(read_dtype=torch.bfloat16),
        tables=tables, buffer_dtype=torch.bfloat16,
    )  # fmt: skip
    for t in range(L):  # a window first: the kernels compile
        st.step(x.tokens(slice(t, t + 1)))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [st.step(x.tokens(slice(t, t + 1))) for t in range(L, 3 * L)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(torch.cat(outs, dim=1)).all()
    assert mode == "standard" or st.flushes == 3


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.skipif(DEVICE == "cuda", reason="the model is on the GPU")
def test_triton_on_a_cpu_without_the_interpreter_is_a_one_line_error(monkeypatch):
    model, _ = tiny_model("gdn")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SketchcalError, match="GPU or use backend='reference'") as err:
        enable(model, None, "replay", backend="triton")
    assert "\n" not in str(err.value)
    with enabled(model, None, "replay") as rt:  # auto: the reference on the CPU
        assert rt.backend == "reference"


def test_triton_refuses_what_the_kernels_do_not_run():
    model, _ = tiny_model("gdn")
    with pytest.raises(SketchcalError, match="backend must be one of"):
        enable(model, None, "replay", backend="fast")
    with pytest.raises(SketchcalError, match="shared"):
        enable(model, None, "replay", read_dtype="bf16", shared=True, backend="triton")
    with pytest.raises(SketchcalError, match="fp32"):
        enable(model, None, "replay", compute_dtype="fp64", backend="triton")
    with pytest.raises(SketchcalError, match="fp16"):
        enable(model, None, "replay", read_dtype="fp16", backend="triton")
    with pytest.raises(SketchcalError, match="buffer"):
        enable(model, None, "replay", backend="triton", buffer_dtype="fp16")
    with pytest.raises(SketchcalError, match="triton backend only"):
        enable(model, None, "replay", backend="reference", buffer_dtype="bf16")


# ---- the shipped demo models on an H200 -----------------------------------------------------------

GPU_BATCH, GPU_NEW = 64, 256


@pytest.fixture(scope="module", params=FAMILIES)
def demo(request, tmp_path_factory):
    """``builtin:tiny-<family>`` on CUDA with an artifact converted at rank 8 from a quick calibration
    (on the CPU: these tests check decoding; CUDA calibration is ``test_calibrate_gpu``'s)."""
    import sketchcal
    from sketchcal.models.loading import load_model

    name = f"builtin:tiny-{request.param}"
    root = tmp_path_factory.mktemp(f"demo-{request.param}")
    sketchcal.calibrate(
        name,
        out=root / "stats",
        samples=8,
        seq_len=96,
        batch_size=4,
        heldout_samples=4,
        heldout_windows=4,
        device="cpu",
        dtype="float32",
        progress=False,
    )
    convert(root / "stats", rank=8, out=root / "art")
    loaded = load_model(name, device="cuda", dtype="float32")
    return loaded.model, read_sketch(root / "art")


@pytest.mark.gpu
def test_demo_model_replay_on_the_kernels_gpu(demo):
    model, art = demo
    window = int(art.config["window"])
    ids = ids_for(model, GPU_BATCH, P + 6 * window, 11)
    check_replay(model, art, ids, window, new=GPU_NEW, tol=1e-4)


@pytest.mark.gpu
def test_demo_model_sketch_on_the_kernels_gpu(demo):
    model, art = demo
    window = int(art.config["window"])
    check_sketch(model, art, ids_for(model, GPU_BATCH, P + 6 * window, 12), window, kl_max=1e-4)


@pytest.mark.gpu
def test_demo_model_adaptive_sketch_on_the_kernels_gpu(demo):
    """The adaptive sketch at batch 64: the flush's factor kernel (TF32 on the tensor cores) against
    the reference backend's float64 SVD per flush."""
    model, art = demo
    window = int(art.config["window"])
    ids = ids_for(model, GPU_BATCH, P + 6 * window, 16)
    check_sketch(model, art, ids, window, kl_max=1e-4, sketch_map="adaptive")


@pytest.mark.gpu
def test_demo_model_bf16_buffers_gpu(demo):
    """The serving defaults on CUDA, bf16 buffered inputs and a bf16 read copy: the buffers' rounding
    costs far less than the sketch (both against the reference backend's bf16 read copy)."""
    model, art = demo
    window = int(art.config["window"])
    ids = ids_for(model, GPU_BATCH, P + 6 * window, 13)
    ref, _ = forward(model, ids, art, "replay", "reference", window, read_dtype="bf16")
    got, _ = forward(model, ids, art, "replay", "triton", window, read_dtype="bf16")
    sketch, _ = forward(model, ids, art, "sketch", "reference", window, read_dtype="bf16")
    kl = float(kl_per_token(ref[:, P:], got[:, P:]).mean())
    assert kl <= 1e-3 and 10 * kl < float(kl_per_token(ref[:, P:], sketch[:, P:]).mean())


@pytest.mark.gpu
def test_demo_model_public_backend_gpu(demo):
    """The public kernels at batch 64, 256 tokens: the model's own greedy tokens."""
    model, _ = demo
    public_or_skip(describe(model).family)
    check_public(model, ids_for(model, GPU_BATCH, P + 16, 15), GPU_NEW)


@pytest.mark.gpu
def test_demo_model_graph_decoder_gpu(demo):
    """CUDA graphs at batch 64, 256 tokens: replay's greedy tokens are the model's own."""
    model, art = demo
    window = int(art.config["window"])
    check_graph_decoder(model, art, ids_for(model, GPU_BATCH, P + window, 14), GPU_NEW, window)


@pytest.mark.gpu
def test_demo_model_serves_a_stream_of_prompts_gpu(demo):
    """CUDA graphs over 8 slots, 24 prompts of 4 to 40 tokens, 5 to 70 new tokens each (replacements
    at every window phase): replay's tokens are those the model's own decode gives each prompt alone
    (in the graph decoder's lock-step batches of one), sketch's those of the same slots run eagerly."""
    model, art = demo
    window = int(art.config["window"])
    gen = torch.Generator().manual_seed(17)
    lengths = torch.randint(4, 41, (24,), generator=gen).tolist()
    counts = torch.randint(5, 71, (24,), generator=gen).tolist()
    prompts = [ids_for(model, 1, n, 200 + i)[0] for i, n in enumerate(lengths)]
    alone = [
        GraphDecoder(model).generate(q[None], n)[0, q.numel() :] for q, n in zip(prompts, counts, strict=True)
    ]
    kw = dict(window=window, backend="triton")
    with enabled(model, art, "replay", **kw, **EXACT):  # fp32 buffers: replay is then exact
        assert _equal(GraphDecoder(model).serve(prompts, counts, batch=8), alone)
    with enabled(model, art, "sketch", **kw):
        graphs = GraphDecoder(model).serve(prompts, counts, batch=8)
        eager = GraphDecoder(model, graphs=False).serve(prompts, counts, batch=8)
    assert _equal(graphs, eager)
