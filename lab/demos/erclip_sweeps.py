"""ERCLIP's sweeps on the lab (Sec. 4.3 Fig. 3, Sec. 4.4; erclip.py deviation 14): training length,
lambda_p, data size, and the component ablations, on the synthetic world with the demo's settings, seeds
lab.seeds(), claims written before the seeds ran, a figure. The schedules, one run and the real setting's
sweep are papers/erclip_sweeps.py; this module holds the lab's part (stand-ins, seeds, claims, figure).

  python erclip.py --demo --sweep NAME

NAME: epochs | lambda-p | data-size | ablations. Each run in OUT/sweep-NAME/<run>-seed<k>/ (a sweep
started again skips finished runs); one results file OUT/sweep-NAME/results.json. The choices (the
lab's stand-ins) are erclip.py's deviation 14, discussed in docs/erclip.md (16); the paper's printed points
live in plumbing/published.py (ERCLIP_LAMBDA_IN, ERCLIP_DATA, ERCLIP_EPOCH_CHANGE, ERCLIP_TABLE2)."""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

from plumbing import models
from papers import erclip_sweeps
import erclip
import lab
from lab import report
from lab.demos import erclip as demo
from plumbing import published
from plumbing.results import from_json

# The lab's stand-ins (ours, fixed before the seeds ran): the pool is the world's 'train' split
# (2,000 scenes), so the paper's sizes scale by 2,000 / 50,000 at the demo's fixed 40 steps; an
# "epoch" is one pass over the first 256 scenes (8 steps of 32), so the 40 steps are 5 epochs.
DEMO_DATA_SIZES = (40, 200, 400, 800, 2000)
DEMO_EPOCH_POOL = 256


def demo_plan(name: str, sizes, first_seed: bool = True) -> list[tuple[str, dict]]:
    """The lab's runs of a sweep: the paper's, plus in 'epochs' the demo's
    pre-registered RT+P with the fusion's own lr (lab/demos/erclip.py); there
    RT+P at the encoders' lr (M+P by construction) runs on the first seed only,
    as the check (demo.CHECK_ONLY)."""
    own = [("RT+P own lr", dict(erclip_sweeps.VARIANTS["RT+P"], epochs=erclip_sweeps.EPOCHS,
                                fusion_lr=demo.DEMO_FUSION_LR))]
    if name != "epochs":
        return erclip_sweeps.sweep_plan(name, sizes)
    return [r for r in erclip_sweeps.sweep_plan(name, sizes) if first_seed or r[0] not in demo.CHECK_ONLY] + own


# --- the lab: --demo --sweep NAME (the demo's settings, lab.SEEDS, claims fixed before the runs) ---
DEMO_SWEEP_NOTES = {
    "epochs": f"M, M+P, RT+P own lr, and RT+P (M+P by construction) on the first seed as the check; an epoch is "
              f"one pass over the first {DEMO_EPOCH_POOL} scenes of "
              f"'train' (8 steps of 32), so the 40 steps are 5 epochs (cosine over all 40); the weights saved after "
              f"each epoch are evaluated; epoch 0 is CLIP",
    "lambda-p": "M (mean fusion) with lambda_p 0, 0.25, 0.5, 1, 2 on the whole 'train' split (2,000 scenes)",
    "data-size": f"M+P on the first N scenes of 'train', N = {', '.join(map(str, DEMO_DATA_SIZES))} for the "
                 f"paper's 1k-50k (x 2,000 / 50,000), every run 40 steps (a fixed budget: 32 epochs of the "
                 f"smallest, 0.64 of the largest)",
    "ablations": "M, M+P, RT+P, RT (lambda_p 0) and L_short only (mean fusion, alpha 0, lambda_p 0) on the whole "
                 "'train' split",
}
SWEEP_README_COLS = ["long", "short", "background", "shape held-out", "color held-out"]
ZS = "background top-1"  # the held-out family: the lab's ImageNet / CIFAR stand-in, as in the demo


