"""sketchcal.hub: resolve (Hub ids, offline cache), the pushed model card, and push against a local Hub.

The upload path runs the real huggingface_hub client against a small HTTP server on 127.0.0.1
(:class:`FakeHub`) that implements what a one-commit upload of small files needs: create repo,
create branch, validate-yaml, preupload (every file "regular", so no LFS / xet) and commit. It
records every request; the tests check the commit's files and metadata. Nothing leaves the machine.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
import yaml

from sketchcal.errors import SketchcalError
from sketchcal.hub import push, push_card, resolve
from sketchcal.hub.card import load_verify_report, split_front_matter

TOKEN = "hf_QxZ7vN2pLk9RmT4wYb8sJc3dHf6gAe1u"
REPO = "acme/tiny-sketch"
ROOT = Path(__file__).resolve().parent.parent


# ---- a local stand-in for the Hub's upload API ---------------------------------------------------


class FakeHub:
    """Threaded HTTP server answering the Hub endpoints of a one-commit upload; records requests."""

    def __init__(self, token: str = TOKEN):
        self.token = token
        self.requests: list[dict[str, Any]] = []
        self.repos: dict[str, dict[str, Any]] = {}
        self.fail_commit: int | None = None  # answer commits with this status (and echo the token)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep pytest output clean
                pass

            def do_GET(self) -> None:
                hub._handle(self, "GET")

            def do_POST(self) -> None:
                hub._handle(self, "POST")

            def do_HEAD(self) -> None:
                hub._handle(self, "HEAD")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    # -- helpers ---------------------------------------------------------------------------------

    def paths(self) -> list[tuple[str, str]]:
        return [(r["method"], r["path"]) for r in self.requests]

    def commits(self) -> list[dict[str, Any]]:
        return [r["commit"] for r in self.requests if "commit" in r]

    @staticmethod
    def _body(h: BaseHTTPRequestHandler) -> bytes:
        if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(h.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    h.rfile.readline()
                    return out
                out += h.rfile.read(size)
                h.rfile.readline()
        return h.rfile.read(int(h.headers.get("Content-Length") or 0))

    @staticmethod
    def _send(
        h: BaseHTTPRequestHandler, status: int, obj: Any, headers: dict[str, str] | None = None
    ) -> None:
        data = json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        path = urlsplit(h.path).path
        body = self._body(h) if method == "POST" else b""
        rec: dict[str, Any] = {"method": method, "path": path, "auth": h.headers.get("Authorization")}
        self.requests.append(rec)
        if rec["auth"] != f"Bearer {self.token}":
            return self._send(h, 401, {"error": "Invalid credentials in Authorization header"})
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if method == "POST" and parts == ["api", "repos", "create"]:
            payload = json.loads(body)
            rec["json"] = payload
            repo_id = f"{payload['organization']}/{payload['name']}"
            url = f"{self.url}/{repo_id}"
            if repo_id in self.repos:
                return self._send(h, 409, {"error": "You already created this model repo", "url": url})
            self.repos[repo_id] = {"payload": payload, "branches": {"main": {}}}
            return self._send(h, 200, {"url": url, "name": repo_id})
        if method == "POST" and parts == ["api", "validate-yaml"]:
            rec["json"] = json.loads(body)
            return self._send(h, 200, {"errors": [], "warnings": []})
        if len(parts) >= 5 and parts[:2] == ["api", "models"]:
            repo_id, action, rest = f"{parts[2]}/{parts[3]}", parts[4], "/".join(parts[5:])
            repo = self.repos.get(repo_id)
            if repo is None:
                return self._send(h, 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            if method == "POST" and action == "branch":
                if rest in repo["branches"]:
                    return self._send(h, 409, {"error": "Reference already exists"})
                repo["branches"][rest] = dict(repo["branches"]["main"])
                return self._send(h, 200, {})
            if method == "POST" and action == "preupload":
                files = json.loads(body)["files"]
                rec["json"] = files
                modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                return self._send(h, 200, {"files": modes, "commitOid": "0" * 40})
            if method == "POST" and action == "commit":
                return self._commit(h, rec, repo_id, repo, rest, body)
        return self._send(h, 404, {"error": f"not implemented by the fake Hub: {method} {path}"})

    def _commit(self, h, rec, repo_id: str, repo: dict, branch: str, body: bytes) -> None:
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        header = next(x["value"] for x in lines if x["key"] == "header")
        files = {
            x["value"]["path"]: base64.b64decode(x["value"]["content"]) for x in lines if x["key"] == "file"
        }
        rec["commit"] = {"repo": repo_id, "branch": branch, "header": header, "files": files, "keys": lines}
        if self.fail_commit:  # a misbehaving server that echoes the credentials it was sent
            return self._send(h, self.fail_commit, {"error": f"storage failure for {rec['auth']}"})
        if branch not in repo["branches"]:
            return self._send(h, 404, {"error": "Invalid rev id"}, {"X-Error-Code": "RevisionNotFound"})
        repo["branches"][branch].update(files)
        oid = hashlib.sha1(body).hexdigest()
        self._send(
            h, 200, {"success": True, "commitOid": oid, "commitUrl": f"{self.url}/{repo_id}/commit/{oid}"}
        )


@pytest.fixture
def online(monkeypatch):
    """Let huggingface_hub make requests in this process (the tests run offline by default)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)


