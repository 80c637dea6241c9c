"""i-Mix on CLIP's image side: m2-Mix's Table 1 / Table 3 baseline row "i-Mix".

Kibok Lee, Yian Zhu, Kihyuk Sohn, Chun-Liang Li, Jinwoo Shin, Honglak Lee. "i-Mix: A
Domain-Agnostic Strategy for Contrastive Representation Learning." ICLR 2021,
https://arxiv.org/abs/2010.08887. Released code ("the code"): github.com/kibok90/imix
(builder.py: `mixup`, Builder.forward's N-pair branch; main_pretext.py: criterion, defaults).
As m2-Mix ran it (Oh et al., NeurIPS 2023, arXiv:2203.03897, Sec. 2, Tables 1 / 3): images
mixed, pseudo-labels mixed with them, CLIP fine-tuned; how exactly: baselines/mixrun.py.
The i-Mix paper's text was not at hand offline: its formulas are cited by name (the N-pair
i-Mix loss), not by section or equation number, and checked against the code instead.

Implements (each formula written once, in the docstring of the function named)
  mixed input   x~_i = lam_i x_i + (1 - lam_i) x_k(i): the code's `mixup`, mixrun.mix_inputs
  mixed label   lam_i on key i, (1 - lam_i) on key k(i): the N-pair i-Mix loss, imix_loss
  sampling      lam_i ~ Beta(alpha, alpha), lam_i <- max(lam_i, 1 - lam_i), k a permutation: draw

Code name -> paper symbol
  img_mix       f(x~_i): the mixed images' L2-normalised embeddings (B, D), i-Mix's queries
  txt           the keys: CLIP's normalised caption embeddings (B, D) (i-Mix: a 2nd view of x_i)
  logit_scale   1/tau            lam: lam_i (B,)            partner: k(i) (B,), a permutation
  alpha         alpha of Beta(alpha, alpha) (the code's --alpha, default 1)

Deviations (one line each; at length in docs/m2mix.md, "The baselines")
  1. Keys: the paired captions (CLIP), not a 2nd augmentation of the image (m2-Mix, Sec. 2).
  2. In-batch negatives (the code's N-pair branch); its MoCo queue / BYOL forms not carried.
  3. One direction, mixed image -> texts, no un-mixed term: i-Mix's loss as the code has it.
  4. CLIP's learnable temperature (the code: fixed --temp 0.2); --tau T fixes 1/T, frozen.
  5. Input mixup only (`imixup`); the code's `icutmix`, --inputmix, --mix-layers not carried.
  6. lam and k from the step's seeded generator (the same on resume), not torch's global RNG.
  7. Optimiser, schedule, data, evaluation, eval() mode: m2mix.py's (the paper pretrains).
  8. One process, --accum-freq 1: the mix pairs one batch's rows (the code: each GPU's own).
Commands
  python -m baselines.imix --train-data flickr30k --out runs/imix   (ViT-B/32, m2mix.py's)
  python m2mix.py --collect runs/ft,runs/imix,runs/unmix,runs/m3    (Table 1 with this row)
  tests: tests/test_mix_baselines.py (tiny runs through main(..., world=lab.WORLD), resume)
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from baselines.settings import MixBaselineConfig
from plumbing import flags
from plumbing.flags import arg, parse_config


@dataclass(frozen=True)
class IMixConfig(MixBaselineConfig):
    out: str = arg("runs/imix", "output folder")
    alpha: float = arg(1.0, "Beta(alpha, alpha) of the mixing ratio",
                       rule="> 0")  # the code's --alpha default
    tau: float = arg(0.0, "fixed temperature (the code: 0.2); 0: CLIP's learnable one (dev. 4)",
                     rule=">= 0")


if __name__ == "__main__":  # --help and flag errors are answered here, before the imports below (69.7)
    flags.answer_early(IMixConfig)

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
def imix_loss(img_mix, txt, logit_scale, lam, partner):
    """The N-pair i-Mix loss: each mixed image's virtual label is lam_i on its own key and
    1 - lam_i on its partner's; the cross-entropy is linear in the label, so
        l_i = -lam_i log p_i(i) - (1 - lam_i) log p_i(k(i)),   p_i = softmax_j(s f(x~_i) . t_j)
        L = 1/B sum_i l_i
    img_mix, txt: (B, D) normalised; logit_scale: s; lam: (B,) in [0, 1];
    partner: (B,) long, k(i)."""
    logits = logit_scale * img_mix @ txt.t()  # (B, B)
    own = torch.arange(len(img_mix), device=img_mix.device)
    # i-Mix (N-pair): the mixed virtual label, lam_i on key i and (1 - lam_i) on key k(i)
    per_row = (lam * F.cross_entropy(logits, own, reduction="none")
               + (1 - lam) * F.cross_entropy(logits, partner, reduction="none"))  # (B,)
    return per_row.mean()


def draw(generator: torch.Generator, n: int, alpha: float):
    """(lam (n,), partner (n,)): lam_i ~ Beta(alpha, alpha) folded to max(lam, 1 - lam) and a random
    permutation, as the code's `mixup`, from the step's generator (deviation 6)."""
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    lam = np.random.default_rng(seed).beta(alpha, alpha, size=n)
    lam = torch.from_numpy(np.maximum(lam, 1 - lam)).float()  # the code: torch.max(lam, 1 - lam)
    return lam, torch.randperm(n, generator=generator)


# --- Model wrapper ---
class IMix(mixrun.MixBaseline):
    """CLIP fine-tuned with i-Mix on its images (common.Method: features, then the loss terms)."""
    label = "i-Mix"

    def __init__(self, model, cfg: IMixConfig):
        super().__init__(model, cfg)
        if cfg.alpha <= 0:
            raise UsageError(f"--alpha must be > 0 (Beta(alpha, alpha)), got {cfg.alpha}")
        if cfg.tau:  # deviation 4: a fixed temperature; the learnable one is unused
            model.logit_scale.requires_grad_(False)

    def features(self, batch, ctx=None):
        images = batch["image"]  # (b, 3, H, W)
        lam, partner = draw(ctx.generator, len(images), self.cfg.alpha)
        lam, partner = lam.to(images.device), partner.to(images.device)
        img_mix, txt = self.encode(mixrun.mix_inputs(images, lam, partner), batch["text"])
        return {"img_mix": img_mix, "txt": txt, "lam": lam, "partner": partner}

    def losses(self, f, ctx):
        scale = 1.0 / self.cfg.tau if self.cfg.tau else self.model.logit_scale.exp()
        return {"loss_imix": imix_loss(f["img_mix"], f["txt"], scale, f["lam"], f["partner"])}


# --- Main ---
def main(argv=None, world=None):
    """`python -m baselines.imix [flags]` (m2mix.py's); world: the lab's, for --backbone tiny."""
    cfg = parse_config(IMixConfig, sys.argv[1:] if argv is None else list(argv))
    if world is None and models.wants_lab(cfg):  # --backbone tiny / --train-data synthetic: the lab's world
        from lab import WORLD as world
    return mixrun.run(cfg, IMix, "imix", world=world)


if __name__ == "__main__":
    cli(main)
