"""ZSCL: Preventing Zero-Shot Transfer Degradation in Continual Learning of Vision-Language Models (issue 60).

Zangwei Zheng, Mingyuan Ma, Kai Wang, Ziheng Qin, Xiangyu Yue, Yang You. ICCV 2023.
https://arxiv.org/abs/2303.06628; code: github.com/Thunderbeee/ZSCL ("the code": mtil/src/models/finetune.py,
helpers.py and mtil/scripts/ZSCL.sh at b96e714). The paper was not at hand offline: its method is cited by its
two parts ("Method, feature space", "Method, parameter space"), the formulas as its code computes them.

Implements
  Method, feature space    distillation on a reference set (images and texts, unlabelled, unpaired) from the
                           INITIAL model theta_0, in both directions of the image-text logits:
                               p_bar = softmax(s_0 f_0(x) g_0(t)^T / T),  p = softmax(s f(x) g(t)^T / T)
                               L_ZSCL = CE(p_bar, p) + CE(p_bar^T, p^T)   (T = 2, x T^2: lwf.distillation)
                           task t's loss: L = L_CLIP + L_ZSCL                                 ZSCL.losses
  Method, parameter space  weight ensemble (WE): every I steps the running average takes in the weights,
                               theta_avg <- (n theta_avg + theta) / (n + 1),  n += 1          weight_ensemble
                           and the task ends on theta_avg (the code: I = 100, theta_avg starts at the task's
                           starting weights, the first merge after the first step)           ZSCLBaseline

Code name -> paper symbol
  teacher / model             the initial (pre-trained) model theta_0 / the current one theta
  Reference (--ref-images,    the reference dataset: ImageNet images and Conceptual Captions texts in the
    --ref-texts)              code (--ref-dataset ImageNet --ref-sentences conceptual_captions); the lab's
                              default: the world's 'train' split (ERCLIP's pool), neither a task nor an eval set
  average, we_count, we_every theta_avg, n, I (the code's --avg_freq 100)

Deviations (from the paper, and from the code)
  1. The current logits pass the reference texts through the CURRENT text tower (both towers distilled, issue
     60); the code puts theta_0's text features on both sides, so only the image tower learns from L_ZSCL:
     --distil-towers image.
  2. Reference texts: --ref-texts-per-step of them drawn each step (default: the batch size); the code encodes
     all of its sentences (CC's validation captions) every step with theta_0. Images: --ref-batch (the code:
     the batch size). Both drawn from the step's seeded generator (the same on resume), not split over ranks.
  3. Each side its own logit scale (theta_0's for p_bar); the code freezes the scale, so both are CLIP's 100.
  4. The code's WC term (--l2 1 in ZSCL.sh: squared distance to the task's starting weights) is off: the paper's
     ZSCL is distillation + WE; --l2 turns it on (the sum of squares, as the code's l2_loss).
  5. The code runs iterations 0..N (N + 1 updates) and merges after update k when k % I == 0 (k from 0); here N
     updates and the merge after update k when (k - 1) % I == 0 (k from 1): the same merges.
  6. Training protocol C-CLIP's (baselines/sequence.py): the CLIP loss on captions, its epochs, lrs, batch (the
     code: classification CE with label smoothing 0.2 on class prompts, 1000 iterations, lr 1e-5).
Commands: python -m baselines.zscl --tasks vlcl --ref-images <manifest> --ref-texts <manifest or .txt>
| --tasks synthetic --backbone tiny (the lab; reference set by default). Notes: docs/baselines.md."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from baselines.settings import SequenceConfig
from plumbing import flags
from plumbing.flags import arg


@dataclasses.dataclass(frozen=True)
class ZSCLConfig(SequenceConfig):
    ref_images: str = arg("auto", "reference images: a manifest (its captions unused); auto: the lab's world "
                          "'train' split with --backbone tiny (the code: ImageNet's training set)")
    ref_texts: str = arg("auto", "reference texts: a manifest's captions or a .txt file (a sentence a line); "
                         "auto: the --ref-images manifest's captions (the code: Conceptual Captions)")
    ref_batch: int = arg(0, "reference images a step (0: --batch-size, as the code)", rule=">= 0")
    ref_texts_per_step: int = arg(0, "reference texts a step (0: --batch-size; the code: all, deviation 2)",
                                   rule=">= 0")
    zscl_tau: float = arg(2.0, "T of the distillation (the code's --T 2)", rule="> 0")
    image_weight: float = arg(1.0, "weight of the image -> texts term (the code's --image_loss: 1)",
                              rule=">= 0")
    text_weight: float = arg(1.0, "weight of the text -> images term (the code's --text_loss: 1)",
                             rule=">= 0")
    distil_towers: str = arg("both", "both: the current logits from both current towers | image: theta_0's "
                             "text features on both sides (the code, deviation 1)", choices=("both", "image"))
    we_every: int = arg(100, "I: steps between weight-ensemble merges (the code's --avg_freq 100); 0: no WE",
                         rule=">= 0")
    l2: float = arg(0.0, "weight of the code's WC term, squared distance to the task's start (ZSCL.sh: 1; "
                    "deviation 4)")
    out: str = arg("runs/zscl", "output: continual.json, results.json, per-task folders, model.pt")


if __name__ == "__main__":  # --help and flag errors are answered here, before the imports below
    flags.answer_early(ZSCLConfig)

import torch
import torch.nn.functional as F

import common
from plumbing.cli import cli
from baselines import sequence
from baselines.lwf import lwf_loss
from plumbing.base import DataError, UsageError


# --- Losses ---
def zscl_loss(img, txt, img_0, txt_0, logit_scale, logit_scale_0, tau: float = 2.0):
    """L_ZSCL's two terms (Method, feature space): the initial model's reference logits distilled in both
    directions, lwf.lwf_loss on the reference set with theta_0 as the teacher.
    img (R, D), txt (M, D): the current model's normalised features of R reference images and M reference
    texts (txt = txt_0 under --distil-towers image); img_0, txt_0: theta_0's; logit_scale / logit_scale_0: s, s_0.
        returns (CE(p_bar, p) image -> texts, CE(p_bar^T, p^T) text -> images), each x T^2"""
    # Method, feature space: L_ZSCL = CE(p_bar, p) + CE(p_bar^T, p^T), p_bar from theta_0
    return lwf_loss(img, txt, img_0, txt_0, logit_scale, logit_scale_0, tau)


@torch.no_grad()
def weight_ensemble(average: list, theta: list, n: int) -> list:
    """Method, parameter space (WE), the code's merge_we: theta_avg <- (n theta_avg + theta) / (n + 1), where n
    models are already in the average. average, theta: the parameters in the same order."""
    # Method, parameter space (WE): a running mean of the weights taken every I steps
    return [(a * n + t) / (n + 1) for a, t in zip(average, theta)]


def l2_loss(params: list, start: list):
    """The code's WC term (helpers.l2_loss): sum over parameters of ||theta - theta_start||^2 (deviation 4)."""
    return sum(((p.float() - s.float()) ** 2).sum() for p, s in zip(params, start))


