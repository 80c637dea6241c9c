"""The docs' demo sections, printed from a committed results file alone:

  python -m lab.report docs/erclip-demo-results.json "python erclip.py --demo"

prints the run line (machine, wall time, seeds), the figure, the mean ± std
table the demo printed and its claims table, so that every number in docs/
comes from a results file a stated command wrote.
"""
from __future__ import annotations

import sys
from pathlib import Path

from plumbing.results import from_json

import lab


def threads(r: dict) -> str:
    """How a results file's runs were executed: lab.run_jobs' one-thread workers, or the process's threads."""
    if "processes" in r:
        return f"one torch thread per run, {r['processes']} run(s) at a time"
    return f"{r['machine']['torch_threads']} torch threads"


def demo_markdown(path, command: str) -> str:
    path = Path(path)
    r = from_json(path.read_text(), restore=True, strict=False)
    m = r["machine"]
    figure = Path(r["figure"]).name
    head = (f"Run: `{command}` on {m['cores']} CPU cores ({m['cpu']}), torch {m['torch']}, {threads(r)}; wall time "
            f"{r['wall_seconds']:.0f} s; seeds {r['seeds']}. "
            f"Table, claims and figure from [`docs/{path.name}`]({path.name}).")
    return (f"{head}\n\n![{command}]({figure})\n\n{r['table']}\n\nClaims (paired per-seed differences; verdict by "
            f"2 standard errors, and by a claim's margin and regime gate where it has them: docs/lab.md):\n\n"
            f"{lab.claims_table(r['claims'])}")


def claims_lines(path) -> str:
    """The README's one line per claim: verdict, claim, our mean, the paper."""
    r = from_json(Path(path).read_text(), restore=True, strict=False)
    return "\n".join(f"- {c['verdict']}: {c['claim']}: {c['mean']:+.2f} (paper {c['paper']})" for c in r["claims"])


def heldout_markdown(path, heldout) -> str:
    """Each claim at the demo's seeds beside the same claim at held-out seeds (issue 39: a verdict reproduced at
    seeds 0-4 must repeat at 10-14)."""
    a, b = (from_json(Path(p).read_text(), restore=True, strict=False) for p in (path, heldout))
    other = {c["claim"]: c for c in b["claims"]}
    lo, hi = (f"seeds {r['seeds'][0]}-{r['seeds'][-1]}" for r in (a, b))
    rows = [f"| {c['claim']} | {c['mean']:+.2f} ± {c['std']:.2f} | {c['verdict']} | "
            f"{other[c['claim']]['mean']:+.2f} ± {other[c['claim']]['std']:.2f} | {other[c['claim']]['verdict']} |"
            for c in a["claims"]]
    return "\n".join([f"| claim | {lo} | verdict | {hi} | verdict |", "|---|---|---|---|---|", *rows])


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m lab.report RESULTS.json 'COMMAND'   or   RESULTS.json HELDOUT_RESULTS.json")
    if sys.argv[2].endswith(".json"):
        print(heldout_markdown(sys.argv[1], sys.argv[2]))
    else:
        print(demo_markdown(sys.argv[1], sys.argv[2]))
