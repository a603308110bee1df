"""Runtime decode-state objects against the shared float64 recurrence (no model; tiny shapes).

References are :func:`sketchcal.kernels.common.recurrence` run in float64 and, for the sketch read,
the artifact's documented formula ``(R S)_{:m}ᵀ (coef_h[:m] (R u))`` written out per head.
"""

from __future__ import annotations

import math

import pytest
import torch

from sketchcal.artifact.sketch import SketchLayer
from sketchcal.errors import SketchcalError
from sketchcal.kernels.common import StepInputs, family, recurrence
from sketchcal.runtime import Precision, StandardState, WindowState, layer_tables, make_state, parse_dtype

FAMILIES = ["mamba2", "gdn", "kda"]
F64 = torch.float64
B, H, G, K, V, L = 2, 4, 2, 8, 6, 8
EXACT = Precision(read_dtype=F64, state_dtype=F64, compute_dtype=F64)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def make_inputs(fam: str, t: int, seed: int = 0, b: int = B, h: int = H, k: int = K, v: int = V, slow=False):
    """Random float64 inputs shaped like the adapters' (normalised delta-rule keys, decays in (0, 1])."""
    g = torch.Generator().manual_seed(seed)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g, dtype=F64)

    def u(*s: int) -> torch.Tensor:
        return torch.rand(*s, generator=g, dtype=F64)

    lo = 0.97 if slow else 0.8
    k_, q = r(b, t, h, k), r(b, t, h, k)
    if fam == "mamba2":
        x = r(b, t, h, v)
        dt = 0.05 + 0.1 * u(b, t, h)
        decay = lo + (1 - lo) * u(b, t, h)
        return StepInputs(
            k=k_ / math.sqrt(k), q=q / math.sqrt(k), w=dt[..., None] * x, decay=decay, skip=0.5 * x
        )
    k_ = k_ / k_.norm(dim=-1, keepdim=True)
    q = q / q.norm(dim=-1, keepdim=True) / math.sqrt(k)
    beta = u(b, t, h)
    decay = lo + (1 - lo) * (u(b, t, h, k) if fam == "kda" else u(b, t, h))
    return StepInputs(k=k_, q=q, w=beta[..., None] * r(b, t, h, v), decay=decay, beta=beta)


def random_state(seed: int = 1, b: int = B, h: int = H, k: int = K, v: int = V) -> torch.Tensor:
    return torch.randn(b, h, k, v, generator=torch.Generator().manual_seed(seed), dtype=F64)


def orthogonal(k: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=F64))
    return q * torch.sign(torch.diagonal(r))


def sketch_layer(ranks: list[int], seed: int = 0, with_tail: bool = True) -> SketchLayer:
    """A sketch layer with random orthogonal frames; maps ``[I_m  Gᵀ]`` with a random G (0 for m = K)."""
    gen = torch.Generator().manual_seed(seed)
    frames = torch.stack([orthogonal(K, gen) for _ in range(G)])
    rows = max(1, max(ranks))
    coef = torch.zeros(H, rows, K, dtype=F64)
    for h, m in enumerate(ranks):
        if m:
            coef[h, :m, :m] = torch.eye(m, dtype=F64)
            if with_tail:
                coef[h, :m, m:] = 0.3 * torch.randn(m, K - m, generator=gen, dtype=F64)
    return SketchLayer(0, frames.float(), coef.float(), torch.tensor(ranks, dtype=torch.int32))


class FlushLog:
    wants_exact = False

    def __init__(self):
        self.checkpoints: list[torch.Tensor] = []

    def on_read(self, layer, positions, approx, exact) -> None:
        return None

    def on_flush(self, layer, checkpoint) -> None:
        self.checkpoints.append(checkpoint.clone())


def reference_flush_states(fam: str, x: StepInputs, s0: torch.Tensor, window: int) -> list[torch.Tensor]:
    """float64 states after every multiple of ``window`` tokens."""
    states, s = [], s0
    for start in range(0, x.num_tokens - window + 1, window):
        _, s = recurrence(family(fam), x.tokens(slice(start, start + window)), s)
        states.append(s)
    return states


def feed_in_pieces(state, x: StepInputs, seed: int) -> torch.Tensor:
    """``state.step`` on random-length pieces of ``x`` (pieces cross window ends)."""
    g = torch.Generator().manual_seed(seed)
    outs, start = [], 0
    while start < x.num_tokens:
        n = int(torch.randint(1, 2 * L + 2, (1,), generator=g))
        outs.append(state.step(x.tokens(slice(start, start + n))))
        start += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("fam", FAMILIES)