# --- Model wrapper ---
class Reference:
    """The reference set: images (a manifest, the evaluation transform) and texts (captions or lines)."""

    def __init__(self, images: str, texts: str, transform, tokenizer):
        self.images = common.ManifestDataset(images, transform, check_images=False)
        self.texts = (Path(texts).read_text().splitlines() if texts.endswith(".txt") else
                      [_first(r[ds.caption_key]) for ds in [common.ManifestDataset(texts, check_images=False)]
                       for r in ds.rows])
        self.texts = [t for t in self.texts if t.strip()]
        self.tokenizer = tokenizer
        if not len(self.images) or not self.texts:
            raise UsageError(f"ZSCL's reference set is empty: {images} ({len(self.images)} images), {texts} "
                             f"({len(self.texts)} texts)")

    def draw(self, generator, n_images: int, n_texts: int, device):
        """n_images images and n_texts tokenised texts, without replacement, from the step's generator."""
        i = torch.randperm(len(self.images), generator=generator)[:n_images].tolist()
        j = torch.randperm(len(self.texts), generator=generator)[:n_texts].tolist()
        images = torch.stack([self.images[k]["image"] for k in i]).to(device)
        return images, self.tokenizer([self.texts[k] for k in j]).to(device)


def _first(caption):
    return caption if isinstance(caption, str) else caption[0]


