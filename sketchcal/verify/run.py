"""``sketchcal.verify()``: accuracy and traffic of a converted model's sketch against the full state.

Held-out text is run teacher-forced and batched: the first ``prompt`` tokens of every sample are
the prefill (the model's own), the next ``tokens`` are decode steps, several windows long. The same
batches run in every configuration (standard first: it is the reference of the KL and top-1
numbers):

- main: ``standard``, ``replay`` and ``sketch`` (the artifact's ranks);
- ablations: PCA and random bases at the artifact's budget, and a low-precision read copy with two
  precisions against the same precision ``shared`` by the single checkpoint;
- rank sweep: the sketch re-fitted at each ``rank`` budget from the calibration statistics;
- sketch map: each sketch row of the main basis (the artifact's, the sweep's) again with the other
  map at its bytes: the allocation for that map at the row's bytes (``convert --sketch-map``'s),
  or without statistics a static row's ranks re-ranked (:mod:`sketchcal.verify.adaptive`);
  ``sketch_map`` runs every sketch row with the map asked for.

Basis ablations and the rank sweep re-fit the sketch in memory with ``convert``'s own steps
(:func:`~sketchcal.artifact.convert.fit_sketch`, :func:`~sketchcal.artifact.convert.sketch_section`)
on the statistics the artifact was made from: ``stats=`` or the artifact's calibration provenance.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sketchcal.artifact.convert import SketchChoices, fit_sketch, sketch_section, traffic_models
from sketchcal.artifact.sketch import SketchArtifact, check_base_weights, check_stats, read_sketch
from sketchcal.errors import SketchcalError
from sketchcal.fit.ranks import SUPPORTED_RANKS
from sketchcal.formats.stats import Stats, load_stats
from sketchcal.fsutil import check_writable, finite_json
from sketchcal.models import ModelSpec
from sketchcal.runtime import enabled
from sketchcal.runtime.precision import dtype_name, parse_dtype
from sketchcal.settings import VerifySettings, api_signature
from sketchcal.verify.adaptive import adaptive_counterpart
from sketchcal.verify.metrics import ReadErrorMeter, TokenMetrics
from sketchcal.verify.retrieval import RecallSet, build_recall, recall_hits

LOW_PRECISION = "bf16"  # the shared-precision ablation's dtype when the artifact reads in fp32


# The recall task takes the last this many decoded tokens (all of them when there are fewer): 48
# key-value pairs and 16 queries, after the held-out text that the other rows decode, so the pairs are
# stored in states that have run as long as the sequence.
RECALL_SPAN = 128
# The recall rows are reported only where the full-state model does the task: at least this
# accuracy and 5× chance; below, a sketch's recall says nothing about the sketch.
RECALL_FLOOR = 0.1


@dataclass
class RunConfig:
    """One decoding configuration to evaluate."""

    name: str
    mode: str  # standard | replay | sketch
    group: str  # main | ablation | rank sweep
    artifact: SketchArtifact | None = None
    read_dtype: str = "fp32"
    shared: bool = False
    basis: str | None = None
    budget: float | None = None  # mean-rank budget the sketch was fitted for
    sketch_map: str = "static"  # sketch mode: the offline maps, or maps made at each flush


@dataclass
class ConfigResult:
    """What one configuration measured (errors are fractions; KL in nats)."""

    name: str
    mode: str
    group: str
    read_dtype: str
    shared: bool
    basis: str | None
    budget: float | None
    mean_rank: float | None  # over all heads, dense counted as K
    layer_mean_rank: dict[int, float]
    tokens: int
    kl_mean: float
    kl_p99: float
    top1_agreement: float
    perplexity: float
    kl_by_position: list[float]
    kl_by_length: list[float]  # mean KL over equal spans of the decoded positions (metrics.length_edges)
    read_error: dict[int, float]  # per layer, Σ‖Δ‖²/Σ‖exact‖² of the non-flush reads
    retrieval_accuracy: float | None
    traffic: dict[str, float]
    sketch_map: str = "static"

    @property
    def mean_read_error(self) -> float:
        vals = list(self.read_error.values())
        return sum(vals) / len(vals) if vals else 0.0


@dataclass
class VerifyResult:
    model_dir: str
    model_id: str  # where the weights came from
    base_model: str | None  # the base model the sketch was converted from
    family: str
    window: int
    prompt: int
    tokens: int
    samples: int
    dtype: str  # the compute dtype of every row
    data: dict[str, Any]
    retrieval: dict[str, Any] | None
    configs: list[ConfigResult]
    command: str
    notes: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)

    def config(self, name: str) -> ConfigResult:
        for c in self.configs:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for c in d["configs"]:
            c["read_error"] = {str(k): v for k, v in c["read_error"].items()}
            c["layer_mean_rank"] = {str(k): v for k, v in c["layer_mean_rank"].items()}
        return finite_json(d)


# ---- setup ---------------------------------------------------------------------------------------


def _has_weights(d: Path) -> bool:
    return any(d.glob("*.safetensors")) or (d / "model.safetensors.index.json").is_file()


def _load(model_dir: Path, baseline: str | None, device: str, dtype: str):
    """The model to run (its weights) and the sketch; the sketch's fingerprint must match the model."""
    from sketchcal.models.loading import load_model

    art = read_sketch(model_dir)
    if baseline is not None:
        source = baseline
    elif _has_weights(model_dir):
        source = str(model_dir)
    else:
        source = art.config.get("base_model", {}).get("id")
        if not source:
            raise SketchcalError(
                f"{model_dir} holds no weights and names no base model; "
                "pass the full-state model (--baseline)"
            )
    loaded = load_model(source, device=device, dtype=dtype)
    read_sketch(model_dir, config=loaded.model.config)  # fingerprint check against the loaded model
    if source != str(model_dir):
        check_base_weights(art, loaded.weights_fingerprint, source)
    return loaded, art


