"""Streaming window statistics equal a brute-force float64 computation.

The brute force materialises every transition matrix, keeps the explicit state at every window
start, and multiplies the transitions out for every effective query.
"""

import pytest
import torch
from helpers import ALL_MODEL_TYPES, build_tiny

from sketchcal.calibrate.stats import LayerStats
from sketchcal.kernels.common import StepInputs, family
from sketchcal.models import LayerShape


def random_inputs(fam: str, b: int, t: int, h: int, k: int, v: int, seed: int) -> StepInputs:
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    kk = torch.nn.functional.normalize(torch.randn(b, t, h, k, generator=g, dtype=f64), dim=-1)
    q = torch.randn(b, t, h, k, generator=g, dtype=f64) / k**0.5
    w = torch.randn(b, t, h, v, generator=g, dtype=f64)
    shape = (b, t, h, k) if fam == "kda" else (b, t, h)
    decay = 0.7 + 0.3 * torch.rand(shape, generator=g, dtype=f64)
    beta = None if fam == "mamba2" else torch.rand(b, t, h, generator=g, dtype=f64)
    return StepInputs(k=kk, q=q, w=w, decay=decay, beta=beta)


def brute_force(fam_name, x: StepInputs, valid, prompt_end, window):
    fam = family(fam_name)
    b, t = valid.shape
    h, kd, vd = x.num_heads, x.key_dim, x.value_dim
    E = torch.zeros(h, kd, kd, dtype=torch.float64)
    C = torch.zeros_like(E)
    energy = torch.zeros(h, dtype=torch.float64)
    n_ck = n_reads = 0
    eye = torch.eye(kd, dtype=torch.float64)
    for row in range(b):
        mats, states = [], [torch.zeros(h, kd, vd, dtype=torch.float64)]
        for i in range(t):
            xi = x.tokens(i).map(lambda f, r=row: f[r])
            if valid[row, i]:
                a = fam.matrix(xi.k, xi.decay, xi.beta)
                upd = xi.k[..., :, None] * xi.w[..., None, :]
            else:
                a, upd = eye.expand(h, kd, kd), torch.zeros(h, kd, vd, dtype=torch.float64)
            mats.append(a)
            states.append(a @ states[-1] + upd)  # states[i + 1] = state after token i
        for c in range(prompt_end, t, window):  # checkpoint = state after c tokens
            reads = [i for i in range(c, min(c + window - 1, t)) if valid[row, i]]
            if not reads:  # a checkpoint counts when at least one read follows it
                continue
            s_c = states[c]
            E += s_c @ s_c.transpose(-1, -2)
            n_ck += 1
            m = eye.expand(h, kd, kd)
            for p in range(1, window):
                i = c + p - 1
                if i >= t:
                    break
                m = mats[i] @ m  # M_p = A_i ⋯ A_c
                if not valid[row, i]:
                    continue
                u = (m.transpose(-1, -2) @ x.q[row, i][..., None]).squeeze(-1)
                C += u[:, :, None] * u[:, None, :]
                energy += ((s_c.transpose(-1, -2) @ u[..., None]) ** 2).sum((-1, -2))
                n_reads += 1
    return E, C, energy, n_ck, n_reads


@pytest.mark.parametrize("fam_name", ["mamba2", "gdn", "kda"])
@pytest.mark.parametrize("prompt_end", [0, 5, 16])
def test_streaming_stats_equal_brute_force(fam_name, prompt_end):
    b, t, h, kd, vd, window = 3, 53, 2, 6, 5, 8
    x = random_inputs(fam_name, b, t, h, kd, vd, seed=prompt_end)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :3] = False  # left padding
    valid[2, 40:] = False  # tokens after an end-of-sequence
    stats = LayerStats(LayerShape(0, h, 1, kd, vd), window)
    stats.update(family(fam_name), x, valid, prompt_end)
    got = stats.take_sums()
    E, C, energy, n_ck, n_reads = brute_force(fam_name, x, valid, prompt_end, window)
    for name, ref in (("E", E), ("C", C), ("read_energy", energy)):
        err = ((got[name] - ref).norm() / ref.norm()).item()
        assert err <= 1e-6, f"{name}: {err:.2e}"
    assert got["n_checkpoints"].item() == n_ck
    assert got["n_reads"].item() == n_reads


def test_brute_force_sees_a_wrong_window_alignment():
    """Misaligning windows by one token changes E: the comparison above is sensitive to it."""
    x = random_inputs("gdn", 2, 40, 2, 6, 5, seed=3)
    valid = torch.ones(2, 40, dtype=torch.bool)
    stats = LayerStats(LayerShape(0, 2, 1, 6, 5), 8)
    stats.update(family("gdn"), x, valid, 9)
    E, *_ = brute_force("gdn", x, valid, 8, 8)
    assert ((stats.take_sums()["E"] - E).norm() / E.norm()).item() > 1e-3


