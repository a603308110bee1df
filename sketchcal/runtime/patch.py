"""Run a transformers model's recurrent mixers in ``standard``, ``replay`` or ``sketch`` mode.

:func:`enable` patches only the mixers' recurrent step: the module-level kernel functions of the
modeling module (the same names :class:`~sketchcal.models.MixerTap` taps) are replaced by
dispatchers, and forward hooks on the mixers tell a dispatcher which layer (and which cache) is
calling. Conv states, attention layers, norms and projections run unchanged; calls from mixers of
other models pass straight through.

Window rule. A call that starts a sequence (the prefill function with no initial state) runs its
first ``prefill`` tokens (all of them when ``prefill`` is None, as in ``generate()``) through the
model's own prefill; the state after them is the first checkpoint, and windows of L tokens start
there. Every later token (the rest of that call, each ``generate()`` step, the tokens of any call
that continues a cached state) is a decode step in the chosen mode. In ``standard`` mode on the
reference backend decode steps run the model's own one-token function; with ``prefill`` None it
changes nothing at all.

Per sequence and layer the decode state (:mod:`sketchcal.runtime.state` or
:mod:`sketchcal.runtime.kernel_state`) lives beside the cache the
model passes to the mixer (a new cache starts a new sequence; a call without a cache is a sequence
of its own). The cache's recurrent state holds the latest checkpoint: it is written at flushes only
(at every step in the triton backend's ``standard`` mode).
Beam search (which reorders caches) is not supported in replay and sketch modes.

Backends. ``reference`` runs the decode states of :mod:`sketchcal.runtime.state` (torch, any
device). ``triton`` runs :mod:`sketchcal.runtime.kernel_state`: each layer's decode steps are the
Triton kernels over a slot pool holding the batch's states (in ``standard`` mode too, where the
reference backend calls the model's own one-token function); prefill stays the model's own.
``auto`` picks ``triton`` when every recurrent layer is on a CUDA device, Triton imports and the
kernels take the configuration, else ``reference``. ``public`` (``standard`` mode, CUDA) runs each
decode call on the family's fastest public kernel over a slot pool
(:mod:`sketchcal.runtime.public_state`): the baseline the triton backend is measured against.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from sketchcal.artifact.sketch import SketchArtifact, read_sketch
from sketchcal.errors import SketchcalError
from sketchcal.models import ModelSpec, describe
from sketchcal.models.capture import pick_implementation, torch_reference
from sketchcal.runtime.families import GLUES, FunctionGlue
from sketchcal.runtime.precision import Precision, parse_dtype
from sketchcal.runtime.sketch import SKETCH_MAPS, SketchTables, layer_tables
from sketchcal.runtime.state import DEFAULT_WINDOW, MODES, DecodeState, Probe, make_state

BACKENDS = ("auto", "triton", "reference", "public")


@dataclass
class _Active:
    runtime: Runtime
    layer: int
    cache: Any


_CURRENT: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("sketchcal_runtime", default=None)


class _Dispatcher:
    """Stands in for one kernel function of a modeling module while any runtime uses that module."""

    def __init__(self, module, name: str, kind: str):
        self.module_name, self.name, self.kind = module.__name__, name, kind
        self.original = getattr(module, name)
        self.reference = torch_reference(self.original)
        self.signature = inspect.signature(self.reference)
        self.users = 0
        # a MixerTap entered later binds arguments by this signature; no ``__wrapped__``, so it
        # calls the dispatcher rather than the reference behind it
        self.__signature__ = self.signature
        self.__name__ = name

    def impl(self, tensors: Any) -> Callable:
        """The original on a GPU, its torch reference otherwise (as MixerTap)."""
        return pick_implementation(self.original, self.reference, tensors)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        active = _CURRENT.get()
        if active is None or active.runtime.module_name != self.module_name:
            return self.impl([*args, *kwargs.values()])(*args, **kwargs)
        return active.runtime._call(self.kind, args, kwargs, active)


_DISPATCHERS: dict[tuple[str, str], _Dispatcher] = {}


def _install(module, name: str, kind: str) -> _Dispatcher:
    """Put the dispatcher of ``module.name`` in place (once, however many runtimes use it)."""
    key = (module.__name__, name)
    disp = _DISPATCHERS.get(key)
    if disp is None or disp.users == 0:
        if disp is None or getattr(module, name) is not disp:
            disp = _Dispatcher(module, name, kind)  # wraps whatever is bound there now
            _DISPATCHERS[key] = disp
        setattr(module, name, disp)
    disp.users += 1
    return disp


def _uninstall(module, disp: _Dispatcher) -> None:
    disp.users -= 1
    if disp.users == 0 and getattr(module, disp.name) is disp:
        setattr(module, disp.name, disp.original)


def _cache_of(args: tuple, kwargs: dict[str, Any]) -> Any:
    """The cache a mixer was called with (keyword in every supported architecture), or None."""
    for name in ("cache", "cache_params", "past_key_values"):
        if kwargs.get(name) is not None:
            return kwargs[name]
    from transformers.cache_utils import Cache

    return next((a for a in args if isinstance(a, Cache)), None)


def _flatten(bound: inspect.BoundArguments) -> dict[str, Any]:
    named = dict(bound.arguments)
    named.update(named.pop("kwargs", {}) or {})
    return named


class Runtime:
    """An enabled model: its mode, window, precision and per-sequence decode states.

    Use :func:`enable` to make one. ``backend`` is ``"reference"`` or ``"triton"`` (resolved).
    ``last_states`` maps layer → decode state of the sequence most recently processed (for
    inspection: ``last_states[i].ckpt``, ``.pos``, ``.state()``).
    """

    def __init__(
        self,
        model: nn.Module,
        spec: ModelSpec,
        mode: str,
        *,
        window: int,
        precision: Precision,
        tables: dict[int, Any],
        prefill: int | None,
        probe: Probe | None,
        backend: str = "reference",
        buffer_dtype: torch.dtype = torch.float32,
        sketch_map: str = "static",
    ):
        self.model, self.spec, self.mode = model, spec, mode
        self.sketch_map = sketch_map
        self.window, self.precision, self.tables = window, precision, tables
        self.prefill, self.probe = prefill, probe
        self.backend, self.buffer_dtype = backend, buffer_dtype
        self.glue: FunctionGlue = GLUES[spec.family]
        self.module = importlib.import_module(spec.arch.module)
        self.module_name = self.module.__name__
        self.shapes = {s.layer: s for s in spec.layers}
        self.last_states: dict[int, DecodeState] = {}
        self._loose: dict[int, DecodeState] | None = None
        self._by_id: dict[int, dict[int, DecodeState]] = {}
        self._by_cache: weakref.WeakKeyDictionary[Any, dict[int, DecodeState]] = weakref.WeakKeyDictionary()
        self._stack = contextlib.ExitStack()
        self._tokens: list[contextvars.Token] = []
        self._dispatchers: dict[str, _Dispatcher] = {}
        self.active = False
        # Write each new checkpoint into the cache's recurrent state (what a reader of the cache
        # sees); the graph decoder turns it off, as its pool is the only copy it keeps.
        self.mirror_cache = True

    @property
    def holds_states(self) -> bool:
        """Whether decode steps keep the recurrent states in the runtime's own decode states (all but
        the reference backend's ``standard`` mode, which runs the model's own one-token function)."""
        return not (self.mode == "standard" and self.backend == "reference")

    # ---- lifecycle -------------------------------------------------------------------------

    def _start(self) -> None:
        adapter = self.spec.adapter
        for kind, name in (("prefill", adapter.prefill_fn), ("decode", adapter.decode_fn)):
            if getattr(self.module, name, None) is None:
                raise SketchcalError(
                    f"{self.module_name} has no {name}(): this transformers version is not supported; "
                    "install transformers>=5.17"
                )
            disp = _install(self.module, name, kind)
            self._dispatchers[kind] = disp
            self._stack.callback(_uninstall, self.module, disp)
        for mixer in self.spec.mixers(self.model):
            pre = mixer.register_forward_pre_hook(self._enter, with_kwargs=True)
            post = mixer.register_forward_hook(self._leave, with_kwargs=True, always_call=True)
            self._stack.callback(pre.remove)
            self._stack.callback(post.remove)
        self.active = True

    def disable(self) -> None:
        """Restore the model (idempotent)."""
        if not self.active:
            return
        self._stack.close()
        self.active = False
        if _ENABLED.get(self.model) is self:
            del _ENABLED[self.model]

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disable()

    def _enter(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        self._tokens.append(_CURRENT.set(_Active(self, module.layer_idx, _cache_of(args, kwargs))))

    def _leave(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._tokens:
            _CURRENT.reset(self._tokens.pop())

    # ---- states ----------------------------------------------------------------------------

    def states(self, cache: Any = None) -> dict[int, DecodeState]:
        """Decode states of the sequence held by ``cache`` (None: the last sequence processed)."""
        if cache is None:
            return self.last_states
        try:
            return self._by_cache.get(cache, {})
        except TypeError:
            return self._by_id.get(id(cache), {})

    def adopt(self, cache: Any, slot: int, donor: Any, buffered: int, row: int = 0) -> None:
        """Make row ``slot`` of the batch in ``cache`` the sequence in row ``row`` of ``donor`` (a
        cache just prefilled), ``buffered`` tokens into the batch's window: every layer's state of
        that row becomes the donor's (the batch's other rows are untouched). Nothing to do when the
        model's own decode keeps the states in the caches (:attr:`holds_states` False)."""
        if not self.holds_states:
            return
        into, src = self.states(cache), self.states(donor)
        if not into or set(into) != set(src):
            raise SketchcalError("adopt: both caches must have been prefilled through this runtime")
        for layer, state in into.items():
            if not 0 <= row < src[layer].ckpt.state.shape[0]:
                raise SketchcalError(f"adopt: the donor cache has no row {row}")
            state.adopt(slot, src[layer], buffered, row)

    def _registry(self, cache: Any, layer: int, fresh: bool) -> dict[int, DecodeState]:
        """The per-layer states of the sequence this call belongs to."""
        if cache is not None:
            try:
                reg = self._by_cache.setdefault(cache, {})
            except TypeError:  # a cache class that cannot be weakly referenced or hashed
                reg = self._by_id.setdefault(id(cache), {})
        else:  # no cache: one forward pass is one sequence; a layer starting again starts a new one
            if fresh and (self._loose is None or layer in self._loose):
                self._loose = {}
            reg = self._loose if self._loose is not None else {}
        self.last_states = reg
        return reg

    def _new_state(self, layer: int, checkpoint: Tensor) -> Any:
        if self.backend == "public":
            from sketchcal.runtime.public_state import PublicStandardState

            return PublicStandardState(self.spec.family, checkpoint.float(), layer=layer)
        common = dict(
            window=self.window,
            precision=self.precision,
            tables=self.tables.get(layer),
            layer=layer,
            probe=self.probe,
        )
        if self.backend == "triton":
            from sketchcal.runtime.kernel_state import make_kernel_state

            return make_kernel_state(
                self.mode,
                self.spec.family,
                checkpoint.float(),
                groups=self.shapes[layer].groups,
                buffer_dtype=self.buffer_dtype,
                adaptive=self.sketch_map == "adaptive",
                **common,
            )
        return make_state(
            self.mode, self.spec.family, checkpoint.float(), sketch_map=self.sketch_map, **common
        )

    # ---- the patched call ------------------------------------------------------------------

    def _call(self, kind: str, args: tuple, kwargs: dict[str, Any], active: _Active) -> Any:
        disp = self._dispatchers[kind]
        bound = disp.signature.bind(*args, **kwargs)
        passed = _flatten(bound)
        bound.apply_defaults()
        named = _flatten(bound)
        impl = disp.impl(passed.values())
        glue, layer = self.glue, active.layer
        if named.get("cu_seqlens") is not None:
            raise SketchcalError("packed sequences (cu_seqlens) are not supported by the sketchcal runtime")
        s_in = named.get(glue.decode_state if kind == "decode" else glue.prefill_state)
        fresh = s_in is None
        n_tokens = glue.num_tokens(named) if kind == "prefill" else 1
        own = not self.holds_states  # the model's own decode steps
        if own and (not fresh or self.prefill is None or self.prefill >= n_tokens):
            return impl(*args, **kwargs)
        registry = self._registry(active.cache, layer, fresh)
        if not fresh:  # decode steps continuing a cached state
            state = self._resume(registry, layer, s_in, named)
            flushes = state.flushes
            out = self._step(state, kind, named)
            if not self.mirror_cache and kind == "decode":  # the cache's tensor is handed back untouched
                return glue.decode_result(named, out, s_in)
            ckpt_hf = glue.from_key_major(state.ckpt.state).float()
            if kind == "prefill":
                return glue.prefill_result(named, out, ckpt_hf)
            if glue.family == "mamba2" and (state.mode == "standard" or state.flushes != flushes):
                s_in.copy_(ckpt_hf)  # this function updates the cache's state in place: when it is written
            return glue.decode_result(named, out, ckpt_hf)
        n0 = n_tokens if self.prefill is None else min(self.prefill, n_tokens)
        out0, s_hf = self._own_prefill(impl, (args, kwargs), named, n0, layer)
        rest = glue.slice_tokens(named, n0, n_tokens)
        if own:
            decode_impl = self._dispatchers["decode"].impl(passed.values())
            out1, s_hf = glue.own_steps(decode_impl, rest, s_hf)
            return glue.prefill_result(named, torch.cat([out0.float(), out1], dim=1), s_hf)
        state = self._new_state(layer, glue.to_key_major(s_hf))
        registry[layer] = state
        outs = [out0.float()]
        if n0 < n_tokens:
            outs.append(self._step(state, "prefill", rest).float())
        if self.mirror_cache:
            ckpt_hf = glue.from_key_major(state.ckpt.state).float()
        else:  # the pool is the only copy: the cache gets an empty placeholder, not a second state
            ckpt_hf = s_hf.new_empty((*s_hf.shape[:-1], 0))
        return glue.prefill_result(named, torch.cat(outs, dim=1), ckpt_hf)

    def _resume(self, registry: dict[int, Any], layer: int, s_hf: Tensor, named) -> Any:
        """The decode state this call continues; a cached state never seen before becomes a checkpoint."""
        state = registry.get(layer)
        if state is not None and state.ckpt.state.shape[0] != self.glue.batch(named):
            raise SketchcalError(
                "the batch changed in the middle of a sequence (beam search?): the sketchcal runtime "
                "supports greedy and sampled decoding"
            )
        if state is None:
            state = self._new_state(layer, self.glue.to_key_major(s_hf))
            registry[layer] = state
        return state

    def _step(self, state: Any, kind: str, named: dict[str, Any]) -> Tensor:
        """Decode steps of ``named``'s tokens in ``state``: outputs [B, T, H, V] (the triton backend:
        in the kernels' dtype, which the call's result casts once to the model's)."""
        if self.backend == "public":
            return state.step_args(named)
        if self.backend != "triton":
            return state.step(self._inputs(kind, named))
        fused = getattr(self.spec.adapter, "fused_inputs", None)
        x = self._inputs(kind, named) if fused is None else fused(named, state.input_dtype)
        return state.step(x, out_dtype=None)

    def _inputs(self, kind: str, named: dict[str, Any]):
        dtype = torch.float32 if self.backend == "triton" else torch.float64  # what the kernels take
        return self.spec.adapter.inputs(kind, named, dtype, step_dynamics=True)[0]  # decode steps

    def _own_prefill(
        self, impl: Callable, call: tuple[tuple, dict[str, Any]], named: dict[str, Any], n0: int, layer: int
    ) -> tuple[Tensor, Tensor]:
        """The model's own prefill of the first ``n0`` tokens: outputs, final state (transformers layout).

        The call keeps the caller's positional / keyword layout (a GPU kernel may name its
        parameters differently from the torch reference).
        """
        glue = self.glue
        if n0 == 0:
            shape, ref = self.shapes[layer], named[glue.token_args[0]]
            s = torch.zeros(ref.shape[0], shape.heads, shape.key_dim, shape.value_dim, device=ref.device)
            empty = ref.new_zeros(ref.shape[0], 0, shape.heads, shape.value_dim, dtype=torch.float32)
            return empty, glue.from_key_major(s)
        args, kwargs = call
        names = list(self._dispatchers["prefill"].signature.parameters)
        new_args = [a[:, :n0] if names[i] in glue.token_args else a for i, a in enumerate(args)]
        new_kwargs = {k: v[:, :n0] if k in glue.token_args else v for k, v in kwargs.items()}
        if glue.final_flag in names[: len(args)]:
            new_args[names.index(glue.final_flag)] = True
        else:
            new_kwargs[glue.final_flag] = True
        out, state = impl(*new_args, **new_kwargs)
        return out, state


