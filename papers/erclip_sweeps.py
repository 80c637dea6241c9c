"""ERCLIP's sweeps on real data (Sec. 4.3 Fig. 3, Sec. 4.4): training length, lambda_p, data size, and the
component ablations (two of them not run in the paper); and the folder plumbing every sweep uses (the lab's
too): one folder per run, resume by skipping finished runs, prefixes of one fixed data order, per-epoch
snapshots. Experiment orchestration, not method: erclip.py's main() dispatches here and hands over what a
sweep needs of it (Method: this module imports no method file and not the lab).

  python erclip.py --sweep NAME --backbone ViT-B/16 --train-data coco-sharegpt4v --out OUT

NAME: epochs | lambda-p | data-size | ablations. Each run in OUT/sweep-NAME/<run>-seed<k>/ (a sweep started
again skips finished runs); one results file OUT/sweep-NAME/results.json. The sweep runs the single run's
preflight (rows, --out lock, resume settings) before any model is loaded. The choices (schedules) are
erclip.py's deviation 14, discussed in docs/erclip.md; the paper's printed points live in eval.py
(ERCLIP_LAMBDA_IN, ERCLIP_DATA, ERCLIP_EPOCH_CHANGE, ERCLIP_TABLE2). The lab's sweeps (--demo --sweep
NAME; docs/erclip.md, deviation 16) are lab/demos/erclip_sweeps.py, on this module."""
from __future__ import annotations

import copy
import dataclasses
import json
import re
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from plumbing import manifests, models, published, runfolder
from plumbing.results import document, from_json, staged, to_json
import common
from plumbing.base import UsageError, atomic_write, markdown_table
from plumbing.manifests import IMAGE_KEYS, read_manifest
import eval as evaluation


# =============================================================================
# Sweeps: one folder per run, resume by skipping finished runs, prefixes, snapshots
# =============================================================================


def sweep_run(out, name: str, fn: Callable[[Path], dict]) -> dict:
    """One run of a sweep, in its own folder out/name. A finished run (its
    run.json exists) is read back and skipped, so a sweep that stopped part
    way resumes at the first unfinished run; an unfinished folder is cleared
    and its run starts afresh (runs are never continued from a half state).
    fn(folder) trains and measures; its dict is written to folder/run.json."""
    folder = Path(out) / name
    done = folder / "run.json"
    if done.exists():
        print(f"[sweep] {name}: finished earlier, skipped ({done})", file=sys.stderr)
        return from_json(done.read_text(), restore=True)
    runfolder.remove_run_folder(folder)
    folder.mkdir(parents=True)
    record = {"run": name, **fn(folder)}
    atomic_write(done, to_json(record))
    return record




def prefix_manifest(src, n: int, dst) -> Path:
    """The first n rows of a manifest (all of them when it has fewer), image
    paths made absolute so that the copy can live anywhere: a data-size sweep
    trains on prefixes of ONE fixed order."""
    src = Path(src)
    rows = read_manifest(src)
    key = next((k for k in IMAGE_KEYS if rows and k in rows[0]), None)
    lines = []
    for r in rows[:n]:
        r = {k: v for k, v in r.items() if k != "_line"}
        if key is not None:
            r[key] = str((src.parent / str(r[key])).resolve())
        lines.append(json.dumps(r))
    if len(rows) < n:
        print(f"[sweep] {src} has {len(rows)} rows, fewer than {n}: all of them are used", file=sys.stderr)
    return atomic_write(dst, "\n".join(lines) + "\n")


class EpochSnapshots:
    """Hooks for common.train that keep the model's weights after the last
    step of every epoch: saved (models.save_model) to folder/epoch<k>.pt, or
    with folder=None kept in memory (the lab's small models). One run thus
    gives the per-epoch checkpoints a training-length sweep evaluates
    afterwards. Reads the weights only (no gradient, no random number), so
    the run is the one it would be without the hooks. The copy is taken
    before train_step's logit-scale clamp, a no-op unless the temperature is
    trained past ln 100. snapshots: one path or state_dict per epoch."""

    def __init__(self, folder, backbone: str, steps_per_epoch: int):
        self.folder, self.backbone, self.steps_per_epoch = folder, backbone, max(1, steps_per_epoch)
        self.step, self.snapshots = 0, []

    def before_optimizer_step(self, net):
        pass

    def after_optimizer_step(self, net):
        self.step += 1
        if self.step % self.steps_per_epoch or manifests.dist_info()[0] != 0:
            return
        if self.folder is None:
            self.snapshots.append({k: v.detach().clone() for k, v in net.model.state_dict().items()})
        else:
            path = Path(self.folder) / f"epoch{self.step // self.steps_per_epoch}.pt"
            self.snapshots.append(models.save_model(net.model, path, self.backbone, source=f"step {self.step}"))


