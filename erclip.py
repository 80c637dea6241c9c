"""ERCLIP: Small-Data Adaptation of CLIP for Free-Length Image-Text Retrieval.

Hoang-Bao Le, Allie Tran, Binh T. Nguyen, Liting Zhou, Cathal Gurrin.
arXiv:2610.29939, https://arxiv.org/abs/2610.29939. No authors' code is public.

Sec. 3: a training-only sentence pathway and a preservation loss. A long caption's sentences go
through the SHARED text encoder in one padded batch (e_i), fused into l, contrasted with the image;
a frozen initial copy anchors image and short caption. Plain CLIP at test. Equation numbers ours:

  Sec. 3.1  z_mean = 1/N sum_i e_i                                   (M)
  Eq. (1)   H = TBlock(E + P),  w_i = softmax_i g(h_i),  z_attn = sum_i w_i e_i
  Eq. (2)   z_long = z_mean + gamma (z_attn - z_mean),  l = z_long / ||z_long||   (RT)
  Eq. (3)   L_short = L_clip(V, T_short),  L_long = L_clip(V, l),  with
            L_clip(V, Y) = 1/2 [CE_eps(V Y^T / tau, I) + CE_eps(Y V^T / tau, I)]
  Eq. (4)   L_pres = 1/(2B) sum_b [(1 - v_b . v0_b) + (1 - t_b . t0_b)]
            L = L_short + alpha L_long + lambda_p L_pres

Code name -> paper symbol
  img, txt          v_b, t_b     image / short-caption embeddings (L2-normalised)
  img0, txt0        v0_b, t0_b   the same from the teacher, the frozen copy of the initial CLIP
  sentence_emb, E   e_i, E       sentence embeddings, (B, N, d) padded + mask
  long_emb          l            fused long-caption embedding (normalised)
  gamma, pos_embedding, scorer   gamma (gate, initialised 0), P (sentence positions), g (scorer)
  logit_scale, label_smoothing   1/tau (exp of the model's parameter), eps of CE_eps

Deviations and choices (paper location in brackets; at length in docs/erclip.md)
 1. eps of CE_eps is not printed [Sec. 3.2]: default --label-smoothing 0.1.
 2. AdamW betas/eps are not printed [Sec. 4]: CLIP's (0.9, 0.98), 1e-6.
 3. The temperature stays FIXED [Sec. 4.3: a learned one "not tested"]; --learn-temperature.
 4. Sentence embeddings are L2-normalised before fusion [Sec. 3.1 leaves it open].
 5. TBlock / g / P unspecified [Sec. 3.1]: 1 pre-norm layer; Linear-GELU-Linear; 64 positions.
 6. The v1 fusions have no equations [Tab. 2]: LSTM's last state; Transformer: z_attn for z_mean.
 7. Sentences end at a '.' + whitespace or the end [Sec. 3.1] (eval.split_sentences).
 8. No sentence cap in the paper; --max-sentences K keeps the first K (counted).
 9. Training set [Sec. 4]: first COCO caption + first ShareGPT4V record per image, no test image.
10. The teacher is a frozen copy made at construction, not checkpointed: rebuilt on resume.
11. The fusion trains at the encoders' lr [Sec. 4]: gamma = 0, so RT+P = M+P; --fusion-lr.
12. Under DDP each rank fuses its own sentences; gathered with gradient: the global batch.
13. Evaluation [Sec. 4]: COCO 5k = first 5 captions (coco-all: all); Urban1K = first line.
14. Sweeps [Sec. 4.3, 4.4] (--sweep, --demo --sweep): schedules, prefixes, stand-ins are ours.
15. No decay on gains, biases, embeddings, logit_scale [Sec. 4 does not say]: --decay-all.
16. --loss siglip (ours): L_clip SigLIP's, from s = 10, b = -10 (--siglip-init); L_pres as is.

Commands (Tab. 2's variants: M+P the default; RT+P --fusion rt; M --lambda-p 0; v1 ablations
--fusion lstm | transformer with --lambda-p 0)
  python erclip.py --backbone ViT-B/16 --train-data coco-sharegpt4v --out runs/erclip-b16-mp
  DDP: torchrun --nproc_per_node 4 erclip.py ...;  sweeps (Sec. 4.3 Fig. 3, 4.4): add --sweep NAME,
  NAME: epochs | lambda-p | data-size | ablations;  the lab: python erclip.py --demo [--sweep NAME]
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import sys
from pathlib import Path

from plumbing import flags, published  # torch-free: the settings, their parser; the papers' numbers

TRAIN_POOL = "coco-sharegpt4v"  # the paper's training pair pool (Sec. 4), --train-data's name


# --- Config ---
@dataclasses.dataclass(frozen=True)
class ERCLIPConfig(flags.Config):
    lr: float = flags.arg(5e-6, "peak learning rate")                          # Sec. 4
    wd: float = flags.arg(0.05, "AdamW weight decay")                           # Sec. 4
    warmup: int = flags.arg(200, "linear warm-up steps, then cosine")           # Sec. 4
    batch_size: int = flags.arg(64, "global batch size (paper: Sec. 4)")        # Sec. 4
    epochs: int = flags.arg(1, "epochs (the paper's fixed budget)")             # Sec. 4, 4.3
    label_smoothing: float = flags.arg(0.1, "eps of CE_eps (not printed; ours)")  # deviation 1
    alpha: float = flags.arg(1.0, "weight of L_long")                           # Sec. 4
    lambda_p: float = flags.arg(1.0, "weight of L_pres (0: variant M)")         # Sec. 4
    fusion: str = flags.arg("mean", "mean (M) | rt (residual Transformer) | lstm / transformer (v1 "
                            "ablations)", choices=("mean", "rt", "lstm", "transformer"))  # Tab. 2
    max_sentences: int = flags.arg(0, "keep at most K sentences per caption, count the rest "
                                   "(0: all; ours)")
    fusion_lr: float = flags.arg(0.0, "lr of the fusion module (0: the encoders' lr; ours)")
    learn_temperature: bool = flags.arg(False, "train logit_scale (the paper keeps it fixed, "
                                        "Sec. 4.3)")
    train_pairs: int = flags.arg(0, "training pairs (0: 20000 for coco-sharegpt4v [Sec. 4], whole "
                                 "split for synthetic)")
    coco_captions: str = flags.arg("", "captions_train2017.json "
                                   "('': DATA_ROOT/coco/annotations/...)")
    sharegpt4v: str = flags.arg("", "ShareGPT4V json ('': "
                                "DATA_ROOT/sharegpt4v/share-captioner_...json)")
    eval_tasks: str = flags.arg("auto", "comma list for eval.evaluate; auto: the paper's (or "
                                "synthetic) set; none")
    eval_base: bool = flags.arg(True, "also evaluate the model before fine-tuning")
    demo: bool = flags.arg(False, "run the synthetic demo (M, M+P, RT+P on the tiny backbone)")
    sweep: str = flags.arg("", "run one of the paper's sweeps (Sec. 4.3-4.4; with --demo: on the "
                           "lab)", choices=("", "epochs", "lambda-p", "data-size", "ablations"))


if __name__ == "__main__":  # --help and flag errors are answered here, before the imports below
    flags.answer_early(ERCLIPConfig)

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
import eval as evaluation
from plumbing import manifests, models, runfolder
from papers import erclip_data, erclip_sweeps
from plumbing.results import document, own_table, staged


# --- Losses and fusion ---
def pad_sentences(sentence_emb, counts, n_max: int | None = None):
    """Scatters one flat batch of sentence embeddings into a padded tensor.
    sentence_emb: (S, d), captions' sentences back to back; counts: (B,) with sum S; n_max:
    max(counts) when the caller knows it as a Python int (no read from the device). Returns E
    (B, N, d) zero-padded, N = max count, and mask (B, N)."""
    counts = counts.to(sentence_emb.device)
    owner = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)  # (S,)
    start = torch.cumsum(counts, 0) - counts  # (B,) offset of each caption's first sentence
    pos = torch.arange(len(owner), device=counts.device) - start[owner]  # (S,) index in its caption
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
        self.block = nn.TransformerEncoderLayer(  # TBlock (deviation 5)
            dim, max(1, dim // 64), 4 * dim, dropout=0.0, activation="gelu", batch_first=True,
            norm_first=True)
        self.pos_embedding = nn.Parameter(0.01 * torch.randn(max_positions, dim))  # P
        self.scorer = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, 1))  # g
        self.residual = residual
        self.gamma = nn.Parameter(torch.zeros(1)) if residual else None  # starts at mean pooling

    def forward(self, E, mask):
        pos = torch.arange(E.shape[1], device=E.device).clamp(max=len(self.pos_embedding) - 1)
        # Eq. (1): H = TBlock(E + P), w_i = softmax_i g(h_i), z_attn = sum_i w_i e_i
        H = self.block(E + self.pos_embedding[pos].to(E.dtype),
                       src_key_padding_mask=~mask)  # (B, N, d)
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
        packed = nn.utils.rnn.pack_padded_sequence(E.float(), lengths, batch_first=True,
                                                   enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return h[-1]  # (B, d)


@common.float32
def preservation_loss(img, img0, txt, txt0):
    """Eq. (4): L_pres = 1/(2B) sum_b [(1 - v_b . v0_b) + (1 - t_b . t0_b)].
    img, img0: (B, d) student / frozen-initial image embeddings; txt, txt0:
    (B, d) short-caption embeddings; all L2-normalised."""
    cos_img = (img.float() * img0.float()).sum(-1)  # (B,)
    cos_txt = (txt.float() * txt0.float()).sum(-1)
    # Eq. (4): L_pres = 1/(2B) sum_b [(1 - v_b.v0_b) + (1 - t_b.t0_b)]
    return ((1 - cos_img) + (1 - cos_txt)).sum() / (2 * len(img))


@common.float32
def erclip_losses(img, txt_short, long_emb, img0, txt0, logit_scale, alpha, lambda_p,
                  label_smoothing, logit_bias=None):
    """Eqs. (3)-(4): the already-weighted terms of
    L = L_short + alpha L_long + lambda_p L_pres.
    img, txt_short, long_emb: (B, d) normalised v, t, l; img0, txt0: (B, d)
    the frozen initial model's (None when lambda_p = 0); logit_scale: 1/tau;
    logit_bias: --loss siglip's b (L_clip read as SigLIP's loss, deviation 16), else None."""
    # Eq. (3): L_short = L_clip(V, T_short), L_long = L_clip(V, l), CE with label smoothing eps
    loss_short = common.contrastive_loss(img, txt_short, logit_scale, logit_bias, label_smoothing)
    loss_long = common.contrastive_loss(img, long_emb, logit_scale, logit_bias, label_smoothing)
    if img0 is None:
        loss_pres = img.new_zeros((), dtype=torch.float32)
    else:
        loss_pres = preservation_loss(img, img0, txt_short, txt0)
    # Eq. (4): L = L_short + alpha L_long + lambda_p L_pres
    return {"loss_short": loss_short, "loss_long": alpha * loss_long,
            "loss_pres": lambda_p * loss_pres}


# --- Model wrapper ---
# Sec. 3.1, deviation 7: eval.py's splitter (its 'sentence-mean' mode splits test captions alike)
split_sentences = evaluation.split_sentences


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
        # seen, dropped, max per caption; then per caption (split_batch)
        out["sentence_stats"] = (sum(counts), sum(dropped), max(counts))
        out["sentence_count_list"], out["sentence_dropped_list"] = counts, dropped
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


class ERCLIP(common.Method):
    """The training wrapper: the open_clip model, the fusion module and the
    frozen teacher (only when lambda_p > 0). features / losses as common.Method
    (forward: the weighted loss terms); the teacher is excluded from checkpoints."""
    no_checkpoint = ("teacher.",)

    def __init__(self, model, cfg: ERCLIPConfig):
        super().__init__()
        self.model, self.cfg = model, cfg
        self.fusion = make_fusion(cfg.fusion, common.embed_dim(model))
        self.teacher = None
        models.pair_bias(model, cfg.loss, cfg.siglip_init)  # --loss siglip's logit_bias (dev. 16)
        if cfg.lambda_p > 0:  # a frozen copy of the INITIAL model (deviation 10)
            self.teacher = copy.deepcopy(model).eval().requires_grad_(False)
        if not cfg.learn_temperature:  # deviation 3
            model.logit_scale.requires_grad_(False)
        self.sentences_seen = self.sentences_dropped = 0

    def encode_long(self, sentence_tokens, sentence_counts, n_max: int | None = None):
        """All sentences of the batch in ONE padded batch through the shared
        text encoder (trimmed padding), then fused per caption. -> l (B, d)."""
        e = common.encode_text(self.model, sentence_tokens)  # (S, d) normalised (deviation 4)
        E, mask = pad_sentences(e, sentence_counts, n_max)  # (B, N, d), (B, N)
        z_long = mean_fusion(E.float(), mask) if self.fusion is None else self.fusion(E, mask)
        return F.normalize(z_long.float(), dim=-1)

    def features(self, batch, ctx=None):
        replay = getattr(ctx, "replay", False)  # --accum-freq's 2nd pass: no count, no teacher
        seen, dropped, n_max = batch["sentence_stats"]  # ints from SentenceCollate: no host sync
        self.sentences_seen += 0 if replay else seen
        self.sentences_dropped += 0 if replay else dropped
        f = {"img": self.model.encode_image(batch["image"], normalize=True),  # (b, d)
             "txt": common.encode_text(self.model, batch["text"]),  # (b, d)
             "long": self.encode_long(batch["sentence_tokens"], batch["sentence_counts"],
                                      n_max)}  # (b, d)
        if self.teacher is not None and not replay:
            with torch.no_grad():
                f["img0"] = self.teacher.encode_image(batch["image"], normalize=True)
                f["txt0"] = common.encode_text(self.teacher, batch["text"])
        return f

    def losses(self, f, ctx=None):
        g = dict(zip(f, common.gather(*f.values())))  # img, txt, long (, img0, txt0) of all ranks
        return erclip_losses(g["img"], g["txt"], g["long"], g.get("img0"), g.get("txt0"),
                             self.model.logit_scale.exp(), self.cfg.alpha, self.cfg.lambda_p,
                             self.cfg.label_smoothing,
                             self.model.logit_bias if self.cfg.loss == "siglip" else None)

    @staticmethod
    def split_batch(batch, k):  # --accum-freq: micro-batches with their captions' sentences
        groups = {"sentence_tokens": "sentence_count_list"}
        return [dict(p, sentence_stats=(len(p["sentence_tokens"]), sum(p["sentence_dropped_list"]),
                                        batch["sentence_stats"][2]))  # the whole batch's padding
                for p in common.split_batch(batch, k, groups=groups)]


# --- Training ---
# Shared with longclip.py (the same pairs, so that the two differ only in method)
build_train_manifest = erclip_data.coco_sharegpt4v_manifest


def train_manifest(cfg: ERCLIPConfig, world: models.LabWorld | None = None) -> Path:
    root = Path(cfg.data_root)
    if cfg.train_data == "synthetic":  # the lab's world
        lab = models.lab_world(world, "--train-data synthetic")
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


def train_erclip(cfg: ERCLIPConfig, model, train_tf, tokenizer, hooks=None, validate=None,
                 world=None):
    """Fine-tunes one variant of freshly loaded initial weights (so on resume
    the teacher is rebuilt from them too); returns (model, summary). hooks:
    passed to common.train (the epochs sweep saves per-epoch weights there)."""
    dataset = common.training_set(cfg, train_manifest(cfg, world), train_tf, need_long=True)
    net = ERCLIP(model, cfg)
    lr_of = ((lambda name: cfg.fusion_lr if name.startswith("fusion.") else None)
             if cfg.fusion_lr else None)
    summary = common.train(cfg, net, dataset, SentenceCollate(tokenizer, cfg.max_sentences),
                           lr_of=lr_of, hooks=hooks, validate=validate)
    summary.update(variant=variant_name(cfg), train_pairs=len(dataset),
                   skipped_rows=len(dataset.skipped), sentences_seen=net.sentences_seen,
                   sentences_dropped=net.sentences_dropped)
    if net.fusion is not None and getattr(net.fusion, "gamma", None) is not None:
        summary["gamma"] = float(net.fusion.gamma.detach())
    if net.sentences_dropped:
        print(f"[erclip] --max-sentences {cfg.max_sentences} dropped {net.sentences_dropped} of "
              f"{net.sentences_seen + net.sentences_dropped} sentences", file=sys.stderr)
    return model, summary


def sweep_method(world=None) -> erclip_sweeps.Method:
    """What papers.erclip_sweeps (--sweep; the lab's sweeps) runs of this file."""
    return erclip_sweeps.Method(functools.partial(train_manifest, world=world),
                                functools.partial(train_erclip, world=world), paper_tables,
                                TRAIN_POOL, world)


# --- Tables (ERCLIP's Tables 1 and 2, the layout written once in eval.py) ---
def paper_tables(ours: list[tuple[str, list, float]], vit: str) -> str:
    """Tables 1 and 2 in the paper's layout: the paper's rows for this
    backbone (published.ERCLIP_TABLE1/2, prefixed 'paper') beside ours: (name,
    records, lambda_p) each."""
    cols1, cols2 = published.erclip_cols()
    rows1 = [dict(zip(cols1, [f"paper {name}", v, *vals, sum(vals[0::2]) / 4, sum(vals[1::2]) / 4]))
             for (v, name), vals in published.ERCLIP_TABLE1.items() if v == vit]
    rows2 = [dict(zip(cols2, [f"paper {name}", v, "-" if name == "CLIP" else
                              ("yes" if name.endswith("+P") else "no"), *vals]))
             for (v, name), vals in published.ERCLIP_TABLE2.items() if v == vit]
    for name, records, lambda_p in ours:
        pres = "-" if name == "CLIP" else ("yes" if lambda_p > 0 else "no")
        r1, r2 = published.erclip_rows(records, name + " (ours)", vit, pres)
        rows1.append(r1)
        rows2.append(r2)
    return evaluation.erclip_tables(rows1, rows2)


# --- Main ---
def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--demo" in argv:  # the lab: demo and sweeps (lab/demos/erclip.py, erclip_sweeps.py)
        from lab.demos import erclip as demo
        return demo.main(argv)
    cfg = flags.parse_config(ERCLIPConfig, argv)
    world = None
    if models.wants_lab(cfg):  # --backbone tiny / --train-data synthetic: the lab's world
        from lab import WORLD as world
    root = Path(cfg.data_root)
    cfg = common.resolve_auto(cfg, "train_data", TRAIN_POOL, [
        cfg.coco_captions or root / "coco" / "annotations" / "captions_train2017.json",
        cfg.sharegpt4v or root / "sharegpt4v" / "share-captioner_coco_lcs_sam_1246k_1107.json"],
        *erclip_data.AUTO_NEEDS)  # what --train-data auto needs, in the message when it is missing
    if cfg.sweep:  # Sec. 4.3-4.4 in the real setting: the single run's preflight, then every run
        common.check_device(cfg)
        return erclip_sweeps.run_sweep(sweep_method(world), cfg)
    torch.manual_seed(cfg.seed)  # the initial weights when --pretrained random, and the fusion's
    tasks = evaluation.task_list(cfg.eval_tasks, cfg.train_data, published.ERCLIP_EVAL_TASKS,
                                 published.ERCLIP_SYNTHETIC_TASKS)
    rank = manifests.dist_info()[0]
    manifest = train_manifest(cfg, world)  # fails at once when the training data is missing
    evaluation.check_tasks(tasks, cfg.data_root)
    common.preflight(cfg, [manifest], need_long=True)  # rows, --out, device: before any model
    model, train_tf, preprocess, tokenizer = models.load_model(cfg.backbone, cfg.pretrained,
                                                               cache_dir=cfg.cache_dir, world=world)
    device = common.init_distributed(cfg.device)
    base = []
    if tasks and cfg.eval_base and rank == 0:  # kept in <out>/base.json: a resumed run reads it
        base = runfolder.kept_result(cfg, "base", lambda: evaluation.evaluate(
            model.to(device), preprocess, tokenizer, tasks, cfg.data_root, model_name=cfg.backbone,
            weights="before fine-tuning"))
    validate = evaluation.validator(cfg, preprocess, tasks)
    model, summary = train_erclip(cfg, model, train_tf, tokenizer, validate=validate, world=world)
    if rank != 0:
        return summary
    if "stopped_at" in summary:  # --stop-at: a checkpoint, no model.pt, nothing evaluated
        print(f"[erclip] stopped at step {summary['stopped_at']}; checkpoint "
              f"{summary['checkpoint']}; continue with --resume latest", file=sys.stderr)
        return {"summary": summary}
    tuned = evaluation.evaluate(model, preprocess, tokenizer, tasks, cfg.data_root,
                                model_name=cfg.backbone,
                                weights=str(Path(cfg.out) / "model.pt")) if tasks else []
    name, vit = variant_name(cfg), published.vit_key(cfg.backbone)
    records = staged(base, "base") + staged(tuned, "tuned")  # one schema for every method
    text = own_table(records, title=f"Your tasks (base: before fine-tuning, tuned: ERCLIP {name})")
    if cfg.train_data != "synthetic" and cfg.eval_tasks == "auto":  # the paper's: Tables 1-2 too
        ours = ([("CLIP", base, 0.0)] if base else []) + [(name, tuned, cfg.lambda_p)]
        text += "\n\n" + paper_tables(ours, vit)
    print(text)
    common.write_results(cfg.out, document("erclip", records, variant=name, manifest=str(manifest),
                                           summary=summary, tables=text), cfg)
    return {"summary": summary, "base": base, "tuned": tuned}


if __name__ == "__main__":
    from plumbing.cli import cli  # one message per expected failure, signals
    cli(main)
