"""The verify report: a rich table, ``verify.json``, ``report.md`` and PNG plots.

Plots (matplotlib, Agg): ``kl_by_length.png`` — mean KL of the sketch rows over spans of the decoded
positions; ``kl_by_position.png`` — mean KL(standard ‖ mode) against the token's
position in its window (p = L is the exact flush read); ``error_by_rank.png`` — per layer, the
measured relative read error against the layer's mean rank, for every state-basis sketch run (the
artifact's and the rank sweep).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import TYPE_CHECKING

from rich import box
from rich.table import Table

from sketchcal.fsutil import atomic_path, write_json

if TYPE_CHECKING:
    from sketchcal.verify.run import ConfigResult, VerifyResult


def _num(x: float | None, fmt: str = ".3g") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return format(x, fmt)


def _pct(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:.{digits}f}%"


def _rows(result: VerifyResult, compact: bool = False) -> list[list[str]]:
    """One row per configuration (``compact``: fewer digits, for the console)."""
    g, d = (".2g", 0) if compact else (".3g", 1)
    rows = []
    for c in result.configs:
        t, std = c.traffic, c.mode == "standard"
        rows.append(
            [
                c.name,
                c.group,
                _num(c.mean_rank, ".1f") if c.mean_rank is not None else "full",
                "—" if std else _num(c.kl_mean, g),
                "—" if std else _num(c.kl_p99, g),
                "—" if std else _pct(c.top1_agreement, d),
                _num(c.perplexity, ".4g" if compact else ".2f"),
                _pct(c.retrieval_accuracy, d) if c.retrieval_accuracy is not None else "n/a",
                "—" if std else _num(c.mean_read_error, g),
                _pct(t.get("reduction_vs_standard"), d) if t else "—",
            ]
        )
    return rows


HEADERS = [
    "config",
    "group",
    "mean rank",
    "KL mean",
    "KL p99",
    "top-1",
    "ppl",
    "retrieval",
    "read err",
    "traffic saved",
]


def table(result: VerifyResult) -> Table:
    """The console table: the markdown columns without ``group``, compact."""
    t = Table(
        title=f"{Path(result.model_dir).name} · {result.family} · L={result.window} · "
        f"{result.samples}×{result.tokens} decoded tokens",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    short = ["config", "rank", "KL", "KL p99", "top-1", "ppl", "recall", "err", "saved"]
    for h in short:
        t.add_column(
            h,
            justify="left" if h == "config" else "right",
            no_wrap=h != "config",
            min_width=14 if h == "config" else None,
        )
    for row in _rows(result, compact=True):
        t.add_row(row[0], *row[2:])
    return t


def print_table(result: VerifyResult, console) -> None:
    console.print(table(result))
    for note in result.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def markdown(result: VerifyResult, plots: dict[str, str]) -> str:
    main = result.config("sketch")
    t = main.traffic
    parts = [
        f"# sketchcal verify: {Path(result.model_dir).name}",
        "",
        "```",
        result.command,
        "```",
        "",
        f"- base model `{result.base_model}`, weights from `{Path(result.model_id).name}`",
        f"- family **{result.family}**, window L = {result.window}; {result.samples} held-out samples from "
        f"`{result.data.get('source')}`, {result.prompt} prefill tokens then {result.tokens} teacher-forced "
        f"decode steps each; computed in {result.dtype}",
        f"- sketch: mean rank {_num(main.mean_rank, '.2f')}, basis `{main.basis}`, read dtype "
        f"`{main.read_dtype}`; traffic {t['bytes_per_token']:.0f} B/token vs "
        f"{t['standard_bytes_per_token']:.0f} standard ({_pct(t['reduction_vs_standard'])} saved) and "
        f"{t['replay_bytes_per_token']:.0f} replay ({_pct(t['reduction_vs_replay'])} saved)",
    ]
    if result.retrieval:
        r = result.retrieval
        parts.append(
            f"- retrieval: {r['task']}, {r['pairs']} pairs, {r['queries']} queries in all"
            + ("" if r.get("applicable", True) else " (not applicable: the full-state model does not do it)")
        )
    parts += [
        "",
        "KL is KL(standard ‖ config) of the next-token distributions, in nats; top-1 is agreement with "
        "standard; read err is Σ‖served − exact‖² / Σ‖exact‖² over the non-flush reads, mean over "
        "layers; traffic saved is against standard decoding (byte model of `sketchcal.fit.traffic`).",
        "",
        "## Results",
        "",
        _md_table(HEADERS, _rows(result)),
        "",
        "## Relative read error per layer",
        "",
    ]
    layers = sorted({layer for c in result.configs for layer in c.read_error})
    rows = [
        [c.name] + [_num(c.read_error.get(layer)) for layer in layers]
        for c in result.configs
        if c.mode != "standard"
    ]
    parts += [_md_table(["config"] + [f"layer {i}" for i in layers], rows), ""]
    if plots:
        parts += ["## Plots", ""]
        for title, name in plots.items():
            parts += [f"![{title}]({name})", ""]
    if result.notes:
        parts += ["## Notes", ""] + [f"- {n}" for n in result.notes] + [""]
    return "\n".join(parts)


def _plot_kl(result: VerifyResult, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    shown = [
        c for c in result.configs if c.mode != "standard" and c.group != "rank sweep" and c.kl_by_position
    ]
    for i, c in enumerate(shown):
        pos = list(range(1, len(c.kl_by_position) + 1))
        style = ("-", "--", ":", "-.")[i % 4]  # overlapping curves stay visible
        ax.plot(pos, c.kl_by_position, style, marker="o", ms=3, label=c.name)
    ax.set_xlabel(f"position in window (p = {result.window} is the flush)")
    ax.set_ylabel("mean KL(standard ‖ config), nats")
    ax.set_yscale("symlog", linthresh=1e-8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("next-token KL by window position")
    _save(fig, path)


def _plot_kl_length(result: VerifyResult, path: Path) -> None:
    import matplotlib.pyplot as plt

    from sketchcal.verify.metrics import length_edges

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    main = result.config("sketch")
    budget = main.budget  # the artifact's own budget: its rows and ablations
    shown = [c for c in result.configs if c.mode == "sketch" and c.budget == budget and c.kl_by_length]
    for i, c in enumerate(shown):
        edges = length_edges(result.tokens, len(c.kl_by_length))
        mids = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
        ax.plot(mids, c.kl_by_length, ("-", "--", ":", "-.")[i % 4], marker="o", ms=3, label=c.name)
    ax.set_xlabel("decoded position in the sequence (span midpoints)")
    ax.set_ylabel("mean KL(standard ‖ config), nats")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"next-token KL along the sequence, mean rank {main.mean_rank:.1f}")
    _save(fig, path)


def _plot_error_rank(result: VerifyResult, path: Path) -> None:
    import matplotlib.pyplot as plt

    runs: list[ConfigResult] = [
        c for c in result.configs if c.mode == "sketch" and c.basis == result.config("sketch").basis
    ]
    main = result.config("sketch")
    runs = [
        c
        for c in runs
        if not c.shared and c.read_dtype == main.read_dtype and c.sketch_map == main.sketch_map
    ]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    layers = sorted({layer for c in runs for layer in c.read_error})
    for layer in layers:
        pts = sorted((c.layer_mean_rank[layer], c.read_error[layer]) for c in runs if layer in c.read_error)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"layer {layer}")
    ax.set_xlabel("mean rank of the layer (dense = K)")
    ax.set_ylabel("relative read error Σ‖Δ‖²/Σ‖exact‖²")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("read error against rank")
    _save(fig, path)


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    with atomic_path(path) as tmp:
        fig.tight_layout()
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def write_report(result: VerifyResult, out: Path, plots: bool = True) -> dict[str, str]:
    """Write verify.json, report.md and (with ``plots``) the PNGs into ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    plot_files: dict[str, str] = {}
    if plots:
        _plot_kl(result, out / "kl_by_position.png")
        _plot_kl_length(result, out / "kl_by_length.png")
        _plot_error_rank(result, out / "error_by_rank.png")
        plot_files = {
            "KL by window position": "kl_by_position.png",
            "KL along the sequence": "kl_by_length.png",
            "read error by rank": "error_by_rank.png",
        }
        files.update(
            {
                "kl_plot": str(out / "kl_by_position.png"),
                "length_plot": str(out / "kl_by_length.png"),
                "rank_plot": str(out / "error_by_rank.png"),
            }
        )
    files["json"] = str(out / "verify.json")
    files["markdown"] = str(out / "report.md")
    result.files = files
    write_json(out / "verify.json", result.to_dict())
    with atomic_path(out / "report.md") as tmp:
        tmp.write_text(markdown(result, plot_files))
    return files
