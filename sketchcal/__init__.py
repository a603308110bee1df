"""sketchcal: calibrated sketches of recurrent states for cheaper hybrid-model decoding."""

__version__ = "0.1.0"
