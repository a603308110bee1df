#!/usr/bin/env bash
# Regenerates the verify tables of the three shipped demo models (README, "The demo models"), offline
# on the CPU: for each model, calibrate with the defaults on the built-in corpus, convert at mean
# rank 8, and verify with a rank sweep over 4 and 16 (each rank with the state-weighted and the PCA
# basis). Writes <family>/ (verify.json, report.md, plots) and tables.md beside this script.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export HF_HUB_OFFLINE=1
for family in gdn mamba2 kda; do
    sketchcal calibrate "builtin:tiny-$family" --out "$work/$family-stats"
    sketchcal convert "$work/$family-stats" --rank 8 --out "$work/$family-sketch"
    sketchcal verify "$work/$family-sketch" --rank 4 --rank 16 --out "$here/$family"
done
python "$here/tables.py" "$here" > "$here/tables.md.partial" && mv "$here/tables.md.partial" "$here/tables.md"
