"""The model-training recipes: sizes and head shapes, the recall task, and a tiny end-to-end run."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from helpers import recipes_train

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes" / "models"
FAMILIES = ["gdn", "mamba2", "kda"]
# (K, V) of every recurrent layer: GDN/KDA K = V = 128; Mamba-2 K = d_state 128, V = head_dim 64
HEAD_SIZES = {"gdn": (128, 128), "mamba2": (128, 64), "kda": (128, 128)}
MIB = 2**20


@pytest.fixture(scope="module")
def train() -> ModuleType:
    """recipes/train.py as a module (recipes/ is not a package)."""
    return recipes_train()


@pytest.fixture(scope="module")
def tokenizer():
    import transformers as tf

    return tf.AutoTokenizer.from_pretrained(ROOT / "sketchcal" / "assets" / "tokenizer")


@pytest.mark.parametrize("family", FAMILIES)
def test_recipe_size_and_head_shapes(train, tokenizer, family):
    recipe = train.load_recipe(RECIPES / f"{family}.yaml")
    assert recipe.model.family == family
    config = train.build_config(recipe, tokenizer)
    assert config.vocab_size == len(tokenizer) == 2048
    model = train.build_model(recipe, config, meta=True)  # checks the class and sketchcal's family
    assert train.parameter_bytes(model, torch.bfloat16) <= 15 * MIB
    shapes = train.layer_shapes(model)
    assert len(shapes) >= 4
    assert {(s["key_dim"], s["value_dim"]) for s in shapes} == {HEAD_SIZES[family]}
    types = list(getattr(config, "layers_block_type", None) or config.layer_types)
    assert "full_attention" in types and "linear_attention" in types  # a hybrid
    if family == "gdn":
        assert config.linear_key_head_dim == config.linear_value_head_dim == 128
        assert config.linear_num_value_heads > config.linear_num_key_heads  # key heads repeat
    elif family == "mamba2":
        assert (config.ssm_state_size, config.mamba_head_dim) == (128, 64)
        assert config.mamba_num_heads > config.n_groups  # grouped B/C
    else:
        assert config.linear_head_dim == 128
    assert recipe.data.corpus_fraction + recipe.data.recall_fraction == pytest.approx(1.0)
    assert recipe.output.dtype == "bfloat16"


def test_recipe_validation(train, tmp_path):
    recipe = (RECIPES / "gdn.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(recipe.replace("  seq_len: 512", "  seq_len: 512\n  sequence_length: 3"))
    with pytest.raises(train.SketchcalError, match="sequence_length"):
        train.load_recipe(bad)
    with pytest.raises(train.SketchcalError, match="must be 1"):
        train.load_recipe(RECIPES / "gdn.yaml", ["data.recall_fraction=0.7"])
    with pytest.raises(train.SketchcalError, match="no room"):
        train.load_recipe(RECIPES / "gdn.yaml", ["train.seq_len=128"])
    ok = train.load_recipe(RECIPES / "gdn.yaml", ["train.batch_size=4", "recall.pairs=[2, 8]"])
    assert ok.train.batch_size == 4 and ok.recall.pairs == (2, 8)


def test_recall_answers_are_the_paired_values(train, tokenizer):
    recipe = train.load_recipe(RECIPES / "gdn.yaml")
    cands = train.candidate_tokens(tokenizer, "words", 3)
    assert len(cands) > 2 * recipe.recall.pairs[1]
    gen_a = train.RecallGenerator(recipe.recall, cands, tokenizer.eos_token_id)
    rng = torch.Generator().manual_seed(0)
    for length, prefix_len in [(513, 0), (513, 64), (100, 10), (40, 0)]:
        prefix = torch.arange(3, 3 + prefix_len)
        seq = gen_a.sample(length, rng, prefix if prefix_len else None)
        ids = seq.ids
        assert ids.shape == (length,)
        assert torch.equal(ids[:prefix_len], prefix)
        n = len(seq.keys)
        assert 1 <= n <= recipe.recall.pairs[1]
        both = torch.cat([seq.keys, seq.values])
        assert len(set(both.tolist())) == 2 * n  # keys and values all distinct
        assert set(both.tolist()) <= set(cands)
        pairs = ids[prefix_len : prefix_len + 2 * n].view(n, 2)
        assert torch.equal(pairs[:, 0], seq.keys) and torch.equal(pairs[:, 1], seq.values)
        paired = dict(zip(seq.keys.tolist(), seq.values.tolist(), strict=True))
        assert len(seq.answer_pos) >= 1
        for pos, answer in zip(seq.answer_pos.tolist(), seq.answers.tolist(), strict=True):
            assert pos >= prefix_len + 2 * n
            key = int(ids[pos])
            assert int(ids[pos + 1]) == answer == paired[key]
            assert (pairs[:, 0] == key).sum() == 1  # the key occurs once among the pairs
    # deterministic given the generator's seed
    one = gen_a.sample(200, torch.Generator().manual_seed(7))
    two = gen_a.sample(200, torch.Generator().manual_seed(7))
    assert torch.equal(one.ids, two.ids) and torch.equal(one.answer_pos, two.answer_pos)


def test_batches_weight_text_and_answers(train, tokenizer):
    fractions = ["data.corpus_fraction=0.5", "data.recall_fraction=0.5"]
    recipe = train.load_recipe(RECIPES / "gdn.yaml", ["train.batch_size=4", *fractions])
    cands = train.candidate_tokens(tokenizer, "words", 3)
    gen = train.RecallGenerator(recipe.recall, cands, tokenizer.eos_token_id)
    stream = 3 + torch.arange(5000) % 256  # byte tokens: never a recall key or value
    assert not set(stream.tolist()) & set(cands)
    batch = next(train.BatchStream(recipe, stream, gen, seed=0))
    again = next(train.BatchStream(recipe, stream, gen, seed=0))
    assert torch.equal(batch.inputs, again.inputs) and torch.equal(batch.weights, again.weights)
    assert batch.inputs.shape == batch.targets.shape == batch.weights.shape == (4, 512)
    assert batch.n_text == 2
    assert torch.allclose(batch.weights.sum(1), torch.ones(4))
    assert (batch.weights[:2] > 0).all()  # text rows: every token
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    for row in range(2, 4):  # recall rows: only the queried values, each predicted after its key
        pos = batch.weights[row].nonzero().flatten()
        inputs, targets = batch.inputs[row], batch.targets[row]
        for p in pos.tolist():
            key = inputs[p]
            first = int((inputs == key).nonzero()[0])
            assert targets[p] == inputs[first + 1]


def test_train_end_to_end(train, tmp_path):
    import transformers as tf

    out = tmp_path / "tiny-gdn"
    args = [
        str(RECIPES / "gdn.yaml"),
        "--device",
        "cpu",
        "--max-steps",
        "2",
        "--out",
        str(out),
        "--no-progress",
        "--set",
        "train.batch_size=2",
        "--set",
        "train.seq_len=32",
        "--set",
        "train.log_every=1",
        "--set",
        "recall.pairs=[2, 8]",
        "--set",
        "recall.prefix=[0, 4]",
        "--set",
        "eval.heldout_windows=2",
        "--set",
        "eval.periodic_windows=1",
        "--set",
        "eval.periodic_recall_samples=2",
        "--set",
        "eval.recall=[{prompt: 8, tokens: 16, samples: 2}]",
    ]
    metrics = train.main(args)
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "metrics.json", "README.md"} <= files
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial directory left
    assert (out / "model.safetensors").stat().st_size <= 15 * MIB
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["heldout"]["loss"] == metrics["heldout"]["loss"]
    for key in (
        "family",
        "architecture",
        "parameters",
        "size_bytes",
        "steps",
        "tokens",
        "train_seconds",
        "tokens_per_second",
        "history",
        "evals",
        "recipe",
        "seed",
        "kernels",
        "layers",
    ):
        assert key in saved, key
    assert saved["steps"] == 2 and saved["family"] == "gdn" and saved["seed"] == 0
    assert set(saved["heldout"]) >= {"loss", "perplexity", "tokens", "uniform_loss"}
    (recall,) = saved["recall"]
    assert set(recall) >= {"accuracy", "chance_in_context", "chance_vocab", "pairs", "queries", "samples"}
    assert 0.0 <= recall["accuracy"] <= 1.0
    assert recall["chance_in_context"] == pytest.approx(1 / recall["pairs"], abs=1e-3)
    assert [e["step"] for e in saved["evals"]] == [0]
    assert "held-out loss" in (out / "README.md").read_text().lower()

    model = tf.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert next(model.parameters()).dtype == torch.bfloat16
    tok = tf.AutoTokenizer.from_pretrained(out)
    ids = tok("def f(x): return x", return_tensors="pt")["input_ids"]
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], 2048)

    with pytest.raises(SystemExit):  # an existing output directory is never overwritten
        train.main(args)
    again = tmp_path / "again"
    train.main([*args[: args.index("--out") + 1], str(again), *args[args.index("--out") + 2 :]])
    weights = (out / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == weights  # deterministic given the seed (CPU)


def test_curriculum_raises_the_pair_count(train, tokenizer):
    """Batch b of a curriculum over R batches draws at most lo + (hi - lo) * b // R pairs; after it, hi."""
    overrides = [
        "train.batch_size=16",
        "train.seq_len=256",
        "data.corpus_fraction=0.0",
        "data.recall_fraction=1.0",
        "recall.pairs=[1, 64]",
        "recall.prefix=[0, 0]",
        "recall.curriculum_steps=4",
    ]
    recipe = train.load_recipe(RECIPES / "mamba2.yaml", overrides)
    gen = train.RecallGenerator(recipe.recall, train.candidate_tokens(tokenizer, "words", 3), 0)
    drawn: list[int] = []
    sample = gen.sample
    gen.sample = lambda *a, **k: (seq := sample(*a, **k), drawn.append(len(seq.keys)))[0]
    stream = train.BatchStream(recipe, 3 + torch.arange(5000) % 256, gen, seed=0)
    per_batch = []
    for _ in range(7):
        drawn.clear()
        next(stream)
        per_batch.append(list(drawn))
    for b in range(4):
        assert max(per_batch[b]) <= 1 + 63 * b // 4
    assert per_batch[0] == [1] * 16
    assert max(max(p) for p in per_batch[4:]) > 1 + 63 * 3 // 4  # the full range after the ramp


