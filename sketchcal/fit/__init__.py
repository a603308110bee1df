"""Basis fitting, error curves and rank allocation (pure math on torch float64 tensors).

Modules: ``shrinkage`` (regularised E), ``basis`` (state-weighted / PCA / random bases, nested
frames, coefficient maps), ``curves`` (predicted and measured read-error curves), ``layer`` (fit
one layer), ``ranks`` (kernel-supported ranks), ``traffic`` (per-step byte model), ``knapsack``
(multiple-choice knapsack), ``allocate`` (per-head ranks under a budget), ``evaluate`` (held-out
comparisons of bases and shrinkage estimators). Import from the submodules.
"""
