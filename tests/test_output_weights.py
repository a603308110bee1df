"""The output weights' target draws, and their fallback when a kernel library's backward fails."""

import importlib
import types

import pytest
import torch

import sketchcal
from sketchcal.calibrate.fisher import draw_targets
from sketchcal.formats.stats import load_stats_tensors
from sketchcal.models import capture, loading
from sketchcal.models.loading import load_model

SMALL = dict(samples=4, seq_len=64, batch_size=2, heldout_samples=0, progress=False, device="cpu")


def test_draws_follow_the_distribution_and_skip_impossible_ids():
    probs = torch.tensor([0.1, 0.0, 0.25, 0.05, 0.0, 0.4, 0.2], dtype=torch.float64)
    n = 200_000
    logp = probs.log().expand(n, -1)
    y = draw_targets(logp, torch.Generator().manual_seed(0))
    freq = torch.bincount(y, minlength=probs.numel()).double() / n
    assert freq[probs == 0].sum() == 0
    # binomial standard deviation at p = 0.4 and 200k draws is about 0.0011
    assert (freq - probs).abs().max() < 0.006


def test_draws_depend_on_the_seed_alone():
    """The uniforms come from the CPU generator and the CDF is float64: float32 and float64 inputs
    (as on two devices) give the same ids; another seed gives others."""
    logits = torch.randn(3, 40, 500, generator=torch.Generator().manual_seed(1))
    logp = torch.log_softmax(logits, -1)
    a = draw_targets(logp, torch.Generator().manual_seed(7))
    b = draw_targets(logp.double(), torch.Generator().manual_seed(7))
    c = draw_targets(logp, torch.Generator().manual_seed(8))
    assert a.shape == (3, 40)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_a_broken_row_is_drawn_uniformly():
    logp = torch.full((4000, 9), float("nan"))
    y = draw_targets(logp, torch.Generator().manual_seed(0))
    assert y.min() >= 0 and y.max() <= 8
    assert torch.bincount(y, minlength=9).min() > 300  # about 444 each


def _broken_kernel(monkeypatch, model: str, package: str) -> None:
    """Bind the mixers' prefill function to one defined in a module of ``package`` whose backward
    raises, and take it as a GPU would (the bound function, not the torch reference)."""
    spec = load_model(model, device="cpu").spec
    modeling = importlib.import_module(spec.arch.module)
    name = spec.adapter.prefill_fn
    fake = types.ModuleType(f"{package}.ops.fake")
    exec(
        "import torch\n"
        "class _Broken(torch.autograd.Function):\n"
        "    @staticmethod\n"
        "    def forward(ctx, x):\n"
        "        return x.view_as(x)\n"
        "    @staticmethod\n"
        "    def backward(ctx, g):\n"
        "        raise RuntimeError('this backward gives wrong results on this GPU')\n"
        "def kernel(*args, **kwargs):\n"
        "    out = kernel.__wrapped__(*args, **kwargs)\n"
        "    return (_Broken.apply(out[0]), *out[1:]) if isinstance(out, tuple) else _Broken.apply(out)\n",
        fake.__dict__,
    )
    fake.kernel.__wrapped__ = capture.torch_reference(getattr(modeling, name))
    monkeypatch.setattr(modeling, name, fake.kernel)
    monkeypatch.setattr(capture, "pick_implementation", lambda original, reference, args: original)
    monkeypatch.setattr(loading, "use_torch_path", lambda spec: None)  # what loading does on a CPU


@pytest.mark.parametrize("model", ["builtin:tiny-gdn", "builtin:tiny-kda"])
def test_a_failing_kernel_backward_falls_back_to_the_torch_references(tmp_path, monkeypatch, capsys, model):
    """The statistics equal those of a run on the torch references: the batch whose backward
    failed is redrawn from the same generator state, and the switch holds for later batches."""
    sketchcal.calibrate(model, out=tmp_path / "ref", **SMALL)
    want = load_stats_tensors(tmp_path / "ref")[1]
    capsys.readouterr()
    _broken_kernel(monkeypatch, model, "fla")
    sketchcal.calibrate(model, out=tmp_path / "fallback", **SMALL)
    got = load_stats_tensors(tmp_path / "fallback")[1]
    assert capsys.readouterr().err.count("kernel's backward failed") == 1  # 2 batches, one switch
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_a_failure_outside_the_kernel_packages_is_raised(tmp_path, monkeypatch):
    _broken_kernel(monkeypatch, "builtin:tiny-gdn", "somewhere_else")
    with pytest.raises(RuntimeError, match="wrong results on this GPU"):
        sketchcal.calibrate("builtin:tiny-gdn", out=tmp_path / "s", **SMALL)
    assert not (tmp_path / "s" / "stats.safetensors").exists()


def test_draws_do_not_depend_on_the_cdf_slices(monkeypatch):
    from sketchcal.calibrate import fisher

    logp = torch.log_softmax(torch.randn(5, 33, 300, generator=torch.Generator().manual_seed(2)), -1)
    whole = draw_targets(logp, torch.Generator().manual_seed(3))
    monkeypatch.setattr(fisher, "_CDF_ELEMENTS", 7 * 300)  # 7 rows per slice, the last one short
    assert torch.equal(draw_targets(logp, torch.Generator().manual_seed(3)), whole)
