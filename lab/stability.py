"""Does a demo's verdict survive a float-rounding perturbation? (issue 39,
item 3). A perturbed rerun of some seeds (another torch thread count, another
machine, a fresh clone) is set beside the demo's results file: each seed it
holds replaces that seed's paired difference in every claim, and the verdict
is judged again by the same rule (lab.stats.verdict).

  OMP_NUM_THREADS=1 python dns.py --demo --seeds 0,1 --out runs/dns-demo-1thread
  python -m lab.stability docs/dns-demo-results.json runs/dns-demo-1thread/results.json
  CLIPFT_JOB_THREADS=2 python erclip.py --demo --seeds 0,1 --out runs/erclip-2threads   (lab.run_jobs' demos)

prints, per claim, the largest change of a per-seed difference and the
verdict before and after ('holds' or 'CHANGES'); exit status 1 when any
verdict changes. Claims made 'by construction' are judged by their own rule
(every per-seed difference within the claim's margin)."""
from __future__ import annotations

import sys
from pathlib import Path

from plumbing.results import from_json

from plumbing.base import UsageError, markdown_table
from lab.stats import verdict


def check(base: dict, other: dict) -> list[dict]:
    """base, other: two demos' results.json (other: a rerun of some of base's seeds). One row per claim of base."""
    seeds, by_text = list(base["seeds"]), {c["claim"]: c for c in other["claims"]}
    missing = [s for s in other["seeds"] if s not in seeds]
    if missing:
        raise UsageError(f"the rerun's seeds {missing} are not among the demo's {seeds}")
    rows = []
    for c in base["claims"]:
        if c["claim"] not in by_text:
            raise UsageError(f"the rerun has no claim {c['claim']!r} (another demo or version?)")
        diffs = list(c["per_seed"])
        changes = []
        for seed, value in zip(other["seeds"], by_text[c["claim"]]["per_seed"]):
            changes.append(value - diffs[seeds.index(seed)])
            diffs[seeds.index(seed)] = value
        if "why" in c:  # by construction: within the margin on every seed
            again = "by construction" if all(abs(x) <= c.get("margin", 0.0) for x in diffs) \
                else "construction check failed"
        else:
            again = verdict(diffs, c["direction"], c.get("margin", 0.0), c.get("interval"),
                            c.get("range_rule", "overlap"))
        if c.get("gate") and not c["gate"]["met"]:  # a val check before the seeds: no seed changes it (issue 58)
            again = "regime unclear" if c["gate"]["met"] is None else "outside the lab's regime"
        rows.append({"claim": c["claim"], "verdict": c["verdict"], "perturbed": again,
                     "largest change": max(abs(x) for x in changes), "holds": again == c["verdict"]})
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) != 2:
        sys.exit("usage: python -m lab.stability DEMO_RESULTS.json RERUN_RESULTS.json")
    docs = []
    for p in argv:
        try:
            docs.append(from_json(Path(p).read_text(), restore=True, strict=False))
        except (OSError, ValueError) as e:
            sys.exit(f"error: {p}: not a readable results file ({e.__class__.__name__}: {e})")
    base, other = docs
    try:
        rows = check(base, other)
    except (UsageError, KeyError, TypeError, ValueError) as e:
        sys.exit(f"error: {argv[1]} beside {argv[0]}: {e}")
    print(markdown_table([{**r, "largest change": f"{r['largest change']:.2g}",
                                  "holds": "holds" if r["holds"] else "CHANGES"} for r in rows],
                                ["claim", "verdict", "perturbed", "largest change", "holds"]))
    def how(r):  # lab.run_jobs' demos: threads per job; the others: the process's
        threads = r.get("job_threads", 1) if "processes" in r else r.get("machine", {}).get("torch_threads")
        return f"{threads} torch thread(s) on {r.get('machine', {}).get('cpu')}"
    print(f"{sum(r['holds'] for r in rows)} of {len(rows)} verdicts hold (rerun: seeds {other['seeds']}, "
          f"{how(other)}; demo: {how(base)})")
    return 0 if all(r["holds"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