def sweep_claims(name: str, base: dict, rows: dict) -> list[dict]:
    """Each sweep's claims as paired per-seed differences, in the paper's
    direction (written before the seeds ran; the two ablations the paper did
    not run carry what its argument predicts)."""
    def d(a, b, key):
        return lab.paired(rows, a, b, key, base)

    if name == "epochs":
        last = erclip_sweeps.EPOCHS
        out = [lab.claim(f"long R@1 falls from epoch 1 to {last}, {v} (epoch {last} - epoch 1)",
                         published.ERCLIP_EPOCH_CHANGE["Long avg"], d(f"{v} epoch {last}", f"{v} epoch 1", "long"),
                         "-")
               for v in ("M", "M+P", "RT+P own lr")]
        out += [lab.claim(f"short R@1 rises from epoch 1 to {last}, {v}",
                          "COCO " + published.ERCLIP_EPOCH_CHANGE["COCO"],
                          d(f"{v} epoch {last}", f"{v} epoch 1", "short"), "+") for v in ("M", "M+P", "RT+P own lr")]
        drift_m = d(f"M epoch {last}", "M epoch 1", "background")
        drift_p = d(f"M+P epoch {last}", "M+P epoch 1", "background")
        return out + [
            lab.claim(f"zero-shot falls from epoch 1 to {last} without P (M, {ZS})", "CIFAR-10 -1.2 to -1.8",
                      drift_m, "-"),
            lab.claim(f"P limits that drift ((M+P) - M change from epoch 1 to {last}, {ZS})",
                      "CIFAR-10 B/32: -0.5 with P against -1.2 to -1.8 without",
                      [p - m for p, m in zip(drift_p, drift_m)], "+"),
            lab.claim(f"RT+P reaches M+P by epoch 2 (RT+P - M+P at epoch 2, {ZS}; equal within 1 point)",
                      "CIFAR-10, Fig. 3", d("RT+P epoch 2", "M+P epoch 2", "background"), "=", margin=1.0,
                      by_construction=demo.BY_CONSTRUCTION),
            lab.claim(f"RT+P own lr is below M at epoch 1 ({ZS})", "CIFAR-10 -1.3 to -2.3 (B/32, B/16), Fig. 3",
                      d("RT+P own lr epoch 1", "M epoch 1", "background"), "-"),
            lab.claim(f"... and reaches M+P by epoch 2 (RT+P own lr - M+P at epoch 2, {ZS}; equal within 1 point)",
                      "CIFAR-10, Fig. 3", d("RT+P own lr epoch 2", "M+P epoch 2", "background"), "=", margin=1.0)]
    if name == "lambda-p":
        lp = [f"lambda_p={x:g}" for x in erclip_sweeps.LAMBDAS]
        lo, hi = erclip_sweeps.PAPER_LAMBDA_IN[0.0], erclip_sweeps.PAPER_LAMBDA_IN[2.0]
        return [lab.claim(f"zero-shot rises from lambda_p 0 to 2 ({ZS})",
                          f"ImageNet {demo.rounded(hi - lo)} ({lo} -> {hi})", d(lp[-1], lp[0], "background"), "+")] + [
            lab.claim(f"... monotonically: lambda_p {a[9:]} -> {b[9:]} ({ZS})", "monotone", d(b, a, "background"), "+")
            for a, b in zip(lp, lp[1:])] + [
            lab.claim(f"{k} R@1 rises from lambda_p 0 to 0.5", f"{paper} up to +1.3", d(lp[2], lp[0], k), "+")
            for k, paper in (("long", "long"), ("short", "COCO"))] + [
            lab.claim(f"{k} R@1 plateaus beyond 0.5 (lambda_p 2 - 0.5; equal within 1 point)", "plateau",
                      d(lp[-1], lp[2], k), "=", margin=1.0) for k in ("long", "short")]
    if name == "data-size":
        n = [f"N={x}" for x in DEMO_DATA_SIZES]
        def change(k, a, b, text="{a} -> {b}"):  # the paper's printed points at a and b pairs
            x, y = erclip_sweeps.PAPER_DATA[a][k], erclip_sweeps.PAPER_DATA[b][k]
            return f"{demo.rounded(y - x)} ({text.format(a=x, b=y)})"
        return [lab.claim("long R@1 rises up to the 10k stand-in (N=400 - N=40)",
                          change("long", 1000, 10000, "{a} at 1k -> {b} at 10k"),
                          d(n[2], n[0], "long"), "+"),
                lab.claim("... then saturates (N=2000 - N=400; equal within 1 point)", "within 0.4 (10k -> 50k)",
                          d(n[-1], n[2], "long"), "=", margin=1.0),
                lab.claim("short R@1 rises with data (N=2000 - N=40)", "COCO " + change("COCO", 1000, 50000),
                          d(n[-1], n[0], "short"), "+"),
                lab.claim(f"zero-shot falls with data (N=2000 - N=40, {ZS})", "ImageNet " + change("IN", 1000, 50000),
                          d(n[-1], n[0], "background"), "-")]
    # ablations: the paper did not run RT or L_short only; "paper" gives what its argument predicts from Table 2
    t2, vits = published.ERCLIP_TABLE2, ("B/32", "B/16", "L/14")
    erosion = [t2[(v, "M")][demo.IN] - t2[(v, "CLIP")][demo.IN] for v in vits]  # M - CLIP, ImageNet
    back = [t2[(v, f)][demo.IN] - t2[(v, "M")][demo.IN] for v in vits for f in ("M+P", "RT+P")]  # with P - M
    return [
        lab.claim(f"RT without P erodes zero-shot (RT - CLIP, {ZS})",
                  f"not run; predicted like M (IN {demo.rounded(max(erosion))} to {demo.rounded(min(erosion))})",
                  d("RT", "CLIP", "background"), "-"),
        lab.claim(f"... as much as M (RT - M, {ZS}; equal within 1 point)", "not run; predicted ~0 (gate starts at "
                  "the mean)", d("RT", "M", "background"), "=", margin=1.0,
                  by_construction="at the encoders' lr the zero-initialised gate cannot move: RT is M "
                                  "(erclip.py deviation 11)"),
        lab.claim(f"P recovers zero-shot for RT too (RT+P - RT, {ZS})", f"not run; predicted like M+P - M (IN "
                  f"{demo.rounded(min(back))} to {demo.rounded(max(back))}, every fusion)",
                  d("RT+P", "RT", "background"), "+"),
        lab.claim("L_short only raises long R@1 less than M (M - L_short only, long)", "not run; predicted > 0 "
                  "(L_long carries the gain)", d("M", "L_short only", "long"), "+"),
        lab.claim(f"L_short only still erodes zero-shot (L_short only - CLIP, {ZS})", "not run; predicted < 0 "
                  "(fine-tuning on COCO captions)", d("L_short only", "CLIP", "background"), "-")]


