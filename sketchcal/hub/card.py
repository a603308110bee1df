"""The model card pushed to the Hub: convert's README.md, completed with the verify numbers.

The card is built in memory from the directory's README.md (front matter + body) and, when there
is one, the verify report (``verify.json`` as written by ``sketchcal verify``); the directory itself
is never modified. Front matter: ``base_model``, ``base_model_relation``, ``tags``, ``library_name``
and a machine-readable ``sketchcal`` block (family, window, mean rank, traffic, verify summary).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import yaml

from sketchcal.artifact.sketch import SketchArtifact
from sketchcal.errors import SketchcalError
from sketchcal.hub.resolve import hub_id_syntax

REQUIRED_TAGS = ("sketchcal", "sketchssm", "replayssm", "hybrid")
REPORT_CANDIDATES = ("verify/verify.json", "verify.json")
VERIFY_HEADING = "## Verify"
_PLACEHOLDER = re.compile(r"^Accuracy of the whole model .*?sketchcal verify.*$", re.MULTILINE)
_FRONT = re.compile(r"\A---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n|\Z)", re.DOTALL)


def find_verify_report(model_dir: str | Path) -> Path | None:
    """The verify report inside ``model_dir`` (``verify/verify.json``, else ``verify.json``), if any."""
    for rel in REPORT_CANDIDATES:
        p = Path(model_dir) / rel
        if p.is_file():
            return p
    return None


def load_verify_report(path: str | Path) -> dict[str, Any]:
    """Read and check a verify report; a one-line error when it is not one."""
    p = Path(path)
    try:
        report = json.loads(p.read_text())
    except FileNotFoundError:
        raise SketchcalError(f"verify report {p} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SketchcalError(f"verify report {p} is not readable JSON ({type(err).__name__})") from err
    configs = report.get("configs") if isinstance(report, dict) else None
    if not isinstance(configs, list) or not all(isinstance(c, dict) and "name" in c for c in configs):
        raise SketchcalError(
            f"{p} is not a sketchcal verify report (no 'configs' list); rerun sketchcal verify"
        )
    if not any(c["name"] == "sketch" for c in configs):
        raise SketchcalError(f"{p} has no 'sketch' configuration; rerun sketchcal verify")
    return report


def split_front_matter(text: str) -> tuple[dict[str, Any], str]:
    """(front matter as a dict, body). Missing or unparsable front matter gives ``{}``."""
    m = _FRONT.match(text)
    if not m:
        return {}, text
    try:
        data = yaml.safe_load(m.group(1)) or {}
    except yaml.YAMLError:
        data = {}
    return (data if isinstance(data, dict) else {}), text[m.end() :]


def _num(x: Any, fmt: str = ".3g") -> str:
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
        return "n/a"
    return format(x, fmt)


def _pct(x: Any) -> str:
    s = _num(x, ".1%")
    return s


def _config(report: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((c for c in report["configs"] if c.get("name") == name), None)


def verify_summary(report: dict[str, Any]) -> dict[str, Any]:
    """The numbers that go into the front matter: the ``sketch`` configuration against ``standard``."""
    sk = _config(report, "sketch") or {}
    std = _config(report, "standard") or {}
    out: dict[str, Any] = {
        "kl_mean": sk.get("kl_mean"),
        "kl_p99": sk.get("kl_p99"),
        "top1_agreement": sk.get("top1_agreement"),
        "perplexity": sk.get("perplexity"),
        "perplexity_standard": std.get("perplexity"),
        "retrieval_accuracy": sk.get("retrieval_accuracy"),
        "retrieval_accuracy_standard": std.get("retrieval_accuracy"),
        "traffic_reduction_vs_standard": (sk.get("traffic") or {}).get("reduction_vs_standard"),
        "tokens": report.get("tokens"),
        "samples": report.get("samples"),
    }
    return {k: v for k, v in out.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def verify_section(report: dict[str, Any] | None) -> str:
    """Markdown for the card's verify section (a 'not run' note without a report)."""
    if report is None:
        return (
            f"{VERIFY_HEADING}\n\n"
            "`sketchcal verify` was not run on this model before it was pushed, so this card has no "
            "accuracy numbers (next-token KL, top-1 agreement, perplexity, retrieval) for the sketch yet. "
            "Run `sketchcal verify DIR` and push again to add them.\n"
        )
    sk = _config(report, "sketch") or {}
    std = _config(report, "standard") or {}
    data = report.get("data") or {}
    lines = [
        VERIFY_HEADING,
        "",
        f"Measured by `sketchcal verify` on {report.get('samples', '?')} held-out samples"
        + (f" from `{data['source']}`" if data.get("source") else "")
        + f": {report.get('prompt', '?')} prefill tokens, then {report.get('tokens', '?')} teacher-forced "
        f"decode steps each (window L = {report.get('window', '?')}). KL is KL(standard ‖ config) of the "
        "next-token distributions in nats; top-1 is agreement with standard decoding.",
        "",
    ]
    ppl, ppl0 = sk.get("perplexity"), std.get("perplexity")
    change = ""
    if isinstance(ppl, (int, float)) and isinstance(ppl0, (int, float)) and ppl0 and math.isfinite(ppl0):
        change = f" ({(ppl / ppl0 - 1):+.2%})"
    lines += [
        f"- **sketch**: KL mean {_num(sk.get('kl_mean'))} (p99 {_num(sk.get('kl_p99'))}), top-1 agreement "
        f"{_pct(sk.get('top1_agreement'))}, perplexity {_num(ppl, '.3f')} vs {_num(ppl0, '.3f')} standard"
        f"{change}, retrieval {_pct(sk.get('retrieval_accuracy'))} vs {_pct(std.get('retrieval_accuracy'))}"
        f" standard; state traffic {_pct((sk.get('traffic') or {}).get('reduction_vs_standard'))} less than "
        "standard decoding",
        "",
        "| config | group | mean rank | KL mean | KL p99 | top-1 | perplexity | retrieval | traffic saved |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in report["configs"]:
        standard = c.get("mode") == "standard"
        rank = c.get("mean_rank")
        lines.append(
            "| "
            + " | ".join(
                [
                    str(c.get("name")),
                    str(c.get("group", "")),
                    "full" if rank is None else _num(rank, ".2f"),
                    "—" if standard else _num(c.get("kl_mean")),
                    "—" if standard else _num(c.get("kl_p99")),
                    "—" if standard else _pct(c.get("top1_agreement")),
                    _num(c.get("perplexity"), ".3f"),
                    _pct(c.get("retrieval_accuracy")),
                    "—" if standard else _pct((c.get("traffic") or {}).get("reduction_vs_standard")),
                ]
            )
            + " |"
        )
    if report.get("command"):
        lines += ["", "```", str(report["command"]), "```"]
    return "\n".join(lines) + "\n"


def _drop_section(body: str, heading: str) -> str:
    """Remove a ``## heading`` section (up to the next ``## `` heading) from ``body``."""
    pattern = re.compile(rf"^{re.escape(heading)}[ \t]*\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    return pattern.sub("", body)


def _insert_section(body: str, section: str) -> str:
    """Put ``section`` before the first ``## `` heading of ``body`` (at the end when there is none)."""
    m = re.search(r"^## ", body, re.MULTILINE)
    if m is None:
        return body.rstrip("\n") + "\n\n" + section
    return body[: m.start()] + section + "\n" + body[m.start() :]


def front_matter(
    existing: dict[str, Any], art: SketchArtifact, verify: dict[str, Any] | None, base_model: str | None
) -> dict[str, Any]:
    """The card's metadata: the existing keys, with base model, relation, tags and sketchcal block set."""
    cfg = art.config
    base_info = cfg.get("base_model") or {}
    fm: dict[str, Any] = dict(existing)
    fm.setdefault("library_name", "transformers")
    base = base_model or fm.get("base_model") or base_info.get("id")
    if hub_id_syntax(base):
        fm["base_model"] = base
        relation = "adapter" if base_info.get("weights") == "reference" else "quantized"
        fm["base_model_relation"] = fm.get("base_model_relation") or relation
    else:  # the Hub only accepts repo ids here: not paths, not builtin: names
        fm.pop("base_model", None)
        fm.pop("base_model_relation", None)
    tags = fm.get("tags")
    tags = [str(t) for t in tags] if isinstance(tags, list) else []
    for t in (*REQUIRED_TAGS, str(cfg.get("family", art.metadata.get("family", "")))):
        if t and t not in tags:
            tags.append(t)
    fm["tags"] = tags
    summary = cfg.get("summary") or {}
    block: dict[str, Any] = {
        "format_version": cfg.get("version"),
        "family": cfg.get("family"),
        "window": cfg.get("window"),
        "mean_rank": summary.get("mean_rank"),
        "traffic_reduction_vs_standard": summary.get("reduction_vs_standard"),
        "verify": verify_summary(verify) if verify is not None else "not run",
    }
    fm["sketchcal"] = {k: v for k, v in block.items() if v is not None}
    return fm


def push_card(
    art: SketchArtifact,
    readme: str | None,
    verify: dict[str, Any] | None = None,
    base_model: str | None = None,
) -> str:
    """The README.md to push: ``readme`` (convert's card, or None) with front matter and verify section set.

    Args:
        art: the directory's sketch (``read_sketch``), for family, window, base model and budget.
        readme: the directory's README.md text, if it has one.
        verify: a verify report (:func:`load_verify_report`); None: the card says verify was not run.
        base_model: a Hub id to record as ``base_model`` instead of the one the sketch names.
    """
    if base_model is not None and not hub_id_syntax(base_model):
        raise SketchcalError(f"--base-model {base_model!r} is not a Hub id (NAMESPACE/NAME)")
    existing, body = split_front_matter(readme or "")
    fm = front_matter(existing, art, verify, base_model)
    if not body.strip():
        base = fm.get("base_model") or (art.config.get("base_model") or {}).get("id") or "its base model"
        body = (
            f"# SketchSSM sketch of {base}\n\n"
            f"SketchSSM read sketches (window L = {art.config.get('window')}) calibrated with sketchcal; "
            "the sketch is in `sketch/sketch.safetensors` and the `sketch_config` section of `config.json`.\n"
        )
    body = _PLACEHOLDER.sub("", _drop_section(body, VERIFY_HEADING))
    body = re.sub(r"\n{3,}", "\n\n", _insert_section(body.lstrip("\n"), verify_section(verify)))
    head = yaml.safe_dump(fm, sort_keys=False, allow_unicode=True, default_flow_style=False)
    return f"---\n{head}---\n\n{body.rstrip()}\n"
