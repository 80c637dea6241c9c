"""EWC, LwF and ZSCL in DNS's feature setting: the continual baselines on maps over frozen features (issue 60).

The setting is CMCL's problem formulation (Liu et al., "Continual Multimodal Contrastive Learning", NeurIPS 2025,
arXiv 2503.14963, Sec. 3): one linear map W_m per modality over frozen, normalised features, trained step by step
on a pair's contrastive loss; dns.py holds it (ModalityMaps, DNSNet, DNSLearner) and trains it three ways
(vanilla / DNS-gradient / DNS-update). A row here is vanilla's training (the same optimiser, lr, epochs, loss,
evaluation, R[i][j] tables and drift) plus one baseline's term; the term's math is its own file's:
  --mode ewc   Eq. (3) of Kirkpatrick et al. (PNAS 2017): lambda/2 sum_i F_i (theta_i - theta*_i)^2 over the maps,
               F the diagonal empirical Fisher of the task's loss at its end (baselines/ewc.py: ewc_penalty,
               empirical_fisher, consolidate, anchor)
  --mode lwf   Li & Hoiem (ECCV 2016) Sec. 3: L_old, the previous maps' image-text logits on the current batch
               distilled at T = 2 in both directions (baselines/lwf.py: lwf_loss)
  --mode zscl  Zheng et al. (ICCV 2023): distillation of the INITIAL maps' logits on a reference set (the identity
               maps: CLIP's own frozen scores) in both directions, and the weight ensemble every I steps
               (baselines/zscl.py: zscl_loss, WeightEnsemble)
Where a method does not apply: ZSCL in CMCL's own setting (--features: ImageBind's seven modalities): its
reference set is images and texts of CLIP's kind; the steps pair audio, depth, ... which have none: refused.
The other rows of CMCL's table (Co2L, CILA, C-FLAT) are not built (docs/baselines.md).

Code name -> paper symbol
  maps (ModalityMaps): theta = {W_img, W_txt} (+ b with --bias) | teacher: the maps at the task's start (LwF's
  theta_o) | initial: the maps before task 1 (identity: ZSCL's theta_0) | reference: ZSCL's reference set, as
  frozen features (R, D)

Deviations (beyond dns.py's, which every row shares: CLIP's InfoNCE at CLIP's frozen scale, bias-free maps, ...)
  1. The features are frozen and normalised, the maps' outputs not renormalised (dns.py deviation 19): the logits
     distilled are CLIP's scale times the maps' scores, s (W v) . (W t), as DNS's loss reads them.
  2. EWC's Fisher: the squared gradients of the task's batch loss over one seeded pass of its pairs (--fisher-
     batches), vanilla's batch size (baselines/ewc.py deviation 1); only the maps of the step's pair get a new F
     (CMCL's setting: the other maps are frozen in that step and keep their entries).
  3. ZSCL's reference set: frozen features of a manifest's images and captions (--ref-images / --ref-texts, the
     lab's default: its world's 'train' split, as baselines/zscl.py), a seeded draw a step (its deviation 2);
     both maps distilled (its deviation 1); the code's WC term not offered (vanilla's weight decay stays).
  4. LwF's first task distils from the initial maps (the pretrained features), as ZSCL's lwf.sh.
Commands: python -m baselines.maps --mode ewc|lwf|zscl (dns.py's flags: --tasks, --lr, --epochs, --features for
CMCL's steps, ...); the lab: --backbone tiny --tasks synthetic. Notes: docs/baselines.md."""
from __future__ import annotations

import copy
import dataclasses
import functools
from pathlib import Path

from plumbing import flags
from plumbing.flags import arg, parse_config


