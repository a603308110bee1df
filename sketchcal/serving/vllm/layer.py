"""What every served recurrent layer adds to vLLM's layer class (a mixin placed before it).

A served layer is constructed by vLLM exactly as its base class (``PluggableLayer.register_oot``
swaps the class by name). When the vLLM config being built serves a sketch
(:func:`~sketchcal.serving.vllm.settings.serve_settings`), the layer

- appends the tensors of its :class:`~sketchcal.serving.vllm.page.PagePlan` to the states it
  declares, so vLLM's pages hold them;
- runs its base forward with itself marked active, so the decode step it calls reaches
  :meth:`decode_call` (the family subclass turns the call's arguments into
  :class:`~sketchcal.kernels.common.StepInputs` and runs :class:`WindowDecoder`), and with
  ``kv_cache`` showing vLLM's own states only (:meth:`base_forward`: vLLM's code unpacks them);
- settles the rows vLLM's own prefill path computed (:meth:`settle`): their cursors restart at 0
  and their read copy and sketch (and the adaptive sketch's factors) are written from the new
  checkpoint.

Otherwise every method is the base class's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from sketchcal.errors import SketchcalError
from sketchcal.serving.vllm.decode import WindowDecoder
from sketchcal.serving.vllm.intercept import active, install
from sketchcal.serving.vllm.page import PagePlan, Pages
from sketchcal.serving.vllm.settings import ServeSettings, serve_settings


def page_plan(settings: ServeSettings, entry: dict[str, Any]) -> PagePlan:
    """The page plan of a layer of ``settings``' model with the shape of sketch layer ``entry``."""
    return PagePlan(
        family=settings.family,
        heads=int(entry["heads"]),
        groups=int(entry["groups"]),
        key_dim=int(entry["key_dim"]),
        value_dim=int(entry["value_dim"]),
        window=settings.window,
        read_dtype=settings.read_dtype,
        buffer_dtype=settings.buffer_dtype,
        map_rows=settings.map_rows,
        # Mamba-2's split sketch read on CUDA (the adaptive sketch runs the one-kernel read)
        workspace=settings.device == "cuda"
        and settings.family == "mamba2"
        and settings.map_rows > 0
        and not settings.adaptive,
        adaptive=settings.adaptive,
    )


def model_page_plan(settings: ServeSettings) -> PagePlan:
    """The page plan every recurrent layer of the model shares (vLLM gives them one page size)."""
    plans = {page_plan(settings, entry) for entry in settings.artifact.config["layers"]}
    if len(plans) != 1:
        raise SketchcalError("the sketch's layers differ in shape; vLLM needs one page per layer kind")
    return plans.pop()


def _tables(settings: ServeSettings, index: int, plan: PagePlan):
    """Sketch mode: the layer's tables, on the device its decode steps run on."""
    if settings.mode != "sketch":
        return None
    from sketchcal.runtime.sketch import layer_tables

    layer = settings.artifact.layer(index)
    tables = layer_tables(
        layer, family=settings.family, heads=plan.heads, key_dim=plan.key_dim, device=settings.device
    )
    # the adaptive factors in the page have the page's rows, which the kernels take from the tables
    return tables.with_map_rows(plan.map_rows) if plan.adaptive else tables


