"""Opt-in: ``push`` to the real Hugging Face Hub, then read the repo back.

Runs only when ``SKETCHCAL_TEST_HF_TOKEN`` holds a token with write access (skipped otherwise; a
plain ``HF_TOKEN`` is not enough, so an ordinary test run never creates repos on your account). It
creates a private repo ``<user>/sketchcal-test-<random>``, pushes a tiny converted model to it,
checks the files, the card and ``resolve`` of the Hub id, and deletes the repo.
"""

from __future__ import annotations

import os
import uuid

import pytest

TOKEN = os.environ.get("SKETCHCAL_TEST_HF_TOKEN")
pytestmark = pytest.mark.skipif(not TOKEN, reason="set SKETCHCAL_TEST_HF_TOKEN (a write token) to run")


def test_push_to_the_real_hub(tmp_path, monkeypatch):
    from huggingface_hub import HfApi, constants
    from test_hub import make_model_dir  # tests/ is on sys.path

    from sketchcal.artifact import read_sketch
    from sketchcal.hub import push, resolve

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    model_dir = make_model_dir(tmp_path)
    api = HfApi(token=TOKEN)
    repo = f"{api.whoami()['name']}/sketchcal-test-{uuid.uuid4().hex[:10]}"
    try:
        res = push(model_dir, repo, private=True)
        assert res.commit_oid and not res.dry_run
        assert api.model_info(repo).private
        remote = set(api.list_repo_files(repo))
        assert {f.path_in_repo for f in res.files} <= remote
        local = resolve(repo, cache_dir=tmp_path / "cache")
        assert (local / "README.md").read_text() == res.card
        assert read_sketch(local).fingerprint == read_sketch(model_dir).fingerprint
        assert len(api.list_repo_commits(repo)) == 2  # the repo's initial commit and ours
    finally:
        api.delete_repo(repo, missing_ok=True)
