"""Whole-model decode throughput: ``sketchcal bench MODEL --e2e``.

For one model and each batch size, in one process, one prompt batch (random token ids, ``prompt``
tokens each) is decoded greedily for ``new`` tokens by:

- ``generate``: plain ``model.generate()``, as a user has it (dynamic cache, the model's own decode
  kernels: fla / mamba-ssm where installed);
- ``own``: :class:`~sketchcal.runtime.graph_decode.GraphDecoder` with the model's own decode
  kernels, as transformers calls them (its state layout, and the modeling code's copies of each
  new state into the cache);
- ``public``: the graph decoder with the runtime's ``public`` backend: the family's fastest public
  decode kernel (fla's GDN kernel value-major, fla's KDA kernel, vLLM's ``selective_state_update``)
  in place on a slot pool, fed the model's own decode arguments: the fast loop with the best
  public kernels, the baseline of the sketch's speed-up;
- ``standard``, ``replay``, ``sketch``: the graph decoder with the runtime's Triton kernels in that
  mode (sketch at the artifact's ranks; for a random-weight config, random bases at ``rank``
  spread over the heads as an allocation spreads them);
- ``bound``: the graph decoder with every recurrent layer's decode call replaced by one that
  returns zeros and touches no state: the step without its recurrent-state work, the most any
  recurrent kernel could gain (the Amdahl bound);
- ``adaptive`` (not run by default): the graph decoder with the Triton kernels in sketch mode
  reading the adaptive sketch at the sketch's read bytes (the artifact itself when it is adaptive,
  else its ranks re-ranked by ``sketchcal.verify.adaptive.adaptive_counterpart``).

``prefill_rows`` runs the recurrent layers' prefill function a few sequences at a time
(:func:`prefill_in_rows`): the same function and results with a lower peak, for models whose
prefill does not fit the whole batch at once (transformers' torch Mamba-2 scan where mamba_ssm is
not installed). Decoding is unchanged.

Each row reports the prefill time, the decode time per step over the graph-replayed steps (CUDA
events; ``generate``: its whole decode over ``new`` − 1 steps), decode tokens/s (batch ÷ step),
peak GPU memory (``torch.cuda.max_memory_allocated`` over that row's prefill and decode) and the
share of tokens equal to ``standard``'s.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from sketchcal.errors import SketchcalError

MODES = ("generate", "own", "public", "standard", "replay", "sketch", "bound", "adaptive")
DEFAULT_MODES = tuple(m for m in MODES if m != "adaptive")
OUT_OF_MEMORY = "out of GPU memory"


def load_bench_model(name: str, *, layers: int | None = None, dtype: torch.dtype = torch.bfloat16):
    """``(model, artifact or None)``: a random-weight model of a real config (:data:`REAL_CONFIGS`),
    a converted model directory (its base weights and sketch), or any supported model id."""
    import transformers as tf

    from sketchcal.models.real import REAL_CONFIGS, real_config

    if name in REAL_CONFIGS:
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = tf.AutoModelForCausalLM.from_config(real_config(name, layers), dtype=dtype)
        return model.eval(), None
    from sketchcal.artifact.sketch import CONFIG_KEY, read_sketch
    from sketchcal.models.loading import load_model

    artifact = None
    path = Path(name)
    if (path / "config.json").is_file() and CONFIG_KEY in json.loads((path / "config.json").read_text()):
        artifact = read_sketch(path)
    loaded = load_model(name, device="cuda", dtype="float32" if name.startswith("builtin:") else "auto")
    return loaded.model.eval(), artifact


def random_artifact(model: nn.Module, rank: float, window: int):
    """A sketch of ``model``'s layers with random orthonormal frames and maps, per-head ranks spread
    around ``rank`` as an allocation spreads them (the kernels' speed does not depend on values)."""
    from sketchcal import __version__
    from sketchcal.artifact.sketch import SketchArtifact, SketchLayer
    from sketchcal.kernels.common.pool import rank_spread
    from sketchcal.models import describe

    spec = describe(model)
    gen = torch.Generator().manual_seed(0)
    layers = []
    for s in spec.layers:
        ranks = [s.key_dim if r == 0 else r for r in rank_spread(s.heads, rank, s.key_dim)]
        frame = torch.linalg.qr(torch.randn(s.groups, s.key_dim, s.key_dim, generator=gen))[0]
        coef = torch.zeros(s.heads, max(ranks), s.key_dim)
        for h, m in enumerate(ranks):
            coef[h, :m, :m] = torch.eye(m)
        layers.append(SketchLayer(s.layer, frame, coef, torch.tensor(ranks, dtype=torch.int32)))
    config = {
        "family": spec.family,
        "window": window,
        "traffic": {"read_dtype": "bf16", "buffer_dtype": "bf16"},
    }
    meta = {"fingerprint": spec.fingerprint, "producer": f"sketchcal {__version__} (random bench sketch)"}
    return SketchArtifact(config, meta, layers)


@contextlib.contextmanager
def state_work_removed(model: nn.Module) -> Iterator[None]:
    """Replace the recurrent layers' decode function by one that returns zeros and the state it was
    given, untouched (the Amdahl bound's step)."""
    from sketchcal.models import describe

    spec = describe(model)
    module = importlib.import_module(spec.arch.module)
    name = spec.adapter.decode_fn
    original = getattr(module, name)

    if spec.family == "mamba2":

        def null(state, hidden_states, *args, **kwargs):
            return torch.zeros_like(hidden_states)
    else:

        def null(query, key, value, *args, initial_state=None, **kwargs):
            return torch.zeros_like(value), initial_state

    setattr(module, name, null)
    try:
        yield
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def prefill_in_rows(model: nn.Module, rows: int | None) -> Iterator[None]:
    """Make the recurrent layers' prefill function run ``rows`` sequences at a time (None: as it
    is): its token and initial-state arguments are split along the batch, everything else passed
    whole, and the outputs (and final states) joined. Enter it before a runtime is enabled: the
    runtime then calls it as the model's own prefill."""
    if rows is None:
        yield
        return
    if rows < 1:
        raise SketchcalError(f"--prefill-rows must be at least 1, got {rows}")
    import inspect

    from sketchcal.models import describe
    from sketchcal.models.capture import torch_reference
    from sketchcal.runtime.families import GLUES

    spec = describe(model)
    glue = GLUES[spec.family]
    module = importlib.import_module(spec.arch.module)
    name = spec.adapter.prefill_fn
    original = getattr(module, name)
    reference = torch_reference(original)
    signature = inspect.signature(reference)
    names = list(signature.parameters)
    # per-sequence arguments (Mamba-2's gate z and sequence index, when a caller passes them)
    split = {*glue.token_args, glue.prefill_state, "z", "seq_idx"}

    def in_rows(*args, **kwargs):
        batch = signature.bind(*args, **kwargs).arguments[glue.token_args[0]].shape[0]
        if batch <= rows:
            return original(*args, **kwargs)

        def rows_of(name: str, value, start: int):
            return value[start : start + rows] if name in split and value is not None else value

        parts = []
        for s in range(0, batch, rows):  # the caller's positional / keyword layout, kept
            part_args = [rows_of(names[i], a, s) for i, a in enumerate(args)]
            parts.append(original(*part_args, **{k: rows_of(k, v, s) for k, v in kwargs.items()}))
        if isinstance(parts[0], tuple):
            return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts, strict=True))
        return torch.cat(parts)

    # no __wrapped__: a runtime enabled inside calls this on every device, as the model does
    in_rows.__signature__, in_rows.__name__ = signature, name
    setattr(module, name, in_rows)
    try:
        yield
    finally:
        setattr(module, name, original)


