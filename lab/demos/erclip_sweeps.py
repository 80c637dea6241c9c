"""ERCLIP's sweeps (Sec. 4.3 Fig. 3, Sec. 4.4): training length, lambda_p,
data size, and the component ablations (two of them not run in the paper).
Experiment orchestration, not method: erclip.py's main() dispatches here.

  python erclip.py --sweep NAME --backbone ViT-B/16 --train-data coco-sharegpt4v --out OUT   (real data)
  python erclip.py --demo --sweep NAME                                                     (the lab)

NAME: epochs | lambda-p | data-size | ablations. Each run in OUT/sweep-NAME/<run>-seed<k>/ (a sweep
started again skips finished runs); one results file OUT/sweep-NAME/results.json. The real sweep
runs the single run's preflight (rows, --out lock, resume settings) before any model is loaded.
The choices (schedules, the lab's stand-ins) are erclip.py's deviations 14 and 15, discussed in
docs/erclip.md; the paper's printed points live in eval.py (ERCLIP_LAMBDA_IN, ERCLIP_DATA,
ERCLIP_EPOCH_CHANGE, ERCLIP_TABLE2)."""
from __future__ import annotations

import copy
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

from plumbing import manifests
import common
import erclip
import eval as evaluation
import lab
from lab import report
from lab.demos import erclip as demo
from plumbing import published

# Every run of a sweep starts from the same initial weights in its own folder
# (lab.sweep_run: a finished run is skipped when the sweep is started again).
VARIANTS = {"M": dict(fusion="mean", lambda_p=0.0), "M+P": dict(fusion="mean", lambda_p=1.0),
            "RT+P": dict(fusion="rt", lambda_p=1.0),
            "RT": dict(fusion="rt", lambda_p=0.0),                         # not run in the paper (Sec. 4.4)
            "L_short only": dict(fusion="mean", lambda_p=0.0, alpha=0.0)}  # not run in the paper (Sec. 4.4)
EPOCHS = 5                                      # Sec. 4, 4.3: every run evaluated after each of 5 epochs
LAMBDAS = (0.0, 0.25, 0.5, 1.0, 2.0)            # Sec. 4.4
DATA_SIZES = (1000, 5000, 10000, 20000, 50000)  # Sec. 4.4, pairs: prefixes of the COCO image-id order
# The lab's stand-ins (ours, fixed before the seeds ran): the pool is the world's 'train' split
# (2,000 scenes), so the paper's sizes scale by 2,000 / 50,000 at the demo's fixed 40 steps; an
# "epoch" is one pass over the first 256 scenes (8 steps of 32), so the 40 steps are 5 epochs.
DEMO_DATA_SIZES = (40, 200, 400, 800, 2000)
DEMO_EPOCH_POOL = 256
# The paper's printed points: published.ERCLIP_LAMBDA_IN, ERCLIP_DATA (Sec. 4.4), ERCLIP_EPOCH_CHANGE (Sec. 4.3).
PAPER_LAMBDA_IN, PAPER_DATA = published.ERCLIP_LAMBDA_IN, published.ERCLIP_DATA
METRIC_COLS = published.erclip_cols()[1][3:]  # Long avg I2T ... IN


def sweep_plan(name: str, sizes=DATA_SIZES) -> list[tuple[str, dict]]:
    """(run name, config overrides) of a sweep, in order; 'train_pairs' means
    a prefix of the pool."""
    if name == "epochs":
        return [(v, dict(VARIANTS[v], epochs=EPOCHS)) for v in ("M", "M+P", "RT+P")]
    if name == "lambda-p":
        return [(f"lambda_p={lp:g}", dict(fusion="mean", lambda_p=lp)) for lp in LAMBDAS]
    if name == "data-size":
        return [(f"N={n}", dict(VARIANTS["M+P"], train_pairs=n)) for n in sizes]
    return list(VARIANTS.items())


