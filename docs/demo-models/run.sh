#!/usr/bin/env bash
# Regenerates the verify tables of the shipped demo models (README, "The demo models"), offline on
# the CPU (about 5 minutes per model on 2 cores): for each model, calibrate 32 samples of 512 tokens
# of the built-in corpus, convert at mean rank 8, and verify on 8 held-out samples of 16 + 512 tokens
# in float32 (verify's defaults but --samples) with a rank sweep over 4 and 16 (each rank with the
# allocation, uniform ranks, the state-weighted and the PCA basis, static and adaptive maps). Writes
# <family>/ (verify.json, report.md, plots) and, when all three were run, tables.md, into $DEMO_OUT
# (default: beside this script).
#
# Usage: bash docs/demo-models/run.sh [gdn] [mamba2] [kda]      (default: all three)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${DEMO_OUT:-$here}
families=("$@")
[ ${#families[@]} -eq 0 ] && families=(gdn mamba2 kda)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export HF_HUB_OFFLINE=1
for family in "${families[@]}"; do
    sketchcal calibrate "builtin:tiny-$family" --samples 32 --seq-len 512 --out "$work/$family-stats"
    sketchcal convert "$work/$family-stats" --rank 8 --out "$work/$family-sketch"
    sketchcal verify "$work/$family-sketch" --rank 4 --rank 16 --samples 8 --out "$out/$family"
done
if [ -f "$out/gdn/verify.json" ] && [ -f "$out/mamba2/verify.json" ] && [ -f "$out/kda/verify.json" ]; then
    python "$here/tables.py" "$out" > "$out/tables.md.partial" && mv "$out/tables.md.partial" "$out/tables.md"
fi