@pytest.fixture
def hub(online):
    with FakeHub() as fake:
        yield fake


# ---- a converted model directory ------------------------------------------------------------------


def make_model_dir(root: Path) -> Path:
    """A small converted model (tiny Qwen3-Next, synthetic statistics) whose base is a Hub id."""
    from synthetic_stats import gdn_layers, tiny_gdn_model, write_synthetic_stats

    from sketchcal.artifact import config_fingerprint, convert

    cfg = tiny_gdn_model(root / "base")
    stats = write_synthetic_stats(
        root / "stats",
        gdn_layers(cfg),
        fingerprint=config_fingerprint(root / "base"),
        model_id="acme/tiny-gdn-base",
        window=8,
    )
    convert(stats, rank=6, out=root / "model", model=root / "base")
    return root / "model"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("hub"))


def tree_digest(d: Path) -> dict[str, str]:
    """Every entry under ``d`` (hidden ones too) with the hash of its bytes and its mtime."""
    out = {}
    for p in sorted(d.rglob("*")):
        key = p.relative_to(d).as_posix()
        out[key] = (
            "dir" if p.is_dir() else f"{hashlib.sha256(p.read_bytes()).hexdigest()}:{p.stat().st_mtime_ns}"
        )
    return out


def verify_report(path: Path) -> Path:
    """A verify.json in the format ``sketchcal verify`` writes (VerifyResult.to_dict())."""

    def config(name, mode, group, kl, top1, ppl, rank, reduction):
        return {
            "name": name,
            "mode": mode,
            "group": group,
            "read_dtype": "fp32",
            "shared": False,
            "basis": None if mode != "sketch" else "state",
            "budget": None,
            "mean_rank": rank,
            "layer_mean_rank": {},
            "tokens": 512,
            "kl_mean": kl,
            "kl_p99": None if kl is None else 10 * kl,
            "top1_agreement": top1,
            "perplexity": ppl,
            "kl_by_position": [],
            "read_error": {"0": 0.01},
            "retrieval_accuracy": 0.75,
            "traffic": {} if reduction is None else {"reduction_vs_standard": reduction},
        }

    report = {
        "model_dir": "x",
        "model_id": "acme/tiny-gdn-base",
        "family": "gdn",
        "window": 8,
        "prompt": 32,
        "tokens": 128,
        "samples": 4,
        "data": {"source": "builtin"},
        "retrieval": None,
        "configs": [
            config("standard", "standard", "main", None, 1.0, 12.5, None, None),
            config("replay", "replay", "main", 0.0, 1.0, 12.5, None, 0.25),
            config("sketch", "sketch", "main", 0.0123, 0.97, 12.8, 6.0, 0.557),
        ],
        "command": "sketchcal verify model/",
        "notes": [],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report))
    return path


# ---- resolve ------------------------------------------------------------------------------------


def test_resolve_local_directories_and_bad_arguments(tmp_path, model_dir):
    assert resolve(model_dir) == model_dir
    assert resolve(str(model_dir)) == model_dir
    (tmp_path / "file.txt").write_text("x")
    cases = {
        str(model_dir): ("--revision dev applies to Hub ids only", "dev"),
        str(tmp_path / "missing"): ("does not exist", None),
        "./nowhere/at/all": ("does not exist", None),
        str(tmp_path / "file.txt"): ("is a file", None),
        "builtin:tiny-gdn": ("built-in model", None),
        "not a hub id": ("neither an existing directory nor a Hub id", None),
    }
    for arg, (msg, rev) in cases.items():
        with pytest.raises(SketchcalError, match=msg) as err:
            resolve(arg, revision=rev)
        assert "\n" not in str(err.value)


