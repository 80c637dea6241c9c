"""m2-Mix / m3-Mix: geodesic multi-modal mixup for robust fine-tuning of CLIP.

Changdae Oh, Junhyuk So, Hoyoon Byun, YongTaek Lim, Minchul Shin, Jong-June Jeon, Kyungwoo Song.
"Geodesic Multi-Modal Mixup for Robust Fine-Tuning." NeurIPS 2023, https://arxiv.org/abs/2203.03897.
Released code ("the code"): github.com/changdaeoh/multimodal-mixup (main.py, loss.py, scripts/).

Implements (each equation written out once, in the docstring of the function named)
  Eq. (3)       geodesic mixup (slerp) of two batches of unit vectors: common.geodesic_mix
  Eqs. (4)-(5)  m2-Mix, every negative replaced by the image-text mix of the other pair: m2mix_loss
  Sec. 4.2.1    V-Mix, L-Mix (uni-modal mixup, flipped batch, soft targets): vmix_loss, lmix_loss
  Sec. 4.2.2    VL-Mix (images and texts mixed with the same lam): vlmix_loss
  Sec. 4.2.3    m3-Mix = L_CLIP + L_m2 + L_uni + L_VL, mix terms weighted (Tab. 6): M2Mix.loss_terms
  Sec. 5.1-5.3  ViT-B/32, Flickr30k / COCO: Tab. 1 retrieval, Fig. 2 align/unif, Tab. 2 / Fig. 6 ECE
Code name -> paper symbol
  img, txt          I, T           L2-normalised image / text embeddings, (B, D)
  logit_scale       s = 1/tau      the cosine logits' multiplier; logit_scale2: 1/t2 (Algorithm 1)
  lam, alpha_*      lambda, alpha  ratio ~ Beta(alpha, alpha) (Tab. 6), weighting the FIRST argument
  m2/uni/vl_weight  lambda_1..3    weights of L_m2, L_uni, L_VL (Tab. 6)
  flip(x), I_R      x_{i'}, I_R    the batch reversed (i' = B-1-i); the identity flipped on its rows

Deviations (one line each; at length in docs/m2mix.md under the same number, with the towers' T1-T7)
  1. Eq. (3) in float64, theta = 2 atan2(|a-b|, |a+b|) in [1e-6, pi - 1e-6]: finite at a = +-b.
  2. V-/L-Mix: M fully mixed (the code); un-mixed: Sec. 4.2.1's denominators, Alg. 1's two diagonals
  3. VL-Mix target: the paper's pseudo-label I (Sec. 4.2.2); the code's I + I_R: --vl-target code.
  4. L_m2 averages its directions (Eq. 5), real anchors (Eq. 4); the code sums: --m2-directions sum.
  5. One learnable tau (Eq. 1); Alg. 1's t2: --m2-own-tau; the code's: --m2-tau 0.07 --base-tau 0.01
  6. The code decays every mix weight as 1/(epoch+1), the paper does not: --mix-decay.
  7. eval() mode while training (Sec. 5.1, the code): on by default, --no-eval-mode turns it off.
  8. Sec. 5.1 prepends "a photo of" to every text; we use the captions as given (train and test).
  9. Ours: lr 1e-5, wd 0.2 (code sweeps); mix weights 0.05, m3's L_m2 2.5x m3mix.sh's per direction
 10. Data (Sec. 5.1): F30k Karpathy train -> test, COCO train2017 -> val2017; --coco-split karpathy.
 11. One lam per batch and per term, drawn from the step's seeded generator (same on every rank).
 12. Numerics, not the paper: every loss (logits included) in float32, autocast off: common.float32
 13. Eq. (4)'s denominator keeps the positive (Sec. 4.1's text, the code): --m2-form printed.
 14. L_uni = 1/2 (C_V + C_L) (Sec. 4.2.1); the code weights C_V and C_L each: --uni-combine sum.
 15. SIMAT (Tab. 5): eval.py's protocol (test split, 14 lambdas); the code's: --simat-protocol code.
 16. Float32 weights and lam between steps; the code keeps both in fp16 (main.py): --fp16-weights.
 17. No weight decay on gains, biases, embeddings, logit_scale; the code decays all: --decay-all.
 18. Flickr30k: Karpathy's split; the code reads its own captions3.txt (unreleased; 1 per image)
 19. AdamW beta2 0.98, eps 1e-6 (Sec. 5.1); the code: torch's 0.999, 1e-8: --beta2 0.999 --eps 1e-8
 20. C_m2(T, I)'s negatives are mix_lam(I_j, T_j) too (the code), not Eq. (4) swapped (T, I).
 21. Training images randomly cropped (open_clip, 0.9-1); the code centre-crops: --augment none.
 22. --loss siglip (ours): L_CLIP SigLIP's, from s=10, b=-10 (--siglip-init); mixes keep softmax.
Commands: README.md (runs, --collect, --demo, the towers); docs/m2mix.md (torchrun, the code's)
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

from plumbing import flags, published  # torch-free: --help and --collect answer before torch loads
from plumbing.flags import arg


@dataclass(frozen=True)
class M2MixConfig(flags.TowerConfig):  # + the towers' settings (--backbone bert-resnet50)
    backbone: str = arg("ViT-B/32", "paper: Sec. 5.1 | bert-resnet50 (Sec. 5.4)")  # Sec. 5.1
    train_data: str = arg("auto", "auto: flickr30k in --data-root (tiny: synthetic) | "
                          "flickr30k (Karpathy) | coco | a manifest | synthetic | imagefolder:DIR")
    coco_split: str = arg("2017", "coco's split (deviation 10)", choices=("2017", "karpathy"))
    train_captions: str = arg("first", "first (Sec. 5.1) | all captions", choices=("first", "all"))
    epochs: int = arg(9, "epochs")  # code scripts
    batch_size: int = arg(128, "global batch")  # code scripts
    lr: float = arg(1e-5, "peak lr")  # ours, inside the code's sweep {1e-5, 7e-6}
    wd: float = arg(0.2, "AdamW weight decay")  # ours, inside the code's sweep {0.2, 0.01}
    warmup: int = arg(-10, "warm-up steps; negative = percent of all steps")  # code: 10% warm-up
    out: str = arg("runs/m2mix", "output folder")
    method: str = arg("m3", "ft: CLIP | m2: + m2-Mix | m3: + uni, VL", choices=("ft", "m2", "m3"))
    m2_weight: float = arg(0.05, "lambda_1 of L_m2 (ours; per direction 2.5x m3mix.sh's: dev. 9)")
    uni_weight: float = arg(0.05, "lambda_2, weight of L_uni = (C_V + C_L)/2")  # Tab. 6 range; ours
    vl_weight: float = arg(0.05, "lambda_3, weight of L_VL")  # Tab. 6 range; ours
    alpha_m2: float = arg(0.0, "Beta parameter, m2 ratio; 0: 0.5 for m2, 0.2 inside m3 (code)")
    alpha_v: float = arg(0.5, "Beta parameter of the V-Mix ratio")  # code
    alpha_l: float = arg(0.5, "Beta parameter of the L-Mix ratio")  # code
    alpha_vl: float = arg(0.5, "Beta parameter of the VL-Mix ratio")  # code
    m2_form: str = arg("text", "Eq. (4)'s reading (dev. 13)", choices=("text", "printed"))
    m2_directions: str = arg("mean", "mean: Eq. (5)'s 1/2 | sum: the code", choices=("mean", "sum"))
    uni_combine: str = arg("mean", "mean: L_uni = (C_V + C_L)/2 (Sec. 4.2.1) | sum: C_V + C_L, "
                                   "each at --uni-weight (code, dev. 14)", choices=("mean", "sum"))
    vl_target: str = arg("paper", "paper: I | code: I + I_R", choices=("paper", "code"))
    m2_tau: float = arg(0.0, "m2 temperature (code: 0.07); 0: the model's; --m2-own-tau: start")
    m2_own_tau: bool = arg(False, "Alg. 1: the m2 term's own trainable temperature t2 (dev. 5)")
    base_tau: float = arg(0.0, "fixed temperature of CLIP/uni/VL terms (code: 0.01); 0: learnable")
    mix_decay: bool = arg(False, "multiply the mix weights by 1/(epoch+1) (code)")
    eval_mode: bool = arg(True, "keep the model in eval() mode while training (Sec. 5.1, code)")
    fp16_weights: bool = arg(False, "weights and lam rounded to fp16, as the code (deviation 16)")
    eval_base: bool = arg(True, "evaluate before fine-tuning too (the ZS row)", old=("--eval-zs",))
    eval_tasks: str = arg("", "eval.py tasks a,b (not the train set's; none)", old=("--eval-on",))
    simat: bool = arg(False, "also evaluate SIMAT (Tab. 5) through eval.py; needs data/simat")
    simat_protocol: str = arg("ours", "SIMAT's split, lambdas (dev. 15)", choices=("ours", "code"))
    collect: str = arg("", "run folders a,b: Table 1 of their results, printed and in a/collect.md")
    demo: bool = arg(False, "run lab/demos/m2mix.py (ZS, FT, m2/m3-Mix, i-Mix, Un-Mix) and exit")
    demo_unimodal: bool = arg(False, "run lab/demos/towers.py (Sec. 5.4's towers) and exit")


if __name__ == "__main__":  # --help and flag errors: answered here, before torch loads (2-5 s)
    flags.answer_early(M2MixConfig, commands={"collect": published.collect_command})

import torch
import torch.nn.functional as F

import common
import eval as evaluation
from plumbing import manifests, models, results, runfolder, towers
from protocols import m2mix_analysis
from papers import m2mix_data


# --- Losses ---
def flip(x):
    """x_{i'}: the batch reversed, partner of row i is row B-1-i (Algorithm 1)."""
    return torch.flip(x, dims=[0])


def soft_cross_entropy(logits, target):
    """mean_i [ -sum_j target_ij log softmax(logits_i)_j ]; logits, target (B, B)."""
    return -(target * logits.float().log_softmax(-1)).sum(-1).mean()


@common.float32
def m2mix_loss(img, txt, logit_scale, lam, directions: str = "mean", form: str = "text"):
    """Eqs. (4)-(5): m2-Mix, hard negatives made by mixing image and text.
        mix_j = mix_lam(I_j, T_j)
      form="text" (Sec. 4.1's text, the code; deviation 13; Algorithm 1 also keeps the positive
      but anchors its rows on the mixes, mix_j . T_i: docs/m2mix.md):
        C_m2(I,T) = -1/B sum_i log exp(s I_i.T_i) / [exp(s I_i.T_i) + sum_{j!=i} exp(s I_i.mix_j)]
      form="printed" (Eq. (4) as printed):
        C_m2(I,T) = -1/B sum_i log exp(s I_i.T_i) / sum_{j=1}^{B} exp(s I_i.mix_j)
      C_m2(T,I) = the same with T_i as anchor: negatives s T_i.mix_j, the same mix_j (deviation 20)
        L_m2 = 1/2 (C_m2(I,T) + C_m2(T,I))          (directions="sum": without the 1/2, the code)
    img, txt: (B, D) normalised; logit_scale: s; lam: float in [0, 1]."""
    if form not in ("text", "printed") or directions not in ("mean", "sum"):
        raise ValueError(f"form is 'text' or 'printed' ({form!r}), directions 'mean' or 'sum' "
                         f"({directions!r})")
    mix = common.geodesic_mix(lam, img, txt)  # (B, D)
    pos = (img * txt).sum(-1, keepdim=True)  # (B, 1): I_i . T_i
    if form == "text":
        eye = torch.eye(len(img), dtype=torch.bool, device=img.device)
        labels = torch.arange(len(img), device=img.device)
        # Eq. (4): the text's reading; diagonal = positive pair, off-diagonal = anchor . mix_j
        logits_img = logit_scale * torch.where(eye, pos, img @ mix.t())  # (B, B), anchor I_i
        logits_txt = logit_scale * torch.where(eye, pos, txt @ mix.t())  # (B, B), anchor T_i
        c_it, c_ti = F.cross_entropy(logits_img, labels), F.cross_entropy(logits_txt, labels)
    else:
        # Eq. (4): as printed; all j in the denominator, mix_i included, the positive absent
        c_it = (torch.logsumexp(logit_scale * img @ mix.t(), dim=1)
                - logit_scale * pos[:, 0]).mean()
        c_ti = (torch.logsumexp(logit_scale * txt @ mix.t(), dim=1)
                - logit_scale * pos[:, 0]).mean()
    # Eq. (5): the mean of the two directions (the code: their sum)
    total = c_it + c_ti
    return 0.5 * total if directions == "mean" else total


def _flip_targets(lam, n, device):
    """lam I + (1 - lam) I_R: the V-Mix / L-Mix pseudo-labels, (B, B)."""
    eye = torch.eye(n, device=device)
    return lam * eye + (1 - lam) * flip(eye)


@common.float32
def vmix_loss(img, txt, logit_scale, lam):
    """Sec. 4.2.1, V-Mix (every logit of M mixed, as the code; deviation 2):
        M = s mix_lam(I, flip(I)) T^T,   Y = lam I + (1-lam) I_R
        C_V = 1/2 [ CE(M, Y) + CE(M^T, Y^T) ]
    img, txt: (B, D) normalised; logit_scale: s; lam: float."""
    # Sec. 4.2.1: image i mixed with its partner i' = B-1-i
    logits = logit_scale * common.geodesic_mix(lam, img, flip(img)) @ txt.float().t()  # (B, B)
    target = _flip_targets(lam, len(img), img.device)
    return 0.5 * (soft_cross_entropy(logits, target) + soft_cross_entropy(logits.t(), target.t()))


@common.float32
def lmix_loss(img, txt, logit_scale, lam):
    """Sec. 4.2.1, L-Mix (every logit of M mixed, as the code; deviation 2):
        M = s I mix_lam(T, flip(T))^T,   Y = lam I + (1-lam) I_R
        C_L = 1/2 [ CE(M, Y) + CE(M^T, Y^T) ]"""
    # Sec. 4.2.1: text i mixed with its partner i' = B-1-i
    logits = logit_scale * img.float() @ common.geodesic_mix(lam, txt, flip(txt)).t()  # (B, B)
    target = _flip_targets(lam, len(img), img.device)
    return 0.5 * (soft_cross_entropy(logits, target) + soft_cross_entropy(logits.t(), target.t()))


@common.float32
def vlmix_loss(img, txt, logit_scale, lam, target: str = "paper"):
    """Sec. 4.2.2, VL-Mix: images and texts mixed with the same lam and partner.
        M = s mix_lam(I, flip(I)) mix_lam(T, flip(T))^T,   Y = I (paper) | I + I_R (code)
        L_VL = 1/2 [ CE(M, Y) + CE(M^T, Y^T) ]
    At lam = 1 it is the CLIP loss (common.clip_loss)."""
    # Sec. 4.2.2: both modalities mixed with the same ratio
    logits = (logit_scale * common.geodesic_mix(lam, img, flip(img))
              @ common.geodesic_mix(lam, txt, flip(txt)).t())  # (B, B)
    eye = torch.eye(len(img), device=img.device)
    y = eye if target == "paper" else eye + flip(eye)
    return 0.5 * (soft_cross_entropy(logits, y) + soft_cross_entropy(logits.t(), y.t()))


# --- Model wrapper ---
class Fp16Storage:
    """common.train hooks for --fp16-weights (deviation 16): after every optimizer step, the
    parameters OpenAI's clip.model.convert_weights casts (conv, linear and attention weights and
    biases; proj, text_projection) are rounded to fp16, as the code's convert_weights after each
    step; norms, embeddings, logit_scale stay float32."""
    def __init__(self, model):
        casts = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Linear, torch.nn.MultiheadAttention)
        self.params = list({id(p): p for m in model.modules()
                            for n, p in m.named_parameters(recurse=False)
                            if isinstance(m, casts) or n in ("proj", "text_projection")}.values())

    def before_optimizer_step(self, net):
        pass

    def after_optimizer_step(self, net):
        with torch.no_grad():
            for p in self.params:
                p.copy_(p.half())


