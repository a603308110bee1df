"""Multiple-choice knapsack: pick one option per item, total cost ≤ budget, minimum total value.

Here an item is a head, an option a rank, the cost its bytes (or its rank) and the value its
predicted error. :func:`solve_mckp` is an exact dynamic program over integer costs (costs are
shifted by each item's cheapest option and divided by their gcd, so typical instances are small).
When the table would exceed ``max_cells`` the costs are rounded *up* to a coarser unit (the
answer stays feasible for the true costs) and the answer is certified by the LP-relaxation lower
bound of :func:`lp_lower_bound`: ``result.value − result.lower_bound`` bounds the sub-optimality.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class InfeasibleBudget(ValueError):
    """Even the cheapest option of every item exceeds the budget."""

    def __init__(self, min_cost: int, budget: int):
        super().__init__(f"minimum cost {min_cost} exceeds the budget {budget}")
        self.min_cost = min_cost
        self.budget = budget


@dataclass
class KnapsackResult:
    choice: list[int]  # option index per item
    value: float  # Σ value of the chosen options
    cost: int  # Σ cost of the chosen options (original units)
    lower_bound: float  # LP-relaxation bound: no feasible choice has a smaller value
    exact: bool  # True when solved without cost rounding (then ``value`` is optimal)


def _check(costs: Sequence[Sequence[int]], values: Sequence[Sequence[float]]) -> None:
    if len(costs) != len(values):
        raise ValueError("costs and values must have one row per item")
    for c, v in zip(costs, values, strict=True):
        if len(c) != len(v) or not c:
            raise ValueError("every item needs at least one option, with one cost and one value each")
        if any(int(x) != x or x < 0 for x in c):
            raise ValueError("costs must be non-negative integers")


def lp_lower_bound(costs: Sequence[Sequence[int]], values: Sequence[Sequence[float]], budget: int) -> float:
    """Optimum of the LP relaxation (options may be mixed fractionally): a lower bound on the MCKP.

    Per item the options on the lower convex hull of (cost, value) are chained from the cheapest;
    all hull segments are taken greedily by slope, the last one fractionally (Sinha & Zoltners).
    """
    _check(costs, values)
    base_value = 0.0
    base_cost = 0
    segments: list[tuple[float, float, float]] = []  # (slope, Δcost, Δvalue)
    for c, v in zip(costs, values, strict=True):
        pts = sorted(zip(c, v, strict=True))
        c0 = pts[0][0]
        v0 = min(val for cc, val in pts if cc == c0)
        base_cost += c0
        base_value += v0
        hull = [(c0, v0)]
        for cc, val in pts:
            if cc == c0 or val >= hull[-1][1]:
                continue
            while len(hull) >= 2:
                (x1, y1), (x2, y2) = hull[-2], hull[-1]
                # pop hull[-1] if it lies on or above the chord hull[-2] -> (cc, val)
                if (y2 - y1) * (cc - x1) >= (val - y1) * (x2 - x1):
                    hull.pop()
                else:
                    break
            hull.append((cc, val))
        for (x1, y1), (x2, y2) in itertools.pairwise(hull):
            segments.append(((y2 - y1) / (x2 - x1), x2 - x1, y2 - y1))
    if base_cost > budget:
        raise InfeasibleBudget(base_cost, budget)
    left = float(budget - base_cost)
    value = base_value
    for _, dc, dv in sorted(segments):
        if left <= 0:
            break
        frac = min(1.0, left / dc)
        value += frac * dv
        left -= frac * dc
    return value


def solve_mckp(
    costs: Sequence[Sequence[int]],
    values: Sequence[Sequence[float]],
    budget: int,
    max_cells: int = 50_000_000,
) -> KnapsackResult:
    """Minimise Σ values[i][choice[i]] subject to Σ costs[i][choice[i]] ≤ budget.

    Args:
        costs: per item, per option, a non-negative integer cost.
        values: per item, per option, a finite value (lower is better).
        budget: integer budget.
        max_cells: bound on items × budget units of the DP table (memory ≈ 2 bytes per cell).

    Raises:
        InfeasibleBudget: when the cheapest options already exceed the budget.
    """
    _check(costs, values)
    n = len(costs)
    base = [min(c) for c in costs]
    min_cost = sum(base)
    if min_cost > budget:
        raise InfeasibleBudget(min_cost, budget)
    lower = lp_lower_bound(costs, values, budget)
    extra = [[int(x) - b for x in c] for c, b in zip(costs, base, strict=True)]
    cap = min(budget - min_cost, sum(max(e) for e in extra))
    g = 0
    for e in extra:
        for x in e:
            g = math.gcd(g, x)
    g = max(g, 1)
    unit = g
    exact = True
    if n * (cap // unit + 1) > max_cells:
        unit = max(g, math.ceil(cap / max(max_cells // n - 1, 1)))
        exact = False
    scaled = [[-(-x // unit) for x in e] for e in extra]  # ceil: rounding up keeps the answer feasible
    width = cap // unit + 1
    dp = np.zeros(width, dtype=np.float64)  # dp[b]: best value of the items so far with extra cost ≤ b
    choice = np.zeros((n, width), dtype=np.int16)
    for i in range(n):
        order = sorted(range(len(scaled[i])), key=lambda j, i=i: (scaled[i][j], values[i][j]))
        new = np.full(width, np.inf)
        arg = np.zeros(width, dtype=np.int16)
        for j in order:
            s = scaled[i][j]
            if s >= width:
                continue
            cand = np.full(width, np.inf)
            cand[s:] = dp[: width - s] + float(values[i][j])
            better = cand < new  # strict: among equal values the cheaper option (earlier in order) wins
            new[better] = cand[better]
            arg[better] = j
        dp = new
        choice[i] = arg
    picks = [0] * n
    b = width - 1
    for i in range(n - 1, -1, -1):
        j = int(choice[i, b])
        picks[i] = j
        b -= scaled[i][j]
    value = float(sum(values[i][picks[i]] for i in range(n)))
    cost = int(sum(costs[i][picks[i]] for i in range(n)))
    return KnapsackResult(choice=picks, value=value, cost=cost, lower_bound=min(lower, value), exact=exact)
