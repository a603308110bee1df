"""The lm-evaluation-harness model ``sketchcal`` on a tiny local task, offline.

calibrate builtin:tiny-gdn (8 samples of 64 tokens) → convert → lm_eval.simple_evaluate of a YAML
multiple-choice task over a local jsonl file, in standard and sketch mode, against lm-eval's own
``hf`` model on the same weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="needs lm-evaluation-harness: pip install -e '.[eval]'")
pytest.importorskip("accelerate", reason="lm-eval's HF model needs accelerate: pip install -e '.[eval]'")

from sketchcal.errors import SketchcalError

TASK = "sketchcal_tiny_mc"
DOCS = [
    {
        "question": "The quick brown fox jumps over the",
        "choices": [" lazy dog and runs away into the forest.", " moon at night.", " table of contents."],
        "answer": 0,
    },
    {
        "question": "Return the number of items in a container. The built-in function that does this",
        "choices": [" is called len and returns an integer.", " raises an error.", " prints a string"],
        "answer": 0,
    },
    {
        "question": "def add(a, b):\n    return",
        "choices": [" a + b", " the quick brown fox jumps over the lazy dog", " None if nothing is given"],
        "answer": 0,
    },
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    import sketchcal
    from sketchcal.artifact import convert

    root = tmp_path_factory.mktemp("lm_eval")
    sketchcal.calibrate("builtin:tiny-gdn", out=root / "stats", samples=8, seq_len=64, progress=False)
    convert(root / "stats", rank=8, out=root / "model")
    convert(root / "stats", rank=8, out=root / "reference", reference_only=True)
    return root


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """A folder with the tiny task: a YAML multiple-choice task over a local jsonl dataset."""
    d = tmp_path_factory.mktemp("tasks")
    (d / "data.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (d / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {d / 'data.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return d


@pytest.fixture(scope="module")
def tasks(task_dir):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_dir), include_defaults=False)  # skip indexing lm-eval's own


def evaluate(model: str, model_args: str, tasks) -> tuple[dict, list[list[float]]]:
    """(results of the task, per doc the log-likelihood of each choice)."""
    import lm_eval

    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args + ",device=cpu,batch_size=16",
        tasks=[TASK],
        task_manager=tasks,
        log_samples=True,
    )
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return out, [[float(r[0]) for r in s["filtered_resps"]] for s in samples]


def test_standard_and_sketch_mode(converted, tasks, monkeypatch):
    import sketchcal.hub.lm_eval_model as mod

    model = converted / "model"
    calls: list[int | None] = []
    contexts: set[int] = set()
    model_call = mod.HFLM._model_call
    ll_tokens = mod.SketchcalLM._loglikelihood_tokens

    def record_call(self, inps, *args, **kwargs):
        if isinstance(self, mod.SketchcalLM):
            calls.append(self._runtime.prefill)
        return model_call(self, inps, *args, **kwargs)

    def record_requests(self, requests, *args, **kwargs):
        contexts.update(len(ctx) for _, ctx, _ in requests)
        return ll_tokens(self, requests, *args, **kwargs)

    monkeypatch.setattr(mod.HFLM, "_model_call", record_call)
    monkeypatch.setattr(mod.SketchcalLM, "_loglikelihood_tokens", record_requests)

    _, hf = evaluate("hf", f"pretrained={model}", tasks)
    std_out, std = evaluate("sketchcal", f"pretrained={model},mode=standard", tasks)
    # prefill=context: each context ran through the model's own prefill, one forward per length
    assert sorted(calls) == sorted(contexts) and len(contexts) == len(DOCS)
    calls.clear()
    sk_out, sk = evaluate("sketchcal", f"pretrained={model},mode=sketch", tasks)
    assert sorted(calls) == sorted(contexts)

    flat = [
        (a, b, c) for rh, rs, rk in zip(hf, std, sk, strict=True) for a, b, c in zip(rh, rs, rk, strict=True)
    ]
    assert all(math.isfinite(x) for row in flat for x in row)
    assert all(b == pytest.approx(a, rel=1e-4, abs=1e-3) for a, b, _ in flat)  # standard decoding = HF
    assert any(abs(c - b) > 1e-5 for _, b, c in flat)  # sketch reads are approximate ...
    assert all(abs(c - b) < 0.05 * abs(b) + 0.5 for _, b, c in flat)  # ... but close on this model
    for out, mode in ((std_out, "standard"), (sk_out, "sketch")):
        acc = out["results"][TASK]["acc,none"]
        assert 0.0 <= acc <= 1.0
        assert out["config"]["sketchcal_mode"] == mode
        assert out["config"]["sketchcal_prefill"] == "context"

    calls.clear()
    _, every = evaluate("sketchcal", f"pretrained={model},mode=sketch,prefill=0", tasks)
    assert set(calls) == {0}  # every token a decode step
    assert any(
        abs(e - s) > 1e-6 for re, rs in zip(every, sk, strict=True) for e, s in zip(re, rs, strict=True)
    )

    # replay is exact; a directory without weights takes them from the base the sketch names (builtin)
    _, replay = evaluate("sketchcal", f"pretrained={converted / 'reference'},mode=replay", tasks)
    for rr, rs in zip(replay, std, strict=True):
        assert rr == pytest.approx(rs, rel=1e-4, abs=1e-3)


def test_bad_arguments(converted):
    from sketchcal.hub.lm_eval_model import SketchcalLM

    with pytest.raises(SketchcalError, match="mode must be one of"):
        SketchcalLM(pretrained=str(converted / "model"), mode="fast")
    with pytest.raises(SketchcalError, match="prefill must be 'context' or a token count"):
        SketchcalLM(pretrained=str(converted / "model"), prefill="prompt")
    with pytest.raises(SketchcalError, match="not in the local Hugging Face cache"):
        SketchcalLM(pretrained="acme/not-cached-anywhere")
    with pytest.raises(SketchcalError, match="not a model directory written by sketchcal convert"):
        SketchcalLM(pretrained=str(converted / "stats"))


def test_registered_and_command_line(monkeypatch):
    """``sketchcal lm-eval ARGS`` runs lm-eval's command line with --model sketchcal added."""
    import lm_eval.__main__
    from lm_eval._cli import HarnessCLI
    from lm_eval.api.registry import get_model
    from typer.testing import CliRunner

    from sketchcal.cli import app
    from sketchcal.hub.lm_eval_model import SketchcalLM

    assert get_model("sketchcal") is SketchcalLM
    seen = []

    def fake_cli() -> None:  # parse sys.argv as lm-eval would, without indexing its thousands of tasks
        seen.append(HarnessCLI().parse_args())

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", fake_cli)
    args = ["run", "--model_args", "pretrained=m,mode=sketch", "--tasks", "hellaswag", "--device", "cpu"]
    result = CliRunner().invoke(app, ["lm-eval", *args])
    assert result.exit_code == 0, result.output
    (ns,) = seen
    assert ns.model == "sketchcal" and ns.tasks == ["hellaswag"]
    assert ns.model_args == {"pretrained": "m", "mode": "sketch"}
