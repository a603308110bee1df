"""Decode kernels and their float64 references, installed as ``sketchcal.kernels``.

Each op family has its own folder (``mamba2/``, ``gdn/``, ``kda/``) holding ``naive.py``, the
float64 reference that the calibration, the runtime and the kernel tests all share, beside the
fast kernels. ``common/`` holds the family-independent reference math.
"""
