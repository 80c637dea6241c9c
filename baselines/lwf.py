"""LwF: Learning without Forgetting, as a continual-CLIP baseline (issue 60).

Zhizhong Li, Derek Hoiem. ECCV 2016 / TPAMI 2018. https://arxiv.org/abs/1606.09282
For CLIP as ZSCL's authors run it (Zheng et al., ICCV 2023, github.com/Thunderbeee/ZSCL, mtil/scripts/lwf.sh:
their ZSCL step with the reference set = the current task and the teacher = the previous task's model).

Implements
  LwF Sec. 3   L_old, the knowledge-distillation cross-entropy at temperature T = 2 between the old model's
               outputs y_o and the new model's yhat_o on the NEW task's data (no old data):
                   y'_o = softmax(y_o / T),  L_old = -sum_j y'_o,j log softmax(yhat_o / T)_j      distillation
               CLIP's "outputs" are its image-text logits over the batch, in both directions:
                   L_LwF = L_old(s_old I_old T_old^T, s I T^T) + L_old(its transpose)                lwf_loss
               task t's loss: L = L_CLIP + lambda_o L_LwF (lambda_o = 1, Sec. 3)                       LwF.losses

Code name -> paper symbol
  teacher / model                  the model at task t's start (theta_s, theta_o fixed) / the one training
  img_old, txt_old / img, txt      normalised features of the old / new model on the batch (B, D)
  tau (--lwf-tau) / lwf_weight     T (Sec. 3: 2) / lambda_o (Sec. 3: 1)

Deviations (from the paper, and from ZSCL's code for CLIP, mtil/src/models/finetune.py at b96e714)
  1. The loss is multiplied by T^2 (Hinton et al.'s scaling; ZSCL's helpers.distillation does); LwF has no T^2.
  2. No warm-up of the new head alone (LwF Sec. 3): CLIP has no task head; both towers train from step 1.
  3. Logits of the current batch's images and captions; ZSCL's code: a second shuffled stream of the task's
     images against its class-name prompts (classification), which a retrieval task does not have.
  4. The new logits use the new model's text features (both towers distilled); ZSCL's code puts the OLD model's
     text features on both sides (only the image tower learns from it): --distil-towers image.
  5. Each side its own logit scale (the old model's for y_o); ZSCL's code freezes the scale, so both are CLIP's 100.
  6. Training protocol C-CLIP's (baselines/sequence.py): the CLIP loss on captions, its epochs, lrs, batch.
Commands: python -m baselines.lwf --tasks vlcl (C-CLIP's 8 tasks) | --tasks synthetic --backbone tiny (the lab);
the flags of baselines/sequence.py (cclip.py's) and the ones below. Notes: docs/baselines.md."""
from __future__ import annotations

import dataclasses

from baselines.settings import SequenceConfig
from plumbing import flags
from plumbing.flags import arg


@dataclasses.dataclass(frozen=True)
class LwFConfig(SequenceConfig):
    lwf_weight: float = arg(1.0, "lambda_o, the weight of L_old (LwF Sec. 3: 1)", rule=">= 0")
    lwf_tau: float = arg(2.0, "T, the distillation temperature (LwF Sec. 3: 2; ZSCL's code: 2)",
                         rule="> 0")
    distil_towers: str = arg("both", "both: the new logits from both new towers | image: the old text "
                             "features on both sides (ZSCL's code, deviation 4)", choices=("both", "image"))
    out: str = arg("runs/lwf", "output: continual.json, results.json, per-task folders, model.pt")


if __name__ == "__main__":  # --help and flag errors are answered here, before the imports below
    flags.answer_early(LwFConfig)

import torch
import torch.nn.functional as F

import common
from plumbing.cli import cli
from baselines import sequence


# --- Losses ---
@common.float32
def distillation(teacher_logits, student_logits, tau: float = 2.0):
    """L_old (LwF Sec. 3) with Hinton et al.'s T^2 (deviation 1), as ZSCL's helpers.distillation:
        y'_o = softmax(teacher / T) per row;  L = T^2 * mean_rows( -sum_j y'_o,j log softmax(student / T)_j )
    teacher_logits, student_logits: (R, C) rows of logits; the teacher's carry no gradient."""
    target = F.softmax(teacher_logits.detach() / tau, dim=-1)  # (R, C) y'_o
    # LwF Sec. 3: L_old = -sum_j y'_o,j log yhat'_o,j (cross_entropy with probability targets), x T^2
    return F.cross_entropy(student_logits / tau, target) * tau ** 2


