"""The per-head rank allocation against uniform ranks at the same budget, on shipped models.

Measured where the error is: teacher-forced KL(standard ‖ sketch) of ``verify`` on held-out text,
the allocation's row against the uniform-rank ablation that ``verify`` fits from the same
statistics and bases. A fallback to uniform ranks may tie; a loss fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import sketchcal


def allocation_and_uniform(model: str, tmp_path: Path, **convert_options):
    """``verify``'s rows of the allocation (``sketch``) and of uniform ranks at its budget, for
    ``model`` calibrated on 16 × 128 tokens and converted at rank 8 with ``convert_options``."""
    stats = tmp_path / "stats"
    sketchcal.calibrate(
        model, out=stats, samples=16, heldout_samples=4, seq_len=128, device="cpu", progress=False
    )
    sketch = tmp_path / "sketch"
    sketchcal.convert(stats, rank=8, out=sketch, reference_only=True, progress=False, **convert_options)
    res = sketchcal.verify(
        sketch,
        tokens=128,
        prompt=16,
        samples=4,
        retrieval=False,
        plots=False,
        device="cpu",
        out=tmp_path / "verify",
        progress=False,
    )
    return res.config("sketch"), res.config("sketch · uniform ranks")


@pytest.mark.parametrize(
    "model,sketch_map",
    # the adaptive sketch on Mamba-2, where the adaptive map gains least
    [("builtin:tiny-gdn", "static"), ("builtin:tiny-mamba2", "adaptive")],
)
def test_allocation_does_not_lose_to_uniform(model, sketch_map, tmp_path):
    alloc, uniform = allocation_and_uniform(model, tmp_path, sketch_map=sketch_map)
    assert alloc.sketch_map == uniform.sketch_map == sketch_map
    assert uniform.traffic["bytes_per_token"] <= alloc.traffic["bytes_per_token"] * (1 + 1e-9)
    assert alloc.kl_mean <= uniform.kl_mean, (alloc.kl_mean, uniform.kl_mean)
