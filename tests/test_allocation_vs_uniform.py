"""The per-head rank allocation against uniform ranks at the same budget, on a shipped model.

Measured where the error is: teacher-forced KL(standard ‖ sketch) of ``verify`` on held-out text,
the allocation's row against the uniform-rank ablation that ``verify`` fits from the same
statistics and bases. A fallback to uniform ranks may tie; a loss fails.
"""

from __future__ import annotations

import sketchcal


def test_allocation_does_not_lose_to_uniform_on_tiny_gdn(tmp_path):
    stats = tmp_path / "stats"
    sketchcal.calibrate(
        "builtin:tiny-gdn",
        out=stats,
        samples=16,
        heldout_samples=4,
        seq_len=128,
        device="cpu",
        progress=False,
    )
    sketchcal.convert(stats, rank=8, out=tmp_path / "sketch", reference_only=True, progress=False)
    res = sketchcal.verify(
        tmp_path / "sketch",
        tokens=128,
        prompt=16,
        samples=4,
        retrieval=False,
        plots=False,
        device="cpu",
        out=tmp_path / "verify",
        progress=False,
    )
    alloc, uniform = res.config("sketch"), res.config("sketch · uniform ranks")
    assert uniform.traffic["bytes_per_token"] <= alloc.traffic["bytes_per_token"] * (1 + 1e-9)
    assert alloc.kl_mean <= uniform.kl_mean, (alloc.kl_mean, uniform.kl_mean)


def test_adaptive_allocation_does_not_lose_to_uniform_on_tiny_mamba2(tmp_path):
    """``convert --sketch-map adaptive``: the adaptive ranks chosen on the held-out windows against
    every head at one adaptive rank within the same bytes (verify's uniform row of an adaptive
    sketch), on Mamba-2, where the adaptive map gains least."""
    stats = tmp_path / "stats"
    sketchcal.calibrate(
        "builtin:tiny-mamba2",
        out=stats,
        samples=16,
        heldout_samples=4,
        seq_len=128,
        device="cpu",
        progress=False,
    )
    sketchcal.convert(
        stats, rank=8, out=tmp_path / "sketch", reference_only=True, sketch_map="adaptive", progress=False
    )
    res = sketchcal.verify(
        tmp_path / "sketch",
        tokens=128,
        prompt=16,
        samples=4,
        retrieval=False,
        plots=False,
        device="cpu",
        out=tmp_path / "verify",
        progress=False,
    )
    alloc, uniform = res.config("sketch"), res.config("sketch · uniform ranks")
    assert alloc.sketch_map == uniform.sketch_map == "adaptive"
    assert uniform.traffic["bytes_per_token"] <= alloc.traffic["bytes_per_token"] * (1 + 1e-9)
    assert alloc.kl_mean <= uniform.kl_mean, (alloc.kl_mean, uniform.kl_mean)
