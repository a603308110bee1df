"""Route a vLLM module's decode function to the served layer that is calling it.

A served layer runs its class's own forward (projections, conv, vLLM's prefill: everything but the
recurrent decode step) with itself marked as the active layer (:func:`active`); the module-level
function that forward calls for the decode step is replaced, once per process, by a
:class:`Interceptor` that hands the call to the active layer's ``decode_call`` and calls vLLM's
original for every other caller (a model without a sketch, another layer class).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
from collections.abc import Iterator
from typing import Any

_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("sketchcal_vllm_layer", default=None)


class Interceptor:
    """Stands in for ``module.name``; ``kind`` tells the active layer which call it gets."""

    def __init__(self, module: Any, name: str, kind: str):
        self.module, self.name, self.kind = module, name, kind
        self.original = getattr(module, name)
        self.__name__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        layer = _ACTIVE.get()
        if layer is None:
            return self.original(*args, **kwargs)
        return layer.decode_call(self.kind, self.original, args, kwargs)


def install(module_name: str, name: str, kind: str) -> Interceptor:
    """Put an :class:`Interceptor` in place of ``module_name.name`` (idempotent)."""
    module = importlib.import_module(module_name)
    current = getattr(module, name)
    if isinstance(current, Interceptor):
        return current
    icpt = Interceptor(module, name, kind)
    setattr(module, name, icpt)
    return icpt


@contextlib.contextmanager
def active(layer: Any) -> Iterator[None]:
    """Mark ``layer`` as the caller of intercepted functions for the duration of the block."""
    token = _ACTIVE.set(layer)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
