"""Shrinkage from the sums vs scikit-learn, and the held-out evidence behind ``shrinkage="auto"``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.covariance import ledoit_wolf, oas

from sketchcal.fit.basis import coef_map, nested_frame, read_error, state_weighted_basis
from sketchcal.fit.shrinkage import shrink

f64 = torch.float64


def _states(gen, n_ckpt, k, v, half, tail):
    scale = torch.exp(tail * torch.randn(n_ckpt, 1, 1, dtype=f64, generator=gen))
    return half @ (torch.randn(n_ckpt, k, v, dtype=f64, generator=gen) * scale)


def _sums(s):
    e_sum = torch.einsum("nkv,njv->kj", s, s)
    col4 = float(((s * s).sum(1) ** 2).sum())
    return e_sum, col4


@pytest.mark.parametrize("n_ckpt,v,tail", [(3, 4, 1.0), (20, 8, 0.0), (50, 16, 0.5)])
def test_shrinkage_from_sums_matches_sklearn(n_ckpt, v, tail):
    gen = torch.Generator().manual_seed(n_ckpt)
    k = 12
    half = torch.randn(k, k, dtype=f64, generator=gen)
    s = _states(gen, n_ckpt, k, v, half, tail)
    x = s.permute(0, 2, 1).reshape(-1, k).numpy()  # the state columns as samples
    e_sum, col4 = _sums(s)
    for method, ref in (("ledoit_wolf", ledoit_wolf), ("oas", oas)):
        cov, sk = ref(x, assume_centered=True)
        e, got = shrink(e_sum, col4, n_ckpt, v, method)
        assert got == pytest.approx(sk, rel=1e-9, abs=1e-12), method
        np.testing.assert_allclose(e.numpy() / v, cov, rtol=1e-9, atol=1e-12)
    e, s0 = shrink(e_sum, col4, n_ckpt, v, "none")
    assert s0 == 0.0
    assert torch.allclose(e, e_sum / n_ckpt)


def _heldout_error(method, *, k, v, n_ckpt, cond, tail, seeds, ranks=(4, 8, 12)):
    """Mean read error (true moments) of state-weighted fits whose E comes from few sampled checkpoints."""
    out = []
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        q, _ = torch.linalg.qr(torch.randn(k, k, dtype=f64, generator=gen))
        vals = torch.logspace(0, -np.log10(cond), k, dtype=f64)
        e_true = (q * vals) @ q.T
        qc, _ = torch.linalg.qr(torch.randn(k, k, dtype=f64, generator=gen))
        c_true = (qc * torch.logspace(0, -2, k, dtype=f64)) @ qc.T
        s = _states(gen, n_ckpt, k, v, (q * vals.sqrt()) @ q.T, tail)
        e_sum, col4 = _sums(s)
        e, _ = shrink(e_sum, col4, n_ckpt, v, method)
        frame = nested_frame(state_weighted_basis(e, c_true)[0])
        out.append(np.mean([read_error(frame, coef_map(frame, e, m), e_true, c_true) for m in ranks]))
    return float(np.mean(out))


def test_shrinkage_helps_when_E_is_undersampled():
    # 16 heavy-tailed state columns for K = 32, mildly anisotropic truth
    kw = dict(k=32, v=4, n_ckpt=4, cond=10.0, tail=1.0, seeds=8)
    lw, oa, none = (_heldout_error(m, **kw) for m in ("ledoit_wolf", "oas", "none"))
    assert lw < 0.9 * none
    assert lw < oa  # heavy tails: the distribution-free estimate shrinks enough, the Gaussian one does not


def test_shrinkage_hurts_when_E_is_well_sampled_and_anisotropic():
    # why convert chooses the estimator on held-out error instead of always shrinking
    kw = dict(k=32, v=32, n_ckpt=64, cond=1e3, tail=1.0, seeds=4)
    assert _heldout_error("none", **kw) < _heldout_error("ledoit_wolf", **kw)
