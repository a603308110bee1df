"""Turn a model or artifact argument (a local directory or a Hub id) into a local directory.

Every command that takes a model, an artifact or a statistics directory can call :func:`resolve`
first: a local directory is returned as it is; a Hub id is fetched into (or found in) the Hugging
Face cache with ``snapshot_download``. ``HF_HUB_OFFLINE=1`` (or an unreachable Hub) means the cache
only; what is not there is a one-line :class:`~sketchcal.errors.SketchcalError`, never a traceback.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from sketchcal.errors import SketchcalError

# A Hub repo id: NAME or NAMESPACE/NAME, each part 1-96 ASCII letters, digits, '-', '_', '.', not
# starting or ending with '-' or '.'; no '--' or '..' anywhere.
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"^(?:{_PART}/)?{_PART}$")

# What inspect / verify-style readers need from a converted model repo: no weights.
ARTIFACT_PATTERNS: tuple[str, ...] = (
    "config.json",
    "README.md",
    "sketch/*",
    "calibration/*",
    "verify/*.json",
)
# A statistics directory written by ``sketchcal calibrate``: all of it.
STATS_PATTERNS: tuple[str, ...] = ("*",)

_TRUE = {"1", "ON", "YES", "TRUE"}


def hub_id_syntax(name: object) -> bool:
    """True when ``name`` is spelled as a Hub repo id (``NAME`` or ``NAMESPACE/NAME``, see above);
    a ``builtin:`` name never is. For names that only the Hub can mean (``push --repo-id``)."""
    return isinstance(name, str) and bool(_HUB_ID.match(name)) and "--" not in name and ".." not in name


def is_hub_id(name: str | os.PathLike | None) -> bool:
    """True when ``name`` is spelled as a Hub repo id (:func:`hub_id_syntax`) and is not an existing
    local path: the one rule for arguments that may be either."""
    if name is None:
        return False
    s = str(name)
    return hub_id_syntax(s) and not Path(s).expanduser().exists()


def is_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as huggingface_hub read it, or as set now."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(constants.is_offline_mode()) or env.upper() in _TRUE


def _looks_like_path(s: str) -> bool:
    """Clearly meant as a path (relative/absolute/home, or nested deeper than NAMESPACE/NAME)."""
    return s.startswith((".", "/", "~")) or s.count("/") > 1 or (os.sep != "/" and os.sep in s)


def resolve(
    model_or_artifact: str | os.PathLike,
    revision: str | None = None,
    allow_patterns: Sequence[str] | str | None = None,
    *,
    repo_type: str | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> Path:
    """A local directory holding ``model_or_artifact``.

    Args:
        model_or_artifact: a local directory, or a Hub id ``NAME`` / ``NAMESPACE/NAME``.
        revision: branch, tag or commit of a Hub id (None: ``main``). Not allowed with a directory.
        allow_patterns: only fetch the files matching these globs (e.g. :data:`ARTIFACT_PATTERNS` to
            read a sketch without its weights). Files already cached are not fetched again.
        repo_type: ``model`` (default), ``dataset`` or ``space``.
        cache_dir: the Hugging Face cache to use (default: ``HF_HUB_CACHE``).

    Returns:
        The directory: the argument itself, or the cached snapshot of the Hub revision.

    Raises:
        SketchcalError: a path that does not exist or is a file, a ``builtin:`` name, an argument that
            is neither a directory nor a Hub id, a repo or revision that does not exist, or a repo
            that is not in the cache while offline (``HF_HUB_OFFLINE=1``) or the Hub is unreachable.
    """
    s = str(model_or_artifact)
    if s.startswith("builtin:"):
        raise SketchcalError(f"{s} is a built-in model: it has no directory or Hub repo to read")
    local = Path(s).expanduser()
    if local.exists():
        if not local.is_dir():
            raise SketchcalError(f"{s} is a file; give a directory or a Hub id (NAMESPACE/NAME)")
        if revision is not None:
            raise SketchcalError(f"--revision {revision} applies to Hub ids only; {s} is a local directory")
        return local
    if _looks_like_path(s):
        raise SketchcalError(
            f"directory {s} does not exist; give a local directory or a Hub id (NAMESPACE/NAME)"
        )
    if not is_hub_id(s):
        raise SketchcalError(f"{s} is neither an existing directory nor a Hub id (NAMESPACE/NAME)")
    return _download(s, revision, allow_patterns, repo_type, cache_dir)


def _download(
    repo_id: str,
    revision: str | None,
    allow_patterns: Sequence[str] | str | None,
    repo_type: str | None,
    cache_dir: str | os.PathLike | None,
) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = is_offline()
    what = f"{repo_id}@{revision}" if revision else repo_id
    patterns = [allow_patterns] if isinstance(allow_patterns, str) else allow_patterns
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            repo_type=repo_type,
            allow_patterns=list(patterns) if patterns is not None else None,
            cache_dir=str(cache_dir) if cache_dir is not None else None,
            local_files_only=offline,
        )
    except GatedRepoError as err:
        raise SketchcalError(
            f"{repo_id} is gated: accept its terms on the Hub and log in (hf auth login or HF_TOKEN)"
        ) from err
    except RepositoryNotFoundError as err:
        raise SketchcalError(
            f"{repo_id} was not found on the Hub (if it is private, log in: hf auth login or HF_TOKEN)"
        ) from err
    except RevisionNotFoundError as err:
        raise SketchcalError(
            f"{repo_id} has no revision {revision!r}; check the branch, tag or commit"
        ) from err
    except LocalEntryNotFoundError as err:
        if offline:
            raise SketchcalError(
                f"{what} is not in the local Hugging Face cache and HF_HUB_OFFLINE=1; download it first "
                f"(hf download {repo_id}) or unset HF_HUB_OFFLINE"
            ) from err
        raise SketchcalError(
            f"cannot reach the Hub and {what} is not in the local Hugging Face cache; check the network "
            "or download it first"
        ) from err
    except HfHubHTTPError as err:
        status = getattr(getattr(err, "response", None), "status_code", "?")
        raise SketchcalError(f"the Hub refused to serve {what} (HTTP {status}); try again later") from err
    except ValueError as err:  # an invalid repo id or type
        raise SketchcalError(f"cannot fetch {what}: {str(err).splitlines()[0]}") from err
    return Path(path)
