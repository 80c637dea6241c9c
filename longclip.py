"""Long-CLIP: Unlocking the Long-Text Capability of CLIP.

Beichen Zhang, Pan Zhang, Xiaoyi Dong, Yuhang Zang, Jiaqi Wang. ECCV 2024.
arXiv 2403.15378, https://arxiv.org/abs/2403.15378. Released code (read for every detail the paper
leaves open, none copied): github.com/beichenzbc/Long-CLIP. Published numbers: ERCLIP Tab. 1's
Long-CLIP rows (plumbing/published.py).

Knowledge-preserved stretching of the text positional embedding (Sec. 3.2), fine-tuning with primary
component matching (Sec. 3.3); the stretched model stays an open_clip CLIP, saved and loaded with
its window. Eq. numbers ours:

  Eq. (1)  stretching, L -> lam2 L - (lam2 - 1) keep positions (77 -> 248):
             PE*(p) = PE(p)                                   p < keep
             PE*(p) = (1 - a) PE(i) + a PE(i + 1)             otherwise, with
             x = keep + (p - keep) / lam2,  i = min(floor x, L - 2),  a = x - i
  Eq. (2)  I_coarse = F^-1(E(F(I_fine))): F = PCA of the batch, E keeps the top-k components:
           mu = mean_b I_fine_b,  X = I_fine - mu = U S V^T,  I_coarse = X V_k V_k^T + mu
  Eq. (3)  L_long  = CLIP_eps(I_fine, T_long),  L_short = CLIP_eps(I_coarse, T_short)
           CLIP_eps(V, Y) = 1/2 [CE_eps(s V Y^T, I) + CE_eps(s Y V^T, I)]
  Eq. (4)  L = L_long + L_short

Code name -> paper symbol
  pos, stretched       PE, PE*      text positional table (L, d) -> (L*, d)
  keep, factor         20, lam2 = 4 positions kept as they are (Sec. 3.1); stretch ratio of the rest
  img, img_coarse      I_fine, I_coarse   image embedding (B, d), L2-normalised; its top-k PCA
                                          reconstruction (B, d), not renormalised; pca_dim = k = 32
  txt_long, txt_short  T_long, T_short    L2-normalised caption embeddings (B, d)
  logit_scale, label_smoothing            s = 1/tau (exp of the model's parameter), eps of CE_eps

Deviations and choices (paper / code location in brackets; at length in docs/longclip.md)
 1. Stretching [Sec. 3.2; load_from_clip]: the code's table; keep = round(20 L / 77) (ours); lam2 4.
 2. The kept rows stay frozen, as the code (gradient zeroed) [paper: "retain"]; --no-freeze-kept.
 3. PCA [Sec. 3.3; CLIP.PCA]: per rank, local batch, float32 SVD, then gathered; --pca-scope global.
 4. Loss [CLIP.forward]: both terms CLIP's symmetric CE, label smoothing 0.1, weight 1.
 5. Temperature [train.py --log_scale]: ln 100, fixed (the code: 4.6052, trained); --log-scale.
 6. Optimiser [train.md; scheduler.py]: AdamW (0.9, 0.999, 1e-8), wd 1e-2, 200 warm-up, cosine.
 7. --recipe longclip = train.md's "recommended" table: batch 2048, lr 1e-6, 6 epochs.
 8. Short caption [sharegpt4v.py]: the text before the first ". ", stripped; --short-caption.
 9. --train-data sharegpt4v [sharegpt4v.py]: records after the first 1,000, none of their images.
10. Windows: training tokenises both captions with the stretched window; tests through 77 and 248.
11. DDP: the loss over the gathered batch; its mean over ranks is the code's.
12. --recipe erclip-budget (ours): ERCLIP's 20k pairs and settings, so that only the method differs.
13. No decay on gains, biases, embeddings, logit_scale [train.py: the code decays all]: --decay-all.
14. --loss siglip (ours): both terms SigLIP's, from s = 10, b = -10 (--siglip-init); no --log-scale.

Commands
  one GPU, the paper's recipe (ShareGPT4V under data/): python longclip.py --backbone ViT-B/16
  torchrun (the global batch of 2048 split across ranks): torchrun --nproc_per_node 8 longclip.py
  same budget as ERCLIP, its run's rows beside (--erclip-results runs/erclip-b16-mp/results.json):
    python longclip.py --recipe erclip-budget --backbone ViT-B/16 --out runs/longclip-b16-budget
  a saved model through either window (--context-length 77: the original one):
    python eval.py --backbone ViT-B/16 --pretrained runs/longclip-b16-budget/model.pt --tasks erclip
  the lab (lab/demos/longclip.py; ERCLIP M+P run as `python erclip.py` per seed): --demo
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

from plumbing import flags, published  # torch-free: the settings, their parser; the papers' numbers

LN_100 = math.log(100.0)


# --- Config ---
# ERCLIP's settings (erclip.py, its paper's Sec. 4) on its data: only the method differs (dev. 12)
RECIPES = {
    "longclip": {},
    "erclip-budget": dict(lr=5e-6, wd=0.05, beta2=0.98, eps=1e-6, warmup=200, batch_size=64,
                          epochs=1, label_smoothing=0.1, log_scale=-1.0,
                          train_data="coco-sharegpt4v", short_caption="caption"),
}


def _recipe(argv) -> str:  # --recipe sets the other flags' defaults
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--recipe", default="longclip", choices=tuple(RECIPES))
    return p.parse_known_args(argv)[0].recipe


@dataclasses.dataclass(frozen=True)
class LongCLIPConfig(flags.Config):
    recipe: str = flags.arg("longclip", "longclip: the paper's/code's settings | erclip-budget: "
                            "ERCLIP's data and schedule (ours)",
                            choices=("longclip", "erclip-budget"))
    # the defaults are the longclip recipe (train/train.md's table unless said)
    lr: float = flags.arg(1e-6, "peak learning rate")                   # train.md (deviation 7)
    wd: float = flags.arg(0.01, "AdamW weight decay")                   # train.md, train.py
    beta2: float = flags.arg(0.999, "AdamW beta2")                      # train.md
    eps: float = flags.arg(1e-8, "AdamW eps")                           # train.md
    warmup: int = flags.arg(200, "linear warm-up steps, then cosine")   # train.md, scheduler.py
    batch_size: int = flags.arg(2048, "global batch (Long-CLIP's train.md)")  # train.md
    epochs: int = flags.arg(6, "epochs")                                # train.md
    label_smoothing: float = flags.arg(0.1, "eps of both CLIP losses")  # model_longclip.py, dev. 4
    log_scale: float = flags.arg(LN_100, "set logit_scale (log 1/tau) to this; < 0: keep the "
                                 "backbone's")  # train.py
    learn_temperature: bool = flags.arg(False, "train logit_scale (the code leaves it in AdamW; "
                                        "deviation 5)")
    keep: int = flags.arg(-1, "positions kept (-1: round(20 L / 77), L the backbone's "
                          "window)")  # Sec. 3.2, deviation 1
    factor: int = flags.arg(4, "stretch ratio lambda_2 of the other positions")  # Sec. 3.2
    stretch: bool = flags.arg(True, "stretch the loaded model (off: --pretrained is a stretched "
                              "model already)")
    freeze_kept: bool = flags.arg(True, "keep the first `keep` positions frozen, as the code "
                                  "(deviation 2)")
    pca_dim: int = flags.arg(32, "k: principal components kept for the coarse image "
                             "embedding")  # Sec. 3.3
    pca_scope: str = flags.arg("rank", "rank: PCA of each rank's batch (code) | global: of the "
                               "gathered batch (ours)", choices=("rank", "global"))  # deviation 3
    short_caption: str = flags.arg("first-sentence", "first-sentence: the long caption's text "
                                   "before the first '. ' (code), stripped, else the whole | code: "
                                   "exactly the code's split | caption: the manifest's",
                                   choices=("first-sentence", "code", "caption"))  # deviation 8
    train_data: str = flags.arg("auto", "auto: sharegpt4v under --data-root (synthetic with "
                                "--backbone tiny when absent) | sharegpt4v (Long-CLIP's) | "
                                "coco-sharegpt4v (ERCLIP's 20k pairs) | synthetic | a manifest "
                                "with caption + long_caption")
    train_pairs: int = flags.arg(0, "pairs of coco-sharegpt4v (0: ERCLIP's 20000) / scenes of "
                                 "synthetic (0: all)")
    coco_captions: str = flags.arg("", "captions_train2017.json "
                                   "('': DATA_ROOT/coco/annotations/...)")
    sharegpt4v: str = flags.arg("", "ShareGPT4V json ('': "
                                "DATA_ROOT/sharegpt4v/share-captioner_...json)")
    eval_tasks: str = flags.arg("auto", "comma list for eval.evaluate; auto: ERCLIP's (or "
                                "synthetic) set; none")
    eval_base: bool = flags.arg(True, "also evaluate the model before fine-tuning (original "
                                "window)")
    erclip_results: str = flags.arg("", "an erclip.py results.json whose rows are printed beside "
                                    "ours")
    demo: bool = flags.arg(False, "run the lab demo: same-budget Long-CLIP against ERCLIP M+P, "
                           "seeds lab.SEEDS")


if __name__ == "__main__":  # --help and flag errors are answered here, before the imports below
    flags.answer_early(LongCLIPConfig, lambda argv: RECIPES[_recipe(argv)])

import open_clip
import torch
import torch.nn as nn

import common
import eval as evaluation
from plumbing import manifests, models, runfolder
from papers.longclip_data import first_sentence, read_erclip_results, train_manifest
from plumbing.results import document, own_table, staged


# --- Losses (and the stretching they train) ---
def stretch_positional_embedding(pos, keep: int = 20, factor: int = 4):
    """Eq. (1), knowledge-preserved stretching (Sec. 3.2, deviation 1). pos: (L, d) PE; keep: rows
    copied as they are; factor: lam2. Returns PE*, (factor L - (factor - 1) keep, d): rows < keep
    copied, the others interpolated at old index keep + (p - keep) / factor, the last `factor` (past
    the end of PE) extrapolated from its last two."""
    L, _ = pos.shape  # (L, d)
    if factor < 1 or not 0 <= keep <= L - 1 or L < 2:
        raise ValueError(f"stretching needs factor >= 1 and 0 <= keep <= L - 1 (L = {L}); got "
                         f"keep={keep}, factor={factor}")
    n = factor * L - (factor - 1) * keep
    p = torch.arange(keep, n, device=pos.device)  # the stretched positions, (n - keep,)
    step, j = torch.div(p - keep, factor, rounding_mode="floor"), (p - keep) % factor
    # left neighbour; L - 2 in the extrapolated tail, where x - i is in [1, 2)
    i = (keep + step).clamp(max=L - 2)
    # x - i, (n - keep, 1)
    a = ((keep + step - i).double() + j.double() / factor).to(pos.dtype)[:, None]
    # Eq. (1): PE*(p) = PE(p) for p < keep, (1 - a) PE(i) + a PE(i + 1) otherwise
    return torch.cat([pos[:keep], (1 - a) * pos[i] + a * pos[i + 1]])  # (n, d)


@common.float32  # the SVD and the reconstruction in float32 under AMP
def pca_reconstruct(x, k: int):
    """Eq. (2), I_coarse = F^-1(E(F(I_fine))) (Sec. 3.3, deviation 3). x: (B, d) fine image
    embeddings; k: components kept. X = x - mu (the batch mean), projected on its top-k right
    singular vectors, mu added back: X V_k V_k^T + mu, (B, d) float32. With k >= min(B, d) every
    component is kept: x itself is returned."""
    if k >= min(x.shape):
        return x
    mu = x.mean(0, keepdim=True)  # (1, d)
    X = x - mu
    _, _, Vh = torch.linalg.svd(X, full_matrices=False)  # rows: right singular vectors, S falling
    V_k = Vh[:k].t()  # (d, k)
    # Eq. (2): I_coarse = X V_k V_k^T + mu
    return X @ V_k @ V_k.t() + mu


@common.float32
def longclip_losses(img, img_coarse, txt_long, txt_short, logit_scale, label_smoothing: float,
                    logit_bias=None):
    """Eqs. (3)-(4): the terms of L = L_long + L_short. img, img_coarse: (B, d) I_fine (normalised),
    I_coarse (not renormalised, as the code); txt_long, txt_short: (B, d) normalised T_long,
    T_short; logit_scale: s = 1/tau; label_smoothing: eps; logit_bias: --loss siglip's b."""
    # Eq. (3): L_long = CLIP_eps(I_fine, T_long)
    loss_long = common.contrastive_loss(img, txt_long, logit_scale, logit_bias, label_smoothing)
    # Eq. (3): L_short = CLIP_eps(I_coarse, T_short)
    loss_short = common.contrastive_loss(img_coarse, txt_short, logit_scale, logit_bias,
                                         label_smoothing)
    # Eq. (4): L = L_long + L_short (weight 1 each, deviation 4)
    return {"loss_long": loss_long, "loss_short": loss_short}


