"""Train sketchcal's small built-in tokenizer on the built-in calibration corpus.

Byte-level BPE (GPT-2 style: every byte is a base symbol, so any text round-trips), vocabulary 2048,
trained with the ``tokenizers`` library on ``sketchcal/data/corpus/calib.jsonl``. Special tokens
have the lowest ids: ``<|endoftext|>`` = 0 (eos and pad), ``<|im_start|>`` = 1, ``<|im_end|>`` = 2.
No token is added automatically (no BOS/EOS post-processing). A ChatML chat template lives in
``tokenizer_config.json``, so ``apply_chat_template`` works.

Writes ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into
``sketchcal/assets/tokenizer/`` and checks that ``transformers.AutoTokenizer`` loads them offline
and round-trips text. Usage: ``python recipes/build_tokenizer.py [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MAX_LENGTH = 8192


def read_texts(path: Path) -> list[str]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def train(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with the special tokens at ids 0, 1, 2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def write(tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=False)
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }
    special = {"eos_token": EOS, "pad_token": EOS, "additional_special_tokens": [IM_START, IM_END]}
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def check(out: Path, texts: list[str]) -> None:
    """Load with transformers, offline, and check ids, round trips and the chat template."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(out))
    assert hf.eos_token_id == 0 and hf.pad_token_id == 0, (hf.eos_token_id, hf.pad_token_id)
    assert hf.convert_tokens_to_ids([IM_START, IM_END]) == [1, 2]
    for text in [*texts[:50], "héllo wörld ✓ 你好 \t\n  x", ""]:
        ids = hf(text, add_special_tokens=False, verbose=False)["input_ids"]
        assert hf.decode(ids) == text, text[:80]
    messages = [{"role": "user", "content": "Hi"}]
    chat = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", chat
    print(f"{out}: vocab {len(hf)}, eos/pad id {hf.eos_token_id}, chat template ok")


def main(argv: list[str] | None = None) -> None:
    here = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=here / "sketchcal" / "data" / "corpus" / "calib.jsonl")
    parser.add_argument("--out", type=Path, default=here / "sketchcal" / "assets" / "tokenizer")
    parser.add_argument("--vocab-size", type=int, default=2048)
    args = parser.parse_args(argv)

    texts = read_texts(args.corpus)
    tok = train(texts, args.vocab_size)
    write(tok, args.out)
    check(args.out, texts)


if __name__ == "__main__":
    main()
