"""The settings every continual baseline shares (issue 60), torch-free so that --help answers before torch loads:
C-CLIP's protocol, cclip.py's defaults (C-CLIP Sec. 5), so that each baseline row is trained as C-CLIP's are."""
from __future__ import annotations

import dataclasses

from papers.cclip_settings import ProtocolConfig
from plumbing import base
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
