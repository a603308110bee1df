"""The runtime inside transformers models: every architecture, generate() and teacher forcing.

References: ``standard`` mode (the model's own prefill and one-token functions), the plain model,
and the shared float64 recurrence run on the inputs a :class:`~sketchcal.models.MixerTap` captures.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from helpers import ALL_MODEL_TYPES, build_tiny

from sketchcal.artifact.sketch import SketchArtifact, SketchLayer
from sketchcal.errors import SketchcalError
from sketchcal.kernels.common import family, recurrence
from sketchcal.models import MixerTap, describe, use_torch_path
from sketchcal.models.loading import BUILTIN_MODELS
from sketchcal.runtime import disable, enable, enabled, runtime_of
from sketchcal.verify.metrics import ReadErrorMeter, kl_per_token

P, L = 6, 4  # prefill tokens, window
FAMILY_MODELS = {f: BUILTIN_MODELS[f"tiny-{f}"] for f in ("gdn", "mamba2", "kda")}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def tiny(model_type: str, seed: int = 0):
    model = build_tiny(model_type, seed)
    spec = describe(model)
    use_torch_path(spec)
    return model, spec


def synthetic_artifact(
    spec, rank: int | None, window: int = L, seed: int = 0, dense_head: bool = False
) -> SketchArtifact:
    """Random orthogonal frames and projection maps ``[I_m 0]``; rank None = every head at full rank K
    (exact), else every head at ``rank``, except head 0 dense with ``dense_head``."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for s in spec.layers:
        q = torch.linalg.qr(torch.randn(s.groups, s.key_dim, s.key_dim, generator=gen))[0]
        ranks = [s.key_dim] * s.heads if rank is None else [rank] * s.heads
        if dense_head:
            ranks[0] = 0
        coef = torch.zeros(s.heads, max(ranks), s.key_dim)
        for h, m in enumerate(ranks):
            coef[h, :m, :m] = torch.eye(m)
        layers.append(SketchLayer(s.layer, q, coef, torch.tensor(ranks, dtype=torch.int32)))
    meta = {"fingerprint": spec.fingerprint, "window": str(window)}
    return SketchArtifact({"family": spec.family, "window": window}, meta, layers)


class MixerOutputs:
    """Forward hooks recording every mixer's output, per layer."""

    def __init__(self, model, spec):
        self.out: dict[int, torch.Tensor] = {}
        self.handles = [
            m.register_forward_hook(lambda mod, a, o: self.out.__setitem__(mod.layer_idx, o.detach().clone()))
            for m in spec.mixers(model)
        ]

    def close(self):
        for h in self.handles:
            h.remove()


class FlushLog:
    wants_exact = False

    def __init__(self):
        self.checkpoints: dict[int, list[torch.Tensor]] = {}

    def on_read(self, layer, positions, approx, exact) -> None:
        return None

    def on_flush(self, layer, checkpoint) -> None:
        self.checkpoints.setdefault(layer, []).append(checkpoint.clone())


def forward(model, spec, ids, *args, **kw):
    """Logits and mixer outputs of a teacher-forced forward in the given mode."""
    rec = MixerOutputs(model, spec)
    try:
        with torch.no_grad(), enabled(model, *args, prefill=P, window=L, **kw):
            logits = model(ids, use_cache=False).logits
    finally:
        rec.close()
    return logits, rec.out


@pytest.mark.parametrize("model_type", ALL_MODEL_TYPES)
def test_every_architecture_runs_all_modes(model_type):
    model, spec = tiny(model_type)
    ids = torch.randint(3, 2000, (2, P + 5 * L + 2), generator=torch.Generator().manual_seed(1))
    std, std_mix = forward(model, spec, ids, None, "standard")
    rep, rep_mix = forward(model, spec, ids, None, "replay")
    full, full_mix = forward(model, spec, ids, synthetic_artifact(spec, None), "sketch")
    meter = ReadErrorMeter(L)
    low, _ = forward(model, spec, ids, synthetic_artifact(spec, 2), "sketch", probe=meter)
    for layer in std_mix:
        assert rel(rep_mix[layer], std_mix[layer]) <= 1e-5, layer
        assert rel(full_mix[layer], rep_mix[layer]) <= 1e-5, layer
    assert rel(rep, std) <= 1e-5 and rel(full, rep) <= 1e-5
    assert min(meter.per_layer().values()) > 1e-6  # low-rank reads really come from the sketch
    assert not torch.equal(low, rep)
    # generate(): replay and full-rank sketch decode the same tokens as the plain model
    prompt = ids[:, :7]
    kw = {"max_new_tokens": 3 * L + 2, "do_sample": False, "pad_token_id": 0}
    plain = model.generate(prompt, **kw)
    with enabled(model, None, "replay", window=L):
        assert torch.equal(model.generate(prompt, **kw), plain)
    with enabled(model, synthetic_artifact(spec, None), "sketch"):
        assert torch.equal(model.generate(prompt, **kw), plain)
    assert runtime_of(model) is None


@pytest.fixture(scope="module", params=list(FAMILY_MODELS))
def fam_model(request):
    model, spec = tiny(FAMILY_MODELS[request.param])
    for mixer in spec.mixers(model):
        if hasattr(mixer, "time_step_limit"):
            # Mamba-2's prefill floors dt at time_step_min, its one-token function does not; decode
            # steps follow the latter. Without the floor, the prefill inputs a MixerTap reports are
            # exactly what the decode steps see.
            mixer.time_step_limit = (0.0, float("inf"))
    return request.param, model, spec