# --- Model wrapper ---
def original_context(backbone: str) -> int:
    """The text window of the backbone's open_clip config (77 for CLIP, 24 for tiny)."""
    cfg = open_clip.get_model_config(models.resolve_backbone(backbone)) or {}
    return int(cfg.get("text_cfg", {}).get("context_length", 77))


def default_keep(context: int) -> int:
    """Deviation 1: Long-CLIP keeps 20 of CLIP's 77 positions; other windows keep the same share."""
    return round(20 * context / 77)


def stretch_text_window(model, keep: int, factor: int) -> int:
    """Stretches an open_clip model's text tower in place (Eq. (1)): a new positional table,
    context_length and causal mask; it saves and loads as the same open_clip architecture with a
    longer context. Returns the new length."""
    t = models.text_tower(model)
    if getattr(t, "attn_mask", None) is None or getattr(t, "cls_emb", None) is not None \
            or not isinstance(getattr(t, "positional_embedding", None), torch.Tensor):
        raise ValueError("Long-CLIP's stretching needs an open_clip text transformer with a causal "
                         "mask and absolute positional embeddings (CLIP's)")
    old = t.positional_embedding
    new = stretch_positional_embedding(old.detach(), keep, factor)  # detached: no graph to the old
    n = len(new)
    t.positional_embedding = nn.Parameter(new, requires_grad=old.requires_grad)
    t.context_length = n
    if hasattr(t, "num_pos"):
        t.num_pos = n
    t.attn_mask = torch.full((n, n), float("-inf"), dtype=t.attn_mask.dtype,
                             device=t.attn_mask.device).triu_(1)
    return n


