"""Issue 70 for GMC's demo (python gmc.py --demo, lab/claims/gmc.json): every margin records where it came from
and is at most half of Table 4's effect scaled to the lab by GMC's own effect of missing modalities (or 20 % of that
effect, for the claim that measures it); the gate has three pilots and its se. What every demo under the registry
checks: tests/test_lab_registry.py."""
import json
from pathlib import Path

import pytest

from lab import calibrate, registry
from lab.demos import gmc

DOCS = Path(__file__).resolve().parents[1] / "docs"
SEED_SETS = ("gmc-demo-results.json", "gmc-demo-heldout-results.json", "gmc-demo-fresh-results.json")


def load(name: str) -> dict:
    return json.loads((DOCS / name).read_text())


def test_the_papers_numbers_the_margins_read():
    """Table 4 by hand: GMC's partial accuracy (78.5 + 64.7 + 66.0 + 77.0 + 77.4 + 67.3) / 6 = 71.8167, so its
    cost of missing modalities 80.1 - 71.8167 = 8.2833; m2-Mix's partial gain (0.4 - 0.5 + 0.2 + 0.8 + 0.5 + 0.1)
    / 6 = 0.25; alignment x100, GMC with two modalities (7 + 8 + 5) / 3 against one (20 + 17 + 9) / 3."""
    partial = gmc.paper_number("GMC@partial", "acc")[0]
    assert gmc.paper_number("GMC@Full", "acc")[0] - partial == pytest.approx(8.28333, abs=1e-4)
    assert gmc.paper_number("GMC+m2-Mix@partial", "acc")[0] - partial == pytest.approx(0.25)
    two, one = gmc.paper_number("GMC@two", "align x100")[0], gmc.paper_number("GMC@one", "align x100")[0]
    assert two - one == pytest.approx(20 / 3 - 46 / 3)
    assert gmc.observed({"Full acc": 1.0}, "Full", "align x100") is None  # Table 4 has no Full alignment


@pytest.mark.parametrize("name", SEED_SETS)
def test_every_margin_records_its_source_and_stays_within_half_the_scaled_paper_effect(name):
    record = load(name)
    ids = [c["id"] for c in registry.load("gmc")["claims"]]
    again = gmc.claims(record["per_seed"])
    assert [c["registry_id"] for c in again] == ids == [c["registry_id"] for c in record["claims"]]
    for c, saved in zip(again, record["claims"]):
        assert c["margin"] == pytest.approx(saved["margin"]) and c["verdict"] == saved["verdict"], c["claim"]
        src = c["margin_source"]
        assert c["margin"] > 0, c["claim"]
        if src["rule"] == "scaled-effect":
            effect, paper_base = abs(src["paper_effect"][0]), abs(src["paper_baseline_effect"][0])  # 4 decimals kept
            assert src["scaled_effect"] == pytest.approx(effect * abs(src["lab_baseline_effect"]) / paper_base,
                                                         rel=1e-3)
            assert c["margin"] <= 0.5 * src["scaled_effect"] + 1e-12, c["claim"]
        else:  # GMC's own cost: 20 % of the lab baseline's effect, never a level
            assert src["rule"] == "baseline-share" and src["why"]
            assert c["margin"] == pytest.approx(0.2 * abs(src["lab_baseline_effect"]))
            assert src["lab_baseline"] == ["GMC@Full", "GMC@partial", "acc"]


def test_the_gate_has_three_pilots_its_se_its_source_and_the_ungated_verdict_beside():
    record = load("gmc-demo-results.json")
    gated = {c["registry_id"]: c for c in record["claims"] if "gate" in c}
    assert sorted(gated) == sorted(registry.load("gmc")["gates"]["missing-modalities-cost"]["applies_to"])
    for c in gated.values():
        gate = c["gate"]
        assert len(gate["pilots"]) == 3 and gate["se"] > 0 and "Table 4" in gate["source"]
        assert gate["met"] in (True, False, None)
        assert ("ungated" in c) == (gate["met"] is not True), c["claim"]
    pilots = calibrate.record("gmc-gate")["pilots"]
    assert [p["cost"] for p in pilots.values()] == next(iter(gated.values()))["gate"]["pilots"]