def test_hub_id_rule(tmp_path, monkeypatch):
    """One rule: NAME or NAMESPACE/NAME of ASCII letters, digits, '-', '_', '.', not an existing local
    path, not builtin:. ``hub_id_syntax`` is the spelling alone (for names only the Hub can mean)."""
    from sketchcal.hub.resolve import hub_id_syntax, is_hub_id

    good = ["gpt2", "acme/sk", "Qwen/Qwen3.5-4B", "a_b/c.d-e", "x/" + "a" * 96]
    bad = ["", "a/b/c", "builtin:tiny-gdn", "not a hub id", "-x/y", "x/y-", "x/.y", "a--b/c", "a..b", "é/x"]
    bad += ["x/" + "a" * 97, "./x", "/abs/path", "~/x"]
    for name in good:
        assert hub_id_syntax(name) and is_hub_id(name), name
    for name in bad:
        assert not hub_id_syntax(name) and not is_hub_id(name), name
    assert not is_hub_id(None)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme" / "sk").mkdir(parents=True)
    assert hub_id_syntax("acme/sk") and not is_hub_id("acme/sk")  # an existing local path wins


def fake_cache(cache: Path, repo_id: str, files: dict[str, str], ref: str = "main") -> Path:
    """A Hugging Face cache entry for ``repo_id`` (refs/<ref> → a snapshot holding ``files``)."""
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / commit
    for name, text in files.items():
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        (snap / name).write_text(text)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snap


def test_resolve_offline_uses_the_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = fake_cache(tmp_path / "cache", "acme/sk", {"config.json": "{}", "sketch/sketch.safetensors": "x"})
    got = resolve("acme/sk", cache_dir=tmp_path / "cache", allow_patterns=["config.json", "sketch/*"])
    assert got.resolve() == snap.resolve()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))  # the default cache location
    assert resolve("acme/sk").resolve() == snap.resolve()
    with pytest.raises(
        SketchcalError, match=r"acme/sk@dev is not in the local Hugging Face cache and HF_HUB_OFFLINE=1"
    ):
        resolve("acme/sk", revision="dev")
    with pytest.raises(SketchcalError, match="hf download acme/other"):
        resolve("acme/other")


def test_resolve_online_errors(tmp_path, online, monkeypatch):
    import socket

    from huggingface_hub import constants

    with socket.socket() as s:  # a local port nobody listens on: the Hub is unreachable
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(SketchcalError, match="cannot reach the Hub and acme/sk is not in the local"):
        resolve("acme/sk", cache_dir=tmp_path / "empty")
    snap = fake_cache(tmp_path / "cache", "acme/sk", {"config.json": "{}"})
    assert resolve("acme/sk", cache_dir=tmp_path / "cache").resolve() == snap.resolve()  # cache fallback
    with FakeHub() as fake:
        monkeypatch.setattr(constants, "ENDPOINT", fake.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
        with pytest.raises(SketchcalError, match="acme/missing was not found on the Hub"):
            resolve("acme/missing", cache_dir=tmp_path / "empty")
        assert fake.paths() == [("GET", "/api/models/acme/missing/revision/main")]


# ---- the model card -----------------------------------------------------------------------------


def test_card_with_and_without_verify(model_dir, tmp_path):
    from sketchcal.artifact import read_sketch

    art = read_sketch(model_dir)
    readme = (model_dir / "README.md").read_text()
    card = push_card(art, readme)
    fm, body = split_front_matter(card)
    assert fm["base_model"] == "acme/tiny-gdn-base" and fm["base_model_relation"] == "quantized"
    assert {"sketchcal", "sketchssm", "replayssm", "gdn", "hybrid"} <= set(fm["tags"])
    assert fm["sketchcal"]["verify"] == "not run" and fm["sketchcal"]["window"] == 8
    assert "## Verify" in body and "`sketchcal verify` was not run" in body
    assert "## Rank allocation" in body and "Accuracy of the whole model" not in body

    report = load_verify_report(verify_report(tmp_path / "verify.json"))
    card = push_card(art, readme, report, base_model="acme/other-base")
    fm, body = split_front_matter(card)
    assert fm["base_model"] == "acme/other-base"
    v = fm["sketchcal"]["verify"]
    assert v["kl_mean"] == pytest.approx(0.0123) and v["top1_agreement"] == pytest.approx(0.97)
    assert v["perplexity"] == 12.8 and v["perplexity_standard"] == 12.5
    assert "was not run" not in body and "| sketch | main | 6.00 | 0.0123 | 0.123 | 97.0% | 12.800 |" in body
    assert "perplexity 12.800 vs 12.500 standard (+2.40%)" in body
    assert body.index("## Verify") < body.index("## Rank allocation")
    assert push_card(art, card, report, base_model="acme/other-base") == card  # pushing a pulled card again
    yaml.safe_load(card.split("---")[1])  # valid YAML front matter

    with pytest.raises(SketchcalError, match="not a Hub id"):
        push_card(art, readme, base_model="./local/dir")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"configs": [{"name": "standard"}]}))
    with pytest.raises(SketchcalError, match="no 'sketch' configuration"):
        load_verify_report(bad)
    card = push_card(art, None)  # a directory without README.md still gets a card
    assert split_front_matter(card)[1].lstrip().startswith("# SketchSSM sketch of acme/tiny-gdn-base")


