"""``inspect``: a per-layer summary of a converted model and PNG plots of its ranks and error curves."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from sketchcal.artifact.sketch import SketchArtifact, read_sketch
from sketchcal.errors import SketchcalError
from sketchcal.fsutil import atomic_path, disk_errors

CURVES_FILE = "calibration/curves.safetensors"
ALLOCATION_FILE = "calibration/allocation.json"


@dataclass
class InspectResult:
    """What :func:`inspect` found and wrote."""

    artifact: SketchArtifact
    summary: dict[str, Any]  # the sketch_config summary (mean rank, errors, bytes ...)
    layers: list[dict[str, Any]]  # per layer: layer, heads, key_dim, ranks, mean_rank, errors, bytes
    plots: list[Path] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: what ``sketchcal inspect --json`` prints."""
        return {
            "sketch_config": self.artifact.config,
            "summary": self.summary,
            "layers": self.layers,
            "plots": [str(p) for p in self.plots],
        }


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * float(x):.2f}%"


def format_kl(x: float | None) -> str:
    """A predicted KL in nats/token, or n/a."""
    return "n/a" if x is None else f"{float(x):.2e}"


def _ranks_text(ranks: list[int]) -> str:
    c = Counter(ranks)
    return " ".join(
        f"{'dense' if m == 0 else m}×{n}" for m, n in sorted(c.items(), key=lambda t: (t[0] == 0, t[0]))
    )


def _load_curves(d: Path) -> dict[str, torch.Tensor]:
    f = d / CURVES_FILE
    if not f.is_file():
        return {}
    from safetensors.torch import load_file

    try:
        return load_file(str(f))
    except Exception:
        return {}


def allocation_table(layers: list[dict[str, Any]], title: str | None = None) -> Table:
    """A rich table with one row per layer (the dicts of ``calibration/allocation.json``'s ``layers``)."""
    table = Table(title=title)
    for col, just in (
        ("layer", "right"),
        ("ranks", "left"),
        ("mean rank", "right"),
        ("pred. KL", "right"),
        ("held-out moments", "right"),
        ("held-out windows", "right"),
        ("bytes/token", "right"),
        ("vs standard", "right"),
    ):
        table.add_column(col, justify=just)
    for lay in layers:
        std = lay.get("standard_bytes_per_token")
        b = lay.get("bytes_per_token")
        table.add_row(
            str(lay["layer"]),
            _ranks_text(lay["ranks"]),
            f"{lay['mean_rank']:.2f}",
            format_kl(lay.get("predicted_kl")),
            format_kl(lay.get("heldout_kl")),
            format_kl(lay.get("measured_kl")),
            "n/a" if b is None else f"{b:,.0f}",
            "n/a" if not (b and std) else f"{std / b:.2f}×",
        )
    return table


def print_allocation(
    summary: dict[str, Any], layers: list[dict[str, Any]], console: Console | None = None
) -> None:
    """Print the per-layer table and the totals (mean rank, errors, traffic reductions)."""
    console = console or Console()
    console.print(allocation_table(layers))
    s = summary
    console.print(
        f"mean rank {s['mean_rank']:.2f} (dense = K) · "
        f"predicted KL {format_kl(s.get('predicted_kl'))} nats/token · "
        f"held-out {format_kl(s.get('heldout_kl'))} predicted, "
        f"{format_kl(s.get('measured_kl'))} measured"
    )
    console.print(
        f"state traffic {s['bytes_per_token']:,.0f} B/token: "
        f"{_pct(s['reduction_vs_standard'])} less than standard "
        f"({s['standard_bytes_per_token']:,.0f} B), {_pct(s['reduction_vs_replay'])} less than ReplaySSM "
        f"({s['replay_bytes_per_token']:,.0f} B)"
    )


def print_convert_result(result, console: Console | None = None) -> None:
    """Print what :func:`sketchcal.artifact.convert` did: table, totals, shrinkage choice and notes."""
    from dataclasses import asdict

    console = console or Console()
    alloc = result.allocation
    summary = {**alloc.to_dict(), "layers": None}
    print_allocation(summary, [asdict(lay) for lay in alloc.layers], console)
    scores = ", ".join(f"{m} {format_kl(v)}" for m, v in result.shrinkage_scores.items())
    exact = "exact optimum" if alloc.optimal else f"within {alloc.gap_bound:.1e} of the optimum"
    console.print(f"E shrinkage: {result.shrinkage} (held-out KL: {scores}); allocation: {exact}")
    for note in result.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    console.print(f"wrote {result.out} (weights: {result.weights})")


