"""The adaptive-sketch ablation of ``verify`` where the statistics hold no held-out windows (with
them, ``verify`` allocates the adaptive ranks at the static row's bytes instead): a sketch
re-ranked to read the bytes of another.

A static head of rank m reads m·V values per non-flush step; an adaptive head of rank r reads
r·(V + K) (its flush-made ``Q`` and ``P_S``, :mod:`sketchcal.runtime.sketch`). The adaptive
counterpart of a static sketch keeps its frames and gives a layer's heads the ranks
:func:`~sketchcal.fit.traffic.adaptive_ranks`, which read no more bytes than the layer's static
ranks (at least 1 per sketch head); dense heads stay dense. The maps are kept (an adaptive read
does not use them).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from sketchcal.artifact.sketch import SketchArtifact
from sketchcal.fit.traffic import adaptive_ranks
from sketchcal.models import ModelSpec


def adaptive_counterpart(art: SketchArtifact, spec: ModelSpec) -> SketchArtifact:
    """``art`` (a static sketch) as an adaptive sketch at its read bytes: same frames, each head's
    ranks → ``adaptive_ranks(ranks, K, V)``; ``config["sketch_map"]`` = ``adaptive``."""
    shapes = {s.layer: s for s in spec.layers}
    layers = []
    for lay in art.layers:
        shape = shapes[lay.layer]
        ranks = adaptive_ranks([int(m) for m in lay.ranks.tolist()], shape.key_dim, shape.value_dim)
        layers.append(replace(lay, ranks=torch.tensor(ranks, dtype=torch.int32)))
    return SketchArtifact(
        config={**art.config, "sketch_map": "adaptive"}, metadata=art.metadata, layers=layers
    )
