"""Terminal output: one rich console, progress bars and the calibration summary."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

console = Console(stderr=True)


@contextlib.contextmanager
def progress_bar(enabled: bool = True) -> Iterator[Progress]:
    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
    )
    with bar:
        yield bar


def effective_rank(m: torch.Tensor) -> float:
    """Participation ratio tr(M)² / tr(M²) of a PSD matrix: how many directions carry its energy."""
    tr = torch.diagonal(m, dim1=-2, dim2=-1).sum(-1)
    tr2 = (m * m).sum((-2, -1))
    return float((tr * tr / tr2.clamp_min(1e-300)).mean())


def summary_table(manifest: dict[str, Any], totals: dict[str, torch.Tensor]) -> Table:
    """Per layer: shape, counts, and the effective ranks of E and C (calibration split)."""
    t = manifest["timing"]
    title = (
        f"{manifest['model']['id']} · {manifest['model']['family']} · window {manifest['window']} · "
        f"{t['tokens_per_second']} tok/s · peak host {t['peak_host_memory_mib']:.0f} MiB"
    )
    table = Table(title=title)
    for col in ("layer", "heads/groups", "K×V", "checkpoints", "reads", "eff. rank E", "eff. rank C"):
        table.add_column(col, justify="right")
    for entry in manifest["layers"]:
        i = entry["layer"]
        pre = f"layers.{i}.calib."
        table.add_row(
            str(i),
            f"{entry['heads']}/{entry['groups']}",
            f"{entry['key_dim']}×{entry['value_dim']}",
            str(int(totals[pre + "n_checkpoints"])),
            str(int(totals[pre + "n_reads"])),
            f"{effective_rank(totals[pre + 'E']):.1f}",
            f"{effective_rank(totals[pre + 'C']):.1f}",
        )
    return table
