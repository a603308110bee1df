"""Decode kernels and their float64 references, installed as ``sketchcal.kernels``.

Layout:

- ``common/``: what the families share: the reference recurrence (``recurrence.py``) and the
  serving-API references over a slot pool (``reference.py``), the pool and its layouts
  (``pool.py``), random pools and inputs (``testing.py``), the Triton kernels that take a
  ``FAMILY`` constexpr (``standard.py``, ``read.py``, ``flush.py``), the Triton building blocks
  (``triton_helpers.py``) and the Gluon ones of the persistent flushes (``gluon_helpers.py``);
- ``mamba2/``, ``gdn/``, ``kda/``: per family ``naive.py``, the float64 transition that the
  calibration, the runtime and the kernel tests share, beside that family's own kernels;
- ``dispatch.py``: the table of which kernel runs per (kernel, family) and the serving entry
  points; ``bench.py`` (``sketchcal bench``), ``resources.py`` (registers, offline compile
  check), ``gpu_check.py`` and ``profile_ops.py`` (tools for a GPU machine).

This ``__init__`` imports only the references (plain torch): the Triton modules load on first use.
"""
