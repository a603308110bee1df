"""sketchcal: calibrated sketches of recurrent states for cheaper hybrid-model decoding.

The Python API under the CLI::

    manifest = sketchcal.calibrate("builtin:tiny-kda", out="stats", samples=32, seq_len=128)
    result = sketchcal.convert("stats", rank=8, out="model-sketch")
    report = sketchcal.verify("model-sketch")
    sketchcal.inspect("model-sketch")
    sketchcal.push("model-sketch", "user/model-sketchssm", dry_run=True)

The options of ``calibrate``, ``convert`` and ``verify`` are the fields of
:class:`sketchcal.settings.CalibrateSettings`, ``ConvertSettings`` and ``VerifySettings``. The
functions are imported on first use (importing ``sketchcal`` loads no torch). ``calibrate`` and
``verify`` shadow the subpackages of the same name on purpose: ``sketchcal.calibrate`` is always the
function; the subpackages are reached with ``from sketchcal.calibrate import ...``.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__version__ = "0.1.0"

# name -> "module:attribute" of the function
_API = {
    "calibrate": "sketchcal.calibrate.run:calibrate",
    "convert": "sketchcal.artifact.convert:convert",
    "verify": "sketchcal.verify.run:verify",
    "inspect": "sketchcal.artifact.report:inspect",
    "push": "sketchcal.hub.push:push",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'sketchcal' has no attribute {name!r}")
    module, _, attr = _API[name].partition(":")
    fn = getattr(importlib.import_module(module), attr)
    globals()[name] = fn
    return fn


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})


class _Package(types.ModuleType):
    """Keeps the API functions bound to their names: importing the subpackage ``sketchcal.calibrate``
    (or ``sketchcal.verify``) would otherwise set the package attribute to the module."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _API and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
