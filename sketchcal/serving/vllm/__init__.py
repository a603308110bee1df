"""sketchcal's vLLM plugin: serve a converted model (``sketchcal convert``'s directory) with replay
or sketch decoding, without a fork of vLLM.

``pip install "sketchcal[vllm]"`` registers :func:`register` in the ``vllm.general_plugins``
entry-point group, which every vLLM process loads. It

- registers the served model classes (:mod:`.models`) for the supported architectures with
  ``ModelRegistry.register_model`` (lazily: a class is imported only when its architecture is
  served); they count the sketchcal tensors in vLLM's page sizes and swap the recurrent layer
  classes (:mod:`.mamba2`, :mod:`.gdn`, :mod:`.kda`) when the model has a ``sketch_config``;
- adds a check to vLLM's config hook for models with recurrent layers, so that a model it cannot
  serve (an unlisted architecture, tensor parallelism, speculative decoding, prefix caching of
  recurrent state, a sketch of another model) is refused when the config is built, with one line.

Without a ``sketch_config`` in the model's ``config.json`` nothing changes: the served classes
behave as vLLM's. Options: ``--additional-config '{"sketchcal": {"mode": "replay"}}'``
(:mod:`.settings`).
"""

from __future__ import annotations

from typing import Any

_REGISTERED = False


def _check_on_config(original: Any) -> classmethod:
    def verify_and_update_config(cls: type, vllm_config: Any) -> None:
        original(vllm_config)
        from sketchcal.serving.vllm.settings import serve_settings

        serve_settings(vllm_config)

    return classmethod(verify_and_update_config)


def register() -> None:
    """The ``vllm.general_plugins`` entry point (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MambaModelConfig

    from sketchcal.serving.vllm.models import PREFIX, VLLM_CLASSES

    for arch in VLLM_CLASSES:
        ModelRegistry.register_model(arch, f"sketchcal.serving.vllm.models:{PREFIX}{arch}")
    # every model with recurrent layers goes through this hook when its config is built
    MambaModelConfig.verify_and_update_config = _check_on_config(MambaModelConfig.verify_and_update_config)
