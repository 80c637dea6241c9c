"""The claims registry (issue 70): a demo's claims, practical margins, regime gates, range and tuning rules, declared
in one file, lab/claims/<demo>.json, before the numbers they judge where that was possible and marked otherwise
(its "order"). Every results file the demo writes records the registry's fingerprint (its sha256, the file and
the commit that last changed it); tests/test_lab_registry.py fails when a committed results file was written
under another registry than today's, so no rule changes without the demo being rerun.

The rules the registry names (each registry states them again in its "rules"):
  scaled-effect   margin = 0.5 x the paper's effect scaled to the lab: the mean over the paper's backbones of
                  |paper effect| x |lab baseline effect| / |paper baseline effect| (the baseline's effect on the
                  claim's measure: the paper's from its table, the lab's the run's own, mean over its seeds)
  baseline-share  margin = 0.2 x |the lab baseline's own effect| on the claim's measure ('about equal' claims;
                  claims whose paper baseline effect changes sign, so no scale exists)
  paper-tie       the paper's own tie threshold (the claim that measures the baseline itself)
  gates           met when value - 2 se >= threshold, not met when value + 2 se < threshold, 'regime unclear'
                  otherwise (value and se over the calibration's pilot seeds, outside every seed set)
The registry is data, the verdict's code (lab.stats.verdict) is part of the fingerprint too: a change to either
is a change of the rules.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import subprocess
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from lab import stats

FOLDER = Path(__file__).resolve().parent / "claims"
ROOT = FOLDER.parents[1]
SCALED_SHARE = 0.5  # issue 70.3: a margin is at most half the paper's effect scaled to the lab
BASELINE_SHARE = 0.2  # issue 70.3: 20 % of the lab baseline's own effect where the paper prints no usable effect


def load(demo: str) -> dict:
    return json.loads((FOLDER / f"{demo}.json").read_text())


def sha256(demo: str) -> str:
    """The registry file's bytes and the verdict's source, hashed: what a results file was judged under."""
    code = inspect.getsource(stats.verdict)
    return hashlib.sha256((FOLDER / f"{demo}.json").read_bytes() + code.encode()).hexdigest()


def fingerprint(demo: str) -> dict:
    """{file, sha256, declared_in}: declared_in is the commit that last changed the file, or 'uncommitted' when the
    working tree's file differs from it (or git cannot tell: a copy without its history)."""
    path = (FOLDER / f"{demo}.json").relative_to(ROOT).as_posix()
    declared = "uncommitted"
    try:
        git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=30)  # noqa: E731
        changed = git("status", "--porcelain", "--", path)
        commit = git("log", "-1", "--format=%H", "--", path)
        if changed.returncode == 0 and not changed.stdout.strip() and commit.stdout.strip():
            declared = commit.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {"file": path, "sha256": sha256(demo), "declared_in": declared}


def lab_effect(spec: Sequence[str], runs: dict, base: dict) -> float:
    """[a, b, key]: the run's mean over seeds of a - b on key (b 'CLIP': the pretrained model)."""
    a, b, key = spec
    return float(np.mean(stats.paired(runs, a, b, key, base)))


def margin(spec: dict, runs: dict, base: dict, paper: Callable[[str, str], list[float]]) -> tuple[float, dict]:
    """A claim's practical margin by its registry rule, and the numbers it came from (kept in the claim).
    paper(variant, measure): that variant's number on the measure in the paper's table, one per backbone."""
    rule = spec["rule"]
    if rule == "paper-tie":
        return spec["value"], {"rule": rule, "value": spec["value"]}
    lab_base = lab_effect(spec["lab_baseline"], runs, base)
    if rule == "baseline-share":
        return BASELINE_SHARE * abs(lab_base), {"rule": rule, "lab_baseline": spec["lab_baseline"],
                                                "lab_baseline_effect": lab_base, "share": BASELINE_SHARE,
                                                **({"why": spec["why"]} if "why" in spec else {})}
    (a, b, measure), (pa, pb, pmeasure) = spec["paper"], spec["paper_baseline"]
    effect = np.subtract(paper(a, measure), paper(b, measure))
    paper_base = np.subtract(paper(pa, pmeasure), paper(pb, pmeasure))
    scaled = float(np.mean(np.abs(effect) * abs(lab_base) / np.abs(paper_base)))
    return SCALED_SHARE * scaled, {
        "rule": rule, "paper_effect": [round(float(x), 4) for x in effect], "paper": spec["paper"],
        "paper_baseline_effect": [round(float(x), 4) for x in paper_base], "paper_baseline": spec["paper_baseline"],
        "lab_baseline_effect": lab_base, "lab_baseline": spec["lab_baseline"], "scaled_effect": scaled,
        "share": SCALED_SHARE}


def gate(spec: dict, values: Sequence[float], measured: str) -> dict:
    """A gate from its pilot values (one per pilot seed): met / not met / None (regime unclear, within 2 se)."""
    mean, _, se = stats.paired_stats(values)
    lo, hi = mean - 2 * se, mean + 2 * se
    met = True if lo >= spec["threshold"] else False if hi < spec["threshold"] else None
    return {"needs": spec["needs"], "measured": measured, "met": met, "value": mean, "se": se,
            "threshold": spec["threshold"], "pilots": [float(v) for v in values], "source": spec["source"]}


def judge(demo: str, runs: dict, base: dict, paper: Callable[[str, str], list[float]],
          read_gate: Callable[[dict], dict]) -> Callable[[str], dict]:
    """judged(claim id) -> what lab.claim takes from registry `demo` for that claim: its margin by the registry's rule
    with the numbers it came from (margin, margin_source), its gate (read_gate(the gate's spec): registry.gate's dict,
    from the calibration record the spec names), its range rule, and its id (registry_id)."""
    reg = load(demo)
    spec = {c["id"]: c for c in reg["claims"]}
    gates = {name: read_gate(g) for name, g in reg["gates"].items()}

    def judged(key: str) -> dict:
        c, out = spec[key], {}
        if "margin" in c:
            out["margin"], out["margin_source"] = margin(c["margin"], runs, base, paper)
        if "gate" in c:
            out["gate"] = gates[c["gate"]]
        if "range_rule" in c:
            out |= {"interval": tuple(c["interval"]), "range_rule": c["range_rule"]}
        return {**out, "registry_id": key}
    return judged
