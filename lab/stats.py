"""The lab's statistics: seeds fixed in advance, paired differences, verdicts,
claims, and the report every demo writes (with the machine it ran on).

Statistics
----------
Every demo runs the same seeds, fixed in advance (SEEDS), from the same
pretrained weights; a claim is a paired (same-seed) difference. With n seeds,
mean d and standard deviation s of the per-seed differences, se = s / sqrt(n):
  reproduced     d has the paper's sign and |d| > 2 se
  opposite       d has the other sign and |d| > 2 se
  not resolved   otherwise
A claim that two variants are "about equal" is reproduced when the whole
interval d +- 2 se lies inside +-margin (stated with the claim), opposite when
|d| - 2 se > margin, and not resolved otherwise. A claim that a quantity lies
in the paper's range [lo, hi] is reproduced when d +- 2 se overlaps it,
opposite when the interval lies beyond 0 on the other side, and not resolved
otherwise (for example: clearly positive but below the range). A comparison
the code makes equal (RT+P against M+P at the encoders' lr) is marked 'by
construction', with why, and is never counted as reproduced. Every seed's
number is kept.

Since issue 58, declared before any run they govern (docs/lab.md, "Statistics"):
  practical margin  a '+' / '-' claim may carry margin m (the paper's own tie
                    threshold where it states one): when |d| < m the verdict is
                    'about equal' if the whole d +- 2 se lies inside +-m, else
                    'not resolved'; never reproduced or opposite
  regime gate       a claim may name the regime it needs and a val check of it
                    on the baseline, measured before the seeds ran (a
                    calibration record); when the check fails the verdict is
                    'outside the lab's regime', with the measured numbers
  diagnosis         a verdict against its paper carries one line backed by a
                    number the run or the calibration measured
  margins' sizes    the paper's tie threshold where it states one (ERCLIP's
                    one point); otherwise EFFECT_SHARE (10 %) of the baseline's
                    own effect on the claim's measure, mean over the run's
                    seeds (EQUAL_SHARE, 20 %, for an 'about equal' claim); a
                    claim that measures the baseline's effect itself (FT -
                    CLIP) takes ERCLIP's one point (FIELD_MARGIN)
Since issue 70, a demo under the claims registry (lab/registry.py, lab/claims/) takes its margins (from the
paper's effects, never from levels), gates (with their se: met, not met or 'regime unclear') and range rule
from there; every gated claim keeps its verdict without the gate beside ('ungated').
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

import common
from plumbing.base import UsageError, markdown_table
from plumbing.runfolder import machine_info

# =============================================================================
# 5. Seeds, paired statistics, claims
# =============================================================================
SEEDS = (0, 1, 2, 3, 4)  # fixed in advance (0-2 before the first demo; 3, 4 before the regime of issue 24 ran)
_current = list(SEEDS)


# torch threads per job of lab.run_jobs: 1, so a job's numbers do not depend on the machine's cores.
# CLIPFT_JOB_THREADS=2 is the float-rounding perturbation of issue 39's stability check (lab/stability.py), never a
# demo's setting.
JOB_THREADS = int(os.environ.get("CLIPFT_JOB_THREADS", "1"))


def seeds() -> tuple[int, ...]:
    """The seeds a demo runs: SEEDS, or those its --seeds flag named."""
    return tuple(_current)


def take_flag(argv: Sequence[str], flag: str) -> tuple[list[str], str | None]:
    """(argv without `flag VALUE` / `flag=VALUE`, the value or None): a demo's
    own flags, taken off before the method's Config parses the rest."""
    argv, rest, value = list(argv), [], None
    while argv:
        a = argv.pop(0)
        if a == flag or a.startswith(flag + "="):
            value = a.partition("=")[2] if "=" in a else (argv.pop(0) if argv else "")
        else:
            rest.append(a)
    return rest, value


def take_seeds_flag(argv: Sequence[str]) -> list[str]:
    """Takes `--seeds 10,11,12` (or --seeds=...) off a demo's command line and
    makes seeds() return them, so anyone can rerun the claims on seeds nobody
    has seen; the verdict rule stays. Returns the other arguments."""
    rest, value = take_flag(argv, "--seeds")
    if value is not None:
        try:
            picked = [int(x) for x in value.split(",") if x.strip()]
        except ValueError:
            picked = []
        if len(picked) < 2 or len(set(picked)) != len(picked):
            raise UsageError(f"--seeds {value!r}: give two or more different integers, e.g. --seeds 10,11,12 "
                                    f"(a verdict needs a standard error)")
        _current[:] = picked
    else:
        _current[:] = SEEDS
    return rest


