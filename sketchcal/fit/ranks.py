"""The sketch ranks the decode kernels support.

``SUPPORTED_RANKS = (0, 4, 8, 12, 16, 24, 32, 48, 64)``; 0 means *dense*: the head reads its full
checkpoint (exact ReplaySSM read, no sketch). Non-zero ranks are multiples of 4 so that the sketch
rows tile the kernels' key blocks; above 16 the steps grow geometrically because the error curves
flatten there. For a head with key dim K only ranks ``0 < m < K`` are candidates: a rank-K sketch
reads as many bytes as the dense read and is exact too, so dense covers it.

"Mean rank" everywhere counts a dense head as rank K.
"""

from __future__ import annotations

SUPPORTED_RANKS: tuple[int, ...] = (0, 4, 8, 12, 16, 24, 32, 48, 64)
DENSE = 0


def candidate_ranks(key_dim: int) -> list[int]:
    """Ranks a head with key dim ``key_dim`` may take, dense (0) first, then increasing."""
    return [0] + [m for m in SUPPORTED_RANKS if 0 < m < key_dim]


def effective_rank(m: int, key_dim: int) -> int:
    """Rank counted in the mean-rank budget: ``m``, or ``key_dim`` for a dense head."""
    return key_dim if m == DENSE else m
