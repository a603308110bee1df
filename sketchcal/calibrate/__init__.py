"""Calibration: stream window-aligned state and query statistics from a model."""

from sketchcal.calibrate.run import calibrate, run_calibration

__all__ = ["calibrate", "run_calibration"]
