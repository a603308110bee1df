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

:meth:`GraphDecoder.generate` decodes a lock-step batch: every row is one sequence, prefilled
together (no padding) and decoded for the same number of tokens. :meth:`GraphDecoder.serve` decodes
a stream of prompts in ``batch`` slots: each prompt is prefilled (with the others of its length
that take a slot at the same step) and copied into a free slot (its keys and values, conv states
and recurrent states: :meth:`Runtime.adopt`), every row writes and attends at its own position
(``attention.row_positions``), and when a sequence has its tokens (or a stop token) the next prompt
takes its slot between two steps. A sequence that takes a
slot in the middle of a window joins that window where it stands (its buffered tokens read as
nothing), so replay decodes exactly what a lone sequence decodes, and sketch mode does when it
joins at a window start.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from sketchcal.errors import SketchcalError
from sketchcal.runtime.attention import decode_attention, row_positions, write_at_row_positions
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

    @torch.no_grad()
    def serve(
        self,
        prompts: Sequence[Tensor],
        max_new_tokens: int | Sequence[int],
        *,
        batch: int,
        stop_tokens: Sequence[int] = (),
    ) -> list[Tensor]:
        """Greedy continuations of ``prompts`` (1-D token ids each, any lengths), ``batch`` sequences
        decoded at a time; a prompt takes a slot as soon as one is free. A sequence ends after
        ``max_new_tokens`` (for every prompt, or one per prompt) or at its first token in
        ``stop_tokens`` (kept; with stop tokens the host reads each step's tokens, one sync per step).
        Returns each prompt's new tokens, in the order given: what ``generate()`` gives that prompt
        alone, in ``replay`` and ``standard`` mode (see the module docstring for ``sketch``).

        Raises:
            SketchcalError: no prompts, an empty or batched prompt, a count below 1, or a model whose
                attention is not SDPA (the rows' own masks come with the decode attention).
        """
        from transformers import StaticCache

        counts = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if not prompts or len(counts) != len(prompts):
            raise SketchcalError("serve needs at least one prompt and one max_new_tokens per prompt")
        if any(p.ndim != 1 or p.numel() < 1 for p in prompts):
            raise SketchcalError("each prompt must be a 1-D tensor of at least one token id")
        if min(counts) < 1 or batch < 1:
            raise SketchcalError("max_new_tokens and batch must be at least 1")
        length = max(p.numel() + n for p, n in zip(prompts, counts, strict=True))
        cache = StaticCache(config=self.model.config, max_cache_len=length)
        mirror = self.runtime.mirror_cache if self.runtime is not None else None
        if self.runtime is not None:
            self.runtime.mirror_cache = False
        with decode_attention(self.model) as grouped:
            if not grouped:
                raise SketchcalError(
                    "serve needs the model's SDPA attention (load it with attn_implementation='sdpa')"
                )
            try:
                on_device = [p.to(self.device) for p in prompts]
                return _Slots(self, cache, length, on_device, counts, batch, set(stop_tokens)).run()
            finally:
                if self.runtime is not None:
                    self.runtime.mirror_cache = mirror

    def _forward(self, ids: Tensor, cache, **kwargs) -> Tensor:
        return self.model(
            input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1, **kwargs
        ).logits

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


