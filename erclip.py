"""ERCLIP: Small-Data Adaptation of CLIP for Free-Length Image-Text Retrieval.

Hoang-Bao Le, Allie Tran, Binh T. Nguyen, Liting Zhou, Cathal Gurrin.
"ERCLIP: Small-Data Adaptation of CLIP for Free-Length Image-Text Retrieval."
arXiv:2610.29939, https://arxiv.org/abs/2610.29939.

What it implements
------------------
Training-only sentence pathway + preservation loss (Sec. 3). A long caption L
is split into sentences s_1..s_N; every sentence of the batch goes through the
SHARED text encoder in one padded batch, e_i = f_text(s_i); the sentence
embeddings are fused per caption into l and contrasted with the image. A
frozen copy of the initial model anchors the image and short-caption
embeddings. At test time the model is a plain CLIP (77-token truncation).
The paper prints its displayed equations without numbers; they are numbered
here in order of appearance:

  Sec. 3.1  z_mean = 1/N sum_i e_i                                   (M)
  Eq. (1)   H = TBlock(E + P),  w_i = softmax_i g(h_i),  z_attn = sum_i w_i e_i
  Eq. (2)   z_long = z_mean + gamma (z_attn - z_mean),  l = z_long / ||z_long||   (RT)
  Eq. (3)   L_clip(V, Y) = 1/2 [CE_eps(V Y^T / tau, I) + CE_eps(Y V^T / tau, I)]
  Eq. (4)   L_pres = 1/(2B) sum_b [(1 - v_b . v0_b) + (1 - t_b . t0_b)]
            L = L_short + alpha L_long + lambda_p L_pres
            with L_short = L_clip(V, T_short), L_long = L_clip(V, l).

Variants (Sec. 4, Table 2): M = --fusion mean --lambda-p 0; M+P = --fusion mean
(default); RT+P = --fusion rt; v1 ablations: --fusion lstm / --fusion transformer
(with --lambda-p 0, as in Table 2).

Code name -> paper symbol
-------------------------
  img, txt             v_b, t_b   image / short-caption embeddings (L2-normalised)
  img0, txt0           v0_b, t0_b the frozen initial model's embeddings
  sentence_emb, E      e_i, E     sentence embeddings, (B, N, d) padded + mask
  z_mean, z_attn       z_mean, z_attn
  gamma                gamma      gate of the residual fusion, initialised 0
  pos_embedding        P          learned sentence positions
  scorer               g          sentence scorer
  long_emb             l          fused long-caption embedding (normalised)
  logit_scale          1/tau      the multiplier (exp of the model's parameter)
  label_smoothing      eps        of CE_eps
  alpha, lambda_p      alpha, lambda_p
  teacher              the frozen copy of the initial CLIP

Deviations and choices (paper location in brackets)
---------------------------------------------------
 1. eps of CE_eps is not printed [Sec. 3.2]: default --label-smoothing 0.1.
 2. AdamW betas/eps are not printed [Sec. 4]: CLIP's (0.9, 0.98), 1e-6.
 3. The temperature is kept FIXED at the backbone's value: Sec. 4.3 says a
    learned temperature was "not tested". --learn-temperature trains it.
 4. Sentence embeddings are L2-normalised before fusion [Sec. 3.1 leaves it
    open]; they are CLIP embeddings, and eval.py's sentence-mean does the same.
 5. TBlock / g / P are not specified [Sec. 3.1]: TBlock = one pre-norm
    nn.TransformerEncoderLayer (d/64 heads, FFN 4d, no dropout); g =
    Linear(d, d) - GELU - Linear(d, 1); P = 64 learned positions (N(0, 0.01));
    sentences past the 64th share the last position.
 6. The v1 fusions have no equations [Tab. 2]: LSTM = one layer, hidden d, its
    state at the last real sentence replaces z_mean; v1 Transformer = Eq. (1)
    with z_attn replacing z_mean (no residual, no gate).
 7. Splitting on sentence-final periods [Sec. 3.1]: a '.' followed by
    whitespace or the end of the text ends a sentence, so decimals ("2.5")
    stay whole; abbreviations ("Mr. X") do split; '!' / '?' do not (the paper
    says periods); fragments with no letter or digit are dropped; whitespace
    (newlines) collapses to one space; a text with no period is one sentence.
 8. No sentence cap in the paper; --max-sentences K keeps the first K per
    caption and counts what it drops (reported in results.json).
 9. Training manifest [Sec. 4]: "first COCO caption" = first annotation of the
    image in captions_train2017.json file order; a ShareGPT4V record counts
    when its image is "coco/train2017/..." (first record per image); images of
    the first 1,000 records (the ShareGPT4V-1k test set) are left out of the
    pool, so no test image is trained on.
10. The teacher is a frozen copy made at construction, in eval mode, run under
    the same autocast as the student; it is not checkpointed and on resume is
    rebuilt from the same initial weights.
11. The fusion module uses the encoders' lr [Sec. 4: one lr]; --fusion-lr
    overrides it (ours).
12. Under DDP each rank encodes and fuses its own sentences; all embeddings
    are then gathered with gradient, so every loss is over the global batch.
13. Evaluation protocols [Sec. 4 names the sets, not their reading]: COCO
    val2017 5k uses the first 5 captions of each image (25,000 texts), as
    Long-CLIP's eval/retrieval/coco.py (github.com/beichenzbc/Long-CLIP), the
    baseline ERCLIP compares with; --eval-tasks ...,coco-all,... keeps all
    25,014. Urban1K captions are the first line of each file, as Long-CLIP's
    Urban1k.py reads them. eval.py (E1, E2) states both; the results record
    the protocol of every number.
14. Sweeps [Sec. 4.3, 4.4] (--sweep): the paper prints neither the schedule of
    its 5-epoch runs nor how the data-size runs are scheduled, nor the backbone
    of Sec. 4.4's sweeps. Ours: epochs = ONE run of 5 epochs, cosine over all
    5, evaluated after each epoch from weights saved at the epoch boundary
    (lab.EpochSnapshots; the run itself is unchanged); data-size = M+P, one
    epoch of each prefix (steps grow with the pairs; --steps fixes them),
    prefixes of one manifest (a size above the pool takes the whole pool and
    the results record the count); lambda-p = mean fusion (M at 0, M+P at 1);
    the backbone is --backbone. The two ablations the paper names as not run
    are ours: RT = --fusion rt --lambda-p 0; L_short only = mean fusion,
    alpha 0, lambda_p 0 (the sentence pathway still runs, weighted 0, so it
    is plain CLIP fine-tuning on the short captions). Sweeps run in one
    process (the paper used one GPU), not under torchrun.
15. Demo sweeps (--demo --sweep, the lab; DEMO_SWEEP_NOTES): the demo's
    settings (40 steps x 32, lr 1e-4) for every run. An "epoch" there is one
    pass over the first 256 scenes of the pool (8 steps), so the 40 steps are
    5 epochs; data sizes 40-2,000 scenes stand for 1k-50k pairs at the FIXED
    40 steps (the demo's budget cannot grow with the data); zero-shot is the
    held-out background family (the lab's ImageNet / CIFAR stand-in).
No authors' code is public to compare with.

Commands
--------
  one GPU (paper, ViT-B/16, M+P):
    python erclip.py --backbone ViT-B/16 --train-data coco-sharegpt4v --data-root data --out runs/erclip-b16-mp
  RT+P / M:   add --fusion rt   /   --lambda-p 0
  torchrun:   torchrun --nproc_per_node 4 erclip.py --backbone ViT-B/16 --train-data coco-sharegpt4v
  demo (synthetic world, tiny backbone, 2 CPU cores, a few minutes):
    python erclip.py --demo
  sweeps (Sec. 4.3 Fig. 3, Sec. 4.4; NAME: epochs | lambda-p | data-size | ablations):
    python erclip.py --sweep NAME --backbone ViT-B/16 --train-data coco-sharegpt4v --out runs/erclip-b16
    python erclip.py --demo --sweep NAME          # the lab, 3 seeds, claims + figure
    each run in OUT/sweep-NAME/<run>-seed<k>/ (started again, a sweep skips finished runs);
    one results file OUT/sweep-NAME/results.json
"""
from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import common
import eval as evaluation
import lab