def inspect(
    model_dir: str | Path,
    plots_dir: str | Path | None = None,
    *,
    plots: bool = True,
    console: Console | None = None,
) -> InspectResult:
    """Summarise a converted model directory and plot it.

    Args:
        model_dir: a directory written by :func:`sketchcal.artifact.convert`.
        plots_dir: where to write ``ranks.png`` (heatmap of ranks, layers × heads; dense shown as K)
            and ``error_curves.png`` (predicted relative error vs rank per head, one panel per layer,
            measured held-out error dashed). Default: ``MODEL_DIR/plots``.
        plots: False to skip the PNGs.
        console: rich console to print to (default: a new one on stdout); None output with
            ``Console(quiet=True)``.
    """
    d = Path(model_dir)
    art = read_sketch(d)
    alloc_path = d / ALLOCATION_FILE
    alloc_layers: dict[int, dict[str, Any]] = {}
    if alloc_path.is_file():
        try:
            alloc_layers = {int(x["layer"]): x for x in json.loads(alloc_path.read_text())["layers"]}
        except (OSError, ValueError, KeyError, TypeError):
            alloc_layers = {}
    rows = []
    for lay, meta in zip(art.layers, art.config["layers"], strict=True):
        ranks = [int(x) for x in lay.ranks.tolist()]
        k = int(meta["key_dim"])
        row = {
            "layer": lay.layer,
            "heads": lay.heads,
            "groups": lay.groups,
            "key_dim": k,
            "value_dim": int(meta["value_dim"]),
            "ranks": ranks,
            "mean_rank": sum(m or k for m in ranks) / len(ranks),
        }
        extra = alloc_layers.get(lay.layer, {})
        for key in (
            "predicted_kl",
            "heldout_kl",
            "measured_kl",
            "bytes_per_token",
            "replay_bytes_per_token",
            "standard_bytes_per_token",
        ):
            row[key] = extra.get(key)
        rows.append(row)
    summary = art.config.get("summary", {})
    console = console or Console()
    base = art.config.get("base_model", {})
    console.print(
        f"[bold]{d}[/bold]: {art.config['family']} sketch, window {art.config['window']}, basis "
        f"{art.config.get('basis')}, {art.sketch_map} map, base {base.get('id')} "
        f"(weights: {base.get('weights')})"
    )
    if summary:
        print_allocation(summary, rows, console)
    else:
        console.print(allocation_table(rows))
    result = InspectResult(artifact=art, summary=summary, layers=rows)
    if plots:
        out = Path(plots_dir) if plots_dir is not None else d / "plots"
        with disk_errors(str(out)):
            out.mkdir(parents=True, exist_ok=True)
        result.plots = [
            _plot_ranks(rows, out / "ranks.png"),
            _plot_curves(rows, _load_curves(d), out / "error_curves.png", art.sketch_map == "adaptive"),
        ]
        console.print(f"plots: {', '.join(str(p) for p in result.plots)}")
    return result


def _plot_ranks(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    width = max(r["heads"] for r in rows)
    grid = np.full((len(rows), width), np.nan)
    for i, r in enumerate(rows):
        grid[i, : r["heads"]] = [m or r["key_dim"] for m in r["ranks"]]
    fig, ax = plt.subplots(figsize=(min(2 + 0.35 * width, 16), min(1.5 + 0.35 * len(rows), 14)))
    top = max(r["key_dim"] for r in rows)
    im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest", vmin=0, vmax=top)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_yticks(range(len(rows)), [str(r["layer"]) for r in rows])
    if width * len(rows) <= 400:
        for i, r in enumerate(rows):
            for h, m in enumerate(r["ranks"]):
                ax.text(h, i, "D" if m == 0 else str(m), ha="center", va="center", color="w", fontsize=7)
    fig.colorbar(im, ax=ax, label="rank (dense = K)")
    ax.set_title("sketch ranks per head (D = dense)")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def _plot_curves(
    rows: list[dict[str, Any]], curves: dict[str, torch.Tensor], path: Path, adaptive: bool = False
) -> Path:
    """Each layer's error curves per head and its chosen ranks; an adaptive sketch's are its
    measured adaptive curves (``adaptive_*`` in the curves file), the ones its ranks were chosen on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(rows)
    cols = min(4, n)
    nrows = -(-n // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3 * nrows), squeeze=False)
    for ax, r in zip(axes.flat, rows, strict=False):
        p = f"layers.{r['layer']}."
        kind = "adaptive_" if adaptive else ""
        curve_key = p + ("adaptive_measured" if adaptive else "predicted")
        if curve_key not in curves:
            ax.text(0.5, 0.5, "no curves stored", ha="center", va="center", transform=ax.transAxes)
            ax.set_title(f"layer {r['layer']}")
            continue
        ranks = curves[p + kind + "candidate_ranks"].tolist()
        cols_nz = [i for i, m in enumerate(ranks) if m]  # dense is exact (error 0): no point on a log axis
        xs = [ranks[i] for i in cols_nz]
        pred = curves[curve_key][:, cols_nz].nan_to_num(1e-12).clamp_min(1e-12)
        meas = None if adaptive else curves.get(p + "measured")
        floor = float(pred.min()) if pred.numel() else 1e-12
        for h in range(pred.shape[0]):
            color = f"C{h % 10}"
            if xs:
                ax.plot(xs, pred[h].tolist(), color=color, lw=1)
                if meas is not None:
                    ax.plot(xs, meas[h, cols_nz].clamp_min(1e-12).tolist(), color=color, lw=1, ls="--")
            chosen = r["ranks"][h]
            if chosen:
                ax.plot([chosen], [float(pred[h, xs.index(chosen)])], "o", color=color, ms=4)
            else:  # dense: marked at x = K on the bottom of the panel
                ax.plot([r["key_dim"]], [floor], "v", color=color, ms=5)
        ax.set_yscale("log")
        ax.set_xlabel("rank (dense = K)")
        ax.set_ylabel("relative read error")
        ax.set_title(f"layer {r['layer']}")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    what = "solid: adaptive, measured held-out" if adaptive else "solid: predicted, dashed: measured held-out"
    fig.suptitle(f"error vs rank per head ({what}, dot: chosen, ▼ at K: dense)")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return path


def _save(fig, path: Path) -> None:
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=110)
    except SketchcalError:
        raise
    except OSError as err:
        raise SketchcalError(f"cannot write {path}: {err.strerror}") from err