def demo_plan(name: str, sizes, first_seed: bool = True) -> list[tuple[str, dict]]:
    """The lab's runs of a sweep: the paper's, plus in 'epochs' the demo's
    pre-registered RT+P with the fusion's own lr (lab/demos/erclip.py); there
    RT+P at the encoders' lr (M+P by construction) runs on the first seed only,
    as the check (demo.CHECK_ONLY)."""
    own = [("RT+P own lr", dict(VARIANTS["RT+P"], epochs=EPOCHS, fusion_lr=demo.DEMO_FUSION_LR))]
    if name != "epochs":
        return sweep_plan(name, sizes)
    return [r for r in sweep_plan(name, sizes) if first_seed or r[0] not in demo.CHECK_ONLY] + own


def sweep_one(cfg, root, run: str, overrides: dict, seed: int, pool, initial, measure, keep_weights=True) -> dict:
    """One run (lab.sweep_run: folder root/run, skipped when finished): a copy
    of the initial weights (model, train_tf, preprocess, tokenizer), train_erclip
    with the overrides, then measure(model, preprocess, tokenizer, weights)
    after training or, in the epochs sweep, on each epoch's checkpoint. pool:
    the manifest that 'train_pairs' takes a prefix of."""
    def go(folder):
        over = dict(overrides)
        if "train_pairs" in over:
            over["train_data"] = str(lab.prefix_manifest(pool, over["train_pairs"], folder / "pairs.jsonl"))
        elif pool is not None:
            over["train_data"] = str(pool)
        over["train_pairs"] = 0 if pool is not None else cfg.train_pairs
        rcfg = dataclasses.replace(cfg, **over, seed=seed, out=str(folder), resume="", stop_at=0, sweep="")
        model, train_tf, preprocess, tokenizer = initial
        model = copy.deepcopy(model)  # the same initial weights for every run
        torch.manual_seed(seed)  # the fusion module's initialisation, as in run_demo
        hooks = None
        if "epochs" in overrides:
            rows = common.ManifestDataset(erclip.train_manifest(rcfg), need_long=True, check_images=False,
                                          skip_bad=rcfg.skip_bad)
            hooks = lab.EpochSnapshots(folder if keep_weights else None, cfg.backbone, len(rows) // rcfg.batch_size)
        model, summary = erclip.train_erclip(rcfg, model, train_tf, tokenizer, hooks=hooks)
        if hooks is None:
            measures = [measure(model, preprocess, tokenizer, folder / "model.pt")]
        else:
            measures = []
            for snap in hooks.snapshots:  # the trained model object takes each epoch's weights in turn
                model.load_state_dict(torch.load(snap, map_location="cpu") if isinstance(snap, Path) else snap)
                measures.append(measure(model, preprocess, tokenizer, snap if isinstance(snap, Path) else None))
        if not keep_weights:  # the lab: the numbers are what is kept
            lab.drop_weights(folder)
        print(f"[erclip sweep] {run} seed {seed}: trained in {summary['train_seconds']:.0f}s", file=sys.stderr)
        return {"name": run, "overrides": over, "prefix": overrides.get("train_pairs"), "seed": seed,
                "summary": summary, "measures": measures}
    folder = re.sub(r"[^\w.=+-]+", "_", run)  # "L_short only" -> L_short_only
    return lab.sweep_run(root, f"{folder}-seed{seed}", go)


def run_sweep(cfg: erclip.ERCLIPConfig, sizes=None):
    """--sweep NAME: the real setting (the paper's backbone, data and
    evaluation tasks; one results file, the paper's layout printed), or with
    --demo the lab (3 seeds, claims, a figure)."""
    if cfg.demo:
        return run_demo_sweep(cfg, sizes)
    if manifests.dist_info()[1] > 1:
        raise common.UsageError("--sweep runs its runs one after another in one process (the paper used one GPU); "
                                "start it with python, not torchrun")
    if cfg.sweep == "epochs" and cfg.steps:  # every run would stop at the same step, before its epochs' ends
        raise common.UsageError(f"--sweep epochs sets each run's --epochs and measures every epoch's end; --steps "
                                f"{cfg.steps} would cut every run short: drop --steps")
    t0, name = time.time(), cfg.sweep
    root = Path(cfg.out) / f"sweep-{name}"  # the preflight below locks --out for the sweep's whole length
    tasks = evaluation.task_list(cfg.eval_tasks, cfg.train_data, published.ERCLIP_EVAL_TASKS,
                                 published.ERCLIP_SYNTHETIC_TASKS)
    evaluation.check_tasks(tasks, cfg.data_root)
    sizes = sizes or DATA_SIZES
    big = dataclasses.replace(cfg, train_pairs=max(sizes)) if cfg.train_data == erclip.TRAIN_POOL else cfg
    pool = erclip.train_manifest(big) if name == "data-size" else None  # fails at once when the data is missing
    manifest = pool if pool is not None else erclip.train_manifest(cfg)
    common.preflight(cfg, [manifest], need_long=True)  # rows, --out, resume settings: before any model is loaded

    def measure(model, preprocess, tokenizer, weights):
        return evaluation.evaluate(model, preprocess, tokenizer, tasks, cfg.data_root, model_name=cfg.backbone,
                                   weights=str(weights))

    torch.manual_seed(cfg.seed)  # the initial weights when --pretrained random
    initial = common.load_model(cfg.backbone, cfg.pretrained, cache_dir=cfg.cache_dir)
    device = common.init_distributed(cfg.device)

    def base(folder):
        model = copy.deepcopy(initial[0]).to(device)
        return {"measures": [measure(model, *initial[2:], cfg.pretrained or "pretrained")]}
    base_records = lab.sweep_run(root, "CLIP", base)["measures"][0]
    runs = [sweep_one(cfg, root, run, over, cfg.seed, pool, initial, measure) for run, over in sweep_plan(name, sizes)]
    text = sweep_tables(name, base_records, runs, published.vit_key(cfg.backbone))
    print(text)
    common.write_results(root, {"sweep": name, "base": base_records, "runs": runs, "tables": text,
                                "config": dataclasses.asdict(cfg), "machine": lab.machine_info(),
                                "wall_seconds": time.time() - t0})
    return {"base": base_records, "runs": runs, "tables": text}


def _metrics(records) -> dict:
    """Table 2's metrics of one evaluation, plus the means of I2T and T2I ('Long avg', 'COCO')."""
    row = published.erclip_rows(records, "", "")[1]
    for key in ("Long avg", "COCO"):
        i2t, t2i = row[f"{key} I2T"], row[f"{key} T2I"]
        row[key] = None if None in (i2t, t2i) else (i2t + t2i) / 2
    return row


def sweep_tables(name: str, base: list, runs: list[dict], vit: str) -> str:
    """The real setting's sweep in the paper's layout, the paper's printed
    numbers beside ours (Fig. 3 prints none: Sec. 4.3's ranges instead)."""
    if name == "ablations":
        return ("Component ablations (Sec. 4.4): the paper's Table 2 rows beside ours; RT (no L_pres) and "
                "L_short only (alpha = 0) are the two runs the paper names as not run.\n\n"
                + erclip.paper_tables([("CLIP", base, 0.0)] + [(r["run"].rsplit("-seed", 1)[0], r["measures"][0],
                                                         r["overrides"]["lambda_p"]) for r in runs], vit))
    cols = METRIC_COLS + ["Long avg", "COCO"]
    if name == "epochs":
        rows = [{"variant": "CLIP", "epoch": 0, **_metrics(base)}]
        change = []
        for r in runs:
            v = r["run"].rsplit("-seed", 1)[0]
            per = [_metrics(m) for m in r["measures"]]
            rows += [{"variant": v, "epoch": k, **m} for k, m in enumerate(per, 1)]
            change.append({"variant": v, **{c: per[-1][c] - per[0][c] if per[0][c] is not None and per[-1][c]
                                            is not None else None for c in ("Long avg", "COCO", "C10", "IN")}})
        change.append({"variant": "paper (Sec. 4.3)", **published.ERCLIP_EPOCH_CHANGE})
        return (f"Fig. 3 (Sec. 4.3): R@1 and zero-shot top-1 (%) after each epoch, ViT {vit}\n\n"
                + common.markdown_table(rows, ["variant", "epoch", *cols], "{:.2f}")
                + f"\n\nChange from epoch 1 to epoch {len(runs[0]['measures'])} (points)\n\n"
                + common.markdown_table(change, ["variant", "Long avg", "COCO", "C10", "IN"], "{:+.2f}"))
    if name == "lambda-p":
        rows = [{"lambda_p": "CLIP", **_metrics(base)}] + [
            {"lambda_p": f"{r['overrides']['lambda_p']:g}", **_metrics(r["measures"][0]),
             "paper IN": PAPER_LAMBDA_IN.get(r["overrides"]["lambda_p"], "-")} for r in runs]
        return (f"Preservation weight (Sec. 4.4), M, ViT {vit}; paper: ImageNet rises monotonically 58.2 -> 60.8, "
                f"long and COCO R@1 rise by up to 1.3 and plateau for lambda_p >= 0.5, C10 within 0.4\n\n"
                + common.markdown_table(rows, ["lambda_p", *cols, "paper IN"], "{:.2f}"))
    rows = [{"pairs": "CLIP", **_metrics(base)}]
    for r in runs:
        paper = PAPER_DATA.get(r["prefix"], {})
        rows.append({"pairs": r["prefix"], "used": r["summary"]["train_pairs"], **_metrics(r["measures"][0]),
                     **{f"paper {k}": paper.get(k, "-") for k in ("long", "COCO", "IN")}})
    return (f"Data size (Sec. 4.4), M+P, ViT {vit}, prefixes of one pool order; R@1 'long' / 'COCO' = mean of "
            f"I2T and T2I\n\n" + common.markdown_table(
                rows, ["pairs", "used", *cols, "paper long", "paper COCO", "paper IN"], "{:.2f}"))


# --- the lab: --demo --sweep NAME (the demo's settings, lab.SEEDS, claims fixed before the runs) ---
DEMO_SWEEP_NOTES = {
    "epochs": f"M, M+P, RT+P own lr, and RT+P (M+P by construction) on the first seed as the check; an epoch is one pass over the first {DEMO_EPOCH_POOL} scenes of "
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
        last = EPOCHS
        out = [lab.claim(f"long R@1 falls from epoch 1 to {last}, {v} (epoch {last} - epoch 1)",
                         published.ERCLIP_EPOCH_CHANGE["Long avg"], d(f"{v} epoch {last}", f"{v} epoch 1", "long"),
                         "-")
               for v in ("M", "M+P", "RT+P own lr")]
        out += [lab.claim(f"short R@1 rises from epoch 1 to {last}, {v}", "COCO " + published.ERCLIP_EPOCH_CHANGE["COCO"],
                          d(f"{v} epoch {last}", f"{v} epoch 1", "short"), "+") for v in ("M", "M+P", "RT+P own lr")]
        drift_m = d(f"M epoch {last}", "M epoch 1", "background")
        drift_p = d(f"M+P epoch {last}", "M+P epoch 1", "background")
        return out + [
            lab.claim(f"zero-shot falls from epoch 1 to {last} without P (M, {ZS})", "CIFAR-10 -1.2 to -1.8", drift_m, "-"),
            lab.claim(f"P limits that drift ((M+P) - M change from epoch 1 to {last}, {ZS})",
                      "CIFAR-10 B/32: -0.5 with P against -1.2 to -1.8 without", [p - m for p, m in zip(drift_p, drift_m)], "+"),
            lab.claim(f"RT+P reaches M+P by epoch 2 (RT+P - M+P at epoch 2, {ZS}; equal within 1 point)",
                      "CIFAR-10, Fig. 3", d("RT+P epoch 2", "M+P epoch 2", "background"), "=", margin=1.0,
                      by_construction=demo.BY_CONSTRUCTION),
            lab.claim(f"RT+P own lr is below M at epoch 1 ({ZS})", "CIFAR-10 -1.3 to -2.3 (B/32, B/16), Fig. 3",
                      d("RT+P own lr epoch 1", "M epoch 1", "background"), "-"),
            lab.claim(f"... and reaches M+P by epoch 2 (RT+P own lr - M+P at epoch 2, {ZS}; equal within 1 point)",
                      "CIFAR-10, Fig. 3", d("RT+P own lr epoch 2", "M+P epoch 2", "background"), "=", margin=1.0)]
    if name == "lambda-p":
        lp = [f"lambda_p={x:g}" for x in LAMBDAS]
        lo, hi = PAPER_LAMBDA_IN[0.0], PAPER_LAMBDA_IN[2.0]
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
            x, y = PAPER_DATA[a][k], PAPER_DATA[b][k]
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
                  f"{demo.rounded(min(back))} to {demo.rounded(max(back))}, every fusion)", d("RT+P", "RT", "background"), "+"),
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
        xs, series = list(range(EPOCHS + 1)), {v: ["CLIP"] + [f"{v} epoch {k}" for k in range(1, EPOCHS + 1)]
                                               for v in ("M", "M+P", "RT+P own lr")}  # RT+P: one seed, = M+P
        paper, xlabel = {}, f"epoch (1 epoch = {DEMO_EPOCH_POOL} pairs = 8 steps; 0 = CLIP)"
    elif name == "lambda-p":
        xs, series = list(LAMBDAS), {"mean fusion": [f"lambda_p={x:g}" for x in LAMBDAS]}
        paper = {"paper Sec. 4.4: ImageNet top-1 (%)": (list(PAPER_LAMBDA_IN), list(PAPER_LAMBDA_IN.values()))}
        xlabel = "lambda_p (weight of L_pres)"
    elif name == "data-size":
        xs, series = list(DEMO_DATA_SIZES), {"M+P": [f"N={x}" for x in DEMO_DATA_SIZES]}
        paper = {f"paper {k}": ([n for n in PAPER_DATA if k in PAPER_DATA[n]], [v[k] for v in PAPER_DATA.values()
                                                                                 if k in v]) for k in ("long", "COCO", "IN")}
        xlabel = "training pairs (prefix of one order)"
    else:
        xs, series = ["CLIP", *VARIANTS], {"ours": ["CLIP", *VARIANTS]}
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
    """One run of a demo sweep (a lab.run_jobs job): sweep_one from freshly loaded pretrained weights, measured
    by the demo's demo_measure, weights dropped."""
    def measure(model, preprocess, tokenizer, weights):
        return demo.demo_measure(model, preprocess, tokenizer, cfg.data_root)
    initial = common.load_model(cfg.backbone, cfg.pretrained)
    return sweep_one(cfg, root, run, overrides, seed, pool, initial, measure, keep_weights=False)


def demo_sweep_base(cfg: erclip.ERCLIPConfig, root) -> dict:
    """The pretrained weights measured (a job too: one torch thread, as every run)."""
    return lab.sweep_run(root, "CLIP", lambda folder: {"measures": [demo.measure_pretrained(cfg)]})["measures"][0]


def run_demo_sweep(cfg: erclip.ERCLIPConfig, sizes=None, processes: int = lab.PROCESSES):
    """--demo --sweep NAME: every run of the sweep once per seed in lab.seeds()
    from the same pretrained weights (same seed, same data order across runs),
    `processes` runs at a time (lab.run_jobs; the same numbers for any count);
    claims from the paired differences, the figure, one results file."""
    t0, name = time.time(), cfg.sweep
    root = lab.hold_out(Path(cfg.out) / f"sweep-{name}")
    full = lab.synthetic_manifest("train", cfg.data_root)
    pool = {"epochs": lambda: lab.prefix_manifest(full, DEMO_EPOCH_POOL, root / "epoch-pool.jsonl"),
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
    r = json.loads(Path(path).read_text())
    m = r["machine"]
    head = (f"`python erclip.py --demo --sweep {r['sweep']}`: {r['definition']}. Seeds {r['seeds']}; "
            f"{m['cores']} cores ({m['cpu']}), torch {m['torch']}, {report.threads(r)}, wall time "
            f"{r['wall_seconds']:.0f} s"
            f"{f' ({timing})' if timing else ''}; from [`{path}`]({path}).")
    table = lab.mean_std_table({"CLIP": [r["base"]], **r["per_seed"]}, SWEEP_README_COLS)
    return f"{head}\n\n{table}\n\n{lab.claims_table(r['claims'])}"