class LongCaptionCollate(common.Collate):
    """common.Collate with the long caption tokenised too ('long_text'); with
    short='first-sentence' the short caption is the long one's first sentence."""

    def __init__(self, tokenizer, short: str = "first-sentence"):
        super().__init__(tokenizer)
        self.short = short

    def __call__(self, items):
        # "code": sharegpt4v.py's caption.split(". ")[0], nothing else (deviation 8)
        if self.short != "caption":
            items = [dict(it, caption=first_sentence(it["long_caption"]) or it["long_caption"]
                          if self.short == "first-sentence"
                          else it["long_caption"].replace("\n", " ").split(". ")[0])
                     for it in items]
        out = super().__call__(items)
        out["long_text"] = self.tokenizer(out["long_caption"])  # (B, stretched context)
        return out


class LongCLIP(common.Method):
    """Stretches the text window of `model` (unless cfg.stretch is off), sets and fixes the
    temperature, freezes the kept positions; features / losses as common.Method, the loss terms of
    Eq. (4)."""

    def __init__(self, model, cfg: LongCLIPConfig):
        super().__init__()
        self.model, self.cfg = model, cfg
        base = original_context(cfg.backbone)
        self.keep = cfg.keep if cfg.keep >= 0 else default_keep(base)
        t = models.text_tower(model)
        if cfg.stretch:
            if t.context_length != base:
                raise ValueError(f"the model's text window is {t.context_length}, not "
                                 f"{cfg.backbone}'s {base}: it is stretched already; pass "
                                 f"--no-stretch")
            stretch_text_window(model, self.keep, cfg.factor)
        self.context_length = int(t.context_length)
        if models.pair_bias(model, cfg.loss, cfg.siglip_init) is None and cfg.log_scale >= 0:
            with torch.no_grad():  # train.py sets ln 100 (deviation 5; siglip keeps its own, 14)
                model.logit_scale.fill_(cfg.log_scale)
        model.logit_scale.requires_grad_(cfg.learn_temperature)
        if cfg.freeze_kept and self.keep > 0:  # deviation 2
            t.positional_embedding.register_hook(self._freeze_kept)

    def _freeze_kept(self, grad):  # deviation 2: rows < keep get no gradient
        return torch.cat([torch.zeros_like(grad[:self.keep]), grad[self.keep:]])

    def features(self, batch, ctx=None):
        return {"img": self.model.encode_image(batch["image"], normalize=True),  # (b, d) I_fine
                "long": common.encode_text(self.model, batch["long_text"]),  # (b, d) T_long
                "short": common.encode_text(self.model, batch["text"])}  # (b, d) T_short

    def losses(self, f, ctx=None):
        if self.cfg.pca_scope == "rank":  # the code: PCA of the local batch, then gather (dev. 3)
            img_coarse = pca_reconstruct(f["img"], self.cfg.pca_dim)
            img, img_coarse, txt_long, txt_short = common.gather(f["img"], img_coarse, f["long"],
                                                                 f["short"])
        else:
            img, txt_long, txt_short = common.gather(f["img"], f["long"], f["short"])
            img_coarse = pca_reconstruct(img, self.cfg.pca_dim)
        bias = self.model.logit_bias if self.cfg.loss == "siglip" else None
        return longclip_losses(img, img_coarse, txt_long, txt_short, self.model.logit_scale.exp(),
                               self.cfg.label_smoothing, bias)