EFFECT_SHARE = 0.10  # issue 58.3 (module docstring): a '+' / '-' margin is 10 % of the baseline's own effect
EQUAL_SHARE = 0.20  # an 'about equal' claim's: 20 % (the example: of full FT's per-task gain)
FIELD_MARGIN = 1.0  # points: ERCLIP's tie threshold (its Sec. 4, Implementation), for the baseline's own effect


def effect_margin(effect: Sequence[float], share: float = EFFECT_SHARE) -> float:
    """A claim's practical margin: share x |mean over seeds of the baseline's own effect| on its measure."""
    return share * abs(float(np.mean(effect)))


def mean_over_seeds(runs: dict, name: str, key: str) -> float:
    """runs[name]'s key, mean over its seeds (the numbers a diagnosis line quotes)."""
    return float(np.mean([r[key] for r in runs[name]]))


def diagnosed(claims: list[dict], lines: dict) -> list[dict]:
    """Issue 58.7: each claim whose verdict goes against its paper (not reproduced, by construction or outside the
    regime) gets lines[its position], a line measured by the run or a calibration (written before the seeds ran)."""
    settled = ("reproduced", "by construction", "outside the lab's regime")
    return [c | ({"diagnosis": lines[i]} if c["verdict"] not in settled and lines.get(i) else {})
            for i, c in enumerate(claims)]


def paired(runs: dict, a: str, b: str, key: str, base: dict | None = None) -> list[float]:
    """Per-seed paired differences runs[a][i][key] - runs[b][i][key]; a b that
    is not in runs (the pretrained model) means `base`, the same for every seed."""
    other = runs[b] if b in runs else [base] * len(runs[a])
    return [x[key] - y[key] for x, y in zip(runs[a], other)]


def paired_stats(diffs: Sequence[float]) -> tuple[float, float, float]:
    """(mean, sample std, standard error) of per-seed paired differences."""
    d = np.asarray(diffs, dtype=float)
    std = float(d.std(ddof=1)) if len(d) > 1 else float("nan")
    return float(d.mean()), std, std / math.sqrt(len(d)) if len(d) > 1 else float("nan")


def verdict(diffs: Sequence[float], direction: str, margin: float = 0.0, interval=None,
            range_rule: str = "overlap") -> str:
    """direction '+' or '-': the paper's sign of the difference; '=': the
    paper says about equal (within +-margin); 'range': the paper gives an
    interval (lo, hi) for the quantity, judged by range_rule: 'overlap' (the
    module docstring) or 'mean-inside' (issue 70.6, a demo's registry declares
    it): reproduced when the mean lies in [lo, hi], opposite when the whole
    mean +- 2 se interval lies outside it, not resolved otherwise."""
    mean, _, se = paired_stats(diffs)
    if not math.isfinite(se):
        return "not resolved"
    if direction == "range" and range_rule == "mean-inside":
        lo, hi = interval
        if lo <= mean <= hi:
            return "reproduced"
        return "opposite" if mean + 2 * se < lo or mean - 2 * se > hi else "not resolved"
    if direction == "range":
        lo, hi = interval
        if mean + 2 * se >= lo and mean - 2 * se <= hi:
            return "reproduced"
        return "opposite" if mean + 2 * se < 0 <= lo or mean - 2 * se > 0 >= hi else "not resolved"
    if direction == "=":
        if abs(mean) + 2 * se < margin:
            return "reproduced"
        return "opposite" if abs(mean) - 2 * se > margin else "not resolved"
    sign = 1.0 if direction == "+" else -1.0
    if margin and abs(mean) < margin:  # inside the practical margin: never reproduced / opposite (issue 58)
        return "about equal" if abs(mean) + 2 * se < margin else "not resolved"
    if abs(mean) > 2 * se and mean != 0:
        return "reproduced" if mean * sign > 0 else "opposite"
    return "not resolved"