@dataclasses.dataclass(frozen=True)
class MapsSettings:
    """The rows' own settings, torch-free (MapsConfig adds them to dns.py's): --help answers before torch."""
    mode: str = arg("ewc", "the baseline: ewc | lwf | zscl (each on vanilla's training)",
                    choices=("ewc", "lwf", "zscl"))
    ewc_lambda: float = arg(1e4, "EWC: lambda of Eq. (3) (ours; the paper tunes it)", rule=">= 0")
    ewc_gamma: float = arg(1.0, "EWC: gamma (1: the paper's sum over tasks; < 1: Schwarz et al.'s online EWC, "
                           "anchored at the last step's maps; baselines/ewc.py deviation 5)", rule="in (0, 1]")
    fisher_batches: int = arg(0, "EWC: batches of the task's pairs for F (0: one pass)", rule=">= 0")
    lwf_weight: float = arg(1.0, "LwF: lambda_o, the weight of L_old (LwF Sec. 3: 1)", rule=">= 0")
    lwf_tau: float = arg(2.0, "LwF: T (Sec. 3: 2)", rule="> 0")
    ref_images: str = arg("auto", "ZSCL: reference images, a manifest (auto: the lab's 'train' split with the lab)")
    ref_texts: str = arg("auto", "ZSCL: reference captions, a manifest (auto: --ref-images')")
    ref_batch: int = arg(0, "ZSCL: reference images a step (0: --batch-size)", rule=">= 0")
    ref_texts_per_step: int = arg(0, "ZSCL: reference texts a step (0: --batch-size)", rule=">= 0")
    zscl_tau: float = arg(2.0, "ZSCL: T of the distillation (the code's --T 2)", rule="> 0")
    image_weight: float = arg(1.0, "ZSCL: weight of the image -> texts term (the code: 1)", rule=">= 0")
    text_weight: float = arg(1.0, "ZSCL: weight of the text -> images term (the code: 1)", rule=">= 0")
    we_every: int = arg(100, "ZSCL: I, steps between weight-ensemble merges (the code: 100); 0: none",
                         rule=">= 0")
    out: str = arg("runs/maps", "output: continual.json, results.json, per-task folders")


if __name__ == "__main__":  # --help and flag errors before torch loads (issue 69.7): dns.py's config
    flags.answer_early(dataclasses.dataclass(frozen=True)(type(  # from the head of dns.py, run alone
        "MapsConfig", (MapsSettings, flags.light_head(Path(__file__).parents[1] / "dns.py")["DNSConfig"]), {})))

import torch

import common
from plumbing.base import UsageError
from plumbing.cli import cli
import dns
from baselines.ewc import anchor, consolidate_named, empirical_fisher, ewc_penalty
from baselines.lwf import lwf_loss
from baselines.zscl import WeightEnsemble, reference_paths, zscl_loss
from papers import cmcl
from plumbing import models


@dataclasses.dataclass(frozen=True)
class MapsConfig(MapsSettings, dns.DNSConfig):
    """dns.py's settings (vanilla's training) and the rows' own (MapsSettings)."""


