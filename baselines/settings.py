"""The settings every continual baseline shares (issue 60), torch-free so that --help answers before torch loads:
C-CLIP's protocol, cclip.py's defaults (C-CLIP Sec. 5), so that each baseline row is trained as C-CLIP's are;
and m2-Mix's baselines' (i-Mix, Un-Mix: m2mix.py's settings, baselines/mixrun.py), here for the same reason."""
from __future__ import annotations

import dataclasses

from papers.cclip_settings import ProtocolConfig
from plumbing import base, flags
from plumbing.flags import arg


@dataclasses.dataclass(frozen=True)
class SequenceConfig(ProtocolConfig):
    """C-CLIP's protocol (papers/cclip_settings.py, cclip.py's defaults, C-CLIP Sec. 5): every baseline row is
    trained as C-CLIP's are."""
    lr: float = arg(1e-5, "lr of the logit scale, and of the towers without --lr-image / --lr-text / preset")
    out: str = arg("runs/baseline", "output: continual.json, results.json, per-task folders, model.pt")


def refuse_unbuilt(cfg, name: str):
    """Issue 59's --loss siglip and --lora are built for the method files; the baselines are their papers' rows
    (CLIP's softmax loss, full fine-tuning): one message rather than a flag silently ignored."""
    if getattr(cfg, "loss", "clip") != "clip" or getattr(cfg, "lora", 0):
        raise base.UsageError(f"{name}: --loss siglip / --lora are not built for the baselines (their papers' rows "
                              f"train CLIP's loss on every weight); run them without these flags")


@dataclasses.dataclass(frozen=True)
class MixBaselineConfig(flags.TowerConfig):
    """m2mix.py's settings that are not m2-Mix's own (the same defaults and meanings: m2mix.M2MixConfig)."""
    backbone: str = arg("ViT-B/32", "m2-Mix Sec. 5.1 | bert-resnet50 (Sec. 5.4, Table 3)")
    train_data: str = arg("auto", "auto: flickr30k in --data-root | flickr30k (Karpathy) | coco (--coco-split) | "
                          "a manifest | synthetic (the lab's, through the lab)")
    coco_split: str = arg("2017", "coco's split (m2mix.py's deviation 10)", choices=("2017", "karpathy"))
    train_captions: str = arg("first", "first (m2-Mix Sec. 5.1) | all captions", choices=("first", "all"))
    epochs: int = arg(9, "epochs")  # the m2-Mix code's scripts
    batch_size: int = arg(128, "global batch")  # the m2-Mix code's scripts
    lr: float = arg(1e-5, "peak lr")  # m2mix.py's (ours, inside the m2-Mix code's sweep)
    wd: float = arg(0.2, "AdamW weight decay")  # m2mix.py's
    warmup: int = arg(-10, "warm-up steps; negative = percent of all steps")  # the m2-Mix code: 10 %
    eval_mode: bool = arg(True, "keep the model in eval() mode while training (m2-Mix Sec. 5.1)")
    eval_base: bool = arg(True, "evaluate before fine-tuning too (the ZS row)")
    eval_tasks: str = arg("", "eval.py tasks a,b (default: the train set's test protocols; none)")
    simat: bool = arg(False, "also evaluate SIMAT (Table 5) through eval.py; needs data/simat")
    simat_protocol: str = arg("ours", "SIMAT's split and lambdas (m2mix.py's deviation 15)",
                              choices=("ours", "code"))