def test_kept_windows_match_sums():
    x = random_inputs("kda", 2, 48, 2, 4, 3, seed=7)
    valid = torch.ones(2, 48, dtype=torch.bool)
    stats = LayerStats(LayerShape(0, 2, 2, 4, 3), 8, keep_windows=100)
    stats.update(family("kda"), x, valid, 8)
    kept = stats.kept_windows()
    sums = stats.take_sums()
    s = kept["windows.S"].double()
    assert s.shape[0] == sums["n_checkpoints"].item() == 10
    E = torch.einsum("rhkv,rhlv->hkl", s, s)
    assert ((E - sums["E"]).norm() / E.norm()).item() < 1e-6
    u, mask = kept["windows.u"].double(), kept["windows.mask"].double()
    C = torch.einsum("rphk,rphl,rp->hkl", u, u, mask)
    assert ((C - sums["C"]).norm() / C.norm()).item() < 1e-6


@pytest.mark.parametrize("fam_name", ["gdn", "kda"])
def test_starting_from_the_prompt_state_equals_scanning_the_prompt(fam_name):
    from sketchcal.kernels.common import recurrence

    b, t, h, kd, vd, window, prompt = 2, 45, 2, 5, 4, 8, 13
    x = random_inputs(fam_name, b, t, h, kd, vd, seed=11)
    valid = torch.ones(b, t, dtype=torch.bool)
    full = LayerStats(LayerShape(0, h, 1, kd, vd), window)
    full.update(family(fam_name), x, valid, prompt)
    _, s_prompt = recurrence(family(fam_name), x.tokens(slice(0, prompt)))
    cont = LayerStats(LayerShape(0, h, 1, kd, vd), window)
    cont.update(family(fam_name), x.tokens(slice(prompt, t)), valid[:, prompt:], 0, initial_state=s_prompt)
    a, c = full.take_sums(), cont.take_sums()
    for name in a:
        assert torch.allclose(a[name].double(), c[name].double(), rtol=1e-10, atol=0), name


@pytest.mark.parametrize("model", ["builtin:tiny-gdn", "builtin:tiny-mamba2", "builtin:tiny-kda"])
def test_calibrate_prefill_state_matches_a_float64_prompt_scan(tmp_path, model):
    """With a prompt (``prompt_len``; the default, 0, has none and no prefill), calibrate takes the
    first checkpoint from the model's own (float32, chunked) prefill; a float64 scan of the prompt
    through the tapped full forward gives the same statistics, γ-weighted ones included."""
    import sketchcal
    from sketchcal.calibrate.fisher import output_weights
    from sketchcal.data import build_samples
    from sketchcal.formats.stats import load_stats_tensors
    from sketchcal.models import MixerTap
    from sketchcal.models.loading import load_model

    sketchcal.calibrate(model, out=tmp_path / "s", samples=4, seq_len=96, prompt_len=48, heldout_samples=0,
                        device="cpu", progress=False, batch_size=4, window=8)  # fmt: skip
    got = load_stats_tensors(tmp_path / "s")[1]

    loaded = load_model(model, device="cpu")
    ids = torch.tensor(build_samples(loaded.tokenizer, None, num_samples=4, seq_len=96).calib)
    ref = {s.layer: LayerStats(s, 8) for s in loaded.spec.layers}
    fam = family(loaded.spec.family)
    valid = torch.ones_like(ids, dtype=torch.bool)
    # the run's one calibration batch (index 0, seed 0) draws its targets from this generator
    gamma = output_weights(loaded.model, loaded.spec, ids, valid, 48, torch.Generator().manual_seed(0))
    with (
        torch.no_grad(),
        MixerTap(
            loaded.model,
            loaded.spec,
            lambda c: ref[c.layer].update(fam, c.inputs, valid, 48, gamma=gamma[c.layer]),
            step_dynamics=True,
        ),
    ):
        loaded.model(ids)
    for layer, st in ref.items():
        for name, t in st.take_sums().items():
            g = got[f"layers.{layer}.calib.{name}"]
            if t.is_floating_point():
                assert ((g - t).norm() / t.norm()).item() < 1e-5, (layer, name)
            else:
                assert torch.equal(g, t), (layer, name)


@pytest.mark.parametrize("model_type", ALL_MODEL_TYPES)
def test_tapped_forward_starts_from_the_models_prefill_state(model_type):
    """For every architecture: the decoded part is tapped from the cached prefill state, and that
    state equals a float64 scan of the prompt's own tapped inputs."""
    from sketchcal.calibrate.run import tapped_forward
    from sketchcal.kernels.common import recurrence
    from sketchcal.models import MixerTap, describe

    model = build_tiny(model_type)
    spec = describe(model)
    fam = family(spec.family)
    ids = torch.randint(1, 2000, (2, 40), generator=torch.Generator().manual_seed(2))
    valid = torch.ones_like(ids, dtype=torch.bool)
    prompt_calls, decode_calls = {}, {}
    with torch.no_grad():
        with MixerTap(model, spec, lambda c: prompt_calls.setdefault(c.layer, c)):
            model(ids[:, :24])
        tapped_forward(
            model, spec, ids, valid, 24, lambda c, v, start: decode_calls.setdefault(c.layer, (c, v, start))
        )
    assert sorted(decode_calls) == [s.layer for s in spec.layers]
    for layer, (call, fed_valid, start) in decode_calls.items():
        assert start == 0 and fed_valid.shape == (2, 16) and call.inputs.num_tokens == 16
        assert call.initial_state is not None, f"{model_type}: no prefill state"
        _, ref = recurrence(fam, prompt_calls[layer].inputs)
        err = ((call.initial_state - ref).norm() / ref.norm()).item()
        assert err < 1e-4, f"{model_type} layer {layer}: prefill state differs by {err:.1e}"
