"""The model card (README.md) of a converted model."""

from __future__ import annotations

import json

from sketchcal.artifact.report import format_kl
from sketchcal.fit.allocate import Allocation
from sketchcal.fit.ranks import SUPPORTED_RANKS
from sketchcal.hub.resolve import is_hub_id

FAMILY_NAMES = {"mamba2": "Mamba-2", "gdn": "Gated DeltaNet", "kda": "Kimi Delta Attention"}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


def model_card(
    *,
    base_id: str | None,
    family: str,
    window: int,
    allocation: Allocation,
    weights: str,
    basis: str,
    shrinkage: str,
    stats_manifest: dict,
    notes: list[str],
) -> str:
    """Markdown with YAML front matter: base_model, base_model_relation, tags, library_name."""
    front = ["---", "library_name: transformers"]
    if is_hub_id(base_id):  # the Hub only accepts repo ids here, not paths or builtin: names
        front.append(f"base_model: {json.dumps(base_id)}")
        # with weights: a lossy-read variant of the base (like a quantization); reference only: a side module
        front.append(f"base_model_relation: {'adapter' if weights == 'reference' else 'quantized'}")
    front += [
        "tags:",
        "  - sketchcal",
        "  - sketchssm",
        "  - replayssm",
        f"  - {family}",
        "  - hybrid",
        "---",
        "",
    ]
    a = allocation
    budget = (
        f"mean rank {a.budget['rank']:g}"
        if "rank" in a.budget
        else f"{a.budget['bytes_per_token']:.0f} bytes per token"
    )
    data = stats_manifest.get("data", {})
    family_name = FAMILY_NAMES.get(family, family)
    base_ref = f"`{base_id}`" if base_id else "the base model"
    weights_text = "not included: load them from the base model" if weights == "reference" else weights
    tokens = stats_manifest.get("tokens", {})
    lines = [
        f"# SketchSSM sketch of {base_id or 'its base model'}",
        "",
        f"This directory adds calibrated SketchSSM read sketches for the {family_name} layers of {base_ref} "
        f"(window L = {window}). The weights are the base model's, unchanged ({weights_text}). "
        "The sketch lives in `sketch/sketch.safetensors` and the `sketch_config` section of `config.json`; "
        "`transformers` loads this directory as the plain base model, the sketchcal runtime uses the sketch.",
        "",
        "## Rank allocation",
        "",
        f"- budget: {budget}; basis: {basis}; E shrinkage: {shrinkage}; supported ranks: "
        f"{', '.join(map(str, SUPPORTED_RANKS))} (0 = dense)",
        *(
            [
                "- sketch map: adaptive (a map made for each checkpoint at its flush; a rank-r head "
                "reads r·(K + V) values; its ranks and KL are measured on the held-out windows)"
            ]
            if a.sketch_map == "adaptive"
            else []
        ),
        f"- mean rank (dense heads count as K): {a.mean_rank:.2f}",
        f"- predicted KL (calibration moments): {format_kl(a.predicted_kl)} nats/token",
        f"- predicted on held-out moments: {format_kl(a.heldout_kl)}; "
        f"on held-out windows: {format_kl(a.measured_kl)}",
        f"- state traffic per token: {a.bytes_per_token:,.0f} B vs "
        f"{a.standard_bytes_per_token:,.0f} B standard "
        f"({_pct(a.reduction_vs_standard)} less) and {a.replay_bytes_per_token:,.0f} B ReplaySSM "
        f"({_pct(a.reduction_vs_replay)} less)",
        "",
        "| layer | mean rank | predicted KL | held-out windows KL | bytes/token |",
        "|---:|---:|---:|---:|---:|",
    ]
    for lay in a.layers:
        lines.append(
            f"| {lay.layer} | {lay.mean_rank:.2f} | {format_kl(lay.predicted_kl)} | "
            f"{format_kl(lay.measured_kl)} | {lay.bytes_per_token:,.0f} |"
        )
    lines += [
        "",
        "## Calibration",
        "",
        f"- data: `{json.dumps(data)}`",
        f"- tokens: `{json.dumps(tokens)}`; seed {stats_manifest.get('seed')}",
        "- full statistics manifest: `calibration/stats-manifest.json`; "
        "allocation: `calibration/allocation.json`",
        "",
        "Accuracy of the whole model (KL, perplexity, retrieval) is measured by `sketchcal verify`; "
        "it is not part of this card until verify has run.",
    ]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(front + lines) + "\n"
