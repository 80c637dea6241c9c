"""The docs' demo sections, printed from a committed results file alone:

  python -m lab.report docs/erclip-demo-results.json "python erclip.py --demo"

prints the run line (machine, wall time, seeds), the figure, the mean ± std
table the demo printed and its claims table, so that every number in docs/
comes from a results file a stated command wrote.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from plumbing.results import from_json

import lab


def load(path) -> dict:
    """A results file as a demo wrote it (NaN and infinities restored)."""
    return from_json(Path(path).read_text(), restore=True, strict=False)


def threads(r: dict) -> str:
    """How a results file's runs were executed: lab.run_jobs' one-thread workers, or the process's threads."""
    if "processes" in r:
        return f"one torch thread per run, {r['processes']} run(s) at a time"
    return f"{r['machine']['torch_threads']} torch threads"


def demo_markdown(path, command: str) -> str:
    path = Path(path)
    r = load(path)
    m = r["machine"]
    figure = Path(r["figure"]).name
    head = (f"Run: `{command}` on {m['cores']} CPU cores ({m['cpu']}), torch {m['torch']}, {threads(r)}; wall time "
            f"{r['wall_seconds']:.0f} s; seeds {r['seeds']}. "
            f"Table, claims and figure from [`docs/{path.name}`]({path.name}).")
    return (f"{head}\n\n![{command}]({figure})\n\n{r['table']}\n\nClaims (paired per-seed differences; verdict by "
            f"2 standard errors, and by a claim's margin and regime gate where it has them: docs/lab.md):\n\n"
            f"{lab.claims_table(r['claims'])}")


def claims_lines(path, fresh=None) -> str:
    """The README's one line per claim: verdict, claim, our mean, the paper; with `fresh` (issue 70: the seeds run
    once after the claims registry) that file's verdict too."""
    r = load(path)
    again = {c["claim"]: c for c in load(fresh)["claims"]} if fresh else {}
    return "\n".join(f"- {c['verdict']}" + (f" (fresh seeds: {again[c['claim']]['verdict']})" if again else "")
                     + f": {c['claim']}: {c['mean']:+.2f} (paper {c['paper']})" for c in r["claims"])


def heldout_markdown(path, *others) -> str:
    """Each claim at the demo's seeds beside the same claim at held-out seeds (issue 39: a verdict reproduced at
    seeds 0-4 must repeat at 10-14), and at fresh seeds run once after the claims registry (issue 70: 30-34)."""
    a, *rest = (load(p) for p in (path, *others))
    others = [{c["claim"]: c for c in b["claims"]} for b in rest]
    head = "| claim | " + " | ".join(f"seeds {r['seeds'][0]}-{r['seeds'][-1]} | verdict" for r in (a, *rest)) + " |"
    rows = [f"| {c['claim']} | " + " | ".join(f"{o['mean']:+.2f} ± {o['std']:.2f} | {o['verdict']}"
                                             for o in (c, *(other[c["claim"]] for other in others))) + " |"
            for c in a["claims"]]
    return "\n".join([head, "|---|" + "---|---|" * (1 + len(rest)), *rows])


def margins_markdown(path) -> str:
    """Issue 70.3: each claim's margin and the numbers it came from (a results file written under a registry)."""
    r = load(path)
    rows = ["| claim | rule | from | margin |", "|---|---|---|---|"]
    for c in r["claims"]:
        src = c.get("margin_source")
        if not src:
            rows.append(f"| {c['claim']} | {c.get('range_rule', 'none')} | range {c.get('interval', '')} | |")
            continue
        frm = {"paper-tie": lambda s: "the paper's tie threshold",
               "baseline-share": lambda s: f"{s['share']:g} x lab {' - '.join(s['lab_baseline'][:2])} "
                                           f"({s['lab_baseline'][2]}) {s['lab_baseline_effect']:+.2f}",
               "scaled-effect": lambda s: "paper " + " / ".join(f"{x:+.2f}" for x in s["paper_effect"])
               + " x lab baseline " + f"{s['lab_baseline_effect']:+.2f} / paper baseline "
               + " / ".join(f"{x:+.2f}" for x in s["paper_baseline_effect"])
               + f" = {s['scaled_effect']:.2f}, x {s['share']:g}"}[src["rule"]](src)
        rows.append(f"| {c['claim']} | {src['rule']} | {frm} | {c['margin']:.3g} |")
    return "\n".join(rows)


def worlds_markdown(prefix: str, docs="docs") -> str:
    """Issue 71.1: each claim's mean and verdict in the shared world (docs/PREFIX-shared*-results.json) beside the
    conflict world (docs/PREFIX*-results.json), at seeds 0-4, 10-14 and 30-34."""
    kinds = ("", "-heldout", "-fresh")
    files = {w: [load(Path(docs) / f"{prefix}{w}{k}-results.json") for k in kinds] for w in ("-shared", "")}
    head = "| claim | " + " | ".join(f"seeds {r['seeds'][0]}-{r['seeds'][-1]}: shared -> conflict"
                                     for r in files[""]) + " |"
    rows = []
    for i, c in enumerate(files[""][0]["claims"]):
        cells = []
        for old, new in zip(files["-shared"], files[""]):
            o, n = old["claims"][i], new["claims"][i]
            cells.append(f"{o['mean']:+.2f} {o['verdict']} -> {n['mean']:+.2f} {n['verdict']}")
        rows.append(f"| {c['claim']} | " + " | ".join(cells) + " |")
    return "\n".join([head, "|---|" + "---|" * len(kinds), *rows])