def _peak_reset() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _generate_row(model: nn.Module, ids: torch.Tensor, new: int) -> tuple[dict, torch.Tensor]:
    opts = dict(do_sample=False, pad_token_id=0, eos_token_id=None, attention_mask=torch.ones_like(ids))

    def timed(n: int) -> tuple[float, torch.Tensor]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **opts)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    timed(2)  # compiles and autotunes the model's kernels at this batch's shapes
    prefill_s, _ = timed(1)
    total_s, out = timed(new)
    step_ms = 1e3 * (total_s - prefill_s) / (new - 1)
    return dict(prefill_s=prefill_s, ms_per_step=step_ms), out


def adaptive_at_bytes_of(model: nn.Module, artifact):
    """``artifact`` as an adaptive sketch that reads its bytes: itself when it is one, else its ranks
    re-ranked (``adaptive_counterpart``)."""
    from sketchcal.models import describe
    from sketchcal.verify.adaptive import adaptive_counterpart

    if artifact.sketch_map == "adaptive":
        return artifact
    return adaptive_counterpart(artifact, describe(model))


def _graph_row(model: nn.Module, ids: torch.Tensor, new: int, mode: str, artifact, window: int):
    from sketchcal.runtime.graph_decode import GraphDecoder
    from sketchcal.runtime.patch import enabled

    if mode in ("own", "bound"):
        with state_work_removed(model) if mode == "bound" else contextlib.nullcontext():
            decoder = GraphDecoder(model)
            decoder.release_cache = mode == "bound"
            out = decoder.generate(ids, new)
    else:
        backend, run_mode, art = "triton", mode, None
        if mode == "public":
            backend, run_mode = "public", "standard"
        elif mode == "sketch":
            art = artifact
        elif mode == "adaptive":  # sketch mode; the artifact says which map it reads
            run_mode, art = "sketch", adaptive_at_bytes_of(model, artifact)
        with enabled(model, art, run_mode, window=window, backend=backend) as rt:
            if rt.backend != backend:
                raise SketchcalError(f"the {backend} backend cannot run this model in {mode} mode")
            decoder = GraphDecoder(model)
            out = decoder.generate(ids, new)
    t = decoder.last_times
    row = dict(prefill_s=t.prefill_s, ms_per_step=t.ms_per_step, capture_s=t.capture_s)
    return row, out


