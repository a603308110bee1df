"""The README's demo-model tables from the ``verify.json`` files that ``run.sh`` writes: one table per
model, then one of static against adaptive maps at equal bytes.

Usage: ``python docs/demo-models/tables.py docs/demo-models > docs/demo-models/tables.md``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FAMILIES = {
    "gdn": "tiny-gdn (Qwen3.5-style GDN)",
    "mamba2": "tiny-mamba2 (Nemotron-H-style Mamba-2)",
    "kda": "tiny-kda (Kimi-Linear-style KDA)",
}
RANKS = (4, 8, 16)


def _row_names(rank: int, main_budget: float) -> tuple[str, str, str]:
    """(allocation, PCA-basis, uniform-rank configs) of ``verify.json`` at one mean-rank budget."""
    if rank == main_budget:
        return "sketch", "sketch · pca basis", "sketch · uniform ranks"
    r = f"sketch · rank {rank:g}"
    return r, f"{r} · pca basis", f"{r} · uniform ranks"


def table(report: dict) -> str:
    configs = {c["name"]: c for c in report["configs"]}
    std, replay, main = configs["standard"], configs["replay"], configs["sketch"]
    ppl = std["perplexity"]

    def pct(x: float) -> str:
        return f"{100 * x:.1f}%"

    def recall(c: dict) -> str:
        return "–" if c.get("retrieval_accuracy") is None else pct(c["retrieval_accuracy"])

    lines = [
        "| config | mean rank | KL (nats/token) | KL p99 | top-1 agreement | perplexity change | "
        "recall | traffic saved vs standard | uniform ranks: KL / top-1 | PCA basis: KL / top-1 |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| standard | full | – | – | – | ({ppl:.2f}) | {recall(std)} | – | – | – |",
        f"| replay | full | {replay['kl_mean']:.1e} | {replay['kl_p99']:.1e} | "
        f"{pct(replay['top1_agreement'])} | "
        f"{100 * (replay['perplexity'] / ppl - 1):+.2f}% | {recall(replay)} | "
        f"{pct(replay['traffic']['reduction_vs_standard'])} | – | – |",
    ]
    for rank in RANKS:
        name, pca_name, uni_name = _row_names(rank, main["budget"])
        c, p, u = configs[name], configs[pca_name], configs.get(uni_name)
        lines.append(
            f"| sketch | {c['mean_rank']:.1f} | {c['kl_mean']:.4f} | {c['kl_p99']:.3f} | "
            f"{pct(c['top1_agreement'])} | {100 * (c['perplexity'] / ppl - 1):+.2f}% | "
            f"{recall(c)} | {pct(c['traffic']['reduction_vs_standard'])} | "
            + ("– | " if u is None else f"{u['kl_mean']:.4f} / {pct(u['top1_agreement'])} | ")
            + f"{p['kl_mean']:.4f} / {pct(p['top1_agreement'])} |"
        )
    r = report["retrieval"]
    lines.append("")
    lines.append(
        f"{report['samples']} held-out samples × {report['tokens']} teacher-forced tokens after a "
        f"{report['prompt']}-token prompt (window {report['window']}); recall: {r['queries']} queries "
        f"over {r['pairs']} key-value pairs after {r['text_tokens']} tokens of text "
        f"(chance {1 / r['pairs']:.1%})."
    )
    return "\n".join(lines)


def adaptive_table(reports: dict[str, dict]) -> str:
    """Each model's allocation at mean ranks 4, 8 and 16 with its static map, and with adaptive maps
    at the ranks that read no more bytes (``· adaptive map`` rows)."""
    lines = [
        "| model | static: mean rank | KL | top-1 | B/token | adaptive: mean rank | KL | top-1 | B/token |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for family, report in reports.items():
        configs = {c["name"]: c for c in report["configs"]}
        for rank in RANKS:
            name = _row_names(rank, configs["sketch"]["budget"])[0]
            c, a = configs[name], configs[f"{name} · adaptive map"]
            cells = [
                f"{x['mean_rank']:.1f} | {x['kl_mean']:.2g} | {100 * x['top1_agreement']:.1f}% | "
                f"{x['traffic']['bytes_per_token']:,.0f}"
                for x in (c, a)
            ]
            lines.append(f"| tiny-{family} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main(folder: str) -> None:
    root = Path(folder)
    reports = {}
    for family, title in FAMILIES.items():
        path = root / family / "verify.json"
        if not path.is_file():
            raise SystemExit(f"{path} is missing: run {root / 'run.sh'} first")
        reports[family] = json.loads(path.read_text())
        print(f"### {title}\n")
        print(table(reports[family]))
        print()
    print("### Static and adaptive maps at equal bytes\n")
    print(adaptive_table(reports))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parent))
