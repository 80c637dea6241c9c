"""The settings every continual baseline shares (issue 60), torch-free so that --help answers before torch loads:
C-CLIP's protocol, cclip.py's defaults (C-CLIP Sec. 5), so that each baseline row is trained as C-CLIP's are."""
from __future__ import annotations

import dataclasses

from plumbing import base, flags
from plumbing.flags import arg


@dataclasses.dataclass(frozen=True)
class SequenceConfig(flags.Config):
    """C-CLIP's protocol (cclip.py's defaults, C-CLIP Sec. 5): every baseline row is trained as C-CLIP's are."""
    backbone: str = arg("ViT-B/16", "backbone (C-CLIP Sec. 5: CLIP ViT-B/16)")
    tasks: str = arg("auto", "auto: vlcl in --data-root, else synthetic (tiny) | vlcl (C-CLIP's 8 tasks, "
                     "data/vlcl/<name>/{train,test}.jsonl) | synthetic (the lab's 4 domains) | "
                     "name=train[:test],... in order")
    unseen: str = arg("auto", "unseen retrieval set: eval name, manifest, auto, '' = none")
    zero_shot: str = arg("auto", "zero-shot sets, comma-separated eval.py names ('auto': imagenet,cifar100 for "
                         "vlcl / the lab's synthetic-* sets; '' = none)")
    epochs: int = arg(40, "epochs per task (C-CLIP Sec. 5)")
    batch_size: int = arg(1024, "global batch (C-CLIP Sec. 5)")
    lr: float = arg(1e-5, "lr of the logit scale, and of the towers without --lr-image / --lr-text / preset")
    lr_image: float = arg(0.0, "image-encoder lr (0: --lr) unless the preset names the task")
    lr_text: float = arg(0.0, "text-encoder lr (0: --lr) unless the preset names the task")
    lr_preset: str = arg("paper", "C-CLIP's per-task lrs (Sec. 5.2.3) | none", choices=("paper", "none"))
    wd: float = arg(0.2, "AdamW weight decay (C-CLIP Sec. 5)")
    beta2: float = arg(0.99, "AdamW beta2 (C-CLIP Sec. 5)")
    warmup: int = arg(-12, "warm-up: 5 of 40 epochs (C-CLIP Sec. 5), as a percentage")
    train_transform: str = arg("augment", "augment | research (C-CLIP's research code: 4 tasks unaugmented)",
                               choices=("augment", "research"))
    out: str = arg("runs/baseline", "output: continual.json, results.json, per-task folders, model.pt")
    resume: str = arg("", "'latest': continue the task sequence (at a boundary or mid-task)")
    eval_n: int = arg(0, "ours: evaluate synthetic unseen/zero-shot sets on first n scenes; 0: all")
    threads: int = arg(0, "ours: CPU threads for torch (0: torch's default)")
    stop_after_tasks: int = arg(0, "ours: leave after n tasks as if interrupted (tests resume)")
    task_safetensors: bool = arg(False, "ours: task folders' model.pt also as .safetensors")


def refuse_unbuilt(cfg, name: str):
    """Issue 59's --loss siglip and --lora are built for the method files; the baselines are their papers' rows
    (CLIP's softmax loss, full fine-tuning): one message rather than a flag silently ignored."""
    if getattr(cfg, "loss", "clip") != "clip" or getattr(cfg, "lora", 0):
        raise base.UsageError(f"{name}: --loss siglip / --lora are not built for the baselines (their papers' rows "
                              f"train CLIP's loss on every weight); run them without these flags")
