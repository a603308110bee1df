"""The adaptive sketch: per-state maps made at each flush from the offline bases.

References: least squares by ``torch.linalg.lstsq`` / ``pinv`` in float64 (the adaptive read is the
exact read projected onto span(Sᵀ B)), the float64 recurrence, and replay.
"""

from __future__ import annotations

import pytest
import torch
from test_runtime_model import FAMILY_MODELS, forward, rel, synthetic_artifact, tiny
from test_runtime_state import EXACT, FAMILIES, H, K, L, make_inputs, random_state, sketch_layer

from sketchcal.errors import SketchcalError
from sketchcal.fit.curves import measured_adaptive_curve
from sketchcal.fit.traffic import TrafficModel, adaptive_ranks
from sketchcal.kernels.common import family
from sketchcal.kernels.common.reference import adaptive_factor, adaptive_read
from sketchcal.runtime import WindowState, enable, layer_tables, make_state

F64 = torch.float64


def basis_rows(ranks: list[int], k: int, seed: int = 0) -> torch.Tensor:
    """[H, M, K]: each head's first m rows of a random orthogonal frame, zero past m."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.zeros(len(ranks), max(1, max(ranks)), k, dtype=F64)
    for h, m in enumerate(ranks):
        q, _ = torch.linalg.qr(torch.randn(k, k, generator=g, dtype=F64))
        rows[h, :m] = q.T[:m]
    return rows


def projected_read(s: torch.Tensor, rows: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sᵀu projected onto span(Sᵀ Bᵀ) by least squares; s [K, V], rows [m, K], u [P, K] → [P, V]."""
    a = s.T @ rows.T  # [V, m]
    y = s.T @ u.T  # [V, P]
    if rows.shape[0] == 0:
        return torch.zeros_like(y.T)
    return (a @ torch.linalg.lstsq(a, y, driver="gelsd").solution).T


def test_adaptive_read_is_the_least_squares_projection_of_the_exact_read():
    ranks, k, v = [5, 3, 0, 1], 16, 8
    rows = basis_rows(ranks, k)
    s = torch.randn(2, len(ranks), k, v, dtype=F64, generator=torch.Generator().manual_seed(1))
    u = torch.randn(2, 3, len(ranks), k, dtype=F64, generator=torch.Generator().manual_seed(2))
    q, p = adaptive_factor(rows, s)
    got = adaptive_read(q, p, u)
    for b in range(2):
        for h, m in enumerate(ranks):
            want = projected_read(s[b, h], rows[h, :m], u[b, :, h])
            assert (got[b, :, h] - want).abs().max() <= 1e-12 * max(1.0, want.abs().max())
            if m:  # Q has orthonormal columns (zero past the rank), P_S = Qᵀ Sᵀ
                assert torch.allclose(q[b, h, :, :m].T @ q[b, h, :, :m], torch.eye(m, dtype=F64), atol=1e-12)
                assert torch.allclose(p[b, h], q[b, h].T @ s[b, h].T, atol=1e-12)
            assert q[b, h, :, m:].abs().max() == 0 if m < q.shape[-1] else True
    # not a silent exact read: a low-rank projection loses part of Sᵀu
    exact = torch.einsum("bhkv,bphk->bphv", s, u)
    assert rel(got[:, :, :2], exact[:, :, :2]) > 0.1