# =============================================================================
# ERCLIP's sweeps: the schedules, one run, the real setting, its tables
# =============================================================================
class Method(NamedTuple):
    """What a sweep needs of erclip.py (erclip.sweep_method() makes it when called, so that a name patched
    there is the one run)."""
    train_manifest: Callable  # cfg -> the training manifest (erclip.train_manifest)
    train: Callable  # (cfg, model, train_tf, tokenizer, hooks=) -> (model, summary) (erclip.train_erclip)
    paper_tables: Callable  # (ours, vit) -> Tables 1 and 2 beside the paper's rows (erclip.paper_tables)
    train_pool: str  # the paper's training pool, --train-data's name (erclip.TRAIN_POOL)
    world: object = None  # the lab's (plumbing.models.LabWorld), when the lab runs the sweep


# Every run of a sweep starts from the same initial weights in its own folder
# (sweep_run: a finished run is skipped when the sweep is started again).
VARIANTS = {"M": dict(fusion="mean", lambda_p=0.0), "M+P": dict(fusion="mean", lambda_p=1.0),
            "RT+P": dict(fusion="rt", lambda_p=1.0),
            "RT": dict(fusion="rt", lambda_p=0.0),                         # not run in the paper (Sec. 4.4)
            "L_short only": dict(fusion="mean", lambda_p=0.0, alpha=0.0)}  # not run in the paper (Sec. 4.4)
EPOCHS = 5                                      # Sec. 4, 4.3: every run evaluated after each of 5 epochs
LAMBDAS = (0.0, 0.25, 0.5, 1.0, 2.0)            # Sec. 4.4
DATA_SIZES = (1000, 5000, 10000, 20000, 50000)  # Sec. 4.4, pairs: prefixes of the COCO image-id order
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


