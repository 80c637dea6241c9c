"""Un-Mix on CLIP's image side: m2-Mix's Table 1 / Table 3 baseline row "Un-Mix".

Zhiqiang Shen, Zechun Liu, Zhuang Liu, Marios Savvides, Trevor Darrell, Eric Xing. "Un-Mix:
Rethinking Image Mixtures for Unsupervised Visual Representation Learning." AAAI 2022,
https://arxiv.org/abs/2003.05438. Released code ("the code"): github.com/szq0214/Un-Mix
(UnMix_MoCo/for_ImageNet: main_moco_unmix.py's train() and rand_bbox, moco/builder.py).
As m2-Mix ran it (Oh et al., NeurIPS 2023, arXiv:2203.03897, Sec. 2, Tables 1 / 3): images
mixed, pseudo-labels mixed with them, CLIP fine-tuned; how exactly: baselines/mixrun.py.
The Un-Mix paper's text was not at hand offline: its formulas are cited by name (global and
region mixtures, the mixed loss), not by section or equation number, checked against the code.

Implements (each formula written once, in the docstring of the function named)
  global mixture  x~ = lam x + (1 - lam) flip(x) (the batch reversed): mixrun.mix_inputs
  region mixture  a box of flip(x) pasted in x, lam <- 1 - box / image area: cut_box, region_mix
  the loss        L_o + lam L(x~_i, t_i) + (1 - lam) L(x~_{B-1-i}, t_i): unmix_loss (+ clip_loss)
  sampling        lam ~ Beta(beta, beta); global with probability --unmix-prob, else region: draw

Code name -> paper symbol
  img, img_mix  f(x_i), f(x~_i): un-mixed / mixed images' normalised embeddings (B, D)
  txt           the keys: CLIP's normalised caption embeddings (B, D) (Un-Mix: the 2nd view's)
  logit_scale   1/tau            lam: lambda (one per batch)          flip: the batch reversed
  beta, unmix_prob               the code's --beta (1) and --unmix_prob (run.sh: 0.5)

Deviations (one line each; at length in docs/m2mix.md, "The baselines")
  1. Keys: the paired captions (CLIP), not a 2nd augmentation of the image (m2-Mix, Sec. 2).
  2. In-batch negatives (N-pair, as CLIP's), not the code's MoCo queue and momentum encoder.
  3. L_o is CLIP's symmetric loss (FT's, m2-Mix's L_CLIP); the code's: one direction, q -> k.
  4. Mixed terms one direction, mixed image -> texts (the code's queries); --mix-weight (1).
  5. CLIP's learnable temperature (the code: --moco-t 0.2); --tau T fixes 1/T, frozen.
  6. unmix_prob 0.5 (the code's run.sh; its argparse default 0: region mixtures only).
  7. lam, the choice and the box from the step's seeded generator, not numpy's global RNG.
  8. Optimiser, schedule, data, evaluation, eval() mode: m2mix.py's (the paper pretrains).
  9. One process, --accum-freq 1: the mix pairs one batch's rows (the code: each GPU's own).
Commands
  python -m baselines.unmix --train-data flickr30k --out runs/unmix  (ViT-B/32, m2mix.py's)
  python m2mix.py --collect runs/ft,runs/imix,runs/unmix,runs/m3    (Table 1 with this row)
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from baselines.settings import MixBaselineConfig
from plumbing import flags
from plumbing.flags import arg, parse_config


@dataclass(frozen=True)
class UnMixConfig(MixBaselineConfig):
    out: str = arg("runs/unmix", "output folder")
    beta: float = arg(1.0, "Beta(beta, beta) of the mixing ratio",
                      rule="> 0")  # the code's --beta default
    unmix_prob: float = arg(0.5, "probability of the global mixture, else the region one",
                             rule="in [0, 1]")  # run.sh
    mix_weight: float = arg(1.0, "weight of the mixed terms (the code: 1; ours to tune, dev. 4)",
                            rule=">= 0")
    tau: float = arg(0.0, "fixed temperature (the code: 0.2); 0: CLIP's learnable one (dev. 5)",
                     rule=">= 0")


if __name__ == "__main__":  # --help and flag errors are answered here, before the imports below (69.7)
    flags.answer_early(UnMixConfig)

import numpy as np
import torch
import torch.nn.functional as F

import common
from plumbing.base import UsageError
from plumbing.cli import cli
from baselines import mixrun
from plumbing import models


# --- Losses ---
@common.float32
def unmix_loss(img_mix, txt, logit_scale, lam: float):
    """Un-Mix's mixed loss: row i of the mixed batch holds lam of image i and 1 - lam of image
    B-1-i, so it is a positive of text i with weight lam and, read flipped (row B-1-i), of text
    i with weight 1 - lam:
        L_mix = lam CE(s x~ T^T, I) + (1 - lam) CE(s flip(x~) T^T, I)
    CE(M, I) = -1/B sum_i log softmax_j(M_ij) at j = i. img_mix, txt: (B, D) normalised;
    logit_scale: s; lam: float. The whole loss adds CLIP's L_o = common.clip_loss (dev. 3)."""
    own = torch.arange(len(img_mix), device=img_mix.device)
    logits = logit_scale * img_mix @ txt.t()  # (B, B)
    logits_flip = logit_scale * torch.flip(img_mix, dims=[0]) @ txt.t()  # (B, B): row i: x~_{B-1-i}
    # Un-Mix: lam L(x~, t) + (1 - lam) L(flip(x~), t)
    return lam * F.cross_entropy(logits, own) + (1 - lam) * F.cross_entropy(logits_flip, own)


