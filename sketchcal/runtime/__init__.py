"""Decode runtime: ``standard``, ``replay`` and ``sketch`` modes inside transformers models.

Two backends: ``reference`` (pure torch, any device) and ``triton`` (the decode kernels over a slot
pool per layer, CUDA; ``auto`` picks it when it can run).

Public API::

    enable(model, artifact=None, mode="sketch", *, window=None, read_dtype=None, shared=False,
           prefill=None, compute_dtype="fp32", probe=None, backend="auto", buffer_dtype=None,
           sketch_map=None) -> Runtime                      # sketch_map: "static" | "adaptive"
    enabled(model, artifact=None, mode="sketch", **kw)      # context manager
    disable(model); runtime_of(model) -> Runtime | None
    GraphDecoder(model).generate(input_ids, max_new_tokens)  # greedy, CUDA graphs on a GPU
    make_state(mode, family, state, *, tables=None, window=16, precision=Precision(),
               sketch_map="static") -> DecodeState
    StandardState / WindowState: step(x), draft(x), accept(k), state()
    layer_tables(sketch_layer, family=..., heads=H, key_dim=K) -> SketchTables; Precision; parse_dtype

Modules: ``precision`` (dtypes of checkpoint, read copy, math), ``sketch`` (one layer's sketch
tables: the kernels' ``SketchTables``), ``state`` (decode-state objects), ``kernel_state`` (the
same on the Triton kernels; imported only when the triton backend runs), ``families`` (the
transformers kernel-function contracts), ``patch`` (plugging the modes into a transformers model),
``graph_decode`` (greedy decoding with a static cache and CUDA graphs), ``e2e_bench`` (whole-model
tokens/s, ``sketchcal bench --e2e``).
"""

from sketchcal.runtime.graph_decode import GraphDecoder
from sketchcal.runtime.patch import BACKENDS, Runtime, disable, enable, enabled, runtime_of
from sketchcal.runtime.precision import READ_DTYPES, Precision, parse_dtype
from sketchcal.runtime.sketch import SketchTables, layer_tables
from sketchcal.runtime.state import (
    DEFAULT_WINDOW,
    MODES,
    Checkpoint,
    DecodeState,
    Probe,
    StandardState,
    WindowState,
    make_state,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_WINDOW",
    "MODES",
    "READ_DTYPES",
    "Checkpoint",
    "DecodeState",
    "GraphDecoder",
    "Precision",
    "Probe",
    "Runtime",
    "SketchTables",
    "StandardState",
    "WindowState",
    "disable",
    "enable",
    "enabled",
    "layer_tables",
    "make_state",
    "parse_dtype",
    "runtime_of",
]