# ---- push ---------------------------------------------------------------------------------------


def test_push_dry_run_lists_files_and_sends_nothing(model_dir, hub, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    before = tree_digest(model_dir)
    res = push(model_dir, REPO, dry_run=True, endpoint=hub.url)
    assert res.dry_run and hub.requests == []
    listed = {f.path_in_repo: f.size for f in res.files}
    local = {
        p.relative_to(model_dir).as_posix(): p.stat().st_size for p in model_dir.rglob("*") if p.is_file()
    }
    assert listed.keys() == local.keys()
    assert all(listed[k] == local[k] for k in local if k != "README.md")
    assert listed["README.md"] == len(res.card.encode())
    assert any("verify was not run" in n for n in res.notes)
    assert tree_digest(model_dir) == before


def test_push_uploads_everything_in_one_commit(model_dir, hub, tmp_path):
    before = tree_digest(model_dir)
    report = verify_report(tmp_path / "elsewhere" / "verify.json")
    res = push(model_dir, REPO, private=True, verify_report=report, token=TOKEN, endpoint=hub.url)
    assert [p for p in hub.paths()] == [
        ("POST", "/api/repos/create"),
        ("POST", "/api/validate-yaml"),
        (("POST", f"/api/models/{REPO}/preupload/main")),
        ("POST", f"/api/models/{REPO}/commit/main"),
    ]
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in hub.requests)
    assert hub.requests[0]["json"] == {"name": "tiny-sketch", "organization": "acme", "visibility": "private"}
    (commit,) = hub.commits()
    files = commit["files"]
    for p in model_dir.rglob("*"):
        rel = p.relative_to(model_dir).as_posix()
        if p.is_file() and rel != "README.md":
            assert files[rel] == p.read_bytes(), rel
    assert files["verify/verify.json"] == report.read_bytes()
    card = files["README.md"].decode()
    assert card == res.card and hub.requests[1]["json"]["content"] == card
    fm, _ = split_front_matter(card)
    assert fm["base_model"] == "acme/tiny-gdn-base" and fm["sketchcal"]["verify"]["kl_mean"] == 0.0123
    assert set(files) == {f.path_in_repo for f in res.files}
    assert commit["header"]["summary"].startswith("Upload SketchSSM sketch (gdn, mean rank 6.00)")
    assert res.commit_oid and res.commit_url.endswith(res.commit_oid) and not res.dry_run
    assert tree_digest(model_dir) == before  # the card was uploaded from memory

    hub.requests.clear()  # again, to a new branch of the now existing repo
    push(model_dir, REPO, revision="dev", token=TOKEN, endpoint=hub.url, commit_message="second")
    assert hub.paths() == [
        ("POST", "/api/repos/create"),  # 409: exists, fine
        ("POST", f"/api/models/{REPO}/branch/dev"),
        ("POST", "/api/validate-yaml"),
        ("POST", f"/api/models/{REPO}/preupload/dev"),
        ("POST", f"/api/models/{REPO}/commit/dev"),
    ]
    (commit,) = hub.commits()
    assert commit["header"]["summary"] == "second" and "verify/verify.json" not in commit["files"]
    assert "was not run" in commit["files"]["README.md"].decode()