def test_replay_equals_float64_recurrence_over_windows(fam):
    x, s0 = make_inputs(fam, 6 * L + 3), random_state()
    ref_o, ref_s = recurrence(family(fam), x, s0)
    log = FlushLog()
    st = WindowState(fam, s0.float(), window=L, probe=log)  # fp32 checkpoint and math
    out = feed_in_pieces(st, x, seed=3)
    assert rel(out, ref_o) <= 1e-5
    flushes = reference_flush_states(fam, x, s0, L)
    assert len(log.checkpoints) == len(flushes) == 6
    for got, want in zip(log.checkpoints, flushes, strict=True):
        assert got.dtype == torch.float32 and rel(got, want) <= 1e-5
    assert st.pos == 3 and rel(st.state(), ref_s) <= 1e-5
    std = StandardState(fam, s0.float())
    assert rel(std.step(x), ref_o) <= 1e-5 and rel(std.state(), ref_s) <= 1e-5


@pytest.mark.parametrize("fam", FAMILIES)
def test_sketch_at_full_rank_equals_replay(fam):
    x, s0 = make_inputs(fam, 5 * L + 5, seed=4), random_state(5).float()
    tables = layer_tables(sketch_layer([K] * H, with_tail=False), family=fam, heads=H, key_dim=K)
    logs = FlushLog(), FlushLog()
    replay = WindowState(fam, s0, window=L, probe=logs[0])
    sketch = WindowState(fam, s0, window=L, tables=tables, probe=logs[1])
    o_r, o_s = replay.step(x), sketch.step(x)
    assert rel(o_s, o_r) <= 1e-5
    assert len(logs[0].checkpoints) == 5
    for a, b in zip(*(log.checkpoints for log in logs), strict=True):
        assert rel(b, a) <= 1e-5


@pytest.mark.parametrize("fam", FAMILIES)
def test_sketch_at_low_rank_differs_and_never_enters_the_checkpoint(fam):
    x, s0 = make_inputs(fam, 5 * L + 2, seed=6), random_state(7).float()
    ranks = [0, 2, 3, 2]  # head 0 dense
    tables = layer_tables(sketch_layer(ranks), family=fam, heads=H, key_dim=K)
    logs = FlushLog(), FlushLog()
    replay = WindowState(fam, s0, window=L, probe=logs[0])
    sketch = WindowState(fam, s0, window=L, tables=tables, probe=logs[1])
    o_r, o_s = replay.step(x), sketch.step(x)
    flush_tok = torch.arange(x.num_tokens) % L == L - 1
    assert rel(o_s[:, ~flush_tok, 1:], o_r[:, ~flush_tok, 1:]) > 1e-2  # not a silent replay
    assert rel(o_s[:, :, 0], o_r[:, :, 0]) <= 1e-6  # the dense head reads its full state
    assert rel(o_s[:, flush_tok], o_r[:, flush_tok]) <= 1e-6  # flush reads are exact
    assert len(logs[1].checkpoints) == 5
    for a, b in zip(*(log.checkpoints for log in logs), strict=True):
        assert torch.equal(a, b)  # bit-identical: the approximation never enters the state


@pytest.mark.parametrize("fam", FAMILIES)
def test_sketch_read_follows_the_artifact_formula(fam):
    """Token p = 1 after a checkpoint: o = approx(S_cᵀ u₁) + w₁ (k₁·q₁) (+ skip), u₁ = A₁ᵀ q₁. The
    runtime reads the kernels' tables, whose model-frame maps ``P = coef R`` are stored fp32: exact
    against the formula with that P, within fp32 rounding of the artifact's own ``coef (R u)``."""
    ranks = [0, 2, 3, 5]
    lay = sketch_layer(ranks, seed=2)
    x, s0 = make_inputs(fam, 1, seed=8), random_state(9)
    st = WindowState(
        fam, s0, window=L, precision=EXACT, tables=layer_tables(lay, family=fam, heads=H, key_dim=K)
    )
    out = st.step(x)[:, 0]
    x1 = x.tokens(0)
    u = family(fam).apply_t(x1.q, x1.k, x1.decay, x1.beta)  # [B, H, K]
    want = x1.w * (x1.k * x1.q).sum(-1, keepdim=True) + (0 if x1.skip is None else x1.skip)
    artifact = want.clone()
    for h, m in enumerate(ranks):
        if m == 0:
            for w in (want, artifact):
                w[:, h] += torch.einsum("bkv,bk->bv", s0[:, h], u[:, h])
            continue
        r = lay.frame_of(h).double()
        sk = torch.einsum("jk,bkv->bjv", r, s0[:, h])[:, :m]
        coeff = torch.einsum("mk,bk->bm", lay.coef[h, :m].double(), u[:, h] @ r.T)
        artifact[:, h] += torch.einsum("bmv,bm->bv", sk, coeff)
        p_stored = (lay.coef[h, :m].double() @ r).float().double()
        want[:, h] += torch.einsum("bmv,bm->bv", sk, u[:, h] @ p_stored.T)
    assert rel(out, want) <= 1e-12
    assert rel(out, artifact) <= 1e-6


def cat_tokens(a: StepInputs, b: StepInputs) -> StepInputs:
    return (
        a.map(lambda t: t)
        if b.num_tokens == 0
        else StepInputs(
            **{
                f: None if getattr(a, f) is None else torch.cat([getattr(a, f), getattr(b, f)], dim=1)
                for f in ("k", "q", "w", "decay", "beta", "skip")
            }
        )
    )


