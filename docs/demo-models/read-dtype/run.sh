#!/usr/bin/env bash
# The read copy's precision on the demo models: for each model, calibrate with the defaults on the
# built-in corpus, convert at mean rank 8, and verify replay and sketch with a bf16 and an fp8 (e4m3)
# read copy and sketch (no ablations). Offline on the CPU, about 1.5 minutes per model on 2 cores.
# Writes <family>-<dtype>/ (report.md, verify.json) into $OUT_DIR (default: beside this script).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT_DIR:-$here}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export HF_HUB_OFFLINE=1
for family in gdn mamba2 kda; do
    sketchcal calibrate "builtin:tiny-$family" --out "$work/$family-stats"
    sketchcal convert "$work/$family-stats" --rank 8 --out "$work/$family-sketch"
    for dtype in bf16 fp8; do
        sketchcal verify "$work/$family-sketch" --read-dtype "$dtype" --no-ablations --out "$work/$family-$dtype"
        mkdir -p "$out/$family-$dtype"
        cp "$work/$family-$dtype/report.md" "$work/$family-$dtype/verify.json" "$out/$family-$dtype/"
    done
done