# =============================================================================
# Config
# =============================================================================
@dataclasses.dataclass(frozen=True)
class ERCLIPConfig(common.Config):
    lr: float = common.arg(5e-6, "peak learning rate")                          # Sec. 4
    wd: float = common.arg(0.05, "AdamW weight decay")                           # Sec. 4
    warmup: int = common.arg(200, "linear warm-up steps, then cosine")           # Sec. 4
    batch_size: int = common.arg(64, "global batch size")                        # Sec. 4
    epochs: int = common.arg(1, "epochs (the paper's fixed budget)")             # Sec. 4, 4.3
    label_smoothing: float = common.arg(0.1, "eps of CE_eps (not printed; ours)")  # Sec. 3.2, deviation 1
    alpha: float = common.arg(1.0, "weight of L_long")                           # Sec. 4
    lambda_p: float = common.arg(1.0, "weight of L_pres (0: variant M)")         # Sec. 4
    fusion: str = common.arg("mean", "mean (M) | rt (residual Transformer) | lstm / transformer (v1 ablations)",
                             choices=("mean", "rt", "lstm", "transformer"))      # Sec. 3.1, Tab. 2
    max_sentences: int = common.arg(0, "keep at most K sentences per caption, count the rest (0: all; ours)")
    fusion_lr: float = common.arg(0.0, "lr of the fusion module (0: the encoders' lr; ours)")
    learn_temperature: bool = common.arg(False, "train logit_scale (the paper keeps it fixed, Sec. 4.3)")
    train_pairs: int = common.arg(0, "training pairs (0: 20000 for coco-sharegpt4v [Sec. 4], whole split for synthetic)")
    coco_captions: str = common.arg("", "captions_train2017.json ('': DATA_ROOT/coco/annotations/...)")
    sharegpt4v: str = common.arg("", "ShareGPT4V json ('': DATA_ROOT/sharegpt4v/share-captioner_...json)")
    eval_tasks: str = common.arg("auto", "comma list for eval.evaluate; auto: the paper's (or synthetic) set; none")
    eval_base: bool = common.arg(True, "also evaluate the model before fine-tuning")
    demo: bool = common.arg(False, "run the synthetic-world demo (M, M+P, RT+P on the tiny backbone)")
    sweep: str = common.arg("", "run one of the paper's sweeps (Sec. 4.3-4.4; with --demo: on the lab)",
                            choices=("", "epochs", "lambda-p", "data-size", "ablations"))


PAPER_EVAL_TASKS = ("urban1k", "sharegpt4v-1k", "docci", "long-dci", "coco", "cifar10", "cifar100", "imagenet")
SYNTHETIC_EVAL_TASKS = ("synthetic-long", "synthetic-short", "synthetic-shape", "synthetic-color")
TRAIN_POOL = "coco-sharegpt4v"


# =============================================================================
# Losses and fusion
# =============================================================================
# Sec. 3.1: split a long caption on sentence-final periods (deviation 7). The
# splitter lives in eval.py because its 'sentence-mean' text mode must split
# test captions exactly as training does; erclip.split_sentences is that function.
split_sentences = evaluation.split_sentences


def pad_sentences(sentence_emb, counts, n_max: int | None = None):
    """Scatters one flat batch of sentence embeddings into a padded tensor.
    sentence_emb: (S, d), captions' sentences back to back; counts: (B,) with
    sum S; n_max: max(counts) when the caller knows it as a Python int (no
    read from the device). Returns E (B, N, d) zero-padded, N = max count,
    and mask (B, N)."""
    counts = counts.to(sentence_emb.device)
    owner = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)  # (S,)
    start = torch.cumsum(counts, 0) - counts  # (B,) offset of each caption's first sentence
    pos = torch.arange(len(owner), device=counts.device) - start[owner]  # (S,) index within its caption
    n = max(n_max, 1) if n_max is not None else int(counts.max().clamp(min=1))
    E = sentence_emb.new_zeros(len(counts), n, sentence_emb.shape[-1])
    E[owner, pos] = sentence_emb
    mask = torch.arange(n, device=counts.device)[None, :] < counts[:, None]  # (B, N)
    return E, mask


def mean_fusion(E, mask):
    """Sec. 3.1, z_mean = 1/N sum_i e_i over the real sentences.
    E: (B, N, d) padded sentence embeddings; mask: (B, N) bool. Returns (B, d)."""
    m = mask.to(E.dtype).unsqueeze(-1)  # (B, N, 1)
    # Sec. 3.1: z_mean = 1/N sum_i e_i (count guarded against 0)
    return (E * m).sum(1) / m.sum(1).clamp(min=1)


class ResidualTransformerFusion(nn.Module):
    """Eqs. (1)-(2): gated residual Transformer fusion (RT). With
    residual=False it is the v1 Transformer ablation (z_attn replaces z_mean).
    forward(E (B, N, d), mask (B, N) bool) -> z_long (B, d), unnormalised."""

    def __init__(self, dim: int, max_positions: int = 64, residual: bool = True):
        super().__init__()
        self.block = nn.TransformerEncoderLayer(dim, max(1, dim // 64), 4 * dim, dropout=0.0, activation="gelu",
                                                batch_first=True, norm_first=True)  # TBlock (deviation 5)
        self.pos_embedding = nn.Parameter(0.01 * torch.randn(max_positions, dim))  # P
        self.scorer = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, 1))  # g
        self.residual = residual
        self.gamma = nn.Parameter(torch.zeros(1)) if residual else None  # starts at mean pooling

    def forward(self, E, mask):
        pos = torch.arange(E.shape[1], device=E.device).clamp(max=len(self.pos_embedding) - 1)
        # Eq. (1): H = TBlock(E + P), w_i = softmax_i g(h_i), z_attn = sum_i w_i e_i
        H = self.block(E + self.pos_embedding[pos].to(E.dtype), src_key_padding_mask=~mask)  # (B, N, d)
        scores = self.scorer(H).squeeze(-1).float().masked_fill(~mask, -float("inf"))  # (B, N)
        w = torch.softmax(scores, dim=1)
        z_attn = (w.unsqueeze(-1) * E.float()).sum(1)  # (B, d)
        if not self.residual:
            return z_attn
        z_mean = mean_fusion(E.float(), mask)
        # Eq. (2): z_long = z_mean + gamma (z_attn - z_mean)
        return z_mean + self.gamma * (z_attn - z_mean)