def _stats_dir(art: SketchArtifact, stats: str | Path | None) -> Path | None:
    if stats is not None:
        return Path(stats)
    cal = art.config.get("calibration")
    for cand in (
        (cal or {}).get("stats_dir") if isinstance(cal, dict) else None,
        art.config.get("stats_dir"),
    ):
        if cand and Path(cand).is_dir():
            return Path(cand)
    return None


class Refits:
    """The artifact's sketch re-fitted from its statistics at other budgets or bases, in memory.

    Every choice but the budget and the basis (coefficient maps, E shrinkage, byte-model dtypes) is
    the artifact's own; each (basis, rank) is fitted once.
    """

    def __init__(self, stats: Stats, art: SketchArtifact):
        self.stats, self.art = stats, art
        self.choices = SketchChoices.of_section(art.config)
        c = self.choices
        self.traffic = traffic_models(stats.family, stats.layers, stats.window, c.read_dtype, c.buffer_dtype)
        # the artifact's base model, its weights not written: the re-fits live in memory
        self.base_model = {**(art.config.get("base_model") or {}), "weights": "reference"}
        self._done: dict[tuple, SketchArtifact] = {}

    @property
    def has_windows(self) -> bool:
        """Whether every layer's statistics hold held-out windows (what an adaptive allocation needs)."""
        return all(self.stats.has_windows(li.layer) for li in self.stats.layers)

    def __call__(
        self,
        rank: float | None,
        basis: str,
        allocation: str = "output",
        *,
        bytes_per_token: float | None = None,
        sketch_map: str | None = None,
    ) -> SketchArtifact:
        """The sketch fitted at mean rank ``rank`` (or at ``bytes_per_token``) with ``basis``,
        ``allocation`` and ``sketch_map`` (default: the artifact's)."""
        sketch_map = sketch_map or self.choices.sketch_map
        key = (basis, rank, bytes_per_token, allocation, sketch_map)
        if key not in self._done:
            choices = replace(self.choices, basis=basis, allocation=allocation, sketch_map=sketch_map)
            fit = fit_sketch(
                self.stats, self.traffic, choices, rank=rank, bytes_per_token=bytes_per_token, progress=False
            )
            section = sketch_section(self.stats, fit, choices, self.base_model)
            # no file behind it: the metadata holds what the runtime checks, the fingerprint
            self._done[key] = SketchArtifact(
                config=section, metadata={"fingerprint": self.stats.fingerprint}, layers=fit.layers
            )
        return self._done[key]


