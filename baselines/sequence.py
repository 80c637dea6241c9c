"""The task sequence the continual baselines share (issue 60): C-CLIP's protocol as cclip.py runs it, with the
baseline's step, its end-of-task work and its state at a task boundary handed in.

Each baseline file (zscl.py, lwf.py, ewc.py) holds its paper's math: the config, the pure losses, a
common.Method wrapper and a `Baseline` (below) that says what changes between tasks. This module is the part they
share and no paper owns: the sequence of common.run_continual (R[i][j] after every task, BWT, forgetting, unseen
retrieval, zero-shot PD), papers.cclip_tasks' tasks, evaluation sets and per-task learning rates, common.train for
each task (AMP, DDP, --resume mid-task), the run folder (config.json, continual.json, results.json of
plumbing.results' schema, task folders' model.pt, model.pt and --export at the end). It is cclip.py's `run` /
`main` with the LoRA and CKC parts taken out; cclip.py is not imported: C-CLIP's protocol without C-CLIP is
what these rows share (baselines/maps.py imports dns.py, whose maps are its setting).

A boundary's state (common.run_continual's boundary.pt) is the model, plus, when the baseline keeps any (EWC's
Fisher and anchor), `boundary-state.pt` beside it: a resumed sequence starts the next task exactly where an
uninterrupted one would (tests/test_baselines.py compares the two)."""
from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import torch

import common
from plumbing.base import markdown_table
from plumbing.flags import parse_config
from plumbing.loading import load_weights_only
from plumbing.manifests import dist_info
from plumbing.runfolder import write_config
import eval as evaluation
from baselines import settings
from baselines.settings import SequenceConfig
from papers import cclip_tasks
from papers import zscl_mtil as zscl_report
from plumbing import loading, models, results

STATE = "boundary-state.pt"  # a baseline's own state at a task boundary, beside run_continual's boundary.pt


class Interrupted(Exception):
    """Raised when --stop-at / --stop-after-tasks end a run early (tests of resume)."""


class Baseline:
    """What a baseline changes between tasks; the default is plain fine-tuning (every hook a no-op).
    start(model, eval_tf, tokenizer): once, on the pretrained model, before any boundary is loaded (ZSCL keeps
    it as its teacher and reads its reference set with the evaluation transform).
    net(model, i, cfg) -> (common.Method, hooks or None): task i's training wrapper (common.train's hooks).
    end_task(model, net, i, dataset, collate, cfg) -> dict: after task i's training, before its evaluation (EWC's
    Fisher, ZSCL's weight ensemble); what it returns joins the task's summary.
    state() / load_state(d): the tensors a boundary keeps besides the model ({} for none)."""

    name = "finetune"

    def start(self, model, eval_tf, tokenizer):
        pass

    def net(self, model, i, cfg):
        raise NotImplementedError

    def end_task(self, model, net, i, dataset, collate, cfg) -> dict:
        return {}

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict):
        pass


def make_lr_of(lr_image: float, lr_text: float, lr_rest: float):
    """Per-encoder learning rates (C-CLIP Sec. 5.2.3): image tower, text tower, logit scale at --lr."""
    def lr_of(name):
        if name.startswith("model.visual."):
            return lr_image
        if name in ("model.logit_scale", "model.logit_bias"):
            return lr_rest
        return lr_text  # token/positional embedding, text transformer, ln_final, text_projection
    return lr_of