class LSTMFusion(nn.Module):
    """v1 ablation (Tab. 2): an LSTM over the sentence sequence; its state at
    the last real sentence replaces z_mean (deviation 6).
    forward(E (B, N, d), mask (B, N)) -> (B, d)."""

    def __init__(self, dim: int):
        super().__init__()
        self.lstm = nn.LSTM(dim, dim, batch_first=True)

    def forward(self, E, mask):
        lengths = mask.sum(1).clamp(min=1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(E.float(), lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return h[-1]  # (B, d)


def preservation_loss(img, img0, txt, txt0):
    """Eq. (4): L_pres = 1/(2B) sum_b [(1 - v_b . v0_b) + (1 - t_b . t0_b)].
    img, img0: (B, d) student / frozen-initial image embeddings; txt, txt0:
    (B, d) short-caption embeddings; all L2-normalised."""
    cos_img = (img.float() * img0.float()).sum(-1)  # (B,)
    cos_txt = (txt.float() * txt0.float()).sum(-1)
    # Eq. (4): L_pres = 1/(2B) sum_b [(1 - v_b.v0_b) + (1 - t_b.t0_b)]
    return ((1 - cos_img) + (1 - cos_txt)).sum() / (2 * len(img))


def erclip_losses(img, txt_short, long_emb, img0, txt0, logit_scale, alpha, lambda_p, label_smoothing):
    """Eqs. (3)-(4): the already-weighted terms of
    L = L_short + alpha L_long + lambda_p L_pres.
    img, txt_short, long_emb: (B, d) normalised v, t, l; img0, txt0: (B, d)
    the frozen initial model's (None when lambda_p = 0); logit_scale: 1/tau."""
    # Eq. (3): L_short = L_clip(V, T_short), L_long = L_clip(V, l), CE with label smoothing eps
    loss_short = common.clip_loss(img, txt_short, logit_scale, label_smoothing)
    loss_long = common.clip_loss(img, long_emb, logit_scale, label_smoothing)
    if img0 is None:
        loss_pres = img.new_zeros((), dtype=torch.float32)
    else:
        loss_pres = preservation_loss(img, img0, txt_short, txt0)
    # Eq. (4): L = L_short + alpha L_long + lambda_p L_pres
    return {"loss_short": loss_short, "loss_long": alpha * loss_long, "loss_pres": lambda_p * loss_pres}


# =============================================================================
# Model wrapper
# =============================================================================
class SentenceCollate(common.Collate):
    """common.Collate plus the sentence pathway's tokens: every sentence of
    the batch in one (S, context) tensor, captions back to back, with
    sentence_counts (B,) and sentences_dropped (B,) by the --max-sentences cap,
    and the same sums and maximum as Python ints (sentence_stats), so that the
    training step never reads them back from the GPU (a host sync)."""

    def __init__(self, tokenizer, max_sentences: int = 0):
        super().__init__(tokenizer)
        self.max_sentences = max_sentences

    def __call__(self, items):
        out = super().__call__(items)
        sentences, counts, dropped = [], [], []
        for text in out["long_caption"]:
            s = split_sentences(text) or [" ".join(text.split())]
            keep = s[:self.max_sentences] if self.max_sentences > 0 else s
            sentences += keep
            counts.append(len(keep))
            dropped.append(len(s) - len(keep))
        out["sentence_tokens"] = self.tokenizer(sentences)  # (S, context)
        out["sentence_counts"] = torch.tensor(counts)
        out["sentences_dropped"] = torch.tensor(dropped)
        out["sentence_stats"] = (sum(counts), sum(dropped), max(counts))  # seen, dropped, max per caption
        return out


def make_fusion(kind: str, dim: int):
    if kind == "mean":
        return None  # no parameters
    if kind == "rt":
        return ResidualTransformerFusion(dim)
    if kind == "transformer":
        return ResidualTransformerFusion(dim, residual=False)
    if kind == "lstm":
        return LSTMFusion(dim)
    raise ValueError(f"unknown fusion {kind!r}")


class ERCLIP(nn.Module):
    """The training wrapper: the open_clip model, the fusion module and the
    frozen teacher (only when lambda_p > 0). forward(batch, ctx) returns the
    weighted loss terms; the teacher is excluded from checkpoints."""
    no_checkpoint = ("teacher.",)

    def __init__(self, model, cfg: ERCLIPConfig):
        super().__init__()
        self.model, self.cfg = model, cfg
        self.fusion = make_fusion(cfg.fusion, common.embed_dim(model))
        self.teacher = None
        if cfg.lambda_p > 0:  # a frozen copy of the INITIAL model (deviation 10)
            self.teacher = copy.deepcopy(model).eval().requires_grad_(False)
        if not cfg.learn_temperature:  # deviation 3
            model.logit_scale.requires_grad_(False)
        self.sentences_seen = self.sentences_dropped = 0

    def train(self, mode: bool = True):
        super().train(mode)
        if self.teacher is not None:
            self.teacher.eval()  # the teacher never leaves eval mode
        return self

    def encode_long(self, sentence_tokens, sentence_counts, n_max: int | None = None):
        """All sentences of the batch in ONE padded batch through the shared
        text encoder (trimmed padding), then fused per caption. -> l (B, d)."""
        e = common.encode_text(self.model, sentence_tokens)  # (S, d) normalised (deviation 4)
        E, mask = pad_sentences(e, sentence_counts, n_max)  # (B, N, d), (B, N)
        z_long = mean_fusion(E.float(), mask) if self.fusion is None else self.fusion(E, mask)
        return F.normalize(z_long.float(), dim=-1)

    def forward(self, batch, ctx=None):
        seen, dropped, n_max = batch["sentence_stats"]  # Python ints from SentenceCollate: no host sync
        self.sentences_seen += seen
        self.sentences_dropped += dropped
        img = self.model.encode_image(batch["image"], normalize=True)  # (B, d)
        txt = common.encode_text(self.model, batch["text"])  # (B, d)
        long_emb = self.encode_long(batch["sentence_tokens"], batch["sentence_counts"], n_max)  # (B, d)
        if self.teacher is not None:
            with torch.no_grad():
                img0 = self.teacher.encode_image(batch["image"], normalize=True)
                txt0 = common.encode_text(self.teacher, batch["text"])
            img, txt, long_emb, img0, txt0 = common.gather(img, txt, long_emb, img0, txt0)
        else:
            img, txt, long_emb = common.gather(img, txt, long_emb)
            img0 = txt0 = None
        return erclip_losses(img, txt, long_emb, img0, txt0, self.model.logit_scale.exp(),
                             self.cfg.alpha, self.cfg.lambda_p, self.cfg.label_smoothing)


# =============================================================================
# Training
# =============================================================================
# The training manifest builder is shared with longclip.py (same pairs, so the two
# methods differ only in method): common.coco_sharegpt4v_manifest.
build_train_manifest = common.coco_sharegpt4v_manifest


def train_manifest(cfg: ERCLIPConfig) -> Path:
    root = Path(cfg.data_root)
    if cfg.train_data == "synthetic":
        return lab.synthetic_manifest("train", root, n=cfg.train_pairs or None)
    if cfg.train_data == TRAIN_POOL:
        return build_train_manifest(
            cfg.coco_captions or root / "coco" / "annotations" / "captions_train2017.json",
            cfg.sharegpt4v or root / "sharegpt4v" / "share-captioner_coco_lcs_sam_1246k_1107.json",
            root / "erclip", cfg.train_pairs or 20000)
    return Path(cfg.train_data)  # a user manifest with caption + long_caption


def variant_name(cfg: ERCLIPConfig) -> str:
    name = {"mean": "M", "rt": "RT", "lstm": "v1 LSTM", "transformer": "v1 Transformer"}[cfg.fusion]
    return name + ("+P" if cfg.lambda_p > 0 else "")


def train_erclip(cfg: ERCLIPConfig, model, train_tf, tokenizer, hooks=None):
    """Fine-tunes one variant of freshly loaded initial weights (so on resume
    the teacher is rebuilt from them too); returns (model, summary). hooks:
    passed to common.train (the epochs sweep saves per-epoch weights there)."""
    dataset = common.ManifestDataset(train_manifest(cfg), train_tf, need_long=True, skip_bad=cfg.skip_bad)
    net = ERCLIP(model, cfg)
    lr_of = (lambda name: cfg.fusion_lr if name.startswith("fusion.") else cfg.lr) if cfg.fusion_lr else None
    summary = common.train(cfg, net, dataset, SentenceCollate(tokenizer, cfg.max_sentences), lr_of=lr_of,
                           hooks=hooks)
    summary.update(variant=variant_name(cfg), train_pairs=len(dataset), skipped_rows=len(dataset.skipped),
                   sentences_seen=net.sentences_seen, sentences_dropped=net.sentences_dropped)
    if net.fusion is not None and getattr(net.fusion, "gamma", None) is not None:
        summary["gamma"] = float(net.fusion.gamma.detach())
    if net.sentences_dropped:
        print(f"[erclip] --max-sentences {cfg.max_sentences} dropped {net.sentences_dropped} of "
              f"{net.sentences_seen + net.sentences_dropped} sentences", file=sys.stderr)
    return model, summary


# =============================================================================
# Tables
# =============================================================================
LONG_SETS = evaluation.ERCLIP_LONG_SETS
# The paper's Tables 1 and 2 live in eval.py (evaluation.ERCLIP_TABLE1 / ERCLIP_TABLE2),
# the one home of every published number.
T1_COLS = ["model", "ViT", "Urban1K I2T", "Urban1K T2I", "ShareGPT4V I2T", "ShareGPT4V T2I", "DOCCI I2T",
           "DOCCI T2I", "Long-DCI I2T", "Long-DCI T2I", "Avg I2T", "Avg T2I"]
T2_COLS = ["model", "ViT", "L_pres", "Long avg I2T", "Long avg T2I", "COCO I2T", "COCO T2I", "C10", "C100", "IN"]


def vit_key(backbone: str) -> str:
    m = re.search(r"([BLH])[-/](\d+)", backbone)
    return f"{m.group(1)}/{m.group(2)}" if m else backbone


def _value(records, task, metric):
    return next((r["value"] for r in records if r["task"] == task and r["metric"] == metric), None)


def _mean(vals):
    return sum(vals) / len(vals) if vals and all(v is not None for v in vals) else None


def table_rows(records, name, vit, lambda_p):
    """Our rows of Tables 1 and 2 from eval.evaluate's records."""
    t1 = [_value(records, t, m) for t in LONG_SETS for m in ("i2t_R@1", "t2i_R@1")]
    long_avg = (_mean(t1[0::2]), _mean(t1[1::2]))
    row1 = dict(zip(T1_COLS, [name + " (ours)", vit, *t1, *long_avg]))
    t2 = [*long_avg, _value(records, "coco", "i2t_R@1"), _value(records, "coco", "t2i_R@1"),
          *(_value(records, t, "top1") for t in ("cifar10", "cifar100", "imagenet"))]
    pres = "-" if name == "CLIP" else ("yes" if lambda_p > 0 else "no")
    row2 = dict(zip(T2_COLS, [name + " (ours)", vit, pres, *t2]))
    return row1, row2


def paper_tables(ours: list[tuple[str, list, float]], vit: str) -> str:
    """Tables 1 and 2 in the paper's layout: the paper's rows for this
    backbone (prefixed 'paper') beside ours. ours: (name, records, lambda_p)."""
    rows1, rows2 = [], []
    for (v, name), vals in evaluation.ERCLIP_TABLE1.items():
        if v == vit:
            rows1.append(dict(zip(T1_COLS, [f"paper {name}", v, *vals, _mean(vals[0::2]), _mean(vals[1::2])])))
    for (v, name), vals in evaluation.ERCLIP_TABLE2.items():
        if v == vit:
            pres = "-" if name == "CLIP" else ("yes" if name.endswith("+P") else "no")
            rows2.append(dict(zip(T2_COLS, [f"paper {name}", v, pres, *vals])))
    for name, records, lambda_p in ours:
        r1, r2 = table_rows(records, name, vit, lambda_p)
        rows1.append(r1)
        rows2.append(r2)
    fmt = "{:.2f}"
    return ("Table 1: long-caption retrieval, R@1 (%), captions truncated at the context\n\n"
            + common.markdown_table(rows1, T1_COLS, fmt)
            + "\n\nTable 2: long avg R@1, COCO 5k R@1, zero-shot top-1 (%)\n\n"
            + common.markdown_table(rows2, T2_COLS, fmt))


# =============================================================================
# Demo (the lab: synthetic world, tiny backbone, 2 CPU cores, seeds lab.SEEDS)
# =============================================================================
# Demo settings (ours, NOT the paper's), fixed before lab.SEEDS were run: 40
# steps x 32 pairs fit the CPU budget; lr 1e-4 was the best of {3e-5, 1e-4,
# 3e-4} on the 'val' split's R@1 (short and long captions) for M+P in a pilot
# with seed 99, which is not one of lab.SEEDS.
DEMO = dict(backbone="tiny", train_data="synthetic", lr=1e-4, wd=0.05, warmup=4, steps=40, batch_size=32,
            label_smoothing=0.1, workers=0, precision="fp32", out="runs/erclip-demo", save_every=0, log_every=20)
DEMO_VARIANTS = (("M", "mean", 0.0), ("M+P", "mean", 1.0), ("RT+P", "rt", 1.0))
DEMO_COLS = ["long", "short", "background", "shape seen", "shape held-out", "color seen", "color held-out",
             "long I2T", "long T2I", "short I2T", "short T2I"]


def demo_measure(model, preprocess, tokenizer, data_root) -> dict:
    """Every number of the demo for one model: R@1 on the fine-tuning
    domain's test split (long captions truncated, the paper's protocol; both
    directions and their mean) and zero-shot top-1 on the zs-test split."""
    m = {**lab.retrieval_report(model, preprocess, tokenizer, "test", data_root),
         **lab.zero_shot_report(model, preprocess, tokenizer, data_root)}
    m["long"] = (m["long I2T"] + m["long T2I"]) / 2
    m["short"] = (m["short I2T"] + m["short T2I"]) / 2
    return m


def demo_claims(base: dict, runs: dict) -> list[dict]:
    """The paper's quantitative claims as paired per-seed differences.
    Paper numbers: Table 2 (ViT-B/32, B/16, L/14)."""
    def d(a, b, key):  # per seed, a - b ("CLIP": the pretrained model, the same for every seed)
        return lab.paired(runs, a, b, key, base)

    erosion, back = d("M", "CLIP", "background"), d("M+P", "M", "background")
    share = [100 * b / -e if e < 0 else float("nan") for b, e in zip(back, erosion)]  # % of M's loss recovered
    return [
        lab.claim("long-caption R@1 rises (M+P - CLIP, mean of I2T/T2I)", "+6.5 / +7.6 / +11.2",
                  d("M+P", "CLIP", "long"), "+"),
        lab.claim("fine-tuning erodes held-out zero-shot (M - CLIP, background top-1)",
                  "ImageNet -5.8 / -6.1 / -3.8", erosion, "-"),
        lab.claim("preservation recovers part of it (M+P - M, background top-1)",
                  "ImageNet +2.1 / +1.8 / +1.6", back, "+"),
        lab.claim("... and that part is 30-42 % of M's loss (share, %)", "36 / 30 / 42", share, "range",
                  interval=(30, 42)),
        lab.claim("short-caption retrieval kept better with P (M+P - M, short R@1)", "COCO +1.3 / +1.3 / +0.4",
                  d("M+P", "M", "short"), "+"),
        lab.claim("RT+P about equal to M+P on long R@1 (RT+P - M+P; equal within 1 point)",
                  "-0.4 / -0.1 / -0.1", d("RT+P", "M+P", "long"), "=", margin=1.0),
    ]


def demo_figure(base: dict, runs: dict, path, caption: str):
    """Long-caption R@1 against held-out zero-shot accuracy, ours (mean and
    std over seeds) beside the paper's Table 2 (ViT-B/16, ImageNet)."""
    plt = lab.pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4.2))
    colors = {"CLIP": "black", "M": "tab:red", "M+P": "tab:blue", "RT+P": "tab:green"}
    marks = {"M": dict(fmt="o", ms=7), "M+P": dict(fmt="D", ms=11, mfc="none"), "RT+P": dict(fmt="x", ms=9)}
    ax.plot(base["long"], base["background"], "s", color="black", label="CLIP (pretrained)")
    for name, ms in runs.items():
        x = np.array([m["long"] for m in ms])
        y = np.array([m["background"] for m in ms])
        ax.errorbar(x.mean(), y.mean(), xerr=x.std(ddof=1), yerr=y.std(ddof=1), capsize=4, color=colors[name],
                    label=f"{name} ({len(ms)} seeds)", **marks[name])
        ax.scatter(x, y, s=10, color=colors[name], alpha=0.4)
    ax.set(xlabel="long-caption R@1, truncated (%; mean of I2T, T2I)", ylabel="held-out zero-shot top-1 (%)",
           title="ours: lab world, tiny CLIP")
    ax.legend(fontsize=8)
    for name in ("CLIP", "M", "M+P", "RT+P"):
        row = evaluation.ERCLIP_TABLE2[("B/16", name)]
        mark = dict(fmt="s", ms=7) if name == "CLIP" else marks[name]
        bx.errorbar((row[0] + row[1]) / 2, row[6], color=colors[name], label=name, **mark)
    bx.set(xlabel="long-caption R@1 (%; avg of 4 sets, mean of I2T, T2I)", ylabel="ImageNet zero-shot top-1 (%)",
           title="paper: Table 2, ViT-B/16")
    bx.legend(fontsize=8)
    fig.suptitle(caption, fontsize=8)
    return lab.save_figure(fig, path)


