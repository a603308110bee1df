"""Build sketchcal's built-in calibration corpus from the docstrings of the Python standard library.

Every machine that runs sketchcal has the CPython standard library, whose docstrings are English prose
about programming (with some doctest code) under the PSF licence. This script turns them into
``sketchcal/data/corpus/{calib,heldout}.jsonl`` (one ``{"text": ...}`` per line) and ``LICENSE.md``.

One document per standard-library module: its module docstring, then the docstring of every class
and function defined at module level or in a class body (source order), each after a heading line
with its qualified name and signature. Rules, all deterministic:

- files are visited in sorted path order; tests, ``site-packages`` and files that carry a licence
  notice of their own (anything beyond the PSF licence and its contributor agreement) are skipped;
- whitespace is normalised lightly (dedent, trailing spaces, tabs, runs of blank lines);
- a docstring shorter than ``--min-docstring`` characters is dropped, and so is any docstring whose
  whitespace-collapsed text already appeared earlier (so no text is repeated across documents);
- a module keeps docstrings up to ``--max-document`` characters and is dropped below ``--min-document``;
- documents are ordered by the SHA-256 of their module name (a fixed pseudo-random order, so any
  prefix of a file is a mix of topics) and kept in that order while the two files fit ``--max-bytes``;
- the split is by top-level package (all of ``email.*`` lands on one side): packages are taken in
  SHA-256 order into ``heldout`` until it holds ``--heldout-fraction`` of the characters.

Usage: ``python recipes/build_corpus.py [--out sketchcal/data/corpus]``. The shipped files were made
with the CPython version recorded in ``LICENSE.md``; other versions give slightly different text.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import platform
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "dist-packages"}
# A file that states a licence of its own (MIT/Apache/BSD/zlib/HPND notices, ...) is left out so that
# the corpus is under the PSF licence alone. "Licensed to PSF under a Contributor Agreement" is fine.
OWN_LICENCE = re.compile(
    r"permission to use|permission is hereby granted|provided ['\"]as-is['\"]|altered source versions"
    r"|without fee|redistribution and use|the software is provided|gnu general|licen[cs]ed under",
    re.IGNORECASE,
)
PSF_SECTION = "B. TERMS AND CONDITIONS FOR ACCESSING OR OTHERWISE USING PYTHON"


@dataclass
class Document:
    """One corpus document: a module's docstrings under headings; ``group`` is its top-level package."""

    module: str
    group: str
    text: str


def normalise(doc: str) -> str:
    """Light whitespace normalisation of a cleaned docstring: no trailing spaces or tabs, at most one
    blank line in a row, no leading/trailing blank lines."""
    doc = doc.replace("\r\n", "\n").replace("\r", "\n")
    lines = [line.rstrip().expandtabs(4) for line in doc.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def module_name(rel: Path) -> str:
    """``json/decoder.py`` -> ``json.decoder``; ``email/__init__.py`` -> ``email``."""
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """``(self, s, *, strict=True)``, as written in the source."""
    return f"({ast.unparse(node.args)})"


def documented_nodes(tree: ast.Module, module: str) -> list[tuple[str, str]]:
    """(heading, raw docstring) for the module and every class/function in the module body or in a
    class body (recursively), in source order. Function bodies are not entered."""
    out: list[tuple[str, str]] = []
    doc = ast.get_docstring(tree, clean=True)
    if doc:
        out.append((f"module {module}", doc))

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                qual = f"{prefix}.{node.name}"
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    bases = ", ".join(ast.unparse(b) for b in node.bases)
                    out.append((f"class {qual}({bases})" if bases else f"class {qual}", doc))
                visit(node.body, qual)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    out.append((f"{prefix}.{node.name}{signature(node)}", doc))

    visit(tree.body, module)
    return out


def collect(stdlib: Path, min_docstring: int, min_document: int, max_document: int) -> list[Document]:
    """All documents of the standard library at ``stdlib``, in sorted path order, deduplicated."""
    seen: set[str] = set()
    docs: list[Document] = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if SKIP_DIRS.intersection(rel.parts) or rel.parts[0].startswith("config-"):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source, filename=str(rel))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if OWN_LICENCE.search(source):
            continue
        name = module_name(rel)
        pieces: list[str] = []
        size = 0
        for heading, raw in documented_nodes(tree, name):
            body = normalise(raw)
            key = " ".join(body.split())
            if len(body) < min_docstring or key in seen:
                continue
            if size + len(body) > max_document:
                break
            seen.add(key)
            pieces.append(f"{heading}\n\n{body}")
            size += len(body)
        text = "\n\n".join(pieces)
        if len(text) >= min_document:
            docs.append(Document(module=name, group=name.split(".")[0], text=text))
    return docs


def heldout_groups(heldout_jsonl: Path) -> set[str]:
    """The top-level packages of a held-out file written by this script: the first name of each
    document's first heading (``module json.decoder``, ``class json.JSONDecoder(...)``, ...)."""
    groups = set()
    for line in heldout_jsonl.read_text(encoding="utf-8").splitlines():
        if line.strip():
            heading = json.loads(line)["text"].split("\n", 1)[0]
            name = heading.removeprefix("module ").removeprefix("class ")
            groups.add(re.split(r"[.(\s]", name, maxsplit=1)[0])
    return groups


