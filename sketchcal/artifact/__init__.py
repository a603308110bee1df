"""Artifacts: the converted model directory (config + sketch) and inspect; the statistics reader
(:mod:`sketchcal.formats.stats`) is re-exported here.

Public API::

    convert(stats_dir, **options) -> ConvertResult   # options: sketchcal.settings.ConvertSettings
    inspect(model_dir, plots_dir=None, *, plots=True, console=None) -> InspectResult
    load_stats(stats_dir) -> Stats
    read_sketch(model_dir, config=None) -> SketchArtifact
    config_fingerprint(config) -> str
    print_convert_result(result, console=None)      # the CLI's convert output
"""

from sketchcal.artifact.convert import ConvertResult, convert
from sketchcal.artifact.fingerprint import config_fingerprint
from sketchcal.artifact.report import InspectResult, inspect, print_allocation, print_convert_result
from sketchcal.artifact.sketch import SketchArtifact, SketchLayer, read_sketch
from sketchcal.formats.stats import HeldoutWindows, LayerInfo, Moments, Stats, load_stats

__all__ = [
    "ConvertResult",
    "HeldoutWindows",
    "InspectResult",
    "LayerInfo",
    "Moments",
    "SketchArtifact",
    "SketchLayer",
    "Stats",
    "config_fingerprint",
    "convert",
    "inspect",
    "load_stats",
    "print_allocation",
    "print_convert_result",
    "read_sketch",
]