def run_demo(cfg: ERCLIPConfig):
    """CLIP, M, M+P and RT+P on the lab world: every variant fine-tuned from
    the same pretrained weights once per seed in lab.SEEDS (same seed, same
    data order across variants); claims from the paired differences."""
    t0 = time.time()
    out = Path(cfg.out)
    model, _, preprocess, tokenizer = common.load_model(cfg.backbone, cfg.pretrained)
    base = demo_measure(model, preprocess, tokenizer, cfg.data_root)
    runs = {name: [] for name, _, _ in DEMO_VARIANTS}
    for seed in lab.SEEDS:
        for name, fusion, lambda_p in DEMO_VARIANTS:
            run_out = out / f"{name.replace('+', '')}-seed{seed}"
            shutil.rmtree(run_out, ignore_errors=True)  # the demo's own folder: a rerun starts it afresh
            vcfg = dataclasses.replace(cfg, fusion=fusion, lambda_p=lambda_p, seed=seed, out=str(run_out))
            model, train_tf, preprocess, tokenizer = common.load_model(cfg.backbone, cfg.pretrained)
            torch.manual_seed(seed)  # the fusion module's initialisation
            model, summary = train_erclip(vcfg, model, train_tf, tokenizer)
            runs[name].append({**demo_measure(model, preprocess, tokenizer, cfg.data_root),
                               "seed": seed, "train_seconds": summary["train_seconds"]})
            print(f"[erclip demo] seed {seed} {name}: {summary['train_seconds']:.0f}s", file=sys.stderr)
    head = (f"ERCLIP demo: lab world, tiny backbone, seeds {list(lab.SEEDS)}, {cfg.steps} steps x batch "
            f"{cfg.batch_size}, lr {cfg.lr:g} (demo settings). R@1 % on the fine-tuning domain's test split "
            f"(long = truncated at the context, the paper's protocol); zero-shot top-1 % on zs-test: background "
            f"= held-out family (8 classes, chance 12.5), seen / held-out = classes fine-tuning shows / only "
            f"pretraining saw. Mean ± std over seeds.")
    claims = demo_claims(base, runs)
    lab.report_demo(out, head, base, runs, claims, DEMO_COLS, t0, lambda o: demo_figure(
        base, runs, o / "erclip-demo.png", f"python erclip.py --demo; seeds {list(lab.SEEDS)}; error bars: std "
        f"over seeds; dots: seeds"), config=dataclasses.asdict(cfg))
    return {"base": base, "per_seed": runs, "claims": claims}


