"""Greedy decoding of a transformers model with each one-token forward replayed from a CUDA graph.

``model.generate()`` spends most of a decode step on the host (Python, launches, its own cache
bookkeeping). :class:`GraphDecoder` removes that: the attention layers keep their keys and values
in transformers' ``StaticCache`` (fixed addresses, positions advanced by a device counter), the
recurrent layers keep their conv states there too and their recurrent state wherever the model's
decode function keeps it (the model's own cache tensor without a runtime; the runtime's slot pool
with :func:`sketchcal.runtime.enable`), and the whole one-token forward, argmax included, is
captured once and replayed. SDPA attention layers run
:func:`~sketchcal.runtime.attention.grouped_decode_attention`, which reads the static cache once
per key head instead of once per query head.

Window phases. In ``replay`` and ``sketch`` modes the work of a step depends on its position p in
the window (p = L − 1 is the flush), so one graph is captured per phase, in window order, and
replayed in the same order; ``standard`` mode needs one. The first window is decoded eagerly: it
compiles the kernels and leaves the runtime at phase 0, where capture starts.

Recurrent state. With a runtime, the pool is the only copy of the recurrent state while the
decoder runs: the runtime stops mirroring checkpoints into the cache (which would copy every state
once per flush, or every step in ``standard`` mode) and the cache's recurrent tensors are replaced
by empty placeholders, so a decoded batch holds its states once and no modeling code copies them.

Batches are lock-step: every row is one sequence, prefilled together (no padding) and decoded for
the same number of tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from sketchcal.errors import SketchcalError
from sketchcal.runtime.attention import decode_attention
from sketchcal.runtime.patch import Runtime, runtime_of


@dataclass
class DecodeTimes:
    """Wall-clock figures of one :meth:`GraphDecoder.generate` (seconds; CUDA events on a GPU)."""

    prefill_s: float
    warmup_s: float  # the eager first window (kernel compilation included)
    capture_s: float
    decode_s: float  # the replayed steps
    replayed_steps: int

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.decode_s / max(self.replayed_steps, 1)


class GraphDecoder:
    """Greedy decoding of ``model`` (on one device) with CUDA-graph steps.

    Args:
        model: a supported transformers causal LM; enable a runtime on it first to decode in
            ``replay`` / ``sketch`` mode (its backend must be ``triton`` for graphs).
        graphs: capture and replay CUDA graphs (default: on CUDA); False runs the same steps
            eagerly (any device; what the CPU tests check).

    Raises:
        SketchcalError: graphs off CUDA, or with a runtime on the reference backend.
    """

    def __init__(self, model: nn.Module, *, graphs: bool | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise SketchcalError("CUDA graphs need the model on a CUDA device; pass graphs=False")
        self.runtime: Runtime | None = runtime_of(model)
        if self.graphs and self.runtime is not None and self.runtime.backend not in ("triton", "public"):
            raise SketchcalError(
                "graph decoding runs the recurrent layers on GPU kernels; enable the runtime with "
                "backend='triton' (or 'auto' on a GPU, or 'public'), or pass graphs=False"
            )
        windowed = self.runtime is not None and self.runtime.mode != "standard"
        self.phases = self.runtime.window if windowed else 1
        # the runtime's pool holds the states: the cache's copies are released after prefill
        self.release_cache = self.runtime is not None and self.runtime.holds_states
        self.last_times: DecodeTimes | None = None

    @torch.no_grad()
    def generate(
        self, input_ids: Tensor, max_new_tokens: int, attention_mask: Tensor | None = None
    ) -> Tensor:
        """Greedy continuation of ``input_ids`` [B, P] by ``max_new_tokens`` tokens: [B, P + N].

        Token t is the argmax of the logits after token t − 1, as ``generate(do_sample=False)``
        gives; no stop tokens (every row decodes N tokens). Prompts are unpadded: an
        ``attention_mask`` with a zero is refused.
        """
        from transformers import StaticCache

        if input_ids.ndim != 2 or input_ids.shape[1] < 1:
            raise SketchcalError("input_ids must be [batch, prompt_len] with at least one prompt token")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise SketchcalError(
                "GraphDecoder decodes prompts of equal length without padding; group prompts by length "
                "or use model.generate() for padded batches"
            )
        if max_new_tokens < 1:
            raise SketchcalError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        ids = input_ids.to(self.device)
        batch, prompt = ids.shape
        clock = _Clock(self.device)
        cache = StaticCache(config=self.model.config, max_cache_len=prompt + max_new_tokens)
        mirror = self.runtime.mirror_cache if self.runtime is not None else None
        if self.runtime is not None:
            self.runtime.mirror_cache = False
        with decode_attention(self.model):
            try:
                logits = self._forward(ids, cache)
                out = torch.empty(batch, max_new_tokens, dtype=ids.dtype, device=self.device)
                token = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]: the static input of every step
                out[:, 0] = token[:, 0]
                if self.release_cache:
                    _release_recurrent_tensors(cache)
                prefill_s = clock.lap()

                def step() -> None:
                    token.copy_(self._forward(token, cache)[:, -1].argmax(-1, keepdim=True))

                steps = max_new_tokens - 1
                eager = steps if not self.graphs else min(steps, self.phases)
                for t in range(eager):
                    step()
                    out[:, 1 + t] = token[:, 0]
                warmup_s = clock.lap()
                graphs = self._capture(step) if steps > eager else []
                capture_s = clock.lap()
                for i, t in enumerate(range(eager, steps)):
                    graphs[i % len(graphs)].replay()
                    out[:, 1 + t] = token[:, 0]
                decode_s = clock.lap()
            finally:
                if self.runtime is not None:
                    self.runtime.mirror_cache = mirror
        self.last_times = DecodeTimes(prefill_s, warmup_s, capture_s, decode_s, steps - eager)
        return torch.cat([ids, out], dim=1)

    def _forward(self, ids: Tensor, cache) -> Tensor:
        return self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits

    def _capture(self, step: Callable[[], None]) -> list[torch.cuda.CUDAGraph]:
        """One graph per window phase, captured in window order into one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        graphs = []
        torch.cuda.synchronize(self.device)
        for _ in range(self.phases):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                step()
            graphs.append(g)
        return graphs


def _release_recurrent_tensors(cache) -> None:
    """Replace the cache's recurrent states by empty placeholders ([..., 0]): the runtime's pool
    holds the states, the model passes the placeholder to its decode function and gets it back as
    the "final state", so whatever the modeling code copies or clones around the call is empty."""
    for layer in getattr(cache, "layers", []):
        states = getattr(layer, "recurrent_states", None)
        if not states:
            continue
        for i, s in states.items() if isinstance(states, dict) else enumerate(states):
            if isinstance(s, Tensor) and s.numel() > 0:
                states[i] = s.new_empty((*s.shape[:-1], 0))


class _Clock:
    """Seconds between laps: CUDA events on a GPU (no sync inside a lap), the host clock elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = [self._mark()]

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        import time

        return time.perf_counter()

    def lap(self) -> float:
        self.marks.append(self._mark())
        a, b = self.marks[-2], self.marks[-1]
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a
