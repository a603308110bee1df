"""``sketchcal.calibrate()``: stream window statistics of a model over calibration text."""

from __future__ import annotations

import inspect
import math
import resource
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import sketchcal
from sketchcal.calibrate.distributed import World, init_world
from sketchcal.calibrate.fisher import OutputWeights
from sketchcal.calibrate.plots import spectra_plot
from sketchcal.calibrate.preflight import check_output, check_resume
from sketchcal.calibrate.stats import LayerStats
from sketchcal.errors import SketchcalError
from sketchcal.formats.stats import (
    FORMAT,
    VERSION,
    load_progress,
    prepare_out_dir,
    save_progress,
    write_final,
)
from sketchcal.kernels.common import family
from sketchcal.models import MixerCall, MixerTap, ModelSpec
from sketchcal.models.loading import LoadedModel, load_model, resolve_device
from sketchcal.settings import CalibrateSettings, api_signature

# the options that set build_samples' counts and lengths, named in its errors
_SAMPLE_OPTIONS = {"num_samples": "--samples", "heldout_samples": "--heldout-samples", "seq_len": "--seq-len"}


@dataclass
class _Batch:
    split: str
    index: int  # global batch index: held-out batches come first
    ids: list[list[int]]


@dataclass
class _Counters:
    tokens: dict[str, dict[str, int]] = field(
        default_factory=lambda: {s: {"prompt": 0, "decode": 0} for s in ("calib", "heldout")}
    )
    gen_seconds: float = 0.0
    fisher_seconds: float = 0.0
    capture_seconds: float = 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tapped_forward(
    model: torch.nn.Module,
    spec: ModelSpec,
    seq: torch.Tensor,
    valid: torch.Tensor,
    prompt_end: int,
    on_call: Callable[[MixerCall, torch.Tensor, int], None],
) -> None:
    """Teacher-forced forward of ``seq`` [B, T] reporting each mixer call of the decoded part.

    The prompt (``seq[:, :prompt_end]``) is prefilled untapped with a cache: its final state, as
    the model itself computes it, is the first checkpoint (what a serving engine stores), so only
    the decoded tokens are scanned. ``on_call(call, valid_of_the_fed_tokens, prompt_end_within_them)``;
    the call's ``initial_state`` is the prefill state; the fed tokens are the last of ``seq``. Falls
    back to one tapped forward of the whole sequence when there is no prompt, nothing after it, or
    the model returns no cache. The tapped tokens are converted with the one-token function's
    dynamics (they are decoded tokens).
    """
    cache = None
    # the cache's keyword: past_key_values for most models, cache for pure Mamba-2 ones
    cache_arg = (
        "past_key_values" if "past_key_values" in inspect.signature(model.forward).parameters else "cache"
    )
    if 0 < prompt_end < seq.shape[1]:
        out = model(
            input_ids=seq[:, :prompt_end],
            attention_mask=valid[:, :prompt_end].long(),
            use_cache=True,
            logits_to_keep=1,
        )
        cache = getattr(out, cache_arg, None)
    if cache is None:
        feed, feed_valid, start = seq, valid, prompt_end
    else:
        feed, feed_valid, start = seq[:, prompt_end:], valid[:, prompt_end:], 0
    with MixerTap(model, spec, lambda call: on_call(call, feed_valid, start), step_dynamics=True):
        model(
            input_ids=feed,
            attention_mask=valid.long(),
            use_cache=cache is not None,
            **({cache_arg: cache} if cache is not None else {}),
            logits_to_keep=1,
        )