class M2Mix(common.Method):
    """CLIP fine-tuning with the m2-Mix / m3-Mix terms; features / losses as
    common.Method (forward: the named, already-weighted loss terms)."""
    def __init__(self, model, cfg: M2MixConfig):
        super().__init__()
        self.model, self.cfg = model, cfg
        models.pair_bias(model, cfg.loss, cfg.siglip_init)  # --loss siglip's logit_bias (dev. 22)
        if cfg.base_tau:  # deviation 5: the code's fixed base scale; the learnable one is unused
            model.logit_scale.requires_grad_(False)
        self.logit_scale2 = None
        if cfg.m2_own_tau:  # Algorithm 1's t2 (deviation 5): ln(1/t2), --m2-tau or the model's
            init = math.log(1.0 / cfg.m2_tau) if cfg.m2_tau else float(model.logit_scale.detach())
            self.logit_scale2 = torch.nn.Parameter(torch.tensor(init))

    def train(self, mode: bool = True):
        super().train(mode)
        if mode and self.cfg.eval_mode:  # Sec. 5.1: the model stays in eval() mode while training
            self.model.eval()
        return self

    def features(self, batch, ctx=None):
        return {"img": self.model.encode_image(batch["image"], normalize=True),  # (b, D)
                "txt": common.encode_text(self.model, batch["text"])}  # (b, D)

    def losses(self, f, ctx):  # every loss in float32 (common.float32)
        return self.loss_terms(*common.gather(f["img"], f["txt"]), ctx)

    def loss_terms(self, img, txt, ctx):
        """The named, weighted terms from the (global) batch's embeddings, (B, D) each."""
        cfg = self.cfg
        scale = 1.0 / cfg.base_tau if cfg.base_tau else self.model.logit_scale.exp()
        bias = self.model.logit_bias if cfg.loss == "siglip" else None  # deviation 22
        losses = {"loss_clip": common.contrastive_loss(img, txt, scale, bias, cfg.label_smoothing)}
        if cfg.method == "ft":
            return losses
        decay = 1.0 / (ctx.epoch + 1) if cfg.mix_decay else 1.0  # deviation 6
        alpha_m2 = cfg.alpha_m2 or (0.5 if cfg.method == "m2" else 0.2)
        if self.logit_scale2 is not None:  # clamped in the graph like logit_scale (1/t2 <= 100)
            m2_scale = self.logit_scale2.clamp(max=common.LOGIT_SCALE_MAX).exp()
        else:
            m2_scale = 1.0 / cfg.m2_tau if cfg.m2_tau else scale
        lam = common.sample_lam(alpha_m2, ctx.generator, cfg.fp16_weights)
        losses["loss_m2"] = cfg.m2_weight * decay * m2mix_loss(img, txt, m2_scale, lam,
                                                               cfg.m2_directions, cfg.m2_form)
        if cfg.method == "m3":
            lam_v, lam_l, lam_vl = (common.sample_lam(a, ctx.generator, cfg.fp16_weights)
                                    for a in (cfg.alpha_v, cfg.alpha_l, cfg.alpha_vl))
            c_v, c_l = vmix_loss(img, txt, scale, lam_v), lmix_loss(img, txt, scale, lam_l)
            # Sec. 4.2.1: L_uni = 1/2 (C_V + C_L); "sum": C_V + C_L, the code (deviation 14)
            uni = 0.5 * (c_v + c_l) if cfg.uni_combine == "mean" else c_v + c_l
            losses["loss_uni"] = cfg.uni_weight * decay * uni
            losses["loss_vl"] = cfg.vl_weight * decay * vlmix_loss(img, txt, scale, lam_vl,
                                                                   cfg.vl_target)
        return losses