# =============================================================================
# Sweeps: training length (Sec. 4.3, Fig. 3), lambda_p and data size (Sec. 4.4),
# the component ablations (Sec. 4.4, two of them not run in the paper)
# =============================================================================
# Every run of a sweep starts from the same initial weights in its own folder
# (lab.sweep_run: a finished run is skipped when the sweep is started again).
VARIANTS = {"M": dict(fusion="mean", lambda_p=0.0), "M+P": dict(fusion="mean", lambda_p=1.0),
            "RT+P": dict(fusion="rt", lambda_p=1.0),
            "RT": dict(fusion="rt", lambda_p=0.0),                         # not run in the paper (Sec. 4.4)
            "L_short only": dict(fusion="mean", lambda_p=0.0, alpha=0.0)}  # not run in the paper (Sec. 4.4)
EPOCHS = 5                                      # Sec. 4, 4.3: every run evaluated after each of 5 epochs
LAMBDAS = (0.0, 0.25, 0.5, 1.0, 2.0)            # Sec. 4.4
DATA_SIZES = (1000, 5000, 10000, 20000, 50000)  # Sec. 4.4, pairs: prefixes of the COCO image-id order
# The lab's stand-ins (ours, fixed before the seeds ran): the pool is the world's 'train' split
# (2,000 scenes), so the paper's sizes scale by 2,000 / 50,000 at the demo's fixed 40 steps; an
# "epoch" is one pass over the first 256 scenes (8 steps of 32), so the 40 steps are 5 epochs.
DEMO_DATA_SIZES = (40, 200, 400, 800, 2000)
DEMO_EPOCH_POOL = 256
# Sec. 4.4's printed points (backbone not stated; R@1 read as the mean of I2T and T2I). Fig. 3 prints
# no numbers: Sec. 4.3 gives the epoch 1 -> 5 changes as ranges (PAPER_EPOCH_CHANGE).
PAPER_LAMBDA_IN = {0.0: 58.2, 2.0: 60.8}
PAPER_DATA = {1000: {"long": 56.3, "COCO": 40.8, "IN": 63.5}, 10000: {"long": 61.9}, 50000: {"COCO": 49.3, "IN": 59.7}}
PAPER_EPOCH_CHANGE = {"Long avg": "-0.4 to -1.2 (every variant)", "COCO": "+0.5 to +1.2 (B/32, B/16); flat (L/14)",
                      "C10": "-1.2 to -1.8 without P; -0.5 with P (B/32)"}
METRIC_COLS = T2_COLS[3:]  # Long avg I2T ... IN


def sweep_plan(name: str, sizes=DATA_SIZES) -> list[tuple[str, dict]]:
    """(run name, config overrides) of a sweep, in order; 'train_pairs' means
    a prefix of the pool."""
    if name == "epochs":
        return [(v, dict(VARIANTS[v], epochs=EPOCHS)) for v in ("M", "M+P", "RT+P")]
    if name == "lambda-p":
        return [(f"lambda_p={lp:g}", dict(fusion="mean", lambda_p=lp)) for lp in LAMBDAS]
    if name == "data-size":
        return [(f"N={n}", dict(VARIANTS["M+P"], train_pairs=n)) for n in sizes]
    return list(VARIANTS.items())


