"""C-CLIP's protocol as settings (Liu et al., ICLR 2025, Sec. 5), torch-free so that --help answers before torch
loads: the fields cclip.py and every continual baseline (baselines/: ZSCL, LwF, EWC) share, with the paper's
defaults, so that a baseline's row is trained as C-CLIP's are. cclip.py's CClipConfig adds LoRA and CKC."""
from __future__ import annotations

import dataclasses

from plumbing import flags
from plumbing.flags import arg


@dataclasses.dataclass(frozen=True)
class ProtocolConfig(flags.Config):
    backbone: str = arg("ViT-B/16", "backbone (C-CLIP Sec. 5: CLIP ViT-B/16)")
    tasks: str = arg("auto", "auto: vlcl in --data-root, else synthetic (tiny) | vlcl (the "
                     "paper's 8, data/vlcl/<name>/{train,test}.jsonl) | synthetic (the lab's 4; "
                     "-long: long captions) | mtil-order1/2 (MTIL) | name=train[:test],...")
    unseen: str = arg("auto", "unseen retrieval set: eval name, manifest, auto, '' = none")
    zero_shot: str = arg("auto", "zero-shot sets, comma-separated eval.py names ('auto': imagenet,"
                         "cifar100 for vlcl, cclip.py's deviation 9 / the lab's synthetic-* sets; '' = none)")
    epochs: int = arg(40, "epochs per task (Sec. 5)")
    batch_size: int = arg(1024, "global batch (Sec. 5)")
    lr_image: float = arg(0.0, "image-encoder lr (0: --lr) unless the preset names the task")
    lr_text: float = arg(0.0, "text-encoder lr (0: --lr) unless the preset names the task")
    lr_preset: str = arg("paper", "per-task lrs of Sec. 5.2.3 | none", choices=("paper", "none"))
    wd: float = arg(0.2, "AdamW weight decay (Sec. 5; research code 0.1)")
    beta2: float = arg(0.99, "AdamW beta2 (Sec. 5; research code: torch's 0.999, cclip.py's dev. 7)")
    warmup: int = arg(-12, "warm-up: 5 of 40 epochs (Sec. 5), as a percentage (cclip.py's dev. 7)")
    train_transform: str = arg("augment", "augment (ours) | research: the research code's 4 tasks unaugmented "
                               "(cclip.py's dev. 15)", choices=("augment", "research"))
    resume: str = arg("", "'latest': continue the task sequence (at a boundary or mid-task)")
    eval_n: int = arg(0, "ours: evaluate synthetic unseen/zero-shot sets on first n scenes; 0: all")
    threads: int = arg(0, "ours: CPU threads for torch (0: torch's default)")
    stop_after_tasks: int = arg(0, "ours: leave after n tasks as if interrupted (tests resume)")
    task_safetensors: bool = arg(False, "ours: task folders' model.pt also as .safetensors")
