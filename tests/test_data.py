"""Tests of sketchcal.data: sources, the held-out split, sample cutting, the built-in corpus and tokenizer.

Expectations are computed independently of the implementation where possible: windows come from
tokenising ``eos.join(documents)`` in one call, file contents from the strings the tests wrote.
"""

from __future__ import annotations

import json
import random
import sys
import types
from pathlib import Path

import pytest
import torch

from sketchcal.data import (
    BUILTIN,
    SampleSet,
    build_samples,
    builtin_tokenizer_path,
    is_heldout_document,
    load_documents,
)
from sketchcal.data import samples as samples_module
from sketchcal.errors import SketchcalError

CORPUS = Path(__file__).resolve().parent.parent / "sketchcal" / "data" / "corpus"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(builtin_tokenizer_path()))


def read_jsonl(path: Path) -> list[str]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def make_docs(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct documents, each starting with a unique marker word ``docNNNNN``."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "state", "query", "window", "buffer", "flush", "sketch"]
    return [f"doc{i:05d} " + " ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) for i in range(n)]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    lines = [json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)]
    path.write_text("".join(lines), encoding="utf-8")
    return path


def expected_windows(tokenizer, docs: list[str], length: int) -> list[list[int]]:
    """Consecutive windows of ``eos.join(docs)`` tokenised in one call."""
    ids = tokenizer(tokenizer.eos_token.join(docs), add_special_tokens=False, verbose=False)["input_ids"]
    return [ids[i * length : (i + 1) * length] for i in range(len(ids) // length)]


# --- built-in corpus and tokenizer ---------------------------------------------------------------


def test_builtin_corpus_is_small_split_by_document_and_licensed():
    calib, heldout = read_jsonl(CORPUS / "calib.jsonl"), read_jsonl(CORPUS / "heldout.jsonl")
    assert len(calib) > 100 and len(heldout) > 10
    assert not set(calib) & set(heldout)
    assert len(set(calib)) == len(calib) and len(set(heldout)) == len(heldout)
    size = (CORPUS / "calib.jsonl").stat().st_size + (CORPUS / "heldout.jsonl").stat().st_size
    assert size < 1_600_000
    licence = (CORPUS / "LICENSE.md").read_text(encoding="utf-8")
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in licence


def test_builtin_tokenizer_ids_round_trip_and_chat_template(tokenizer):
    assert len(tokenizer) == 2048
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == 0 and tokenizer.pad_token_id == 0
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    text = "def f(x):\n    return x ** 2  # héllo ✓"
    ids = tokenizer(text)["input_ids"]
    assert 0 not in ids and tokenizer.decode(ids) == text
    messages = [{"role": "user", "content": "hi"}]
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_load_documents_builtin_matches_the_shipped_files():
    calib, heldout = read_jsonl(CORPUS / "calib.jsonl"), read_jsonl(CORPUS / "heldout.jsonl")
    assert load_documents() == calib
    assert load_documents(BUILTIN, split="heldout") == heldout
    assert load_documents(None, split="all") == calib + heldout
    assert load_documents(split="heldout", max_documents=3) == heldout[:3]


# --- local files -----------------------------------------------------------------------------------


def test_txt_documents_are_separated_by_blank_lines(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("first doc\nsecond line\n\n\n  \nsecond doc\n\t\nthird  doc  \n", encoding="utf-8")
    assert load_documents(path, split="all") == ["first doc\nsecond line", "second doc", "third  doc"]


def test_jsonl_documents_use_the_text_field_and_skip_empty_rows(tmp_path):
    path = tmp_path / "a.jsonl"
    rows = [{"body": "one"}, {"body": ""}, {"body": None}, {"body": "  "}, {"body": "two\nlines"}]
    lines = [json.dumps(r) for r in rows]
    path.write_text("\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]), encoding="utf-8")
    assert load_documents(str(path), split="all", text_field="body") == ["one", "two\nlines"]


def test_parquet_documents_and_directories(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"content": ["p1", None, "p2", ""], "n": [1, 2, 3, 4]}), tmp_path / "b.parquet")
    assert load_documents(tmp_path / "b.parquet", split="all", text_field="content") == ["p1", "p2"]

    folder = tmp_path / "dir"
    (folder / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"text": ["parquet doc"]}), folder / "sub" / "c.parquet")
    (folder / "a.txt").write_text("txt doc 1\n\ntxt doc 2\n", encoding="utf-8")
    write_jsonl(folder / "b.jsonl", ["jsonl doc"])
    (folder / "notes.md").write_text("ignored", encoding="utf-8")
    (folder / ".hidden.txt").write_text("ignored too", encoding="utf-8")
    assert load_documents(folder, split="all") == ["txt doc 1", "txt doc 2", "jsonl doc", "parquet doc"]


def test_heldout_split_of_a_file_is_a_stable_content_partition(tmp_path):
    docs = make_docs(2000)
    path = write_jsonl(tmp_path / "docs.jsonl", docs)
    calib, heldout = load_documents(path, split="calib"), load_documents(path, split="heldout")
    assert calib == [d for d in docs if not is_heldout_document(d)]
    assert heldout == [d for d in docs if is_heldout_document(d)]
    assert 140 <= len(heldout) <= 260  # about 10% (binomial, 2000 draws: sd ~ 13)
    # The rule looks at the text only: shuffling the file keeps every document on its side.
    shuffled = docs[:]
    random.Random(1).shuffle(shuffled)
    write_jsonl(tmp_path / "shuffled.jsonl", shuffled)
    assert set(load_documents(tmp_path / "shuffled.jsonl", split="heldout")) == set(heldout)


# --- samples -----------------------------------------------------------------------------------------


def test_plain_samples_are_distinct_windows_of_the_eos_joined_calib_stream(tokenizer, tmp_path):
    docs = make_docs(400)
    path = write_jsonl(tmp_path / "docs.jsonl", docs)
    calib_docs = [d for d in docs if not is_heldout_document(d)]
    windows = expected_windows(tokenizer, calib_docs, 48)
    result = build_samples(tokenizer, str(path), num_samples=20, seq_len=48)
    assert isinstance(result, SampleSet)
    assert len(result.calib) == 20 and result.heldout == []
    assert all(len(s) == 48 for s in result.calib)
    positions = [windows.index(s) for s in result.calib]  # ValueError if a sample is not a window
    assert len(set(positions)) == 20
    assert positions != sorted(positions)  # a random choice, not the first windows in order
    assert result.info["windows"]["calib"] == len(windows)
    assert result.info["documents"]["calib"] == len(calib_docs)
    assert result.info["tokens"] == {"calib": 20 * 48, "heldout": 0}
    json.dumps(result.info)


def test_samples_are_deterministic_per_seed_and_leave_global_rngs_alone(tokenizer):
    state = torch.get_rng_state()
    a = build_samples(tokenizer, num_samples=8, seq_len=64, heldout_samples=4, seed=3)
    assert torch.equal(state, torch.get_rng_state())
    torch.manual_seed(12345)
    random.seed(7)
    b = build_samples(tokenizer, BUILTIN, num_samples=8, seq_len=64, heldout_samples=4, seed=3)
    c = build_samples(tokenizer, num_samples=8, seq_len=64, heldout_samples=4, seed=4)
    assert a == b
    assert a.calib != c.calib and a.heldout != c.heldout
    assert a.info["sha256"] == c.info["sha256"] and a.info["seed"] == 3 and c.info["seed"] == 4
    assert all(len(s) == 64 for s in a.calib + a.heldout + c.calib + c.heldout)
    assert (len(a.calib), len(a.heldout)) == (8, 4)


def test_builtin_calib_samples_contain_no_heldout_text(tokenizer):
    calib_docs, heldout_docs = read_jsonl(CORPUS / "calib.jsonl"), read_jsonl(CORPUS / "heldout.jsonl")
    calib_lines = {line for doc in calib_docs for line in doc.splitlines()}
    # Lines that identify held-out documents: long, and not a line of any calib document.
    markers = {line for doc in heldout_docs for line in doc.splitlines() if len(line) >= 50} - calib_lines
    assert len(markers) > 100
    ids = tokenizer(calib_docs, add_special_tokens=False)["input_ids"]
    available = (sum(map(len, ids)) + len(ids) - 1) // 256  # eos between documents
    result = build_samples(tokenizer, num_samples=available, seq_len=256, heldout_samples=50)
    decoded_calib = {line for s in result.calib for line in tokenizer.decode(s).splitlines()}
    assert len(decoded_calib & calib_lines) > 1000  # the check below can see whole lines
    assert not decoded_calib & markers
    decoded_heldout = {line for s in result.heldout for line in tokenizer.decode(s).splitlines()}
    assert decoded_heldout & markers


def test_heldout_samples_of_a_file_come_only_from_heldout_documents(tokenizer, tmp_path):
    docs = make_docs(1500, seed=2)
    path = write_jsonl(tmp_path / "docs.jsonl", docs)
    held = {d.split()[0] for d in docs if is_heldout_document(d)}
    result = build_samples(tokenizer, path, num_samples=100, seq_len=32, heldout_samples=20, seed=1)
    assert all(len(s) == 32 for s in result.calib + result.heldout)

    def markers(samples: list[list[int]]) -> set[str]:
        text = " ".join(tokenizer.decode(s) for s in samples)
        words = text.replace(tokenizer.eos_token, " ").split()
        return {w for w in words if w.startswith("doc") and len(w) == 8}

    calib_markers, heldout_markers = markers(result.calib), markers(result.heldout)
    assert calib_markers and heldout_markers
    assert not calib_markers & held
    assert heldout_markers <= held


def test_chat_template_samples(tokenizer, tmp_path):
    docs = make_docs(300, seed=5)
    path = write_jsonl(tmp_path / "docs.jsonl", docs)
    head = tokenizer("<|im_start|>user\n", add_special_tokens=False)["input_ids"]
    tail = tokenizer("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    result = build_samples(tokenizer, path, num_samples=12, seq_len=40, heldout_samples=3, chat_template=True)
    again = build_samples(tokenizer, path, num_samples=12, seq_len=40, heldout_samples=3, chat_template=True)
    assert result == again and result.info["chat_template"] is True
    calib_text = "\n\n".join(d for d in docs if not is_heldout_document(d))
    for ids in result.calib + result.heldout:
        assert len(ids) <= 40
        assert ids[: len(head)] == head and ids[-len(tail) :] == tail
    for ids in result.calib:
        content = tokenizer.decode(ids[len(head) : -len(tail)])
        assert len(content) > 20 and content in calib_text
    assert max(len(s) for s in result.calib) >= 36  # windows are filled up to nearly seq_len


def test_chat_template_requires_a_template(tokenizer):
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(str(builtin_tokenizer_path()))
    bare.chat_template = None
    with pytest.raises(SketchcalError, match="no chat template"):
        build_samples(bare, num_samples=2, seq_len=64, chat_template=True)
    with pytest.raises(SketchcalError, match="no room for text"):
        build_samples(tokenizer, num_samples=2, seq_len=5, chat_template=True)


def test_hub_datasets_are_streamed_and_read_only_as_far_as_needed(tokenizer, monkeypatch):
    calls: list[dict] = []
    consumed = [0]

    def rows():
        i = 0
        while True:  # an endless dataset: the reader must stop by itself
            consumed[0] += 1
            if consumed[0] > 10_000:
                raise RuntimeError("read far more rows than the samples need")
            yield {"text": f"row {i} " + "words " * 20, "other": i}
            i += 1

    def load_dataset(repo, config, **kwargs):
        calls.append({"repo": repo, "config": config, **kwargs})
        return rows()

    fake = types.ModuleType("datasets")
    fake.load_dataset = load_dataset
    fake.config = types.SimpleNamespace(HF_HUB_OFFLINE=False)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    monkeypatch.setattr(samples_module, "_MIN_POOL_TOKENS", 0)
    result = build_samples(
        tokenizer, "org/name:cfg:validation", num_samples=4, seq_len=16, heldout_samples=2, revision="abc"
    )
    expected = {"repo": "org/name", "config": "cfg", "split": "validation", "revision": "abc"}
    expected["streaming"] = True
    assert calls == [expected]
    assert len(result.calib) == 4 and len(result.heldout) == 2
    assert 0 < consumed[0] <= 10_000
    assert result.info["source"] == "org/name:cfg:validation" and result.info["revision"] == "abc"

    fake.config.HF_HUB_OFFLINE = True
    calls.clear()
    load_documents("org/name", max_documents=2)
    assert calls[0]["streaming"] is False and calls[0]["split"] == "train" and calls[0]["config"] is None


# --- errors --------------------------------------------------------------------------------------------


def test_hub_source_without_datasets_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(SketchcalError, match=r"pip install 'sketchcal\[data\]'"):
        load_documents("someorg/somedata")


@pytest.mark.parametrize(
    ("name", "content", "kwargs", "match"),
    [
        ("missing.txt", None, {}, "does not exist"),
        ("data.csv", "text\nhello\n", {}, "unsupported data file"),
        ("rows.jsonl", '{"text": "ok"}\n{"body": "no text"}\n', {}, r"rows\.jsonl:2: no field 'text'"),
        ("rows.jsonl", '{"text": "ok"}\n{"text": 3}\n', {}, "not a string"),
        ("rows.jsonl", '{"text": "ok"}\nnot json\n', {}, r"rows\.jsonl:2: not valid JSON"),
        ("empty.jsonl", '{"text": ""}\n{"text": "   "}\n', {}, "no non-empty documents"),
        ("empty.txt", "\n\n  \n", {}, "no non-empty documents"),
        ("rows.jsonl", '{"text": "ok"}\n', {"revision": "main"}, "revision applies only"),
        ("rows.jsonl", '{"text": "ok"}\n', {"split": "train"}, "unknown data split"),
    ],
)
def test_bad_sources_raise_one_line_errors(tmp_path, name, content, kwargs, match):
    path = tmp_path / name
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(SketchcalError, match=match) as info:
        load_documents(path, **{"split": "all", **kwargs})
    assert "\n" not in str(info.value)


def test_bad_parquet_column_and_empty_directory(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    with pytest.raises(SketchcalError, match="no column 'text'"):
        load_documents(tmp_path / "a.parquet")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SketchcalError, match="holds no"):
        load_documents(tmp_path / "empty")


def test_evaluation_uses_every_document_of_a_file(tokenizer, tmp_path):
    """A file given for evaluation is held-out data as a whole: every document, and windows of the
    whole stream; the builtin corpus keeps its own held-out split."""
    docs = make_docs(50)
    path = write_jsonl(tmp_path / "docs.jsonl", docs)
    want = expected_windows(tokenizer, docs, 64)
    got = build_samples(
        tokenizer, path, num_samples=0, seq_len=64, heldout_samples=len(want), evaluation=True
    )
    assert got.calib == [] and got.info["documents"]["heldout"] == len(docs)
    assert sorted(got.heldout) == sorted(want) and got.info["heldout_rule"] == "every document"
    split = build_samples(tokenizer, path, num_samples=1, seq_len=64, heldout_samples=1)
    assert split.info["documents"]["heldout"] == sum(is_heldout_document(d) for d in docs) < len(docs)
    builtin = build_samples(tokenizer, None, num_samples=0, seq_len=64, heldout_samples=2, evaluation=True)
    assert builtin.info["heldout_rule"] == "builtin heldout.jsonl"
    names = {"heldout_samples": "--samples", "seq_len": "--tokens"}
    with pytest.raises(SketchcalError, match=rf"lower --samples to {len(want)} .*a shorter --tokens"):
        build_samples(
            tokenizer, path, num_samples=0, seq_len=64, heldout_samples=len(want) + 1, evaluation=True,
            option_names=names,
        )  # fmt: skip


def test_bad_sample_requests(tokenizer, tmp_path):
    docs = make_docs(50)
    path = write_jsonl(tmp_path / "docs.jsonl", docs)
    available = len(expected_windows(tokenizer, [d for d in docs if not is_heldout_document(d)], 64))
    message = f"enough for {available} samples of 64 tokens.*lower num_samples to {available}"
    with pytest.raises(SketchcalError, match=message):
        build_samples(tokenizer, path, num_samples=available + 1, seq_len=64)
    for kwargs, match in [
        ({"num_samples": 0, "seq_len": 8}, "num_samples must be at least 1"),
        ({"num_samples": 2, "seq_len": 0}, "seq_len must be at least 1"),
        ({"num_samples": 2, "seq_len": 8, "heldout_samples": -1}, "heldout_samples must be at least 0"),
        ({"num_samples": True, "seq_len": 8}, "num_samples must be an integer"),
    ]:
        with pytest.raises(SketchcalError, match=match):
            build_samples(tokenizer, path, **kwargs)
    only_calib = write_jsonl(tmp_path / "one.jsonl", [d for d in docs if not is_heldout_document(d)][:5])
    with pytest.raises(SketchcalError, match="no non-empty heldout documents"):
        build_samples(tokenizer, only_calib, num_samples=1, seq_len=8, heldout_samples=1)


def test_tokenizer_without_eos_is_refused(tokenizer):
    class NoEos:
        eos_token_id = None

    with pytest.raises(SketchcalError, match="no eos token"):
        build_samples(NoEos(), num_samples=1, seq_len=8)