def test_push_validates_before_sending(model_dir, hub, tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text("{}")
    bad_report = tmp_path / "bad.json"
    bad_report.write_text("{not json")
    cases = [
        (dict(model_dir=tmp_path / "plain", repo_id=REPO), "no sketch_config section"),
        (dict(model_dir=tmp_path / "absent", repo_id=REPO), "is not a directory"),
        (dict(model_dir=model_dir, repo_id="no-namespace"), "NAMESPACE/NAME"),
        (dict(model_dir=model_dir, repo_id="acme/a/b"), "NAMESPACE/NAME"),
        (dict(model_dir=model_dir, repo_id=REPO, verify_report=bad_report), "not readable JSON"),
        (dict(model_dir=model_dir, repo_id=REPO, verify_report=tmp_path / "x.json"), "does not exist"),
        (dict(model_dir=model_dir, repo_id=REPO, base_model="not/a/hub/id"), "not a Hub id"),
    ]
    for kwargs, msg in cases:
        with pytest.raises(SketchcalError, match=msg) as err:
            push(token=TOKEN, endpoint=hub.url, **kwargs)
        assert "\n" not in str(err.value)
    assert hub.requests == []


def test_push_needs_a_token_and_the_network(model_dir, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SketchcalError, match="HF_HUB_OFFLINE=1"):
        push(model_dir, REPO, token=TOKEN)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "stored_tokens"))
    with pytest.raises(SketchcalError, match="no Hugging Face token"):
        push(model_dir, REPO)
    (tmp_path / "token").write_text(TOKEN)  # the login cache (hf auth login writes it)
    with FakeHub() as fake:
        push(model_dir, REPO, endpoint=fake.url)
        assert {r["auth"] for r in fake.requests} == {f"Bearer {TOKEN}"} and len(fake.commits()) == 1


def test_failed_upload_leaves_the_directory_untouched(model_dir, hub):
    before = tree_digest(model_dir)
    hub.fail_commit = 500
    with pytest.raises(SketchcalError) as err:
        push(model_dir, REPO, token=TOKEN, endpoint=hub.url)
    msg = str(err.value)
    assert "push to acme/tiny-sketch failed: HTTP 500" in msg and "unchanged" in msg
    assert TOKEN not in msg and "Bearer ***" in msg  # the echoed credentials are masked
    assert "\n" not in msg
    assert tree_digest(model_dir) == before
    hub.token = "hf_another"  # a rejected token
    hub.fail_commit = None
    with pytest.raises(SketchcalError, match=r"HTTP 401.*token is invalid"):
        push(model_dir, REPO, token=TOKEN, endpoint=hub.url)
    assert tree_digest(model_dir) == before


def _cli(args: list[str], endpoint: str, home: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_ENDPOINT=endpoint, HF_TOKEN=TOKEN, HF_HUB_OFFLINE="0", HF_HOME=str(home), COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "sketchcal", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_cli_dry_run_lists_every_file_with_its_size(model_dir, hub, monkeypatch):
    from typer.testing import CliRunner

    from sketchcal.cli import app

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("COLUMNS", "200")
    dry = CliRunner().invoke(app, ["push", str(model_dir), "--repo-id", REPO, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "dry run: would upload 8 files" in dry.output and hub.requests == []
    for p in model_dir.rglob("*"):
        if p.is_file() and p.name != "README.md":
            assert f"{p.stat().st_size:,} B  {p.relative_to(model_dir).as_posix()}" in dry.output
    assert "README.md  (model card, generated)" in dry.output and TOKEN not in dry.output


def test_cli_push_never_prints_the_token(model_dir, hub, tmp_path):
    """The real command in a subprocess, token in HF_TOKEN, against the local Hub: stdout and stderr."""
    before = tree_digest(model_dir)

    hub.fail_commit = 500  # the server echoes the token in its error
    failed = _cli(["push", str(model_dir), "--repo-id", REPO, "--private"], hub.url, tmp_path)
    assert failed.returncode == 2
    assert "error: push to acme/tiny-sketch failed: HTTP 500" in failed.stderr
    hub.fail_commit = None
    ok = _cli(["push", str(model_dir), "--repo-id", REPO, "--revision", "v1"], hub.url, tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "uploaded 8 files" in ok.stderr and f"{hub.url}/{REPO}/commit/" in ok.stderr
    assert hub.commits()[-1]["branch"] == "v1"
    assert any(r["auth"] == f"Bearer {TOKEN}" for r in hub.requests)  # the token was used ...
    for run in (failed, ok):  # ... and never shown
        assert TOKEN not in run.stdout + run.stderr
        assert TOKEN[-12:] not in run.stdout + run.stderr
    assert tree_digest(model_dir) == before
