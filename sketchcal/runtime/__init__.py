"""Reference decode runtime (pure torch, any device): ``standard``, ``replay`` and ``sketch`` modes.

Public API::

    enable(model, artifact=None, mode="sketch", *, window=None, read_dtype=None, shared=False,
           prefill=None, compute_dtype="fp32", probe=None) -> Runtime
    enabled(model, artifact=None, mode="sketch", **kw)      # context manager
    disable(model); runtime_of(model) -> Runtime | None
    make_state(mode, family, state, *, tables=None, window=16, precision=Precision()) -> DecodeState
    StandardState / WindowState: step(x), draft(x), accept(k), state()
    layer_tables(sketch_layer, family=..., heads=H, key_dim=K) -> SketchTables; Precision; parse_dtype

Modules: ``precision`` (dtypes of checkpoint, read copy, math), ``sketch`` (one layer's sketch
tables: the kernels' ``SketchTables``, read in the compute dtype), ``state`` (decode-state objects),
``families`` (the transformers kernel-function contracts), ``patch`` (plugging the modes into a
transformers model).
"""

from sketchcal.runtime.patch import Runtime, disable, enable, enabled, runtime_of
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
    "DEFAULT_WINDOW",
    "MODES",
    "READ_DTYPES",
    "Checkpoint",
    "DecodeState",
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
