"""Long-CLIP: Unlocking the Long-Text Capability of CLIP.

Beichen Zhang, Pan Zhang, Xiaoyi Dong, Yuhang Zang, Jiaqi Wang. ECCV 2024.
arXiv 2403.15378, https://arxiv.org/abs/2403.15378. Released code:
https://github.com/beichenzbc/Long-CLIP (model/longclip.py `load_from_clip`,
model/model_longclip.py `CLIP.forward` / `CLIP.PCA`, train/train.py,
train/scheduler.py, train/sharegpt4v.py, train/train.md), read for every
detail the paper leaves open; no code of it is copied here.

What it implements
------------------
Knowledge-preserved stretching (Sec. 3.2) of the text positional embedding,
and fine-tuning with primary component matching (Sec. 3.3). The stretched
model stays an open_clip CLIP: one positional table of the new length, the
causal mask and `context_length` rebuilt, saved by common.save_model with the
new window in its sidecar, loaded back by common.load_model with it (and a
tokenizer of that window), so eval.py evaluates it through its longer window.
The paper gives the stretching as a formula (Sec. 3.2) and the loss by
pseudo-code (Sec. 3.3); the equation numbers below are ours, in order:

  Eq. (1)  stretching, L -> lam2 L - (lam2 - 1) keep positions (77 -> 248):
             PE*(p) = PE(p)                                   p < keep
             PE*(p) = (1 - a) PE(i) + a PE(i + 1)             otherwise, with
             x = keep + (p - keep) / lam2,  i = min(floor x, L - 2),  a = x - i
           (a = j / lam2 inside the old table; the last lam2 rows have x > L - 1
           and extrapolate along PE(L-1) - PE(L-2), as the released code does)
  Eq. (2)  I_coarse = F^-1(E(F(I_fine))): F = PCA of the batch, E keeps the
           top-k components (k = 32), F^-1 maps back:
             mu = mean_b I_fine_b,  X = I_fine - mu = U S V^T,
             I_coarse = X V_k V_k^T + mu
  Eq. (3)  L_long  = CLIP_eps(I_fine, T_long),  L_short = CLIP_eps(I_coarse, T_short)
           CLIP_eps(V, Y) = 1/2 [CE_eps(s V Y^T, I) + CE_eps(s Y V^T, I)]
  Eq. (4)  L = L_long + L_short

Code name -> paper symbol
-------------------------
  pos, stretched       PE, PE*     text positional table (L, d) -> (L*, d)
  keep                 20          positions kept as they are (Sec. 3.1's effective length)
  factor               lam2 = 4    stretch ratio of the other positions
  img                  I_fine      L2-normalised image embedding (B, d)
  img_coarse           I_coarse    its top-k PCA reconstruction (B, d), not renormalised
  pca_dim              k = 32
  txt_long, txt_short  T_long, T_short   L2-normalised caption embeddings (B, d)
  logit_scale          s = 1/tau   (exp of the model's parameter)
  label_smoothing      eps of CE_eps

Deviations and choices (paper / code location in brackets)
----------------------------------------------------------
 1. Stretching [Sec. 3.2; load_from_clip]: the released code's table, which
    Eq. (1) writes out: rows < keep copied, row keep + lam2 i + j =
    ((lam2 - j) PE[keep+i] + j PE[keep+i+1]) / lam2, and the last lam2 rows
    PE[L-1] + j (PE[L-1] - PE[L-2]) / lam2. Where the paper's formula and the
    code could be read differently, the code is followed. keep defaults to
    round(20 L / 77) (ours for L != 77): 20 for CLIP, 6 for the tiny backbone
    (24 -> 4 x 24 - 3 x 6 = 78 positions); lam2 = 4.
 2. The kept rows stay frozen during fine-tuning, as in the released code (a
    frozen copy of the table supplies rows < 20 and a trainable copy the rest,
    combined by masks). Here: one table whose gradient is zeroed on rows <
    keep (no weight decay on embeddings, so AdamW leaves them exactly), and
    the export is one open_clip table equal to the code's masked sum. The
    paper says only "retain". --no-freeze-kept trains them too.
 3. PCA [Sec. 3.3; CLIP.PCA and forward]: per rank, on the local batch of
    normalised fine image embeddings, centred on its mean, by SVD in float32
    (autocast off), mean added back, not renormalised, then gathered across
    ranks with gradient; the gradient flows through the SVD. All as the
    code. --pca-scope global (ours) takes the PCA of the gathered batch, so
    the result does not depend on the number of ranks. With k >= min(B, d)
    the reconstruction is exact and the input is returned without an SVD.
 4. Loss [Sec. 3.3 pseudo-code; CLIP.forward]: both terms are CLIP's
    symmetric cross-entropy with label smoothing 0.1, weight 1 each, as the
    code (the paper prints no eps).
 5. Temperature [train.py --log_scale 4.6052]: the code replaces logit_scale
    by a new parameter at ln 100 that stays in AdamW (lr 1e-6, decayed, no
    clamp); Adam moves it by at most ~lr per step. Here it is set to ln 100
    and kept fixed; --learn-temperature trains it (the shared loop clamps it
    at ln 100, so it can only fall); --log-scale -1 keeps the backbone's.
 6. Optimiser [train.md table; scheduler.py]: AdamW with beta 0.9/0.999,
    eps 1e-8, wd 1e-2, linear warm-up of 200 steps then cosine to 0 (the
    scheduler's formula), but with the shared parameter groups: no decay on
    gains, biases, embeddings and the logit scale (the code decays all).
 7. --recipe longclip = train.md's "recommended" table: global batch 2048,
    lr 1e-6 (train.md calls the paper's lr a typo), 6 epochs, 200 warm-up,
    wd 1e-2. train.py's own CLI defaults differ (128 per GPU, 2 epochs).
 8. Short caption [sharegpt4v.py; train.md]: the text before the first ". "
    of the long caption ("first-sentence"). --recipe erclip-budget uses the
    manifest's short caption (ERCLIP's first COCO caption) instead, so both
    methods see the same triplets; --short-caption chooses.
 9. Long-CLIP's data (--train-data sharegpt4v) [sharegpt4v.py]: the
    ShareGPT4V records after the first 1,000 (the ShareGPT4V-1k test set);
    we also drop later records of those 1,000 images (the code does not), so
    no test image is trained on. Images of sources missing under --data-root
    stop the pre-pass (or --skip-bad skips and counts them).
10. Windows: both captions are tokenised with the stretched window in
    training, as the code does. Evaluation reads test captions through both
    windows: the original one (77, truncated, ERCLIP's protocol) and the
    stretched one (248, Long-CLIP's); prompts of the zero-shot tasks fit in
    both, so classification is evaluated once.
11. DDP: in the code each rank scores its local rows against the gathered
    columns; here every rank computes the loss over the gathered batch
    (common.gather, with gradient). The mean over ranks of the code's loss is
    this loss (tests check it), so the gradients after DDP averaging agree.
12. --recipe erclip-budget (ours, the comparison ERCLIP's paper names as
    missing): ERCLIP's 20k COCO/ShareGPT4V pairs (the same manifest file,
    common.coco_sharegpt4v_manifest), one epoch, batch 64, lr 5e-6 with 200
    warm-up steps and cosine, wd 0.05, AdamW (0.9, 0.98, 1e-6), label
    smoothing 0.1, temperature fixed at the backbone's: ERCLIP's settings,
    so that only the method differs (stretching, frozen kept rows, PCM).

Published Long-CLIP numbers: the tables print the rows ERCLIP's Table 1 gives
for Long-CLIP (grey rows: released checkpoints trained on ~1M ShareGPT4V
captions, ViT-B/16 and L/14, 248-token window). ERCLIP's Table 2 and the
Long-CLIP paper's own tables are not reproduced here.

Commands
--------
  one GPU, the paper's recipe (ShareGPT4V json and images under data/):
    python longclip.py --backbone ViT-B/16 --out runs/longclip-b16
  torchrun (the global batch of 2048 is split across ranks):
    torchrun --nproc_per_node 8 longclip.py --backbone ViT-L/14 --out runs/longclip-l14
  same budget as ERCLIP, its run's rows printed beside:
    python longclip.py --recipe erclip-budget --backbone ViT-B/16 \\
        --erclip-results runs/erclip-b16-mp/results.json --out runs/longclip-b16-budget
  a saved model through either window:
    python eval.py --backbone ViT-B/16 --pretrained runs/longclip-b16-budget/model.pt --tasks erclip
    python eval.py --backbone ViT-B/16 --pretrained runs/longclip-b16-budget/model.pt --tasks erclip --context-length 77
  demo (the lab's world, tiny backbone, 2 CPU cores, seeds lab.SEEDS; minutes):
    python longclip.py --demo

Demo (ours, the lab)
--------------------
Same-budget Long-CLIP against ERCLIP M+P on the lab's world (lab.py), once
per seed in lab.SEEDS, from the same pretrained tiny weights. Settings fixed
before any demo run: the erclip-budget recipe (deviation 12) at erclip.py's
demo settings (its DEMO: lr 1e-4, wd 0.05, 4 warm-up steps then cosine, 40
steps at batch 32, label smoothing 0.1, fp32, workers 0, split 'train', the
manifest's short caption, the backbone's temperature kept fixed), plus
k = 8 principal components (ours: 32 of ViT-B/16's 512 embedding dimensions
is 1/16; 1/16 of the tiny backbone's 128 is 8; with the paper's k = 32 at
batch 32 the reconstruction would be exact and L_short plain CLIP). The tiny
window 24 is stretched to 78 (keep 6, lam2 = 4).
ERCLIP M+P runs are obtained WITHOUT importing erclip.py (method files never
import each other): for each seed the demo runs `python erclip.py` as a
subprocess with the same settings (--fusion mean --lambda-p 1 --eval-tasks
none, the same seed, data root and training manifest, which the demo writes
first) and measures the model.pt it exports in this process, exactly as the
Long-CLIP runs are measured. Measured: R@1 (%, mean of I2T and T2I) on split
'test' with lab.retrieval_report, long captions through the original
24-token window (truncated) and the stretched 78-token one; short-caption
R@1; held-out zero-shot top-1 (%) on the background family of 'zs-test'
(lab.zero_shot_report). Claims: paired per-seed differences, verdicts by
lab.verdict; directions and margins were fixed before running (demo_claims).
Writes runs/longclip-demo/results.json (key `claims`) and longclip-demo.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import open_clip
import torch
import torch.nn as nn

import common
import lab
import eval as evaluation

LN_100 = math.log(100.0)


# =============================================================================
# Config
# =============================================================================
@dataclasses.dataclass(frozen=True)
class LongCLIPConfig(common.Config):
    recipe: str = common.arg("longclip", "longclip: the paper's/code's settings | erclip-budget: ERCLIP's data "
                             "and schedule (ours)", choices=("longclip", "erclip-budget"))
    # the defaults are the longclip recipe (train/train.md's table unless said)
    lr: float = common.arg(1e-6, "peak learning rate")                               # train.md (deviation 7)
    wd: float = common.arg(0.01, "AdamW weight decay")                               # train.md, train.py
    beta2: float = common.arg(0.999, "AdamW beta2")                                  # train.md
    eps: float = common.arg(1e-8, "AdamW eps")                                       # train.md
    warmup: int = common.arg(200, "linear warm-up steps, then cosine")               # train.md, scheduler.py
    batch_size: int = common.arg(2048, "global batch size")                          # train.md
    epochs: int = common.arg(6, "epochs")                                            # train.md
    label_smoothing: float = common.arg(0.1, "eps of both CLIP losses")              # model_longclip.py (deviation 4)
    log_scale: float = common.arg(LN_100, "set logit_scale (log 1/tau) to this; < 0: keep the backbone's")  # train.py
    learn_temperature: bool = common.arg(False, "train logit_scale (the code leaves it in AdamW; deviation 5)")
    keep: int = common.arg(-1, "positions kept by the stretching (-1: round(20 L / 77), L the backbone's "
                           "window)")                                               # Sec. 3.2, deviation 1
    factor: int = common.arg(4, "stretch ratio lambda_2 of the other positions")    # Sec. 3.2
    stretch: bool = common.arg(True, "stretch the loaded model (off: --pretrained is a stretched model already)")
    freeze_kept: bool = common.arg(True, "keep the first `keep` positions frozen, as the code (deviation 2)")
    pca_dim: int = common.arg(32, "k: principal components kept for the coarse image embedding")  # Sec. 3.3
    pca_scope: str = common.arg("rank", "rank: PCA of each rank's batch (code) | global: of the gathered batch "
                                "(ours)", choices=("rank", "global"))
    short_caption: str = common.arg("first-sentence", "first-sentence: the long caption's text before the first "
                                    "'. ' (code) | caption: the manifest's caption",
                                    choices=("first-sentence", "caption"))                 # deviation 8
    train_data: str = common.arg("auto", "auto: sharegpt4v under --data-root (synthetic with --backbone tiny when "
                                 "absent) | sharegpt4v (Long-CLIP's) | coco-sharegpt4v (ERCLIP's 20k pairs) | "
                                 "synthetic | a manifest with caption + long_caption")
    train_pairs: int = common.arg(0, "pairs of coco-sharegpt4v (0: ERCLIP's 20000) / scenes of synthetic (0: all)")
    coco_captions: str = common.arg("", "captions_train2017.json ('': DATA_ROOT/coco/annotations/...)")
    sharegpt4v: str = common.arg("", "ShareGPT4V json ('': DATA_ROOT/sharegpt4v/share-captioner_...json)")
    eval_tasks: str = common.arg("auto", "comma list for eval.evaluate; auto: ERCLIP's (or synthetic) set; none")
    eval_base: bool = common.arg(True, "also evaluate the model before fine-tuning (original window)")
    erclip_results: str = common.arg("", "an erclip.py results.json whose rows are printed beside ours")
    demo: bool = common.arg(False, "run the lab demo: same-budget Long-CLIP against ERCLIP M+P (subprocess), "
                            "seeds lab.SEEDS")


# ERCLIP's settings (erclip.py, its paper's Sec. 4) on ERCLIP's data: only the method differs (deviation 12)
RECIPES = {
    "longclip": {},
    "erclip-budget": dict(lr=5e-6, wd=0.05, beta2=0.98, eps=1e-6, warmup=200, batch_size=64, epochs=1,
                          label_smoothing=0.1, log_scale=-1.0, train_data="coco-sharegpt4v", short_caption="caption"),
}
PAPER_EVAL_TASKS = ("urban1k", "sharegpt4v-1k", "docci", "long-dci", "coco", "cifar10", "cifar100", "imagenet")
SYNTHETIC_EVAL_TASKS = ("synthetic-long", "synthetic-short", "synthetic-shape", "synthetic-color")


# =============================================================================
# Losses (and the stretching they train)
# =============================================================================
def stretch_positional_embedding(pos, keep: int = 20, factor: int = 4):
    """Eq. (1), knowledge-preserved stretching (Sec. 3.2, deviation 1).
    pos: (L, d) positional table PE; keep: rows copied as they are; factor:
    lam2. Returns PE* of shape (factor L - (factor - 1) keep, d): rows < keep
    copied, the others linearly interpolated between neighbouring rows of PE
    at old index keep + (p - keep) / factor, and the last `factor` rows (past
    the end of PE) extrapolated from its last two rows."""
    L, d = pos.shape
    if factor < 1 or not 0 <= keep <= L - 1 or L < 2:
        raise ValueError(f"stretching needs factor >= 1 and 0 <= keep <= L - 1 (L = {L}); got keep={keep}, "
                         f"factor={factor}")
    n = factor * L - (factor - 1) * keep
    p = torch.arange(keep, n, device=pos.device)  # the stretched positions, (n - keep,)
    step, j = torch.div(p - keep, factor, rounding_mode="floor"), (p - keep) % factor
    i = (keep + step).clamp(max=L - 2)  # left neighbour; L - 2 for the extrapolated tail
    a = (keep + step - i).double() + j.double() / factor  # x - i: in [0, 1) inside, [1, 2) in the tail
    a = a.to(pos.dtype)[:, None]  # (n - keep, 1)
    out = torch.empty(n, d, dtype=pos.dtype, device=pos.device)
    out[:keep] = pos[:keep]
    # Eq. (1): PE*(p) = (1 - a) PE(i) + a PE(i + 1)
    out[keep:] = (1 - a) * pos[i] + a * pos[i + 1]
    return out


def pca_reconstruct(x, k: int):
    """Eq. (2), I_coarse = F^-1(E(F(I_fine))) (Sec. 3.3, deviation 3).
    x: (B, d) the batch's fine image embeddings; k: components kept. Centred
    on the batch mean, projected on the top-k right singular vectors of the
    centred batch, mean added back: X V_k V_k^T + mu, (B, d) float32. With
    k >= min(B, d) every component is kept and x itself is returned."""
    x = x.float()
    if k >= min(x.shape):
        return x
    with torch.autocast(x.device.type, enabled=False):
        mu = x.mean(0, keepdim=True)  # (1, d)
        X = x - mu
        _, _, Vh = torch.linalg.svd(X, full_matrices=False)  # rows: right singular vectors, by decreasing S
        V_k = Vh[:k].t()  # (d, k)
        # Eq. (2): I_coarse = X V_k V_k^T + mu
        return X @ V_k @ V_k.t() + mu


def longclip_losses(img, img_coarse, txt_long, txt_short, logit_scale, label_smoothing: float):
    """Eqs. (3)-(4): the terms of L = L_long + L_short.
    img: (B, d) normalised I_fine; img_coarse: (B, d) I_coarse (not
    renormalised, as the code); txt_long, txt_short: (B, d) normalised
    T_long, T_short; logit_scale: s = 1/tau; label_smoothing: eps."""
    # Eq. (3): L_long = CLIP_eps(I_fine, T_long)
    loss_long = common.clip_loss(img, txt_long, logit_scale, label_smoothing)
    # Eq. (3): L_short = CLIP_eps(I_coarse, T_short)
    loss_short = common.clip_loss(img_coarse, txt_short, logit_scale, label_smoothing)
    # Eq. (4): L = L_long + L_short (weight 1 each, deviation 4)
    return {"loss_long": loss_long, "loss_short": loss_short}


# =============================================================================
# Model wrapper
# =============================================================================
def original_context(backbone: str) -> int:
    """The text window of the backbone's open_clip config (77 for CLIP, 24 for tiny)."""
    cfg = open_clip.get_model_config(common.resolve_backbone(backbone)) or {}
    return int(cfg.get("text_cfg", {}).get("context_length", 77))