def claim(text: str, paper: str, diffs: Sequence[float], direction: str, margin: float = 0.0,
          interval=None, by_construction: str = "", gate: dict | None = None, diagnosis: str = "",
          range_rule: str = "overlap", **extra) -> dict:
    """One row of a claims table (the keys results.json's `claims` list uses).
    by_construction: why the comparison cannot come out otherwise (the code
    makes the two sides equal); the verdict is then 'by construction', never
    'reproduced', and 'construction check failed' when a seed's difference
    lies outside the margin after all (the diffs may then come from a
    check on fewer seeds than the demo's). margin: the practical margin of a
    '+' / '-' claim too (module docstring). gate: {'needs': the regime in
    words, 'measured': the val check's numbers, 'met': bool}; not met: the
    verdict is "outside the lab's regime" (the paired numbers still kept); met None (a registry's gate within
    2 se of its threshold, issue 70.4): "regime unclear". A gated claim keeps its verdict without the gate beside
    ('ungated'). diagnosis: why a verdict goes against the paper, with a measured number."""
    mean, std, se = paired_stats(diffs)
    kind = ({"interval": list(interval)} if direction == "range" else
            {"margin": margin} if direction == "=" or margin else {})  # '+' / '-': a margin when it has one
    judged = verdict(diffs, direction, margin, interval, range_rule)
    if by_construction:
        judged = "by construction" if all(abs(x) <= margin for x in diffs) else "construction check failed"
    if gate is not None and (gate["met"] is None or not gate["met"]):
        extra["ungated"], judged = judged, "regime unclear" if gate["met"] is None else "outside the lab's regime"
    extra |= ({"gate": gate} if gate is not None else {}) | ({"diagnosis": diagnosis} if diagnosis else {})
    extra |= {"range_rule": range_rule} if direction == "range" and range_rule != "overlap" else {}
    return {"claim": text, "paper": paper, "mean": mean, "std": std, "n_seeds": len(diffs),
            "per_seed": [float(x) for x in diffs], "verdict": judged, "direction": direction, "se": se, **kind,
            **({"why": by_construction} if by_construction else {}), **extra}


def gate_word(gate: dict) -> str:
    return "regime unclear" if gate["met"] is None else "met" if gate["met"] else "not met"


def claims_table(claims: Sequence[dict]) -> str:
    rows = [{"claim": c["claim"], "paper": c["paper"],
             "ours (mean ± std)": f"{c['mean']:+.2f} ± {c['std']:.2f}",
             "per seed": ", ".join(f"{x:+.1f}" for x in c["per_seed"]), "verdict": c["verdict"],
             "margin": f"{c['margin']:.3g}" if c["direction"] != "=" and c.get("margin") else "",
             "regime (val check)": f"{c['gate']['needs']}: {c['gate']['measured']} ({gate_word(c['gate'])}"
                                   + (f"; without the gate: {c['ungated']})" if "ungated" in c else ")")
                                   if c.get("gate") else "",
             "beside": c.get("beside", ""), "diagnosis": c.get("diagnosis", "")} for c in claims]
    columns = ["claim", "paper", "ours (mean ± std)", "per seed", "verdict"]  # + what issue 58's claims carry
    return markdown_table(rows, columns + [k for k in ("margin", "regime (val check)", "beside", "diagnosis")
                                                  if any(r[k] for r in rows)])


def mean_std_table(per_seed: dict, columns: Sequence[str], first: str = "model") -> str:
    """per_seed: row name -> list (one dict per seed) -> 'mean ± std' cells."""
    rows = []
    for name, runs in per_seed.items():
        row = {first: name}
        for c in columns:
            vals = np.array([r[c] for r in runs], dtype=float)
            row[c] = f"{vals.mean():.1f} ± {vals.std(ddof=1):.1f}" if len(vals) > 1 else f"{vals[0]:.1f}"
        rows.append(row)
    return markdown_table(rows, [first, *columns])


def report_demo(out, head: str, base: dict, runs: dict, claims: list, columns: Sequence[str], t0: float,
                figure: Callable[[Path], Path], base_name: str | None = "CLIP", **extra) -> dict:
    """Prints a demo's mean ± std table and claims table, draws its figure and
    writes out/results.json with every seed's numbers; returns the record.
    base_name None: no row of its own for `base` (a demo whose start differs per seed keeps it in runs)."""
    out = Path(out)
    table = mean_std_table({**({base_name: [base]} if base_name else {}), **runs}, columns)
    fig = figure(out)
    wall = time.time() - t0
    print(f"{head}\n\n{table}\n\nClaims (paired differences, verdict by 2 standard errors):\n\n"
          f"{claims_table(claims)}\n\nwall time {wall:.0f}s")
    if "processes" in extra:  # lab.run_jobs' threads per job
        extra["job_threads"] = JOB_THREADS
    perturb = int(os.environ.get("CLIPFT_PERTURB", "0") or 0)
    if perturb:  # the weights moved by one ulp (lab.tiny.perturbed_weights): a stability rerun, never a demo
        extra["perturb"] = perturb
    record = {"settings": "demo settings (not the paper's)", **extra, "seeds": list(seeds()), "base": base,
              "per_seed": runs, "claims": claims, "table": table, "figure": str(fig), "wall_seconds": wall,
              "machine": machine_info()}
    common.write_results(out, record)
    return record


def run_seeds(seeds: Sequence[int], fn: Callable[[int], dict], log=print) -> list[dict]:
    """fn(seed) for every seed, in order; nothing dropped."""
    out = []
    for s in seeds:
        t0 = time.time()
        out.append(fn(s))
        log(f"[lab] seed {s} done in {time.time() - t0:.0f}s")
    return out


