"""Atomic file and directory writes: a reader never sees a half-written file.

A write goes to a hidden temporary sibling ``.<name>.<host>-<pid>.<random>.tmp`` (``.partial`` for a
directory) and is renamed into place. Files get the permissions the user's umask gives (0644 / 0755
by default), not ``tempfile``'s private 0600 / 0700, so a serving process under another user can read
an artifact. A process killed mid-write leaves its temporary behind; the next atomic write into the
same directory removes every temporary of this host whose process is gone.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sketchcal.errors import SketchcalError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _owner_tag() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"
    return f"{host}-{os.getpid()}"


_TEMP_NAME = re.compile(r"^\..+\.(?P<host>[A-Za-z0-9_-]+)-(?P<pid>\d+)\.[^.]+\.(tmp|partial)$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporaries that interrupted writes of this host left in ``directory``.

    Only names of the form this module creates are considered, and only those whose writing process
    (same host name, pid no longer alive) is gone; a concurrent writer's temporaries are kept.
    Returns what was removed.
    """
    directory = Path(directory)
    host = _owner_tag().rsplit("-", 1)[0]
    removed: list[Path] = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP_NAME.match(entry.name)
        if m is None or m["host"] != host or _alive(int(m["pid"])):
            continue
        with contextlib.suppress(OSError):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
    return removed


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


_OS_ERROR = re.compile(r"os error (\d+)")


def _errno_of(err: BaseException) -> int | None:
    """The errno of an OSError, or of an I/O error that a library reports only in its message
    (safetensors' writer says ``... (os error 28)``)."""
    if isinstance(err, OSError):
        return err.errno
    m = _OS_ERROR.search(str(err))
    return int(m[1]) if m else None


@contextlib.contextmanager
def disk_errors(what: str) -> Iterator[None]:
    """Turn a full disk or a permission problem into a one-line :class:`SketchcalError`.

    Catches ``OSError`` and the I/O errors of writers that wrap it (safetensors' ``SafetensorError``).
    """
    try:
        yield
    except SketchcalError:
        raise
    except Exception as err:
        code = _errno_of(err)
        if code == errno.ENOSPC:
            msg = f"no space left on the device while writing {what}; free space and rerun"
            raise SketchcalError(msg) from err
        if code in (errno.EACCES, errno.EPERM, errno.EROFS):
            reason = os.strerror(code)
            raise SketchcalError(f"cannot write {what}: {reason}; choose a writable location") from err
        raise


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_writable(path: str | os.PathLike, need_bytes: int, what: str, option: str = "--out") -> None:
    """Fail early, with one line, when ``path`` (a directory to be written, existing or not) cannot be
    created or written, or its filesystem has less than ``need_bytes`` free.

    A probe file is created (and removed) in ``path`` or its nearest existing ancestor, so a read-only
    filesystem or a missing permission is found before any long work starts; nothing is left behind.
    """
    base = _existing_ancestor(Path(path))
    if not base.is_dir():
        raise SketchcalError(f"{base} is not a directory; choose another {option}")
    remove_stale_temporaries(base)
    with disk_errors(what):
        fd, probe = tempfile.mkstemp(prefix=f".probe.{_owner_tag()}.", suffix=".tmp", dir=base)
        os.close(fd)
        os.unlink(probe)
    free = shutil.disk_usage(base).free
    if free < need_bytes:
        raise SketchcalError(
            f"not enough free space for {what}: about {need_bytes / 2**20:,.1f} MiB needed, "
            f"{free / 2**20:,.1f} MiB free on {base}; free space or choose another {option}"
        )


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is fsynced and renamed onto ``path``.

    The temporary file lives in a private directory beside ``path``, named as this module names its
    temporaries, so that whatever the writer puts beside it (safetensors writes through a temporary
    file of its own) goes with that directory: on an error here, or with the next run's
    :func:`remove_stale_temporaries` after a kill. ``path`` is left as it was on any error.
    """
    path = Path(path)
    with disk_errors(str(path)):
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path.parent)
        prefix = f".{path.name}.{_owner_tag()}."
        tmp_dir = Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=path.parent))
    tmp_path = tmp_dir / path.name
    try:
        with disk_errors(str(path)):
            yield tmp_path
            os.chmod(tmp_path, 0o666 & ~_umask())  # writers may create it 0600; give it normal permissions
            with open(tmp_path, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp_path, path)
            _fsync_dir(path.parent)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def finite_json(obj: Any) -> Any:
    """JSON has no NaN or Inf: replace non-finite floats (in nested dicts and lists) by None."""
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite_json(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Build a directory under a temporary name beside ``path`` and rename it into place at the end.

    ``path`` must not exist (callers decide about overwriting first). On error the partial
    directory is deleted, so an interrupted run never leaves something that looks complete.
    """
    path = Path(path)
    if path.exists():
        raise SketchcalError(f"{path} already exists; choose another output or remove it first")
    with disk_errors(str(path)):
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path.parent)
        prefix = f".{path.name}.{_owner_tag()}."
        tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=".partial", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp creates 0700
    try:
        with disk_errors(str(path)):
            yield tmp
            os.replace(tmp, path)
            _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
