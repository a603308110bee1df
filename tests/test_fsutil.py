"""Atomic writes: permissions from the umask, stale temporaries removed, faults as one line."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sketchcal.errors import SketchcalError
from sketchcal.fsutil import atomic_dir, atomic_path, remove_stale_temporaries, write_json


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_files_and_directories_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        write_json(tmp_path / "a.json", {"x": 1})
        with atomic_dir(tmp_path / "art") as d:
            (d / "f.txt").write_text("hi")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "a.json") == 0o644
    assert _mode(tmp_path / "art") == 0o755


def _killed_writer(tmp_path: Path, kind: str) -> Path:
    """A child process that starts an atomic write and is killed with SIGKILL inside it."""
    code = textwrap.dedent(
        f"""
        import os, signal, sys
        from sketchcal.fsutil import atomic_dir, atomic_path
        target = sys.argv[1]
        if {kind!r} in ("file", "file-side"):
            with atomic_path(target) as tmp:
                if {kind!r} == "file-side":  # a writer with a temporary of its own, as safetensors has
                    (tmp.parent / ".tmpAbC123").write_bytes(b"x" * 1000)
                else:
                    tmp.write_bytes(b"x" * 1000)
                os.kill(os.getpid(), signal.SIGKILL)
        else:
            with atomic_dir(target) as tmp:
                (tmp / "w.bin").write_bytes(b"x" * 1000)
                os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    target = tmp_path / f"{kind}-target"
    proc = subprocess.run([sys.executable, "-c", code, str(target)], check=False)
    assert proc.returncode == -signal.SIGKILL
    return target


@pytest.mark.parametrize("kind", ["file", "file-side", "dir"])
def test_a_killed_write_leaves_a_temporary_that_the_next_write_removes(tmp_path, kind):
    target = _killed_writer(tmp_path, kind)
    assert not target.exists()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert len(leftovers) == 1
    write_json(tmp_path / "other.json", {})  # any later atomic write in the directory cleans up
    assert [p.name for p in tmp_path.iterdir()] == ["other.json"]


def test_a_live_writers_temporary_is_kept(tmp_path):
    live = tmp_path / f".x.json.{os.uname().nodename}-{os.getpid()}.abcd1234.tmp"
    live.write_text("in progress")
    assert remove_stale_temporaries(tmp_path) == []
    assert live.exists()


def test_unrelated_hidden_files_are_kept(tmp_path):
    (tmp_path / ".gitignore").write_text("*")
    (tmp_path / ".cache.tmp").write_text("user file")
    assert remove_stale_temporaries(tmp_path) == []


def _mount_tmpfs(path: Path, options: str) -> bool:
    path.mkdir()
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "small"
    if os.geteuid() != 0 or not _mount_tmpfs(mnt, "size=64k"):
        pytest.skip("needs root and tmpfs to make a small filesystem")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


@pytest.fixture
def readonly_fs(tmp_path):
    mnt = tmp_path / "ro"
    if os.geteuid() != 0 or not _mount_tmpfs(mnt, "size=64k,ro"):
        pytest.skip("needs root and tmpfs to make a read-only filesystem")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_a_full_disk_is_one_line_and_leaves_nothing(small_fs):
    (small_fs / "keep.json").write_text("{}")
    with pytest.raises(SketchcalError, match="no space left"), atomic_path(small_fs / "big.bin") as tmp:
        tmp.write_bytes(os.urandom(1 << 20))
    assert sorted(p.name for p in small_fs.iterdir()) == ["keep.json"]
    assert (small_fs / "keep.json").read_text() == "{}"


def test_a_read_only_filesystem_is_one_line(readonly_fs):
    with pytest.raises(SketchcalError, match=r"cannot write .*writable location"):
        write_json(readonly_fs / "sub" / "a.json", {})
    with pytest.raises(SketchcalError, match="cannot write"), atomic_dir(readonly_fs / "art"):
        pass
