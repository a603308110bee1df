"""Tap the recurrent mixers of a loaded model: every call of a mixer's kernel function is
converted to :class:`~sketchcal.kernels.common.StepInputs` and handed to a callback.

The mixers call module-level functions of their transformers modeling module (a chunked
prefill and a one-token decode). While a :class:`MixerTap` is active those names are replaced
by wrappers that (1) convert the arguments with the family adapter, (2) run the original
function (its torch reference on the CPU, so kernels that need a GPU are never called there)
and (3) report the call, tagged with the calling mixer's layer index. :class:`OutputCapture`
wraps the same functions to collect each call's output instead (for gradients with respect to it).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from sketchcal.errors import SketchcalError
from sketchcal.kernels.common import StepInputs
from sketchcal.models.base import FamilyAdapter
from sketchcal.models.spec import ModelSpec

# Kernel-backed helpers that the mixers also call; on the CPU they must take the torch path.
_AUX_FUNCTIONS = ("causal_conv1d_fn", "causal_conv1d_update", "mamba2_split_conv1d_scan_combined")


@dataclass
class MixerCall:
    """One call of a mixer's recurrence.

    ``inputs`` is float64 [B, T, H, ...] (T = 1 for decode); ``initial_state`` the state it
    started from, key-major [B, H, K, V] float64 (None = zeros); ``output`` the function's
    pre-gate output [B, T, H, V] when the tap records outputs.
    """

    layer: int
    kind: str  # "prefill" | "decode"
    inputs: StepInputs
    initial_state: Tensor | None
    output: Tensor | None = None


def torch_reference(fn: Callable) -> Callable:
    """The torch implementation behind a transformers kernel function.

    transformers wraps it with ``functools.wraps`` (``__wrapped__``); with the ``kernels`` package
    installed (a dependency from transformers 5.25) that wrapper is itself held by an ``nn.Module``
    standing in for the function, whose ``forward`` closes over it as ``func``.
    """
    if isinstance(fn, nn.Module):
        forward = type(fn).forward
        cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or (), strict=True))
        if "func" in cells:
            fn = cells["func"].cell_contents
    return getattr(fn, "__wrapped__", fn)


def pick_implementation(original: Callable, reference: Callable, args: Iterable[Any]) -> Callable:
    """The bound kernel when any tensor argument is on a GPU, else the torch reference: GPU-only
    kernels (fla, mamba-ssm, causal-conv1d) never run on the CPU."""
    on_gpu = any(isinstance(a, Tensor) and a.is_cuda for a in args)
    return original if on_gpu else reference


def _modeling_module(spec: ModelSpec):
    return importlib.import_module(spec.arch.module)


@contextlib.contextmanager
def _patched(module, replacements: dict[str, Callable]) -> Iterator[None]:
    saved = {name: getattr(module, name) for name in replacements}
    try:
        for name, fn in replacements.items():
            setattr(module, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def use_torch_path(spec: ModelSpec) -> None:
    """Bind the modeling module's kernel functions to their torch references, for good.

    transformers binds optional GPU kernels (flash-linear-attention, mamba-ssm, causal-conv1d)
    at import when they are installed; they fail on a machine without a GPU.
    """
    module = _modeling_module(spec)
    for name in (spec.adapter.prefill_fn, spec.adapter.decode_fn, *_AUX_FUNCTIONS):
        fn = getattr(module, name, None)
        if fn is not None:
            setattr(module, name, torch_reference(fn))


class _MixerPatch:
    """Replace the modeling module's kernel functions by ``_wrap(kind, original, adapter)`` while
    active, with forward hooks on the mixers that tell the wrappers which layer is calling."""

    def __init__(self, model: nn.Module, spec: ModelSpec):
        self.model, self.spec = model, spec
        self._layer: int | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        module = _modeling_module(self.spec)
        adapter = self.spec.adapter
        replacements = {}
        for kind, name in (("prefill", adapter.prefill_fn), ("decode", adapter.decode_fn)):
            original = getattr(module, name, None)
            if original is None:
                raise SketchcalError(
                    f"{self.spec.arch.module} has no {name}(): this transformers version is not supported; "
                    "install transformers>=5.17"
                )
            replacements[name] = self._wrap(kind, original, adapter)
        self._stack.enter_context(_patched(module, replacements))
        for mixer in self.spec.mixers(self.model):
            self._stack.enter_context(self._layer_hooks(mixer))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @contextlib.contextmanager
    def _layer_hooks(self, mixer: nn.Module) -> Iterator[None]:
        def enter(module: nn.Module, args: Any, kwargs: Any = None) -> None:
            self._layer = module.layer_idx

        def leave(module: nn.Module, args: Any, *rest: Any) -> None:
            self._layer = None

        handles = [
            mixer.register_forward_pre_hook(enter, with_kwargs=True),
            mixer.register_forward_hook(leave, with_kwargs=True),
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _wrap(self, kind: str, original: Callable, adapter: FamilyAdapter) -> Callable:
        raise NotImplementedError


class MixerTap(_MixerPatch):
    """Context manager reporting every recurrent-mixer call of ``model`` to ``on_call``.

    ``record_outputs`` also reports each call's pre-gate output (for tests; it costs a copy).
    ``step_dynamics``: convert the arguments of chunked calls as the one-token function computes
    (Mamba-2: no dt limit), the dynamics that decoding has (calibration).
    """

    def __init__(
        self,
        model: nn.Module,
        spec: ModelSpec,
        on_call: Callable[[MixerCall], None],
        record_outputs: bool = False,
        step_dynamics: bool = False,
    ):
        super().__init__(model, spec)
        self.on_call, self.record_outputs, self.step_dynamics = on_call, record_outputs, step_dynamics

    def __enter__(self) -> MixerTap:
        return super().__enter__()

    def _wrap(self, kind: str, original: Callable, adapter: FamilyAdapter) -> Callable:
        reference = torch_reference(original)
        signature = inspect.signature(reference)

        @functools.wraps(reference)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            named = dict(bound.arguments)
            named.update(named.pop("kwargs", {}) or {})
            impl = pick_implementation(original, reference, named.values())
            layer = self._layer
            if layer is None:  # called from outside a tapped mixer
                return impl(*args, **kwargs)
            inputs, state = adapter.inputs(kind, named, step_dynamics=self.step_dynamics)
            output = None
            if self.record_outputs:
                output = self._pre_gate_output(kind, reference, named, adapter)
            result = impl(*args, **kwargs)
            if self.record_outputs and output is None:
                output = adapter.pre_gate_output(kind, result).float()
            self.on_call(MixerCall(layer, kind, inputs, state, output))
            return result

        return wrapper

    @staticmethod
    def _pre_gate_output(kind: str, reference: Callable, named: dict[str, Any], adapter: FamilyAdapter):
        """When a decode call gates its output internally (``z``), rerun it ungated on a copy."""
        if named.get("z") is None:
            return None
        ungated = dict(named, z=None)
        if "state" in ungated:
            ungated["state"] = ungated["state"].clone()  # the function updates the state in place
        with torch.no_grad():
            return adapter.pre_gate_output(kind, reference(**ungated)).float()


class OutputCapture(_MixerPatch):
    """Context manager collecting the pre-gate output [B, T, H, V] of every recurrent-mixer call of
    ``model``, by layer, as the tensor the model goes on computing with (so that gradients with
    respect to it can be taken). The mixers must not gate inside the kernel function (every
    supported architecture passes ``z=None``). ``reference``: call the torch references on a GPU
    too, for a kernel library whose backward fails there."""

    def __init__(self, model: nn.Module, spec: ModelSpec, reference: bool = False):
        super().__init__(model, spec)
        self.reference = reference  # the torch references on every device (their backward is plain torch)
        self.outputs: dict[int, list[Tensor]] = {}

    def __enter__(self) -> OutputCapture:
        return super().__enter__()

    def _wrap(self, kind: str, original: Callable, adapter: FamilyAdapter) -> Callable:
        reference = torch_reference(original)

        @functools.wraps(reference)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            args_ = [*args, *kwargs.values()]
            impl = reference if self.reference else pick_implementation(original, reference, args_)
            result = impl(*args, **kwargs)
            if self._layer is not None:
                self.outputs.setdefault(self._layer, []).append(adapter.pre_gate_output(kind, result))
            return result

        return wrapper
