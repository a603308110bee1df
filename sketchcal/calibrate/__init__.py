"""Calibration: stream window-aligned state and query statistics from a model."""

from sketchcal.calibrate.run import Settings, calibrate

__all__ = ["Settings", "calibrate"]