def default_keep(context: int) -> int:
    """Deviation 1: Long-CLIP keeps 20 of CLIP's 77 positions; other windows keep the same share."""
    return round(20 * context / 77)


def stretch_text_window(model, keep: int, factor: int) -> int:
    """Stretches an open_clip model's text tower in place (Eq. (1)): a new
    positional table, context_length and causal mask of the new length. The
    result saves and loads as the same open_clip architecture with a longer
    context. Returns the new context length."""
    t = common.text_tower(model)
    if getattr(t, "attn_mask", None) is None or getattr(t, "cls_emb", None) is not None \
            or not isinstance(getattr(t, "positional_embedding", None), torch.Tensor):
        raise ValueError("Long-CLIP's stretching needs an open_clip text transformer with a causal mask and "
                         "absolute positional embeddings (CLIP's)")
    old = t.positional_embedding
    with torch.no_grad():
        new = stretch_positional_embedding(old.detach(), keep, factor)
    n = len(new)
    t.positional_embedding = nn.Parameter(new, requires_grad=old.requires_grad)
    t.context_length = n
    if hasattr(t, "num_pos"):
        t.num_pos = n
    # open_clip's causal mask: -inf above the diagonal
    t.attn_mask = torch.full((n, n), float("-inf"), dtype=t.attn_mask.dtype, device=t.attn_mask.device).triu_(1)
    return n


