"""C-CLIP's plumbing above common and eval (cclip.py's, no other method's): the research code's schedule,
--schedule research (cclip.py's deviation 13). It imports the standard library only."""
from __future__ import annotations

import math


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