@common.float32
def lwf_loss(img, txt, img_old, txt_old, logit_scale, logit_scale_old, tau: float = 2.0):
    """L_LwF for CLIP: L_old of the image-text logits in both directions.
    img, txt: (B, D) and (M, D) new-model features; img_old, txt_old: the old model's on the same inputs (all
    L2-normalised); logit_scale, logit_scale_old: s and s_old (each model's own, deviation 5).
        y_o = s_old img_old txt_old^T (B, M),  yhat_o = s img txt^T
        returns (L_old(y_o, yhat_o), L_old(y_o^T, yhat_o^T))    image -> texts, text -> images"""
    logits = logit_scale * img @ txt.t()  # (B, M) the new model's outputs yhat_o
    old = logit_scale_old * img_old @ txt_old.t()  # (B, M) the old model's y_o
    # LwF Sec. 3 on both rows (images) and columns (texts): the two terms of ZSCL's code (image_loss, text_loss)
    return distillation(old, logits, tau), distillation(old.t(), logits.t(), tau)


# --- Model wrapper ---
class LwF(common.Method):
    """Task t's step: L_CLIP on the batch, plus lambda_o L_LwF toward the model at the task's start."""

    no_checkpoint = ("teacher.",)  # the old model is rebuilt from the task boundary

    def __init__(self, model, teacher=None, weight: float = 1.0, tau: float = 2.0, towers: str = "both",
                 label_smoothing: float = 0.0):
        super().__init__()
        self.model, self.teacher, self.weight, self.tau, self.towers = model, teacher, weight, tau, towers
        self.label_smoothing = label_smoothing
        if teacher is not None:
            teacher.requires_grad_(False).eval()

    def features(self, batch, ctx=None):
        f = {"img": self.model.encode_image(batch["image"]),  # (b, D) unnormalised
             "txt": common.encode_text(self.model, batch["text"], normalize=False)}
        if self.teacher is not None and not getattr(ctx, "replay", False):
            with torch.no_grad():
                f["img_old"] = self.teacher.encode_image(batch["image"])  # (b, D) the old model's
                f["txt_old"] = common.encode_text(self.teacher, batch["text"], normalize=False)
        return f

    def losses(self, f, ctx=None):
        img, txt = common.gather(F.normalize(f["img"], dim=-1), F.normalize(f["txt"], dim=-1))
        scale = self.model.logit_scale.exp()
        losses = {"loss_clip": common.clip_loss(img, txt, scale, self.label_smoothing)}
        if self.teacher is not None:
            img_old, txt_old = common.gather(F.normalize(f["img_old"], dim=-1), F.normalize(f["txt_old"], dim=-1))
            student_txt = txt if self.towers == "both" else txt_old  # deviation 4
            to_txt, to_img = lwf_loss(img, student_txt, img_old, txt_old, scale,
                                      self.teacher.logit_scale.exp(), self.tau)
            # LwF Sec. 3: L = L_new + lambda_o L_old (both directions of CLIP's logits)
            losses["loss_lwf_img"] = self.weight * to_txt
            losses["loss_lwf_txt"] = self.weight * to_img
        return losses


class LwFBaseline(sequence.Baseline):
    """LwF between tasks: the teacher of task t is the model at its start: the pretrained one for task 1 (as
    ZSCL's lwf.sh, whose first task has no --ref-model: the zero-shot CLIP), task t-1's result after."""

    name = "lwf"

    def net(self, model, i, cfg):
        teacher = sequence.frozen_copy(model)
        return LwF(model, teacher, cfg.lwf_weight, cfg.lwf_tau, cfg.distil_towers, cfg.label_smoothing), None


# --- Main ---
def main(argv=None):
    return sequence.main(LwFConfig, lambda cfg, world: LwFBaseline(), argv)


if __name__ == "__main__":
    cli(main)
