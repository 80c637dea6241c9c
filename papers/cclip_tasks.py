"""C-CLIP's plumbing (cclip.py's, no other method's): the paper's 8 tasks in the order of Sec. 3.2 as
data/vlcl/<name>/{train,test}.jsonl (python -m commands.vlcl builds them), --tasks into the task sequence,
the unseen retrieval set and zero-shot sets each --tasks is evaluated on (deviation 9), the paper's
per-task learning rates (Sec. 5.2.3, --lr-preset paper), the research code's schedule, --schedule
research (deviation 13), its start of task 5 on (--merge-schedule research, deviation 1) and its training transform of
the fractionally split tasks (--train-transform research, deviation 15)."""
from __future__ import annotations

import math
from pathlib import Path

import common
from plumbing.loading import load_weights_only
from plumbing import models, results
from protocols import mtil
import eval as evaluation

PAPER_TASKS = ("flickr30k", "coco", "pets", "lexica", "simpsons", "wikiart", "kream", "sketch")  # Sec. 3.2 order
PAPER_ZERO_SHOT = ("imagenet", "cifar100")  # Sec. 3.2 (3), the two of its six that eval.py loads by name
# (image lr, text lr) per task (Sec. 5.2.3; COCO's printed, the others from the research code, lexica, kream and
# sketch our assumption: docs/cclip.md, "Per-task learning rates")
PAPER_TASK_LRS = {"flickr30k": (8.6e-6, 1.3e-4), "coco": (5e-7, 4e-5), "pets": (3e-5, 3e-5),
                  **{k: (5e-5, 5e-5) for k in ("lexica", "simpsons", "wikiart", "kream", "sketch")}}
# The tasks the research code splits by a fraction of one split (commands.vlcl's research sources); its data module
# (SmallPigPeppa/clip-lightning, clip_openai/dataloaders/data_module_dil_json_zeroshot_hf_all.py at 038845e) builds
# them as two Subsets of ONE dataset and then sets that dataset's transform to the evaluation one, so they train
# without augmentation (--train-transform research, deviation 15)
FRACTIONAL_TASKS = ("simpsons", "wikiart", "kream", "sketch")
# --merge-schedule research, from task 5 on (deviation 1): the research scripts start a task from, and distil from,
# the uniform average of the listed per-task checkpoints (clip_openai/aaaa_train_bs1024_simpson.sh at 08a8d88: four;
# model_distill_zeroshot_lora_best_v2.py at 7053e46 averages a comma-separated --model.old_checkpoint_path), each the
# model right after its task's training (LoRA merged at full strength, before a_mix.sh)
AVERAGE_FROM_TASK = 5
OWN_RESULT = "own.pt"  # that per-task model, kept in the task's folder under --merge-schedule research


def train_transform(cfg, task_name: str, train_tf, eval_tf):
    """The transform task `task_name` trains with: ours (open_clip's training transform), or under
    --train-transform research the evaluation one for FRACTIONAL_TASKS."""
    return eval_tf if cfg.train_transform == "research" and task_name in FRACTIONAL_TASKS else train_tf


def average_of_task_results(out, tasks, i: int) -> dict:
    """The start (and CKC teacher) of task i + 1 >= AVERAGE_FROM_TASK under --merge-schedule research: the uniform
    average of tasks 1..i's own results (OWN_RESULT in their folders). Float tensors averaged, others taken from
    the first (they are equal)."""
    total = None
    for k in range(i):
        sd = load_weights_only(Path(out) / f"task{k + 1}-{tasks[k].name}" / OWN_RESULT)
        if total is None:
            total = {n: v.double() if v.is_floating_point() else v for n, v in sd.items()}
            dtypes = {n: v.dtype for n, v in sd.items()}
            continue
        for n, v in sd.items():
            if v.is_floating_point():
                total[n] += v.double()
    return {n: (v / i).to(dtypes[n]) if v.is_floating_point() else v for n, v in total.items()}


def checked_tasks(cfg, world=None):
    """A sequence's command before any model (cclip.py's main and every continual baseline's): --tasks auto resolved
    (vlcl when its 8 tasks are under --data-root), the task sequence, then common.preflight (rows, --out, device).
    Returns (cfg, tasks)."""
    needs = [Path(cfg.data_root) / "vlcl" / n / f"{s}.jsonl" for n in PAPER_TASKS for s in ("train", "test")]
    cfg = common.resolve_auto(cfg, "tasks", "vlcl", needs, "the 8 tasks of C-CLIP Sec. 3.2 as "
                              "vlcl/<task>/{train,test}.jsonl (python -m commands.vlcl builds them)")
    tasks = resolve_tasks(cfg, world)
    common.preflight(cfg, [t.train for t in tasks], continual=True)
    return cfg, tasks