def first_sentence(text: str) -> str:
    """Deviation 8: the released code's short caption, the text before the first '. '."""
    return text.replace("\n", " ").split(". ")[0].strip()


class LongCaptionCollate(common.Collate):
    """common.Collate with the long caption tokenised too ('long_text'); with
    short='first-sentence' the short caption is the long one's first sentence."""

    def __init__(self, tokenizer, short: str = "first-sentence"):
        super().__init__(tokenizer)
        self.short = short

    def __call__(self, items):
        if self.short == "first-sentence":
            items = [dict(it, caption=first_sentence(it["long_caption"]) or it["long_caption"]) for it in items]
        out = super().__call__(items)
        out["long_text"] = self.tokenizer(out["long_caption"])  # (B, stretched context)
        return out


class LongCLIP(nn.Module):
    """Stretches the text window of `model` (unless cfg.stretch is off), sets
    and fixes the temperature, freezes the kept positions; forward(batch, ctx)
    returns the loss terms of Eq. (4)."""

    def __init__(self, model, cfg: LongCLIPConfig):
        super().__init__()
        self.model, self.cfg = model, cfg
        base = original_context(cfg.backbone)
        self.keep = cfg.keep if cfg.keep >= 0 else default_keep(base)
        t = common.text_tower(model)
        if cfg.stretch:
            if t.context_length != base:
                raise ValueError(f"the model's text window is {t.context_length}, not {cfg.backbone}'s {base}: "
                                 f"it is stretched already; pass --no-stretch")
            stretch_text_window(model, self.keep, cfg.factor)
        self.context_length = int(t.context_length)
        if cfg.log_scale >= 0:
            with torch.no_grad():  # train.py sets ln 100 (deviation 5)
                model.logit_scale.fill_(cfg.log_scale)
        model.logit_scale.requires_grad_(cfg.learn_temperature)
        if cfg.freeze_kept and self.keep > 0:  # deviation 2
            t.positional_embedding.register_hook(self._freeze_kept)

    def _freeze_kept(self, grad):
        grad = grad.clone()
        grad[:self.keep] = 0
        return grad

    def forward(self, batch, ctx=None):
        img = self.model.encode_image(batch["image"], normalize=True)  # (b, d) I_fine
        txt_long = common.encode_text(self.model, batch["long_text"])  # (b, d) T_long
        txt_short = common.encode_text(self.model, batch["text"])  # (b, d) T_short
        if self.cfg.pca_scope == "rank":  # the code: PCA of the local batch, then gather (deviation 3)
            img_coarse = pca_reconstruct(img, self.cfg.pca_dim)
            img, img_coarse, txt_long, txt_short = common.gather(img, img_coarse, txt_long, txt_short)
        else:
            img, txt_long, txt_short = common.gather(img, txt_long, txt_short)
            img_coarse = pca_reconstruct(img, self.cfg.pca_dim)
        return longclip_losses(img, img_coarse, txt_long, txt_short, self.model.logit_scale.exp(),
                               self.cfg.label_smoothing)