def test_replay_flush_states_equal_float64_recurrence(fam_model):
    fam, model, spec = fam_model
    ids = torch.randint(3, 2000, (2, P + 6 * L + 1), generator=torch.Generator().manual_seed(2))
    calls, log = {}, FlushLog()
    tap = MixerTap(model, spec, lambda c: calls.__setitem__(c.layer, c))  # this run's own inputs
    with torch.no_grad(), enabled(model, None, "replay", prefill=P, window=L, probe=log), tap:
        model(ids, use_cache=False)
    for shape in spec.layers:
        x = calls[shape.layer].inputs
        assert len(log.checkpoints[shape.layer]) == 6
        for j, ckpt in enumerate(log.checkpoints[shape.layer]):
            _, want = recurrence(family(fam), x.tokens(slice(0, P + (j + 1) * L)))  # float64 from zeros
            assert rel(ckpt, want) <= 1e-5, (shape.layer, j)


def test_sketch_checkpoints_are_bit_identical_to_replay(fam_model):
    _, model, spec = fam_model
    ids = torch.randint(3, 2000, (2, P + 5 * L), generator=torch.Generator().manual_seed(3))
    logs = FlushLog(), FlushLog()
    rep, _ = forward(model, spec, ids, None, "replay", probe=logs[0])
    low, _ = forward(model, spec, ids, synthetic_artifact(spec, 2), "sketch", probe=logs[1])
    first = spec.layers[0].layer  # its inputs do not depend on earlier approximate reads
    assert len(logs[1].checkpoints[first]) == 5
    for a, b in zip(logs[0].checkpoints[first], logs[1].checkpoints[first], strict=True):
        assert torch.equal(a, b)
    assert rel(low, rep) > 1e-7


def test_generate_keeps_the_checkpoint_in_the_cache(fam_model):
    fam, model, spec = fam_model
    prompt = torch.randint(3, 2000, (2, 5), generator=torch.Generator().manual_seed(4))
    new = 2 * L + 3  # generate feeds new − 1 tokens as decode steps
    with enabled(model, synthetic_artifact(spec, 2), "sketch") as rt:
        out = model.generate(
            prompt, max_new_tokens=new, do_sample=False, pad_token_id=0, return_dict_in_generate=True
        )
        cache = out.past_key_values
        states = rt.states(cache)
    value_major = fam == "mamba2"
    for shape in spec.layers:
        st = states[shape.layer]
        assert st.flushes == (new - 1) // L and st.pos == (new - 1) % L
        cached = cache.get_recurrent_state(shape.layer)
        assert torch.equal(cached.transpose(-1, -2) if value_major else cached, st.ckpt.state)


def test_shared_low_precision_gives_higher_kl_than_two_precisions(fam_model):
    fam = fam_model[0]
    model, spec = tiny(FAMILY_MODELS[fam])  # a copy with long memory (real models decay slowly)
    with torch.no_grad():
        for mixer in spec.mixers(model):
            for name, p in mixer.named_parameters():
                if name.endswith("A_log"):
                    p.fill_(math.log(0.02))
                if fam == "mamba2" and name == "D":
                    p.zero_()  # the state read, not the skip, should carry the mixer output
                if fam == "mamba2" and name == "out_proj.weight":
                    p.mul_(30)
    ids = torch.randint(3, 2000, (2, 16 + 320), generator=torch.Generator().manual_seed(5))
    kl = {}
    with torch.no_grad():
        with enabled(model, None, "standard", prefill=16):
            ref = model(ids, use_cache=False).logits[:, 16:]
        for shared in (False, True):
            with enabled(model, None, "replay", prefill=16, window=16, read_dtype="bf16", shared=shared):
                kl[shared] = float(kl_per_token(ref, model(ids, use_cache=False).logits[:, 16:]).mean())
    assert kl[True] > 1.2 * kl[False] > 0


def test_enable_checks_and_restores():
    model, spec = tiny("qwen3_5_text")
    other, _ = tiny("qwen3_5_text", seed=1)
    module = importlib.import_module(spec.arch.module)
    before = getattr(module, spec.adapter.decode_fn)
    with pytest.raises(SketchcalError, match="sketch mode needs"):
        enable(model, None, "sketch")
    with pytest.raises(SketchcalError, match="mode must be"):
        enable(model, None, "fast")
    wrong = synthetic_artifact(describe(build_tiny("kimi_linear")), 2)
    with pytest.raises(SketchcalError, match="another model"):
        enable(model, wrong, "sketch")
    with pytest.raises(SketchcalError, match="standard mode"):
        enable(model, None, "standard", read_dtype="bf16")
    ids = torch.randint(3, 2000, (1, 20))
    with torch.no_grad():
        plain_other = other(ids, use_cache=False).logits
        rt = enable(model, synthetic_artifact(spec, 2), "sketch", prefill=4)
        assert getattr(module, spec.adapter.decode_fn) is not before
        assert torch.equal(other(ids, use_cache=False).logits, plain_other)  # other models pass through
        enable(model, None, "replay")  # replaces the first runtime
        assert not rt.active
        disable(model)
    assert getattr(module, spec.adapter.decode_fn) is before and runtime_of(model) is None