def sweep_figure(name: str, base: dict, rows: dict, path, caption: str):
    """Ours (mean over seeds, +-1 std band, seeds as dots) per measure; the
    paper's printed points in a panel of their own (other units and models)."""
    measures = (("long", "long-caption R@1, truncated (%)"), ("short", "short-caption R@1 (%)"),
                ("background", "held-out zero-shot top-1 (%)"))

    def seeds(names, key):  # (n_seeds, len(names)); 'CLIP' is the pretrained model for every seed
        return np.array([[base[key] if r == "CLIP" else rows[r][i][key] for r in names]
                         for i in range(len(lab.seeds()))])
    if name == "epochs":
        epochs = erclip_sweeps.EPOCHS
        xs, series = list(range(epochs + 1)), {v: ["CLIP"] + [f"{v} epoch {k}" for k in range(1, epochs + 1)]
                                               for v in ("M", "M+P", "RT+P own lr")}  # RT+P: one seed, = M+P
        paper, xlabel = {}, f"epoch (1 epoch = {DEMO_EPOCH_POOL} pairs = 8 steps; 0 = CLIP)"
    elif name == "lambda-p":
        xs, series = list(erclip_sweeps.LAMBDAS), {"mean fusion": [f"lambda_p={x:g}" for x in erclip_sweeps.LAMBDAS]}
        paper = {"paper Sec. 4.4: ImageNet top-1 (%)": (list(erclip_sweeps.PAPER_LAMBDA_IN),
                                                         list(erclip_sweeps.PAPER_LAMBDA_IN.values()))}
        xlabel = "lambda_p (weight of L_pres)"
    elif name == "data-size":
        xs, series = list(DEMO_DATA_SIZES), {"M+P": [f"N={x}" for x in DEMO_DATA_SIZES]}
        data = erclip_sweeps.PAPER_DATA
        paper = {f"paper {k}": ([n for n in data if k in data[n]], [v[k] for v in data.values() if k in v])
                 for k in ("long", "COCO", "IN")}
        xlabel = "training pairs (prefix of one order)"
    else:
        xs, series = ["CLIP", *erclip_sweeps.VARIANTS], {"ours": ["CLIP", *erclip_sweeps.VARIANTS]}
        paper = {f"paper Tab. 2 B/16 {k}": (["CLIP", "M", "M+P", "RT+P"], [published.ERCLIP_TABLE2[("B/16", v)][i]
                                                                          for v in ("CLIP", "M", "M+P", "RT+P")])
                 for k, i in (("long avg T2I", 1), ("ImageNet", 6))}
        xlabel = "variant"
    panels = [{"title": f"ours: {label.split(' (')[0]}", "ylabel": label,
               "series": {s: (xs, seeds(names, key)) for s, names in series.items()}} for key, label in measures]
    if paper:
        title = ("paper Tab. 2, ViT-B/16 (RT, L_short only: not run)" if name == "ablations"
                 else "paper Sec. 4.4 (ViT; backbone not stated)")
        panels.append({"title": title, "ylabel": "% (paper's metric)", "paper": paper,
                       "xlabel": "training pairs" if name == "data-size" else xlabel})
    return lab.curves_figure(panels, path, caption, xlabel, log_x=name == "data-size")