class ServedLayer:
    """Mixin: ``serving`` is None for a layer of a model without a sketch (base behaviour)."""

    serving: ServeSettings | None = None
    plan: PagePlan | None = None
    decoder: WindowDecoder | None = None
    layer_index: int = -1
    base_states: int = 2  # vLLM's own states at the front of the page (conv, recurrent)

    # (module, function): what vLLM's forward calls for the decode step, and the family's adapter
    # (the family subclass sets both)
    vllm_decode: tuple[str, str] = ("", "")
    adapter: Any = None

    def __init__(self, *args: Any, **kwargs: Any):
        from vllm.config import get_current_vllm_config

        super().__init__(*args, **kwargs)
        self.serve_setup(get_current_vllm_config(), self.prefix, self.layer_dims())  # type: ignore[attr-defined]
        if self.serving is not None:
            install(*self.decode_target(), "decode")

    def decode_target(self) -> tuple[str, str]:
        """(module, function) of the decode call this layer's forward makes on its device."""
        return self.vllm_decode

    def layer_dims(self) -> tuple[int, int, int, int]:
        """(heads, groups, key dim, value dim) of this layer as vLLM built it (family subclass)."""
        raise NotImplementedError

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return self.served_shapes(tuple(super().get_state_shape()))  # type: ignore[misc]

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self.served_dtypes(tuple(super().get_state_dtype()))  # type: ignore[misc]

    def serve_setup(self, vllm_config: Any, prefix: str, shape: tuple[int, int, int, int]) -> None:
        """Read the settings; ``shape`` = (heads, groups, key dim, value dim) of this layer as vLLM
        built it, checked against the sketch."""
        from vllm.model_executor.models.utils import extract_layer_index

        settings = serve_settings(vllm_config)
        if settings is None:
            return
        index = extract_layer_index(prefix)
        entry = settings.layer_entry(index)
        got = tuple(int(entry[k]) for k in ("heads", "groups", "key_dim", "value_dim"))
        if got != tuple(shape):
            raise SketchcalError(
                f"sketch layer {index} is (heads, groups, key dim, value dim) = {got}, the model's layer "
                f"{tuple(shape)}; it belongs to another model, reconvert it"
            )
        self.serving, self.layer_index = settings, index
        self.plan = page_plan(settings, entry)
        if self.plan != model_page_plan(settings):
            raise SketchcalError("the sketch's layers differ in shape; vLLM needs one page per layer kind")
        tables = _tables(settings, index, self.plan)
        self.decoder = WindowDecoder(settings.family, settings.window, tables, adaptive=settings.adaptive)

    def served_shapes(self, base: tuple) -> tuple:
        return base if self.plan is None else (*base, *self.plan.shapes)

    def served_dtypes(self, base: tuple) -> tuple:
        return base if self.plan is None else (*base, *self.plan.dtypes)

    def checkpoint_view(self, state: Tensor) -> Tensor:
        """vLLM's recurrent state tensor [N, ...] seen key-major, [N, H, K, V] (family subclass)."""
        raise NotImplementedError

    _pages: tuple | None = None

    @contextlib.contextmanager
    def base_forward(self) -> Iterator[None]:
        """Run the base class's forward inside: this layer is the active caller of the intercepted
        decode function, and ``kv_cache`` holds vLLM's own states only."""
        pages = self.kv_cache  # type: ignore[attr-defined]
        self._pages, self.kv_cache = pages, pages[: self.base_states]
        try:
            with active(self):
                yield
        finally:
            self.kv_cache, self._pages = pages, None

    @contextlib.contextmanager
    def vllm_kernels_continue_decode_rows(self) -> Iterator[None]:
        """:meth:`base_forward` for a layer whose batches with prefill rows run every non-speculative
        row, decode rows included, through vLLM's own kernels from the state in the page (KDA;
        GDN on CUDA): before them the decode rows' buffers are folded into their checkpoints (the
        exact current state), and after them every such row restarts its window from the state
        vLLM wrote."""
        from vllm.forward_context import get_forward_context

        meta = get_forward_context().attn_metadata
        meta = meta.get(self.prefix) if isinstance(meta, dict) else None  # type: ignore[attr-defined]
        chunked = meta is not None and meta.num_prefills > 0
        rows = meta.non_spec_state_indices_tensor if chunked else None
        if chunked:
            self.settle(rows[: meta.num_decodes], buffered=True)
        with self.base_forward():
            yield
        if chunked:
            self.settle(rows[: meta.num_decodes + meta.num_prefills], buffered=False)

    def pages(self) -> Pages:
        """The decode pool over block ids, the cursors and the adaptive factors, viewing this
        layer's bound pages."""
        assert self.plan is not None
        states = self._pages if self._pages is not None else self.kv_cache  # type: ignore[attr-defined]
        return self.plan.pages(self.checkpoint_view(states[1]), states[self.base_states :])

    def settle(self, blocks: Tensor | None, *, buffered: bool) -> None:
        if self.decoder is None or blocks is None:
            return
        self.decoder.settle(self.pages(), blocks.reshape(-1), buffered=buffered)