@pytest.mark.parametrize("mode", ["standard", "replay", "sketch"])
@pytest.mark.parametrize("fam", FAMILIES)
def test_speculative_accept_reject_equals_sequential(fam, mode):
    n, seed = 7 * L, {"mamba2": 11, "gdn": 12, "kda": 13}[fam]
    x, s0 = make_inputs(fam, n, seed=seed), random_state(seed)
    tables = layer_tables(sketch_layer([0, 2, 3, 2]), family=fam, heads=H, key_dim=K)
    kw = {"window": L, "precision": EXACT, "tables": tables}
    seq = make_state(mode, fam, s0, **kw)
    want = torch.cat([seq.step(x.tokens(slice(t, t + 1))) for t in range(n)], dim=1)
    spec = make_state(mode, fam, s0, **kw)
    g = torch.Generator().manual_seed(seed)
    cursor, rounds = 0, 0
    while cursor < n:
        t = int(torch.randint(1, L + 1, (1,), generator=g))
        k = min(int(torch.randint(0, t + 1, (1,), generator=g)), n - cursor)
        if rounds % 2:  # the k accepted drafts are right, the rest garbage the target rejects
            draft = cat_tokens(
                x.tokens(slice(cursor, cursor + k)), make_inputs(fam, t - k, seed=100 + rounds)
            )
            checked = k
        else:  # all drafts right, only k accepted
            draft = x.tokens(slice(cursor, cursor + t))
            checked = draft.num_tokens
        out = spec.draft(draft)
        assert out.shape[1] == draft.num_tokens
        if checked:
            assert rel(out[:, :checked], want[:, cursor : cursor + checked]) <= 1e-12
        spec.accept(k)
        cursor += k
        rounds += 1
    assert rounds > 8
    assert rel(spec.state(), seq.state()) <= 1e-12
    if mode != "standard":
        assert spec.pos == seq.pos and spec.flushes == seq.flushes == n // L
        assert rel(spec.ckpt.state, seq.ckpt.state) <= 1e-12


@pytest.mark.parametrize("fam", FAMILIES)
def test_replay_does_not_drift_over_4096_steps(fam):
    n = 4096
    x = make_inputs(fam, n, seed=21, b=1, h=2, k=8, v=8, slow=True).to(torch.float32)
    s0 = torch.zeros(1, 2, 8, 8)
    std, rep = StandardState(fam, s0), WindowState(fam, s0, window=16)
    o_std = torch.cat([std.step(x.tokens(slice(i, i + 512))) for i in range(0, n, 512)], dim=1)
    o_rep = torch.cat([rep.step(x.tokens(slice(i, i + 512))) for i in range(0, n, 512)], dim=1)
    assert rep.flushes == n // 16
    for i in range(0, n, 256):  # every stretch of the run, not only the average
        assert rel(o_rep[:, i : i + 256], o_std[:, i : i + 256]) <= 1e-4
    assert rel(rep.ckpt.state, std.state()) <= 1e-4


@pytest.mark.parametrize("fam", ["gdn", "kda"])
def test_precisions_store_what_they_say(fam):
    x, s0 = make_inputs(fam, 3 * L, seed=30), random_state(31).float()
    ref = WindowState(fam, s0, window=L).step(x)
    two = WindowState(fam, s0, window=L, precision=Precision(read_dtype=torch.bfloat16))
    shared = WindowState(fam, s0, window=L, precision=Precision(read_dtype=torch.bfloat16, shared=True))
    o_two, o_shared = two.step(x), shared.step(x)
    assert two.ckpt.state.dtype == torch.float32 and two.ckpt.read_copy.dtype == torch.bfloat16
    assert shared.ckpt.state.dtype == torch.bfloat16 and shared.ckpt.read_copy is None
    assert 1e-5 < rel(o_two, ref) < 2e-2 and 1e-5 < rel(o_shared, ref) < 2e-2
    if hasattr(torch, "float8_e4m3fn"):
        fp8 = WindowState(fam, s0, window=L, precision=Precision(read_dtype=parse_dtype("fp8")))
        o8 = fp8.step(x)
        assert fp8.ckpt.read_copy.dtype == torch.float8_e4m3fn and rel(o8, ref) < 0.2


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(SketchcalError, match="read-dtype"):
        parse_dtype("int8")
    st = WindowState("gdn", random_state().float(), window=L)
    with pytest.raises(SketchcalError, match="between 1 and the window"):
        st.draft(make_inputs("gdn", L + 1))
    st.draft(make_inputs("gdn", 3))
    with pytest.raises(SketchcalError, match="accept"):
        st.accept(4)
    with pytest.raises(SketchcalError, match="mode"):
        make_state("fast", "gdn", random_state())
    with pytest.raises(SketchcalError, match="sketch layer"):
        layer_tables(sketch_layer([2] * H), family="gdn", heads=H, key_dim=K + 1)
