"""The Hugging Face Hub: Hub ids wherever a directory is accepted, ``push``, and the lm-eval model.

Public API::

    resolve(model_or_artifact, revision=None, allow_patterns=None, *, repo_type=None,
            cache_dir=None) -> Path                  # a local dir, or a Hub id fetched into the HF cache
    is_hub_id(name) -> bool; is_offline() -> bool
    push(model_dir, repo_id, *, private=False, revision=None, dry_run=False, verify_report=None,
         base_model=None, commit_message=None, token=None, endpoint=None) -> PushResult
    print_push_result(result, console)              # the CLI's push output
    push_card(art, readme, verify=None, base_model=None) -> str   # the card push uploads

Modules: ``resolve``, ``push``, ``card``, and ``lm_eval_model`` (the ``sketchcal`` model of
lm-evaluation-harness; imported only on demand, it needs ``pip install 'sketchcal[eval]'``).
"""

from sketchcal.hub.card import find_verify_report, load_verify_report, push_card
from sketchcal.hub.push import PushResult, UploadFile, print_push_result, push
from sketchcal.hub.resolve import ARTIFACT_PATTERNS, STATS_PATTERNS, is_hub_id, is_offline, resolve

__all__ = [
    "ARTIFACT_PATTERNS",
    "STATS_PATTERNS",
    "PushResult",
    "UploadFile",
    "find_verify_report",
    "is_hub_id",
    "is_offline",
    "load_verify_report",
    "print_push_result",
    "push",
    "push_card",
    "resolve",
]