# =============================================================================
# Training
# =============================================================================
def sharegpt4v_manifest(sharegpt4v, out_dir, holdout: int = 1000) -> Path:
    """Long-CLIP's training set (deviations 8, 9): the ShareGPT4V records after
    the first `holdout` (the ShareGPT4V-1k test set) whose image is not a test
    image; long caption = the reply (conversations[1]) with newlines as
    spaces, caption = its first sentence. Written once as JSONL under out_dir
    (image paths relative to it; ShareGPT4V's are relative to the data root)."""
    out_dir = Path(out_dir)
    path = out_dir / f"longclip-train-sharegpt4v-{holdout}.jsonl"
    if path.exists():
        return path
    if not Path(sharegpt4v).is_file():
        raise common.DataError(f"ShareGPT4V json not found: {sharegpt4v} (see the data layout in README.md)")
    records = json.loads(Path(sharegpt4v).read_text())
    held_out = {r.get("image") for r in records[:holdout]}
    rows, dropped = [], 0
    for r in records[holdout:]:
        conv = r.get("conversations", [])
        text = " ".join(str(conv[1].get("value", "")).split()) if len(conv) > 1 else ""
        if not text or not r.get("image") or r["image"] in held_out:
            dropped += 1
            continue
        rows.append({"image": str(Path("..") / r["image"]), "caption": first_sentence(text) or text,
                     "long_caption": text})
    if not rows:
        raise common.DataError(f"{sharegpt4v}: no training record after the first {holdout}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    (out_dir / (path.name + ".json")).write_text(json.dumps(
        {"sharegpt4v": str(sharegpt4v), "pairs": len(rows), "dropped": dropped, "holdout_records": holdout}))
    return path


