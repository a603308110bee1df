"""Multiple-choice knapsack and rank allocation against exhaustive search."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from sketchcal.errors import SketchcalError
from sketchcal.fit.allocate import allocate
from sketchcal.fit.knapsack import InfeasibleBudget, lp_lower_bound, solve_mckp
from sketchcal.fit.layer import LayerFit
from sketchcal.fit.ranks import adaptive_candidate_ranks, candidate_ranks
from sketchcal.fit.traffic import TrafficModel


def exhaustive(costs, values, budget):
    best = None
    for pick in itertools.product(*[range(len(c)) for c in costs]):
        cost = sum(c[j] for c, j in zip(costs, pick, strict=True))
        if cost > budget:
            continue
        val = sum(v[j] for v, j in zip(values, pick, strict=True))
        if best is None or val < best[0] - 1e-12:
            best = (val, pick)
    return best


def random_instance(rng: random.Random, items: int, options: int):
    costs, values = [], []
    for _ in range(items):
        c = sorted(rng.sample(range(0, 40), options))
        v = sorted((rng.random() for _ in range(options)), reverse=True)
        if rng.random() < 0.3:  # non-monotone curves and ties must work too
            v = [rng.choice([0.1, 0.2, 0.5]) for _ in range(options)]
        costs.append(c)
        values.append(v)
    return costs, values


@pytest.mark.parametrize("seed", range(40))
def test_matches_exhaustive_search(seed):
    rng = random.Random(seed)
    costs, values = random_instance(rng, rng.randint(1, 5), rng.randint(1, 4))
    lo, hi = sum(min(c) for c in costs), sum(max(c) for c in costs)
    budget = rng.randint(lo, hi + 3)
    res = solve_mckp(costs, values, budget)
    ref = exhaustive(costs, values, budget)
    assert res.exact
    assert res.value == pytest.approx(ref[0], abs=1e-12)
    assert res.cost <= budget
    assert res.value == pytest.approx(sum(v[j] for v, j in zip(values, res.choice, strict=True)))
    assert res.lower_bound <= res.value + 1e-12
    assert lp_lower_bound(costs, values, budget) <= ref[0] + 1e-12


@pytest.mark.parametrize("seed", range(10))
def test_rounded_costs_stay_feasible_and_within_the_lp_bound(seed):
    rng = random.Random(100 + seed)
    costs = [[rng.randint(0, 10_000) for _ in range(3)] for _ in range(5)]
    values = [[rng.random() for _ in range(3)] for _ in range(5)]
    budget = sum(min(c) for c in costs) + rng.randint(0, 20_000)
    res = solve_mckp(costs, values, budget, max_cells=60)  # forces coarse cost units
    ref = exhaustive(costs, values, budget)
    assert res.cost <= budget
    assert res.lower_bound <= ref[0] + 1e-12 <= res.value + 2e-12


def test_infeasible_budget():
    with pytest.raises(InfeasibleBudget):
        solve_mckp([[3, 5], [2]], [[1.0, 0.0], [0.0]], 4)


def _fit(layer: int, heads: int, k: int, rng: random.Random) -> LayerFit:
    ranks = candidate_ranks(k)
    pred = torch.zeros(heads, len(ranks), dtype=torch.float64)
    for h in range(heads):
        errs = sorted((rng.random() for _ in ranks[1:]), reverse=True)
        pred[h, 1:] = torch.tensor(errs, dtype=torch.float64)
    z = torch.zeros(heads, dtype=torch.float64)
    scale = torch.tensor([0.5 + rng.random() for _ in range(heads)], dtype=torch.float64)
    return LayerFit(
        layer=layer,
        heads=heads,
        groups=1,
        key_dim=k,
        value_dim=k,
        basis="state",
        coef="state",
        ranks=ranks,
        frames=torch.zeros(1, k, k),
        eigvals=torch.zeros(1, k),
        e_map=torch.zeros(heads, k, k),
        shrinkage=z,
        predicted=pred,
        heldout_predicted=None,
        measured=None,
        read_energy=z,
        kl_scale=scale,
    )


def test_allocation_by_mean_rank_matches_exhaustive():
    rng = random.Random(7)
    fits = [_fit(0, 2, 16, rng), _fit(3, 2, 16, rng)]
    traffic = [TrafficModel("gdn", 16, 16, 8, 2)] * 2
    for m in (4, 5.5, 8, 11, 16):
        alloc = allocate(fits, traffic, rank=m)
        assert alloc.mean_rank <= m + 1e-9
        costs = [[r or 16 for r in f.ranks] for f in fits for _ in range(f.heads)]
        values = [(f.kl_scale[h] * f.predicted[h]).tolist() for f in fits for h in range(f.heads)]
        ref = exhaustive(costs, values, int(m * 4))
        assert alloc.predicted_kl == pytest.approx(ref[0])
    assert allocate(fits, traffic, rank=16).predicted_kl == 0.0  # everything dense


def test_allocation_by_bytes_matches_exhaustive():
    rng = random.Random(8)
    fits = [_fit(0, 3, 32, rng)]
    tm = TrafficModel("kda", 32, 32, 16, 1)
    traffic = [tm]
    lo = 3 * tm.step_bytes(4)
    for budget in (lo, lo * 1.3, 3 * tm.step_bytes(0)):
        alloc = allocate(fits, traffic, bytes_per_token=budget)
        assert alloc.bytes_per_token <= budget + 1e-9
        costs = [[tm.window_bytes(r) for r in fits[0].ranks]] * 3
        values = [(fits[0].kl_scale[h] * fits[0].predicted[h]).tolist() for h in range(3)]
        ref = exhaustive(costs, values, int(budget * 16))
        assert alloc.predicted_kl == pytest.approx(ref[0])


def _curves(heads: int, n: int, rng: random.Random) -> torch.Tensor:
    out = torch.zeros(heads, n, dtype=torch.float64)
    for h in range(heads):
        out[h, 1:] = torch.tensor(sorted((rng.random() for _ in range(n - 1)), reverse=True))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_allocation_never_predicted_worse_than_uniform(seed):
    """Held-out windows choose (the exhaustive optimum on them), the held-out moments, which did not
    choose, guard: the result is never predicted worse there than every head at one rank."""
    rng = random.Random(seed)
    fits = [_fit(0, 2, 16, rng), _fit(1, 2, 16, rng)]
    for f in fits:
        f.measured, f.heldout_predicted = _curves(2, len(f.ranks), rng), _curves(2, len(f.ranks), rng)
    traffic = [TrafficModel("gdn", 16, 16, 8, 2)] * 2
    costs = [[r or 16 for r in f.ranks] for f in fits for _ in range(f.heads)]
    chosen = [(f.kl_scale[h] * f.measured[h]).tolist() for f in fits for h in range(f.heads)]
    check = [(f.kl_scale[h] * f.heldout_predicted[h]).tolist() for f in fits for h in range(f.heads)]
    for m in (4, 8, 16):
        alloc = allocate(fits, traffic, rank=m)
        uniform = allocate(fits, traffic, rank=m, allocation="uniform")
        assert alloc.mean_rank <= m and alloc.heldout_kl <= uniform.heldout_kl + 1e-12
        best = exhaustive(costs, chosen, 4 * m)
        on_check = sum(check[i][j] for i, j in enumerate(best[1]))
        if on_check < uniform.heldout_kl - 1e-12:  # the optimum on the windows passes the guard
            assert alloc.measured_kl == pytest.approx(best[0]) and not alloc.notes
        else:  # uniform ranks
            assert [r for lay in alloc.layers for r in lay.ranks] == [
                r for lay in uniform.layers for r in lay.ranks
            ]


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(rank=1), "cannot be met"),
        (dict(rank=-1), "positive"),
        (dict(rank=0), "positive"),
        (dict(rank=17), "exceeds the key dim"),
        (dict(bytes_per_token=10.0), "cannot be met"),
        (dict(), "exactly one"),
        (dict(rank=4, bytes_per_token=1e9), "exactly one"),
    ],
)
def test_bad_budgets(kw, match):
    fits = [_fit(0, 2, 16, random.Random(0))]
    with pytest.raises(SketchcalError, match=match):
        allocate(fits, [TrafficModel("gdn", 16, 16, 8, 2)], **kw)


def test_adaptive_allocation_matches_exhaustive_at_the_bytes_of_a_static_rank():
    """``sketch_map="adaptive"``: the adaptive candidates and curves, a rank-r head costing r·(K + V)
    values a read; a mean-rank budget M is the bytes of static rank M on every head."""
    rng = random.Random(9)
    k, v = 16, 8
    fits = [_fit(0, 2, k, rng), _fit(2, 2, k, rng)]
    for f in fits:
        f.value_dim = v
        f.adaptive_ranks = adaptive_candidate_ranks(k, v)
        f.adaptive_measured = _curves(f.heads, len(f.adaptive_ranks), rng)
    assert fits[0].adaptive_ranks == [0, 1, 2, 3, 4, 5]  # 6·(16 + 8) ≥ 16·8: dense is cheaper
    static = TrafficModel("gdn", k, v, 8, 2)
    adaptive = TrafficModel("gdn", k, v, 8, 2, adaptive=True)
    for m in (4, 5, 6):
        alloc = allocate(fits, [static] * 2, rank=m, sketch_map="adaptive")
        budget = 4 * static.window_bytes(m)  # per window, four heads
        assert alloc.sketch_map == "adaptive" and alloc.budget == {"rank": float(m)}
        assert alloc.bytes_per_token * 8 <= budget + 1e-6
        costs = [[adaptive.window_bytes(r) for r in f.adaptive_ranks] for f in fits for _ in range(f.heads)]
        values = [(f.kl_scale[h] * f.adaptive_measured[h]).tolist() for f in fits for h in range(f.heads)]
        ref = exhaustive(costs, values, budget)
        assert alloc.measured_kl == pytest.approx(ref[0]) and alloc.predicted_kl == alloc.measured_kl
        ranks = [r for lay in alloc.layers for r in lay.ranks]
        assert ranks == [
            f.adaptive_ranks[j] for f, j in zip([*fits[:1]] * 2 + [fits[1]] * 2, ref[1], strict=True)
        ]
    # static rank 2 reads 2·V = 16 values a step, below one adaptive rank's K + V = 24
    with pytest.raises(SketchcalError, match="--rank 2 with the adaptive sketch cannot be met"):
        allocate(fits, [static] * 2, rank=2, sketch_map="adaptive")
    with pytest.raises(SketchcalError, match="held-out windows"):
        allocate([_fit(0, 2, k, rng)], [static], rank=4, sketch_map="adaptive")
    with pytest.raises(SketchcalError, match="sketch-map"):
        allocate(fits, [static] * 2, rank=4, sketch_map="dynamic")