# --- Training ---
def train_longclip(cfg: LongCLIPConfig, model, train_tf, manifest, validate=None):
    """Stretches and fine-tunes freshly loaded weights (so a resumed run
    rebuilds the same model); returns (model, tokenizer of its window, summary)."""
    dataset = common.training_set(cfg, manifest, train_tf, need_long=True)
    net = LongCLIP(model, cfg)
    tokenizer = models.get_tokenizer(cfg.backbone, net.context_length)
    summary = common.train(cfg, net, dataset, LongCaptionCollate(tokenizer, cfg.short_caption),
                           validate=validate)
    summary.update(train_pairs=len(dataset), skipped_rows=len(dataset.skipped),
                   context_length=net.context_length, keep=net.keep, factor=cfg.factor,
                   logit_scale=float(model.logit_scale.detach().exp()))
    return model, tokenizer, summary


def evaluate_windows(model, preprocess, tokenizers: dict, tasks, data_root, **kw) -> list:
    """eval.evaluate with each text window ({context: tokenizer}) on the retrieval tasks, records
    tagged 'window'; zero-shot tasks once, with the longest window (their prompts fit in any;
    'window': None)."""
    retrieval = [t for t in tasks if t != "simat" and not evaluation.is_classification(t)]
    other = [t for t in tasks if t not in retrieval]
    records = [dict(r, window=window) for window, tok in sorted(tokenizers.items()) if retrieval
               for r in evaluation.evaluate(model, preprocess, tok, retrieval, data_root, **kw)]
    if other:
        records += [dict(r, window=None) for r in evaluation.evaluate(
            model, preprocess, tokenizers[max(tokenizers)], other, data_root, **kw)]
    return records