# --- Training and evaluation ---
def evaluate_model(model, preprocess, tokenizer, cfg: M2MixConfig, label: str) -> list[dict]:
    """eval.evaluate on every protocol: R@1/5/10, plus m2-Mix's geometry (align, unif, on each
    image's first caption) and ECE (both directions, the model's temperature, the ECE-vs-tau
    curve)."""
    records = []
    for name, task in m2mix_data.eval_tasks(cfg).items():
        for r in evaluation.evaluate(model, preprocess, tokenizer, [task], cfg.data_root,
                                     model_name=label, analyses=("geometry", "ece")):
            records.append(dict(r, task=name))
    if cfg.simat:  # deviation 15: --simat-protocol code evaluates the code's split and lambdas
        records += evaluation.evaluate(model, preprocess, tokenizer, ["simat"], cfg.data_root,
                                       model_name=label, simat_protocol=cfg.simat_protocol)
    return records


def finetune(cfg: M2MixConfig, show: bool = True, world=None) -> dict:
    """Loads the backbone, evaluates it (ZS), fine-tunes with cfg.method,
    evaluates again; writes results.json and returns it (world: the lab's)."""
    device = common.init_distributed(cfg.device)
    if cfg.random_init or cfg.pretrained == "random":  # random initial weights, seeded (55.3)
        torch.manual_seed(cfg.seed)
    model, train_tf, eval_tf, tokenizer = models.load_model(
        cfg.backbone, "random" if cfg.random_init else cfg.pretrained, device=device,
        cache_dir=cfg.cache_dir, world=world, **towers.tower_settings(cfg))
    rank = manifests.dist_info()[0]
    manifest = m2mix_data.train_manifest(cfg, world)
    records = []
    if cfg.eval_base and rank == 0:  # kept in <out>/base.json: a resumed run reads it back
        records += results.staged(runfolder.kept_result(
            cfg, "base", lambda: evaluate_model(model, eval_tf, tokenizer, cfg, "ZS")), "base")
    dataset = common.training_set(cfg, manifest,
                                  eval_tf if cfg.augment == "none" else train_tf)  # deviation 21
    net = M2Mix(model, cfg)
    hooks = Fp16Storage(model) if cfg.fp16_weights else None
    heads = ("model.visual.head.", "model.text.proj.")  # the towers' projections (deviation T4)
    lr_of = (lambda n: cfg.head_lr if n.startswith(heads) else None) if cfg.head_lr else None
    summary = common.train(cfg, net, dataset, common.Collate(tokenizer), hooks=hooks, lr_of=lr_of,
                           validate=evaluation.validator(
                               cfg, eval_tf, list(m2mix_data.eval_tasks(cfg).values())))
    if "stopped_at" in summary or rank != 0:
        return {"summary": summary}
    tuned = evaluate_model(model, eval_tf, tokenizer, cfg, method_name(cfg))
    records += results.staged(tuned, "tuned")
    doc = results.document("m2mix", records, summary=summary)  # one schema for every method
    common.write_results(cfg.out, doc, cfg)
    if show:
        print(m2mix_analysis.table(records, cfg.backbone))
    return doc


