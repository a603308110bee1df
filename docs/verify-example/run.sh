#!/usr/bin/env bash
# Regenerates this folder's report (about a minute on 2 idle CPU cores, no GPU, no network):
# calibrate the built-in tiny GDN model (Qwen3.5 layout, random weights) on the built-in corpus,
# convert its statistics at mean rank 8, then verify the sketch with a rank sweep.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
sketchcal calibrate builtin:tiny-gdn --out stats
sketchcal convert stats --rank 8 --out tiny-gdn-sketch
sketchcal verify tiny-gdn-sketch --tokens 128 --rank 4 --rank 6 --rank 12 --out "$here"