# --- Tables (ERCLIP's Tables 1 and 2 layout, written once in eval.py, with the text window) ---
def paper_tables(ours, backbone: str) -> str:
    """Tables 1 and 2 in ERCLIP's layout plus a window column: the published rows for this backbone
    (ERCLIP's CLIP row, Long-CLIP's row of ERCLIP Tab. 1), then ours: (name, records, window, L_pres
    mark) each."""
    vit, rows = published.vit_key(backbone), []
    clip = evaluation.published_numbers("erclip", backbone)
    if clip:
        rows.append(published.erclip_rows(
            [{"task": t, "metric": m, "value": v} for (t, m), v in clip.items()],
            "paper CLIP (ERCLIP Tab. 1-2)", vit, window=77))
    vals = published.PUBLISHED_LONGCLIP.get(models.openai_name(backbone))
    if vals:
        (cols1, cols2), name = (published.erclip_cols(window=True),
                                "paper Long-CLIP, ~1M pairs (ERCLIP Tab. 1)")
        avg = (sum(vals[0::2]) / 4, sum(vals[1::2]) / 4)
        rows.append((dict(zip(cols1, [name, vit, 248, *vals, *avg])),
                     dict(zip(cols2, [name, vit, 248, "-", *avg, *["–"] * 5]))))
    rows += [published.erclip_rows(records, name, vit, pres, window)
             for name, records, window, pres in ours]
    return evaluation.erclip_tables([r1 for r1, _ in rows], [r2 for _, r2 in rows], window=True)