def test_rank_deficient_and_full_rank_cases():
    k, v = 12, 6
    g = torch.Generator().manual_seed(3)
    # a rank-2 state: Sᵀ B has rank ≤ 2 whatever the basis rank (5): the projection onto its span
    low = torch.randn(k, 2, dtype=F64, generator=g) @ torch.randn(2, v, dtype=F64, generator=g)
    # r ≥ V: span(Sᵀ B) is all of R^V for a generic state, so the read is exact
    full = torch.randn(k, v, dtype=F64, generator=g)
    s = torch.stack([low, full])[None]  # [1, 2, K, V]
    rows = basis_rows([5, 8], k, seed=4)
    u = torch.randn(1, 4, 2, k, dtype=F64, generator=g)
    q, p = adaptive_factor(rows, s)
    got = adaptive_read(q, p, u)
    a = low.T @ rows[0, :5].T
    want_low = (a @ torch.linalg.pinv(a) @ (low.T @ u[0, :, 0].T)).T
    assert torch.linalg.matrix_rank(a) == 2
    assert (got[0, :, 0] - want_low).abs().max() <= 1e-10
    assert (got[0, :, 1] - u[0, :, 1] @ full).abs().max() <= 1e-10
    assert torch.isfinite(q).all() and torch.isfinite(p).all()
    # the zero state: no direction at all, a zero read (no NaN from the empty Gram)
    q0, p0 = adaptive_factor(rows, torch.zeros_like(s))
    assert adaptive_read(q0, p0, u).abs().max() == 0


@pytest.mark.parametrize("fam", FAMILIES)
def test_adaptive_state_reads_the_projection_and_writes_exact_checkpoints(fam):
    """Token p = 1 after a checkpoint: o = proj(S_cᵀ u₁) + w₁ (k₁·q₁) (+ skip); over many windows
    the checkpoints are bit-identical to replay's (the sketch never enters a state)."""
    ranks = [0, 2, 3, 5]
    lay = sketch_layer(ranks, seed=2)
    tables = layer_tables(lay, family=fam, heads=H, key_dim=K)
    x, s0 = make_inputs(fam, 1, seed=8), random_state(9)
    st = WindowState(fam, s0, window=L, precision=EXACT, tables=tables, sketch_map="adaptive")
    out = st.step(x)[:, 0]
    x1 = x.tokens(0)
    u = family(fam).apply_t(x1.q, x1.k, x1.decay, x1.beta)
    want = x1.w * (x1.k * x1.q).sum(-1, keepdim=True) + (0 if x1.skip is None else x1.skip)
    for h, m in enumerate(ranks):
        for b in range(s0.shape[0]):
            if m == 0:
                want[b, h] += s0[b, h].T @ u[b, h]
            else:
                rows = lay.frame_of(h).double()[:m]
                want[b, h] += projected_read(s0[b, h], rows, u[b, h][None])[0]
    assert rel(out, want) <= 1e-12

    x, s0 = make_inputs(fam, 5 * L + 2, seed=6), random_state(7).float()
    logs = [], []
    replay = WindowState(fam, s0, window=L)
    adaptive = make_state("sketch", fam, s0, window=L, tables=tables, sketch_map="adaptive")
    static = make_state("sketch", fam, s0, window=L, tables=tables)
    o_r = replay.step(x)
    o_a, o_s = adaptive.step(x), static.step(x)
    logs[0].append(replay.ckpt.state)
    logs[1].append(adaptive.ckpt.state)
    assert torch.equal(logs[0][0], logs[1][0]) and adaptive.flushes == 5
    flush_tok = torch.arange(x.num_tokens) % L == L - 1
    assert rel(o_a[:, ~flush_tok, 1:], o_r[:, ~flush_tok, 1:]) > 1e-4  # approximate reads
    assert rel(o_a[:, ~flush_tok, 1:], o_s[:, ~flush_tok, 1:]) > 1e-4  # not the static map
    assert rel(o_a[:, flush_tok], o_r[:, flush_tok]) <= 1e-6