class _Runner:
    def __init__(self, loaded: LoadedModel, settings: CalibrateSettings, world: World):
        self.loaded, self.s, self.world = loaded, settings, world
        self.family = family(loaded.spec.family)
        self.stats = {
            (split, shape.layer): LayerStats(
                shape, settings.window, settings.heldout_windows if split == "heldout" else 0
            )
            for split in ("calib", "heldout")
            for shape in loaded.spec.layers
        }
        self.counters = _Counters()
        self.output_weights = OutputWeights(loaded.model, loaded.spec)
        tok = loaded.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.eos_id = tok.eos_token_id

    def _pad(self, ids: list[list[int]], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(x) for x in ids)
        rows, masks = [], []
        for x in ids:
            pad = [self.pad_id] * (width - len(x))
            rows.append(pad + x if left else x + pad)
            ones, zeros = [1] * len(x), [0] * (width - len(x))
            masks.append(zeros + ones if left else ones + zeros)
        dev = self.loaded.device
        return torch.tensor(rows, device=dev), torch.tensor(masks, device=dev, dtype=torch.bool)

    @torch.no_grad()
    def process(self, batch: _Batch) -> None:
        s, model, dev = self.s, self.loaded.model, self.loaded.device
        if s.gen_tokens > 0:
            ids, mask = self._pad(batch.ids, left=True)
            prompt_end = ids.shape[1]
            torch.manual_seed(s.seed * 1_000_003 + batch.index)
            _sync(dev)
            t0 = time.perf_counter()
            seq = model.generate(
                input_ids=ids,
                attention_mask=mask.long(),
                max_new_tokens=s.gen_tokens,
                do_sample=s.do_sample,
                temperature=s.temperature if s.do_sample else None,
                top_p=None,
                top_k=None,
                pad_token_id=self.pad_id,
            )
            _sync(dev)
            self.counters.gen_seconds += time.perf_counter() - t0
            gen = seq[:, prompt_end:]
            is_eos = (
                gen == self.eos_id if self.eos_id is not None else torch.zeros_like(gen, dtype=torch.bool)
            )
            after_eos = (is_eos.long().cumsum(1) - is_eos.long()) > 0
            valid = torch.cat([mask, ~after_eos], dim=1)
        else:
            seq, valid = self._pad(batch.ids, left=False)
            prompt_end = s.prompt_len
        tokens = self.counters.tokens[batch.split]
        tokens["prompt"] += int(valid[:, :prompt_end].sum())
        tokens["decode"] += int(valid[:, prompt_end:].sum())

        _sync(dev)
        t0 = time.perf_counter()
        targets = torch.Generator().manual_seed(s.seed * 1_000_003 + batch.index)
        gamma = self.output_weights(seq, valid, prompt_end, targets)
        _sync(dev)
        self.counters.fisher_seconds += time.perf_counter() - t0
        t0 = time.perf_counter()

        def on_call(call: MixerCall, valid_fed: torch.Tensor, start: int) -> None:
            stats = self.stats[(batch.split, call.layer)]
            fed = gamma[call.layer][:, seq.shape[1] - valid_fed.shape[1] :]
            stats.update(self.family, call.inputs, valid_fed, start, call.initial_state, fed)

        tapped_forward(model, self.loaded.spec, seq, valid, prompt_end, on_call)
        _sync(dev)
        self.counters.capture_seconds += time.perf_counter() - t0

    def reduce_into(self, totals: dict[str, torch.Tensor]) -> None:
        """All-reduce this round's sums over ranks and add them to ``totals`` (CPU, on rank 0)."""
        for (split, layer), st in self.stats.items():
            for name, delta in st.take_sums().items():
                if self.world.size > 1:  # every rank must reduce on the same kind of device (NCCL: CUDA)
                    delta = delta.to(self.loaded.device)
                delta = self.world.all_reduce(delta).cpu()
                key = f"layers.{layer}.{split}.{name}"
                totals[key] = totals[key] + delta if key in totals else delta
            for name, t in st.kept_windows().items():
                if t.shape[0]:
                    totals[f"layers.{layer}.{split}.{name}"] = t

    def ensure_all_layers(self, totals: dict[str, torch.Tensor]) -> None:
        """Held-out window tensors exist even when no window was kept (empty, with the right shapes)."""
        for (split, layer), st in self.stats.items():
            for name, t in st.kept_windows().items():
                totals.setdefault(f"layers.{layer}.{split}.{name}", t)


def _check_finite(totals: dict[str, torch.Tensor]) -> None:
    for name, t in totals.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            layer = name.split(".")[1]
            raise SketchcalError(
                f"NaN or Inf in the statistics of layer {layer} ({name}): the model produced non-finite "
                "values; try --dtype float32 or check the model"
            )


def calibrate(model: str | None = None, **options: Any) -> dict[str, Any]:
    """Capture window statistics of ``model`` and write a statistics directory to ``out``.

    ``model``: Hub id, local directory or ``builtin:NAME`` (None: the package's default). The options
    are the fields of :class:`~sketchcal.settings.CalibrateSettings` (``out="stats"``, ``samples``,
    ``seq_len=512``, ...), the same as ``sketchcal calibrate``'s.

    Returns the manifest written to ``out/manifest.json`` (an empty dict on ranks other than 0 of a
    data-parallel run).
    """
    return run_calibration(CalibrateSettings(model=model, **options))


calibrate.__signature__ = api_signature(CalibrateSettings, "model")  # type: ignore[attr-defined]


