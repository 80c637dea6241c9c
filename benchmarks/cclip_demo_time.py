"""Where `python cclip.py --demo`'s time goes (issue 71.4: can the data path bring it to its 420-s budget?).

    python benchmarks/cclip_demo_time.py     # seed 0 of every row, 2 processes of one thread (the demo's); ~3 min

Runs the demo's sequence of each of its seven rows (full FT, LoRA only, CKC only, C-CLIP, ZSCL, LwF, EWC) once, at
the demo's settings in its default world, as the demo runs them (lab.run_jobs: one torch thread a process), and
times inside each: the optimisation steps (common.train_step: forward, backward, optimiser; a method's teacher
forwards included), the evaluations (eval.evaluate: the R[i][j] matrix, the unseen domain, zero-shot) and the
batches' loading (the DataLoader: seeding, decoding, transform, collation). Writes
benchmarks/results-cclip-demo-time.json: CPU seconds per row and part, and what the demo's seeds make of them in
wall time on two processes (the parts' sums x seeds / processes; row 0's evaluation, which the demo runs once per
row and passes on, is counted per seed, so the evaluation's share is an upper bound).
"""
from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PARTS = {"steps": ("common", "train_step"), "evaluation": ("eval", "evaluate"),
         "loading": ("torch.utils.data.dataloader", "_BaseDataLoaderIter.__next__")}


def timed_sequence(method: str, out: str, argv: tuple = (), overrides: tuple = ()) -> dict:
    """One row's sequence (seed 0), with its parts' seconds (a run_jobs job: module-level)."""
    import importlib
    from lab.demos import cclip as demo
    import cclip
    from plumbing.flags import parse_config
    seconds, undo = dict.fromkeys(PARTS, 0.0), []
    for part, (module, name) in PARTS.items():
        owner = importlib.import_module(module)
        *path, attr = name.split(".")
        for p in path:
            owner = getattr(owner, p)
        undo.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, _timer(getattr(owner, attr), seconds, part))
    try:
        cfg = parse_config(cclip.CClipConfig, ["--out", f"{out}/{method}", *argv],
                           **{**demo.DEMO, "steps": demo.WORLDS["conflict"]["steps"], **dict(overrides)})
        t = time.perf_counter()
        demo.one_sequence(cfg, method, 0, None, "conflict")
        return {**seconds, "total": time.perf_counter() - t}
    finally:  # a worker runs several rows: each times its own
        for owner, attr, fn in undo:
            setattr(owner, attr, fn)


def _timer(fn, seconds: dict, part: str):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[part] += time.perf_counter() - t
    return timed


def measure(out: str = "runs/bench-cclip-demo-time", processes: int = 2, argv: tuple = (), seeds: int = 5,
            methods: tuple = (), **overrides) -> dict:
    """The parts' seconds of each row (`methods`: all seven by default) at the demo's settings (`overrides`:
    the tests' shorter ones)."""
    import lab
    from lab.demos import cclip as demo
    methods = list(methods or demo.ALL_NAMES)
    t = time.time()
    rows = lab.run_jobs(timed_sequence, [(m, out, tuple(argv), tuple(overrides.items())) for m in methods],
                        processes)
    wall = time.time() - t
    per_row = {demo.ALL_NAMES[m]: r for m, r in zip(methods, rows)}
    total = {k: sum(r[k] for r in rows) for k in (*PARTS, "total")}
    rest = total["total"] - sum(total[k] for k in PARTS)
    return {"seed": 0, "processes": processes, "argv": list(argv), "wall seconds": wall, "rows": per_row,
            "cpu seconds a seed": {**total, "rest": rest},
            "share": {k: v / total["total"] for k, v in {**{p: total[p] for p in PARTS}, "rest": rest}.items()},
            f"demo wall seconds at {seeds} seeds": {k: v * seeds / processes for k, v in total.items()},
            "machine": lab.machine_info()}


def main(argv=None) -> dict:
    out = measure()
    path = ROOT / "benchmarks" / "results-cclip-demo-time.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    share, demo = out["share"], out["demo wall seconds at 5 seeds"]
    print(f"seed 0, 7 rows: steps {share['steps']:.0%}, evaluation {share['evaluation']:.0%}, loading "
          f"{share['loading']:.0%}, rest {share['rest']:.0%}; at 5 seeds on 2 processes the steps alone take "
          f"{demo['steps']:.0f} s of {demo['total']:.0f} s -> {path}")
    return out


if __name__ == "__main__":
    main()