@pytest.mark.parametrize("fam", FAMILIES)
def test_adaptive_speculative_drafts_equal_sequential(fam):
    tables = layer_tables(sketch_layer([0, 2, 3, 2]), family=fam, heads=H, key_dim=K)
    x, s0 = make_inputs(fam, 3 * L + 1, seed=11), random_state(12).float()
    seq = make_state("sketch", fam, s0, window=L, tables=tables, sketch_map="adaptive")
    want = seq.step(x)
    spec = make_state("sketch", fam, s0, window=L, tables=tables, sketch_map="adaptive")
    got, start, g = [], 0, torch.Generator().manual_seed(0)
    while start < x.num_tokens:
        n = min(int(torch.randint(1, L + 1, (1,), generator=g)), x.num_tokens - start)
        spec.draft(x.tokens(slice(start, start + L if start + L <= x.num_tokens else x.num_tokens)))
        spec.accept(0)  # a rejected draft leaves nothing behind
        got.append(spec.draft(x.tokens(slice(start, start + n))))
        spec.accept(n)
        start += n
    assert rel(torch.cat(got, dim=1), want) <= 1e-6


def test_byte_model_counts_r_times_v_plus_k():
    k, v, n = 128, 64, 16
    static = TrafficModel("gdn", k, v, n, read_bytes=2)
    adaptive = TrafficModel("gdn", k, v, n, read_bytes=2, adaptive=True)
    # reads: (L − 1) · rows · width · rb; the flush writes the factors too
    extra = adaptive.window_bytes(3) - static.window_bytes(3)
    assert extra == (n - 1) * 3 * k * 2 + 3 * k * 2
    assert adaptive.window_bytes(0) == static.window_bytes(0)  # dense heads read the same
    assert adaptive_ranks([0, 4, 8, 16], 128, 128) == [0, 2, 4, 8]
    # V = 64, K = 128: eight heads of rank 8 read 8·8·64 = 4096 values, 21⅓ adaptive ranks of 192
    assert adaptive_ranks([8] * 8, k, v) == [3, 3, 3, 3, 3, 2, 2, 2]
    assert adaptive_ranks([0, 4, 1], k, v) == [0, 1, 1]  # a sketch head keeps at least rank 1
    assert adaptive_ranks([128, 8], k, v) == [0, 2]  # rank K reads the dense bytes: dense, exact
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # never more read bytes than the static heads it stands in for
        ranks = torch.randint(0, 25, (8,), generator=g).tolist()
        ad = adaptive_ranks(ranks, k, v)
        assert all((a == 0) == (m == 0) for a, m in zip(ad, ranks, strict=True))
        if all(m == 0 or m * v >= k + v for m in ranks):
            assert sum(ad) * (k + v) <= sum(ranks) * v
            assert (sum(ad) + 1) * (k + v) > sum(ranks) * v  # and no whole rank left over
        for a, m in zip(ad, ranks, strict=True):
            assert a == 0 or abs(a - m * v / (k + v)) < 1 + 1e-9 or a == 1


@pytest.mark.parametrize("fam", list(FAMILY_MODELS))
def test_adaptive_runtime_in_models(fam):
    """In each family's model: an adaptive sketch of rank ≥ V reads exactly (replay's outputs); a
    low-rank one is approximate and differs from the static map; triton refuses it."""
    model, spec = tiny(FAMILY_MODELS[fam])
    ids = torch.randint(3, 2000, (2, 6 + 4 * 4 + 1), generator=torch.Generator().manual_seed(1))
    rep, rep_mix = forward(model, spec, ids, None, "replay")
    _, full_mix = forward(model, spec, ids, synthetic_artifact(spec, None), "sketch", sketch_map="adaptive")
    assert all(s.key_dim >= s.value_dim for s in spec.layers)
    for layer in rep_mix:
        assert rel(full_mix[layer], rep_mix[layer]) <= 1e-5, layer
    art = synthetic_artifact(spec, 2)
    low, _ = forward(model, spec, ids, art, "sketch", sketch_map="adaptive")
    static, _ = forward(model, spec, ids, art, "sketch", sketch_map="static")
    assert rel(low, rep) > 1e-7 and rel(low, static) > 1e-7
    art.config["sketch_map"] = "adaptive"  # the artifact's own kind is the default
    again, _ = forward(model, spec, ids, art, "sketch")
    assert torch.equal(again, low)
    with pytest.raises(SketchcalError, match="'public' has no adaptive sketch"):
        enable(model, art, "sketch", backend="public", sketch_map="adaptive")
    with pytest.raises(SketchcalError, match="sketch_map must be one of"):
        enable(model, art, "sketch", sketch_map="dynamic")