class MapsNet(dns.DNSNet):
    """DNSNet's loss (vanilla's) plus the row's term; the frozen inputs ride along in the features."""

    no_checkpoint = ("teacher.", "initial.")  # rebuilt from the task boundary / the start

    def __init__(self, cfg: MapsConfig, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cfg, self.teacher, self.initial = cfg, None, None
        self.fisher = self.anchor = self.reference = None

    def features(self, batch, ctx=None):
        return super().features(batch, ctx) | {"x_a": batch["img"], "x_b": batch["txt"]}

    def mapped(self, maps, f):
        """The step's pair through `maps` (a frozen copy): (x_a W_a^T, x_b W_b^T), no gradient."""
        with torch.no_grad():
            return maps.map(self.model.pair[0], f["x_a"]), maps.map(self.model.pair[1], f["x_b"])

    def losses(self, f, ctx=None):
        losses, cfg = super().losses(f, ctx), self.cfg
        scale = self.model.logit_scale.exp()
        if cfg.mode == "ewc" and self.fisher:
            params = dict(self.model.named_parameters())
            # EWC Eq. (3): L = L_B + sum_i lambda/2 F_i (theta_i - theta*_i)^2
            losses["loss_ewc"] = ewc_penalty([params[n] for n in self.fisher], list(self.fisher.values()),
                                             self.anchor, cfg.ewc_lambda)
        elif cfg.mode == "lwf":
            to_txt, to_img = lwf_loss(f["img"], f["txt"], *self.mapped(self.teacher, f), scale, scale, cfg.lwf_tau)
            # LwF Sec. 3: L = L_new + lambda_o L_old (both directions)
            losses["loss_lwf_img"], losses["loss_lwf_txt"] = cfg.lwf_weight * to_txt, cfg.lwf_weight * to_img
        elif cfg.mode == "zscl":
            img_r, txt_r = self.reference
            i = torch.randperm(len(img_r), generator=ctx.generator)[:cfg.ref_batch or cfg.batch_size]
            j = torch.randperm(len(txt_r), generator=ctx.generator)[:cfg.ref_texts_per_step or cfg.batch_size]
            ref = {"x_a": img_r[i].to(f["img"].device), "x_b": txt_r[j].to(f["img"].device)}
            img_0, txt_0 = self.mapped(self.initial, ref)  # theta_0's features of the draw
            img, txt = self.model.map_image(ref["x_a"]), self.model.map_text(ref["x_b"])
            to_txt, to_img = zscl_loss(img, txt, img_0, txt_0, scale, scale, cfg.zscl_tau)
            # ZSCL, feature space: L = L_CLIP + L_ZSCL (image -> texts, text -> images)
            losses["loss_zscl_img"], losses["loss_zscl_txt"] = cfg.image_weight * to_txt, cfg.text_weight * to_img
        return losses


class MapsLearner(dns.DNSLearner):
    """DNSLearner in vanilla mode, with a row's state between steps: EWC's consolidated (F, W) (kept in the
    boundary's state), LwF's teacher (the maps at the step's start), ZSCL's initial maps and weight ensemble."""

    def __init__(self, cfg: MapsConfig, reference, dim, logit_scale, label_smoothing=0.0, loss="clip", bias=False,
                 modalities=dns.CLIP_MODALITIES):
        super().__init__(dim, logit_scale, label_smoothing, loss, bias, modalities)
        self.cfg, self.name = cfg, cfg.mode
        self.net = MapsNet(cfg, dim, logit_scale, label_smoothing, loss, bias, modalities)
        if cfg.mode == "zscl":  # theta_0: the maps before task 1 (the identity), and the reference set
            self.net.initial, self.net.reference = copy.deepcopy(self.net.model).requires_grad_(False), reference
        self.fisher = self.weighted = None  # EWC: {param name: tensor}

    def learn(self, cfg, x_a, x_b, out, resume=False, pair=None, cov_x=None) -> dict:
        net, model = self.net, self.net.model
        model.set_pair(*(pair or model.modalities[:2]))
        if cfg.mode == "lwf":  # the maps at the step's start
            net.teacher = copy.deepcopy(model).requires_grad_(False)
        if self.fisher:  # EWC: the tasks before, as one quadratic penalty (after Eq. 3)
            params = dict(model.named_parameters())
            net.fisher = self.fisher
            net.anchor = anchor(list(self.fisher.values()), list(self.weighted.values()),
                                [params[n] for n in self.fisher])
        if cfg.mode == "zscl":  # WE: theta_avg starts at the step's starting weights
            WeightEnsemble.start(net)
        self.hooks = WeightEnsemble(cfg.we_every) if cfg.mode == "zscl" else None
        summary = super().learn(dataclasses.replace(cfg, mode="vanilla"), x_a, x_b, out, resume, pair, cov_x)
        if cfg.mode == "zscl" and cfg.we_every:  # ZSCL, parameter space: the step ends on theta_avg
            WeightEnsemble.finish(net)
            self.history[-1] = model.snapshot()
            summary["we_models"] = int(net.we_count)
        if cfg.mode == "ewc":
            summary["fisher_mean"] = self.add_fisher(cfg, x_a, x_b)
        return summary

    def add_fisher(self, cfg, x_a, x_b) -> float:
        """F of the step just learned at its end weights (deviation 2), consolidated into (F, W)."""
        net, theta = self.net, {n: p for n, p in self.net.model.named_parameters() if p.requires_grad}
        loader = torch.utils.data.DataLoader(
            dns.feature_pairs(x_a, x_b), batch_size=cfg.batch_size, shuffle=True, drop_last=len(x_a) >= cfg.batch_size,
            generator=torch.Generator().manual_seed(cfg.seed + len(self.history)))

        def gradients():
            for b, batch in enumerate(loader):
                if cfg.fisher_batches and b >= cfg.fisher_batches:
                    return
                batch = {k: batch[k].to(net.model.logit_scale.device) for k in ("img", "txt")}
                loss = sum(dns.DNSNet.losses(net, net.features(batch)).values())  # the task's loss alone
                yield torch.autograd.grad(loss, list(theta.values()))
        new = dict(zip(theta, empirical_fisher(gradients())))
        self.fisher, self.weighted = consolidate_named(self.fisher, self.weighted, new, theta, cfg.ewc_gamma)
        return float(sum(x.sum() for x in new.values()) / sum(x.numel() for x in new.values()))

    def state_dict(self):
        return super().state_dict() | {"fisher": self.fisher, "weighted": self.weighted}

    def load_state_dict(self, s):
        super().load_state_dict(s)
        self.fisher, self.weighted = s.get("fisher"), s.get("weighted")


def reference_features(cfg: MapsConfig, device, world=None):
    """ZSCL's reference set as frozen features (deviation 3): (images (R, D), captions (M, D)), cached with the
    tasks' features (papers.cmcl.frozen_task_features on the reference manifests)."""
    images, texts = reference_paths(cfg, world)
    ref_cfg = dataclasses.replace(cfg, task_classes="", zero_shot="")
    feats = cmcl.frozen_task_features(ref_cfg, [common.Task("reference", images, texts)], device, world)["tasks"][0]
    return feats["train"]["img"], feats["test"]["txt"]  # the manifest's unique images, the captions


def run(cfg: MapsConfig, show: bool = True, world=None) -> dict:
    """One row on CLIP features of the --tasks manifests (dns.run's sequence, papers.cmcl.run_clip)."""
    reference = reference_features(cfg, cmcl.start(cfg), world) if cfg.mode == "zscl" else None
    return cmcl.run_clip(cfg, functools.partial(MapsLearner, cfg, reference), dns.score_drift, show, world)


def run_steps(cfg: MapsConfig, show: bool = True) -> dict:
    """One row in CMCL's setting: its step sequence from cached features (--features; papers.cmcl.run_steps)."""
    if cfg.mode == "zscl":
        raise UsageError("ZSCL needs a reference set of images and texts; CMCL's steps pair other "
                                "modalities (audio, depth, ...): not applicable there (docs/baselines.md)")
    return cmcl.run_steps(cfg, functools.partial(MapsLearner, cfg, None), dns.score_drift, show)


def main(argv=None):
    cfg = parse_config(MapsConfig, argv)
    world = None
    if models.wants_lab(cfg):  # --backbone tiny / --tasks synthetic: the lab's world, handed on
        from lab import WORLD as world
    if cfg.export or cfg.lock_image or cfg.lock_text or cfg.lora or cfg.torchcompile or cfg.demo or cfg.demo_cmcl:
        raise UsageError("--export / --lock-* / --lora / --torchcompile / --demo: baselines.maps trains maps "
                                "over frozen features; its rows are in dns.py's demo")
    if cfg.features:
        if cfg.mode != "zscl":  # ZSCL: run_steps' one message, before any check of the data
            common.preflight(cfg, continual=True)
        return run_steps(cfg)
    cfg = cmcl.resolve(cfg)
    common.preflight(cfg, [t.train for t in common.parse_tasks(cfg.tasks, cfg.data_root, world)], continual=True)
    return run(cfg, world=world)


if __name__ == "__main__":
    cli(main)
