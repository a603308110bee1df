"""Streaming window statistics of one mixer layer (layouts: :mod:`sketchcal.formats.stats`).

For each head: the state second moment E = Σ S_c S_cᵀ over window checkpoints, the
effective-query second moment C = Σ u uᵀ over non-flush reads (u_p = M_pᵀ q_p, the query pushed
back to the checkpoint through the window's transitions), the exact read energy Σ ‖S_cᵀ u‖², the
same two weighted by each read's output weight γ (:mod:`sketchcal.calibrate.fisher`):
C_fisher = Σ γ u uᵀ and fisher = Σ γ ‖S_cᵀ u‖², fourth-moment sums for shrinkage, and counts.
Per-token tensors are dropped after each update.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sketchcal.calibrate.windows import to_windows
from sketchcal.formats.stats import moment_layout, window_layout
from sketchcal.kernels.common import Family, StepInputs, effective_queries, step
from sketchcal.models import LayerShape

# Upper bound on the float64 checkpoints held at once, in bytes.
_BLOCK_BYTES = 2**30


class LayerStats:
    """Sums for one layer and one data split, kept on ``device`` (the layer's device).

    ``keep_windows`` > 0 also keeps the first that many counted windows verbatim (checkpoint and
    effective queries, float32), the held-out sample that measures real read errors.
    """

    def __init__(
        self, shape: LayerShape, window: int, keep_windows: int = 0, device: str | torch.device = "cpu"
    ):
        self.shape, self.window, self.keep_windows = shape, window, keep_windows
        self.sums: dict[str, Tensor] = {}
        self.kept: dict[str, list[Tensor]] = {name: [] for name in self._window_layout(0)}
        self._kept_count = 0
        self._init(torch.device(device))

    def _init(self, device: torch.device) -> None:
        layout = moment_layout(self.shape.heads, self.shape.key_dim)
        self.sums = {
            name: torch.zeros(shape, dtype=dt, device=device) for name, (shape, dt) in layout.items()
        }

    def _window_layout(self, count: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        sh = self.shape
        return window_layout(count, sh.heads, sh.key_dim, sh.value_dim, self.window)

    def update(
        self,
        family: Family,
        x: StepInputs,
        valid: Tensor,
        prompt_end: int,
        initial_state: Tensor | None = None,
        gamma: Tensor | None = None,
    ) -> None:
        """Add one batch: ``x`` float64 [B, T, H, ...], ``valid`` [B, T] bool, windows aligned to
        ``prompt_end`` (tokens before it are the prompt). ``initial_state`` [B, H, K, V] is the state
        before the first token of ``x`` (default zero): pass the model's own prefill state with
        ``prompt_end=0`` to skip rescanning the prompt. ``gamma`` [B, T, H]: the output weight of
        each token's read (default 1: every read weighs the same)."""
        if self.sums["E"].device != x.k.device:  # follow the layer's inputs (device maps, offloading)
            self.sums = {name: t.to(x.k.device) for name, t in self.sums.items()}
        lay = to_windows(x, valid.to(x.k.device), prompt_end, self.window, gamma)
        b, n, ln = lay.valid.shape
        h, kd, vd = self.shape.heads, self.shape.key_dim, self.shape.value_dim
        block = max(1, _BLOCK_BYTES // (b * h * kd * vd * 8))  # checkpoints held at once
        state = x.k.new_zeros(b, h, kd, vd) if initial_state is None else initial_state.to(x.k)
        ckpts: list[Tensor] = []
        for j in range(n):
            if j >= lay.first_decode:
                ckpts.append(state)
            if len(ckpts) == block or (ckpts and j == n - 1):
                first = j + 1 - len(ckpts)
                reads = lay.inputs.map(
                    lambda f, a=first, z=j + 1: f[:, a:z, : ln - 1]
                )  # the L-1 non-flush reads
                self._accumulate(
                    family,
                    torch.stack(ckpts, dim=1),
                    reads,
                    lay.valid[:, first : j + 1, : ln - 1],
                    lay.gamma[:, first : j + 1, : ln - 1],
                )
                ckpts = []
            if j < n - 1:  # fold window j into the next checkpoint, token by token
                xw = lay.inputs.map(lambda f, i=j: f[:, i])
                for t in range(ln):
                    state = step(family, state, xw.tokens(t))

    def _accumulate(
        self, family: Family, s_c: Tensor, reads: StepInputs, read_valid: Tensor, gamma: Tensor
    ) -> None:
        ck_mask = read_valid.any(-1).to(s_c.dtype)  # a checkpoint counts if a read follows it
        s = self.sums
        # two-operand einsums only: torch contracts three operands left to right, through the
        # [.., K, K] outer product of every read (hundreds of times slower)
        s["E"] += torch.einsum("bjhkv,bjhlv->hkl", s_c * ck_mask[..., None, None, None], s_c)
        col2 = (s_c * s_c).sum(-2)  # [B, nd, H, V]
        s["E_col4"] += torch.einsum("bjhv,bj->h", col2 * col2, ck_mask)
        s["n_checkpoints"] += ck_mask.sum().long()

        u = effective_queries(family, reads)  # [B, nd, L-1, H, K]
        r_mask = read_valid.to(u.dtype)
        g = gamma * r_mask[..., None]  # [B, nd, L-1, H]
        s["C"] += torch.einsum("bjphk,bjphl->hkl", u * r_mask[..., None, None], u)
        s["C_fisher"] += torch.einsum("bjphk,bjphl->hkl", u * g[..., None], u)
        u2 = (u * u).sum(-1)
        s["C_col4"] += torch.einsum("bjph,bjp->h", u2 * u2, r_mask)
        o = torch.einsum("bjhkv,bjphk->bjphv", s_c, u)
        o2 = (o * o).sum(-1)
        s["read_energy"] += torch.einsum("bjph,bjp->h", o2, r_mask)
        s["fisher"] += (o2 * g).sum((0, 1, 2))
        s["n_reads"] += read_valid.sum().long()

        if self._kept_count < self.keep_windows:
            counted = ck_mask.flatten().bool()
            take = self.keep_windows - self._kept_count
            ss = s_c.flatten(0, 1)[counted][:take]
            uu = u.flatten(0, 1)[counted][:take]
            gg = g.flatten(0, 1)[counted][:take]
            mm = read_valid.flatten(0, 1)[counted][:take]
            kept = (ss, uu, gg, mm)
            for (name, (_, dt)), t in zip(self._window_layout(0).items(), kept, strict=True):
                self.kept[name].append(t.to(dt).cpu())
            self._kept_count += ss.shape[0]

    def take_sums(self) -> dict[str, Tensor]:
        """Return a copy of the sums (on their device) and reset them to zero."""
        out = {name: t.clone() for name, t in self.sums.items()}
        for t in self.sums.values():
            t.zero_()
        return out

    def stop_keeping_windows(self) -> None:
        """Keep no more windows (a resumed run: the sample was taken and saved before)."""
        self._kept_count = self.keep_windows

    def kept_windows(self) -> dict[str, Tensor]:
        if not self.keep_windows:
            return {}
        empty = {name: torch.zeros(shape, dtype=dt) for name, (shape, dt) in self._window_layout(0).items()}
        return {name: torch.cat(parts) if parts else empty[name] for name, parts in self.kept.items()}
