"""The adapters' per-token tensors reproduce each mixer's own output.

For every architecture: run the model (chunked prefill crossing the chunk size, then decode
steps of generate()), record every mixer call, rebuild the state from the recorded k, q, w,
decay, beta in float64 with the shared reference recurrence, and read it.
"""

from collections import defaultdict

import pytest
import torch
from helpers import ALL_MODEL_TYPES, build_tiny

from sketchcal.errors import SketchcalError
from sketchcal.kernels.common import family, recurrence
from sketchcal.models import MixerTap, describe


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("model_type", ALL_MODEL_TYPES)
def test_rebuilt_state_reproduces_mixer_output(model_type):
    model = build_tiny(model_type)
    spec = describe(model)
    calls = defaultdict(list)
    # 80 prompt tokens cross both the Mamba-2 chunk (16) and the GDN/KDA chunk (64).
    ids = torch.randint(
        1, model.config.get_text_config().vocab_size, (2, 80), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad(), MixerTap(model, spec, lambda c: calls[c.layer].append(c), record_outputs=True):
        model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False
        )

    assert sorted(calls) == [s.layer for s in spec.layers]
    fam = family(spec.family)
    for layer, layer_calls in calls.items():
        kinds = [c.kind for c in layer_calls]
        assert kinds == ["prefill"] + ["decode"] * 5, kinds  # the 6th token needs no forward
        state = None
        for call in layer_calls:
            out, state = recurrence(fam, call.inputs, state)
            tol = 1e-4 if call.kind == "prefill" else 1e-5
            err = _rel(out, call.output)
            assert err <= tol, f"{model_type} layer {layer} {call.kind}: rel err {err:.2e}"
            assert torch.isfinite(out).all()


def test_rebuild_detects_a_wrong_transition():
    """The check above can fail: dropping the decay breaks the reproduction."""
    model = build_tiny("qwen3_next")
    spec = describe(model)
    calls = []
    ids = torch.randint(1, 2000, (1, 70))
    with torch.no_grad(), MixerTap(model, spec, calls.append, record_outputs=True):
        model(ids)
    call = calls[0]
    bad = call.inputs.map(lambda t: t)
    bad.decay = torch.ones_like(bad.decay)
    out, _ = recurrence(family("gdn"), bad)
    assert _rel(out, call.output) > 1e-2


def test_layer_shapes_and_groups():
    spec = describe(build_tiny("qwen3_next"))
    assert spec.family == "gdn"
    assert [(s.layer, s.heads, s.groups, s.key_dim, s.value_dim) for s in spec.layers] == [
        (0, 4, 2, 16, 16),
        (2, 4, 2, 16, 16),
    ]
    spec = describe(build_tiny("nemotron_h"))
    assert spec.family == "mamba2" and [s.layer for s in spec.layers] == [0, 3]
    assert (
        spec.layers[0].heads,
        spec.layers[0].groups,
        spec.layers[0].key_dim,
        spec.layers[0].value_dim,
    ) == (
        8,
        2,
        16,
        16,
    )


def test_unknown_architecture_lists_supported():
    import transformers as tf

    model = tf.LlamaForCausalLM(
        tf.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
        )
    )
    with pytest.raises(SketchcalError, match=r"unsupported architecture 'llama'.*GDN: .*qwen3_next") as err:
        describe(model)
    assert "\n" not in str(err.value)


def test_model_without_recurrent_layers():
    import transformers as tf

    from sketchcal.models.tiny import tiny_config

    cfg = tiny_config("qwen3_next")
    cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(SketchcalError, match="no linear-attention or Mamba-2 layers"):
        describe(model)


def test_cpu_runs_the_torch_path_even_with_gpu_kernels_bound(monkeypatch):
    """transformers binds fla / causal-conv1d kernels at import when installed; on the CPU they must
    never run. Simulate the binding with kernels that fail, as the real ones do without a GPU."""
    import importlib

    from sketchcal.models.capture import torch_reference
    from sketchcal.models.loading import load_model

    module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    names = ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn"]
    names.append("causal_conv1d_update")
    for name in names:

        def gpu_only(*args, **kwargs):
            raise RuntimeError("a GPU kernel ran on the CPU")

        gpu_only.__wrapped__ = torch_reference(getattr(module, name))
        monkeypatch.setattr(module, name, gpu_only)

    loaded = load_model("builtin:tiny-gdn", device="cpu")
    ids = torch.randint(1, 2000, (1, 20))
    with torch.no_grad():
        loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
        calls = []
        with MixerTap(loaded.model, loaded.spec, calls.append):
            loaded.model(ids)
    assert len(calls) == len(loaded.spec.layers)


def test_builtin_prefers_shipped_trained_weights(tmp_path, monkeypatch):
    import transformers as tf

    from sketchcal.models import loading
    from sketchcal.models.tiny import tiny_config

    trained = tmp_path / "tiny-kda"
    tok = tf.AutoTokenizer.from_pretrained(loading.ASSETS / "tokenizer")
    torch.manual_seed(123)
    tf.AutoModelForCausalLM.from_config(tiny_config("kimi_linear", vocab_size=len(tok))).save_pretrained(
        trained
    )
    tok.save_pretrained(trained)
    monkeypatch.setattr(loading, "TRAINED_MODELS", tmp_path)

    shipped = loading.load_model("builtin:tiny-kda", device="cpu")
    random = loading.load_model("builtin:random-tiny-kda", device="cpu")
    saved = tf.AutoModelForCausalLM.from_pretrained(trained)
    for (name, p), q in zip(shipped.model.state_dict().items(), saved.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert shipped.revision.startswith("sha256:") and random.revision is None
    assert not torch.equal(next(random.model.parameters()), next(shipped.model.parameters()))
    # without shipped weights both names give the same random stand-in
    monkeypatch.setattr(loading, "TRAINED_MODELS", tmp_path / "none")
    a = loading.load_model("builtin:tiny-kda", device="cpu").model.state_dict()
    assert all(torch.equal(a[k], v) for k, v in random.model.state_dict().items())