def test_stdlib_sources_leave_the_heldout_packages_out(train):
    """Training source text skips the held-out packages (named in the corpus LICENSE.md) and shares
    almost no 100-character run with the held-out file."""
    corpus = ROOT / "sketchcal" / "data" / "corpus"
    groups = train.corpus_builder().heldout_groups(corpus / "heldout.jsonl")
    licence = (corpus / "LICENSE.md").read_text()
    listed = licence.split("whole top-level packages: ", 1)[1].split(")", 1)[0]
    assert groups == set(listed.split(", "))
    docs = train.stdlib_source_documents(corpus / "heldout.jsonl")
    assert len(docs) > 100 and not {d.group for d in docs} & groups
    source = " ".join(" ".join(d.text for d in docs).split())
    held = [" ".join(json.loads(line)["text"].split()) for line in (corpus / "heldout.jsonl").open()]
    chunks = [t[i : i + 100] for t in held for i in range(0, len(t) - 100, 100)]
    shared = sum(chunk in source for chunk in chunks)
    assert len(chunks) > 1000 and shared / len(chunks) < 0.01


def test_recipe_overrides_and_bad_values(train):
    """``--set`` values are YAML; numbers written without a dot (``2e-3``, which YAML 1.1 reads as
    text) still count as numbers, and anything else fails with one line naming the key."""
    from sketchcal.errors import SketchcalError

    recipe = train.load_recipe(RECIPES / "gdn.yaml", ["optimizer.lr=2e-3", "recall.curriculum_steps=5"])
    assert recipe.optimizer.lr == 0.002 and isinstance(recipe.optimizer.lr, float)
    assert recipe.recall.curriculum_steps == 5
    bad = [
        (["optimizer.lr=fast"], "optimizer.lr' must be a number"),
        (["data.stdlib_sources=1.5"], "stdlib_sources must be in"),
        (["recall.curriculum_steps=-1"], "curriculum_steps must be >= 0"),
        (["train.colour=red"], "unknown key"),
        (["optimizer"], "SECTION.KEY=VALUE"),
    ]
    for overrides, message in bad:
        with pytest.raises(SketchcalError, match=message) as err:
            train.load_recipe(RECIPES / "gdn.yaml", overrides)
        assert "\n" not in str(err.value)
