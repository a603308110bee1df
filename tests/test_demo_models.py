"""The trained demo models that ship in ``sketchcal/assets/models/tiny-<family>``.

Each loads with ``AutoModelForCausalLM``, predicts held-out text far better than the random-weight
stand-in of its architecture (``builtin:random-tiny-<family>``), generates text, solves ``sketchcal verify``'s
recall task far above chance with the full state, and matches the numbers its ``metrics.json``
records; the README's verify table of the default model is reproduced by its listed command.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess

import pytest
import torch
from helpers import ROOT, recipes_train

ASSETS = ROOT / "sketchcal" / "assets" / "models"
MODEL_TYPES = {"gdn": "qwen3_5_text", "mamba2": "nemotron_h", "kda": "kimi_linear"}
DEMO = ROOT / "docs" / "demo-models"


@pytest.fixture(scope="module")
def heldout_windows():
    """The first 4 held-out windows of 257 tokens and the recall set of ``sketchcal verify``
    (48 pairs, 16 queries) on 16 held-out prompts, as the training recipe builds them."""
    import transformers as tf

    train = recipes_train()
    tokenizer = tf.AutoTokenizer.from_pretrained(ROOT / "sketchcal" / "assets" / "tokenizer")
    recipe = train.load_recipe(
        ROOT / "recipes" / "models" / "gdn.yaml",
        [
            "train.seq_len=256",
            "recall.pairs=[1, 64]",
            "eval.heldout_windows=4",
            "eval.recall=[{prompt: 32, tokens: 128, samples: 16}]",
        ],
    )
    held = train.token_stream(tokenizer, train.read_texts(train.resolve(recipe.data.heldout), "text"))
    return train.build_eval_sets(recipe, tokenizer, held)


def _load(name: str):
    """A built-in model on the CPU (``load_model`` binds the torch reference mixers there)."""
    from sketchcal.models.loading import load_model

    return load_model(f"builtin:{name}", device="cpu", dtype="float32")


@pytest.mark.parametrize("family", list(MODEL_TYPES))
def test_shipped_model_loads_generates_and_beats_the_random_stand_in(family, heldout_windows):
    import transformers as tf

    folder = ASSETS / f"tiny-{family}"
    assert (folder / "model.safetensors").stat().st_size <= 15 * 2**20
    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert model.config.model_type == MODEL_TYPES[family]
    train = recipes_train()
    trained = _load(f"tiny-{family}")
    random = _load(f"random-tiny-{family}")
    loss = train.heldout_loss(trained.model, heldout_windows.heldout, 4, "cpu", torch.float32)
    loss_random = train.heldout_loss(random.model, heldout_windows.heldout, 4, "cpu", torch.float32)
    # uniform guessing scores ln 2048 = 7.62 nats; the trained models score ~3.6 on all held-out text
    assert loss < 4.5 < 7.0 < loss_random, (loss, loss_random)
    tokenizer = trained.tokenizer
    prompt = tokenizer('def read_lines(path):\n    """Return the', return_tensors="pt").input_ids
    out = trained.model.generate(prompt, max_new_tokens=24, do_sample=False)[0, prompt.shape[1] :]
    text = tokenizer.decode(out)
    assert len(out) == 24 and len(set(out.tolist())) >= 6  # no single repeated token
    assert text.strip() and all(ch.isprintable() or ch in "\n\t" for ch in text)


@pytest.mark.parametrize("family", list(MODEL_TYPES))
def test_full_state_model_solves_recall_far_above_chance(family, heldout_windows):
    train = recipes_train()
    rs = heldout_windows.recall[0]
    assert rs.n_pairs == 48
    accuracy = train.recall_accuracy(_load(f"tiny-{family}").model, rs, 8, "cpu", torch.float32)
    assert accuracy >= 0.9 > 20 / rs.n_pairs, accuracy  # chance: 1 / 48 = 2.1 %


@pytest.mark.parametrize("family", list(MODEL_TYPES))
def test_metrics_json_matches_the_shipped_weights(family):
    """The model card's numbers belong to these weights (parameter count and file size) and say
    what the README says: recall solved, held-out loss falling through training."""
    folder = ASSETS / f"tiny-{family}"
    metrics = json.loads((folder / "metrics.json").read_text())
    loaded = _load(f"tiny-{family}")
    assert metrics["parameters"] == sum(p.numel() for p in loaded.model.parameters())
    assert metrics["size_bytes"] == (folder / "model.safetensors").stat().st_size
    assert metrics["family"] == family and metrics["recipe"]["name"] == f"tiny-{family}"
    assert metrics["recall"][0]["pairs"] == 48 and metrics["recall"][0]["accuracy"] > 0.99
    assert math.isclose(metrics["heldout"]["perplexity"], math.exp(metrics["heldout"]["loss"]), rel_tol=1e-3)
    # the held-out curve ends below where it started and near the final full-set value
    evals = metrics["evals"]
    assert evals[0]["heldout_loss"] > 7.0 > 4.0 > evals[-1]["heldout_loss"]


def _demo_tables():
    spec = importlib.util.spec_from_file_location("demo_tables", DEMO / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ROWS = ("standard", "replay", "sketch", "sketch · pca basis", "sketch · uniform ranks")
SWEEP = [f"sketch · rank {r}{suffix}" for r in (4, 16) for suffix in ("", " · pca basis", " · uniform ranks")]


@pytest.mark.parametrize("family", list(MODEL_TYPES))
def test_readme_tables_are_the_committed_verify_reports(family):
    """README's demo-model tables are what ``tables.py`` renders from the committed verify.json of
    ``docs/demo-models/run.sh``, and each report holds the rows those tables are built from, measured
    under the script's protocol (512-token sequences in float32)."""
    report = json.loads((DEMO / family / "verify.json").read_text())
    rendered = _demo_tables().table(report)
    assert rendered in (ROOT / "README.md").read_text(), rendered
    names = {c["name"] for c in report["configs"]}
    assert set(ROWS) | set(SWEEP) <= names, sorted(set(ROWS) | set(SWEEP) - names)
    assert report["tokens"] >= 512 and report["dtype"] == "float32", (report["tokens"], report.get("dtype"))


def test_readme_verify_table_of_the_default_model_reproduces(tmp_path):
    """``docs/demo-models/run.sh gdn`` (the README's command, about 5 minutes on 2 CPU cores) gives
    the committed verify.json: the same rows with the same numbers."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", DEMO_OUT=str(tmp_path))
    subprocess.run(["bash", str(DEMO / "run.sh"), "gdn"], check=True, env=env, capture_output=True)
    got = {c["name"]: c for c in json.loads((tmp_path / "gdn" / "verify.json").read_text())["configs"]}
    want = {c["name"]: c for c in json.loads((DEMO / "gdn" / "verify.json").read_text())["configs"]}
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        for key in ("kl_mean", "kl_p99", "top1_agreement", "perplexity", "retrieval_accuracy"):
            if w[key] is None:
                assert g[key] is None
            else:
                assert math.isclose(g[key], w[key], rel_tol=1e-3, abs_tol=1e-9), (name, key, g[key], w[key])
        assert g["traffic"] == w["traffic"] and g["mean_rank"] == w["mean_rank"]
