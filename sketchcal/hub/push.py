"""``sketchcal push``: publish a converted model directory to the Hugging Face Hub in one commit.

Everything is checked before anything is sent: the directory must be one ``sketchcal convert``
wrote (:func:`~sketchcal.artifact.read_sketch` reads it), the repo id well formed, the verify
report (if any) readable. The model card is built in memory (convert's README.md plus base model,
tags and the verify numbers) and uploaded from memory: the local directory is never written, so
a failed upload leaves it exactly as it was. The token comes from ``token=``, ``HF_TOKEN`` or the
login cache, and never appears in any output or error message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from sketchcal import __version__
from sketchcal.artifact.sketch import SketchArtifact, read_sketch
from sketchcal.errors import SketchcalError
from sketchcal.hub.card import find_verify_report, load_verify_report, push_card
from sketchcal.hub.resolve import hub_id_syntax, is_offline

CARD = "README.md"
REPORT_IN_REPO = "verify/verify.json"
DEFAULT_REVISION = "main"


@dataclass
class UploadFile:
    """One file of the commit."""

    path_in_repo: str
    size: int
    source: Path | None  # None: built in memory (the model card)
    note: str = ""


@dataclass
class PushResult:
    """What was (or, with ``dry_run``, would be) uploaded, and where it went."""

    repo_id: str
    revision: str
    private: bool
    dry_run: bool
    files: list[UploadFile]
    verify_report: Path | None
    card: str
    repo_url: str | None = None
    commit_url: str | None = None
    commit_oid: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def human_size(n: int) -> str:
    """``1.2 MB``-style size (powers of 1000, as the Hub shows them)."""
    size = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def _scrub(text: str, token: str | None) -> str:
    """``text`` with the token (if any) masked: nothing this module raises or prints carries it."""
    return text.replace(token, "***") if token else text


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")


def _local_files(model_dir: Path) -> list[UploadFile]:
    """Every regular file under ``model_dir`` except README.md (replaced by the card) and hidden entries."""
    files = []
    for p in sorted(model_dir.rglob("*")):
        rel = p.relative_to(model_dir)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file() or rel.as_posix() == CARD:
            continue
        files.append(UploadFile(rel.as_posix(), p.stat().st_size, p))
    return files


def _commit_message(art: SketchArtifact) -> str:
    rank = (art.config.get("summary") or {}).get("mean_rank")
    rank_text = f", mean rank {rank:.2f}" if isinstance(rank, (int, float)) else ""
    return f"Upload SketchSSM sketch ({art.config.get('family')}{rank_text}) with sketchcal {__version__}"


def plan_push(
    model_dir: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    verify_report: str | os.PathLike | None = None,
    base_model: str | None = None,
) -> tuple[PushResult, SketchArtifact]:
    """Validate everything and list the commit's files (nothing is sent); used by :func:`push`."""
    if not hub_id_syntax(repo_id) or "/" not in repo_id:  # the repo to create needs its namespace
        raise SketchcalError(f"--repo-id {repo_id!r} is not a Hub repo id; use NAMESPACE/NAME")
    if revision is not None and (not revision.strip() or revision.startswith(("/", "refs/pr/"))):
        raise SketchcalError(f"--revision {revision!r} is not a branch name")
    d = Path(model_dir).expanduser()
    if not d.is_dir():
        raise SketchcalError(f"{d} is not a directory; give the directory written by sketchcal convert")
    art = read_sketch(d)  # one-line SketchcalError when it is not a sketchcal model directory
    notes: list[str] = []
    report_path = Path(verify_report).expanduser() if verify_report is not None else find_verify_report(d)
    report = load_verify_report(report_path) if report_path is not None else None
    files = _local_files(d)
    if report_path is not None:
        sketch_file = d / str(art.config.get("file", "sketch/sketch.safetensors"))
        if sketch_file.is_file() and report_path.stat().st_mtime < sketch_file.stat().st_mtime:
            notes.append(f"the verify report {report_path} is older than the sketch; rerun sketchcal verify")
        if not any(f.path_in_repo == REPORT_IN_REPO for f in files):
            files.append(
                UploadFile(REPORT_IN_REPO, report_path.stat().st_size, report_path, "from --verify-report")
            )
    else:
        notes.append("no verify report: the model card says verify was not run (sketchcal verify DIR)")
    readme = d / CARD
    card = push_card(art, readme.read_text() if readme.is_file() else None, report, base_model)
    files.append(UploadFile(CARD, len(card.encode()), None, "model card, generated"))
    files.sort(key=lambda f: f.path_in_repo)
    result = PushResult(
        repo_id=repo_id,
        revision=revision or DEFAULT_REVISION,
        private=private,
        dry_run=True,
        files=files,
        verify_report=report_path,
        card=card,
        notes=notes,
    )
    return result, art