def sweep_one(method: Method, cfg, root, run: str, overrides: dict, seed: int, pool, initial, measure,
              keep_weights=True) -> dict:
    """One run (sweep_run: folder root/run, skipped when finished): a copy
    of the initial weights (model, train_tf, preprocess, tokenizer), method.train
    with the overrides, then measure(model, preprocess, tokenizer, weights)
    after training or, in the epochs sweep, on each epoch's checkpoint. pool:
    the manifest that 'train_pairs' takes a prefix of."""
    def go(folder):
        over = dict(overrides)
        if "train_pairs" in over:
            over["train_data"] = str(prefix_manifest(pool, over["train_pairs"], folder / "pairs.jsonl"))
        elif pool is not None:
            over["train_data"] = str(pool)
        over["train_pairs"] = 0 if pool is not None else cfg.train_pairs
        rcfg = dataclasses.replace(cfg, **over, seed=seed, out=str(folder), resume="", stop_at=0, sweep="")
        model, train_tf, preprocess, tokenizer = initial
        model = copy.deepcopy(model)  # the same initial weights for every run
        torch.manual_seed(seed)  # the fusion module's initialisation, as in run_demo
        hooks = None
        if "epochs" in overrides:
            rows = common.ManifestDataset(method.train_manifest(rcfg), need_long=True, check_images=False,
                                          skip_bad=rcfg.skip_bad)
            hooks = EpochSnapshots(folder if keep_weights else None, cfg.backbone, len(rows) // rcfg.batch_size)
        model, summary = method.train(rcfg, model, train_tf, tokenizer, hooks=hooks)
        if hooks is None:
            measures = [measure(model, preprocess, tokenizer, folder / "model.pt")]
        else:
            measures = []
            for snap in hooks.snapshots:  # the trained model object takes each epoch's weights in turn
                model.load_state_dict(torch.load(snap, map_location="cpu") if isinstance(snap, Path) else snap)
                measures.append(measure(model, preprocess, tokenizer, snap if isinstance(snap, Path) else None))
        if not keep_weights:  # the lab: the numbers are what is kept
            runfolder.drop_weights(folder)
        print(f"[erclip sweep] {run} seed {seed}: trained in {summary['train_seconds']:.0f}s", file=sys.stderr)
        return {"name": run, "overrides": over, "prefix": overrides.get("train_pairs"), "seed": seed,
                "summary": summary, "measures": measures}
    folder = re.sub(r"[^\w.=+-]+", "_", run)  # "L_short only" -> L_short_only
    return sweep_run(root, f"{folder}-seed{seed}", go)


def run_sweep(method: Method, cfg, sizes=None):
    """--sweep NAME in the real setting: the paper's backbone, data and
    evaluation tasks; one results file, the paper's layout printed."""
    if manifests.dist_info()[1] > 1:
        raise UsageError("--sweep runs its runs one after another in one process (the paper used one "
                                "GPU); start it with python, not torchrun")
    if cfg.sweep == "epochs" and cfg.steps:  # every run would stop at the same step, before its epochs' ends
        raise UsageError(f"--sweep epochs sets each run's --epochs and measures every epoch's end; "
                                f"--steps {cfg.steps} would cut every run short: drop --steps")
    t0, name = time.time(), cfg.sweep
    root = Path(cfg.out) / f"sweep-{name}"  # the preflight below locks --out for the sweep's whole length
    tasks = evaluation.task_list(cfg.eval_tasks, cfg.train_data, published.ERCLIP_EVAL_TASKS,
                                 published.ERCLIP_SYNTHETIC_TASKS)
    evaluation.check_tasks(tasks, cfg.data_root)
    sizes = sizes or DATA_SIZES
    big = dataclasses.replace(cfg, train_pairs=max(sizes)) if cfg.train_data == method.train_pool else cfg
    pool = method.train_manifest(big) if name == "data-size" else None  # fails at once when the data is missing
    manifest = pool if pool is not None else method.train_manifest(cfg)
    common.preflight(cfg, [manifest], need_long=True)  # rows, --out, resume settings: before any model is loaded

    def measure(model, preprocess, tokenizer, weights):
        return evaluation.evaluate(model, preprocess, tokenizer, tasks, cfg.data_root, model_name=cfg.backbone,
                                   weights=str(weights))

    torch.manual_seed(cfg.seed)  # the initial weights when --pretrained random
    initial = models.load_model(cfg.backbone, cfg.pretrained, cache_dir=cfg.cache_dir, world=method.world)
    device = common.init_distributed(cfg.device)

    def base(folder):
        model = copy.deepcopy(initial[0]).to(device)
        return {"measures": [measure(model, *initial[2:], cfg.pretrained or "pretrained")]}
    base_records = sweep_run(root, "CLIP", base)["measures"][0]
    runs = [sweep_one(method, cfg, root, run, over, cfg.seed, pool, initial, measure)
            for run, over in sweep_plan(name, sizes)]
    text = sweep_tables(name, base_records, runs, published.vit_key(cfg.backbone), method.paper_tables)
    print(text)
    records = staged(base_records, "base") + [  # the one schema (plumbing.results); stage: the run's name
        r for run in runs for e, m in enumerate(run["measures"], 1)
        for r in staged(m, run["name"] + (f", epoch {e}" if len(run["measures"]) > 1 else ""), seed=run["seed"])]
    common.write_results(root, document("erclip sweep", records, **{
        "sweep": name, "base": base_records, "runs": runs, "tables": text, "config": dataclasses.asdict(cfg),
        "machine": runfolder.machine_info(), "wall_seconds": time.time() - t0}))
    return {"base": base_records, "runs": runs, "tables": text}


def _metrics(records) -> dict:
    """Table 2's metrics of one evaluation, plus the means of I2T and T2I ('Long avg', 'COCO')."""
    row = published.erclip_rows(records, "", "")[1]
    for key in ("Long avg", "COCO"):
        i2t, t2i = row[f"{key} I2T"], row[f"{key} T2I"]
        row[key] = None if None in (i2t, t2i) else (i2t + t2i) / 2
    return row


def sweep_tables(name: str, base: list, runs: list[dict], vit: str, paper_tables: Callable | None = None) -> str:
    """The real setting's sweep in the paper's layout, the paper's printed
    numbers beside ours (Fig. 3 prints none: Sec. 4.3's ranges instead).
    paper_tables: erclip.paper_tables (Method.paper_tables), for the ablations."""
    if name == "ablations":
        return ("Component ablations (Sec. 4.4): the paper's Table 2 rows beside ours; RT (no L_pres) and "
                "L_short only (alpha = 0) are the two runs the paper names as not run.\n\n"
                + paper_tables([("CLIP", base, 0.0)] + [(r["run"].rsplit("-seed", 1)[0], r["measures"][0],
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
                + markdown_table(rows, ["variant", "epoch", *cols], "{:.2f}")
                + f"\n\nChange from epoch 1 to epoch {len(runs[0]['measures'])} (points)\n\n"
                + markdown_table(change, ["variant", "Long avg", "COCO", "C10", "IN"], "{:+.2f}"))
    if name == "lambda-p":
        rows = [{"lambda_p": "CLIP", **_metrics(base)}] + [
            {"lambda_p": f"{r['overrides']['lambda_p']:g}", **_metrics(r["measures"][0]),
             "paper IN": PAPER_LAMBDA_IN.get(r["overrides"]["lambda_p"], "-")} for r in runs]
        return (f"Preservation weight (Sec. 4.4), M, ViT {vit}; paper: ImageNet rises monotonically 58.2 -> "
                f"60.8, long and COCO R@1 rise by up to 1.3 and plateau for lambda_p >= 0.5, C10 within 0.4\n\n"
                + markdown_table(rows, ["lambda_p", *cols, "paper IN"], "{:.2f}"))
    rows = [{"pairs": "CLIP", **_metrics(base)}]
    for r in runs:
        paper = PAPER_DATA.get(r["prefix"], {})
        rows.append({"pairs": r["prefix"], "used": r["summary"]["train_pairs"], **_metrics(r["measures"][0]),
                     **{f"paper {k}": paper.get(k, "-") for k in ("long", "COCO", "IN")}})
    return (f"Data size (Sec. 4.4), M+P, ViT {vit}, prefixes of one pool order; R@1 'long' / 'COCO' = mean of "
            f"I2T and T2I\n\n" + markdown_table(
                rows, ["pairs", "used", *cols, "paper long", "paper COCO", "paper IN"], "{:.2f}"))
