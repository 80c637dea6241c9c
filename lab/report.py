"""The docs' demo sections, printed from a committed results file alone:

  python -m lab.report docs/erclip-demo-results.json "python erclip.py --demo"

prints the run line (machine, wall time, seeds), the figure, the mean ± std
table the demo printed and its claims table, so that every number in docs/
comes from a results file a stated command wrote.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import lab


def threads(r: dict) -> str:
    """How a results file's runs were executed: lab.run_jobs' one-thread workers, or the process's threads."""
    if "processes" in r:
        return f"one torch thread per run, {r['processes']} run(s) at a time"
    return f"{r['machine']['torch_threads']} torch threads"


def demo_markdown(path, command: str) -> str:
    path = Path(path)
    r = json.loads(path.read_text())
    m = r["machine"]
    figure = Path(r["figure"]).name
    head = (f"Run: `{command}` on {m['cores']} CPU cores ({m['cpu']}), torch {m['torch']}, {threads(r)}; wall time "
            f"{r['wall_seconds']:.0f} s; seeds {r['seeds']}. "
            f"Table, claims and figure from [`docs/{path.name}`]({path.name}).")
    return (f"{head}\n\n![{command}]({figure})\n\n{r['table']}\n\nClaims (paired per-seed differences; verdict by "
            f"2 standard errors):\n\n{lab.claims_table(r['claims'])}")


def claims_lines(path) -> str:
    """The README's one line per claim: verdict, claim, our mean, the paper."""
    r = json.loads(Path(path).read_text())
    return "\n".join(f"- {c['verdict']}: {c['claim']}: {c['mean']:+.2f} (paper {c['paper']})" for c in r["claims"])


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m lab.report RESULTS.json 'COMMAND'")
    print(demo_markdown(sys.argv[1], sys.argv[2]))
