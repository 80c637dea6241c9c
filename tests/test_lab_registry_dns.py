"""Issue 70, DNS (python dns.py --demo, lab/demos/dns.py) under the claims registry (lab/claims/dns.json): every
committed results file of the demo was written under today's registry, committed before the run; every margin
records the numbers it came from and is at most half CMCL's DNS - vanilla scaled to the lab by vanilla's forgetting
(or 20 % of the lab vanilla's forgetting / drift where the paper prints no number); the fresh seeds 30-34 had never
been run by the demo."""
import json
import subprocess
from pathlib import Path

import pytest

from lab import registry
from lab.demos import dns
from papers import cmcl

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
UNDER_REGISTRY = ("dns-demo-results.json", "dns-demo-heldout-results.json", "dns-demo-fresh-results.json")
STABILITY_RERUN = "dns-demo-1thread-results.json"
FRESH = "dns-demo-fresh-results.json"


def record(name: str) -> dict:
    return json.loads((DOCS / name).read_text())


def judge(runs: dict) -> list[dict]:  # the demo's claims as run_demo makes them
    return dns.demo_claims(runs, (dns._paper_gain(3), dns._paper_gain(2)), reg=dns.REGISTRY)


@pytest.mark.parametrize("name", UNDER_REGISTRY + (STABILITY_RERUN,))
def test_committed_results_were_judged_under_todays_registry(name):
    r = record(name)
    assert r["registry"]["file"] == "lab/claims/dns.json"
    assert r["registry"]["sha256"] == registry.sha256("dns"), f"{name}: written under another registry; rerun"
    assert r["registry"]["declared_in"] != "uncommitted", name  # the rules were committed before the run
    assert [c["registry_id"] for c in r["claims"]] == [c["id"] for c in registry.load("dns")["claims"]]


def test_declared_in_is_a_commit_of_this_history_that_changed_the_registry():
    declared = record(UNDER_REGISTRY[0])["registry"]["declared_in"]
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)  # noqa: E731
    if git("rev-parse", "--git-dir").returncode:
        pytest.skip("a copy without its git history")
    assert git("cat-file", "-e", f"{declared}^{{commit}}").returncode == 0, declared
    assert "lab/claims/dns.json" in git("show", "--name-only", "--format=", declared).stdout
    for commit in git("log", "--format=%H", "--", f"docs/{FRESH}").stdout.split():  # never before the registry
        assert git("merge-base", "--is-ancestor", declared, commit).returncode == 0, commit


@pytest.mark.parametrize("name", UNDER_REGISTRY + (STABILITY_RERUN,))
def test_committed_verdicts_and_margins_follow_from_the_committed_numbers(name):
    r = record(name)
    again = judge(r["per_seed"])
    assert [c["claim"] for c in again] == [c["claim"] for c in r["claims"]]
    for new, old in zip(again, r["claims"]):
        assert new["verdict"] == old["verdict"], (name, new["claim"])
        assert new["margin"] == pytest.approx(old["margin"]), (name, new["claim"])


@pytest.mark.parametrize("name", UNDER_REGISTRY)
def test_every_margin_records_its_source_and_stays_within_half_the_scaled_paper_effect(name):
    r = record(name)
    for c in r["claims"]:
        src = c["margin_source"]
        assert c["margin"] > 0, c["claim"]
        a, b, key = src["lab_baseline"]
        assert (a, b) == ("vanilla", "CLIP") and key in ("BWT_A", "BWT_R@1", "BWT_R@10", "drift %"), c["claim"]
        lab_base = sum(s[key] for s in r["per_seed"]["vanilla"]) / len(r["per_seed"]["vanilla"])
        assert src["lab_baseline_effect"] == pytest.approx(lab_base)  # vanilla's own forgetting: an effect
        if src["rule"] == "scaled-effect":
            (pa, pb, measure), (qa, qb, qkey) = src["paper"], src["paper_baseline"]
            assert (pa, pb, qa, qb) == ("DNS", "vanilla", "vanilla", "CLIP") and qkey == key, c["claim"]
            col = dns.PAPER_COLUMNS.index(measure)
            effect = [cmcl.CMCL_PAPER[f"{bb} DNS"][col] - cmcl.CMCL_PAPER[f"{bb} vanilla"][col]
                      for bb in ("ImageBind", "LanguageBind")]
            forgetting = [cmcl.CMCL_PAPER[f"{bb} vanilla"][dns.PAPER_COLUMNS.index(key)]
                          for bb in ("ImageBind", "LanguageBind")]
            assert src["paper_effect"] == pytest.approx(effect, abs=1e-4)
            assert src["paper_baseline_effect"] == pytest.approx(forgetting, abs=1e-4)
            scaled = sum(abs(e) * abs(lab_base) / abs(f) for e, f in zip(effect, forgetting)) / 2
            assert src["scaled_effect"] == pytest.approx(scaled, rel=1e-4)
            assert c["margin"] <= 0.5 * scaled + 1e-9, c["claim"]
        else:  # no paper number on R@1, the drift, or the baselines: 20 % of vanilla's own, and it says why
            assert src["rule"] == "baseline-share" and src["why"], c["claim"]
            assert c["margin"] == pytest.approx(0.2 * abs(lab_base))


def test_the_fresh_seeds_are_new():
    fresh = record(FRESH)["seeds"]
    assert fresh == registry.load("dns")["fresh_seeds"] == [30, 31, 32, 33, 34]
    used = {s for name in UNDER_REGISTRY[:2] + (STABILITY_RERUN,) for s in record(name)["seeds"]}
    used |= {json.loads((DOCS / f"calibration-dns-{k}.json").read_text())["pilot_seed"]
             for k in ("2", "zscl", "lwf", "ewc")}
    assert not used & set(fresh)


def test_the_docs_print_the_margins_and_the_three_seed_sets():
    from lab import report
    paths = [DOCS / name for name in UNDER_REGISTRY]
    text = (DOCS / "dns.md").read_text()
    assert report.margins_markdown(paths[0]) in text
    seeds = report.heldout_markdown(*paths)
    assert seeds.splitlines()[0].startswith("| claim | seeds 0-4 | verdict | seeds 10-14 | verdict | seeds 30-34 |")
    assert seeds in text