def test_verify_sketch_map_option_is_checked(monkeypatch, capsys):
    from test_bad_inputs import fails

    from sketchcal.settings import VerifySettings

    with pytest.raises(SketchcalError, match="--sketch-map must be static or adaptive"):
        VerifySettings(model_dir="x", sketch_map="dynamic")
    line = fails(monkeypatch, capsys, "verify", "x", "--sketch-map", "dynamic")
    assert "--sketch-map must be static or adaptive" in line


def exact_of(s: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return torch.einsum("rkv,rtk->rtv", s, u)


def den_of(s: torch.Tensor, u: torch.Tensor, w: torch.Tensor) -> float:
    return float((w * (exact_of(s, u) ** 2).sum(-1)).sum())


def test_measured_adaptive_curve_is_the_least_squares_projection_error():
    """The allocation's adaptive curve against least squares per window (``projected_read``): the
    γ-weighted relative error of Sᵀu projected onto span(Sᵀ R_{:r}ᵀ), masked reads left out."""
    g = torch.Generator().manual_seed(3)
    k, v, n, t = 12, 6, 5, 4
    frame, _ = torch.linalg.qr(torch.randn(k, k, dtype=F64, generator=g))
    frame = frame.T
    s = torch.randn(n, k, v, dtype=F64, generator=g) * torch.linspace(2, 0.1, k, dtype=F64)[:, None]
    u = torch.randn(n, t, k, dtype=F64, generator=g)
    mask = torch.rand(n, t, generator=g) > 0.3
    gamma = torch.rand(n, t, dtype=F64, generator=g)
    ranks = [0, 1, 2, 4, 6, 8]
    got = measured_adaptive_curve(frame, s, u, mask, ranks, gamma)
    w = gamma * mask
    exact = torch.einsum("rkv,rtk->rtv", s, u)
    den = float((w * (exact**2).sum(-1)).sum())
    for i, r in enumerate(ranks[1:], start=1):  # (rank 0 is dense: exact, 0)
        approx = torch.stack([projected_read(s[j], frame[:r], u[j]) for j in range(n)])
        want = float((w * ((approx - exact) ** 2).sum(-1)).sum()) / den
        assert got[i] == pytest.approx(want, rel=1e-9, abs=1e-15), r
    assert got[0] == 0 and got[1] > got[2] > got[3] > 0.01  # nested spans: error falls with r
    assert got[4] < 1e-20 and got[5] < 1e-20  # r ≥ V: span(Sᵀ R_{:r}ᵀ) is all of R^V, exact
    assert torch.isnan(measured_adaptive_curve(frame, s, u, torch.zeros_like(mask), ranks)).all()
    # states whose key space misses the frame's second row: that column of Sᵀ R_{:r}ᵀ is zero, the
    # next ones are not (what a basis fitted to other states meets); rank 2 then reads as rank 1
    s = s - torch.einsum("k,j,rjv->rkv", frame[1], frame[1], s)
    got = measured_adaptive_curve(frame, s, u, mask, ranks, gamma)
    for i, r in enumerate(ranks[1:5], start=1):
        approx = torch.stack([projected_read(s[j], frame[:r], u[j]) for j in range(n)])
        want = float((w * ((approx - exact_of(s, u)) ** 2).sum(-1)).sum()) / den_of(s, u, w)
        assert got[i] == pytest.approx(want, rel=1e-9, abs=1e-15), r
    assert float(got[1]) == pytest.approx(float(got[2]), rel=1e-12) and got[3] < got[2]
