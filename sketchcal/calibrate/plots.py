"""``calibration.png``: how fast the state and query energy decay over directions, per layer.

A steep spectrum of E (states) and C (effective queries) is what lets a small sketch serve reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from sketchcal.fsutil import atomic_path


def spectra_plot(path: Path, manifest: dict[str, Any], totals: dict[str, torch.Tensor]) -> None:
    """Cumulative energy fraction captured by the top-r eigenvectors of the group-summed E and C."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for entry in manifest["layers"]:
        i, g = entry["layer"], entry["groups"]
        for ax, name in zip(axes, ("E", "C"), strict=True):
            m = totals[f"layers.{i}.calib.{name}"]
            m = m.reshape(g, -1, *m.shape[-2:]).sum(1)  # per group (the frame is shared by a group)
            ev = torch.linalg.eigvalsh(m).flip(-1).clamp_min(0)
            frac = (ev.cumsum(-1) / ev.sum(-1, keepdim=True).clamp_min(1e-300)).mean(0)
            ax.plot(range(1, len(frac) + 1), frac.numpy(), label=f"layer {i}")
    for ax, title in zip(axes, ("state second moment E", "effective-query second moment C"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("rank r (top eigenvectors)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("energy fraction captured (mean over groups)")
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{manifest['model']['id']} — window {manifest['window']}")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