def push(
    model_dir: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    dry_run: bool = False,
    verify_report: str | os.PathLike | None = None,
    base_model: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
) -> PushResult:
    """Upload ``model_dir`` to the Hub model repo ``repo_id`` in one commit (creating the repo if needed).

    Args:
        model_dir: a directory written by ``sketchcal convert``.
        repo_id: ``NAMESPACE/NAME``.
        private: create the repo private (only applies when it does not exist yet).
        revision: the branch to commit to (created from ``main`` if missing); default ``main``.
        dry_run: validate and list the files, upload nothing (no token needed).
        verify_report: a ``verify.json``; default: ``model_dir/verify/verify.json`` if present.
        base_model: Hub id recorded as the card's ``base_model`` (default: the one the sketch names).
        commit_message: default: family, mean rank and sketchcal version.
        token: default: ``HF_TOKEN`` or the login cache (``hf auth login``).
        endpoint: the Hub URL (default: ``HF_ENDPOINT`` or huggingface.co).

    Raises:
        SketchcalError: invalid inputs, no token, offline mode, or a refused / failed upload (one line,
            token masked). The local directory is never modified.
    """
    result, art = plan_push(
        model_dir,
        repo_id,
        private=private,
        revision=revision,
        verify_report=verify_report,
        base_model=base_model,
    )
    if dry_run:
        return result
    if is_offline():
        raise SketchcalError("push needs the Hub, but HF_HUB_OFFLINE=1; unset it to upload")
    from huggingface_hub import HfApi, get_token

    token = token or get_token()
    if not token:
        raise SketchcalError("no Hugging Face token: set HF_TOKEN or log in with `hf auth login`")
    try:
        _upload(result, art, HfApi(endpoint=endpoint, token=token), commit_message, token)
    except SketchcalError:
        raise
    except Exception as err:
        raise SketchcalError(_scrub(_describe_failure(repo_id, err), token)) from None
    result.dry_run = False
    return result


def _upload(result: PushResult, art: SketchArtifact, api, commit_message: str | None, token: str) -> None:
    from huggingface_hub import CommitOperationAdd

    repo_url = api.create_repo(result.repo_id, private=True if result.private else None, exist_ok=True)
    if result.revision != DEFAULT_REVISION:
        api.create_branch(result.repo_id, branch=result.revision, exist_ok=True)
    ops = [
        CommitOperationAdd(
            path_in_repo=f.path_in_repo,
            path_or_fileobj=str(f.source) if f.source is not None else result.card.encode(),
        )
        for f in result.files
    ]
    verify = "with" if result.verify_report is not None else "without"
    info = api.create_commit(
        result.repo_id,
        ops,
        commit_message=commit_message or _commit_message(art),
        commit_description=f"{len(ops)} files, pushed by `sketchcal push` {verify} a verify report.",
        revision=result.revision,
    )
    result.repo_url = str(repo_url)
    result.commit_url = getattr(info, "commit_url", None)
    result.commit_oid = getattr(info, "oid", None)


def _describe_failure(repo_id: str, err: Exception) -> str:
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(err, HfHubHTTPError):
        status = getattr(getattr(err, "response", None), "status_code", None)
        server = _first_line(getattr(err, "server_message", "") or "")
        hint = {
            401: "the token is invalid or expired (HF_TOKEN / hf auth login)",
            403: "the token cannot write to this namespace (it needs write access)",
        }.get(status or 0, "")
        parts = [f"push to {repo_id} failed: HTTP {status}"]
        parts += [p for p in (server, hint) if p]
        return "; ".join(parts) + "; the local directory is unchanged"
    return (
        f"push to {repo_id} failed: {type(err).__name__}: {_first_line(str(err))}; "
        "the local directory is unchanged"
    )


def print_push_result(result: PushResult, console) -> None:
    """The CLI's output: the file list with sizes (dry run) or the commit that was made."""
    verb = "would upload" if result.dry_run else "uploaded"
    where = f"{result.repo_id} (branch {result.revision}{', private' if result.private else ''})"
    console.print(
        f"{'dry run: ' if result.dry_run else ''}{verb} {len(result.files)} files "
        f"({human_size(result.total_bytes)}) to {where} in one commit",
        highlight=False,
        soft_wrap=True,
    )
    width = max(len(f"{f.size:,}") for f in result.files)
    for f in result.files:
        note = f"  ({f.note})" if f.note else ""
        console.print(f"  {f.size:>{width},} B  {f.path_in_repo}{note}", highlight=False, soft_wrap=True)
    for note in result.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    if not result.dry_run:
        console.print(f"commit {result.commit_oid}: {result.commit_url}", highlight=False, soft_wrap=True)
