"""The per-step byte model: what "traffic reduction" means everywhere in sketchcal.

Counted per decoded token, per sequence and per state head: the bytes of recurrent-state traffic
(checkpoint, read copy, sketch and ReplaySSM buffer). Inputs and outputs of the current token and
the model weights (including the frames and coefficient maps, which are shared by the whole batch)
are the same in every mode and are not counted.

With window L, key dim K, value dim V, checkpoint bytes ``sb`` (fp32: 4), read-copy bytes ``rb``
(== sb: the fp32 checkpoint serves reads; 2: bf16 copy; 1: fp8), buffer bytes ``bb`` and a buffer
entry of ``e = (K/heads_per_group + V + decay + beta)·bb`` bytes per head (keys are shared by the
heads of a group; decay is 1 value per head for Mamba-2/GDN and K for KDA; beta is 1 for
GDN/KDA and 0 for Mamba-2):

- **standard**: read + write the full state every step: ``2·K·V·sb``.
- **replay / sketch** with rank m (``rows = m``, or K for a dense head), per window of L steps:

  - non-flush steps p = 1..L−1: read ``rows·V·rb`` (the sketch, or the full read copy), read the
    p−1 earlier buffer entries, write the current one;
  - the flush (p = L): read the fp32 checkpoint ``K·V·sb``, read the L−1 entries, write the new
    checkpoint ``K·V·sb``, plus ``rows·V·rb`` for the read copy / sketch when one is written:
    always for a KDA sketch (``R_{:m} S_c`` must be materialised, its decay does not commute
    with R), and whenever ``rb != sb`` (a separate low-precision copy of the rows that are read);

  and the per-step figure is the window total divided by L. Replay is the dense case.

- **adaptive sketch** (``adaptive``): a head of rank r reads ``Q (P_S u)``, the flush's factors
  ``Q`` [V, r] and ``P_S`` [r, K]: ``r·(V + K)·rb`` per non-flush step instead of ``r·V·rb``, and
  the flush writes them (``r·(V + K)·rb``; the two extra passes over the state it already holds
  are not traffic). :func:`adaptive_ranks` gives the adaptive ranks that read
  the bytes of a layer's static ranks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "float8": 1,
    "fp8": 1,
    "float8_e4m3fn": 1,
}


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name (``float32``, ``bf16``, ``fp8`` ...)."""
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(sorted(DTYPE_BYTES))}") from None


@dataclass(frozen=True)
class TrafficModel:
    """Byte model of one layer's heads (all heads of a layer share it)."""

    family: str  # "mamba2" | "gdn" | "kda"
    key_dim: int
    value_dim: int
    window: int
    heads_per_group: int = 1
    # bytes per value: the fp32 state, the copy the reads come from, the token buffer
    state_bytes: int = DTYPE_BYTES["float32"]
    read_bytes: int = DTYPE_BYTES["float32"]
    buffer_bytes: int = DTYPE_BYTES["bfloat16"]
    adaptive: bool = False  # the adaptive sketch: a rank-r read is r·(V + K) values

    @property
    def entry_bytes(self) -> int:
        """Bytes of one buffered token of one head."""
        k_share = math.ceil(self.key_dim / max(self.heads_per_group, 1))
        decay = self.key_dim if self.family == "kda" else 1
        beta = 0 if self.family == "mamba2" else 1
        return (k_share + self.value_dim + decay + beta) * self.buffer_bytes

    def standard_window_bytes(self) -> int:
        """Bytes of L standard steps of one head."""
        return self.window * 2 * self.key_dim * self.value_dim * self.state_bytes

    def window_bytes(self, rank: int) -> int:
        """Bytes of one window (L−1 sketch/replay steps + 1 flush) of one head at ``rank`` (0 = dense)."""
        k, v, n = self.key_dim, self.value_dim, self.window
        rows = k if rank == 0 else rank
        width = v + k if self.adaptive and rank != 0 else v  # values per row read
        e = self.entry_bytes
        reads = (n - 1) * rows * width * self.read_bytes + e * (n - 1) * n // 2  # Σ_p [(p−1)+1]·e
        flush = 2 * k * v * self.state_bytes + (n - 1) * e
        separate_copy = self.read_bytes != self.state_bytes
        if separate_copy or (rank != 0 and (self.family == "kda" or self.adaptive)):
            flush += rows * width * self.read_bytes
        return reads + flush

    def step_bytes(self, rank: int) -> float:
        """Mean bytes per decoded token of one head at ``rank`` (0 = dense, i.e. ReplaySSM)."""
        return self.window_bytes(rank) / self.window

    def standard_step_bytes(self) -> float:
        """Bytes per decoded token of one head in standard decoding."""
        return float(2 * self.key_dim * self.value_dim * self.state_bytes)

    def to_dict(self) -> dict:
        return asdict(self)


def adaptive_ranks(static_ranks: list[int], key_dim: int, value_dim: int) -> list[int]:
    """Adaptive-sketch ranks for a layer's heads that read at most the bytes of a static sketch of
    ``static_ranks`` (Σ r·(V + K) ≤ Σ m·V): each head of rank m gets ``⌊m·V / (V + K)⌋`` (at least 1:
    rank 0 means dense, which stays 0, as does a head of rank m ≥ K, which reads the dense read's
    bytes and then reads exactly); the layer's remaining bytes then go one rank at a time to the
    heads with the largest remainders (ties: lower head index)."""
    width = value_dim + key_dim
    static_ranks = [0 if m >= key_dim else m for m in static_ranks]
    exact = [m * value_dim / width for m in static_ranks]
    ranks = [0 if m <= 0 else max(1, int(e)) for m, e in zip(static_ranks, exact, strict=True)]
    spare = (sum(static_ranks) * value_dim - sum(ranks) * width) // width
    order = sorted((h for h, m in enumerate(static_ranks) if m > 0), key=lambda h: (ranks[h] - exact[h], h))
    for h in order[: max(0, spare)]:
        ranks[h] += 1
    return ranks
