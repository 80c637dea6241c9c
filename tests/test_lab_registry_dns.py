"""Issue 70, DNS's two demos (python dns.py --demo and --demo-cmcl, lab/demos/dns.py) under the claims registry
(lab/claims/dns.json, lab/claims/dns-cmcl.json): every margin records the numbers it came from and is at most half
CMCL's DNS - vanilla scaled to the lab by vanilla's forgetting (or 20 % of the lab vanilla's forgetting / drift where
the paper prints no number). What every demo under the registry checks: tests/test_lab_registry.py."""
import json
from pathlib import Path

import pytest

from lab.demos import dns
from papers import cmcl

DOCS = Path(__file__).resolve().parents[1] / "docs"
UNDER_REGISTRY = tuple(f"{demo}{kind}-results.json" for demo in ("dns-demo", "dns-cmcl-demo")
                       for kind in ("", "-heldout", "-fresh"))


def record(name: str) -> dict:
    return json.loads((DOCS / name).read_text())


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
