"""sketchcal: calibrated sketches of recurrent states for cheaper hybrid-model decoding.

The Python API under the CLI: ``sketchcal.calibrate``, ``convert``, ``inspect``, ``verify``.
The function names shadow the subpackages of the same name on purpose.
"""

__version__ = "0.1.0"

from sketchcal.calibrate import calibrate

__all__ = ["__version__", "calibrate"]