def _budget(art: SketchArtifact) -> float | None:
    b = art.config.get("budget") or {}
    if "rank" in b:
        return float(b["rank"])
    summary = art.config.get("summary") or {}
    return float(summary["mean_rank"]) if summary.get("mean_rank") is not None else None


def layer_ranks(art: SketchArtifact) -> dict[int, list[int]]:
    return {lay.layer: [int(r) for r in lay.ranks.tolist()] for lay in art.layers}


def traffic(
    spec: ModelSpec,
    ranks: dict[int, list[int]] | None,
    window: int,
    read_dtype: str,
    buffer_dtype: str,
    adaptive: bool = False,
) -> dict[str, float]:
    """Per-token state traffic of all mixer layers (:mod:`sketchcal.fit.traffic`); ranks None = replay;
    ``adaptive``: the ranks are an adaptive sketch's."""
    total = replay = standard = 0.0
    models = traffic_models(spec.family, spec.layers, window, read_dtype, buffer_dtype)
    for shape, tm in zip(spec.layers, models, strict=True):
        heads = ranks[shape.layer] if ranks is not None else [0] * shape.heads
        total += sum(replace(tm, adaptive=adaptive).step_bytes(m) for m in heads)
        replay += shape.heads * tm.step_bytes(0)
        standard += shape.heads * tm.standard_step_bytes()
    return {
        "bytes_per_token": total,
        "replay_bytes_per_token": replay,
        "standard_bytes_per_token": standard,
        "reduction_vs_standard": 1.0 - total / standard,
        "reduction_vs_replay": 1.0 - total / replay,
    }


def _mean_ranks(spec: ModelSpec, ranks: dict[int, list[int]]) -> tuple[float, dict[int, float]]:
    eff, per_layer = [], {}
    for shape in spec.layers:
        r = [shape.key_dim if m == 0 else m for m in ranks[shape.layer]]
        per_layer[shape.layer] = sum(r) / len(r)
        eff.extend(r)
    return sum(eff) / len(eff), per_layer


# ---- running -------------------------------------------------------------------------------------


def teacher_forced(
    model: nn.Module,
    cfg: RunConfig,
    ids: torch.Tensor,
    *,
    prompt: int,
    window: int,
    probe: ReadErrorMeter | None = None,
) -> torch.Tensor:
    """Logits [B, T − prompt, vocab] of positions prompt.. of ``ids`` [B, T], decoded in ``cfg``'s mode."""
    kw: dict[str, Any] = {"prefill": prompt, "window": window, "probe": probe}
    if cfg.mode != "standard":
        kw.update(read_dtype=cfg.read_dtype, shared=cfg.shared)
    if cfg.mode == "sketch":
        kw.update(sketch_map=cfg.sketch_map)
    with torch.no_grad(), enabled(model, cfg.artifact, cfg.mode, **kw):
        out = model(input_ids=ids, use_cache=False, logits_to_keep=ids.shape[1] - prompt)
    return out.logits


