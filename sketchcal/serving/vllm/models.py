"""The served model classes: vLLM's own, with page sizes that count the sketchcal tensors.

vLLM sizes a hybrid model's pages from the model class, before any layer exists
(``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config``: the attention block
size is raised until an attention page holds a recurrent one). Each class here subclasses vLLM's
class of the same architecture and appends the layer's :class:`PagePlan` to those shapes and dtypes
when the config serves a sketch (refusing, as vLLM sizes the pages, a recurrent state that is not
fp32); construction swaps the recurrent layer class
(``PluggableLayer.register_oot``) before vLLM builds the layers. For a model without a sketch every
method is vLLM's.

The classes are built on first access (``sketchcal.serving.vllm.models:Sketch<Architecture>``, the
lazy form :func:`sketchcal.serving.vllm.register` hands to ``ModelRegistry.register_model``), so
only the architecture being served is imported.
"""

from __future__ import annotations

import importlib
from typing import Any

from sketchcal.serving.vllm.page import check_checkpoint_dtype
from sketchcal.serving.vllm.settings import serve_settings

# architecture → (vLLM module, class name)
VLLM_CLASSES: dict[str, tuple[str, str]] = {
    "NemotronHForCausalLM": ("vllm.model_executor.models.nemotron_h", "NemotronHForCausalLM"),
    "FalconH1ForCausalLM": ("vllm.model_executor.models.falcon_h1", "FalconH1ForCausalLM"),
    "GraniteMoeHybridForCausalLM": (
        "vllm.model_executor.models.granitemoehybrid",
        "GraniteMoeHybridForCausalLM",
    ),
    "Qwen3NextForCausalLM": ("vllm.model_executor.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("vllm.model_executor.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("vllm.model_executor.models.qwen3_5", "Qwen3_5MoeForCausalLM"),
    "KimiLinearForCausalLM": ("vllm.models.kimi_k3", "KimiLinearForCausalLM"),
}

# family → (module of the served layer, its class, the vLLM layer class name it replaces)
SERVED_LAYERS: dict[str, tuple[str, str, str]] = {
    "mamba2": ("sketchcal.serving.vllm.mamba2", "SketchMambaMixer2", "MambaMixer2"),
    "gdn": ("sketchcal.serving.vllm.gdn", "SketchQwenGatedDeltaNet", "QwenGatedDeltaNetAttention"),
    "kda": ("sketchcal.serving.vllm.kda", "SketchKimiDeltaAttention", "KimiGatedDeltaNetAttention"),
}

PREFIX = "Sketch"


def use_served_layer(family: str) -> None:
    """Swap vLLM's recurrent layer class of ``family`` for the served one, from now on in this process
    (idempotent). Served layers behave as vLLM's for a model without a sketch."""
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot

    module, cls_name, replaces = SERVED_LAYERS[family]
    if replaces in op_registry_oot:
        return
    cls = getattr(importlib.import_module(module), cls_name)
    PluggableLayer.register_oot(cls, name=replaces)


def _page_plan(vllm_config: Any):
    settings = serve_settings(vllm_config)
    if settings is None:
        return None
    from sketchcal.serving.vllm.layer import model_page_plan

    return model_page_plan(settings)


def served_class(architecture: str) -> type:
    """The served subclass of vLLM's class for ``architecture``."""
    module, name = VLLM_CLASSES[architecture]
    base = getattr(importlib.import_module(module), name)

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        settings = serve_settings(vllm_config)
        if settings is not None:
            use_served_layer(settings.family)
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)

    def get_mamba_state_shape_from_config(cls, vllm_config: Any) -> tuple:
        shapes = tuple(base.get_mamba_state_shape_from_config.__func__(cls, vllm_config))
        plan = _page_plan(vllm_config)
        return shapes if plan is None else (*shapes, *plan.shapes)

    def get_mamba_state_dtype_from_config(cls, vllm_config: Any) -> tuple:
        dtypes = tuple(base.get_mamba_state_dtype_from_config.__func__(cls, vllm_config))
        plan = _page_plan(vllm_config)
        if plan is None:
            return dtypes
        check_checkpoint_dtype(dtypes[1])
        return (*dtypes, *plan.dtypes)

    namespace = {
        "__init__": __init__,
        "__module__": __name__,
        "__doc__": f"vLLM's {name}, serving a sketchcal sketch when its config has one.",
        "get_mamba_state_shape_from_config": classmethod(get_mamba_state_shape_from_config),
        "get_mamba_state_dtype_from_config": classmethod(get_mamba_state_dtype_from_config),
    }
    return type(PREFIX + architecture, (base,), namespace)


_BUILT: dict[str, type] = {}


def __getattr__(name: str) -> type:
    arch = name.removeprefix(PREFIX)
    if not name.startswith(PREFIX) or arch not in VLLM_CLASSES:
        raise AttributeError(name)
    if arch not in _BUILT:
        _BUILT[arch] = served_class(arch)
    return _BUILT[arch]