def sweep_one(cfg, root, run: str, overrides: dict, seed: int, pool, initial, measure, keep_weights=True) -> dict:
    """One run (lab.sweep_run: folder root/run, skipped when finished): a copy
    of the initial weights (model, train_tf, preprocess, tokenizer), train_erclip
    with the overrides, then measure(model, preprocess, tokenizer, weights)
    after training or, in the epochs sweep, on each epoch's checkpoint. pool:
    the manifest that 'train_pairs' takes a prefix of."""
    def go(folder):
        over = dict(overrides)
        if "train_pairs" in over:
            over["train_data"] = str(lab.prefix_manifest(pool, over["train_pairs"], folder / "pairs.jsonl"))
        elif pool is not None:
            over["train_data"] = str(pool)
        over["train_pairs"] = 0 if pool is not None else cfg.train_pairs
        rcfg = dataclasses.replace(cfg, **over, seed=seed, out=str(folder), resume="", stop_at=0, sweep="")
        model, train_tf, preprocess, tokenizer = initial
        model = copy.deepcopy(model)  # the same initial weights for every run
        torch.manual_seed(seed)  # the fusion module's initialisation, as in run_demo
        hooks = None
        if "epochs" in overrides:
            rows = common.ManifestDataset(train_manifest(rcfg), need_long=True, check_images=False,
                                          skip_bad=rcfg.skip_bad)
            hooks = lab.EpochSnapshots(folder if keep_weights else None, cfg.backbone, len(rows) // rcfg.batch_size)
        model, summary = train_erclip(rcfg, model, train_tf, tokenizer, hooks=hooks)
        if hooks is None:
            measures = [measure(model, preprocess, tokenizer, folder / "model.pt")]
        else:
            measures = []
            for snap in hooks.snapshots:  # the trained model object takes each epoch's weights in turn
                model.load_state_dict(torch.load(snap, map_location="cpu") if isinstance(snap, Path) else snap)
                measures.append(measure(model, preprocess, tokenizer, snap if isinstance(snap, Path) else None))
        if not keep_weights:  # the lab: the numbers are what is kept
            shutil.rmtree(folder / "checkpoints", ignore_errors=True)
            for p in folder.glob("model.pt*"):
                p.unlink()
        print(f"[erclip sweep] {run} seed {seed}: trained in {summary['train_seconds']:.0f}s", file=sys.stderr)
        return {"name": run, "overrides": over, "prefix": overrides.get("train_pairs"), "seed": seed,
                "summary": summary, "measures": measures}
    folder = re.sub(r"[^\w.=+-]+", "_", run)  # "L_short only" -> L_short_only
    return lab.sweep_run(root, f"{folder}-seed{seed}", go)


def run_sweep(cfg: ERCLIPConfig, sizes=None):
    """--sweep NAME: the real setting (the paper's backbone, data and
    evaluation tasks; one results file, the paper's layout printed), or with
    --demo the lab (3 seeds, claims, a figure)."""
    if cfg.demo:
        return run_demo_sweep(cfg, sizes)
    if common.dist_info()[1] > 1:
        raise ValueError("--sweep runs its runs one after another in one process (the paper used one GPU); "
                         "start it with python, not torchrun")
    t0, name = time.time(), cfg.sweep
    root = Path(cfg.out) / f"sweep-{name}"
    tasks = evaluation.task_list(cfg.eval_tasks, cfg.train_data, PAPER_EVAL_TASKS, SYNTHETIC_EVAL_TASKS)
    evaluation.check_tasks(tasks, cfg.data_root)
    sizes = sizes or DATA_SIZES
    big = dataclasses.replace(cfg, train_pairs=max(sizes)) if cfg.train_data == TRAIN_POOL else cfg
    pool = train_manifest(big) if name == "data-size" else None  # fails at once when the data is missing
    if pool is None:
        train_manifest(cfg)

    def measure(model, preprocess, tokenizer, weights):
        return evaluation.evaluate(model, preprocess, tokenizer, tasks, cfg.data_root, model_name=cfg.backbone,
                                   weights=str(weights))

    torch.manual_seed(cfg.seed)  # the initial weights when --pretrained random
    initial = common.load_model(cfg.backbone, cfg.pretrained, cache_dir=cfg.cache_dir)
    device = common.init_distributed(cfg.device)

    def base(folder):
        model = copy.deepcopy(initial[0]).to(device)
        return {"measures": [measure(model, *initial[2:], cfg.pretrained or "pretrained")]}
    base_records = lab.sweep_run(root, "CLIP", base)["measures"][0]
    runs = [sweep_one(cfg, root, run, over, cfg.seed, pool, initial, measure) for run, over in sweep_plan(name, sizes)]
    text = sweep_tables(name, base_records, runs, vit_key(cfg.backbone))
    print(text)
    common.write_results(root, {"sweep": name, "base": base_records, "runs": runs, "tables": text,
                                "config": dataclasses.asdict(cfg), "machine": common.machine_info(),
                                "wall_seconds": time.time() - t0})
    return {"base": base_records, "runs": runs, "tables": text}


def _metrics(records, name="", lambda_p=0.0) -> dict:
    row = table_rows(records, name, "", lambda_p)[1]
    row["Long avg"] = _mean([row["Long avg I2T"], row["Long avg T2I"]])
    row["COCO"] = _mean([row["COCO I2T"], row["COCO T2I"]])
    return row


def sweep_tables(name: str, base: list, runs: list[dict], vit: str) -> str:
    """The real setting's sweep in the paper's layout, the paper's printed
    numbers beside ours (Fig. 3 prints none: Sec. 4.3's ranges instead)."""
    if name == "ablations":
        return ("Component ablations (Sec. 4.4): the paper's Table 2 rows beside ours; RT (no L_pres) and "
                "L_short only (alpha = 0) are the two runs the paper names as not run.\n\n"
                + paper_tables([("CLIP", base, 0.0)] + [(r["run"].rsplit("-seed", 1)[0], r["measures"][0],
                                                         r["overrides"]["lambda_p"]) for r in runs], vit))
    cols = METRIC_COLS + ["Long avg", "COCO"]
    if name == "epochs":
        rows = [{"variant": "CLIP", "epoch": 0, **_metrics(base)}]
        change = []
        for r in runs:
            v = r["run"].rsplit("-seed", 1)[0]
            per = [_metrics(m) for m in r["measures"]]
            rows += [{"variant": v, "epoch": k, **m} for k, m in enumerate(per, 1)]
            change.append({"variant": v, **{c: per[-1][c] - per[0][c] if per[0][c] is not None and per[-1][c]
                                            is not None else None for c in ("Long avg", "COCO", "C10", "IN")}})
        change.append({"variant": "paper (Sec. 4.3)", **PAPER_EPOCH_CHANGE})
        return (f"Fig. 3 (Sec. 4.3): R@1 and zero-shot top-1 (%) after each epoch, ViT {vit}\n\n"
                + common.markdown_table(rows, ["variant", "epoch", *cols], "{:.2f}")
                + f"\n\nChange from epoch 1 to epoch {len(runs[0]['measures'])} (points)\n\n"
                + common.markdown_table(change, ["variant", "Long avg", "COCO", "C10", "IN"], "{:+.2f}"))
    if name == "lambda-p":
        rows = [{"lambda_p": "CLIP", **_metrics(base)}] + [
            {"lambda_p": f"{r['overrides']['lambda_p']:g}", **_metrics(r["measures"][0]),
             "paper IN": PAPER_LAMBDA_IN.get(r["overrides"]["lambda_p"], "-")} for r in runs]
        return (f"Preservation weight (Sec. 4.4), M, ViT {vit}; paper: ImageNet rises monotonically 58.2 -> 60.8, "
                f"long and COCO R@1 rise by up to 1.3 and plateau for lambda_p >= 0.5, C10 within 0.4\n\n"
                + common.markdown_table(rows, ["lambda_p", *cols, "paper IN"], "{:.2f}"))
    rows = [{"pairs": "CLIP", **_metrics(base)}]
    for r in runs:
        paper = PAPER_DATA.get(r["prefix"], {})
        rows.append({"pairs": r["prefix"], "used": r["summary"]["train_pairs"], **_metrics(r["measures"][0], "", 1.0),
                     **{f"paper {k}": paper.get(k, "-") for k in ("long", "COCO", "IN")}})
    return (f"Data size (Sec. 4.4), M+P, ViT {vit}, prefixes of one pool order; R@1 'long' / 'COCO' = mean of "
            f"I2T and T2I\n\n" + common.markdown_table(
                rows, ["pairs", "used", *cols, "paper long", "paper COCO", "paper IN"], "{:.2f}"))


# --- the lab: --demo --sweep NAME (the demo's settings, lab.SEEDS, claims fixed before the runs) ---
DEMO_SWEEP_NOTES = {
    "epochs": f"M, M+P, RT+P; an epoch is one pass over the first {DEMO_EPOCH_POOL} scenes of 'train' (8 steps of "
              f"32), so the 40 steps are 5 epochs (cosine over all 40); the weights saved after each epoch are "
              f"evaluated; epoch 0 is CLIP",
    "lambda-p": "M (mean fusion) with lambda_p 0, 0.25, 0.5, 1, 2 on the whole 'train' split (2,000 scenes)",
    "data-size": f"M+P on the first N scenes of 'train', N = {', '.join(map(str, DEMO_DATA_SIZES))} for the "
                 f"paper's 1k-50k (x 2,000 / 50,000), every run 40 steps (a fixed budget: 32 epochs of the "
                 f"smallest, 0.64 of the largest)",
    "ablations": "M, M+P, RT+P, RT (lambda_p 0) and L_short only (mean fusion, alpha 0, lambda_p 0) on the whole "
                 "'train' split",
}
SWEEP_README_COLS = ["long", "short", "background", "shape held-out", "color held-out"]
ZS = "background top-1"  # the held-out family: the lab's ImageNet / CIFAR stand-in, as in the demo


def sweep_claims(name: str, base: dict, rows: dict) -> list[dict]:
    """Each sweep's claims as paired per-seed differences, in the paper's
    direction (written before the seeds ran; the two ablations the paper did
    not run carry what its argument predicts)."""
    def d(a, b, key):
        return lab.paired(rows, a, b, key, base)

    if name == "epochs":
        last = EPOCHS
        out = [lab.claim(f"long R@1 falls from epoch 1 to {last}, {v} (epoch {last} - epoch 1)",
                         "-0.4 to -1.2 (every variant)", d(f"{v} epoch {last}", f"{v} epoch 1", "long"), "-")
               for v in ("M", "M+P", "RT+P")]
        out += [lab.claim(f"short R@1 rises from epoch 1 to {last}, {v}", "COCO +0.5 to +1.2 (B/32, B/16), flat (L/14)",
                          d(f"{v} epoch {last}", f"{v} epoch 1", "short"), "+") for v in ("M", "M+P", "RT+P")]
        drift_m = d(f"M epoch {last}", "M epoch 1", "background")
        drift_p = d(f"M+P epoch {last}", "M+P epoch 1", "background")
        return out + [
            lab.claim(f"zero-shot falls from epoch 1 to {last} without P (M, {ZS})", "CIFAR-10 -1.2 to -1.8", drift_m, "-"),
            lab.claim(f"P limits that drift ((M+P) - M change from epoch 1 to {last}, {ZS})",
                      "CIFAR-10 B/32: -0.5 with P against -1.2 to -1.8 without", [p - m for p, m in zip(drift_p, drift_m)], "+"),
            lab.claim(f"RT+P reaches M+P by epoch 2 (RT+P - M+P at epoch 2, {ZS}; equal within 1 point)",
                      "CIFAR-10, Fig. 3", d("RT+P epoch 2", "M+P epoch 2", "background"), "=", margin=1.0)]
    if name == "lambda-p":
        lp = [f"lambda_p={x:g}" for x in LAMBDAS]
        return [lab.claim(f"zero-shot rises from lambda_p 0 to 2 ({ZS})", "ImageNet +2.6 (58.2 -> 60.8)",
                          d(lp[-1], lp[0], "background"), "+")] + [
            lab.claim(f"... monotonically: lambda_p {a[9:]} -> {b[9:]} ({ZS})", "monotone", d(b, a, "background"), "+")
            for a, b in zip(lp, lp[1:])] + [
            lab.claim(f"{k} R@1 rises from lambda_p 0 to 0.5", f"{paper} up to +1.3", d(lp[2], lp[0], k), "+")
            for k, paper in (("long", "long"), ("short", "COCO"))] + [
            lab.claim(f"{k} R@1 plateaus beyond 0.5 (lambda_p 2 - 0.5; equal within 1 point)", "plateau",
                      d(lp[-1], lp[2], k), "=", margin=1.0) for k in ("long", "short")]
    if name == "data-size":
        n = [f"N={x}" for x in DEMO_DATA_SIZES]
        return [lab.claim("long R@1 rises up to the 10k stand-in (N=400 - N=40)", "+5.6 (56.3 at 1k -> 61.9 at 10k)",
                          d(n[2], n[0], "long"), "+"),
                lab.claim("... then saturates (N=2000 - N=400; equal within 1 point)", "within 0.4 (10k -> 50k)",
                          d(n[-1], n[2], "long"), "=", margin=1.0),
                lab.claim("short R@1 rises with data (N=2000 - N=40)", "COCO +8.5 (40.8 -> 49.3)",
                          d(n[-1], n[0], "short"), "+"),
                lab.claim(f"zero-shot falls with data (N=2000 - N=40, {ZS})", "ImageNet -3.8 (63.5 -> 59.7)",
                          d(n[-1], n[0], "background"), "-")]
    return [  # ablations: the paper did not run RT or L_short only; "paper" gives what its argument predicts
        lab.claim(f"RT without P erodes zero-shot (RT - CLIP, {ZS})", "not run; predicted like M (IN -3.8 to -6.1)",
                  d("RT", "CLIP", "background"), "-"),
        lab.claim(f"... as much as M (RT - M, {ZS}; equal within 1 point)", "not run; predicted ~0 (gate starts at "
                  "the mean)", d("RT", "M", "background"), "=", margin=1.0),
        lab.claim(f"P recovers zero-shot for RT too (RT+P - RT, {ZS})", "not run; predicted like M+P - M (IN +1.5 to "
                  "+2.1, every fusion)", d("RT+P", "RT", "background"), "+"),
        lab.claim("L_short only raises long R@1 less than M (M - L_short only, long)", "not run; predicted > 0 "
                  "(L_long carries the gain)", d("M", "L_short only", "long"), "+"),
        lab.claim(f"L_short only still erodes zero-shot (L_short only - CLIP, {ZS})", "not run; predicted < 0 "
                  "(fine-tuning on COCO captions)", d("L_short only", "CLIP", "background"), "-")]


def sweep_figure(name: str, base: dict, rows: dict, path, caption: str):
    """Ours (mean over seeds, +-1 std band, seeds as dots) per measure; the
    paper's printed points in a panel of their own (other units and models)."""
    measures = (("long", "long-caption R@1, truncated (%)"), ("short", "short-caption R@1 (%)"),
                ("background", "held-out zero-shot top-1 (%)"))

    def seeds(names, key):  # (n_seeds, len(names)); 'CLIP' is the pretrained model for every seed
        return np.array([[base[key] if r == "CLIP" else rows[r][i][key] for r in names]
                         for i in range(len(lab.SEEDS))])
    if name == "epochs":
        xs, series = list(range(EPOCHS + 1)), {v: ["CLIP"] + [f"{v} epoch {k}" for k in range(1, EPOCHS + 1)]
                                               for v in ("M", "M+P", "RT+P")}
        paper, xlabel = {}, f"epoch (1 epoch = {DEMO_EPOCH_POOL} pairs = 8 steps; 0 = CLIP)"
    elif name == "lambda-p":
        xs, series = list(LAMBDAS), {"mean fusion": [f"lambda_p={x:g}" for x in LAMBDAS]}
        paper = {"paper Sec. 4.4: ImageNet top-1 (%)": (list(PAPER_LAMBDA_IN), list(PAPER_LAMBDA_IN.values()))}
        xlabel = "lambda_p (weight of L_pres)"
    elif name == "data-size":
        xs, series = list(DEMO_DATA_SIZES), {"M+P": [f"N={x}" for x in DEMO_DATA_SIZES]}
        paper = {f"paper {k}": ([n for n in PAPER_DATA if k in PAPER_DATA[n]], [v[k] for v in PAPER_DATA.values()
                                                                                 if k in v]) for k in ("long", "COCO", "IN")}
        xlabel = "training pairs (prefix of one order)"
    else:
        xs, series = ["CLIP", *VARIANTS], {"ours": ["CLIP", *VARIANTS]}
        paper = {f"paper Tab. 2 B/16 {k}": (["CLIP", "M", "M+P", "RT+P"], [evaluation.ERCLIP_TABLE2[("B/16", v)][i]
                                                                          for v in ("CLIP", "M", "M+P", "RT+P")])
                 for k, i in (("long avg T2I", 1), ("ImageNet", 6))}
        xlabel = "variant"
    panels = [{"title": f"ours: {label.split(' (')[0]}", "ylabel": label,
               "series": {s: (xs, seeds(names, key)) for s, names in series.items()}} for key, label in measures]
    if paper:
        title = ("paper Tab. 2, ViT-B/16 (RT, L_short only: not run)" if name == "ablations"
                 else "paper Sec. 4.4 (ViT; backbone not stated)")
        panels.append({"title": title, "ylabel": "% (paper's metric)", "paper": paper,
                       "xlabel": "training pairs" if name == "data-size" else xlabel})
    return lab.curves_figure(panels, path, caption, xlabel, log_x=name == "data-size")


def run_demo_sweep(cfg: ERCLIPConfig, sizes=None):
    """--demo --sweep NAME: every run of the sweep once per seed in lab.SEEDS
    from the same pretrained weights (same seed, same data order across runs);
    claims from the paired differences, the figure, one results file."""
    t0, name = time.time(), cfg.sweep
    root = Path(cfg.out) / f"sweep-{name}"
    full = lab.synthetic_manifest("train", cfg.data_root)
    pool = {"epochs": lambda: lab.prefix_manifest(full, DEMO_EPOCH_POOL, root / "epoch-pool.jsonl"),
            "data-size": lambda: full}.get(name, lambda: None)()

    def measure(model, preprocess, tokenizer, weights):
        return demo_measure(model, preprocess, tokenizer, cfg.data_root)

    initial = common.load_model(cfg.backbone, cfg.pretrained)
    base = lab.sweep_run(root, "CLIP", lambda folder: {"measures": [measure(initial[0], *initial[2:], None)]})
    base = base["measures"][0]
    records = [sweep_one(cfg, root, run, over, seed, pool, initial, measure, keep_weights=False)
               for seed in lab.SEEDS for run, over in sweep_plan(name, sizes or DEMO_DATA_SIZES)]
    rows = {}
    for r in records:  # seed-major: every row's list is in lab.SEEDS order
        for k, m in enumerate(r["measures"], 1):
            rows.setdefault(f"{r['name']} epoch {k}" if name == "epochs" else r["name"], []).append(
                {**m, "seed": r["seed"], "train_seconds": r["summary"]["train_seconds"]})
    head = (f"ERCLIP sweep '{name}' on the lab: {DEMO_SWEEP_NOTES[name]}. Tiny backbone, seeds {list(lab.SEEDS)}, "
            f"{cfg.steps} steps x batch {cfg.batch_size}, lr {cfg.lr:g} (the demo's settings). Columns as in the "
            f"demo; mean ± std over seeds.")
    claims = sweep_claims(name, base, rows)
    lab.report_demo(root, head, base, rows, claims, DEMO_COLS, t0, lambda o: sweep_figure(
        name, base, rows, o / f"erclip-sweep-{name}.png", f"python erclip.py --demo --sweep {name}; seeds "
        f"{list(lab.SEEDS)}; band: ±1 std over seeds; dots: seeds"), config=dataclasses.asdict(cfg),
        sweep=name, definition=DEMO_SWEEP_NOTES[name])
    return {"base": base, "per_seed": rows, "claims": claims}


def sweep_markdown(path, timing: str = "") -> str:
    """The README block of a demo sweep, from its results file alone:
    python -c "import erclip; print(erclip.sweep_markdown('docs/erclip-sweep-epochs.json'))"
    timing: a remark on the wall time (e.g. that the machine was shared)."""
    r = json.loads(Path(path).read_text())
    m = r["machine"]
    head = (f"`python erclip.py --demo --sweep {r['sweep']}`: {r['definition']}. Seeds {r['seeds']}; "
            f"{m['cores']} cores ({m['cpu']}), torch {m['torch']}, wall time {r['wall_seconds']:.0f} s"
            f"{f' ({timing})' if timing else ''}; from [`{path}`]({path}).")
    table = lab.mean_std_table({"CLIP": [r["base"]], **r["per_seed"]}, SWEEP_README_COLS)
    return f"{head}\n\n{table}\n\n{lab.claims_table(r['claims'])}"


# =============================================================================
# Main
# =============================================================================
def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = common.parse_config(ERCLIPConfig, argv, **(DEMO if "--demo" in argv else {}))
    if cfg.demo:  # the lab; with --sweep, Sec. 4.3-4.4 there
        return run_sweep(cfg) if cfg.sweep else run_demo(cfg)
    root = Path(cfg.data_root)
    cfg = common.resolve_auto(cfg, "train_data", TRAIN_POOL, [
        cfg.coco_captions or root / "coco" / "annotations" / "captions_train2017.json",
        cfg.sharegpt4v or root / "sharegpt4v" / "share-captioner_coco_lcs_sam_1246k_1107.json"],
        "COCO train2017 captions + ShareGPT4V descriptions, Sec. 4")
    if cfg.sweep:  # Sec. 4.3-4.4 in the real setting
        common.check_device(cfg)
        return run_sweep(cfg)
    torch.manual_seed(cfg.seed)  # the initial weights when --pretrained random, and the fusion's
    tasks = evaluation.task_list(cfg.eval_tasks, cfg.train_data, PAPER_EVAL_TASKS, SYNTHETIC_EVAL_TASKS)
    rank = common.dist_info()[0]
    manifest = train_manifest(cfg)  # fails at once when the training data is missing
    evaluation.check_tasks(tasks, cfg.data_root)
    common.preflight(cfg, [manifest], need_long=True)  # rows, --out, device: before any model is loaded
    model, train_tf, preprocess, tokenizer = common.load_model(cfg.backbone, cfg.pretrained,
                                                               cache_dir=cfg.cache_dir)
    device = common.init_distributed(cfg.device)
    base = []
    if tasks and cfg.eval_base and rank == 0:
        base = evaluation.evaluate(model.to(device), preprocess, tokenizer, tasks, cfg.data_root,
                                   model_name=cfg.backbone, weights="before fine-tuning")
    model, summary = train_erclip(cfg, model, train_tf, tokenizer)
    if rank != 0:
        return summary
    if "stopped_at" in summary:  # --stop-at: a checkpoint, no model.pt, nothing evaluated
        print(f"[erclip] stopped at step {summary['stopped_at']}; checkpoint {summary['checkpoint']}; continue with "
              f"--resume latest", file=sys.stderr)
        return {"summary": summary}
    tuned = evaluation.evaluate(model, preprocess, tokenizer, tasks, cfg.data_root, model_name=cfg.backbone,
                                weights=str(Path(cfg.out) / "model.pt")) if tasks else []
    name, vit = variant_name(cfg), vit_key(cfg.backbone)
    if cfg.train_data == "synthetic":
        text = "\n\n".join(f"{title}\n\n{evaluation.results_table(r)}"
                           for title, r in (("CLIP", base), (f"ERCLIP {name}", tuned)) if r)
    else:
        text = paper_tables(([("CLIP", base, 0.0)] if base else []) + [(name, tuned, cfg.lambda_p)], vit)
    print(text)
    common.write_results(cfg.out, {"variant": name, "manifest": str(manifest), "summary": summary,
                                   "base": base, "tuned": tuned, "tables": text,
                                   "config": dataclasses.asdict(cfg)})
    return {"summary": summary, "base": base, "tuned": tuned}


if __name__ == "__main__":
    common.cli(main)
