"""Content hashes of the files sketchcal writes and reads: sha256 digests and weights fingerprints.

A digest is ``"sha256:<64 hex>"`` of a file's bytes. The weights fingerprint of a model directory
is the digest of the sorted lines ``"<name> <digest>\\n"`` over its top-level ``*.safetensors``
files (what transformers loads), so two directories with the same weight files, linked or copied,
have the same fingerprint. Files in a Hugging Face cache snapshot are symlinks to ``blobs/<sha256>``
(the LFS object id, which is the sha256 of the content); their digest is read from that name
instead of rehashing gigabytes. Digests are cached per process by (device, inode, size, mtime).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from sketchcal.errors import SketchcalError

_BLOB = re.compile(r"^[0-9a-f]{64}$")
_CACHE: dict[tuple[int, int, int, int], str] = {}


def file_digest(path: str | os.PathLike) -> str:
    """``"sha256:<hex>"`` of the file at ``path`` (symlinks followed)."""
    p = Path(path)
    real = p.resolve()
    st = real.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key in _CACHE:
        return _CACHE[key]
    if p.is_symlink() and real.parent.name == "blobs" and _BLOB.match(real.name):
        digest = "sha256:" + real.name  # a Hugging Face cache blob is named by its sha256
    else:
        h = hashlib.sha256()
        with open(real, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
        digest = "sha256:" + h.hexdigest()
    _CACHE[key] = digest
    return digest


def tensor_file_digests(root: str | os.PathLike, known: dict[str, str] | None = None) -> dict[str, str]:
    """:func:`file_digest` of every ``*.safetensors`` file under ``root``, by relative path (what a
    converted model's ``sketch_config.files`` records); a file named in ``known`` takes its digest
    from there (a base weight file linked or copied, already hashed)."""
    root, known = Path(root), known or {}
    out = {}
    for f in sorted(root.rglob("*.safetensors")):
        rel = f.relative_to(root).as_posix()
        out[rel] = known.get(rel) or file_digest(f)
    return out


def weight_files(model_dir: str | os.PathLike) -> list[str]:
    """The top-level ``*.safetensors`` files of ``model_dir``, sorted by name."""
    d = Path(model_dir)
    return sorted(p.name for p in d.glob("*.safetensors") if p.is_file() and not p.name.startswith("."))


def weights_fingerprint(model_dir: str | os.PathLike) -> tuple[str | None, dict[str, str]]:
    """The weights fingerprint of ``model_dir`` and the digest of each weight file (name -> digest);
    ``(None, {})`` when it has no safetensors weights."""
    digests = {name: file_digest(Path(model_dir) / name) for name in weight_files(model_dir)}
    return fingerprint_of(digests), digests


def fingerprint_of(digests: dict[str, str]) -> str | None:
    """The fingerprint of a set of weight files given their digests (None for no files)."""
    if not digests:
        return None
    lines = "".join(f"{name} {digests[name]}\n" for name in sorted(digests))
    return "sha256:" + hashlib.sha256(lines.encode()).hexdigest()


def check_files(root: str | os.PathLike, recorded: dict[str, str], what: str) -> None:
    """Check that every file ``recorded`` (path relative to ``root`` -> digest) exists with that digest.

    Raises:
        SketchcalError: naming the first file that is missing or whose content differs.
    """
    root = Path(root)
    for rel, want in sorted(recorded.items()):
        rel_path = Path(rel)
        if rel_path.is_absolute() or ".." in rel_path.parts:
            raise SketchcalError(f"{what} records a file outside its directory ({rel}); reconvert")
        f = root / rel_path
        if not f.is_file():
            raise SketchcalError(f"{f} is missing; {what} is incomplete: re-download it or reconvert")
        if file_digest(f) != want:
            raise SketchcalError(
                f"{f} does not match the sha256 recorded in {what}: the file was modified, damaged or "
                "replaced after convert; re-download it or reconvert"
            )


def short(digest: str | None) -> str:
    """A digest shortened for messages: ``sha256:0123456789ab…``."""
    return "none" if digest is None else digest[:19] + "…"


def save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file`` with the header's metadata in sorted order.

    The writer keeps the metadata in a hash map, so its order (and the file's sha256) would change
    from one process to the next; the same tensors and metadata must give the same bytes.
    """
    import json
    import struct

    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    if not metadata:
        return
    with open(path, "r+b") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(size))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > size:  # never: the same keys and values in another order
            raise RuntimeError(f"cannot reorder the safetensors header of {path}")
        fh.seek(8)
        fh.write(text + b" " * (size - len(text)))  # the format pads headers with spaces