_ENABLED: weakref.WeakKeyDictionary[nn.Module, Runtime] = weakref.WeakKeyDictionary()


def _load_artifact(artifact: str | Path | SketchArtifact | None, spec: ModelSpec) -> SketchArtifact | None:
    """The sketch, checked against the model it will run with (fingerprint of its description)."""
    if artifact is None:
        return None
    art = artifact if isinstance(artifact, SketchArtifact) else read_sketch(artifact)
    if art.fingerprint != spec.fingerprint:
        raise SketchcalError(
            f"the sketch was fitted for another model (fingerprint {art.fingerprint[:12]}…, this model "
            f"{spec.fingerprint[:12]}…); use the base model it was converted from, or reconvert"
        )
    return art


def _artifact_window(art: SketchArtifact) -> int:
    window = art.config.get("window", art.metadata.get("window"))
    try:
        return int(window)
    except (TypeError, ValueError):
        raise SketchcalError("the sketch has no valid window length; reconvert it") from None


def _sketch_map(sketch_map: str | None, art: SketchArtifact | None, mode: str) -> str:
    """The sketch map ``enable`` runs: the one asked for, else the artifact's, else static."""
    if sketch_map is None:
        sketch_map = art.sketch_map if art is not None else "static"
    if sketch_map not in SKETCH_MAPS:
        raise SketchcalError(f"sketch_map must be one of {', '.join(SKETCH_MAPS)}, got {sketch_map!r}")
    return sketch_map if mode == "sketch" else "static"