def world_figure(shared, conflict, path, method: str = "full FT") -> Path:
    """Issue 71.1: what the continual world does to `method`'s R@1 matrix: its per-seed matrices from two results
    files of C-CLIP's demo (the shared world's, the conflict world's) side by side, on one colour scale."""
    runs = [load(p) for p in (shared, conflict)]
    label = {r.get("world", {}).get("name", "shared"): r for r in runs}
    matrices = {f"{method}, {name} world": [s["R"] for s in r["per_seed"][method]] for name, r in label.items()}
    steps = " / ".join(f"{name} {r['config']['steps']}" for name, r in label.items())
    return lab.matrix_figure(matrices, list(lab.TASK_DOMAINS), path,
                             f"python -m lab.report {shared} {conflict} --world-figure {path}; R[i][j] = R@1 on task j "
                             f"after tasks 1..i; steps per task: {steps}; seeds {runs[0]['seeds']}")


def long_world_figure(path, docs="docs") -> Path:
    """Issue 71.2: what the window reads of a long caption. Left: R@1 against the content tokens read (long-reach),
    CLIP and M in the shared world and at register 2/3, their sentence-mean R@1 dashed, CLIP and M from the plain-alt
    weights (long-reach-2, long-world-3's world), the window at 22. Right: M's
    truncated / sentence-mean long gain (mean +- 2 se over the pilots) in every world the rules tried; the gate."""
    from lab import stats
    rec = lambda name: load(Path(docs) / f"calibration-{name}.json")  # noqa: E731
    reach = rec("long-reach")
    plt = lab.pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    ks = reach["tokens"]
    for (key, w), color in zip(reach["worlds"].items(), ("tab:blue", "tab:red")):
        name = "shared world" if not w["register"] else f"register {w['register']:.2g}"
        ax.plot(ks, [w["CLIP"]["tokens"][str(k)] for k in ks], "s--", color=color, alpha=0.6, label=f"CLIP, {name}")
        m = np.array([[p["tokens"][str(k)] for k in ks] for p in w["M"].values()])
        ax.errorbar(ks, m.mean(0), yerr=m.std(0, ddof=1), fmt="o-", color=color, capsize=3,
                    label=f"M ({len(m)} pilots), {name}")
        ax.axhline(np.mean([p["sentence-mean"] for p in w["M"].values()]), color=color, ls=":", lw=1)
        ax.axhline(w["CLIP"]["sentence-mean"], color=color, ls="--", lw=0.7, alpha=0.5)
    plain = rec("long-world-3")
    for w in rec("long-reach-2")["worlds"].values():  # CLIP pretrained on plain alt-text, and M from it
        ax.plot(ks, [w["CLIP"]["tokens"][str(k)] for k in ks], "^--", color="tab:green", alpha=0.6,
                label="CLIP, plain-alt pretraining")
        m = np.array([[p["tokens"][str(k)] for k in ks] for p in w["M"].values()])
        ax.errorbar(ks, m.mean(0), yerr=m.std(0, ddof=1), fmt="^-", color="tab:green", capsize=3,
                    label=f"M ({len(m)} pilots), plain-alt pretraining")
    ax.axvline(22, color="black", lw=0.8)
    ax.set(xlabel="content tokens of a long caption read (the window: 22)", ylabel="long-caption R@1 (%), val",
           title="R@1 by tokens read (dotted / dashed: M's / CLIP's sentence-mean)")
    ax.legend(fontsize=7)
    worlds = [("shared", [p["share"] for p in rec("erclip-gates")["pilots"].values()])]
    worlds += [(f"lead {r['lead']}", [p["share"] for p in r["pilots"].values()]) for r in rec("long-world")["grid"]]
    worlds += [(f"register {r['register']:.2g}", [p["share"] for p in r["pilots"].values()])
               for r in rec("long-world-2")["grid"]]
    worlds += [("plain-alt", [p["share"] for p in plain["grid"][0]["pilots"].values()])]
    for i, (name, shares) in enumerate(worlds):
        mean, _, se = stats.paired_stats(shares)
        bx.errorbar(i, mean, yerr=2 * se, fmt="o", color="black", capsize=4)
        bx.scatter([i] * len(shares), shares, s=10, color="tab:gray")
    bx.axhline(1 / 3, color="tab:red", ls="--", label="gate: mean - 2 se >= 1/3")
    bx.set_xticks(range(len(worlds)), [n for n, _ in worlds], fontsize=8, rotation=20)
    bx.set(ylabel="M's truncated / sentence-mean long gain", title="the window's share of M's gain, +- 2 se")
    bx.legend(fontsize=8)
    fig.suptitle(f"python -m lab.report --long-world-figure {path}; val; docs/calibration-long-reach, -erclip-gates, "
                 f"-long-world, -long-world-2, -long-world-3, -long-reach-2.json", fontsize=8)
    return lab.save_figure(fig, path)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python -m lab.report RESULTS.json 'COMMAND' | OTHER_SEEDS_RESULTS.json ... | --margins | "
                 "CONFLICT_RESULTS.json --world-figure OUT.png | --worlds PREFIX | --long-world-figure OUT.png")
    if sys.argv[1] == "--long-world-figure":
        print(long_world_figure(sys.argv[2]))
    elif sys.argv[1] == "--worlds":
        print(worlds_markdown(sys.argv[2]))
    elif len(sys.argv) == 5 and sys.argv[3] == "--world-figure":
        print(world_figure(*sys.argv[1:3], sys.argv[4]))
    elif sys.argv[2] == "--margins":
        print(margins_markdown(sys.argv[1]))
    elif sys.argv[2].endswith(".json"):
        print(heldout_markdown(*sys.argv[1:]))
    else:
        print(demo_markdown(sys.argv[1], sys.argv[2]))