def demo_sweep_job(cfg: erclip.ERCLIPConfig, root, run: str, overrides: dict, seed: int, pool) -> dict:
    """One run of a demo sweep (a lab.run_jobs job): erclip_sweeps.sweep_one from freshly loaded pretrained weights,
    measured by the demo's demo_measure, weights dropped."""
    def measure(model, preprocess, tokenizer, weights):
        return demo.demo_measure(model, preprocess, tokenizer, cfg.data_root)
    initial = models.load_model(cfg.backbone, cfg.pretrained, world=lab.WORLD)
    return erclip_sweeps.sweep_one(erclip.sweep_method(lab.WORLD), cfg, root, run, overrides, seed, pool, initial,
                                   measure, keep_weights=False)


def demo_sweep_base(cfg: erclip.ERCLIPConfig, root) -> dict:
    """The pretrained weights measured (a job too: one torch thread, as every run)."""
    measured = erclip_sweeps.sweep_run(root, "CLIP", lambda folder: {"measures": [demo.measure_pretrained(cfg)]})
    return measured["measures"][0]


def run_demo_sweep(cfg: erclip.ERCLIPConfig, sizes=None, processes: int = lab.PROCESSES):
    """--demo --sweep NAME: every run of the sweep once per seed in lab.seeds()
    from the same pretrained weights (same seed, same data order across runs),
    `processes` runs at a time (lab.run_jobs; the same numbers for any count);
    claims from the paired differences, the figure, one results file."""
    t0, name = time.time(), cfg.sweep
    root = lab.hold_out(Path(cfg.out) / f"sweep-{name}")
    full = lab.synthetic_manifest("train", cfg.data_root)
    pool = {"epochs": lambda: erclip_sweeps.prefix_manifest(full, DEMO_EPOCH_POOL, root / "epoch-pool.jsonl"),
            "data-size": lambda: full}.get(name, lambda: None)()
    base = lab.run_jobs(demo_sweep_base, [(cfg, root)], 1)[0]
    jobs = [(cfg, root, run, over, seed, pool) for k, seed in enumerate(lab.seeds())
            for run, over in demo_plan(name, sizes or DEMO_DATA_SIZES, k == 0)]
    records = lab.run_jobs(demo_sweep_job, jobs, processes, lambda i, r: print(
        f"[erclip sweep] {r['name']} seed {r['seed']}: {time.time() - t0:.0f}s so far", file=sys.stderr))
    rows = {}
    for r in records:  # seed-major: every row's list is in lab.seeds() order
        for k, m in enumerate(r["measures"], 1):
            rows.setdefault(f"{r['name']} epoch {k}" if name == "epochs" else r["name"], []).append(
                {**m, "seed": r["seed"], "train_seconds": r["summary"]["train_seconds"]})
    head = (f"ERCLIP sweep '{name}' on the lab: {DEMO_SWEEP_NOTES[name]}. Tiny backbone, seeds {list(lab.seeds())}, "
            f"{cfg.steps} steps x batch {cfg.batch_size}, lr {cfg.lr:g} (the demo's settings). Columns as in the "
            f"demo; mean ± std over seeds.")
    claims = sweep_claims(name, base, rows)
    lab.report_demo(root, head, base, rows, claims, demo.DEMO_COLS, t0, lambda o: sweep_figure(
        name, base, rows, o / f"erclip-sweep-{name}.png", f"python erclip.py --demo --sweep {name}; seeds "
        f"{list(lab.seeds())}; band: ±1 std over seeds; dots: seeds"), config=dataclasses.asdict(cfg),
        sweep=name, definition=DEMO_SWEEP_NOTES[name], processes=processes)
    return {"base": base, "per_seed": rows, "claims": claims}


def sweep_markdown(path, timing: str = "") -> str:
    """The README block of a demo sweep, from its results file alone:
    python -c "from lab.demos import erclip_sweeps as s; print(s.sweep_markdown('docs/erclip-sweep-epochs.json'))"
    timing: a remark on the wall time (e.g. that the machine was shared)."""
    r = from_json(Path(path).read_text(), restore=True, strict=False)  # NaN: null in strict files
    m = r["machine"]
    head = (f"`python erclip.py --demo --sweep {r['sweep']}`: {r['definition']}. Seeds {r['seeds']}; "
            f"{m['cores']} cores ({m['cpu']}), torch {m['torch']}, {report.threads(r)}, wall time "
            f"{r['wall_seconds']:.0f} s"
            f"{f' ({timing})' if timing else ''}; from [`{path}`]({path}).")
    table = lab.mean_std_table({"CLIP": [r["base"]], **r["per_seed"]}, SWEEP_README_COLS)
    return f"{head}\n\n{table}\n\n{lab.claims_table(r['claims'])}"