class ZSCL(common.Method):
    """Task t's step: L_CLIP on the batch, plus L_ZSCL on a reference draw toward theta_0 (and --l2's WC term);
    the weight ensemble's running average rides along (checkpointed: a mid-task resume keeps it)."""

    no_checkpoint = ("teacher.",)  # theta_0: the pretrained weights, loaded again

    def __init__(self, model, teacher, reference: Reference, cfg):
        super().__init__()
        self.model, self.teacher, self.reference, self.cfg = model, teacher, reference, cfg
        teacher.requires_grad_(False).eval()
        WeightEnsemble.start(self)
        self.start = [p.detach().clone() for p in model.parameters()] if cfg.l2 else None

    def features(self, batch, ctx=None):
        return {"img": self.model.encode_image(batch["image"]),  # (b, D) unnormalised
                "txt": common.encode_text(self.model, batch["text"], normalize=False)}

    def losses(self, f, ctx=None):
        img, txt = common.gather(F.normalize(f["img"], dim=-1), F.normalize(f["txt"], dim=-1))
        scale = self.model.logit_scale.exp()
        losses = {"loss_clip": common.clip_loss(img, txt, scale, self.cfg.label_smoothing)}
        cfg, device = self.cfg, img.device
        images, texts = self.reference.draw(ctx.generator, cfg.ref_batch or cfg.batch_size,
                                            cfg.ref_texts_per_step or cfg.batch_size, device)
        with torch.no_grad():
            img_0 = F.normalize(self.teacher.encode_image(images), dim=-1)  # (R, D) f_0(x)
            txt_0 = F.normalize(common.encode_text(self.teacher, texts, normalize=False), dim=-1)  # (M, D)
        ref_img = F.normalize(self.model.encode_image(images), dim=-1)  # (R, D) f(x)
        ref_txt = (F.normalize(common.encode_text(self.model, texts, normalize=False), dim=-1)
                   if cfg.distil_towers == "both" else txt_0)  # (M, D) g(t), or g_0(t) (deviation 1)
        to_txt, to_img = zscl_loss(ref_img, ref_txt, img_0, txt_0, scale, self.teacher.logit_scale.exp(),
                                   cfg.zscl_tau)
        # Method: L = L_CLIP + L_ZSCL (the code's image_loss and text_loss terms)
        losses["loss_zscl_img"] = cfg.image_weight * to_txt
        losses["loss_zscl_txt"] = cfg.text_weight * to_img
        if self.start is not None:  # the code's WC term (deviation 4)
            losses["loss_l2"] = cfg.l2 * l2_loss(list(self.model.parameters()), self.start)
        return losses


class WeightEnsemble:
    """common.train's hooks: after update k (k = 1, 2, ...) with (k - 1) % I == 0, theta_avg takes theta in."""

    def __init__(self, every: int):
        self.every = every

    @staticmethod
    def start(net):
        """A task's ensemble state on `net` (a module with .model), checkpointed with it: theta_avg = the task's
        starting weights (net.average), n = 1 model in it (we_count), no update taken yet (we_step)."""
        net.average = torch.nn.ParameterList([torch.nn.Parameter(p.detach().clone(), requires_grad=False)
                                              for p in net.model.parameters()])
        net.register_buffer("we_count", torch.ones((), dtype=torch.long))
        net.register_buffer("we_step", torch.zeros((), dtype=torch.long))

    @staticmethod
    @torch.no_grad()
    def finish(net):
        """Method, parameter space (WE): the task's result is the average (net.model's weights <- theta_avg)."""
        for p, a in zip(net.model.parameters(), net.average):
            p.copy_(a)

    def before_optimizer_step(self, net):
        pass

    def after_optimizer_step(self, net):
        net.we_step += 1
        if self.every and (int(net.we_step) - 1) % self.every == 0:
            n = int(net.we_count)
            merged = weight_ensemble(list(net.average), [p.detach() for p in net.model.parameters()], n)
            for a, m in zip(net.average, merged):
                a.copy_(m)
            net.we_count += 1


class ZSCLBaseline(sequence.Baseline):
    """ZSCL between tasks: theta_0 (the pretrained model) is the teacher of every task; a task ends on the
    weight ensemble's average (the code saves we_model, which the next task loads)."""

    name = "zscl"

    def __init__(self, cfg, world=None):
        self.cfg, self.world, self.teacher, self.reference = cfg, world, None, None

    def start(self, model, eval_tf, tokenizer):
        self.teacher = sequence.frozen_copy(model)  # theta_0, before any boundary is loaded
        self.reference = Reference(*reference_paths(self.cfg, self.world), eval_tf, tokenizer)

    def net(self, model, i, cfg):
        return ZSCL(model, self.teacher, self.reference, cfg), WeightEnsemble(cfg.we_every)

    def end_task(self, model, net, i, dataset, collate, cfg) -> dict:
        if cfg.we_every:  # Method, parameter space (WE): the task's result is the average
            WeightEnsemble.finish(net)
        return {"we_models": int(net.we_count)}


def reference_paths(cfg, world=None) -> tuple[str, str]:
    """(--ref-images, --ref-texts) resolved: 'auto' is the lab's 'train' split with the lab's world."""
    images = cfg.ref_images
    if images == "auto":
        if world is None:
            raise UsageError("ZSCL needs a reference set: --ref-images <manifest> (the paper: ImageNet's training "
                             "images) and --ref-texts <manifest or .txt> (the paper: Conceptual Captions)")
        images = str(world.synthetic_manifest("train", cfg.data_root))
    texts = images if cfg.ref_texts == "auto" else cfg.ref_texts
    for p in (images, texts):
        if not Path(p).exists():
            raise DataError(f"ZSCL reference set: {p} not found")
    return images, texts


# --- Main ---
def main(argv=None):
    return sequence.main(ZSCLConfig, lambda cfg, world: ZSCLBaseline(cfg, world), argv)


if __name__ == "__main__":
    cli(main)
