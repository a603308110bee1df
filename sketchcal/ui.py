"""Terminal output: the consoles, progress bars (periodic lines when stderr is a log) and the
calibration summary.

Results (tables, JSON) go to stdout, progress and notes to stderr. When stdout is not a terminal
(a file, a pipe) results are printed at their natural width instead of rich's default 80 columns.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
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

WIDE = 100_000  # columns of a results console that writes to a file or a pipe: never cut a table


def results_console() -> Console:
    """A console on stdout for results; not cut at 80 columns when stdout is not a terminal
    (an explicit ``COLUMNS`` still wins)."""
    out = Console()
    if out.is_terminal or "COLUMNS" in os.environ:
        return out
    return Console(width=WIDE, soft_wrap=True)


def print_json(obj: Any) -> None:
    """Write ``obj`` to stdout as JSON (non-finite floats as null; paths and other objects as text)."""
    import json

    from sketchcal.fsutil import finite_json

    sys.stdout.write(json.dumps(finite_json(obj), indent=1, default=str) + "\n")
    sys.stdout.flush()


class LogProgress:
    """The part of ``rich.progress.Progress`` sketchcal uses, for a stderr that is not a terminal (a log
    file, CI): a line per task at its start, every ``step`` of its total or ``interval`` seconds,
    whichever comes first, and at its end, instead of a bar that only shows when it is done."""

    def __init__(self, out: Console, step: float = 0.1, interval: float = 60.0):
        self.console, self.step, self.interval = out, step, interval
        self.tasks: dict[int, dict[str, Any]] = {}

    def add_task(self, description: str, total: float | None = None, completed: float = 0, **_: Any) -> int:
        tid = len(self.tasks)
        now = time.monotonic()
        self.tasks[tid] = dict(
            description=description, total=total, completed=completed, start=now, start_done=completed,
            last_time=now, last_frac=-1.0,
        )  # fmt: skip
        self._report(tid, force=True)
        return tid

    def update(
        self,
        task_id: int,
        *,
        advance: float | None = None,
        completed: float | None = None,
        total: float | None = None,
        description: str | None = None,
        **_: Any,
    ) -> None:
        t = self.tasks[task_id]
        if description is not None:
            t["description"] = description
        if total is not None:
            t["total"] = total
        if completed is not None:
            t["completed"] = completed
        if advance is not None:
            t["completed"] += advance
        self._report(task_id)

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def _report(self, task_id: int, force: bool = False) -> None:
        t = self.tasks[task_id]
        total, done, now = t["total"], t["completed"], time.monotonic()
        frac = done / total if total else 0.0
        finished = bool(total) and done >= total
        due = frac - t["last_frac"] >= self.step or now - t["last_time"] >= self.interval
        if not (force or finished or due) or (finished and t["last_frac"] >= 1.0):
            return
        elapsed = now - t["start"]
        line = f"{t['description']}: {done:g}/{total:g} ({100 * frac:.0f}%), {_clock(elapsed)} elapsed"
        rate = (done - t["start_done"]) / elapsed if elapsed > 0 else 0.0
        if total and not finished and rate > 0:
            line += f", about {_clock((total - done) / rate)} left"
        self.console.print(line, highlight=False, soft_wrap=True)
        t["last_time"], t["last_frac"] = now, frac


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


@contextlib.contextmanager
def progress_bar(enabled: bool = True, fields: tuple[str, ...] = ()) -> Iterator[Progress]:
    """A rich progress bar on stderr; a :class:`LogProgress` when stderr is not a terminal.
    ``fields``: text columns after the count, rich templates of the tasks' fields
    (``"loss {task.fields[loss]}"``)."""
    if enabled and not console.is_terminal:
        yield LogProgress(console)  # type: ignore[misc]
        return
    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        *(TextColumn(f) for f in fields),
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


def calibration_summary(manifest: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    """Per layer of the statistics in ``out``: shape, counts, and the effective ranks of E and C
    (calibration split; only those tensors are read)."""
    from safetensors import safe_open

    rows = []
    for entry in manifest["layers"]:
        pre = f"layers.{entry['layer']}.calib."
        with safe_open(str(out / entry["shard"]), framework="pt") as fh:
            totals = {pre + n: fh.get_tensor(pre + n) for n in ("E", "C", "n_checkpoints", "n_reads")}
        rows.append(
            {
                **{k: entry[k] for k in ("layer", "heads", "groups", "key_dim", "value_dim")},
                "checkpoints": int(totals[pre + "n_checkpoints"]),
                "reads": int(totals[pre + "n_reads"]),
                "effective_rank_E": round(effective_rank(totals[pre + "E"]), 2),
                "effective_rank_C": round(effective_rank(totals[pre + "C"]), 2),
            }
        )
    return rows


def summary_table(manifest: dict[str, Any], rows: list[dict[str, Any]]) -> Table:
    """The rows of :func:`calibration_summary` as a table titled with the model and throughput."""
    t = manifest["timing"]
    title = (
        f"{manifest['model']['id']} · {manifest['model']['family']} · window {manifest['window']} · "
        f"{t['tokens_per_second']} tok/s · peak host {t['peak_host_memory_mib']:.0f} MiB"
    )
    table = Table(title=title)
    for col in ("layer", "heads/groups", "K×V", "checkpoints", "reads", "eff. rank E", "eff. rank C"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["layer"]),
            f"{r['heads']}/{r['groups']}",
            f"{r['key_dim']}×{r['value_dim']}",
            str(r["checkpoints"]),
            str(r["reads"]),
            f"{r['effective_rank_E']:.1f}",
            f"{r['effective_rank_C']:.1f}",
        )
    return table


def show_calibration(manifest: dict[str, Any], out: Path, as_json: bool) -> None:
    """Print what ``calibrate`` wrote to ``out``: the summary table, or with ``as_json`` the manifest
    and the summary rows as JSON."""
    if not manifest:  # a data-parallel rank other than 0
        return
    rows = calibration_summary(manifest, Path(out))
    if as_json:
        print_json(
            {"out": str(out), "plot": str(out / "calibration.png"), "layers": rows, "manifest": manifest}
        )
        return
    results = results_console()
    results.print(summary_table(manifest, rows))
    results.print(f"statistics in {out}/ · spectra plot {out / 'calibration.png'}")
