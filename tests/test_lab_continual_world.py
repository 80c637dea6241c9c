"""Issue 71.1: the continual world's calibrations (python -m lab.calibrate continual-world, -2, -3) and the tuning
rule in the world they chose (cclip-floor-2), read back from their committed records: each record's choice follows
from its own pilot numbers by its declared rule, each grid ran in its declared order and stopped where declared, no
calibration reused an earlier one's pilot seeds or a demo's seeds, and C-CLIP's demo runs what they chose."""
import math

import numpy as np
import pytest

import lab
from lab import calibrate, registry
from lab.demos import cclip

WORLDS = {"continual-world": (calibrate.GATE_PILOTS, "every pilot", (None,)),
          "continual-world-2": (calibrate.WORLD_PILOTS, "pilot mean", (None,)),
          "continual-world-3": (calibrate.WORLD_PILOTS_3, "pilot mean", calibrate.WORLD_STEPS_3)}


def gate_met(ratios) -> bool:
    """The registry's forgetting gate by hand: mean - 2 se of the pilots' ratios >= the threshold."""
    mean, se = np.mean(ratios), np.std(ratios, ddof=1) / math.sqrt(len(ratios))
    return mean - 2 * se >= registry.load("cclip")["gates"]["forgetting"]["threshold"]


@pytest.mark.parametrize("name", sorted(WORLDS))
def test_each_world_calibration_chose_by_its_declared_rule(name):
    pilots, floor, steps = WORLDS[name]
    rec = calibrate.record(name)
    order = [(s, k) for s in steps for k in calibrate.CONFLICT_GRID]  # cost, then strength ascending
    ran = [(r.get("steps"), r["strength"]) for r in rec["grid"]]
    assert ran == order[:len(ran)], "the grid's declared order"
    first = None
    for row in rec["grid"]:
        assert sorted(row["pilots"]) == [str(p) for p in pilots]
        gains = np.array([p["check"]["learned per task"] for p in row["pilots"].values()])  # pilot x task
        ratios = [-p["check"]["BWT"] / np.mean(g) for p, g in zip(row["pilots"].values(), gains)]
        assert [p["ratio"] for p in row["pilots"].values()] == pytest.approx(ratios)
        learns = (gains.min() if floor == "every pilot" else gains.mean(0).min()) >= calibrate.LEARNS - calibrate.TOL
        assert row["passes"] == (learns and gate_met(ratios)), row["strength"]
        first = first or (row if row["passes"] else None)
    assert rec["chosen"] == (first and first["strength"])
    if name == "continual-world":
        assert len(ran) == len(order)  # every strength ran (its declaration)
    else:  # -2, -3 stop at the first that passes
        assert first is None and len(ran) == len(order) or rec["grid"][-1] is first


def test_no_world_calibration_reused_pilots_or_a_demos_seeds():
    sets = [set(p) for p, _, _ in WORLDS.values()]
    assert all(not (a & b) for i, a in enumerate(sets) for b in sets[i + 1:])
    demo_seeds = set(range(0, 5)) | set(range(10, 15)) | set(range(30, 35))
    assert not set().union(*sets) & demo_seeds and set(lab.SEEDS) <= demo_seeds


def test_the_demo_runs_the_world_and_knobs_that_were_chosen():
    name, rec = calibrate.conflict_world_record()
    world = cclip.WORLDS["conflict"]
    assert (world["conflict"], world["steps"]) == (rec["chosen"], rec.get("steps") or 30)
    assert registry.load("cclip")["gates"]["forgetting"]["record"] == name
    floor = calibrate.record("cclip-floor-2")
    assert (floor["world"], floor["strength"], floor["steps"]) == (name, world["conflict"], world["steps"])
    assert floor["chosen"]["lora"] == world["lora"] == cclip.DEMO_LORA
    for b in ("zscl", "lwf", "ewc"):
        assert floor["chosen"][b] == world["baselines"][b] == cclip.CHOSEN_BASELINES[b], b
    shared = cclip.WORLDS["shared"]  # the domains as drawn: issue 70.5's knobs, 30 steps, cclip-gates' pilots
    assert shared["conflict"] == 0.0 and shared["steps"] == calibrate.record("cclip-long-2")["chosen"]["steps"]
    assert shared["lora"] == calibrate.record("cclip-floor")["chosen"]["lora"]


@pytest.mark.parametrize("variant", sorted(calibrate.FLOOR_2_ORDERS))
def test_cclip_floor_2_took_each_knob_by_the_one_rule(variant):
    """In the knob's order from the least-changing setting, two at a time, stopping after the pair that holds the
    first setting learning every task by >= 5 R@1; none: the one whose worst task learned most."""
    rows = calibrate.record("cclip-floor-2")["grid"][variant]
    order = calibrate.FLOOR_2_ORDERS[variant]
    knob = [r["setting"] for r in rows] if variant == "lora" else [r["weight"] for r in rows]
    if variant == "lora":
        steps = calibrate.record("cclip-floor-2")["steps"]
        assert knob == [{**o, "steps": steps} for o in order[:len(rows)]]
    else:
        assert knob == list(order[:len(rows)])
    learns = [min(r["check"]["learned per task"]) >= 5 - calibrate.TOL for r in rows]
    assert [r["check"]["learns"] for r in rows] == learns
    first = learns.index(True) if True in learns else None
    assert len(rows) == (len(order) if first is None else min(len(order), 2 * (first // 2 + 1)))
    pick = rows[first] if first is not None else max(rows, key=lambda r: min(r["check"]["learned per task"]))
    chosen = calibrate.record("cclip-floor-2")["chosen"][variant]
    if variant == "lora":
        assert chosen == {k: pick["setting"][k] for k in chosen} and "steps" not in chosen
    else:
        assert chosen == calibrate._baseline_knob(variant, pick["weight"])


def test_a_bad_world_is_one_clear_message(capsys):
    with pytest.raises(SystemExit, match="--world 'mixed': one of conflict, shared"):
        cclip.main(["--world", "mixed"])


@pytest.mark.parametrize("name", ["continual-world-2", "continual-world-3"])
def test_the_grid_code_replays_its_committed_record(monkeypatch, name):
    """calibrate_continual_world_2 / _3 fed their records' own rows (no training) ask for them in the recorded order,
    stop where the record stops and return the record's every field but main()'s."""
    rec = calibrate.record(name)
    rows, asked = iter(rec["grid"]), []

    def row(data_root, out, strength, *args):
        asked.append(strength)
        return next(rows)
    monkeypatch.setattr(calibrate, "_forgetting_pilots", row)
    out = calibrate.CALIBRATIONS[name]()
    assert asked == [r["strength"] for r in rec["grid"]]
    assert set(rec) - set(out) == {"demo", "machine", "pilot_seed", "rule", "seconds"}
    assert all(out[k] == rec[k] for k in out if k != "grid") and len(out["grid"]) == len(rec["grid"])