# --- Main: Table 1, the command line ---
METHOD_NAMES = {"ft": "FT", "m2": "m2-Mix", "m3": "m3-Mix"}  # Table 1's rows


def method_name(cfg) -> str:
    """Table 1's / 3's row: FT, m2-Mix, m3-Mix; FT(tau=0.05) at a fixed temperature other than
    the paper's 0.01."""
    return METHOD_NAMES[cfg.method] + (f"(tau={cfg.base_tau:g})"
                                       if cfg.base_tau not in (0, 0.01) else "")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--demo" in argv or "--demo-unimodal" in argv:  # the lab: world, tiny backbones, claims
        from lab.demos import m2mix as demo, towers as unimodal
        return (demo if "--demo" in argv else unimodal).main(argv)
    cfg = flags.parse_config(M2MixConfig, argv)
    world = None
    if models.wants_lab(cfg):  # --backbone tiny / --train-data synthetic: the lab's world
        from lab import WORLD as world
    if cfg.collect:
        table = published.collect(cfg.collect.split(","))
        print(table)
        return table
    karpathy = Path(cfg.data_root) / "flickr30k" / "dataset_flickr30k.json"
    cfg = common.resolve_auto(cfg, "train_data", "flickr30k", [karpathy],
                              "Flickr30K and Karpathy's split file, Sec. 5.1")
    # before training: the tasks; then rows, --out, device before any model is loaded
    flag = "--eval-tasks" if cfg.eval_tasks else "--train-data (evaluated as the default task)"
    evaluation.check_tasks(list(m2mix_data.eval_tasks(cfg).values()), cfg.data_root, flag)
    common.preflight(cfg, [m2mix_data.train_manifest(cfg, world)])
    return finetune(cfg, world=world)


if __name__ == "__main__":
    from plumbing.cli import cli  # one message per expected failure, signals
    cli(main)
