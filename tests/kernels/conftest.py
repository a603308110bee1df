"""Kernel tests run the Triton kernels through the interpreter when no CUDA device is present.

``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set here, before any test
module imports ``sketchcal.kernels.common.decode``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
