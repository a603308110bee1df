"""Mamba-2 decode kernels: the serving API of ``common/decode.py`` bound to this family.

Layouts (``common/pool.py``): state [N, H, K, V] fp32, read copy [N, H, K, V] bf16, buffer
[N, G or H, C, ...]; inputs k, q [B, T, G, K], w [B, T, H, V], decay [B, T, H], skip [B, T, H, V] (D·x);
slots, pos [B] int32. In sketch mode a flush writes the sketch R_{:m} S_c [N, H, M, V].
"""

from functools import partial

from sketchcal.kernels.common import decode as _decode

FAMILY = "mamba2"

standard_step = partial(_decode.standard_step, FAMILY)
replay_step = partial(_decode.replay_step, FAMILY)
sketch_step = partial(_decode.sketch_step, FAMILY)
flush = partial(_decode.flush, FAMILY)
spec_verify = partial(_decode.spec_verify, FAMILY)

__all__ = ["FAMILY", "flush", "replay_step", "sketch_step", "spec_verify", "standard_step"]
