"""``python -m sketchcal``."""

from sketchcal.cli import main

main()
