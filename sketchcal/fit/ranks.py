"""The sketch ranks a head may take, as the decode kernels define them (``sketchcal.kernels.common.pool``).

``SUPPORTED_RANKS = (0, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)``; 0 means *dense*: the head reads its full
checkpoint (exact ReplaySSM read, no sketch). For a head with key dim K only ranks ``0 < m < K`` are
candidates (:func:`candidate_ranks`): a rank-K sketch reads as many bytes as the dense read and is
exact too, so dense covers it.

An adaptive-sketch head (``sketch_map="adaptive"``) of rank r reads ``r·(K + V)`` values instead of
``m·V``; its candidates (:func:`adaptive_candidate_ranks`) are every r up to 16, then the supported
ones, while that is below the dense read.

"Mean rank" everywhere counts a dense head as rank K.
"""

from __future__ import annotations

from sketchcal.kernels.common.pool import (
    SKETCH_MAPS,
    SUPPORTED_RANKS,
    adaptive_candidate_ranks,
    candidate_ranks,
)

DENSE = 0

__all__ = [
    "DENSE",
    "SKETCH_MAPS",
    "SUPPORTED_RANKS",
    "adaptive_candidate_ranks",
    "candidate_ranks",
    "effective_rank",
]


def effective_rank(m: int, key_dim: int) -> int:
    """Rank counted in the mean-rank budget: ``m``, or ``key_dim`` for a dense head."""
    return key_dim if m == DENSE else m