def cut_box(size, lam: float, cx: int, cy: int):
    """The code's rand_bbox: a box of side sqrt(1 - lam) x the image's, centred at (cx, cy),
    clipped; its first axis is the tensor's dim 2 (the code's W), the second dim 3.
    size: (B, C, W, H). -> (x1, y1, x2, y2)."""
    w, h = size[2], size[3]
    cut = np.sqrt(1.0 - lam)
    cut_w, cut_h = int(w * cut), int(h * cut)
    return (int(np.clip(cx - cut_w // 2, 0, w)), int(np.clip(cy - cut_h // 2, 0, h)),
            int(np.clip(cx + cut_w // 2, 0, w)), int(np.clip(cy + cut_h // 2, 0, h)))


def region_mix(x, box):
    """Un-Mix's region mixture: the box of flip(x) pasted into x; lam becomes the share of x left,
        lam = 1 - (x2 - x1)(y2 - y1) / (W H)
    x: (B, C, W, H); box: cut_box's. -> (x~, lam)."""
    x1, y1, x2, y2 = box
    mixed = x.clone()
    mixed[:, :, x1:x2, y1:y2] = torch.flip(x, dims=[0])[:, :, x1:x2, y1:y2]
    return mixed, 1.0 - (x2 - x1) * (y2 - y1) / (x.shape[-1] * x.shape[-2])


def draw(generator: torch.Generator, size, beta: float, unmix_prob: float):
    """(lam, box or None): lam ~ Beta(beta, beta); the global mixture (box None) with probability
    unmix_prob, else the region one with the code's box, its centre uniform over the image; from
    the step's generator (deviation 7)."""
    rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=generator)))
    r, lam = rng.random(), float(rng.beta(beta, beta))
    if r < unmix_prob:
        return lam, None
    return lam, cut_box(size, lam, int(rng.integers(size[2])), int(rng.integers(size[3])))


# --- Model wrapper ---
class UnMix(mixrun.MixBaseline):
    """CLIP fine-tuned with Un-Mix on its images (common.Method: features, then the loss terms)."""
    label = "Un-Mix"

    def __init__(self, model, cfg: UnMixConfig):
        super().__init__(model, cfg)
        if cfg.beta <= 0 or not 0 <= cfg.unmix_prob <= 1:
            raise UsageError(f"--beta must be > 0 and --unmix-prob in [0, 1], got "
                                    f"{cfg.beta}, {cfg.unmix_prob}")
        if cfg.tau:  # deviation 5: a fixed temperature; the learnable one is unused
            model.logit_scale.requires_grad_(False)

    def features(self, batch, ctx=None):
        images = batch["image"]  # (b, 3, H, W)
        lam, box = draw(ctx.generator, images.shape, self.cfg.beta, self.cfg.unmix_prob)
        if box is None:  # Un-Mix's global mixture, with the batch reversed
            reverse = torch.arange(len(images) - 1, -1, -1, device=images.device)
            mixed = mixrun.mix_inputs(images, lam, reverse)
        else:
            mixed, lam = region_mix(images, box)
        img, txt = self.encode(torch.cat([images, mixed]), batch["text"])  # one pass: (2b, D)
        return {"img": img[:len(images)], "img_mix": img[len(images):], "txt": txt,
                "lam": torch.full((len(images),), lam, device=images.device)}

    def losses(self, f, ctx):
        scale = 1.0 / self.cfg.tau if self.cfg.tau else self.model.logit_scale.exp()
        lam = float(f["lam"][0])
        return {"loss_clip": common.clip_loss(f["img"], f["txt"], scale, self.cfg.label_smoothing),
                "loss_unmix": self.cfg.mix_weight * unmix_loss(f["img_mix"], f["txt"], scale, lam)}


# --- Main ---
def main(argv=None, world=None):
    """`python -m baselines.unmix [flags]` (m2mix.py's); world: the lab's, for --backbone tiny."""
    cfg = parse_config(UnMixConfig, sys.argv[1:] if argv is None else list(argv))
    if world is None and models.wants_lab(cfg):  # --backbone tiny / --train-data synthetic: the lab's world
        from lab import WORLD as world
    return mixrun.run(cfg, UnMix, "unmix", world=world)


if __name__ == "__main__":
    cli(main)