def _configs(
    art: SketchArtifact,
    read_dtype: str,
    refits: Refits | None,
    ranks: tuple[float, ...],
    ablations: bool,
    notes: list[str],
) -> list[RunConfig]:
    """The configurations to run; ``refits`` None: no statistics (no basis ablations, no sweep)."""
    basis = art.config.get("basis", "state")
    budget = _budget(art)
    cfgs = [
        RunConfig("standard", "standard", "main"),
        RunConfig("replay", "replay", "main", art, read_dtype),
        RunConfig("sketch", "sketch", "main", art, read_dtype, basis=basis, budget=budget),
    ]
    if ablations:
        if refits is not None and budget is not None:
            if budget in SUPPORTED_RANKS:  # every head at the budget's rank: the same mean rank
                cfgs.append(
                    RunConfig(
                        "sketch · uniform ranks",
                        "sketch",
                        "ablation",
                        refits(budget, basis, "uniform"),
                        read_dtype,
                        basis=basis,
                        budget=budget,
                    )
                )
            for alt in ("pca", "random"):
                if alt != basis:
                    cfgs.append(
                        RunConfig(
                            f"sketch · {alt} basis",
                            "sketch",
                            "ablation",
                            refits(budget, alt),
                            read_dtype,
                            basis=alt,
                            budget=budget,
                        )
                    )
        elif refits is None:
            notes.append(
                "basis ablations skipped: the calibration statistics were not found "
                "(pass stats=DIR / --stats DIR)"
            )
        low = read_dtype if parse_dtype(read_dtype) != torch.float32 else LOW_PRECISION
        if low != read_dtype:
            cfgs.append(
                RunConfig(f"sketch · {low} two precisions", "sketch", "ablation", art, low, False, basis)
            )
        cfgs.append(RunConfig(f"sketch · {low} shared", "sketch", "ablation", art, low, True, basis))
    for r in ranks if refits is not None else ():  # verify refuses a sweep without statistics
        # the artifact's own budget is the main "sketch" row (and its PCA ablation row): not re-run
        alts = [(basis, "output")] + ([("pca", "output")] if ablations and basis != "pca" else [])
        alts += [(basis, "uniform")] if ablations and r in SUPPORTED_RANKS else []
        for alt, how in alts if r != budget else []:
            suffix = " · uniform ranks" if how == "uniform" else "" if alt == basis else f" · {alt} basis"
            cfgs.append(
                RunConfig(
                    f"sketch · rank {r:g}{suffix}",
                    "sketch",
                    "rank sweep",
                    refits(r, alt, how),
                    read_dtype,
                    basis=alt,
                    budget=r,
                )
            )
    return cfgs


def with_sketch_map(
    cfgs: list[RunConfig],
    spec: ModelSpec,
    sketch_map: str | None,
    ablations: bool,
    refits: Refits | None = None,
) -> list[RunConfig]:
    """``cfgs`` with every sketch row run with ``sketch_map`` (None: the artifact's own), and, with
    ``ablations``, each sketch row of the main basis (the artifact's, the sweep's) followed by its
    counterpart of the other map at the same bytes (``NAME · adaptive map`` / ``NAME · static
    map``). A counterpart is the allocation for that map at the row's bytes when the statistics
    are there (``refits``; the adaptive one needs their held-out windows); else a static row's
    adaptive counterpart is its ranks re-ranked (:func:`adaptive_counterpart`) and an adaptive row
    has no static one."""

    def counterpart_of(c: RunConfig, to_map: str) -> SketchArtifact | None:
        spent = (c.artifact.config.get("summary") or {}).get("bytes_per_token")
        fits = refits is not None and spent is not None and (to_map == "static" or refits.has_windows)
        if not fits:
            return adaptive_counterpart(c.artifact, spec) if to_map == "adaptive" else None
        how = str(c.artifact.config.get("allocation", "output"))
        return refits(None, c.basis, how, bytes_per_token=float(spent), sketch_map=to_map)

    basis = next((c.basis for c in cfgs if c.group == "main" and c.mode == "sketch"), None)
    out = []
    for c in cfgs:
        own, given = None, c.artifact
        if c.mode == "sketch" and c.artifact is not None:
            own = c.artifact.sketch_map
            c = replace(c, sketch_map=sketch_map or own)
            if c.sketch_map != own:
                other = counterpart_of(c, c.sketch_map)
                if other is None:  # no statistics: the artifact's own ranks, read the other way
                    own = None
                else:
                    c = replace(c, artifact=other)
        out.append(c)
        if not (ablations and own is not None and c.group in ("main", "rank sweep") and c.basis == basis):
            continue
        to_map = "static" if c.sketch_map == "adaptive" else "adaptive"
        # a row re-run with the other map has its own artifact as the counterpart
        other = given if to_map == own else counterpart_of(c, to_map)
        if other is not None:
            out.append(
                replace(
                    c, name=f"{c.name} · {to_map} map", group="sketch map", artifact=other, sketch_map=to_map
                )
            )
    return out