def train_manifest(cfg: LongCLIPConfig) -> Path:
    root = Path(cfg.data_root)
    sharegpt4v = cfg.sharegpt4v or root / "sharegpt4v" / "share-captioner_coco_lcs_sam_1246k_1107.json"
    if cfg.train_data == "synthetic":
        return lab.synthetic_manifest("train", root, n=cfg.train_pairs or None)
    if cfg.train_data == "coco-sharegpt4v":  # ERCLIP's file, shared (deviation 12)
        return common.coco_sharegpt4v_manifest(
            cfg.coco_captions or root / "coco" / "annotations" / "captions_train2017.json", sharegpt4v,
            root / "erclip", cfg.train_pairs or 20000)
    if cfg.train_data == "sharegpt4v":
        return sharegpt4v_manifest(sharegpt4v, root / "longclip")
    return Path(cfg.train_data)


def read_erclip_results(path) -> tuple[str, list, float]:
    """(variant, tuned records, lambda_p) of an erclip.py results.json."""
    p = Path(path)
    try:
        res = json.loads(p.read_text())
        return res["variant"], res["tuned"], float(res["config"]["lambda_p"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise common.DataError(f"--erclip-results {p}: not an erclip.py results.json ({type(e).__name__}: {e})")


def train_longclip(cfg: LongCLIPConfig, model, train_tf, manifest):
    """Stretches and fine-tunes freshly loaded weights (so a resumed run
    rebuilds the same model); returns (model, tokenizer of its window, summary)."""
    dataset = common.ManifestDataset(manifest, train_tf, need_long=True, skip_bad=cfg.skip_bad)
    net = LongCLIP(model, cfg)
    tokenizer = common.get_tokenizer(cfg.backbone, net.context_length)
    summary = common.train(cfg, net, dataset, LongCaptionCollate(tokenizer, cfg.short_caption))
    summary.update(train_pairs=len(dataset), skipped_rows=len(dataset.skipped), context_length=net.context_length,
                   keep=net.keep, factor=cfg.factor, logit_scale=float(model.logit_scale.detach().exp()))
    return model, tokenizer, summary


def evaluate_windows(model, preprocess, tokenizers: dict, tasks, data_root, **kw) -> list:
    """eval.evaluate with each text window ({context: tokenizer}) on the
    retrieval tasks, records tagged 'window'; zero-shot tasks once, with the
    longest window (their prompts fit in any; 'window': None)."""
    retrieval = [t for t in tasks if t != "simat" and not evaluation.is_classification(t)]
    other = [t for t in tasks if t not in retrieval]
    records = []
    for window, tok in sorted(tokenizers.items()):
        if retrieval:
            records += [dict(r, window=window) for r in evaluation.evaluate(model, preprocess, tok, retrieval,
                                                                            data_root, **kw)]
    if other:
        records += [dict(r, window=None) for r in evaluation.evaluate(model, preprocess, tokenizers[max(tokenizers)],
                                                                      other, data_root, **kw)]
    return records


# =============================================================================
# Tables (ERCLIP's Tables 1 and 2 layout, with the text window)
# =============================================================================
LONG_SETS = ("urban1k", "sharegpt4v-1k", "docci", "long-dci")
# ERCLIP Tab. 1, grey rows "LongCLIP" (published results, released checkpoints, 248-token window):
# Urban1K, ShareGPT4V, DOCCI, Long-DCI as I2T, T2I pairs (R@1 %).
PUBLISHED_LONGCLIP = {
    "ViT-B/16": (79.30, 79.40, 94.60, 93.40, 63.18, 71.50, 42.20, 48.46),
    "ViT-L/14": (82.50, 86.10, 97.20, 97.30, 66.58, 78.56, 46.53, 54.28),
}
T1_COLS = ["model", "ViT", "window", "Urban1K I2T", "Urban1K T2I", "ShareGPT4V I2T", "ShareGPT4V T2I", "DOCCI I2T",
           "DOCCI T2I", "Long-DCI I2T", "Long-DCI T2I", "Avg I2T", "Avg T2I"]
T2_COLS = ["model", "ViT", "window", "L_pres", "Long avg I2T", "Long avg T2I", "COCO I2T", "COCO T2I", "C10", "C100",
           "IN"]


def openai_name(backbone: str) -> str:
    return {v: k for k, v in common.OPENAI_NAMES.items()}.get(backbone, backbone)


def vit_key(backbone: str) -> str:
    m = re.search(r"([BLH])[-/](\d+)", backbone)
    return f"{m.group(1)}/{m.group(2)}" if m else backbone


def _value(records, task, metric, window=None):
    """A record's value; records without a window (zero-shot, other runs) match any."""
    return next((r["value"] for r in records if r["task"] == task and r["metric"] == metric
                 and r.get("window") in (None, window)), None)


def _mean(vals):
    return sum(vals) / len(vals) if vals and all(v is not None for v in vals) else None


def table_rows(records, name, vit, window, pres="-"):
    """One row of each table from eval.evaluate records (retrieval of this window)."""
    t1 = [_value(records, t, m, window) for t in LONG_SETS for m in ("i2t_R@1", "t2i_R@1")]
    long_avg = (_mean(t1[0::2]), _mean(t1[1::2]))
    row1 = dict(zip(T1_COLS, [name, vit, window, *t1, *long_avg]))
    t2 = [*long_avg, _value(records, "coco", "i2t_R@1", window), _value(records, "coco", "t2i_R@1", window),
          *(_value(records, t, "top1") for t in ("cifar10", "cifar100", "imagenet"))]
    return row1, dict(zip(T2_COLS, [name, vit, window, pres, *t2]))


def paper_tables(ours, backbone: str) -> str:
    """Tables 1 and 2 in ERCLIP's layout plus a window column: the published
    rows for this backbone (ERCLIP's CLIP row, Long-CLIP's row of ERCLIP Tab. 1)
    then ours: (name, records, window, L_pres mark) each."""
    vit, rows1, rows2 = vit_key(backbone), [], []
    clip = evaluation.published_numbers("erclip", backbone)
    if clip:
        r1, r2 = table_rows([{"task": t, "metric": m, "value": v} for (t, m), v in clip.items()],
                            "paper CLIP (ERCLIP Tab. 1-2)", vit, 77)
        rows1.append(r1)
        rows2.append(r2)
    vals = PUBLISHED_LONGCLIP.get(openai_name(backbone))
    if vals:
        avg = (_mean(vals[0::2]), _mean(vals[1::2]))
        rows1.append(dict(zip(T1_COLS, ["paper Long-CLIP, ~1M pairs (ERCLIP Tab. 1)", vit, 248, *vals, *avg])))
        rows2.append(dict(zip(T2_COLS, ["paper Long-CLIP, ~1M pairs (ERCLIP Tab. 1)", vit, 248, "-", *avg,
                                        "–", "–", "–", "–", "–"])))
    for name, records, window, pres in ours:
        r1, r2 = table_rows(records, name, vit, window, pres)
        rows1.append(r1)
        rows2.append(r2)
    return ("Table 1: long-caption retrieval, R@1 (%), captions cut at the window\n\n"
            + common.markdown_table(rows1, T1_COLS, "{:.2f}")
            + "\n\nTable 2: long avg R@1, COCO 5k R@1, zero-shot top-1 (%)\n\n"
            + common.markdown_table(rows2, T2_COLS, "{:.2f}"))


# =============================================================================
# Demo (the lab: synthetic world, tiny backbone, 2 CPU cores, seeds lab.SEEDS)
# =============================================================================
# Demo settings (ours, NOT the paper's), fixed before lab.SEEDS were run: the
# erclip-budget recipe at erclip.py's demo settings (its DEMO, copied here:
# method files do not import each other), and k = 8 (module docstring, "Demo").
DEMO = dict(recipe="erclip-budget", backbone="tiny", train_data="synthetic", lr=1e-4, wd=0.05, warmup=4, steps=40,
            batch_size=32, label_smoothing=0.1, workers=0, precision="fp32", pca_dim=8, out="runs/longclip-demo",
            save_every=0, log_every=20)
DEMO_COLS = ["long", "short", "background", "long I2T", "long T2I", "short I2T", "short T2I", "shape held-out",
             "color held-out"]
ERCLIP_NAME = "ERCLIP M+P"


def demo_measure(model, preprocess, tokenizers: dict, data_root) -> dict:
    """Every number of the demo for one model, per text window
    ({window: tokenizer}): R@1 on the fine-tuning domain's test split (long
    captions cut at the window; both directions and their mean) and zero-shot
    top-1 on zs-test (once, with the longest window: the prompts fit any).
    Returns {window: measurements}."""
    zs = lab.zero_shot_report(model, preprocess, tokenizers[max(tokenizers)], data_root)
    out = {}
    for window, tok in sorted(tokenizers.items()):
        m = {**lab.retrieval_report(model, preprocess, tok, "test", data_root), **zs, "window": window}
        m["long"] = (m["long I2T"] + m["long T2I"]) / 2
        m["short"] = (m["short I2T"] + m["short T2I"]) / 2
        out[window] = m
    return out


def _paper_long_avg(vals) -> float:
    """Mean of the I2T and T2I long-set averages of an ERCLIP Tab. 1 row."""
    return (sum(vals[0::2]) / 4 + sum(vals[1::2]) / 4) / 2


def demo_paper_numbers() -> dict:
    """Long avg R@1 differences printed in ERCLIP's Table 1 (B/16 / L/14):
    published Long-CLIP (~1M ShareGPT4V pairs, 248 tokens) minus CLIP, and
    minus ERCLIP M+P (20k pairs; not the same budget)."""
    out = {}
    for other in ("CLIP", "M+P"):
        out[other] = " / ".join(
            f"{_paper_long_avg(PUBLISHED_LONGCLIP[openai_name(f'ViT-{v}')]) - _paper_long_avg(evaluation.ERCLIP_TABLE1[(v, other)]):+.1f}"
            for v in ("B/16", "L/14"))
    return out


def demo_claims(base: dict, runs: dict, short: str, full: str) -> list[dict]:
    """Paired per-seed differences. Directions and margins fixed before any
    run: Long-CLIP ahead of CLIP and of ERCLIP on long captions (Long-CLIP's
    claim; ERCLIP's stated expectation that it closes only part of the gap
    to Long-CLIP), the stretched window ahead of the truncated one (Long-CLIP
    Sec. 3); short-caption R@1 and held-out zero-shot: neither paper claims a
    direction between the two methods, so '=' within 2 points (8 test scenes
    of 400; 14 zero-shot scenes of 720). short / full: the run names of the
    Long-CLIP model read through the original and the stretched window."""
    def d(a, b, key):  # per seed, a - b ("CLIP": the pretrained model, the same for every seed)
        return lab.paired(runs, a, b, key, base)

    paper = demo_paper_numbers()
    gap = f"- (same budget not run; Tab. 1 at ~1M vs 20k pairs: {paper['M+P']})"
    return [
        lab.claim(f"Long-CLIP beats CLIP on long R@1 ({full} - CLIP)",
                  f"{paper['CLIP']} (ERCLIP Tab. 1, B/16 / L/14, ~1M pairs)", d(full, "CLIP", "long"), "+"),
        lab.claim(f"the stretched window reads more of the long captions ({full} - {short}, long R@1)", "-",
                  d(full, short, "long"), "+"),
        lab.claim(f"Long-CLIP ahead of ERCLIP on long R@1, truncated ({short} - {ERCLIP_NAME})", gap,
                  d(short, ERCLIP_NAME, "long"), "+"),
        lab.claim(f"Long-CLIP ahead of ERCLIP on long R@1, full window ({full} - {ERCLIP_NAME})", gap,
                  d(full, ERCLIP_NAME, "long"), "+"),
        lab.claim(f"short R@1 about equal ({ERCLIP_NAME} - {short}; within 2 points)", "-",
                  d(ERCLIP_NAME, short, "short"), "=", margin=2.0),
        lab.claim(f"held-out zero-shot about equal ({ERCLIP_NAME} - Long-CLIP, background top-1; within 2 points)",
                  "-", d(ERCLIP_NAME, short, "background"), "=", margin=2.0),
    ]


def demo_figure(base: dict, runs: dict, path, caption: str):
    """Bars: mean over seeds with std error bars, per-seed points on top."""
    plt = lab.pyplot()
    metrics = (("long", "long-caption R@1"), ("short", "short-caption R@1"),
               ("background", "held-out zero-shot top-1\n(background, chance 12.5)"))
    names = ["CLIP", *runs]
    colors = ["0.45", "tab:blue", "tab:orange", "tab:red"]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        ms = [base] if name == "CLIP" else runs[name]
        xs = np.arange(len(metrics)) + (j - (len(names) - 1) / 2) * width
        vals = np.array([[m[k] for k, _ in metrics] for m in ms])  # (seeds, metrics)
        err = vals.std(0, ddof=1) if len(ms) > 1 else None
        ax.bar(xs, vals.mean(0), width, yerr=err, capsize=3, color=colors[j % len(colors)],
               label="CLIP (pretrained)" if name == "CLIP" else f"{name} ({len(ms)} seeds)")
        for v in vals:
            ax.scatter(xs, v, s=8, color="black", zorder=3)
    ax.set_xticks(np.arange(len(metrics)), [t for _, t in metrics], fontsize=8)
    ax.set(ylabel="% (R@1: mean of I2T and T2I; top-1)", title="lab world, tiny CLIP: same-budget Long-CLIP vs ERCLIP M+P")
    ax.legend(fontsize=8)
    fig.suptitle(caption, fontsize=8)
    return lab.save_figure(fig, path)


def erclip_command(cfg: LongCLIPConfig, seed: int, out) -> list[str]:
    """`python erclip.py` for ERCLIP M+P at the demo's settings and seed (a
    subprocess: method files never import each other)."""
    flags = dict(backbone=cfg.backbone, pretrained=cfg.pretrained, data_root=cfg.data_root, train_data=cfg.train_data,
                 train_pairs=cfg.train_pairs, lr=cfg.lr, wd=cfg.wd, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps,
                 warmup=cfg.warmup, steps=cfg.steps, epochs=cfg.epochs, batch_size=cfg.batch_size,
                 grad_clip=cfg.grad_clip, label_smoothing=cfg.label_smoothing, precision=cfg.precision,
                 workers=cfg.workers, device=cfg.device, log_every=cfg.log_every, save_every=0, seed=seed, out=str(out),
                 fusion="mean", lambda_p=1.0, eval_tasks="none")
    args = [sys.executable, str(Path(__file__).resolve().parent / "erclip.py")]
    for k, v in flags.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args + ["--no-eval-base"]


def run_demo(cfg: LongCLIPConfig):
    """CLIP, ERCLIP M+P (subprocess) and same-budget Long-CLIP (both
    windows) on the lab world, once per seed in lab.SEEDS from the same
    pretrained weights; claims from the paired differences."""
    t0 = time.time()
    out = Path(cfg.out)
    model, _, preprocess, tokenizer = common.load_model(cfg.backbone, cfg.pretrained)
    short_window = original_context(cfg.backbone)
    base = demo_measure(model, preprocess, {short_window: tokenizer}, cfg.data_root)[short_window]
    manifest = train_manifest(cfg)  # written here, so the ERCLIP subprocess reads the same file
    runs, names = {ERCLIP_NAME: []}, {}
    for seed in lab.SEEDS:
        run_out = out / f"ERCLIP-MP-seed{seed}"
        shutil.rmtree(run_out, ignore_errors=True)  # the demo's own folder: a rerun starts it afresh
        t1 = time.time()
        subprocess.run(erclip_command(cfg, seed, run_out), check=True, stdout=subprocess.DEVNULL)
        model, _, preprocess, tokenizer = common.load_model(cfg.backbone, str(run_out / "model.pt"))
        runs[ERCLIP_NAME].append({**demo_measure(model, preprocess, {short_window: tokenizer},
                                                 cfg.data_root)[short_window], "seed": seed,
                                  "train_seconds": time.time() - t1})
        print(f"[longclip demo] seed {seed} {ERCLIP_NAME}: {time.time() - t1:.0f}s (subprocess)", file=sys.stderr)

        run_out = out / f"LongCLIP-seed{seed}"
        shutil.rmtree(run_out, ignore_errors=True)
        vcfg = dataclasses.replace(cfg, seed=seed, out=str(run_out))
        model, train_tf, preprocess, _ = common.load_model(cfg.backbone, cfg.pretrained)
        torch.manual_seed(seed)
        model, long_tok, summary = train_longclip(vcfg, model, train_tf, manifest)
        window = summary["context_length"]
        tokenizers = {window: long_tok, short_window: common.get_tokenizer(cfg.backbone, short_window)}
        for w, m in demo_measure(model, preprocess, tokenizers, cfg.data_root).items():
            names[w] = f"Long-CLIP, window {w}"
            runs.setdefault(names[w], []).append({**m, "seed": seed, "train_seconds": summary["train_seconds"]})
        print(f"[longclip demo] seed {seed} Long-CLIP: {summary['train_seconds']:.0f}s", file=sys.stderr)
    short, full = names[short_window], names[max(names)]
    head = (f"Long-CLIP demo: lab world, tiny backbone, seeds {list(lab.SEEDS)}, {cfg.steps} steps x batch "
            f"{cfg.batch_size}, lr {cfg.lr:g}, k = {cfg.pca_dim} (demo settings; ERCLIP M+P by subprocess at the "
            f"same settings). R@1 % (long, short: mean of I2T and T2I) on the fine-tuning domain's test split, "
            f"long captions cut at the window ({short_window}: truncated; {max(names)}: Long-CLIP's stretched "
            f"window); zero-shot top-1 % on zs-test: background = held-out family (8 classes, chance 12.5). "
            f"Mean ± std over seeds.")
    claims = demo_claims(base, runs, short, full)
    lab.report_demo(out, head, base, runs, claims, DEMO_COLS, t0, lambda o: demo_figure(
        base, runs, o / "longclip-demo.png", f"python longclip.py --demo; seeds {list(lab.SEEDS)}; error bars: "
        f"std over seeds; dots: seeds"), config=dataclasses.asdict(cfg),
        erclip="python erclip.py subprocess per seed: " + " ".join(
            erclip_command(cfg, lab.SEEDS[0], out / "ERCLIP-MP-seed{seed}")[1:]))
    return {"base": base, "per_seed": runs, "claims": claims}


# =============================================================================
# Main
# =============================================================================
def _recipe(argv) -> str:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--recipe", default="longclip", choices=tuple(RECIPES))
    return p.parse_known_args(argv)[0].recipe


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    demo = "--demo" in argv
    cfg = common.parse_config(LongCLIPConfig, argv, **{**RECIPES["erclip-budget" if demo else _recipe(argv)],
                                                       **(DEMO if demo else {})})
    if cfg.demo:
        return run_demo(cfg)
    cfg = common.resolve_auto(cfg, "train_data", "sharegpt4v", [
        cfg.sharegpt4v or Path(cfg.data_root) / "sharegpt4v" / "share-captioner_coco_lcs_sam_1246k_1107.json"],
        "the ShareGPT4V descriptions with their images, Sec. 4.1")
    torch.manual_seed(cfg.seed)  # the initial weights when --pretrained random
    tasks = evaluation.task_list(cfg.eval_tasks, cfg.train_data, PAPER_EVAL_TASKS, SYNTHETIC_EVAL_TASKS)
    rank = common.dist_info()[0]
    erclip_run = read_erclip_results(cfg.erclip_results) if cfg.erclip_results else None
    manifest = train_manifest(cfg)  # fails at once when the training data is missing
    evaluation.check_tasks(tasks, cfg.data_root)
    common.preflight(cfg, [manifest], need_long=True)  # rows, --out, device: before any model is loaded
    model, train_tf, preprocess, tokenizer = common.load_model(cfg.backbone, cfg.pretrained,
                                                               cache_dir=cfg.cache_dir)
    base_window = common.text_tower(model).context_length
    device = common.init_distributed(cfg.device)
    base = []
    if tasks and cfg.eval_base and rank == 0:  # before stretching, through its own window
        base = [dict(r, window=None if r["task"] == "simat" or evaluation.is_classification(r["task"]) else base_window)
                for r in evaluation.evaluate(model.to(device), preprocess, tokenizer, tasks, cfg.data_root,
                                             model_name=cfg.backbone, weights="before fine-tuning")]
    model, long_tokenizer, summary = train_longclip(cfg, model, train_tf, manifest)
    if rank != 0:
        return summary
    if "stopped_at" in summary:  # --stop-at: a checkpoint, no model.pt, nothing evaluated
        print(f"[longclip] stopped at step {summary['stopped_at']}; checkpoint {summary['checkpoint']}; continue "
              f"with --resume latest", file=sys.stderr)
        return {"summary": summary}
    window = summary["context_length"]
    short_window = original_context(cfg.backbone)
    tokenizers = {window: long_tokenizer}
    if short_window < window:
        tokenizers[short_window] = common.get_tokenizer(cfg.backbone, short_window)
    tuned = evaluate_windows(model, preprocess, tokenizers, tasks, cfg.data_root, model_name=cfg.backbone,
                             weights=str(Path(cfg.out) / "model.pt")) if tasks else []
    name = "Long-CLIP" + (" same budget" if cfg.recipe == "erclip-budget" else "") + " (ours)"
    if cfg.train_data == "synthetic":
        parts = [("CLIP (ours)", base)] + [(f"{name}, window {w}", [r for r in tuned if r["window"] in (w, None)])
                                           for w in sorted(tokenizers)]
        text = "\n\n".join(f"{title}\n\n{evaluation.results_table(r)}" for title, r in parts if r)
    else:
        ours = ([("CLIP (ours)", base, base_window, "-")] if base else [])
        if erclip_run:
            variant, records, lambda_p = erclip_run
            ours.append((f"ERCLIP {variant} (ours, --erclip-results)", records, short_window,
                         "yes" if lambda_p > 0 else "no"))
        ours += [(name, tuned, w, "no") for w in sorted(tokenizers)]
        text = paper_tables(ours, cfg.backbone)
    print(text)
    common.write_results(cfg.out, {"recipe": cfg.recipe, "manifest": str(manifest), "summary": summary,
                                   "windows": sorted(tokenizers), "base": base, "tuned": tuned, "tables": text,
                                   "erclip_results": cfg.erclip_results, "config": dataclasses.asdict(cfg)})
    return {"summary": summary, "base": base, "tuned": tuned}


if __name__ == "__main__":
    common.cli(main)