def _resolve_backend(
    backend: str, mode: str, spec: ModelSpec, precision: Precision, probe: Probe | None, devices: list
) -> str:
    """``reference``, ``triton`` or ``public`` for ``backend`` (see :func:`enable`); a one-line
    error where ``triton`` or ``public`` was asked for and cannot run."""
    if backend not in BACKENDS:
        raise SketchcalError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "reference":
        return backend
    on_cuda = bool(devices) and all(d.type == "cuda" for d in devices)
    if backend == "public":
        return _public_backend(mode, spec, probe, on_cuda)
    if backend == "auto" and not on_cuda:
        return "reference"
    try:
        from sketchcal.runtime.kernel_state import interpreting, unsupported
    except ImportError as err:
        if backend == "auto":
            return "reference"
        raise SketchcalError(f"backend='triton' needs Triton ({err}); use backend='reference'") from None
    if not on_cuda and not interpreting():
        raise SketchcalError(
            "backend='triton' runs the decode kernels on a CUDA GPU: move the model to a GPU or use "
            "backend='reference'"
        )
    why = unsupported(mode, spec.layers, precision, probe)
    if why is None:
        return "triton"
    if backend == "auto":
        return "reference"
    raise SketchcalError(f"backend='triton': {why}; use backend='reference'")