def run(cfg: SequenceConfig, baseline: Baseline, world=None, first_row: dict | None = None) -> dict:
    """The continual sequence of one baseline; returns common.run_continual's summary (world: the lab's)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = common.init_distributed(cfg.device)
    rank = dist_info()[0]
    tasks = cclip_tasks.resolve_tasks(cfg, world)
    unseen, zero_shot = cclip_tasks.resolve_eval_sets(cfg)
    torch.manual_seed(cfg.seed)  # random-init backbones are reproducible too (resume tests)
    model, train_tf, eval_tf, tokenizer = models.load_model(
        cfg.backbone, cfg.pretrained, device=device, cache_dir=cfg.cache_dir, world=world)
    baseline.start(model, eval_tf, tokenizer)
    out = Path(cfg.out)

    def learn_task(i, task, task_out, resume):
        if cfg.stop_after_tasks and i >= cfg.stop_after_tasks:
            raise Interrupted(f"stopped before task {i + 1} (--stop-after-tasks)")
        torch.manual_seed(cfg.seed + i)  # what the baseline draws at a task's start, the same on resume
        net, hooks = baseline.net(model, i, cfg)
        lr_image, lr_text = cclip_tasks.task_lrs(cfg, task.name)
        task_cfg = dataclasses.replace(cfg, out=str(task_out), resume="latest" if resume else "",
                                       train_data=task.train)
        dataset = common.training_set(
            cfg, task.train, cclip_tasks.train_transform(cfg, task.name, train_tf, eval_tf))
        collate = common.Collate(tokenizer)
        summary = common.train(task_cfg, net, dataset, collate, lr_of=make_lr_of(lr_image, lr_text, cfg.lr),
                               export=False, hooks=hooks)
        if "stopped_at" in summary:
            raise Interrupted(f"stopped in task {i + 1} at step {summary['stopped_at']} (--stop-at)")
        summary.update(baseline.end_task(model, net, i, dataset, collate, cfg))
        model.requires_grad_(True)
        if rank == 0:
            models.save_model(model, Path(task_out) / "model.pt", cfg.backbone,
                              source=f"{baseline.name} task {i + 1}", twin=cfg.task_safetensors)
        return {**summary, "lr_image": lr_image, "lr_text": lr_text}

    def evaluate():  # a row of the matrices as cclip.py's: R@1 both ways and their mean (MTIL: top-1)
        names, extra = [t.test for t in tasks], ([unseen] if unseen else []) + list(zero_shot)
        records = evaluation.evaluate(model, eval_tf, tokenizer, [*names, *extra], cfg.data_root,
                                      device=device, synthetic_n=cfg.eval_n or None)
        return cclip_tasks.continual_row(records, names, extra)

    def save_state(path):  # the model, then the baseline's own tensors beside it
        if rank == 0:
            state = baseline.state()
            if state:
                loading._atomic_save({k: v.detach().cpu() for k, v in state.items()}, Path(path).parent / STATE)
            models.save_model(model, path, cfg.backbone, source=f"{baseline.name} task boundary", twin=False)

    def load_state(path):
        model.load_state_dict(load_weights_only(path, map_location=device))
        if (Path(path).parent / STATE).exists():
            baseline.load_state(load_weights_only(Path(path).parent / STATE, map_location=device))

    if rank == 0 and not (out / "config.json").exists():  # main's preflight wrote it (+ resume)
        out.mkdir(parents=True, exist_ok=True)
        write_config(cfg, out)
    summary = common.run_continual(
        out, tasks, learn_task, evaluate, save_state, load_state, resume=bool(cfg.resume),
        log=lambda m: print(f"[{baseline.name}] {m}", file=sys.stderr), first_row=first_row)
    if rank == 0:
        models.save_model(model, out / "model.pt", cfg.backbone, source=f"{baseline.name} sequence")
        if cfg.export:  # the final model, in open_clip's hub layout (results kept if it fails)
            summary.update(models.export_after_training(model, cfg.export, cfg.backbone, out / "model.pt"))
        common.write_results(out, results.of_sequence(baseline.name, summary, tasks), cfg)
    return summary


def main(config_class, make_baseline, argv=None, demo=None):
    """A baseline's command: parse (config_class), check the data before a model, run the sequence, print the
    user's numbers, the R[i][j] tables and the C-CLIP-shaped headline row. make_baseline(cfg) -> Baseline."""
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = parse_config(config_class, argv)
    settings.refuse_unbuilt(cfg, f"python -m {config_class.__module__}")
    world = None
    if models.wants_lab(cfg):  # --backbone tiny / --tasks synthetic: the lab's world, handed on
        from lab import WORLD as world  # the one upward import: the lab's world when the command names it
    cfg, tasks = cclip_tasks.checked_tasks(cfg, world)  # --tasks auto, the rows, --out: before a model
    baseline = make_baseline(cfg, world)
    try:
        summary = run(cfg, baseline, world=world)
    except Interrupted as e:
        print(f"[{baseline.name}] {e}; continue with --resume latest", file=sys.stderr)
        return {"interrupted": str(e)}
    print(results.sequence_table(summary, tasks))  # the user's numbers first (issue 42.3)
    print(f"\n{cclip_tasks.matrix_heading(baseline.name, [t.test for t in tasks])}\n")
    print(evaluation.continual_tables(summary, [t.name for t in tasks]))
    if "mtil" in summary:  # ZSCL's Transfer / Average / Last, as cclip.py and dns.py print them
        return zscl_report.report(baseline.name, summary, tasks, cfg.backbone)
    row = {"method": baseline.name,
           **evaluation.continual_headline(summary, *cclip_tasks.resolve_eval_sets(cfg))}
    table = markdown_table([row], list(row))
    print(f"\n## {baseline.name} (C-CLIP Sec. 5.2.1 shape)\n\n{table}")
    return {"rows": [row], "table": table, "summary": summary}


def frozen_copy(model):
    """A deep copy of `model` in eval mode with no gradient (a teacher)."""
    return copy.deepcopy(model).requires_grad_(False).eval()
