"""Train one of sketchcal's small built-in hybrid models from a declarative recipe.

Usage (from the repository root)::

    python recipes/train.py recipes/models/gdn.yaml [--device cuda] [--max-steps N] [--out DIR]
        [--time-budget SECONDS] [--torch-path] [--set SECTION.KEY=VALUE ...]

The recipe (``recipes/models/{gdn,mamba2,kda}.yaml``) names a stock transformers architecture and
its sizes, the data mix, the optimizer and schedule, the evaluation and the output directory. This
script:

1. builds the model with ``AutoModelForCausalLM.from_config`` (random init under the recipe's seed);
   on the CPU (or with ``--torch-path``) the recurrent mixers are bound to transformers' torch
   references through :func:`sketchcal.models.use_torch_path`;
2. streams batches mixing windows of the built-in corpus (``sketchcal/data/corpus/calib.jsonl``,
   Python standard-library docstrings, PSF licence) with a synthetic associative-recall task
   (:class:`RecallGenerator`): a fixed share of every batch is each kind;
3. trains with AdamW, linear warm-up and a cosine decay, gradient clipping, bf16 autocast on CUDA
   and fp32 on the CPU;
4. evaluates held-out loss on ``heldout.jsonl`` and recall accuracy with the exact task of
   ``sketchcal verify`` (:func:`sketchcal.verify.retrieval.build_recall`: top-1 accuracy of the
   queried values, with its chance levels), also every ``train.eval_every`` steps on a subset;
5. writes the output directory atomically (built under a temporary name, then renamed; an existing
   directory is never overwritten): bf16 ``model.safetensors`` + ``config.json`` via
   ``save_pretrained``, the tokenizer files, ``metrics.json`` and a model card ``README.md``.

Everything random (initialisation, text windows, recall sequences, evaluation sets) comes from the
recipe's seed, so a run is determined by its recipe and ``--max-steps``: bitwise on the CPU, up to
the GPU kernels' own non-determinism on CUDA. ``--time-budget`` picks the number of steps from the
measured step time (during warm-up, so the schedule stays consistent) and records it in
``metrics.json``; ``--max-steps`` with that number reproduces the run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import platform
import shlex
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import yaml
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("gdn", "mamba2", "kda")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SIZE_LIMIT_BYTES = 15 * 2**20  # bf16 safetensors budget per model (the "at most ~15 MiB")


def _bootstrap_sketchcal() -> None:
    """Make ``sketchcal`` importable from a plain checkout (e.g. on a GPU machine without an install):
    an installed (or editable) sketchcal is used as is, else the repository root goes on ``sys.path``."""
    if importlib.util.find_spec("sketchcal") is None and str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


_bootstrap_sketchcal()

from sketchcal.errors import SketchcalError  # noqa: E402
from sketchcal.fsutil import atomic_dir, finite_json  # noqa: E402

# --------------------------------------------------------------------------------------------------
# Recipe
# --------------------------------------------------------------------------------------------------


@dataclass
class ModelRecipe:
    """A stock transformers architecture and its sizes.

    ``config`` holds the keyword arguments of the config class of ``model_type``; the vocabulary
    size and the pad/bos/eos ids always come from the tokenizer.
    """

    family: str
    model_type: str
    architecture: str
    config: dict[str, Any]


@dataclass
class DataRecipe:
    """Where text and tokenizer come from, and the share of each kind of training sequence."""

    tokenizer: str = "sketchcal/assets/tokenizer"
    corpus: str = "sketchcal/data/corpus/calib.jsonl"
    heldout: str = "sketchcal/data/corpus/heldout.jsonl"
    text_field: str = "text"
    corpus_fraction: float = 0.5
    recall_fraction: float = 0.5
    # share of the text windows taken from the running interpreter's standard-library source files
    # (code, comments, docstrings; the held-out packages left out), the rest from ``corpus``; 0 = off
    stdlib_sources: float = 0.0


@dataclass
class RecallRecipe:
    """Shape of the synthetic associative-recall sequences used for training.

    A sequence is ``prefix`` tokens of corpus text, then ``pairs`` key-value pairs ``k1 v1 k2 v2 …``,
    then queries ``k v`` (keys of earlier pairs, each answered by its value) up to the sequence
    length. Candidate tokens: ``words`` = whole-word tokens (`` word``, at least ``min_chars``
    letters; the vocabulary of ``sketchcal verify``'s recall test), ``all`` = every non-special
    token. Keys come from ``key_range`` and values from ``value_range``, each a ``[start, stop)``
    slice of the candidate list (``null`` = its end); within one sequence all keys and values are
    distinct. ``pairs`` and ``prefix`` are inclusive ``[min, max]`` ranges drawn per sequence.
    ``curriculum_steps``: over the first that many batches the upper end of ``pairs`` rises linearly
    from its lower end (few pairs first: the copy circuit forms on easy sequences); 0 = off.
    """

    tokens: str = "words"
    min_chars: int = 3
    key_range: tuple[int, int | None] = (0, None)
    value_range: tuple[int, int | None] = (0, None)
    pairs: tuple[int, int] = (16, 128)
    prefix: tuple[int, int] = (0, 64)
    curriculum_steps: int = 0


@dataclass
class OptimizerRecipe:
    """AdamW with linear warm-up and cosine decay to ``min_lr_ratio * lr``."""

    name: str = "adamw"
    lr: float = 2e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 100
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0


@dataclass
class TrainRecipe:
    """Steps, batch shape, seed and precision. ``dtype`` is the CUDA autocast dtype (CPU: fp32)."""

    steps: int = 2000
    batch_size: int = 32
    seq_len: int = 512
    seed: int = 0
    dtype: str = "bfloat16"
    log_every: int = 50
    eval_every: int = 250


@dataclass
class RecallEval:
    """One recall evaluation: ``sketchcal verify``'s task with ``prompt`` text tokens, ``tokens``
    decoded tokens of pairs and queries (16 queries, ``(tokens - 32) / 2`` pairs), ``samples`` rows."""

    prompt: int = 32
    tokens: int = 128
    samples: int = 256


@dataclass
class EvalRecipe:
    """Final and periodic evaluation. ``heldout_windows``: held-out windows of ``seq_len + 1``
    tokens for the final loss (``null`` = all); the periodic evaluations use the first
    ``periodic_windows`` of them and the first ``periodic_recall_samples`` rows of the first recall
    evaluation."""

    batch_size: int = 32
    heldout_windows: int | None = None
    periodic_windows: int = 32
    periodic_recall_samples: int = 64
    recall: list[RecallEval] = field(default_factory=lambda: [RecallEval()])


@dataclass
class OutputRecipe:
    """Output directory (relative paths: from the repository root) and the dtype of the weights."""

    dir: str = "runs/model"
    dtype: str = "bfloat16"


@dataclass
class Recipe:
    """A whole training recipe (one YAML file)."""

    name: str
    model: ModelRecipe
    description: str = ""
    data: DataRecipe = field(default_factory=DataRecipe)
    recall: RecallRecipe = field(default_factory=RecallRecipe)
    optimizer: OptimizerRecipe = field(default_factory=OptimizerRecipe)
    train: TrainRecipe = field(default_factory=TrainRecipe)
    eval: EvalRecipe = field(default_factory=EvalRecipe)
    output: OutputRecipe = field(default_factory=OutputRecipe)
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe as plain JSON-able data (tuples as lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


_SECTIONS: dict[str, type] = {
    "data": DataRecipe,
    "recall": RecallRecipe,
    "optimizer": OptimizerRecipe,
    "train": TrainRecipe,
    "eval": EvalRecipe,
    "output": OutputRecipe,
}
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _number(value: Any, key: str) -> float:
    """A float recipe value. YAML 1.1 reads ``2e-3`` (no dot) as text, so numeric text is accepted."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise SketchcalError(f"recipe key {key!r} must be a number, got {value!r}") from None


def _section(cls: type, raw: Any, where: str) -> Any:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys (typos fail loudly)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SketchcalError(f"recipe section {where!r} must be a mapping, got {type(raw).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise SketchcalError(f"unknown key(s) in recipe section {where!r}: {', '.join(unknown)}")
    values = dict(raw)
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else None
        value = values.get(f.name)
        if isinstance(default, tuple) and isinstance(value, list):
            values[f.name] = tuple(value)
        if isinstance(default, float) and not isinstance(value, bool) and value is not None:
            values[f.name] = _number(value, f"{where}.{f.name}")
    if cls is EvalRecipe and "recall" in values:
        items = values["recall"] or []
        if not isinstance(items, list):
            raise SketchcalError("recipe key 'eval.recall' must be a list of {prompt, tokens, samples}")
        values["recall"] = [_section(RecallEval, item, f"eval.recall[{i}]") for i, item in enumerate(items)]
    try:
        return cls(**values)
    except TypeError as err:
        raise SketchcalError(f"recipe section {where!r}: {err}") from err


def _set_dotted(tree: dict[str, Any], assignment: str) -> None:
    """Apply one ``--set section.key=value`` override (the value is parsed as YAML)."""
    if "=" not in assignment:
        raise SketchcalError(f"--set expects SECTION.KEY=VALUE, got {assignment!r}")
    key, value = assignment.split("=", 1)
    parts = key.strip().split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SketchcalError(f"--set {key}: {part!r} is not a section")
    node[parts[-1]] = yaml.safe_load(value)


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read and validate a recipe YAML, applying ``--set`` overrides first."""
    path = Path(path)
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise SketchcalError(f"cannot read recipe {path}: {err.strerror}") from err
    except yaml.YAMLError as err:
        raise SketchcalError(f"recipe {path} is not valid YAML: {err}") from err
    if not isinstance(tree, dict):
        raise SketchcalError(f"recipe {path} must be a mapping")
    for assignment in overrides or []:
        _set_dotted(tree, assignment)
    known = {"name", "description", "model", *_SECTIONS}
    unknown = sorted(set(tree) - known)
    if unknown:
        raise SketchcalError(f"unknown top-level key(s) in recipe {path}: {', '.join(unknown)}")
    for key in ("name", "model"):
        if key not in tree:
            raise SketchcalError(f"recipe {path} has no {key!r}")
    recipe = Recipe(
        name=str(tree["name"]),
        description=str(tree.get("description", "")),
        model=_section(ModelRecipe, tree["model"], "model"),
        source=str(path),
        **{name: _section(cls, tree.get(name), name) for name, cls in _SECTIONS.items()},
    )
    validate_recipe(recipe)
    return recipe


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise SketchcalError(message)


def validate_recipe(r: Recipe) -> None:
    """Everything that can be checked before a model is built or a step is run."""
    _check(r.model.family in FAMILIES, f"model.family must be one of {', '.join(FAMILIES)}")
    _check(isinstance(r.model.config, dict), "model.config must be a mapping of config arguments")
    for key in ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id"):
        _check(key not in r.model.config, f"model.config.{key} comes from the tokenizer; remove it")
    d = r.data
    _check(0.0 <= d.recall_fraction <= 1.0, "data.recall_fraction must be in [0, 1]")
    _check(0.0 <= d.stdlib_sources <= 1.0, "data.stdlib_sources must be in [0, 1]")
    _check(
        abs(d.corpus_fraction + d.recall_fraction - 1.0) < 1e-9,
        "data.corpus_fraction + data.recall_fraction must be 1, "
        f"got {d.corpus_fraction} + {d.recall_fraction}",
    )
    t = r.train
    for name in ("steps", "batch_size", "seq_len", "log_every", "eval_every"):
        _check(isinstance(getattr(t, name), int) and getattr(t, name) >= 1, f"train.{name} must be >= 1")
    _check(t.dtype in _DTYPES, f"train.dtype must be one of {', '.join(_DTYPES)}")
    _check(r.output.dtype in _DTYPES, f"output.dtype must be one of {', '.join(_DTYPES)}")
    o = r.optimizer
    _check(o.name == "adamw", "optimizer.name: only 'adamw' is implemented")
    _check(o.schedule == "cosine", "optimizer.schedule: only 'cosine' is implemented")
    _check(o.lr > 0 and 0 <= o.min_lr_ratio <= 1, "optimizer.lr must be > 0 and min_lr_ratio in [0, 1]")
    _check(o.warmup_steps >= 0 and o.grad_clip >= 0, "optimizer.warmup_steps and grad_clip must be >= 0")
    _check(len(o.betas) == 2, "optimizer.betas must be two numbers")
    rc = r.recall
    _check(rc.tokens in ("words", "all"), "recall.tokens must be 'words' or 'all'")
    for name in ("pairs", "prefix", "key_range", "value_range"):
        _check(len(getattr(rc, name)) == 2, f"recall.{name} must be two numbers")
    _check(1 <= rc.pairs[0] <= rc.pairs[1], "recall.pairs must be [min, max] with 1 <= min <= max")
    _check(0 <= rc.prefix[0] <= rc.prefix[1], "recall.prefix must be [min, max] with 0 <= min <= max")
    _check(rc.curriculum_steps >= 0, "recall.curriculum_steps must be >= 0")
    if d.recall_fraction > 0:
        room = t.seq_len + 1 - rc.prefix[1] - 2 * rc.pairs[1]
        _check(
            room >= 2,
            f"train.seq_len {t.seq_len} leaves no room for a query after {rc.prefix[1]} prefix tokens and "
            f"{rc.pairs[1]} pairs; lower recall.pairs / recall.prefix or raise train.seq_len",
        )
    e = r.eval
    _check(e.batch_size >= 1 and e.periodic_windows >= 0, "eval.batch_size >= 1, eval.periodic_windows >= 0")
    _check(e.heldout_windows is None or e.heldout_windows >= 1, "eval.heldout_windows must be >= 1 or null")
    for i, item in enumerate(e.recall):
        _check(item.prompt >= 0 and item.tokens >= 8 and item.samples >= 1, f"eval.recall[{i}]: bad shape")


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


def build_config(recipe: Recipe, tokenizer: Any) -> Any:
    """The transformers config of the recipe, with vocabulary and special ids from ``tokenizer``."""
    import transformers as tf

    eos = tokenizer.eos_token_id
    kwargs = dict(recipe.model.config)
    kwargs.update(vocab_size=len(tokenizer), pad_token_id=eos, bos_token_id=eos, eos_token_id=eos)
    try:
        config = tf.AutoConfig.for_model(recipe.model.model_type, **kwargs)
    except (ValueError, TypeError) as err:
        raise SketchcalError(f"cannot build a {recipe.model.model_type} config: {err}") from err
    return config


def build_model(recipe: Recipe, config: Any, *, meta: bool = False) -> nn.Module:
    """Random-init model of ``config`` (fp32), seeded by the recipe; ``meta``: no memory (sizes only).

    The architecture class and the sketchcal family are checked against the recipe.
    """
    import transformers as tf

    from sketchcal.models import describe

    if meta:
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(config)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe.train.seed)
            model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if type(model).__name__ != recipe.model.architecture:
        raise SketchcalError(
            f"recipe says model.architecture {recipe.model.architecture}, "
            f"transformers built {type(model).__name__}"
        )
    spec = describe(model)
    if spec.family != recipe.model.family:
        raise SketchcalError(f"recipe says family {recipe.model.family}, sketchcal detects {spec.family}")
    return model


def parameter_bytes(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of the (deduplicated, i.e. tied-once) parameters when stored in ``dtype``."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # parameters() already yields a tied tensor once
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
    return total * torch.empty((), dtype=dtype).element_size()


def layer_shapes(model: nn.Module) -> list[dict[str, int]]:
    """sketchcal's view of the recurrent layers: heads, groups, K (key/state dim), V (value dim)."""
    from sketchcal.models import describe

    return [s.as_dict() for s in describe(model).layers]


def kernel_path(family: str, device: str, torch_path: bool) -> str:
    """Which implementation the recurrent mixers run (for the record)."""
    if device == "cpu" or torch_path:
        return "torch reference (sketchcal.models.use_torch_path)"
    package = "mamba_ssm" if family == "mamba2" else "fla"
    if importlib.util.find_spec(package) is not None:
        return f"{package} kernels"
    return f"torch reference ({package} not installed)"


# --------------------------------------------------------------------------------------------------
# Data: corpus windows and synthetic associative recall
# --------------------------------------------------------------------------------------------------


def read_texts(path: Path, text_field: str) -> list[str]:
    """The non-empty documents of a JSON Lines file."""
    texts = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[text_field]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise SketchcalError(f"{path}:{n}: no string field {text_field!r}") from err
            if isinstance(text, str) and text.strip():
                texts.append(text)
    if not texts:
        raise SketchcalError(f"{path} holds no documents")
    return texts


def token_stream(tokenizer: Any, texts: list[str]) -> Tensor:
    """The documents tokenised (no special tokens) and joined by eos, as one long int64 tensor."""
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    eos = tokenizer.eos_token_id
    out: list[int] = []
    for row in ids:
        out.extend(row)
        out.append(eos)
    return torch.tensor(out, dtype=torch.long)


def corpus_builder() -> ModuleType:
    """``recipes/build_corpus.py`` as a module (recipes/ is not a package)."""
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        import build_corpus
    finally:
        sys.path.remove(str(ROOT / "recipes"))
    return build_corpus


def stdlib_source_documents(heldout: Path) -> list[Any]:
    """The running interpreter's standard-library source files (``recipes/build_corpus.py``'s file
    rules), minus the held-out file's top-level packages so that no held-out text is trained on."""
    import sysconfig

    builder = corpus_builder()
    return builder.source_documents(Path(sysconfig.get_paths()["stdlib"]), builder.heldout_groups(heldout))


def stdlib_source_stream(tokenizer: Any, heldout: Path) -> Tensor:
    """:func:`stdlib_source_documents`, tokenised and joined by eos."""
    docs = stdlib_source_documents(heldout)
    if not docs:
        raise SketchcalError("data.stdlib_sources: no standard-library source files found; set it to 0")
    return token_stream(tokenizer, [d.text for d in docs])


def candidate_tokens(tokenizer: Any, kind: str, min_chars: int) -> list[int]:
    """Recall vocabulary: whole-word tokens (as ``sketchcal verify``) or every non-special id."""
    from sketchcal.verify.retrieval import word_tokens

    if kind == "words":
        return word_tokens(tokenizer, min_chars=min_chars)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return [i for i in range(len(tokenizer)) if i not in special]


@dataclass
class RecallSequence:
    """One synthetic recall sequence of ``len(ids)`` tokens.

    ``answer_pos``: positions ``t`` whose next token ``ids[t + 1]`` is a queried value (``ids[t]`` is
    its key); ``answers``: those values; ``keys``/``values``: the pairs in order.
    """

    ids: Tensor
    answer_pos: Tensor
    answers: Tensor
    keys: Tensor
    values: Tensor


class RecallGenerator:
    """Associative-recall sequences: text prefix, key-value pairs, then queries ``k v`` to the end.

    Deterministic given the ``torch.Generator`` passed to :meth:`sample`.
    """

    def __init__(self, spec: RecallRecipe, candidates: list[int], filler: int):
        self.spec = spec
        pool = torch.tensor(candidates, dtype=torch.long)
        self.keys = pool[spec.key_range[0] : spec.key_range[1]]
        self.values = pool[spec.value_range[0] : spec.value_range[1]]
        self.filler = filler
        n = spec.pairs[1]
        overlap = int(torch.isin(self.keys, self.values).sum())
        if len(self.keys) < n or len(self.values) - min(n, overlap) < n:
            raise SketchcalError(
                f"recall: {len(self.keys)} key and {len(self.values)} value tokens (overlap {overlap}) are "
                f"too few for {n} distinct pairs; widen recall.key_range / value_range or lower recall.pairs"
            )

    def sample(
        self, length: int, gen: torch.Generator, prefix: Tensor | None = None, max_pairs: int | None = None
    ) -> RecallSequence:
        """One sequence of exactly ``length`` tokens; ``prefix`` (text) goes first when given;
        ``max_pairs`` lowers the upper end of ``recall.pairs`` (the curriculum)."""
        lo, hi = self.spec.pairs
        if max_pairs is not None:
            hi = max(lo, min(hi, max_pairs))
        prefix = torch.empty(0, dtype=torch.long) if prefix is None else prefix
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        n = min(n, (length - len(prefix) - 2) // 2)
        if n < 1:
            raise SketchcalError(f"recall: a sequence of {length} tokens has no room for pairs and a query")
        keys = self.keys[torch.randperm(len(self.keys), generator=gen)[:n]]
        allowed = self.values[~torch.isin(self.values, keys)]
        values = allowed[torch.randperm(len(allowed), generator=gen)[:n]]
        pairs = torch.stack([keys, values], dim=1).flatten()
        start = len(prefix) + 2 * n
        n_queries = (length - start) // 2
        rounds = -(-n_queries // n)
        which = torch.cat([torch.randperm(n, generator=gen) for _ in range(rounds)])[:n_queries]
        queries = torch.stack([keys[which], values[which]], dim=1).flatten()
        tail = torch.full((length - start - 2 * n_queries,), self.filler, dtype=torch.long)
        ids = torch.cat([prefix, pairs, queries, tail])
        answer_pos = start + 2 * torch.arange(n_queries)
        return RecallSequence(ids, answer_pos, values[which], keys, values)


@dataclass
class Batch:
    """Inputs [B, T], targets [B, T] and per-token loss weights [B, T] (each row's weights sum to 1)."""

    inputs: Tensor
    targets: Tensor
    weights: Tensor
    n_text: int


class BatchStream:
    """Training batches: ``n_text`` random corpus windows, then ``n_recall`` recall sequences.

    Text rows are trained on every token, recall rows only on the queried values; the loss is the mean
    over rows of each row's mean token loss, so ``data.recall_fraction`` is the recall task's weight.
    """

    def __init__(
        self,
        recipe: Recipe,
        stream: Tensor,
        recall: RecallGenerator | None,
        seed: int,
        sources: Tensor | None = None,
    ):
        t = recipe.train
        self.seq_len = t.seq_len
        self.n_recall = round(t.batch_size * recipe.data.recall_fraction) if recall is not None else 0
        self.n_text = t.batch_size - self.n_recall
        self.stream = stream
        self.sources = sources if sources is not None and recipe.data.stdlib_sources > 0 else None
        self.sources_share = recipe.data.stdlib_sources
        self.recall = recall
        self.prefix = recipe.recall.prefix
        self.gen = torch.Generator().manual_seed(seed)
        self.batches = 0
        if len(stream) < t.seq_len + 2:
            raise SketchcalError(f"the corpus has {len(stream)} tokens, fewer than train.seq_len + 2")

    def _window(self, length: int, stream: Tensor | None = None) -> Tensor:
        stream = self.stream if stream is None else stream
        start = int(torch.randint(0, len(stream) - length + 1, (1,), generator=self.gen))
        return stream[start : start + length]

    def _text_window(self, length: int) -> Tensor:
        """A training text window: from the source files with probability ``stdlib_sources``."""
        if self.sources is not None and float(torch.rand((), generator=self.gen)) < self.sources_share:
            return self._window(length, self.sources)
        return self._window(length)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        length = self.seq_len + 1
        rows, weights = [], []
        max_pairs = None
        ramp = self.recall.spec.curriculum_steps if self.recall is not None else 0
        if ramp and self.batches < ramp:
            lo, hi = self.recall.spec.pairs
            max_pairs = lo + (hi - lo) * self.batches // ramp
        self.batches += 1
        for _ in range(self.n_text):
            rows.append(self._text_window(length))
            weights.append(torch.full((self.seq_len,), 1.0 / self.seq_len))
        for _ in range(self.n_recall):
            assert self.recall is not None
            p = int(torch.randint(self.prefix[0], self.prefix[1] + 1, (1,), generator=self.gen))
            seq = self.recall.sample(length, self.gen, self._window(p) if p else None, max_pairs)
            w = torch.zeros(self.seq_len)
            w[seq.answer_pos] = 1.0 / len(seq.answer_pos)
            rows.append(seq.ids)
            weights.append(w)
        ids = torch.stack(rows)
        return Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), torch.stack(weights), self.n_text)


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------


@dataclass
class EvalSets:
    """Held-out windows [N, seq_len + 1] and one recall set per ``eval.recall`` entry."""

    heldout: Tensor
    recall: list[Any]
    recall_specs: list[RecallEval]
    vocab_sizes: list[int]


def build_eval_sets(recipe: Recipe, tokenizer: Any, heldout_stream: Tensor) -> EvalSets:
    """Held-out windows (consecutive, non-overlapping) and ``sketchcal verify``'s recall sets, whose
    text prefixes are consecutive chunks of the held-out stream."""
    from sketchcal.verify.retrieval import build_recall, word_tokens

    length = recipe.train.seq_len + 1
    n = len(heldout_stream) // length
    if n < 1:
        raise SketchcalError(f"the held-out text has {len(heldout_stream)} tokens, fewer than seq_len + 1")
    if recipe.eval.heldout_windows is not None:
        n = min(n, recipe.eval.heldout_windows)
    windows = heldout_stream[: n * length].view(n, length)
    sets, vocab_sizes = [], []
    words = len(word_tokens(tokenizer))
    for i, item in enumerate(recipe.eval.recall):
        need = item.prompt * item.samples
        if need > len(heldout_stream):
            raise SketchcalError(
                f"eval.recall[{i}]: {item.samples} prompts of {item.prompt} tokens need more held-out text"
            )
        prefixes = (
            [heldout_stream[j * item.prompt : (j + 1) * item.prompt].tolist() for j in range(item.samples)]
            if item.prompt
            else [[] for _ in range(item.samples)]
        )
        rs = build_recall(tokenizer, prefixes, item.tokens, seed=recipe.train.seed + 1 + i)
        sets.append(rs)
        vocab_sizes.append(words if words >= 4 * rs.n_pairs else len(word_tokens(tokenizer, min_chars=1)))
    return EvalSets(windows, sets, list(recipe.eval.recall), vocab_sizes)


def _autocast(device: str, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    if device.startswith("cuda") and dtype != torch.float32:
        return torch.autocast("cuda", dtype=dtype)
    return contextlib.nullcontext()


@torch.no_grad()
def heldout_loss(
    model: nn.Module, windows: Tensor, batch_size: int, device: str, dtype: torch.dtype
) -> float:
    """Mean next-token cross-entropy (nats) over every position of ``windows``."""
    total, count = 0.0, 0
    for start in range(0, windows.shape[0], batch_size):
        rows = windows[start : start + batch_size].to(device)
        with _autocast(device, dtype):
            logits = model(input_ids=rows[:, :-1], use_cache=False).logits
        loss = nn.functional.cross_entropy(
            logits.float().flatten(0, 1), rows[:, 1:].flatten(), reduction="sum"
        )
        total += float(loss)
        count += rows[:, 1:].numel()
    return total / max(count, 1)


@torch.no_grad()
def recall_accuracy(
    model: nn.Module, rs: Any, batch_size: int, device: str, dtype: torch.dtype, limit: int | None = None
) -> float:
    """Top-1 accuracy on the queried values of a :class:`sketchcal.verify.retrieval.RecallSet`."""
    from sketchcal.verify.retrieval import recall_hits

    n = rs.ids.shape[0] if limit is None else min(limit, rs.ids.shape[0])
    hits, count = 0, 0
    for start in range(0, n, batch_size):
        stop = min(start + batch_size, n)
        ids = rs.ids[start:stop].to(device)
        with _autocast(device, dtype):
            logits = model(input_ids=ids, use_cache=False).logits
        h = recall_hits(logits.float(), rs.query_pos[start:stop], rs.answers[start:stop], 0)
        hits += int(h.sum())
        count += h.numel()
    return hits / max(count, 1)


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


def learning_rate(step: int, total: int, o: OptimizerRecipe) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine from ``lr`` to ``min_lr_ratio * lr`` at ``total``."""
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    span = max(total - o.warmup_steps, 1)
    progress = min((step - o.warmup_steps) / span, 1.0)
    floor = o.lr * o.min_lr_ratio
    return floor + (o.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


_NO_DECAY = {"A_log", "dt_bias", "D", "bias"}


def make_optimizer(model: nn.Module, o: OptimizerRecipe, device: str) -> torch.optim.Optimizer:
    """AdamW; no weight decay on embeddings, norms, biases and the SSM/decay parameters."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if p.ndim < 2 or leaf in _NO_DECAY or "norm" in name or "embed" in name:
            plain.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    fused = device.startswith("cuda")
    return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=fused)


def batch_loss(logits: Tensor, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, text loss, recall loss): weighted token cross-entropy, mean over rows, in fp32."""
    ce = nn.functional.cross_entropy(
        logits.float().flatten(0, 1), batch.targets.flatten(), reduction="none"
    ).view_as(batch.weights)
    per_row = (ce * batch.weights).sum(1)
    nan = torch.tensor(float("nan"), device=per_row.device)
    text = per_row[: batch.n_text].mean() if batch.n_text else nan
    recall = per_row[batch.n_text :].mean() if batch.n_text < per_row.numel() else nan
    return per_row.mean(), text, recall


def _steps_within(
    done: int, steps: int, per_step: float, eval_cost: float, eval_every: int, remaining: float
) -> int:
    """The largest total step count <= ``steps`` whose remaining steps and periodic evaluations
    (every ``eval_every`` steps, strictly before the end) fit into ``remaining`` seconds."""

    def evals_before(k: int) -> int:
        return (k - 1) // eval_every

    fit = done
    while fit < steps:
        cost = (fit + 1 - done) * per_step + (evals_before(fit + 1) - evals_before(done)) * eval_cost
        if cost > remaining:
            break
        fit += 1
    return fit


def _to_device(batch: Batch, device: str) -> Batch:
    """Move a batch; on CUDA through pinned memory so that the copy does not wait for the GPU."""
    if not device.startswith("cuda"):
        return batch
    inputs, targets, weights = (
        x.pin_memory().to(device, non_blocking=True) for x in (batch.inputs, batch.targets, batch.weights)
    )
    return Batch(inputs, targets, weights, batch.n_text)


@dataclass
class RunResult:
    """What the training loop produced, for ``metrics.json``."""

    steps: int
    planned_steps: int
    stopped_by_budget: bool
    train_seconds: float
    tokens: int
    history: list[dict[str, Any]]
    evals: list[dict[str, Any]]


def _log(message: str) -> None:
    """A log line: above the live progress bar in a terminal, a plain unwrapped line otherwise."""
    from sketchcal.ui import console

    if console.is_terminal:
        console.print(message, highlight=False)
    else:
        print(message, file=sys.stderr, flush=True)


def train_loop(
    recipe: Recipe,
    model: nn.Module,
    batches: BatchStream,
    evals: EvalSets,
    *,
    device: str,
    steps: int,
    time_budget: float | None,
    progress: bool = True,
) -> RunResult:
    """Run the optimisation; evaluate at step 0, every ``train.eval_every`` steps and at the end (subset)."""
    o, t, e = recipe.optimizer, recipe.train, recipe.eval
    cuda = device.startswith("cuda")
    dtype = _DTYPES[t.dtype] if cuda else torch.float32
    optimizer = make_optimizer(model, o, device)
    history: list[dict[str, Any]] = []
    eval_log: list[dict[str, Any]] = []
    windows = evals.heldout[: e.periodic_windows] if e.periodic_windows else evals.heldout[:0]

    def periodic(step: int, record: bool = True) -> float:
        t0 = time.perf_counter()
        model.eval()
        row: dict[str, Any] = {"step": step}
        if len(windows):
            row["heldout_loss"] = round(heldout_loss(model, windows, e.batch_size, device, dtype), 4)
        if evals.recall and e.periodic_recall_samples:
            limit = e.periodic_recall_samples
            acc = recall_accuracy(model, evals.recall[0], e.batch_size, device, dtype, limit)
            row["recall_accuracy"] = round(acc, 4)
        model.train()
        if cuda:
            torch.cuda.synchronize()
        if record:
            eval_log.append(row)
            fields = "  ".join(f"{k} {v}" for k, v in row.items() if k != "step")
            _log(f"eval  step {step:>6}  {fields}")
        return time.perf_counter() - t0

    total = steps
    # With a time budget the step count is fixed once the step time is known: at step 30 (or the end
    # of warm-up, if sooner), or as soon as a tenth of the budget is spent, from step 4 on.
    decide_at = min(max(4, min(30, o.warmup_steps)), steps) if time_budget else None
    eval_cost = periodic(0)
    if time_budget:  # the first evaluation compiles kernels: time a second one for the budget
        eval_cost = periodic(0, record=False)
    model.train()
    tokens_per_step = t.batch_size * t.seq_len
    start = time.perf_counter()
    probe_start = start
    stopped_by_budget = False
    step = 0
    from sketchcal.ui import progress_bar

    fields = ("loss {task.fields[loss]}", "lr {task.fields[lr]}", "{task.fields[tps]} tok/s")
    with progress_bar(progress, fields) as bar:
        task = bar.add_task(recipe.name, total=total, loss="-", lr="-", tps="-")
        while step < total:
            lr = learning_rate(step, total, o)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = _to_device(next(batches), device)
            inputs = batch.inputs
            with _autocast(device, dtype):
                logits = model(input_ids=inputs, use_cache=False).logits
            loss, text_loss, recall_loss = batch_loss(logits, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip) if o.grad_clip else None
            optimizer.step()
            step += 1
            if step == 3:  # steps 1-2 carry compilation and autotuning
                if cuda:
                    torch.cuda.synchronize()
                probe_start = time.perf_counter()
            if (
                decide_at is not None
                and time_budget is not None
                and (step == decide_at or (step >= 4 and time.perf_counter() - start >= 0.1 * time_budget))
            ):
                decide_at = None
                if cuda:
                    torch.cuda.synchronize()
                now = time.perf_counter()
                per_step = (now - probe_start) / max(step - 3, 1) if step > 3 else (now - start) / step
                remaining = time_budget - (now - start)
                fit = _steps_within(step, steps, per_step, eval_cost, t.eval_every, remaining)
                if fit < steps:
                    stopped_by_budget = True
                    total = max(fit, step)
                    bar.update(task, total=total)
                    _log(
                        f"time budget {time_budget:.0f} s: {per_step * 1000:.1f} ms/step, "
                        f"eval {eval_cost:.1f} s -> {total} steps instead of {steps}"
                    )
                    if total <= o.warmup_steps:
                        _log(f"warning: {total} steps end inside the {o.warmup_steps} warm-up steps")
            if step % t.log_every == 0 or step == total or step == 1:
                loss_v = float(loss.detach())
                elapsed = time.perf_counter() - start
                row = {
                    "step": step,
                    "loss": round(loss_v, 4),
                    "text_loss": round(float(text_loss.detach()), 4),
                    "recall_loss": round(float(recall_loss.detach()), 4),
                    "lr": lr,
                    "grad_norm": None if grad_norm is None else round(float(grad_norm), 4),
                    "elapsed_s": round(elapsed, 2),
                }
                history.append(row)
                tps = step * tokens_per_step / max(elapsed, 1e-9)
                bar.update(task, loss=f"{loss_v:.3f}", lr=f"{lr:.2e}", tps=f"{tps:,.0f}")
                _log(
                    f"step {step:>6}/{total}  loss {loss_v:.4f}  text {row['text_loss']}  "
                    f"recall {row['recall_loss']}  lr {lr:.2e}  {tps:,.0f} tok/s  {elapsed:.0f} s"
                )
            if step % t.eval_every == 0 and step < total:
                periodic(step)
            bar.update(task, completed=step)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return RunResult(step, steps, stopped_by_budget, seconds, step * tokens_per_step, history, eval_log)


# --------------------------------------------------------------------------------------------------
# Output: weights, tokenizer, metrics.json, model card
# --------------------------------------------------------------------------------------------------


def resolve(path: str | Path) -> Path:
    """Recipe paths are relative to the repository root."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else ROOT / p


def _versions() -> dict[str, str]:
    import tokenizers
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def model_card(metrics: dict[str, Any]) -> str:
    """A Hugging Face model card (YAML front matter + markdown) from ``metrics``."""
    m = metrics
    shapes = m["layers"]
    first = shapes[0]
    families = {"gdn": "GDN (gated delta rule)", "mamba2": "Mamba-2", "kda": "KDA (Kimi delta attention)"}
    fam = families[m["family"]]
    recall_rows = "\n".join(
        f"| prompt {r['prompt']} + {r['pairs']} pairs + {r['queries']} queries | {r['samples']} | "
        f"**{r['accuracy']:.3f}** | {r['chance_in_context']:.3f} | {r['chance_vocab']:.4f} |"
        for r in m["recall"]
    )
    budget = " (chosen by `--time-budget`)" if m["stopped_by_budget"] else ""
    recurrent = (
        f"{len(shapes)} × {first['heads']} heads in {first['groups']} groups, "
        f"K = {first['key_dim']}, V = {first['value_dim']}"
    )
    o, task, data = m["optimizer"], m["recall_task"], m["data"]
    share = data.get("stdlib_sources", 0.0)
    curriculum = task.get("curriculum_steps", 0)
    ramp = ""
    if curriculum:
        ramp = f" (the upper end ramped up from {task['pairs'][0]} over the first {curriculum} steps)"
    text_mix = f"the Python standard-library docstrings shipped with sketchcal, `{data['corpus']}`"
    if share:
        text_mix = (
            f"{share:.0%} from the Python {data['python']} standard-library source files minus the held-out "
            f"packages ({data['stdlib_source_tokens']:,} tokens), the rest from {text_mix}"
        )
    return f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags:
- sketchcal
- hybrid
- {m["family"]}
- {m["model_type"]}
- tiny
---

# {m["name"]}

{m["description"].strip()}

A tiny **{m["architecture"]}** (`{m["model_type"]}`, a stock transformers architecture) trained from
scratch by sketchcal's `recipes/train.py` as the built-in demo model of the {fam} family. It exists to
exercise calibration, conversion and verification offline; it is not a useful language model.

| | |
|---|---|
| parameters | {m["parameters"]:,} ({m["size_bytes"] / 2**20:.2f} MiB bf16 safetensors) |
| layers | {m["num_hidden_layers"]}, hidden size {m["hidden_size"]} |
| recurrent layers | {recurrent} |
| vocabulary | {m["vocab_size"]} (byte-level BPE, the tokenizer of `sketchcal/assets/tokenizer`) |

## Training

- Data, per batch: {data["corpus_fraction"]:.0%} random text windows ({text_mix}, PSF licence),
  {data["recall_fraction"]:.0%} synthetic associative recall:
  {task["prefix"][0]}-{task["prefix"][1]} tokens of text,
  {task["pairs"][0]}-{task["pairs"][1]} key-value pairs of whole-word tokens{ramp}, then queries `key value`
  to the end of the sequence (loss on the queried values only).
- {m["steps"]} steps{budget} of {m["batch_size"]} × {m["seq_len"]} tokens ({m["tokens"]:,} tokens);
  AdamW lr {o["lr"]}, betas {o["betas"]}, weight decay {o["weight_decay"]}, {o["warmup_steps"]} warm-up
  steps, cosine to {o["min_lr_ratio"]} × lr, gradient clip {o["grad_clip"]}; seed {m["seed"]}.
- {m["device_name"]}, {m["autocast_dtype"]} compute, {m["train_seconds"]:.0f} s
  ({m["tokens_per_second"]:,.0f} tokens/s); mixers: {m["kernels"]}.

## Evaluation

Held-out loss on `{data["heldout"]}` (standard-library packages not in the training split),
{m["heldout"]["tokens"]:,} tokens: **{m["heldout"]["loss"]:.4f}** nats/token (perplexity
{m["heldout"]["perplexity"]:.2f}; a uniform guess scores {m["heldout"]["uniform_loss"]:.4f}).

Associative recall, the task of `sketchcal verify`: top-1 accuracy of the value after each queried
key. Chance is one of the pairs' values (in context) or one of the whole-word tokens (vocabulary).

| task | samples | accuracy | chance (in context) | chance (vocabulary) |
|---|---|---|---|---|
{recall_rows}

## Reproduce

```
{m["reproduce"]}
```
"""


def write_output(
    out: Path, model: nn.Module, tokenizer_dir: Path, metrics: dict[str, Any], dtype: torch.dtype
) -> dict[str, Any]:
    """Write weights, tokenizer, metrics.json and README.md into a temporary directory beside
    ``out`` and rename it into place; returns ``metrics`` completed with the file size."""
    with atomic_dir(out) as tmp:
        model.to(dtype)
        model.config.use_cache = True
        model.save_pretrained(tmp)
        weights = tmp / "model.safetensors"
        if not weights.is_file():
            raise SketchcalError("save_pretrained wrote no single model.safetensors file")
        for name in TOKENIZER_FILES:
            src = tokenizer_dir / name
            if src.is_file():
                shutil.copy2(src, tmp / name)
        metrics["size_bytes"] = weights.stat().st_size
        metrics["files"] = [*sorted(p.name for p in tmp.iterdir()), "metrics.json", "README.md"]
        metrics = finite_json(metrics)
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
        (tmp / "README.md").write_text(model_card(metrics), encoding="utf-8")
        umask = os.umask(0)
        os.umask(umask)
        for path in tmp.iterdir():  # mkdtemp / mkstemp create 0700 / 0600: give normal permissions
            path.chmod(0o666 & ~umask)
        tmp.chmod(0o777 & ~umask)
    return metrics


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def _command(argv: list[str], steps: int | None = None) -> str:
    """The training command line; with ``steps``: without ``--time-budget`` and with ``--max-steps``."""
    args = [str(a) for a in argv]
    if steps is not None:
        kept: list[str] = []
        skip = False
        for a in args:
            if skip:
                skip = False
            elif a in ("--time-budget", "--max-steps"):
                skip = True
            elif not a.startswith(("--time-budget=", "--max-steps=")):
                kept.append(a)
        args = [*kept[:1], "--max-steps", str(steps), *kept[1:]]
    return "python recipes/train.py " + " ".join(shlex.quote(a) for a in args)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SketchcalError(f"--device {device} asked for, but no CUDA device is available; use cpu")
    return device


def run(
    recipe: Recipe,
    *,
    out: Path,
    device: str = "auto",
    max_steps: int | None = None,
    time_budget: float | None = None,
    torch_path: bool = False,
    progress: bool = True,
    argv: list[str] | None = None,
) -> dict[str, Any]:
    """Train ``recipe`` and write its output directory ``out``; returns the metrics.

    ``argv``: the command-line arguments, recorded with a command that reproduces the run.
    """
    import transformers as tf

    from sketchcal.models import describe, use_torch_path

    device = resolve_device(device)
    if out.exists():
        raise SketchcalError(f"output directory {out} already exists; choose another --out or remove it")
    steps = recipe.train.steps if max_steps is None else max_steps
    if steps < 1:
        raise SketchcalError("--max-steps must be at least 1")
    if time_budget is not None and time_budget <= 0:
        raise SketchcalError("--time-budget must be positive")
    out.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(out.parent, os.W_OK):
        raise SketchcalError(f"cannot write into {out.parent}; choose a writable --out")
    tokenizer_dir = resolve(recipe.data.tokenizer)
    tokenizer = tf.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = build_config(recipe, tokenizer)
    model = build_model(recipe, config)
    size = parameter_bytes(model, _DTYPES[recipe.output.dtype])
    if size > SIZE_LIMIT_BYTES:
        raise SketchcalError(f"the model needs {size / 2**20:.2f} MiB in {recipe.output.dtype}, over 15 MiB")
    if device == "cpu" or torch_path:
        use_torch_path(describe(model))
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # TF32 for what autocast leaves in fp32
    model.to(device)

    corpus = token_stream(tokenizer, read_texts(resolve(recipe.data.corpus), recipe.data.text_field))
    held = token_stream(tokenizer, read_texts(resolve(recipe.data.heldout), recipe.data.text_field))
    generator = None
    if recipe.data.recall_fraction > 0:
        cands = candidate_tokens(tokenizer, recipe.recall.tokens, recipe.recall.min_chars)
        generator = RecallGenerator(recipe.recall, cands, tokenizer.eos_token_id)
    sources = None
    if recipe.data.stdlib_sources:
        sources = stdlib_source_stream(tokenizer, resolve(recipe.data.heldout))
    batches = BatchStream(recipe, corpus, generator, recipe.train.seed, sources)
    evals = build_eval_sets(recipe, tokenizer, held)
    n_params = sum(p.numel() for p in model.parameters())
    source_note = "" if sources is None else f", stdlib sources {len(sources):,}"
    kernels = kernel_path(recipe.model.family, device, torch_path)
    _log(
        f"{recipe.name}: {type(model).__name__}, {n_params:,} parameters ({size / 2**20:.2f} MiB "
        f"{recipe.output.dtype}), device {device}, mixers: {kernels}; corpus {len(corpus):,} tokens, "
        f"held-out {len(held):,}{source_note}; "
        f"{steps} steps of {recipe.train.batch_size} × {recipe.train.seq_len}"
    )

    result = train_loop(
        recipe, model, batches, evals, device=device, steps=steps, time_budget=time_budget, progress=progress
    )

    t0 = time.perf_counter()
    model.eval()
    dtype = _DTYPES[recipe.train.dtype] if device.startswith("cuda") else torch.float32
    loss = heldout_loss(model, evals.heldout, recipe.eval.batch_size, device, dtype)
    recall = []
    for item, rs, vocab in zip(evals.recall_specs, evals.recall, evals.vocab_sizes, strict=True):
        acc = recall_accuracy(model, rs, recipe.eval.batch_size, device, dtype)
        recall.append(
            {
                "prompt": item.prompt,
                "tokens": item.tokens,
                "pairs": rs.n_pairs,
                "queries": int(rs.answers.shape[1]),
                "samples": int(rs.ids.shape[0]),
                "accuracy": round(acc, 4),
                "chance_in_context": round(1.0 / rs.n_pairs, 4),
                "chance_vocab": round(1.0 / vocab, 5),
            }
        )
    eval_seconds = time.perf_counter() - t0
    final_rows = [h for h in result.history if h["step"] == result.steps]
    args = argv or [str(recipe.source)]
    cuda = device.startswith("cuda")
    device_name = torch.cuda.get_device_name(device) if cuda else f"CPU ({platform.machine()})"
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    metrics: dict[str, Any] = {
        "name": recipe.name,
        "description": recipe.description,
        "family": recipe.model.family,
        "model_type": recipe.model.model_type,
        "architecture": type(model).__name__,
        "parameters": n_params,
        "bf16_parameter_bytes": parameter_bytes(model, torch.bfloat16),
        "num_hidden_layers": int(text_cfg.num_hidden_layers),
        "hidden_size": int(text_cfg.hidden_size),
        "vocab_size": int(text_cfg.vocab_size),
        "layers": layer_shapes(model),
        "heldout": {
            "loss": round(loss, 4),
            "perplexity": round(math.exp(min(loss, 50.0)), 3),
            "tokens": int(evals.heldout[:, 1:].numel()),
            "uniform_loss": round(math.log(len(tokenizer)), 4),
        },
        "recall": recall,
        "final_train_loss": final_rows[0]["loss"] if final_rows else None,
        "steps": result.steps,
        "planned_steps": result.planned_steps,
        "stopped_by_budget": result.stopped_by_budget,
        "time_budget_s": time_budget,
        "batch_size": recipe.train.batch_size,
        "seq_len": recipe.train.seq_len,
        "tokens": result.tokens,
        "train_seconds": round(result.train_seconds, 2),
        "eval_seconds": round(eval_seconds, 2),
        "tokens_per_second": round(result.tokens / max(result.train_seconds, 1e-9), 1),
        "seed": recipe.train.seed,
        "device": device,
        "device_name": device_name,
        "kernels": kernels,
        "autocast_dtype": recipe.train.dtype if device.startswith("cuda") else "float32",
        "weights_dtype": recipe.output.dtype,
        "data": {
            "corpus": recipe.data.corpus,
            "heldout": recipe.data.heldout,
            "corpus_fraction": recipe.data.corpus_fraction,
            "recall_fraction": recipe.data.recall_fraction,
            "corpus_tokens": len(corpus),
            "stdlib_sources": recipe.data.stdlib_sources,
            "stdlib_source_tokens": 0 if sources is None else len(sources),
            "python": platform.python_version(),
            "heldout_tokens": len(held),
        },
        "recall_task": dataclasses.asdict(recipe.recall),
        "optimizer": dataclasses.asdict(recipe.optimizer),
        "history": result.history,
        "evals": result.evals,
        "versions": _versions(),
        "command": _command(args),
        "reproduce": _command(args, steps=result.steps if result.stopped_by_budget else None),
        "recipe": recipe.to_dict(),
    }
    metrics = write_output(out, model, tokenizer_dir, metrics, _DTYPES[recipe.output.dtype])
    _log(
        f"wrote {out}: held-out loss {metrics['heldout']['loss']:.4f}, recall "
        + ", ".join(
            f"{r['accuracy']:.3f} ({r['pairs']} pairs, chance {r['chance_in_context']:.3f})" for r in recall
        )
        + f", {metrics['size_bytes'] / 2**20:.2f} MiB, {result.train_seconds:.0f} s training"
    )
    return metrics


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", type=Path, help="recipes/models/{gdn,mamba2,kda}.yaml")
    parser.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N")
    parser.add_argument("--max-steps", type=int, default=None, help="override train.steps")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: the recipe's)")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="cap the training loop's wall time: the step count is fixed from the measured step time",
    )
    parser.add_argument(
        "--torch-path", action="store_true", help="torch reference mixers on CUDA too (no fla / mamba_ssm)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a recipe value (YAML syntax), e.g. --set train.batch_size=4; repeatable",
    )
    parser.add_argument("--no-progress", action="store_true", help="no live progress bar (log lines only)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        out = args.out if args.out is not None else resolve(recipe.output.dir)
        return run(
            recipe,
            out=out,
            device=args.device,
            max_steps=args.max_steps,
            time_budget=args.time_budget,
            torch_path=args.torch_path,
            progress=not args.no_progress,
            argv=list(sys.argv[1:] if argv is None else argv),
        )
    except SketchcalError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()


__all__ = [
    "BatchStream",
    "RecallGenerator",
    "Recipe",
    "build_config",
    "build_model",
    "load_recipe",
    "main",
    "parameter_bytes",
    "run",
]