def resolve_tasks(cfg, world: models.LabWorld | None = None) -> list[common.Task]:
    """cclip.py's --tasks: vlcl's layout, the lab's (world: models.LabWorld) or the user's manifests."""
    if cfg.tasks == "synthetic-long":  # ours: the lab's 4 domain tasks, trained and tested on their long captions
        long_tasks = models.lab_world(world, "--tasks synthetic-long").long_task_manifests(cfg.data_root)
        return [common.Task(*t) for t in long_tasks]
    if cfg.tasks == "vlcl":
        root = Path(cfg.data_root) / "vlcl"
        spec = ",".join(f"{n}={root / n / 'train.jsonl'}:{root / n / 'test.jsonl'}" for n in PAPER_TASKS)
        return common.parse_tasks(spec, cfg.data_root)
    return common.parse_tasks(cfg.tasks, cfg.data_root, world)


def resolve_eval_sets(cfg):
    """(unseen retrieval set or None, zero-shot classification sets)."""
    unseen = cfg.unseen
    if unseen == "auto":
        unseen = {"synthetic": "synthetic-unseen", "synthetic-long": "synthetic-unseen-long",
                  "vlcl": str(Path(cfg.data_root) / "vlcl" / "havg" / "test.jsonl")}.get(cfg.tasks, "")
    if cfg.zero_shot != "auto":
        zero_shot = [z for z in cfg.zero_shot.split(",") if z]
    elif cfg.tasks.startswith("synthetic"):  # the lab's sets (registered in eval when the lab is loaded)
        zero_shot = [z for z in evaluation.CLASSIFICATION_TASKS if z.startswith("synthetic-")]
    else:  # vlcl: deviation 9; a sequence of your own: none
        zero_shot = list(PAPER_ZERO_SHOT) if cfg.tasks == "vlcl" else []
    return unseen or None, zero_shot


def continual_row(records, names, extra) -> dict:
    """cclip.py's row of the matrices (Sec. 3.3) from evaluate()'s records: R@1 per task both ways and 'R@1' their
    mean; on MTIL's test sets (classification, protocols/mtil.py) top-1, ZSCL's metric. extra: the zero-shot sets."""
    if mtil.is_mtil(names):
        return evaluation.continual_row(records, names, ("top1",), zero_shot=extra)
    row = evaluation.continual_row(records, names, results.RECALLS, zero_shot=extra)
    i2t, t2i = row["per_task"]["i2t_R@1"], row["per_task"]["t2i_R@1"]
    row["per_task"] = {"R@1": [0.5 * (a + b) for a, b in zip(i2t, t2i)], **row["per_task"]}
    return row


def matrix_heading(method: str, names) -> str:
    """The heading of a sequence's R[i][j] tables, naming the metric they hold: top-1 on MTIL's classification
    sets, else R@1 (the mean of I2T and T2I)."""
    metric = "top-1 (%)" if mtil.is_mtil(names) else "R@1 = mean of I2T and T2I"
    return f"## {method}: R[i][j] on each task's test set ({metric})"


def task_lrs(cfg, task_name: str):
    """(image lr, text lr): the paper's preset for its datasets (Sec. 5.2.3), else --lr-image / --lr-text (0: --lr)."""
    if cfg.lr_preset == "paper" and task_name.lower() in PAPER_TASK_LRS:
        return PAPER_TASK_LRS[task_name.lower()]
    return cfg.lr_image or cfg.lr, cfg.lr_text or cfg.lr


def epoch_warmup_cosine(steps_per_epoch: int, warmup_epochs: int, epochs: int, start: float, floor: float):
    """pl_bolts' LinearWarmupCosineAnnealingLR stepped once per epoch (Lightning's default interval), as
    multipliers for common.train's schedule=: lr(e) = start + e (base - start) / max(1, W - 1) for e < W, then
    floor + (base - floor) (1 + cos(pi (e - W) / (E - W))) / 2; start and floor absolute, the same for every group."""
    def for_group(base: float):
        def f(step):
            e = step // max(1, steps_per_epoch)
            if e < warmup_epochs:
                return (start + e * (base - start) / max(1, warmup_epochs - 1)) / base
            t = (e - warmup_epochs) / max(1, epochs - warmup_epochs)
            return (floor + 0.5 * (base - floor) * (1 + math.cos(math.pi * min(1.0, t)))) / base
        return f
    return lambda opt, *_: [for_group(g["lr"]) for g in opt.param_groups]