def verify(model_dir: str | Path, **options: Any) -> VerifyResult:
    """Measure a converted model's sketch against the full-state model and write a report.

    ``model_dir``: the directory ``sketchcal convert`` wrote, or a Hub id. The options are the fields
    of :class:`~sketchcal.settings.VerifySettings` (``tokens``, ``rank`` budgets to sweep, ``prompt``,
    ``samples``, ``stats``, ``out``, ...), the same as ``sketchcal verify``'s. The report folder
    (default ``model_dir/verify``; ``verify-NAME`` for a Hub id, never inside the Hugging Face cache)
    gets ``verify.json``, ``report.md`` and the PNG plots.

    Raises:
        SketchcalError: bad arguments, an unusable directory or data source, a model that does not
            match the sketch, or a rank sweep without statistics.
    """
    return run_verify(VerifySettings(model_dir=model_dir, **options))


verify.__signature__ = api_signature(VerifySettings, "model_dir")  # type: ignore[attr-defined]


def run_verify(settings: VerifySettings) -> VerifyResult:
    """:func:`verify` for a settings object."""
    from sketchcal.data import build_samples
    from sketchcal.hub.resolve import is_hub_id, resolve
    from sketchcal.ui import progress_bar
    from sketchcal.verify.report import write_report

    s = settings
    out_dir = s.out
    if out_dir is None and is_hub_id(s.model_dir):
        out_dir = Path("verify-" + s.model_dir.split("/")[-1])
    model_dir = resolve(s.model_dir, revision=s.revision)
    out_dir = out_dir if out_dir is not None else model_dir / "verify"
    prompt, tokens, batch_size = s.prompt, s.tokens, s.batch_size
    sketch = read_sketch(model_dir)
    stats_dir = _stats_dir(sketch, s.stats)
    stats = load_stats(stats_dir) if stats_dir is not None else None
    if stats is not None:
        check_stats(sketch, stats, f"the sketch in {model_dir}")
    if s.rank and stats_dir is None:
        raise SketchcalError(
            "--rank re-fits the sketch from its calibration statistics, which were not found; "
            "pass the statistics directory (stats=DIR / --stats DIR)"
        )
    check_writable(out_dir, 2**24, f"the verify report in {out_dir}")
    loaded, art = _load(model_dir, s.baseline, s.device, s.dtype)
    spec, model, dev = loaded.spec, loaded.model, loaded.device
    window = int(art.config.get("window", art.metadata.get("window", 16)))
    traffic_cfg = art.config.get("traffic", {})
    read_dtype = dtype_name(parse_dtype(s.read_dtype or traffic_cfg.get("read_dtype", "float32")))
    buffer_dtype = traffic_cfg.get("buffer_dtype", "bfloat16")
    notes: list[str] = []
    sample_set = build_samples(
        loaded.tokenizer,
        s.data,
        num_samples=0,
        seq_len=prompt + tokens + 1,
        heldout_samples=s.samples,
        seed=s.seed,
        text_field=s.text_field,
        revision=s.data_revision,
        evaluation=True,
        option_names={"heldout_samples": "--samples", "seq_len": "--tokens"},
    )
    held = torch.tensor(sample_set.heldout)
    recall: RecallSet | None = None
    if s.retrieval:
        lead = max(0, tokens - RECALL_SPAN)  # held-out text decoded before the pairs
        recall = build_recall(
            loaded.tokenizer,
            [row[:prompt] for row in sample_set.heldout],
            tokens,
            seed=s.seed,
            text=[row[prompt : prompt + lead] for row in sample_set.heldout],
        )

    refits = Refits(stats, art) if stats is not None else None
    cfgs = with_sketch_map(
        _configs(art, read_dtype, refits, s.rank, s.ablations, notes), spec, s.sketch_map, s.ablations, refits
    )
    metrics = {c.name: TokenMetrics(window) for c in cfgs}
    meters = {c.name: ReadErrorMeter(window) for c in cfgs}
    hits: dict[str, list[torch.Tensor]] = {c.name: [] for c in cfgs}
    positions = torch.arange(tokens) % window + 1
    batches = [held[i : i + batch_size] for i in range(0, len(held), batch_size)]
    recall_batches = [] if recall is None else list(range(0, recall.ids.shape[0], batch_size))
    total = (len(batches) + len(recall_batches)) * len(cfgs)
    with progress_bar(enabled=s.progress) as bar:
        task = bar.add_task(f"verifying {model_dir.name}", total=total)
        for batch in batches:
            ids = batch[:, : prompt + tokens].to(dev)
            targets = batch[:, prompt + 1 : prompt + tokens + 1].to(dev)
            ref = None
            for c in cfgs:
                probe = None if c.mode == "standard" else meters[c.name]
                logits = teacher_forced(model, c, ids, prompt=prompt, window=window, probe=probe)
                ref = logits if ref is None else ref
                metrics[c.name].add(ref, logits, targets, positions)
                bar.update(task, advance=1)
        for start in recall_batches:
            ids = recall.ids[start : start + batch_size].to(dev)
            for c in cfgs:
                logits = teacher_forced(model, c, ids, prompt=prompt, window=window)
                q = slice(start, start + batch_size)
                hits[c.name].append(recall_hits(logits, recall.query_pos[q], recall.answers[q], prompt))
                bar.update(task, advance=1)

    results = []
    for c in cfgs:
        summary = metrics[c.name].summary()
        ranks_c = layer_ranks(c.artifact) if c.mode == "sketch" else None
        mean_rank, layer_mean = _mean_ranks(spec, ranks_c) if ranks_c else (None, {})
        acc = None
        if hits[c.name]:
            acc = float(torch.cat(hits[c.name]).double().mean())
        results.append(
            ConfigResult(
                name=c.name,
                mode=c.mode,
                group=c.group,
                read_dtype=c.read_dtype,
                shared=c.shared,
                basis=c.basis,
                budget=c.budget,
                mean_rank=mean_rank,
                layer_mean_rank=layer_mean,
                tokens=int(summary["tokens"]),
                kl_mean=summary["kl_mean"],
                kl_p99=summary["kl_p99"],
                top1_agreement=summary["top1_agreement"],
                perplexity=summary["perplexity"],
                kl_by_position=summary["kl_by_position"],
                kl_by_length=summary["kl_by_length"],
                read_error=meters[c.name].per_layer(),
                retrieval_accuracy=acc,
                traffic=traffic(
                    spec,
                    ranks_c,
                    window,
                    c.read_dtype if c.mode != "standard" else "fp32",
                    buffer_dtype,
                    adaptive=c.sketch_map == "adaptive",
                )
                if c.mode != "standard"
                else {},
                sketch_map=c.sketch_map,
            )
        )
    retrieval = None
    if recall is not None:
        chance = 1 / recall.n_pairs
        full = next((r.retrieval_accuracy for r in results if r.mode == "standard"), None)
        applicable = full is not None and full >= max(RECALL_FLOOR, 5 * chance)
        retrieval = {
            "task": "associative recall",
            "pairs": recall.n_pairs,
            "queries": recall.num_queries,
            "text_tokens": lead,  # held-out text decoded before the pairs
            "full_state_accuracy": full,
            "applicable": applicable,
        }
        if not applicable:
            notes.append(
                f"recall: not applicable; the full-state model answers {full:.1%} of the queries "
                f"(chance {chance:.1%}), so this model does not do the task at this length"
            )
            for r in results:
                r.retrieval_accuracy = None
    result = VerifyResult(
        model_dir=str(model_dir),
        model_id=loaded.model_id,
        base_model=(art.config.get("base_model") or {}).get("id"),
        family=spec.family,
        window=window,
        prompt=prompt,
        tokens=tokens,
        samples=len(held),
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        data=sample_set.info,
        retrieval=retrieval,
        configs=results,
        command=s.command or _command(s),
        notes=notes,
    )
    result.files = write_report(result, out_dir, plots=s.plots)
    return result  # the CLI prints its table (stdout) or JSON


def _command(s: VerifySettings) -> str:
    """The CLI call equivalent to ``s`` (the options that change the numbers)."""
    parts = ["sketchcal", "verify", s.model_dir]
    if s.baseline:
        parts += ["--baseline", s.baseline]
    if s.data:
        parts += ["--data", s.data]
    parts += ["--tokens", str(s.tokens), "--prompt", str(s.prompt), "--samples", str(s.samples)]
    for r in s.rank:
        parts += ["--rank", f"{r:g}"]
    if s.sketch_map:
        parts += ["--sketch-map", s.sketch_map]
    if s.stats:
        parts += ["--stats", str(s.stats)]
    return shlex.join(parts)