def run_e2e(
    model_name: str,
    batches: list[int],
    *,
    prompt: int = 1024,
    new: int = 256,
    rank: float = 8.0,
    window: int = 16,
    modes: tuple[str, ...] = DEFAULT_MODES,
    layers: int | None = None,
    prefill_rows: int | None = None,
    progress: bool = True,
) -> dict:
    """Decode throughput of ``model_name`` at each batch size in each mode (see the module docstring)."""
    from sketchcal.ui import progress_bar

    if prefill_rows is not None and prefill_rows < 1:
        raise SketchcalError(f"--prefill-rows must be at least 1, got {prefill_rows}")
    if not torch.cuda.is_available():
        raise SketchcalError("sketchcal bench --e2e needs a CUDA device and none is visible to torch")
    if unknown := set(modes) - set(MODES):
        raise SketchcalError(f"unknown modes {sorted(unknown)}; choose among {', '.join(MODES)}")
    if new < 2 * window + 1:
        raise SketchcalError(f"--new-tokens must be at least {2 * window + 1} (two windows and a step)")
    model, artifact = load_bench_model(model_name, layers=layers)
    if artifact is None:
        artifact = random_artifact(model, rank, window)
    else:
        window = int(artifact.config.get("window", window))
    from sketchcal.models import describe

    spec = describe(model)
    vocab = model.config.get_text_config().vocab_size
    result = dict(
        model=model_name,
        family=spec.family,
        recurrent_layers=len(spec.layers),
        layers=model.config.get_text_config().num_hidden_layers,
        params=sum(p.numel() for p in model.parameters()),
        dtype=str(next(model.parameters()).dtype),
        prompt=prompt,
        new=new,
        prefill_rows=prefill_rows,
        window=window,
        mean_rank=float(torch.cat([lay.ranks.float() for lay in artifact.layers]).mean()),
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        rows=[],
    )
    with torch.no_grad(), prefill_in_rows(model, prefill_rows), progress_bar(enabled=progress) as bar:
        task = bar.add_task("e2e", total=len(batches) * len(modes))
        for batch in batches:
            ids = torch.randint(3, vocab, (batch, prompt), generator=torch.Generator().manual_seed(batch))
            ids = ids.cuda()
            tokens: dict[str, torch.Tensor] = {}
            for mode in modes:
                bar.update(task, description=f"batch {batch}: {mode}")
                _peak_reset()
                try:
                    if mode == "generate":
                        row, out = _generate_row(model, ids, new)
                    else:
                        row, out = _graph_row(model, ids, new, mode, artifact, window)
                    row.update(peak_gib=torch.cuda.max_memory_allocated() / 2**30)
                    tokens[mode] = out[:, prompt:].cpu()
                except torch.OutOfMemoryError:
                    row = dict(error=OUT_OF_MEMORY)
                except SketchcalError as err:
                    row = dict(error=str(err))
                row.update(batch=batch, mode=mode)
                if "ms_per_step" in row:
                    row["tokens_per_s"] = batch / (row["ms_per_step"] / 1e3)
                result["rows"].append(row)
                bar.console.log(_row_line(row))
                bar.advance(task)
            ref = tokens.get("standard")
            for row in result["rows"]:
                if row["batch"] == batch and ref is not None and row["mode"] in tokens:
                    row["same_tokens_as_standard"] = float((tokens[row["mode"]] == ref).float().mean())
    _summarise(result)
    return result