def _public_backend(mode: str, spec: ModelSpec, probe: Probe | None, on_cuda: bool) -> str:
    """``public`` where it can run, else a one-line error saying what to change."""
    from sketchcal.kernels import public
    from sketchcal.runtime.kernel_state import interpreting

    if mode != "standard":
        raise SketchcalError(
            f"backend='public' runs standard decoding only, not {mode}; use backend='triton'"
        )
    if probe is not None:
        raise SketchcalError("backend='public' takes no probe; use backend='reference'")
    if not on_cuda and not interpreting():
        raise SketchcalError("backend='public' runs public CUDA kernels: move the model to a GPU")
    why = public.available(spec.family)
    if why is not None:
        raise SketchcalError(f"backend='public': {why}; install it or use backend='triton'")
    return "public"


def _layer_tables(backend: str, layer, family: str, shape, device) -> SketchTables:
    """One layer's sketch tables (the kernels' :class:`SketchTables`, which both backends read)."""
    if backend == "triton":
        from sketchcal.runtime.kernel_state import kernel_tables

        return kernel_tables(layer, family, heads=shape.heads, key_dim=shape.key_dim, device=device)
    return layer_tables(layer, family=family, heads=shape.heads, key_dim=shape.key_dim, device=device)


def enable(
    model: nn.Module,
    artifact: str | Path | SketchArtifact | None = None,
    mode: str = "sketch",
    *,
    window: int | None = None,
    read_dtype: str | torch.dtype | None = None,
    shared: bool = False,
    prefill: int | None = None,
    compute_dtype: str | torch.dtype = "fp32",
    probe: Probe | None = None,
    backend: str = "auto",
    buffer_dtype: str | torch.dtype | None = None,
    sketch_map: str | None = None,
) -> Runtime:
    """Make ``model.generate()`` and forward passes decode in ``mode``; returns the :class:`Runtime`.

    Args:
        model: a supported transformers model (any device).
        artifact: a directory written by ``sketchcal convert`` or a loaded
            :class:`~sketchcal.artifact.SketchArtifact`; needed for ``sketch``, optional otherwise
            (it supplies the window). Its fingerprint must match the model.
        mode: ``standard`` (the model's own step), ``replay`` (checkpoint + buffer) or ``sketch``.
        window: flush every ``window`` tokens (default: the artifact's, else 16).
        read_dtype: precision of the read copy / sketch: fp32, bf16, fp16 or fp8 (default: the
            artifact's ``traffic.read_dtype``, else fp32). The checkpoint stays fp32.
        shared: store the checkpoint itself in ``read_dtype`` (the single-precision ablation).
        prefill: tokens of a fresh sequence run by the model's own prefill before decode steps
            start (None: the whole first call, as ``generate()`` wants; an int for teacher forcing).
        compute_dtype: dtype of the runtime math (fp32; fp64 for references).
        probe: observer of reads and flushes (see :class:`~sketchcal.runtime.state.Probe`); the
            triton backend reports flushes only, and a probe that wants exact reads takes the
            reference backend.
        backend: ``triton`` (the decode kernels over a slot pool per layer; CUDA, or the CPU
            interpreter with ``TRITON_INTERPRET=1``), ``reference`` (torch), or ``auto``: triton
            when every recurrent layer is on CUDA, Triton imports and the kernels take the
            configuration (fp32 math, no ``shared``, an fp32, bf16 or fp8 read copy, power-of-two
            K, V ≥ 16, no probe of exact reads), else reference. ``public``: ``standard`` mode on
            the family's fastest public kernel (fla, vLLM) over a slot pool, for comparison.
        buffer_dtype: triton backend: dtype of the buffered inputs, fp32 or bf16 (default: the
            artifact's ``traffic.buffer_dtype``, else bf16, on CUDA; fp32 in the interpreter).
            fp32 makes replay exact to fp32 rounding; bf16 halves the buffer traffic. Ignored when
            ``auto`` picks the reference backend.
        sketch_map: ``sketch`` mode: ``static`` (the artifact's offline coefficient maps) or
            ``adaptive`` (a map of each new checkpoint, made at its flush from the artifact's bases:
            a rank-m head then reads m·(V + K) values); default: the artifact's ``sketch_map``, else
            static. The triton backend makes the factors in a kernel after each flush
            (``kernels.common.adaptive``); the public backend has no adaptive sketch.

    Raises:
        SketchcalError: unsupported model, unknown mode, backend or dtype, a sketch that does not
            fit the model or the kernels, ``sketch`` mode without an artifact, or ``backend="triton"``
            where the kernels cannot run.
    """
    if mode not in MODES:
        raise SketchcalError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if prefill is not None and prefill < 0:
        raise SketchcalError(f"prefill must be None or ≥ 0, got {prefill}")
    spec = describe(model)
    art = _load_artifact(artifact, spec)
    if mode == "sketch" and art is None:
        raise SketchcalError("sketch mode needs a converted model directory (sketchcal convert --out DIR)")
    if art is not None and art.config.get("family", spec.family) != spec.family:
        raise SketchcalError(
            f"the sketch is for {art.config.get('family')} layers, the model has {spec.family} layers"
        )
    if window is None:
        window = _artifact_window(art) if art is not None else DEFAULT_WINDOW
    if int(window) < 1:
        raise SketchcalError(f"window must be at least 1, got {window}")
    if read_dtype is None:
        read_dtype = (art.config.get("traffic", {}).get("read_dtype") if art is not None else None) or "fp32"
    precision = Precision(
        read_dtype=parse_dtype(read_dtype),
        shared=shared,
        compute_dtype=parse_dtype(compute_dtype, "compute dtype"),
    )
    if mode == "standard" and (shared or precision.read_dtype != torch.float32):
        raise SketchcalError("standard mode keeps the full fp32 state: read_dtype and shared do not apply")
    if backend == "reference" and buffer_dtype is not None:
        raise SketchcalError("buffer_dtype applies to the triton backend only")
    sketch_map = _sketch_map(sketch_map, art, mode)
    if sketch_map == "adaptive" and backend == "public":
        raise SketchcalError("backend='public' has no adaptive sketch; use backend='triton' or 'reference'")
    devices = {m.layer_idx: next(m.parameters()).device for m in spec.mixers(model)}  # device_map safe
    backend = _resolve_backend(backend, mode, spec, precision, probe, list(devices.values()))
    buffers = torch.float32
    if backend == "triton":
        from sketchcal.runtime.kernel_state import buffer_dtype_for

        traffic = art.config.get("traffic", {}) if art is not None else {}
        first = next(iter(devices.values()))
        buffers = buffer_dtype_for(buffer_dtype, first, traffic.get("buffer_dtype"))
    tables: dict[int, Any] = {}
    if mode == "sketch":
        for shape in spec.layers:
            try:
                layer = art.layer(shape.layer)
            except KeyError:
                raise SketchcalError(f"the sketch has no layer {shape.layer}; reconvert it") from None
            # the adaptive sketch reads no offline map: any rank the artifact gives runs
            kind = "reference" if sketch_map == "adaptive" else backend
            tables[shape.layer] = _layer_tables(kind, layer, spec.family, shape, devices[shape.layer])
    previous = _ENABLED.get(model)
    if previous is not None:
        previous.disable()
    runtime = Runtime(
        model,
        spec,
        mode,
        window=int(window),
        precision=precision,
        tables=tables,
        prefill=prefill,
        probe=probe,
        backend=backend,
        buffer_dtype=buffers,
        sketch_map=sketch_map,
    )
    runtime._start()
    _ENABLED[model] = runtime
    return runtime


def disable(model: nn.Module) -> None:
    """Restore ``model`` if a runtime is enabled on it."""
    runtime = _ENABLED.get(model)
    if runtime is not None:
        runtime.disable()


def runtime_of(model: nn.Module) -> Runtime | None:
    """The runtime enabled on ``model``, if any."""
    return _ENABLED.get(model)


@contextlib.contextmanager
def enabled(
    model: nn.Module, artifact: str | Path | SketchArtifact | None = None, mode: str = "sketch", **kw: Any
):
    """``with enabled(model, art, mode="replay", prefill=64) as rt:`` — :func:`enable`, then restore."""
    runtime = enable(model, artifact, mode, **kw)
    try:
        yield runtime
    finally:
        runtime.disable()
