"""The architecture fingerprint that ties statistics and sketches to one model.

The definition lives in :attr:`sketchcal.models.ModelSpec.fingerprint` (model type, sizes, and the
shape of every recurrent mixer), which ``calibrate`` records from the loaded model. Here the same
value is computed from a config alone: the model is built on the ``meta`` device (no weights read,
no memory allocated) and described.
"""

from __future__ import annotations

from pathlib import Path


def config_fingerprint(config) -> str:
    """The fingerprint ``calibrate`` records for a model with this config.

    ``config``: a ``PretrainedConfig``, a config dict (as in config.json), or a local model
    directory / config.json path.

    Raises:
        SketchcalError: the architecture is not supported (from :func:`sketchcal.models.describe`).
    """
    import transformers as tf

    from sketchcal.models.spec import describe_config

    if isinstance(config, str | Path):
        config = load_config(config)
    if isinstance(config, dict):
        d = dict(config)
        config = tf.AutoConfig.for_model(d.pop("model_type"), **d)
    return describe_config(config).fingerprint


def load_config(path: str | Path):
    """Load a transformers config from a local model directory or a config.json file (no network)."""
    from transformers import AutoConfig

    p = Path(path)
    return AutoConfig.from_pretrained(str(p.parent if p.is_file() else p), local_files_only=True)