# --- Main ---
def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--demo" in argv:  # the lab: same-budget Long-CLIP against ERCLIP M+P (lab/demos/)
        from lab.demos import longclip as demo
        return demo.main(argv)
    cfg = flags.parse_config(LongCLIPConfig, argv, **RECIPES[_recipe(argv)])
    world = None
    if models.wants_lab(cfg):  # --backbone tiny / --train-data synthetic: the lab's world
        from lab import WORLD as world
    sharegpt4v = Path(cfg.data_root) / "sharegpt4v" / "share-captioner_coco_lcs_sam_1246k_1107.json"
    cfg = common.resolve_auto(cfg, "train_data", "sharegpt4v", [cfg.sharegpt4v or sharegpt4v],
                              "the ShareGPT4V descriptions with their images, Sec. 4.1")
    torch.manual_seed(cfg.seed)  # the initial weights when --pretrained random
    tasks = evaluation.task_list(cfg.eval_tasks, cfg.train_data, published.ERCLIP_EVAL_TASKS,
                                 published.ERCLIP_SYNTHETIC_TASKS)
    rank = manifests.dist_info()[0]
    erclip_run = read_erclip_results(cfg.erclip_results) if cfg.erclip_results else None
    manifest = train_manifest(cfg, world)  # fails at once when the training data is missing
    evaluation.check_tasks(tasks, cfg.data_root)
    common.preflight(cfg, [manifest], need_long=True)  # rows, --out, device: before any model
    model, train_tf, preprocess, tokenizer = models.load_model(cfg.backbone, cfg.pretrained,
                                                               cache_dir=cfg.cache_dir, world=world)
    base_window = models.text_tower(model).context_length
    device = common.init_distributed(cfg.device)
    base = []
    if tasks and cfg.eval_base and rank == 0:  # before stretching, through its own window (kept)
        base = runfolder.kept_result(cfg, "base", lambda: [
            dict(r, window=None if r["task"] == "simat" or evaluation.is_classification(r["task"])
                 else base_window)
            for r in evaluation.evaluate(model.to(device), preprocess, tokenizer, tasks,
                                         cfg.data_root, model_name=cfg.backbone,
                                         weights="before fine-tuning")])
    model, long_tokenizer, summary = train_longclip(
        cfg, model, train_tf, manifest, validate=evaluation.validator(cfg, preprocess, tasks))
    if rank != 0:
        return summary
    if "stopped_at" in summary:  # --stop-at: a checkpoint, no model.pt, nothing evaluated
        print(f"[longclip] stopped at step {summary['stopped_at']}; checkpoint "
              f"{summary['checkpoint']}; continue with --resume latest", file=sys.stderr)
        return {"summary": summary}
    window, short_window = summary["context_length"], original_context(cfg.backbone)
    tokenizers = {window: long_tokenizer}
    if short_window < window:
        tokenizers[short_window] = models.get_tokenizer(cfg.backbone, short_window)
    tuned = evaluate_windows(model, preprocess, tokenizers, tasks, cfg.data_root,
                             model_name=cfg.backbone,
                             weights=str(Path(cfg.out) / "model.pt")) if tasks else []
    name = "Long-CLIP" + (" same budget" if cfg.recipe == "erclip-budget" else "") + " (ours)"
    records = staged(base, "base") + staged(tuned, "tuned")  # one schema for every method
    erclip_own = staged(erclip_run[1], f"ERCLIP {erclip_run[0]}") if erclip_run else []
    text = own_table(records + erclip_own, title=f"Your tasks (base: before fine-tuning; tuned: "
                     f"{name}{'; ERCLIP: --erclip-results' * bool(erclip_run)}; window: tokens)")
    if cfg.train_data != "synthetic" and cfg.eval_tasks == "auto":  # the paper's: Tables 1-2 too
        ours = [("CLIP (ours)", base, base_window, "-")] if base else []
        if erclip_run:
            variant, erclip_records, lambda_p = erclip_run
            ours.append((f"ERCLIP {variant} (ours, --erclip-results)", erclip_records, short_window,
                         "yes" if lambda_p > 0 else "no"))
        ours += [(name, tuned, w, "no") for w in sorted(tokenizers)]
        text += "\n\n" + paper_tables(ours, cfg.backbone)
    print(text)
    common.write_results(cfg.out, document(
        "longclip", records, recipe=cfg.recipe, manifest=str(manifest), summary=summary,
        windows=sorted(tokenizers), tables=text, erclip_results=cfg.erclip_results), cfg)
    return {"summary": summary, "base": base, "tuned": tuned}


if __name__ == "__main__":
    from plumbing.cli import cli  # one message per expected failure, signals
    cli(main)
