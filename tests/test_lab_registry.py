"""Issue 70: the claims registry. A committed results file of a demo under the registry was written under today's
registry (its sha256), so no rule changes without the demo being rerun; every margin records where it came from
and is at most half the paper's effect scaled to the lab; gates carry their se and the verdict without them."""
import json
import shutil
from pathlib import Path

import pytest

import lab
from lab import registry
from lab.demos import erclip

DOCS = Path(__file__).resolve().parents[1] / "docs"
UNDER_REGISTRY = {"erclip": ("erclip-demo-results.json", "erclip-demo-heldout-results.json",
                             "erclip-demo-fresh-results.json")}
STABILITY_RERUNS = {"erclip": ("erclip-demo-ulp-results.json", "erclip-demo-2threads-results.json")}


@pytest.mark.parametrize("demo", sorted(UNDER_REGISTRY))
def test_committed_results_were_judged_under_todays_registry(demo):
    today = registry.sha256(demo)
    for name in UNDER_REGISTRY[demo] + STABILITY_RERUNS[demo]:
        record = json.loads((DOCS / name).read_text())
        assert record["registry"]["sha256"] == today, f"{name}: written under another registry; rerun the demo"
        assert record["registry"]["declared_in"] != "uncommitted", name  # the rules were committed before the run


def test_the_fresh_seeds_are_new_and_ran_after_the_registry():
    record = json.loads((DOCS / "erclip-demo-fresh-results.json").read_text())
    assert record["seeds"] == [30, 31, 32, 33, 34]
    used = {s for name in ("erclip-demo-results.json", "erclip-demo-heldout-results.json")
            for s in json.loads((DOCS / name).read_text())["seeds"]}
    assert not used & set(record["seeds"])


def test_a_changed_rule_changes_the_fingerprint(tmp_path, monkeypatch):
    shutil.copy(registry.FOLDER / "erclip.json", tmp_path / "erclip.json")
    monkeypatch.setattr(registry, "FOLDER", tmp_path)
    before = registry.sha256("erclip")
    spec = json.loads((tmp_path / "erclip.json").read_text())
    spec["claims"][1]["margin"]["value"] = 0.5
    (tmp_path / "erclip.json").write_text(json.dumps(spec))
    assert registry.sha256("erclip") != before


def test_every_margin_records_its_source_and_stays_within_half_the_scaled_paper_effect():
    for name in UNDER_REGISTRY["erclip"]:
        record = json.loads((DOCS / name).read_text())
        for c in erclip.demo_claims(record["base"], record["per_seed"]):
            if c["direction"] == "range":
                assert c["range_rule"] == "mean-inside"
                continue
            src = c["margin_source"]
            assert c["margin"] > 0, c["claim"]
            if src["rule"] == "scaled-effect":
                assert c["margin"] <= 0.5 * src["scaled_effect"] + 1e-12, c["claim"]
                assert src["paper_effect"] and src["paper_baseline_effect"], c["claim"]
            elif src["rule"] == "paper-tie":  # ERCLIP's one point, at most half the smallest paper effect
                paper = registry.load("erclip")["claims"][1]["margin"]["paper"]
                effects = [abs(x - y) for x, y in zip(erclip.paper_number(paper[0], paper[2]),
                                                      erclip.paper_number(paper[1], paper[2]))]
                assert c["margin"] <= 0.5 * min(effects), c["claim"]
            else:
                assert src["rule"] == "baseline-share"
                assert c["margin"] == pytest.approx(0.2 * abs(src["lab_baseline_effect"]))


def test_a_scaled_margin_is_half_the_papers_effect_times_the_labs_baseline_over_the_papers():
    runs = {"M": [{"x": 4.0}, {"x": 6.0}], "M+P": [{"x": 6.0}, {"x": 8.0}]}
    base = {"x": 0.0}
    paper = {("M+P", "m"): [12.0, 20.0], ("M", "m"): [10.0, 10.0], ("CLIP", "m"): [0.0, 5.0]}
    spec = {"rule": "scaled-effect", "paper": ["M+P", "M", "m"], "paper_baseline": ["M", "CLIP", "m"],
            "lab_baseline": ["M", "CLIP", "x"]}
    m, src = registry.margin(spec, runs, base, lambda v, k: paper[(v, k)])
    # paper effects 2 and 10, paper baseline 10 and 5, lab baseline 5: (2 x 5 / 10 + 10 x 5 / 5) / 2 = 5.5
    assert src["scaled_effect"] == pytest.approx(5.5) and m == pytest.approx(2.75)
    m, src = registry.margin({"rule": "baseline-share", "lab_baseline": ["M", "CLIP", "x"]}, runs, base, None)
    assert m == pytest.approx(1.0) and src["lab_baseline_effect"] == pytest.approx(5.0)


def test_a_gate_within_two_se_of_its_threshold_is_unclear_and_the_ungated_verdict_is_kept():
    spec = {"needs": "n", "threshold": 1 / 3, "source": "s"}
    assert registry.gate(spec, [0.5, 0.52, 0.54], "m")["met"] is True
    assert registry.gate(spec, [0.1, 0.12, 0.14], "m")["met"] is False
    unclear = registry.gate(spec, [0.2, 0.35, 0.5], "m")
    assert unclear["met"] is None and unclear["se"] > 0
    c = lab.claim("c", "+", [3.0, 3.1, 2.9], "+", margin=1.0, gate=unclear)
    assert c["verdict"] == "regime unclear" and c["ungated"] == "reproduced"
    c = lab.claim("c", "+", [3.0, 3.1, 2.9], "+", margin=1.0, gate=registry.gate(spec, [0.1, 0.12, 0.14], "m"))
    assert c["verdict"] == "outside the lab's regime" and c["ungated"] == "reproduced"
    assert "without the gate: reproduced" in lab.claims_table([c])


def test_the_mean_inside_range_rule():
    inside, straddling, outside = [35.0, 45.0, 40.0], [38.0, 48.0, 58.0], [60.0, 61.0, 62.0]
    assert lab.verdict(inside, "range", interval=(30, 42), range_rule="mean-inside") == "reproduced"
    assert lab.verdict(straddling, "range", interval=(30, 42), range_rule="mean-inside") == "not resolved"
    assert lab.verdict(straddling, "range", interval=(30, 42)) == "reproduced"  # 'overlap', the other demos'
    assert lab.verdict(outside, "range", interval=(30, 42), range_rule="mean-inside") == "opposite"


def test_the_docs_tables_print_the_margins_sources_and_the_three_seed_sets():
    from lab import report
    paths = [DOCS / name for name in UNDER_REGISTRY["erclip"]]
    record = json.loads(paths[0].read_text())
    margins = report.margins_markdown(paths[0]).splitlines()
    assert len(margins) == 2 + len(record["claims"])
    assert all(f"{c['margin']:.3g} |" in row for c, row in zip(record["claims"], margins[2:]) if "margin" in c)
    seeds = report.heldout_markdown(*paths).splitlines()
    assert seeds[0].startswith("| claim | seeds 0-4 | verdict | seeds 10-14 | verdict | seeds 30-34 | verdict |")
    assert len(seeds) == 2 + len(record["claims"])