def source_documents(stdlib: Path, exclude_groups: set[str]) -> list[Document]:
    """Whole standard-library source files (code, comments and docstrings) as training text.

    The same files as :func:`collect` (sorted path order; tests, ``site-packages`` and files with a
    licence of their own skipped) minus every top-level package in ``exclude_groups`` (the held-out
    packages, whose docstrings must not be trained on), whitespace normalised as docstrings are.
    """
    docs = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if SKIP_DIRS.intersection(rel.parts) or rel.parts[0].startswith("config-"):
            continue
        name = module_name(rel)
        if name.split(".")[0] in exclude_groups:
            continue
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, ValueError):
            continue
        if OWN_LICENCE.search(source) or not source.strip():
            continue
        docs.append(Document(module=name, group=name.split(".")[0], text=normalise(source)))
    return docs


def sha_key(name: str) -> str:
    """A fixed pseudo-random order that does not depend on any RNG implementation."""
    return hashlib.sha256(name.encode("utf-8")).hexdigest()


def line_bytes(doc: Document) -> int:
    return len(json.dumps({"text": doc.text}, ensure_ascii=False).encode("utf-8")) + 1


def select(docs: list[Document], max_bytes: int) -> list[Document]:
    """Documents in SHA-256 order of their module name, kept while the total stays within ``max_bytes``."""
    kept, total = [], 0
    for doc in sorted(docs, key=lambda d: sha_key(d.module)):
        size = line_bytes(doc)
        if total + size <= max_bytes:
            kept.append(doc)
            total += size
    return kept


def split(docs: list[Document], heldout_fraction: float) -> tuple[list[Document], list[Document]]:
    """Whole top-level packages go to held-out in SHA-256 order until it holds the fraction of characters."""
    chars: dict[str, int] = {}
    for doc in docs:
        chars[doc.group] = chars.get(doc.group, 0) + len(doc.text)
    target = heldout_fraction * sum(chars.values())
    held: set[str] = set()
    total = 0
    for group in sorted(chars, key=sha_key):
        if total >= target:
            break
        if total + chars[group] > 2 * target:  # one huge package would unbalance the split
            continue
        held.add(group)
        total += chars[group]
    calib = [d for d in docs if d.group not in held]
    heldout = [d for d in docs if d.group in held]
    return calib, heldout


def write_jsonl(path: Path, docs: list[Document]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc.text}, ensure_ascii=False) + "\n")


def psf_licence_text(stdlib: Path) -> str:
    """Section B of CPython's LICENSE.txt (the PSF licence stack), verbatim."""
    for candidate in (stdlib / "LICENSE.txt", Path(sys.base_prefix) / "LICENSE.txt"):
        if candidate.is_file():
            text = candidate.read_text(encoding="utf-8")
            start = text.find(PSF_SECTION)
            if start >= 0:
                return text[start:].rstrip() + "\n"
    raise SystemExit("cannot find CPython's LICENSE.txt; run with a full CPython install")


def licence_markdown(stdlib: Path, calib: list[Document], heldout: list[Document]) -> str:
    def stats(docs: list[Document]) -> str:
        return f"{len(docs)} documents, {sum(len(d.text) for d in docs):,} characters"

    held_groups = sorted({d.group for d in heldout})
    return f"""# Built-in calibration corpus: source and licence

`calib.jsonl` and `heldout.jsonl` hold docstrings of the Python standard library, extracted from
the `.py` files of CPython {platform.python_version()} by `recipes/build_corpus.py` in this
repository. Each line is one document, `{{"text": ...}}`: one standard-library module's docstrings
(module, classes, functions), each under a heading line with its qualified name and signature.

- calib: {stats(calib)}
- heldout: {stats(heldout)} (whole top-level packages: {", ".join(held_groups)})

Summary of the changes made to the original (PSF licence, clause 3): only docstrings are kept;
whitespace is normalised (dedent, trailing spaces, tabs, repeated blank lines); short and repeated
docstrings are dropped; headings are generated from the source's names and signatures; modules are
reordered and split into the two files. Tests, third-party packages and standard-library files that
carry a licence notice of their own are left out, so all text here is under the PSF licence below.

The Python standard library is Copyright (c) 2001-2023 Python Software Foundation; All Rights
Reserved. Its licence terms, copied verbatim from CPython's `LICENSE.txt`:

```
{psf_licence_text(stdlib).rstrip()}
```
"""


def main(argv: list[str] | None = None) -> None:
    here = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--out", type=Path, default=here / "sketchcal" / "data" / "corpus")
    parser.add_argument("--min-docstring", type=int, default=120, help="drop shorter docstrings (chars)")
    parser.add_argument("--min-document", type=int, default=400, help="drop smaller modules (chars)")
    parser.add_argument("--max-document", type=int, default=30_000, help="cap per module (chars)")
    parser.add_argument("--max-bytes", type=int, default=1_450_000, help="both files together")
    parser.add_argument("--heldout-fraction", type=float, default=0.1)
    args = parser.parse_args(argv)

    docs = collect(args.stdlib, args.min_docstring, args.min_document, args.max_document)
    docs = select(docs, args.max_bytes)
    calib, heldout = split(docs, args.heldout_fraction)
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "calib.jsonl", calib)
    write_jsonl(args.out / "heldout.jsonl", heldout)
    (args.out / "LICENSE.md").write_text(licence_markdown(args.stdlib, calib, heldout), encoding="utf-8")
    for name in ("calib.jsonl", "heldout.jsonl"):
        path = args.out / name
        count = sum(1 for _ in path.open(encoding="utf-8"))
        print(f"{path}: {count} documents, {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