class _Slots:
    """The slots of one :meth:`GraphDecoder.serve`: which prompt each row decodes, and the loop.

    Device tensors the steps read (a CUDA graph replays them): ``token`` [B, 1] the last token of
    each row, ``positions`` [B] the position its next token takes, ``live`` [B] 1 where a row decodes
    a prompt (an idle row repeats its position). Host bookkeeping: the prompt of each row, the
    tokens it still has, the step its tokens start at; ``log`` keeps every step's tokens [B].
    """

    def __init__(self, decoder: GraphDecoder, cache, length: int, prompts: list[Tensor], counts: list[int],
                 batch: int, stop: set[int]):  # fmt: skip
        self.decoder, self.cache, self.length = decoder, cache, length  # (the caches' positions)
        self.prompts, self.counts, self.stop = prompts, counts, stop
        dev = decoder.device
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.positions = torch.zeros(batch, dtype=torch.long, device=dev)
        self.live = torch.zeros(batch, dtype=torch.long, device=dev)
        self.queue = deque(range(len(prompts)))
        self.first: dict[int, Tensor] = {}  # prompt → its first new token (from its prefill) [1]
        self.spans: dict[int, tuple[int, int, int]] = {}  # prompt → (row, first step, end step)
        self.request, self.left, self.since = [-1] * batch, [0] * batch, [0] * batch
        self.log: list[Tensor] = []

    def run(self) -> list[Tensor]:
        dec, batch = self.decoder, self.token.shape[0]
        # lay out the batch's cache and states with a one-token prefill; every row is then replaced
        dec._forward(self.prompts[0][:1].expand(batch, 1), self.cache)
        if dec.release_cache:
            _release_recurrent_tensors(self.cache)
        restore = write_at_row_positions(self.cache, self.positions)
        try:
            self.fill(list(range(batch)))
            graphs: list[torch.cuda.CUDAGraph] = []
            while any(r >= 0 for r in self.request):
                if graphs:
                    graphs[len(self.log) % dec.phases].replay()
                elif dec.graphs and len(self.log) == dec.phases:  # the first window ran eagerly
                    graphs = dec._capture(self.step)
                    graphs[0].replay()
                else:
                    self.step()
                self.log.append(self.token[:, 0].clone())
                self.retire()
        finally:
            restore()
        steps = torch.stack(self.log) if self.log else self.token.new_zeros(0, batch)
        return [torch.cat([self.first[r], steps[a:b, row]]) for r, (row, a, b) in sorted(self.spans.items())]

    def step(self) -> None:
        """One token for every row, each at its own position (what a graph captures)."""
        with row_positions(self.positions):
            logits = self.decoder._forward(self.token, self.cache, position_ids=self.positions[:, None])
        self.token.copy_(logits[:, -1].argmax(-1, keepdim=True))
        self.positions.add_(self.live)

    def retire(self) -> None:
        """Rows whose sequence has its tokens (or a stop token) go to the next prompts."""
        tokens = self.log[-1].tolist() if self.stop else None
        free = []
        for row, r in enumerate(self.request):
            if r < 0:
                continue
            self.left[row] -= 1
            if self.left[row] == 0 or (tokens is not None and tokens[row] in self.stop):
                self.spans[r] = (row, self.since[row], len(self.log))
                free.append(row)
        if free:
            self.fill(free)

    def fill(self, rows: list[int]) -> None:
        """Give each of ``rows`` the next prompt, or leave it idle. Prompts of one length are
        prefilled together, then each is adopted into its row."""
        from transformers import StaticCache

        dec, rows = self.decoder, list(rows)
        while rows and self.queue:
            taken = [self.queue.popleft() for _ in range(min(len(rows), len(self.queue)))]
            for n in dict.fromkeys(self.prompts[r].numel() for r in taken):  # lengths, in queue order
                group = [r for r in taken if self.prompts[r].numel() == n]
                donor = StaticCache(config=dec.model.config, max_cache_len=self.length)
                ids = torch.stack([self.prompts[r] for r in group])
                first = dec._forward(ids, donor)[:, -1].argmax(-1, keepdim=True)  # [k, 1]
                for i, r in enumerate(group):
                    self.first[r] = first[i]
                    if self.counts[r] == 1 or (self.stop and int(first[i]) in self.stop):
                        self.spans[r] = (0, len(self.log), len(self.log))  # done at its prefill
                        continue
                    row = rows.pop(0)
                    _copy_row(self.cache, row, donor, i)
                    if dec.runtime is not None:
                        dec.runtime.adopt(self.cache, row, donor, len(self.log) % dec.phases, row=i)
                    self.token[row] = first[i]
                    self.positions[row] = n
                    self.live[row] = 1
                    self.request[row], self.left[row], self.since[row] = r, self.counts[r] - 1, len(self.log)
        for row in rows:
            self.live[row], self.request[row] = 0, -1


def _copy_row(cache, row: int, donor, donor_row: int) -> None:
    """Row ``row`` of every per-sequence tensor of ``cache`` (keys, values, conv and recurrent states)
    from row ``donor_row`` of ``donor``'s; placeholders (a runtime's pool holds the recurrent
    states) are left alone."""
    for mine, theirs in zip(getattr(cache, "layers", []), getattr(donor, "layers", []), strict=True):
        for name in ("keys", "values", "conv_states", "recurrent_states"):
            a, b = getattr(mine, name, None), getattr(theirs, name, None)
            pairs = zip(a.values(), b.values(), strict=True) if isinstance(a, dict) else [(a, b)]
            for t, src in pairs:
                if (
                    isinstance(t, Tensor)
                    and isinstance(src, Tensor)
                    and t.numel()
                    and t.shape[1:] == src.shape[1:]
                ):
                    t[row] = src[donor_row]


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