def _row_line(row: dict) -> str:
    """One row as a log line (printed as soon as it is measured)."""
    if "error" in row:
        return f"batch {row['batch']} {row['mode']}: {row['error']}"
    return (
        f"batch {row['batch']} {row['mode']}: prefill {row['prefill_s']:.2f} s, "
        f"{row['ms_per_step']:.2f} ms/step, "
        f"{row['tokens_per_s']:,.0f} tokens/s, peak {row['peak_gib']:.1f} GiB"
    )


def _summarise(result: dict) -> None:
    """Per batch: each mode's speed-up over ``generate`` and ``own``, and the sketch's share of the
    Amdahl-bound gain (over ``standard``)."""
    by = {(r["batch"], r["mode"]): r for r in result["rows"] if "ms_per_step" in r}
    summary = []
    for batch in sorted({b for b, _ in by}):
        step = {m: by[(batch, m)]["ms_per_step"] for (b, m) in by if b == batch}
        line: dict = {"batch": batch}
        for base in ("generate", "own", "public", "standard"):
            if base in step:
                line[f"vs_{base}"] = {m: step[base] / ms for m, ms in step.items()}
        if {"standard", "bound"} <= step.keys() and step["standard"] > step["bound"]:
            for m in ("sketch", "adaptive"):
                if m in step:
                    line[f"{m}_share_of_bound_gain"] = (step["standard"] - step[m]) / (
                        step["standard"] - step["bound"]
                    )
        summary.append(line)
    result["summary"] = summary


def _ratio(summary: dict, key: str, mode: str) -> str:
    """A speed-up cell: "–" where the batch has no row of the mode it is relative to."""
    value = summary.get(key, {}).get(mode)
    return "–" if value is None else f"{value:.2f}"


def print_e2e(result: dict, console=None) -> None:
    """A rich table of :func:`run_e2e`'s rows."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(
        title=f"{result['model']} ({result['family']}, {result['recurrent_layers']} recurrent of "
        f"{result['layers']} layers, {result['dtype']}) · prompt {result['prompt']} · {result['new']} new · "
        f"L={result['window']} · mean rank {result['mean_rank']:.1f} · {result['device']}"
    )
    for col in (
        "batch",
        "mode",
        "prefill s",
        "ms/step",
        "tokens/s",
        "× generate",
        "× own",
        "× public",
        "peak GiB",
        "= std",
    ):
        table.add_column(col, justify="left" if col == "mode" else "right")
    summary = {s["batch"]: s for s in result["summary"]}
    for r in result["rows"]:
        if "error" in r:
            table.add_row(str(r["batch"]), r["mode"], r["error"], *[""] * 7)
            continue
        s = summary.get(r["batch"], {})
        table.add_row(
            str(r["batch"]),
            r["mode"],
            f"{r['prefill_s']:.2f}",
            f"{r['ms_per_step']:.2f}",
            f"{r['tokens_per_s']:,.0f}",
            _ratio(s, "vs_generate", r["mode"]),
            _ratio(s, "vs_own", r["mode"]),
            _ratio(s, "vs_public", r["mode"]),
            f"{r['peak_gib']:.1f}",
            f"{r['same_tokens_as_standard']:.1%}" if "same_tokens_as_standard" in r else "–",
        )
    console.print(table)
    if any(r.get("error") == OUT_OF_MEMORY for r in result["rows"]):
        console.print(
            "rows out of GPU memory: try a smaller --batch, or --prefill-rows N where the prefill does "
            "not fit (transformers' torch Mamba-2 scan holds a whole batch's chunk temporaries)"
        )
    for s in result["summary"]:
        for m, what in (("sketch", "the sketch"), ("adaptive", "the adaptive sketch")):
            share = s.get(f"{m}_share_of_bound_gain")
            if share is not None:
                console.print(
                    f"batch {s['batch']}: {what} gets {share:.0%} of the Amdahl-bound gain over standard"
                )
