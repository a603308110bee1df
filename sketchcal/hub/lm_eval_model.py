"""lm-evaluation-harness model ``sketchcal``: lm-eval's HFLM with the sketchcal runtime enabled.

Use it as ``--model sketchcal --model_args pretrained=DIR_OR_HUB_ID,mode=sketch``. Model arguments
beyond HFLM's own:

- ``pretrained``: a directory written by ``sketchcal convert``, or its Hub id (``revision=`` picks
  the branch, tag or commit). Its weights are used when it has them.
- ``base``: where the weights come from when the directory is reference-only (default: the base
  model the sketch names: a Hub id, a directory, or ``builtin:NAME``).
- ``mode``: ``sketch`` (default), ``replay`` or ``standard`` (the model's own decode step).
- ``prefill``: which tokens the model's own (exact) prefill runs; the rest are decode steps in
  ``mode``. ``context`` (default): each request's context, as in serving, so the continuation tokens
  are decoded (the first continuation token is predicted by the prefill, as when generating);
  an integer N: the first N tokens of every sequence (0: every token is a decode step).
- ``window``, ``read_dtype``, ``shared``, ``backend`` (``auto``, ``triton`` or ``reference``): passed
  to :func:`sketchcal.runtime.enable`.

``generate_until`` requests run ``generate()`` with the whole prompt prefilled and every generated
token a decode step. Registration: importing this module registers ``sketchcal`` in lm-eval's model
registry; the package also declares the ``lm_eval.models`` entry point (lm-eval versions with plugin
discovery find it without an import), and ``sketchcal lm-eval ...`` / ``python -m
sketchcal.hub.lm_eval_model ...`` run lm-eval's command line with it registered.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from sketchcal.errors import SketchcalError

try:
    import lm_eval.models  # noqa: F401  (fills lm-eval's registry first: its lazy fill skips a non-empty one)
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "the sketchcal lm-eval model needs lm-evaluation-harness: pip install 'sketchcal[eval]'"
    ) from err

MODEL_NAME = "sketchcal"
PREFILL_POLICIES = ("context",)


def _key(tokens: Any) -> bytes:
    """A compact key of a token sequence (the harness may hold tens of thousands of requests)."""
    data = torch.as_tensor(tokens, dtype=torch.int64).cpu().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


def _parse_prefill(prefill: Any) -> int | str:
    if isinstance(prefill, str) and prefill in PREFILL_POLICIES:
        return prefill
    try:
        n = int(prefill)
    except (TypeError, ValueError):
        raise SketchcalError(f"prefill must be 'context' or a token count ≥ 0, got {prefill!r}") from None
    if n < 0 or str(n) != str(prefill).strip():
        raise SketchcalError(f"prefill must be 'context' or a token count ≥ 0, got {prefill!r}")
    return n


def _has_weights(d: Path) -> bool:
    return any(d.glob("*.safetensors")) or (d / "model.safetensors.index.json").is_file()


class SketchcalLM(HFLM):
    """HFLM over a converted model, decoding in ``standard``, ``replay`` or ``sketch`` mode."""

    def __init__(
        self,
        pretrained: str,
        mode: str = "sketch",
        base: str | None = None,
        prefill: int | str = "context",
        window: int | None = None,
        read_dtype: str | None = None,
        shared: bool = False,
        backend: str = "auto",
        revision: str | None = None,
        **kwargs: Any,
    ) -> None:
        from sketchcal.artifact.sketch import read_sketch
        from sketchcal.hub.resolve import resolve
        from sketchcal.models.capture import use_torch_path
        from sketchcal.models.spec import describe
        from sketchcal.runtime import MODES, enable

        if not isinstance(pretrained, (str, Path)):
            raise SketchcalError("pretrained must be a converted model directory or its Hub id")
        if mode not in MODES:
            raise SketchcalError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self._prefill_policy = _parse_prefill(prefill)
        self._artifact_dir = resolve(str(pretrained), revision=revision)
        art = read_sketch(self._artifact_dir)
        weights, tokenizer = self._weights_source(art, base, kwargs.get("tokenizer"), kwargs.get("device"))
        if tokenizer is not None:
            kwargs["tokenizer"] = tokenizer
        super().__init__(pretrained=weights, **kwargs)
        spec = describe(self.model)
        if self.model.device.type == "cpu":
            use_torch_path(spec)  # optional GPU kernels that transformers bound at import fail on the CPU
        self._runtime = enable(
            self.model,
            art,
            mode,
            window=window,
            read_dtype=read_dtype,
            shared=bool(shared),
            prefill=None,
            backend=backend,
        )
        self._mode = mode
        self._contexts: dict[tuple[int, bytes], int] = {}
        self._lengths: list[int] = []

    # ---- loading ---------------------------------------------------------------------------

    def _weights_source(self, art, base: str | None, tokenizer: Any, device: str | None) -> tuple[Any, Any]:
        """(what HFLM loads: a directory path or a loaded model, the tokenizer to give it or None)."""
        from sketchcal.hub.resolve import resolve

        if base is None and _has_weights(self._artifact_dir):
            return str(self._artifact_dir), tokenizer
        recorded = art.config.get("base_model") or {}
        source, revision = (base, None) if base else (recorded.get("id"), recorded.get("revision"))
        if not source:
            raise SketchcalError(
                f"{self._artifact_dir} has no weights and names no base model: pass base=HUB_ID_OR_DIR"
            )
        if str(source).startswith("builtin:"):
            from sketchcal.models.loading import load_model

            loaded = load_model(str(source), device=device or "auto")
            return loaded.model, tokenizer if tokenizer is not None else loaded.tokenizer
        local = Path(str(source)).expanduser()
        return str(local if local.is_dir() else resolve(str(source), revision=revision)), tokenizer

    # ---- prefill policy --------------------------------------------------------------------

    @contextlib.contextmanager
    def _prefill(self, n: int | None) -> Iterator[None]:
        """Run the model with the runtime's prefill set to ``n`` (None: the whole call)."""
        old = self._runtime.prefill
        self._runtime.prefill = n
        try:
            yield
        finally:
            self._runtime.prefill = old

    def _row_prefill(self, row: torch.Tensor) -> int | None:
        """The context length of one right-padded input row (None: not a known request)."""
        nz = torch.nonzero(row).flatten()
        last = int(nz[-1]) + 1 if nz.numel() else 0
        for n in self._lengths:  # longest first; the padding after the true length is all zeros
            if n < last:
                break
            if n <= row.shape[0]:
                hit = self._contexts.get((n, _key(row[:n])))
                if hit is not None:
                    return hit
        return None

    def _loglikelihood_tokens(self, requests, *args: Any, **kwargs: Any):
        """Record each request's context length (by its input tokens) before HFLM batches them."""
        if self._prefill_policy != "context" or self.backend != "causal":
            return super()._loglikelihood_tokens(requests, *args, **kwargs)
        contexts: dict[tuple[int, bytes], int] = {}
        for _, ctx, cont in requests:
            inp = (list(ctx) + list(cont))[-(self.max_length + 1) :][:-1]  # as HFLM builds it
            key = (len(inp), _key(inp))
            n = max(0, len(inp) - len(cont) + 1)
            contexts[key] = min(n, contexts.get(key, n))
        self._contexts = contexts
        self._lengths = sorted({n for n, _ in contexts}, reverse=True)
        try:
            return super()._loglikelihood_tokens(requests, *args, **kwargs)
        finally:
            self._contexts, self._lengths = {}, []

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """Logits with the prefill policy applied; rows of different context lengths run separately."""
        if attn_mask is not None or labels is not None:
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
        if isinstance(self._prefill_policy, int):
            with self._prefill(self._prefill_policy):
                return super()._model_call(inps)
        groups: dict[int | None, list[int]] = {}
        for i, row in enumerate(inps):
            groups.setdefault(self._row_prefill(row), []).append(i)
        if len(groups) == 1:
            with self._prefill(next(iter(groups))):
                return super()._model_call(inps)
        out: torch.Tensor | None = None
        for n, rows in groups.items():
            idx = torch.tensor(rows, device=inps.device)
            with self._prefill(n):
                logits = super()._model_call(inps[idx])
            if out is None:
                out = logits.new_empty((inps.shape[0], *logits.shape[1:]))
            out[idx] = logits
        assert out is not None
        return out

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        """``generate()``: the prompt is prefilled, every generated token is a decode step."""
        with self._prefill(None):
            return super()._model_generate(context, max_length, stop, **generation_kwargs)

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info.update(
            {
                "sketchcal_mode": self._mode,
                "sketchcal_prefill": self._prefill_policy,
                "sketchcal_window": self._runtime.window,
                "sketchcal_backend": self._runtime.backend,
                "sketchcal_artifact": str(self._artifact_dir),
            }
        )
        return info


def register() -> None:
    """Put :class:`SketchcalLM` in lm-eval's model registry as ``sketchcal`` (idempotent)."""
    import lm_eval.api.registry as registry

    names = getattr(registry, "model_registry", None) or getattr(registry, "MODEL_REGISTRY", {})
    if MODEL_NAME in names:  # this class, or lm-eval's entry-point placeholder that loads it
        return
    with contextlib.suppress(ValueError, AssertionError):  # a concurrent registration
        register_model(MODEL_NAME)(SketchcalLM)


register()


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with ``sketchcal`` registered; adds ``--model sketchcal`` if none is given."""
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--model" or a.startswith("--model=") for a in args) and not any(
        a in ("-h", "--help") for a in args
    ):
        args += ["--model", MODEL_NAME]
    sys.argv = ["lm-eval", *args]
    cli_evaluate()


if __name__ == "__main__":
    main()
