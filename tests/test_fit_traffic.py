"""The per-step byte model, checked against hand-computed numbers for real model shapes."""

from __future__ import annotations

import pytest

from sketchcal.fit.ranks import SUPPORTED_RANKS, candidate_ranks, effective_rank
from sketchcal.fit.traffic import TrafficModel


def test_gdn_qwen35_shape():
    # Qwen3.5-4B: K = V = 128, 2 value heads per key head, L = 16, fp32 checkpoint, bf16 buffer
    tm = TrafficModel("gdn", 128, 128, 16, heads_per_group=2)
    entry = (64 + 128 + 1 + 1) * 2  # k shared by 2 heads, v, α, β
    assert tm.entry_bytes == entry == 388
    assert tm.standard_step_bytes() == 2 * 128 * 128 * 4
    buffer = entry * sum(range(1, 16))  # step p reads p−1 entries and writes 1
    flush = 2 * 128 * 128 * 4 + 15 * entry
    assert tm.window_bytes(0) == 15 * 128 * 128 * 4 + buffer + flush == 1_166_492
    assert tm.window_bytes(8) == 15 * 8 * 128 * 4 + buffer + flush == 244_892
    assert tm.step_bytes(8) == pytest.approx(244_892 / 16)
    # ReplaySSM saves a bit less than half; a rank-8 sketch about 8.6x
    assert 1 - tm.step_bytes(0) / tm.standard_step_bytes() == pytest.approx(0.4438, abs=1e-4)
    assert tm.standard_step_bytes() / tm.step_bytes(8) == pytest.approx(8.564, abs=1e-3)


def test_kda_writes_its_sketch_at_the_flush():
    tm = TrafficModel("kda", 128, 128, 16, heads_per_group=1)
    entry = (128 + 128 + 128 + 1) * 2  # k, v, per-channel α, β
    assert tm.entry_bytes == entry
    reads = 15 * 8 * 128 * 4 + entry * 120
    flush = 2 * 128 * 128 * 4 + 15 * entry + 8 * 128 * 4
    assert tm.window_bytes(8) == reads + flush
    assert tm.window_bytes(0) == 15 * 128 * 128 * 4 + entry * 120 + 2 * 128 * 128 * 4 + 15 * entry


def test_two_precisions_write_a_read_copy():
    tm = TrafficModel("mamba2", 128, 64, 16, heads_per_group=8, read_bytes=2)
    entry = (16 + 64 + 1) * 2  # B shared by 8 heads, x, dt
    assert tm.entry_bytes == entry
    assert (
        tm.window_bytes(0) == 15 * 128 * 64 * 2 + entry * 120 + 2 * 128 * 64 * 4 + 15 * entry + 128 * 64 * 2
    )
    assert tm.window_bytes(16) == 15 * 16 * 64 * 2 + entry * 120 + 2 * 128 * 64 * 4 + 15 * entry + 16 * 64 * 2


def test_window_one_is_standard_plus_nothing():
    tm = TrafficModel("gdn", 16, 16, 1)
    assert tm.step_bytes(0) == tm.standard_step_bytes()


def test_supported_ranks():
    assert SUPPORTED_RANKS == (0, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    assert candidate_ranks(128) == list(SUPPORTED_RANKS)
    assert candidate_ranks(16) == [0, 2, 4, 6, 8, 12]
    assert candidate_ranks(4) == [0, 2]
    assert effective_rank(0, 64) == 64 and effective_rank(8, 64) == 8
