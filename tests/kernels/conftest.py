"""Kernel tests run the Triton kernels through the interpreter when no CUDA device is present.

``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set here, before any test
module imports a kernel module (``sketchcal.kernels.dispatch`` and the modules it runs).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