def run_calibration(settings: CalibrateSettings) -> dict[str, Any]:
    """:func:`calibrate` for a settings object."""
    out = settings.out
    dev = resolve_device(settings.device)
    world = init_world(dev)
    if world.size > 1 and dev.startswith("cuda"):
        dev = f"cuda:{world.local_rank}"
    s = settings = settings.for_device(dev)
    if world.is_main:
        prepare_out_dir(out, resume=s.resume, overwrite=s.overwrite, clear=False)
        check_output(s)
    created = not out.exists()

    from sketchcal.data import build_samples
    from sketchcal.ui import console, progress_bar

    loaded = load_model(
        s.model,
        revision=s.revision,
        device=dev,
        dtype=s.dtype,
        device_map=s.device_map,
        trust_remote_code=s.trust_remote_code,
    )
    sample_set = build_samples(
        loaded.tokenizer, s.data, num_samples=s.samples, seq_len=s.seq_len,
        heldout_samples=s.heldout_samples, seed=s.seed, chat_template=s.chat_template,
        text_field=s.text_field, revision=s.data_revision,
        option_names=_SAMPLE_OPTIONS,
    )  # fmt: skip
    if world.is_main:
        prepare_out_dir(out, resume=s.resume, overwrite=s.overwrite, clear=True)
    world.barrier()
    run_id = {
        "settings": s.run_identity(),
        "fingerprint": loaded.spec.fingerprint,
        "weights": loaded.weights_fingerprint,
        "data": sample_set.info,
    }

    bs = s.batch_size
    batches = [
        _Batch(split, 0, ids[i : i + bs])
        for split, ids in (("heldout", sample_set.heldout), ("calib", sample_set.calib))
        for i in range(0, len(ids), bs)
    ]
    for i, b in enumerate(batches):
        b.index = i
    rounds = math.ceil(len(batches) / world.size)

    runner = _Runner(loaded, settings, world)
    totals: dict[str, torch.Tensor] = {}
    start = 0
    if s.resume:
        state, totals = load_progress(out) if world.is_main else ({}, {})
        state = world.broadcast_object(state)
        check_resume(state.get("run") or {}, run_id, out)
        start = state["round_done"]
        runner.counters = _Counters(**state["counters"])
        for st in runner.stats.values():
            st.stop_keeping_windows()  # the held-out sample is taken in round 0, already saved

    t_start = time.perf_counter()
    saved = start > 0
    try:
        with progress_bar(enabled=s.progress and world.is_main) as bar:
            task = bar.add_task(f"calibrating {loaded.model_id}", total=rounds, completed=start)
            for r in range(start, rounds):
                gb = r * world.size + world.rank
                if gb < len(batches):
                    runner.process(batches[gb])
                # every round's sums are added in round order, so --save-every does not change the result
                runner.reduce_into(totals)
                if ((r + 1) % s.save_every == 0 or r + 1 == rounds) and world.is_main:
                    _check_finite(totals)
                    state = {"run": run_id, "counters": asdict(runner.counters)}
                    save_progress(out, r + 1, totals, state)
                    saved = True
                bar.update(task, advance=1)
    except BaseException as err:
        if world.is_main and created and not saved:
            shutil.rmtree(out, ignore_errors=True)  # nothing to resume: leave no empty directory behind
        if isinstance(err, KeyboardInterrupt) and world.is_main and saved:
            console.print(
                f"[yellow]interrupted; rerun with --resume to continue from the last saved round in {out}"
            )
        raise

    elapsed = time.perf_counter() - t_start
    if not world.is_main:
        world.barrier()
        return {}
    runner.ensure_all_layers(totals)
    c = runner.counters
    all_tokens = sum(v for split in c.tokens.values() for v in split.values())
    peak_host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux reports KiB)
    timing = {
        "seconds": round(elapsed, 3),
        "tokens_per_second": round(all_tokens / elapsed, 1) if elapsed > 0 else None,
        "generation_seconds": round(c.gen_seconds, 3),
        "output_weight_seconds": round(c.fisher_seconds, 3),
        "capture_seconds": round(c.capture_seconds, 3),
        "peak_host_memory_mib": round(peak_host, 1),
        "peak_device_memory_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1)
        if loaded.device.type == "cuda"
        else None,
        "world_size": world.size,
        "resumed": bool(s.resume),
    }
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "complete": False,
        "tool": {"name": "sketchcal", "version": sketchcal.__version__},
        "model": {
            "id": loaded.model_id,
            "revision": loaded.revision,
            "model_type": loaded.spec.arch.model_type,
            "family": loaded.spec.family,
            "fingerprint": loaded.spec.fingerprint,
            "weights_fingerprint": loaded.weights_fingerprint,
            "dtype": str(next(loaded.model.parameters()).dtype).removeprefix("torch."),
        },
        "data": sample_set.info,
        "seed": s.seed,
        "window": s.window,
        "seq_len": s.seq_len,
        "gen_tokens": s.gen_tokens,
        "prompt_len": s.prompt_len,
        "do_sample": s.do_sample,
        "chat_template": s.chat_template,
        "tokens": c.tokens,
        "samples": {"calib": len(sample_set.calib), "heldout": len(sample_set.heldout)},
        "timing": timing,
        "layers": [shape.as_dict() for shape in loaded.spec.layers],
    }
    # the plot comes first: once write_final drops the progress, the directory must be complete,
    # or a run killed in between would leave one that can neither be resumed nor started again
    spectra_plot(out / "calibration.png", manifest, totals)
    manifest = write_final(out, totals, manifest)
    world.barrier()
    return manifest
