"""What two or more method files share: the CLIP math (contrastive loss, trimmed text encoding, retrieval and
zero-shot metrics), the training data (manifests, samplers, seeded samples), DDP, the one AMP training loop
(AdamW groups, warm-up + cosine, fp16 grad scaling, clipping, the logit-scale clamp, exact gradient
accumulation, checkpoints, exact resume) and the continual-task driver. Nothing here is specific to one
paper. Not run directly.

It stands on the plumbing package (plumbing/: errors, settings, the run folder, file reading, manifests,
towers, shards, the scripts' error handling, loading and saving models: plumbing/models.py) and imports
nothing above it: no eval.py, method file or lab. The lab's synthetic world reaches it as an argument
(parse_tasks's world, a plumbing.models.LabWorld).

Sections, in order:
  1. shared math       clip_loss, siglip_loss, encode_text (trimmed), retrieval_metrics, zero-shot classifier /
                       accuracy, continual_metrics, LoRA (add_lora, merge_lora)
  2. data              the manifest dataset with its validating pre-pass, shards or manifests, loaders
  3. distributed       torchrun detection, feature gathering with gradient
  4. training loop     train_step, accumulated_backward, train and its set-up (checked_batch, training_loader, ...)
  5. continual driver  task sequence, score matrices, resume at boundaries
  6. before a run      --train-data auto, the device check, preflight
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import random
import shutil
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np
import open_clip
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize
from PIL import Image

# The plumbing and protocols this module stands on (the layers below it). Nothing is imported here for another
# module's use: a caller imports each name from the module that defines it (issue 73.3).
from plumbing import flags, manifests, models, param_rates, reporting, runfolder, shards, trainlog
from plumbing import lora as lora_files
from plumbing.base import (DataError, RunError, UsageError, atomic_write, check_finite, rendezvous_watch, warn_once,
                           world_size)
from plumbing.cli import StopSignals
from plumbing.flags import Config
from plumbing.loading import seeded, to_rgb
from plumbing.manifests import (CompactRows, Tally, bad_rows_message, columns, dist_info, image_check_cache,
                                image_problems, iter_manifest)
from plumbing.results import from_json, to_json  # strict JSON: NaN as null, listed (issue 42.3)
from plumbing.runfolder import _rng_state, _set_rng_state, data_fingerprint, latest_checkpoint
from plumbing.shards import is_shards
from plumbing.trainlog import TrainLog
from protocols import mtil

LOGIT_SCALE_MAX = math.log(100.0)  # CLIP's clamp: temperature never below 0.01


# =============================================================================
# 1. Shared math
# =============================================================================
def float32(loss_fn):
    """Every loss's numerics: autocast off inside it and its floating tensor arguments in float32, so logits and
    log-sum-exps are float32 under fp16 / bf16 AMP too (autocast recasts a matmul's inputs whatever .float() said:
    bf16 logits at scale 100 are off by 0.1-0.4 each). Gradients flow back through the casts to the AMP graph."""
    cast = lambda x: x.float() if torch.is_tensor(x) and x.is_floating_point() else x  # noqa: E731

    @functools.wraps(loss_fn)
    def wrapped(*args, **kwargs):
        device = next((a.device.type for a in (*args, *kwargs.values()) if torch.is_tensor(a)), "cpu")
        with torch.autocast(device, enabled=False):
            return loss_fn(*map(cast, args), **{k: cast(v) for k, v in kwargs.items()})
    return wrapped


@float32
def clip_loss(img, txt, logit_scale, label_smoothing: float = 0.0):
    """CLIP's symmetric InfoNCE (Radford et al. 2021, Fig. 3):
        L = 1/2 [ CE(s img txt^T, I) + CE(s txt img^T, I) ]
    img, txt: (B, D) L2-normalised; logit_scale: the multiplier s = 1/tau."""
    logits = logit_scale * img.float() @ txt.float().t()  # (B, B)
    labels = torch.arange(len(img), device=img.device)
    return 0.5 * (F.cross_entropy(logits, labels, label_smoothing=label_smoothing)
                  + F.cross_entropy(logits.t(), labels, label_smoothing=label_smoothing))


@float32
def siglip_loss(img, txt, logit_scale, logit_bias):
    """SigLIP's sigmoid loss (Zhai, Mustafa, Kolesnikov, Beyer. "Sigmoid Loss for Language Image Pre-Training".
    ICCV 2023. arXiv:2303.15343, Sec. 3, Eq. 1 / Algorithm 1), as open_clip's SigLipLoss on one process:
        L = -1/B sum_i sum_j log sigma(z_ij (s img_i . txt_j + b)),  z_ij = 1 if i = j else -1
    img, txt: (B, D) L2-normalised; logit_scale: s; logit_bias: b (a 0-dim tensor, learned). The methods gather
    features over ranks and every rank takes this over the global batch: the same gradient as open_clip's
    neighbour exchange (tests/test_siglip.py, two gloo processes)."""
    logits = logit_scale * img @ txt.t() + logit_bias  # (B, B)
    z = 2 * torch.eye(len(img), device=img.device, dtype=logits.dtype) - 1  # +1 on the diagonal, -1 elsewhere
    # Eq. 1 as Algorithm 1 computes it: -sum(log_sigmoid(labels * logits)) / n
    return -F.logsigmoid(z * logits).sum() / len(img)


def contrastive_loss(img, txt, logit_scale, logit_bias=None, label_smoothing: float = 0.0):
    """The pair loss a method's --loss names: CLIP's (clip_loss) when logit_bias is None, SigLIP's (siglip_loss,
    which has no label smoothing) when the run trains a logit_bias (models.pair_bias)."""
    if logit_bias is None:
        return clip_loss(img, txt, logit_scale, label_smoothing)
    return siglip_loss(img, txt, logit_scale, logit_bias)



def geodesic_mix(lam, a, b, eps: float = 1e-6):
    """m2-Mix's Eq. (3) (Oh et al., NeurIPS 2023): row-wise spherical interpolation between unit
    vectors, used by m2mix.py and gmc.py.
        mix_lam(a, b) = a sin(lam theta)/sin(theta) + b sin((1-lam) theta)/sin(theta),
        theta = arccos(a . b)
    lam = 1 gives a, lam = 0 gives b. a, b: (B, D) unit rows -> (B, D) float32 unit rows.
    Numerics (m2mix.py's deviation 1): in float64, theta = 2 atan2(|a - b|, |a + b|), which
    equals arccos(a . b) for unit vectors but stays accurate next to 0 and pi,
    clamped to [eps, pi - eps] so sin(theta) >= ~eps: a = b returns a with
    finite gradients; a = -b (no unique geodesic) stays finite."""
    a64, b64 = a.double(), b.double()
    theta = 2 * torch.atan2((a64 - b64).norm(dim=-1, keepdim=True),
                            (a64 + b64).norm(dim=-1, keepdim=True))
    theta = theta.clamp(eps, math.pi - eps)  # (B, 1)
    sin = torch.sin(theta)  # never 0
    # Eq. (3): a sin(lam theta)/sin(theta) + b sin((1-lam) theta)/sin(theta)
    mix = a64 * (torch.sin(lam * theta) / sin) + b64 * (torch.sin((1 - lam) * theta) / sin)
    return mix.float()


def sample_lam(alpha: float, generator: torch.Generator, fp16: bool = False) -> float:
    """lam ~ Beta(alpha, alpha) (m2-Mix Sec. 4.1), drawn from the step's seeded generator; fp16:
    rounded as m2-Mix's released code's .half() (m2mix.py's deviation 16)."""
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    lam = float(np.random.default_rng(seed).beta(alpha, alpha))
    return float(torch.tensor(lam).half()) if fp16 else lam


def encode_text(model, tokens, normalize: bool = True):
    """model.encode_text(tokens) with the padding columns beyond the batch's longest sequence dropped first.
    Under causal attention no position attends to a later one, so the pooled end-token feature is exact and the
    cost falls from O(context) to O(longest caption). No causal mask or non-argmax pooling: the untrimmed path."""
    t = model.text if hasattr(model, "text") else model  # CustomTextCLIP's tower, or CLIP's own attributes
    causal = getattr(t, "attn_mask", None) is not None
    if hasattr(t, "config") and hasattr(t, "pooler"):  # a Hugging Face tower: padding is masked, so cut it off
        n = int((tokens != t.config.pad_token_id).sum(1).max().clamp(min=1))
        return model.encode_text(tokens[:, :n], normalize=normalize)
    if not causal or getattr(t, "text_pool_type", getattr(t, "pool_type", "")) != "argmax" \
            or not hasattr(t, "token_embedding") or getattr(t, "cls_emb", None) is not None:
        return model.encode_text(tokens, normalize=normalize)
    n = int((tokens != 0).sum(1).max().clamp(min=1))  # (B, L) -> longest real sequence
    tokens = tokens[:, :n]
    cast = t.transformer.get_cast_dtype()
    x = t.token_embedding(tokens).to(cast) + t.positional_embedding[:n].to(cast)  # (B, n, W)
    x = t.transformer(x, attn_mask=t.attn_mask[:n, :n])
    x = t.ln_final(x)
    x = x[torch.arange(len(x), device=x.device), tokens.argmax(dim=-1)]  # end token, (B, W)
    proj = t.text_projection
    if proj is not None:
        x = proj(x) if isinstance(proj, nn.Linear) else x @ proj
    return F.normalize(x, dim=-1) if normalize else x


@torch.no_grad()
def encode_texts(model, tokenizer, texts: Sequence[str], batch_size: int = 256, device=None):
    """Normalised features of many texts, sorted by length so trimming pays off."""
    device = device or next(model.parameters()).device
    tokens = tokenizer(list(texts))
    order = torch.argsort((tokens != 0).sum(1), descending=True)
    out = torch.empty(len(texts), embed_dim(model))
    for i in range(0, len(texts), batch_size):
        idx = order[i:i + batch_size]
        with autocast(device):
            out[idx] = encode_text(model, tokens[idx].to(device)).float().cpu()
    return out


def embed_dim(model):
    t = model.text if hasattr(model, "text") else model  # CustomTextCLIP's tower, or CLIP's own attributes
    p = getattr(t, "text_projection", None)
    if isinstance(p, nn.Linear):
        return p.out_features
    if p is not None:
        return p.shape[1]
    return getattr(t, "output_dim", None) or t.transformer.width  # a Hugging Face tower: its projection's size


@torch.no_grad()
def zero_shot_classifier(model, tokenizer, classnames, templates, device=None, classes_per_batch=50):
    """CLIP's prompt ensemble: per class, the renormalised mean of the normalised template embeddings; (D, C).
    open_clip's builder, given our trimmed encode_text (the only method it calls)."""
    device = device or next(model.parameters()).device

    def trimmed(tokens, normalize=False):
        with autocast(tokens.device):
            return encode_text(model, tokens, normalize=normalize).float()
    return open_clip.build_zero_shot_classifier(SimpleNamespace(encode_text=trimmed), tokenizer, list(classnames),
                                                list(templates), num_classes_per_batch=classes_per_batch,
                                                device=device).float()


@torch.no_grad()
def zero_shot_accuracy(img, classifier, labels, ks=(1, 5), name: str = "zero-shot"):
    """Top-k accuracy (percent) of logits img @ classifier; img (N, D) normalised, classifier (D, C), labels (N,).
    A tie with the gold class counts against it; a non-finite row is an error (check_finite), never a hit."""
    check_finite(name, image=img, classifier=classifier.t())
    logits = img.float() @ classifier.float().to(img.device)  # (N, C)
    gold = logits.gather(1, labels.view(-1, 1).to(img.device))
    n_better = (logits >= gold).sum(1) - 1
    return {f"top{k}": 100.0 * (n_better < k).float().mean().item() for k in ks if k <= logits.shape[1]}


@torch.no_grad()
def retrieval_metrics(img, txt, text_to_image, ks=(1, 5, 10), max_chunk_scores: int = 2 ** 24, name="retrieval",
                      sides=("image", "text")):
    """Recall@k in percent for both directions. img (N, D), txt (M, D) normalised; text_to_image (M,) = index of
    text j's image (several captions per image allowed). Image-to-text: a hit when any of the image's captions
    ranks in the top k; text-to-image: when the text's image does. A candidate scoring equal to the best gold
    counts as ranked above it, so ties never inflate recall. Chunks of at most max_chunk_scores scores (64 MiB
    of float32): 5k x 25k never needs the dense matrix. A non-finite row is an error (check_finite), never a hit."""
    check_finite(name, **{sides[0]: img, sides[1]: txt})
    img, txt = img.float(), txt.float()
    t2i = torch.as_tensor(text_to_image, device=txt.device).long()
    n_img, n_txt = len(img), len(txt)
    if torch.bincount(t2i, minlength=n_img).min() == 0:
        raise ValueError("retrieval_metrics: some images have no caption")
    hits_t2i = torch.empty(n_txt, dtype=torch.long)
    chunk = max(1, max_chunk_scores // n_img)
    for s in range(0, n_txt, chunk):
        sim = txt[s:s + chunk] @ img.t()  # (c, N)
        gold = sim.gather(1, t2i[s:s + chunk, None].to(sim.device))  # (c, 1)
        hits_t2i[s:s + chunk] = ((sim >= gold).sum(1) - 1).cpu()  # candidates at least as good, minus itself
    hits_i2t = torch.empty(n_img, dtype=torch.long)
    order = torch.argsort(t2i, stable=True)  # texts grouped by image
    starts = torch.searchsorted(t2i[order], torch.arange(n_img + 1, device=t2i.device))
    chunk = max(1, max_chunk_scores // n_txt)
    for s in range(0, n_img, chunk):
        e = min(n_img, s + chunk)
        sim = img[s:e] @ txt.t()  # (c, M)
        gold_txt = order[starts[s]:starts[e]]  # the chunk's gold texts
        gold_row = t2i[gold_txt] - s
        gold_val = sim[gold_row, gold_txt]
        best = torch.full((e - s,), -float("inf"), device=sim.device).scatter_reduce(0, gold_row, gold_val, "amax")
        n_gold_at_best = torch.zeros(e - s, dtype=torch.long, device=sim.device).index_add_(
            0, gold_row, (gold_val >= best[gold_row]).long())
        hits_i2t[s:e] = ((sim >= best[:, None]).sum(1) - n_gold_at_best).cpu()  # non-gold texts >= best gold
    out = {}
    for k in ks:
        out[f"i2t_R@{k}"] = 100.0 * (hits_i2t < k).float().mean().item()
        out[f"t2i_R@{k}"] = 100.0 * (hits_t2i < k).float().mean().item()
    return out


def continual_metrics(R):
    """Continual-learning summaries of a (T+1) x T score matrix: R[i][j] = score on task j after training
    tasks 1..i, row 0 = before any training. With tasks numbered 1..T (column j-1 holds task j):
      last       = mean_j R[T][j]
      avg        = mean_{i=1..T} mean_{j<=i} R[i][j]
      bwt        = mean_{j<T} (R[T][j] - R[j][j])
      forgetting = mean_{j<T} (max_{0<=i<T} R[i][j] - R[T][j])   (row 0 included)
    """
    R = np.asarray(R, dtype=float)
    T = R.shape[1]
    if R.shape[0] != T + 1:
        raise ValueError(f"continual_metrics needs a (T+1) x T matrix, got {R.shape}")
    out = {"last": R[T].mean(), "avg": np.mean([R[i, :i].mean() for i in range(1, T + 1)])}
    if T > 1:
        out["bwt"] = np.mean([R[T, j - 1] - R[j, j - 1] for j in range(1, T)])
        out["forgetting"] = np.mean([R[:T, j - 1].max() - R[T, j - 1] for j in range(1, T)])
    else:
        out["bwt"] = out["forgetting"] = 0.0
    return {k: float(v) for k, v in out.items()}


class LoRA(nn.Module):
    """A weight parametrization W -> W + (alpha / r) B A (LoRA, Eq. 3; C-CLIP Sec. 4.1).

    Because it replaces the weight tensor itself, it acts wherever the weight is read, including
    nn.MultiheadAttention's in_proj_weight and out_proj.weight. B starts at zero: a fresh adapter changes nothing.
    Dropout (ours, cclip.py's deviation 3) masks A's input columns, one mask per step."""

    def __init__(self, out_features: int, in_features: int, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.A = nn.Parameter(torch.empty(rank, in_features))  # (r, in)
        self.B = nn.Parameter(torch.zeros(out_features, rank))  # (out, r)
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))  # LoRA's init of A (as nn.Linear, and peft's)
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def delta(self):
        """DeltaW = (alpha / r) B A, (out, in), without dropout."""
        return self.scale * (self.B @ self.A)

    def forward(self, weight):
        if isinstance(self.dropout, nn.Identity) or not self.training:
            return weight + self.delta().to(weight.dtype)
        mask = self.dropout(torch.ones(self.A.shape[1], device=self.A.device, dtype=self.A.dtype))  # (in,)
        return weight + (self.scale * (self.B @ (self.A * mask))).to(weight.dtype)


def _targets(model, targets):
    """(module, tensor name, full name) of every 2-D weight whose name ends in a target suffix."""
    found = []
    for mod_name, mod in model.named_modules():
        for p_name, p in list(mod.named_parameters(recurse=False)):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if p.ndim == 2 and any(full.endswith(t) for t in targets):
                found.append((mod, p_name, full))
    return found


def add_lora(model, rank: int = 16, alpha: float = 32.0, dropout: float = 0.0,
             targets=tuple(lora_files.DEFAULT_TARGETS.split(",")), keep_trainable=(), towers=("image", "text")):
    """Freezes every weight of `model` (but the parameters named in keep_trainable, e.g. SigLIP's logit_bias) and
    adds zero-initialised LoRA adapters to each 2-D parameter whose name ends in one of `targets` (default: attention
    in/out and MLP weights) in `towers` (the image tower: names under visual.). The outputs are unchanged until the
    adapters train. Returns the list of adapted parameter names."""
    model.requires_grad_(False)
    for name, p in model.named_parameters():
        if name in keep_trainable:
            p.requires_grad_(True)
    found = [t for t in _targets(model, tuple(targets))
             if ("image" if t[2].startswith("visual.") else "text") in towers]
    if not found:
        raise UsageError(f"add_lora: no plain 2-D parameter ends in any of {tuple(targets)} (already adapted? "
                         f"merge first; --lora-targets names weight suffixes such as attn.in_proj_weight)")
    for mod, p_name, _ in found:
        w = getattr(mod, p_name)
        lora = LoRA(w.shape[0], w.shape[1], rank, alpha, dropout).to(w.device)
        parametrize.register_parametrization(mod, p_name, lora)
    return [full for _, _, full in found]


def adapters(model):
    """{adapted weight's open_clip name: its LoRA} of every adapter in `model`."""
    out = {}
    for mod_name, mod in model.named_modules():
        if parametrize.is_parametrized(mod):
            for p_name, plist in mod.parametrizations.items():
                for m in plist:
                    if isinstance(m, LoRA):
                        out[f"{mod_name}.{p_name}" if mod_name else p_name] = m
    return out


@torch.no_grad()
def merge_lora(model, coef: float = 1.0):
    """Folds every adapter into its weight, theta <- theta + coef * DeltaW (coef 1: the adapted model's function;
    C-CLIP Sec. 4.1: coef = alpha), and removes the parametrizations: the model is a plain open_clip model again,
    its state_dict has the original keys, and every weight is trainable."""
    for mod in list(model.modules()):
        if not parametrize.is_parametrized(mod):
            continue
        for p_name in list(mod.parametrizations.keys()):
            plist = getattr(mod.parametrizations, p_name)
            loras = [m for m in plist if isinstance(m, LoRA)]
            if len(loras) != len(plist):
                raise ValueError(f"merge_lora: {p_name} carries a parametrization that is not LoRA")
            theta = plist.original
            merged = theta + coef * sum(lora.delta() for lora in loras)  # theta + coef DeltaW
            parametrize.remove_parametrizations(mod, p_name, leave_parametrized=False)
            getattr(mod, p_name).copy_(merged)
    model.requires_grad_(True)
    return model


# =============================================================================
# 2. Data
# =============================================================================


class ManifestDataset(torch.utils.data.Dataset):
    """Image-caption pairs from a manifest (image path relative to it, a caption, an optional long caption,
    optional extra columns). A pre-pass before any training step checks every row: unreadable lines (not UTF-8,
    not JSON), required columns, empty captions, missing images and (check_images) images that do not decode in
    full. One DataError names file and line of every bad row (the first MAX_LISTED, then a count); skip_bad=True
    drops them into `self.skipped` (train's summary, hence results.json, records them all). An image failing
    later (check_images=False, or changed on disk) raises a DataError naming the file and the manifest line.
    check_images: True / 'full' (every image; across_ranks: split across the processes, remembered on disk) |
    'sample' (manifests.IMAGE_SAMPLE of them) | False / 'none'. replace_undecodable: an image failing during training
    is replaced by the next decodable row and reported in the item's '_failed' (train counts them). draw_caption:
    a row whose caption is a list ('captions') gives one of them at random per item (training_set's)."""

    def __init__(self, path, transform=None, need_long: bool = False, skip_bad: bool = False,
                 check_images: bool | str = True, extra: Sequence[str] = (), across_ranks: bool = False,
                 replace_undecodable: bool = False, draw_caption: bool = False, keys=None, sep: str | None = None):
        self.path, self.transform = Path(path), transform  # keys, sep: open_clip's --csv-img-key / -caption-key
        keys = keys or (flags.CSV_COLUMNS["csv_img_key"], flags.CSV_COLUMNS["csv_caption_key"])  # None: the run's
        self.need_long, self.extra, self.image_key = need_long, tuple(extra), None
        mode = {True: "full", False: "none"}.get(check_images, check_images)
        self.rows, problems, files = CompactRows(), [], []  # problems: (line, message), sorted by line at the end
        rows = iter_manifest(self.path, keep_bad=True, sep=flags.CSV_COLUMNS["csv_separator"] if sep is None else sep)
        for r in rows:  # a row at a time into packed columns: 1M rows are never held as dicts (issue 55.3)
            if self.image_key is None and "_error" not in r:
                self.image_key, self.caption_key = columns(self.path, set(r) - {"_line"}, keys, need_long, extra)
            why = r.get("_error") or self._check(r)
            if why:
                problems.append((r["_line"], f"{self.path}:{r['_line']}: {why}"))
                continue
            self.rows.append(r)
            if mode != "none":
                files.append(str(self.image_file(r)))
        if self.image_key is None:
            raise DataError(bad_rows_message(self.path, [p for _, p in problems]) if problems else
                            f"{self.path}: no rows")
        todo = ([] if mode == "none" else range(len(files)) if mode == "full" else  # decoded in full, in threads
                sorted(random.Random(0).sample(range(len(files)), min(manifests.IMAGE_SAMPLE, len(files)))))
        found = image_problems([files[k] for k in todo], across_ranks=across_ranks,  # --check-images none: []
                               cache_file=image_check_cache(self.path) if across_ranks else None) if todo else []
        keep = np.ones(len(self.rows), bool)
        for k, why in ((k, why) for k, why in zip(todo, found) if why):
            keep[k] = False
            line = self.rows[k]["_line"]
            problems.append((line, f"{self.path}:{line}: {why}"))
        self.rows.keep(keep)
        self.replace_undecodable, self.draw_caption = replace_undecodable, draw_caption
        self.skipped = [p for _, p in sorted(problems, key=lambda lp: lp[0])]  # stable: a line's rows in order
        if self.skipped and not skip_bad:
            raise DataError(bad_rows_message(self.path, self.skipped, " (use --skip-bad to skip and count them)"))
        if self.skipped:
            warn_once(bad_rows_message(f"warning: {self.path}: skipped", self.skipped))  # preflight's and train's
        if not self.rows:
            raise DataError(f"{self.path}: every row is bad")

    def _caption(self, r, draw: bool = False):
        """The row's caption; of a list, the first, or with draw one at random (training: seeded per sample by
        SeededSamples, so the same on resume; as C-CLIP's research loader's random.choice)."""
        c = r.get(self.caption_key)
        return (random.choice(c) if draw else c[0]) if isinstance(c, list) and c else c

    def _check(self, r):  # a list's every caption: training draws any of them
        c, key = r.get(self.caption_key), self.caption_key
        caps = [(f"{key}[{i}]", x) for i, x in enumerate(c)] if isinstance(c, list) and c else [(key, c)]
        for name, value in (*caps, ("long_caption", r.get("long_caption") if self.need_long else "x")):
            if not isinstance(value, str):
                return f"no {name}" if value is None else f"{name} is not text ({type(value).__name__} {value!r:.40})"
            if not value.strip():
                return f"empty {name}"
        if r.get(self.image_key) is None:
            return "no image path"
        p = self.image_file(r)
        if not p.is_file():
            return (f"not a regular file (a folder, a pipe or a broken link): {p}" if os.path.lexists(p)
                    else f"image not found: {p}")
        return None

    def image_file(self, r) -> Path:
        return self.path.parent / str(r[self.image_key])

    def __len__(self):
        return len(self.rows)

    def _image(self, r):
        try:
            with Image.open(self.image_file(r)) as im:
                return to_rgb(im)
        except Exception as e:  # PIL raises many types; name the file (a worker's traceback would not)
            raise DataError(f"{self.path}:{r['_line']}: undecodable image {self.image_file(r)} "
                            f"({type(e).__name__}: {e}); run again with --skip-bad (the row check decodes "
                            f"every image) or fix the file") from None

    def __getitem__(self, i):
        failed = []
        for j in range(len(self.rows) if self.replace_undecodable else 1):  # the next rows stand in for a bad one
            try:
                r = self.rows[(i + j) % len(self.rows)]
                image = self._image(r)
                break
            except DataError as e:
                if not self.replace_undecodable:
                    raise
                failed.append(str(e).split("; run again")[0])
        else:
            raise DataError(f"{self.path}: no row's image decodes")
        item = {"image": self.transform(image) if self.transform else image,
                "caption": self._caption(r, self.draw_caption), "index": i, **({"_failed": failed} if failed else {})}
        if self.need_long:
            item["long_caption"] = r["long_caption"]
        for k in self.extra:
            item[k] = r[k]
        return item


class CountFailures:
    """train's collate_fn around the method's: takes the '_failed' reports off the items (ManifestDataset's
    replaced images) before the method's collate sees them, and hands them on as the batch's '_failed'."""
    def __init__(self, collate):
        self.collate = collate

    def __call__(self, items):
        failed = [f for item in items if isinstance(item, dict) for f in item.pop("_failed", ())]
        return {**self.collate(items), "_failed": failed}


def training_set(cfg, path, transform=None, **kw) -> ManifestDataset:
    """A training manifest as every method reads it: --skip-bad, and the row check's --check-images (full:
    every image, split across the processes and remembered on disk; sample / none: an image failing during
    training is replaced by the next good row and counted in results.json). Tar shards ('DIR/{00000..00099}.tar'):
    shards.ShardSet, --train-num-samples samples an epoch."""
    if is_shards(path):
        return shards.ShardSet(path, transform, kw.get("need_long", False), cfg.train_num_samples,
                               readers=world_size() * max(1, cfg.workers))
    return ManifestDataset(path, transform, skip_bad=cfg.skip_bad, check_images=cfg.check_images, across_ranks=True,
                           replace_undecodable=cfg.check_images != "full", draw_caption=True,
                           keys=(cfg.csv_img_key, cfg.csv_caption_key), sep=cfg.csv_separator, **kw)


class Collate:
    """Stacks tensors, tokenises 'caption' into 'text', keeps other strings as lists."""
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, items):
        out = {}
        for k in items[0]:
            vals = [it[k] for it in items]
            if isinstance(vals[0], torch.Tensor):
                out[k] = torch.stack(vals)
            elif isinstance(vals[0], (int, float)):
                out[k] = torch.tensor(vals)
            else:
                out[k] = vals
        if "caption" in out:
            out["text"] = self.tokenizer(out["caption"])
        return out


class ResumableSampler(torch.utils.data.Sampler):
    """Seeded shuffle per epoch, sharded across ranks, that can start part way into an epoch (exact resume
    without replaying the data). batch_size is the per-rank batch. Each global batch of the one shuffle is split
    by rank (rank r takes positions r*batch ... (r+1)*batch - 1), so the global batch that gather() assembles in
    rank order is, sample for sample, one process's batch with batch_size * world: N processes under torchrun
    train on the data order of one. keys=True yields (epoch, index) for SeededSamples. keep_last (one process): the
    last partial batch too, after the whole ones, as a DataLoader without drop_last."""
    def __init__(self, n, batch_size, seed=0, shuffle=True, rank=0, world=1, keys: bool = False, keep_last=False):
        self.n, self.batch, self.seed, self.shuffle, self.rank, self.world = n, batch_size, seed, shuffle, rank, world
        self.epoch, self.skip_batches, self.keys, self.keep_last = 0, 0, keys, keep_last and world == 1

    def set_epoch(self, epoch, skip_batches=0):
        self.epoch, self.skip_batches = epoch, skip_batches

    def _indices(self):
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            idx = torch.randperm(self.n, generator=g).tolist()
        else:
            idx = list(range(self.n))
        n_global, b = self.n // (self.batch * self.world), self.batch  # drop_last: whole global batches only
        mine = [idx[(g * self.world + self.rank) * b:(g * self.world + self.rank + 1) * b] for g in range(n_global)]
        return [i for batch in mine for i in batch] + (idx[n_global * b:] if self.keep_last else [])

    def __iter__(self):
        idx = self._indices()[self.skip_batches * self.batch:]
        return iter([(self.epoch, i) for i in idx] if self.keys else idx)

    def __len__(self):
        return len(self._indices()) - self.skip_batches * self.batch


class SeededSamples(torch.utils.data.Dataset):
    """dataset[i] with its randomness (the train transform's random crop: torch's CPU generator; Python's and
    NumPy's too) seeded from (seed, epoch, i), not drawn from the loading process's generators. A sample's
    augmentation is then the same whatever the number of DataLoader workers, and a resumed run sees the crops of
    an uninterrupted one. Keys are (epoch, i), as ResumableSampler(keys=True) yields them. The caller's
    generators are left as they were (workers=0 runs in the main process)."""

    def __init__(self, dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, i = key
        return seeded(((self.seed * 1_000_003 + epoch) * 1_000_003 + i) % 2 ** 63, self.dataset.__getitem__, i)


# =============================================================================
# 3. Distributed
# =============================================================================
def init_distributed(device: str = "auto"):
    """Initialises the process group under torchrun (or srun: plumbing.base.adopt_slurm); picks the device."""
    if world_size() > 1 and not dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", 0))
        use_cuda = torch.cuda.is_available() and device != "cpu"
        if use_cuda:
            torch.cuda.set_device(local)
        watch = rendezvous_watch()  # a process started alone ends with one message, not a silent wait
        dist.init_process_group("nccl" if use_cuda else "gloo")
        watch.cancel()
    rank, world, local = dist_info()
    if device == "auto":
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and world > 1:
        device = f"cuda:{local}"
    return torch.device(device)


def gather(*features):
    """All ranks' features, concatenated in rank order, WITH gradient (open_clip's gather_features,
    gather_with_grad=True). Every rank computes the loss over the global batch; DDP averages gradients over ranks
    and the gather's backward sums them, so this equals one process on the global batch (tests/test_train.py)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:  # one process
        return features if len(features) > 1 else features[0]
    rank, world = dist.get_rank(), dist.get_world_size()
    from open_clip.loss import gather_features
    out = []
    for i in range(0, len(features), 2):
        a = features[i]
        b = features[i + 1] if i + 1 < len(features) else a
        ga, gb = gather_features(a, b, gather_with_grad=True, rank=rank, world_size=world)
        out += [ga, gb] if i + 1 < len(features) else [ga]
    return tuple(out) if len(out) > 1 else out[0]


# =============================================================================
# 4. Training loop
# =============================================================================
def resolve_precision(precision: str, device) -> str:
    """'auto' -> fp16 on CUDA, fp32 elsewhere. fp16 off CUDA is accepted for testing the grad-scaler path
    (tests/test_fp16.py), with a warning: CPU half-precision matrix products are slow, and bf16 needs no scaler."""
    dev = torch.device(device).type
    if precision == "auto":
        return "fp16" if dev == "cuda" else "fp32"
    if precision not in ("fp16", "bf16", "fp32"):
        raise UsageError(f"unknown precision {precision!r}")
    if precision == "fp16" and dev != "cuda":
        warn_once(f"warning: --precision fp16 on {dev} is meant for testing the grad-scaler path (slow); "
                   f"use bf16 or fp32 to train on {dev}")
    return precision


def autocast(device, precision: str = "auto"):
    """One AMP path: fp16 or bf16 autocast, or nothing for fp32. For inference ('auto'): fp16 on CUDA, fp32 on CPU."""
    dev = torch.device(device).type
    precision = resolve_precision(precision, device)
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(dev, dtype=torch.float16 if precision == "fp16" else torch.bfloat16)


def no_decay(name: str, p: torch.Tensor) -> bool:
    """Gains, biases, embeddings and the logit scale get no weight decay."""
    return p.ndim < 2 or any(s in name for s in ("logit_scale", "logit_bias", "embedding", "class_embedding",
                                                  "ln_", "norm", ".bn", "bias"))


def param_groups(net, lr, wd, lr_of: Callable[[str], float] | None = None, decay_all: bool = False):
    """AdamW groups keyed by (learning rate, decay) over trainable parameters."""
    groups = {}
    for name, p in net.named_parameters():
        if not p.requires_grad:
            continue
        g_lr = lr_of(name) if lr_of else lr
        key = (g_lr, decay_all or not no_decay(name, p))
        groups.setdefault(key, {"params": [], "names": [], "lr": g_lr, "weight_decay": wd if key[1] else 0.0})
        groups[key]["params"].append(p)
        groups[key]["names"].append(name)
    if not groups:
        raise ValueError("no trainable parameters")
    return list(groups.values())


def warmup_cosine(warmup: int, total: int):
    """Multiplier of the peak lr at step s: linear warm-up, then cosine to 0."""
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return f


class Method(nn.Module):
    """A method's training wrapper, in two parts that exact gradient accumulation (accumulated_backward) runs
    apart: features(batch, ctx) -> {name: (b, ...) rows of this process's batch} (the towers' output; what
    depends on nothing but the row), and losses(features, ctx) -> the named, already-weighted loss terms over the
    whole batch (gathered across ranks there). forward is the one after the other. ctx.replay is True when
    accumulation runs a micro-batch a second time for its gradient: skip what carries none (a frozen teacher)."""

    def forward(self, batch, ctx=None):
        return self.losses(self.features(batch, ctx), ctx)

    def train(self, mode: bool = True):
        super().train(mode)
        if getattr(self, "teacher", None) is not None:
            self.teacher.eval()  # a frozen teacher (ERCLIP's initial model, C-CLIP's old one) never leaves eval()
        return self


def step_generator(seed: int, step: int, device="cpu"):
    """The randomness a loss consumes at a step (mixing ratios, ...): the same on every rank, reproducible on
    resume without saving any state. device is unused (a CPU generator)."""
    return torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + step)


def make_optimizer(cfg: Config, net: nn.Module, device, lr_of=None, fused: bool | None = None):
    """AdamW over param_groups, each parameter at plumbing.param_rates' lr (the method's lr_of, --lr-image /
    --lr-text, the layer decays), betas (--beta1, --beta2) = (0.9, 0.98) and eps 1e-6 unless set (the shared
    Config's defaults). Fused by default on CUDA and CPU: one kernel for all parameters (5x faster on CPU),
    which takes the scaler's inf flag and skips an overflowed step on the device. fused=False: for-each (tests)."""
    groups = param_groups(net, cfg.lr, cfg.wd, param_rates.lr_of(cfg, net, lr_of), cfg.decay_all)
    for g in groups:
        g.pop("names")
    fused = torch.device(device).type in ("cuda", "cpu") if fused is None else fused
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)


class NonFiniteGuard:
    """The first step whose summed loss is not finite, with its loss terms, kept on the device: update() queues a
    few tiny kernels and reads nothing back, so the host never waits for a step; train calls check() at log and
    save steps and at the end. Steps between a non-finite loss and the next check still run (their weights may
    turn non-finite), but check() runs before every save, so no checkpoint holds them, and the error names the
    step where it began."""

    def __init__(self, device):
        self.step = torch.full((), -1, dtype=torch.long, device=device)
        self.terms = {}

    def update(self, step: int, losses: dict, loss):
        first = ~torch.isfinite(loss) & (self.step < 0)
        self.step = torch.where(first, step, self.step)
        for k, v in losses.items():
            v = v.detach().float()
            self.terms[k] = torch.where(first, v, self.terms.get(k, torch.full_like(v, float("nan"))))

    def check(self, hint: Callable[[], str] = str):
        """Raises FloatingPointError naming the first non-finite step as metrics.jsonl numbers it (the step
        after which it was logged: 1-based), plus hint() (one host sync)."""
        step = int(self.step)
        if step >= 0:
            terms = {k: float(v) for k, v in self.terms.items()}
            raise FloatingPointError(f"non-finite loss at step {step + 1}: {terms}{hint()}")


def split_batch(batch: dict, k: int, groups: dict[str, str] | None = None) -> list[dict]:
    """A collated batch of n rows (its images) as k micro-batches of n / k: every tensor and list of n rows is cut
    into k runs in order; anything else (statistics, ...) is kept whole. groups {key: counts key}: batch[key] holds
    batch[counts key][i] rows for row i, back to back (ERCLIP's sentences); each micro-batch gets its rows' ones."""
    n = len(next(batch[key] for key in ("image", "img") if key in batch))  # the rows: the images'
    if n % k:
        raise UsageError(f"--accum-freq {k} does not divide this process's batch of {n}")
    parts = [{key: v[i * n // k:(i + 1) * n // k] if isinstance(v, (list, torch.Tensor)) and len(v) == n else v
              for key, v in batch.items()} for i in range(k)]
    for key, counts in (groups or {}).items():
        ends = [sum(batch[counts][:i * n // k]) for i in range(k + 1)]
        for i, part in enumerate(parts):
            part[key] = batch[key][ends[i]:ends[i + 1]]
    return parts


def _torch_rng(device):
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _put_torch_rng(state, device):
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def summed_loss(losses: dict, ctx, guard: "NonFiniteGuard | None"):
    """The loss terms summed in float32, with the non-finite check on the UNSCALED loss: recorded on the device
    by a guard, else raised here (one host sync)."""
    loss = sum(v.float() for v in losses.values())
    if guard is not None:
        guard.update(ctx.step, losses, loss)
    elif not torch.isfinite(loss):
        terms = {k: float(v.detach()) for k, v in losses.items()}
        raise FloatingPointError(f"non-finite loss at step {ctx.step + 1}: {terms}")
    return loss


def accumulated_backward(net: Method, batch, ctx, scaler, k: int, guard=None):
    """--accum-freq k: the whole batch's gradient from k micro-batches, exactly (up to float rounding), whatever the
    loss does across the batch (m2-Mix's mixes, CKC over 2N rows, Long-CLIP's PCA, ERCLIP's teacher). GradCache's
    feature cache (Gao et al., "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup", RepL4NLP
    2021, arXiv 2101.06983, Sec. 3), as in open_clip's --accum-freq (PR #267) but with the loss computed once
    (open_clip's, once per micro-batch, counts the temperature's gradient K times: docs/scale.md): 1. each
    micro-batch's features without a graph (RNG state kept); 2. the loss over all, backward (the features' and the
    loss's own parameters' gradients); 3. each micro-batch again with a graph (RNG put back: dropout draws the same),
    backward with its rows of the features' gradient. Peak activation memory: one micro-batch's, for a 2nd forward.
    One disabled autocast region holds autocast's cast cache for the step: each weight cast once a step, not once a
    pass (issue 75.2, docs/benchmarks.md). Returns (losses, loss) as train_step's forward; gradients in .grad."""
    with torch.autocast(ctx.device.type, enabled=False):  # holds autocast's cast cache open for the step
        return _accumulated_backward(net, batch, ctx, scaler, k, guard)


def _accumulated_backward(net: Method, batch, ctx, scaler, k: int, guard=None):
    split = getattr(net, "split_batch", split_batch)
    micro, states, parts = split(batch, k), [], []
    with torch.no_grad():
        for mb in micro:
            states.append(_torch_rng(ctx.device))
            with autocast(ctx.device, ctx.precision):
                parts.append(net.features(mb, ctx))
    after = _torch_rng(ctx.device)
    whole = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
    for v in whole.values():
        v.requires_grad_(v.is_floating_point())
    with autocast(ctx.device, ctx.precision):
        losses = net.losses(whole, ctx)
    loss = summed_loss(losses, ctx, guard)
    scaler.scale(loss).backward()
    replay, start = SimpleNamespace(**{**vars(ctx), "replay": True}), 0
    for mb, state in zip(micro, states):
        _put_torch_rng(state, ctx.device)
        with autocast(ctx.device, ctx.precision):
            f = net.features(mb, replay)
        rows = slice(start, start + len(next(iter(f.values()))))
        start = rows.stop
        pairs = [(v, whole[key].grad[rows]) for key, v in f.items() if v.requires_grad and whole[key].grad is not None]
        if pairs:
            torch.autograd.backward(*zip(*pairs))
    _put_torch_rng(after, ctx.device)
    return losses, loss


def average_gradients(net: nn.Module):
    """DDP's gradient average, done once after accumulated_backward's passes (DDP's reducer expects one backward
    per forward through it: its hooks stay idle when the forward bypasses the wrapper): one all_reduce of every
    gradient flattened together, divided by the number of processes."""
    world = dist_info()[1]
    grads = [p.grad for p in net.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])  # one buffer, one all_reduce
    dist.all_reduce(flat)
    for g, mean in zip(grads, flat.div_(world).split([g.numel() for g in grads])):
        g.copy_(mean.view_as(g))


def train_step(net, batch, ctx, opt, scaler, sched=None, *, grad_clip: float = 0.0, hooks=None, forward=None,
               guard: NonFiniteGuard | None = None, accum: int = 1):
    """One optimisation step: the body of train's loop, called as is by tests/test_fp16.py and
    benchmarks/gpu_check.py. ctx needs .device and .precision (and whatever net.forward reads); forward defaults
    to net (train passes the DDP wrapper).
      1. forward under autocast; the loss terms are summed in float32 (accum > 1: accumulated_backward's
         passes over accum micro-batches, then, under DDP, one average of the gradients)
      2. non-finite guard on the UNSCALED loss: a NaN/inf loss stops the run (raised here, one host sync,
         without a guard; a NonFiniteGuard records it on the device for train's next check); a scaled overflow
         (inf gradients from a too-large loss scale) is left to the scaler
      3. backward of loss * scale (the scale is 1, i.e. off, unless fp16)
      4. unscale the gradients when clipping or hooks need their true values
      5. clip the global gradient norm (hooks.clip_grad_norm_(params, max_norm, scaler) when the hooks have one)
      6. hooks.before_optimizer_step(net) (DNS projects the gradients here)
      7. scaler.step: AdamW, skipped when any gradient is inf/NaN; scaler.update: the scale halves after a
         skipped step and doubles after 2000 clean ones
      8. the LR scheduler steps on every iteration, skipped or not (as open_clip_train's scheduler(step)): the
         schedule and the data order are functions of the iteration; a skip costs one step of schedule
      9. hooks.after_optimizer_step(net); then CLIP's clamp of the logit scale to [0, ln 100], idempotent: a skipped
         step's weights are unchanged and already inside (only a value outside, possible before the first step, moves)
    A skipped step leaves weights, AdamW moments and step counts bitwise unchanged (fused AdamW creates its
    state, zeros, if the very first step is skipped). Returns (losses, loss, skipped): skipped is a 0-dim bool
    tensor on the scaler's device (None when the scaler is off); reading it syncs on CUDA, so train reads it at
    log steps only."""
    forward = forward or net
    opt.zero_grad(set_to_none=True)
    if accum > 1:  # k micro-batches, the whole batch's gradient
        losses, loss = accumulated_backward(net, batch, ctx, scaler, accum, guard)
        if isinstance(forward, nn.parallel.DistributedDataParallel):  # its reducer bypassed: its average, once
            average_gradients(net)
    else:
        with autocast(ctx.device, ctx.precision):
            losses = forward(batch, ctx)
        loss = summed_loss(losses, ctx, guard)
        scaler.scale(loss).backward()
    if grad_clip > 0 or hooks is not None:
        scaler.unscale_(opt)  # clip and project the true gradients, not the scaled ones
    if grad_clip > 0:  # hooks.clip_grad_norm_, if any, clips (DNS: by the unprojected gradient's norm) or torch's
        clip = getattr(hooks, "clip_grad_norm_", lambda ps, c, _: torch.nn.utils.clip_grad_norm_(ps, c))
        clip([p for g in opt.param_groups for p in g["params"]], grad_clip, scaler)
    if hooks is not None:
        hooks.before_optimizer_step(net)
    one = loss.new_ones(())  # scaler.scale(one): the scale as a new device tensor (get_scale() waits for the device)
    scale = scaler.scale(one) if scaler.is_enabled() else None  # a copy: update() changes the scale in place
    scaler.step(opt)
    scaler.update()
    skipped = scaler.scale(one) < scale if scale is not None else None  # only a skip lowers it
    if sched is not None:
        sched.step()
    if hooks is not None:
        hooks.after_optimizer_step(net)
    logit_scale = getattr(net.model, "logit_scale", None)
    if logit_scale is not None:
        with torch.no_grad():  # CLIP: clamp the temperature at 0.01 after every step
            logit_scale.clamp_(0, LOGIT_SCALE_MAX)
    return losses, loss, skipped


def train(cfg: Config, net: nn.Module, train_set, collate, *, lr_of=None, export: bool = True,
          hooks=None, method_state: Callable[[], dict] | None = None, schedule: Callable | None = None,
          validate: Callable[[nn.Module], dict] | None = None, keep_last: bool = False):
    """Trains `net` (a wrapper with .model = the open_clip model, whose forward(batch, ctx) returns the loss
    terms) and returns a summary dict. hooks: optional object with before_optimizer_step(net) (after unscaling
    and clipping) and after_optimizer_step(net); DNS projects there. Each step is train_step (its docstring gives
    the order and what an fp16 skipped step does); metrics.jsonl logs grad_scale and skipped_steps under fp16.
    schedule(opt, steps_per_epoch, total): LambdaLR's lr_lambda(s) (default: warm-up, then cosine to 0).
    validate(model) -> {name: value}: --val-every's evaluation (rank 0; the training's random state and the
    modules' train/eval modes are put back after it, so the run is the one it would be without it). keep_last: an
    epoch ends with its partial batch (one process, no --accum-freq, not shards; gmc.py's --keep-last-batch)."""
    device = init_distributed(cfg.device)
    rank, world, _ = dist_info()
    # torch takes a skipped FIRST step (GradScaler) for a misordered scheduler call. Set once a run: a filter set
    # every step resets Python's once-per-place memo, so open_clip's all_gather FutureWarning printed every step
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
    precision = resolve_precision(cfg.precision, device)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    overrides = runfolder.start_run(cfg, out) if rank == 0 else []  # lock, leftovers, an old run, --resume's settings
    prepare_model(cfg, net, device)  # on the device; --grad-checkpointing, --lock-*, --lora, --torchcompile
    local_batch = checked_batch(cfg, net, validate)  # --batch-size, --accum-freq and --val-every checked
    steps_per_epoch = epoch_steps(cfg, train_set, keep_last)
    loader, sampler = training_loader(cfg, train_set, collate, local_batch, steps_per_epoch, device, keep_last)
    total = cfg.steps or cfg.epochs * steps_per_epoch
    opt, sched = optimizer_and_schedule(cfg, net, device, lr_of, schedule, steps_per_epoch, total)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    ddp = nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None,
                                              find_unused_parameters=cfg.find_unused) if world > 1 else net
    run = runfolder.Checkpoints(cfg, out, net, opt, sched, scaler, data_fingerprint(train_set), overrides,
                                method_state)
    step, skipped, data_change = run.start(rank)  # --resume's state and step (plumbing/runfolder.py), config.json
    n_skipped = torch.full((), skipped, dtype=torch.long, device=device)  # fp16: overflowed steps (weights untouched)
    guard, failed = NonFiniteGuard(device), Tally()

    def save(tag="last"):
        guard.check(run.kept)  # before anything is written: no checkpoint after a non-finite loss
        if rank == 0:
            run.save(step, int(n_skipped), tag)

    log = TrainLog(cfg, out, total, step, rank)  # the bar; metrics.jsonl and --report-to on rank 0
    net.train()
    stop = StopSignals().install()
    t_start, last = time.time(), {}  # last: loss terms of the latest step, on the device
    logit_scale = getattr(net.model, "logit_scale", None)
    try:  # the handlers go back whatever ends the loop (an error included)
        while step < total:
            epoch = step // steps_per_epoch
            sampler.set_epoch(epoch, step % steps_per_epoch)
            for batch in loader:
                failed.add(batch.pop("_failed"))  # images replaced by the next row (--check-images sample / none)
                batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
                ctx = SimpleNamespace(step=step, epoch=epoch, total_steps=total, device=device,
                                      generator=step_generator(cfg.seed, step), precision=precision)
                losses, loss, skipped = train_step(net, batch, ctx, opt, scaler, sched, grad_clip=cfg.grad_clip,
                                                   hooks=hooks, forward=ddp, guard=guard, accum=cfg.accum_freq)
                if skipped is not None:
                    n_skipped += skipped  # stays on the device; read at log steps
                step += 1
                log.bar.update(1)
                last = {k: v.detach() for k, v in losses.items()}  # no host sync: read at log steps
                if step % cfg.log_every == 0 or step == total:
                    guard.check(run.kept)  # every rank: the loss is the global batch's, so all stop together
                    log.train(step, epoch, sched.get_last_lr()[0], loss, last, logit_scale, scaler, n_skipped)
                if rank == 0 and cfg.val_every and (step % cfg.val_every == 0 or step == total):
                    log.validation(step, validation(net, validate))
                if cfg.save_every and step % cfg.save_every == 0 and step < total:
                    save()
                if stop.requested(step, cfg.log_every, device):  # SIGINT / SIGTERM, honoured between steps
                    save()
                    log.bar.close()
                    stop.stop(out, step)
                if step >= total or (cfg.stop_at and step >= cfg.stop_at):
                    break
            if cfg.stop_at and step >= cfg.stop_at and step < total:
                save()
                log.bar.close()
                return {"stopped_at": step, "total_steps": total, "checkpoint": str(out / "checkpoints" / "last.pt")}
    finally:
        stop.restore()
        log.close()  # metrics.jsonl, --report-to's runs
    log.bar.close()
    summary = {"steps": step, "total_steps": total, "train_seconds": time.time() - t_start,
               "final_losses": {k: float(v) for k, v in last.items()}, "world_size": world, "precision": precision,
               "device": str(device), "skipped_steps": int(n_skipped),
               "grad_scale": scaler.get_scale() if scaler.is_enabled() else None,
               "bad_rows": list(getattr(train_set, "skipped", [])),  # every row the data check skipped
               "data": run.data, **({"data_changed_on_resume": data_change} if data_change else {}),
               "undecodable_images": trainlog.undecodable_images(failed, world)}  # every rank's, counted together
    if rank == 0 and cfg.val_every:  # every validation of the run, resumed parts included (metrics.jsonl's)
        summary["validation"] = trainlog.validations(out)
    if rank == 0:
        save()
        if export:  # --lora's peft adapter, then merged; model.pt and its .safetensors twin; --export's folder
            summary.update(run_lora(cfg, net.model, out))
            summary.update(models.save_trained(net.model, cfg, out))
    return summary


def run_lora(cfg, model, out: Path | None = None):
    """--lora RANK of every method (issue 59.2). Before training (out None): adapters on --lora-targets, every other
    weight of the model frozen but a SigLIP logit_bias (before the optimizer and the resume, so a checkpoint's
    adapters load back). At the end: the adapters written as a peft adapter in <out>/lora_adapter (checked with
    peft: plumbing/lora.py), then merged at coefficient 1, so model.pt and --export hold the trained function."""
    if not getattr(cfg, "lora", 0):
        return {}
    if out is None:  # --lock-image / --lock-text: no adapters in that tower (LoRA on the other one only)
        keep = ("logit_bias",) if getattr(cfg, "loss", "clip") == "siglip" else ()
        towers = [t for t, locked in (("image", cfg.lock_image), ("text", cfg.lock_text)) if not locked]
        return add_lora(model, cfg.lora, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets.split(","), keep, towers)
    written = lora_files.export_peft(model, adapters(model), out / lora_files.ADAPTER_FOLDER, cfg.backbone,
                                     getattr(cfg, "pretrained", ""))  # checked with peft: one line says what
    merge_lora(model, 1.0)
    return written


def checked_batch(cfg, net, validate) -> int:
    """train's batch settings checked (--batch-size over the processes, --accum-freq, --val-every): this process's
    batch. With several processes, rank 0 says how the global batch is split."""
    rank, world, _ = dist_info()
    if cfg.batch_size % world:
        raise UsageError(f"batch size {cfg.batch_size} is not divisible by {world} ranks")
    local_batch = cfg.batch_size // world
    if local_batch % cfg.accum_freq:
        raise UsageError(f"--accum-freq {cfg.accum_freq} does not divide the batch of {local_batch} per process")
    if cfg.accum_freq > 1 and not isinstance(net, Method):
        raise UsageError(f"--accum-freq: {type(net).__name__} has no features / losses parts (common.Method)")
    if world > 1 and rank == 0:  # the global batch is the flag's; open_clip users think per GPU
        print(f"[train] batch: {cfg.batch_size} global = {world} processes x {local_batch}", file=sys.stderr)
    if cfg.val_every and validate is None:
        raise UsageError("--val-every: this run has no validation set during training (a task sequence evaluates "
                         "every task's test set after each task)")
    return local_batch


def epoch_steps(cfg, train_set, keep_last: bool) -> int:
    """Steps an epoch: whole batches of the training set (keep_last: and its partial last batch)."""
    if len(train_set) < cfg.batch_size:
        raise UsageError(f"training set ({len(train_set)}) smaller than one batch ({cfg.batch_size})")
    if keep_last and (dist_info()[1] > 1 or cfg.accum_freq > 1 or hasattr(train_set, "loader")):
        raise UsageError("--keep-last-batch: one process, without --accum-freq, on a manifest (not shards) only")
    return -(-len(train_set) // cfg.batch_size) if keep_last else len(train_set) // cfg.batch_size


def training_loader(cfg, train_set, collate, local_batch: int, steps_per_epoch: int, device, keep_last: bool):
    """(loader, sampler) of this process's batches: a manifest's seeded, resumable shuffle (ResumableSampler,
    SeededSamples), or webdataset shards each process reads its own of (shards.ShardStream). The sampler's
    set_epoch(epoch, batch) starts an epoch part way in."""
    rank, world, _ = dist_info()
    if hasattr(train_set, "loader"):  # webdataset shards: each process reads its own (shards.ShardStream)
        loader = train_set.loader(local_batch, CountFailures(collate), cfg.seed, rank, world, cfg.workers,
                                  steps_per_epoch, pin_memory=device.type == "cuda")
        return loader, loader.dataset  # set_epoch(epoch, batch) as the sampler's
    sampler = ResumableSampler(len(train_set), local_batch, cfg.seed, True, rank, world, True, keep_last)
    loader = torch.utils.data.DataLoader(
        SeededSamples(train_set, cfg.seed), batch_size=local_batch, sampler=sampler, num_workers=cfg.workers,
        collate_fn=CountFailures(collate), pin_memory=device.type == "cuda", drop_last=not keep_last,
        generator=torch.Generator().manual_seed(cfg.seed), persistent_workers=False)
    return loader, sampler


def optimizer_and_schedule(cfg, net, device, lr_of, schedule, steps_per_epoch: int, total: int):
    """AdamW (make_optimizer), LambdaLR: schedule's multipliers, else --warmup's (< 0: % of the run), then cosine."""
    warmup = cfg.warmup if cfg.warmup >= 0 else round(-cfg.warmup / 100 * total)
    if warmup >= total and not schedule:  # issue 72.5: scaled, not a run spent warming up (42.4 only warned)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            print(f"[train] --warmup {warmup} is not shorter than the run ({total} steps): scaled to "
                  f"{round(total / 10)} (10 % of the run, as --warmup -10) so that the lr reaches --lr; pass a "
                  f"--warmup below {total} to choose another", file=sys.stderr)
        warmup = round(total / 10)
    opt = make_optimizer(cfg, net, device, lr_of)
    multipliers = schedule(opt, steps_per_epoch, total) if schedule else warmup_cosine(warmup, total)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, multipliers)


def prepare_model(cfg, net, device):
    """train's model set-up, in order: onto the device, --grad-checkpointing, --lock-image / --lock-text
    (lock_towers), --lora (run_lora), --torchcompile (models.compile_towers: in place, checkpoints keep their names)."""
    net.to(device)
    if cfg.grad_checkpointing:
        net.model.set_grad_checkpointing(True)
    lock_towers(cfg, net.model)
    run_lora(cfg, net.model)
    if getattr(cfg, "torchcompile", False):
        models.compile_towers(net.model)


def lock_towers(cfg, model):
    """--lock-image / --lock-text: open_clip's own lock_image_tower / lock_text_tower (requires_grad off, but the
    last --lock-image-unlocked-groups / --lock-text-unlocked-layers); frozen parameters never reach AdamW."""
    if not (cfg.lock_image or cfg.lock_text):
        return
    if not hasattr(model, "lock_image_tower"):
        raise UsageError("--lock-image / --lock-text: this run trains no CLIP tower (DNS learns maps over frozen "
                         "features), so there is nothing to lock")
    if cfg.lock_image:
        model.lock_image_tower(unlocked_groups=cfg.lock_image_unlocked_groups)
    if cfg.lock_text:
        model.lock_text_tower(unlocked_layers=cfg.lock_text_unlocked_layers)


def validation(net, validate: Callable[[nn.Module], dict]) -> dict:
    """validate(net.model) without touching the run: no gradient, and the random generators' states and every
    module's train/eval mode as they were (evaluate() switches to eval mode; a DataLoader draws a seed)."""
    modes, rng = [(m, m.training) for m in net.modules()], _rng_state()
    try:
        with torch.no_grad():
            return validate(net.model)
    finally:
        _set_rng_state(rng)
        for m, mode in modes:
            m.training = mode


def write_results(out, results: dict, cfg=None):
    """<out>/results.json, atomically, strict JSON (plumbing.results), with cfg's settings ('switches': off their
    defaults). A run whose --export failed ends here, its results written, with one message (exit 1)."""
    if cfg is not None:
        results = {**results, "config": dataclasses.asdict(cfg), "switches": {
            f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != f.default}}
    written = atomic_write(Path(out) / "results.json", to_json(results))
    models.export_failure(results, written)
    return written


# =============================================================================
# 5. Continual driver (shared by cclip.py and dns.py)
# =============================================================================
@dataclass(frozen=True)
class Task:
    name: str
    train: str  # manifest path
    test: str   # manifest path (the train manifest when none is given)


def parse_tasks(spec: str, data_root="data", world: models.LabWorld | None = None) -> list[Task]:
    """'name=train.jsonl[:test.jsonl],...' in order, 'synthetic' for the lab's four continual domains (lab/world.py
    TASK_DOMAINS; world: the lab's, models.LabWorld), or 'mtil-order1' / 'mtil-order2' (ZSCL's, protocols/mtil.py)."""
    if mtil.order_of(spec):  # training manifests written once; each test set is eval.py's mtil:<Dataset>
        return [Task(*t) for t in mtil.sequence(spec, data_root)]
    if spec == "synthetic":
        manifests = models.lab_world(world, "--tasks synthetic").task_manifests(data_root)
        return [Task(d, str(tr), str(te)) for d, tr, te in manifests]
    tasks = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, eq, paths = part.partition("=")
        if not eq or not paths:
            raise UsageError(f"task {part!r}: expected name=train_manifest[:test_manifest]")
        train_p, _, test_p = paths.partition(":")
        for p in (train_p, test_p or train_p):
            if not Path(p).exists():
                raise DataError(f"task {name}: manifest not found: {p}")
        tasks.append(Task(name, train_p, test_p or train_p))
    if len({t.name for t in tasks}) != len(tasks):
        raise UsageError("task names must be unique")
    return tasks


def run_continual(out, tasks: Sequence[Task], learn_task: Callable, evaluate: Callable, save_state: Callable,
                  load_state: Callable, resume: bool = False, log=print, first_row: dict | None = None) -> dict:
    """Trains the tasks in order and keeps, per metric, the matrix R[i][j] = score on task j after learning tasks
    1..i (row 0: before any training), plus per-row scalars such as zero-shot accuracy.
    learn_task(i, task, task_out, resume) trains task i in place and returns common.train's summary (one with
    'stopped_at' ends the sequence early); evaluate() -> {"per_task": {metric: [score per task]}, "scalars":
    {name: value}}; save_state(path) / load_state(path) store / restore the method's state at a task boundary.
    Everything is written after each task: a crash loses at most the task in flight, which resumes from its
    last checkpoint. first_row: row 0 when the caller has it (sequences from the same weights: evaluate once)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state_file, boundary = out / "continual.json", out / "boundary.pt"
    rec = {"tasks": [dataclasses.asdict(t) for t in tasks], "rows": [], "scalars": [], "seconds": [], "steps": []}
    if resume and state_file.exists():
        rec = from_json(state_file.read_text(), restore=True)  # NaN (a task without classes) back
        if [t["name"] for t in rec["tasks"]] != [t.name for t in tasks]:
            raise RunError(f"{state_file} was written for another task sequence; continue with the same --tasks, "
                           f"or start afresh with --overwrite")
        if len(rec["rows"]) > 1:
            load_state(boundary)
        log(f"resuming the task sequence after {len(rec['rows']) - 1} finished task(s)")

    def record(row, seconds, steps):
        for key, value in zip(("rows", "scalars", "seconds", "steps"),
                              (row["per_task"], row.get("scalars", {}), seconds, steps)):
            rec[key].append(value)
        atomic_write(state_file, to_json(rec))

    if not rec["rows"]:
        record(first_row or evaluate(), 0.0, 0)
    for i, task in enumerate(tasks):
        if i + 1 < len(rec["rows"]):
            continue
        t0 = time.time()
        task_out = out / f"task{i + 1}-{task.name}"
        task_resume = resume and latest_checkpoint(task_out) is not None
        if not task_resume and task_out.exists():  # the task starts again from its beginning: no leftovers
            runfolder.clear_run(task_out)
        summary = learn_task(i, task, task_out, task_resume) or {}
        seconds = time.time() - t0
        if "stopped_at" in summary:  # --stop-at inside this task: nothing recorded, --resume latest goes on
            log(f"task {i + 1} ({task.name}) stopped at step {summary['stopped_at']}; continue with --resume latest")
            return {"stopped_at": summary["stopped_at"], "task": i + 1}
        save_state(boundary)
        record(evaluate(), seconds, summary.get("steps", 0))
        shutil.rmtree(task_out / "checkpoints", ignore_errors=True)  # recorded: boundary.pt now holds its end state
        log(f"task {i + 1}/{len(tasks)} ({task.name}) learned in {seconds:.0f}s")
    return summarize_continual(rec)


def summarize_continual(rec) -> dict:
    """Matrices and continual_metrics per metric; PD for every scalar (before training minus at the end)."""
    metrics = list(rec["rows"][0])
    matrices = {m: [row[m] for row in rec["rows"]] for m in metrics}
    summary = {"matrices": matrices, "metrics": {m: continual_metrics(R) for m, R in matrices.items()},
               "scalars": rec["scalars"], "seconds_per_task": rec["seconds"][1:], "steps_per_task": rec["steps"][1:]}
    first, last = rec["scalars"][0], rec["scalars"][-1]
    summary["pd"] = {k: first[k] - last[k] for k in first if k in last}
    summary.update(mtil.summary([t["test"] for t in rec.get("tasks", ())], matrices))  # MTIL: Transfer, Average, Last
    return summary


# =============================================================================
# 6. Before a run: --train-data auto, the device, the preflight
# =============================================================================


def resolve_auto(cfg, field_name: str, paper: str, needs: Sequence, what: str, after: str = ""):
    """cfg with `--<field> auto` made concrete: `paper` when every path in `needs` exists (paper=None: the
    paper's data has no layout here); otherwise 'synthetic' (the lab's world) with --backbone tiny, and with a
    real backbone a RunError saying what is missing, where it goes and how to smoke-test instead (+ `after`)."""
    if getattr(cfg, field_name) != "auto":
        return cfg
    flag = "--" + field_name.replace("_", "-")
    missing = [str(p) for p in needs if not Path(p).exists()]
    if paper is not None and not missing:
        value = paper
    elif cfg.backbone == "tiny":
        value = "synthetic"
    else:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        where = (f"is not under --data-root {cfg.data_root}; missing: {shown}. Put it there as "
                 f"README.md's 'Real data' layout shows (or point --data-root at it), pass" if paper is not None
                 else "has no layout in this repository; pass")
        raise RunError(f"{flag} auto: the paper's training data ({what}) {where} {flag} with your own data, or run "
                       f"a smoke test on the lab's synthetic world with {flag} synthetic{after}.")
    print(f"[data] {flag} auto -> {value}", file=sys.stderr)
    return dataclasses.replace(cfg, **{field_name: value})


def check_device(cfg) -> str:
    """The precision the run will use, refusing a device that is not there (fp16 on CPU stays allowed, with
    resolve_precision's warning)."""
    dev = cfg.device
    if dev.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"--device {dev}: no CUDA device is visible; use --device cpu (or auto)")
        index = torch.device(dev).index
        if index is not None and index >= torch.cuda.device_count():
            raise UsageError(f"--device {dev}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev not in ("auto", "cpu"):  # meta, mps, xpu, ...: torch knows them, this repository does not run there
        raise UsageError(f"--device {dev}: expected auto, cpu, cuda or cuda:N")
    device = "cuda" if dev == "auto" and torch.cuda.is_available() else ("cpu" if dev == "auto" else dev)
    return resolve_precision(getattr(cfg, "precision", "auto"), device)


def preflight(cfg, manifests: Sequence = (), continual: bool = False, **dataset_kw):
    """Everything cheap, before any model is loaded or evaluated: device and precision, batch size vs world
    size, every training manifest (each row, as training will check it, and at least one batch of rows), then
    the --out folder (writable, lock, an old run there, --resume's settings). continual=True: --out holds a task
    sequence (cclip.py, dns.py); its config.json is written here, since common.train writes per task."""
    check_device(cfg)
    if getattr(cfg, "export", ""):
        models.check_export(cfg.export, out=cfg.out)
    reporting.check(cfg.report_to)  # --report-to's packages are installed
    if cfg.val_every and continual:
        raise UsageError("--val-every: a task sequence has no validation set during training; it evaluates every "
                         "task's test set after each task")
    world = world_size()
    if cfg.batch_size % world:
        raise UsageError(f"--batch-size {cfg.batch_size} is not divisible by {world} processes")
    if cfg.batch_size == 1:
        warn_once("warning: --batch-size 1: a contrastive loss over one pair is 0 (an image's only candidate is "
                  "its own caption), so nothing is learned; use a batch of at least 2")
    if world > 1:  # the processes split the row check's decoding between them (image_problems)
        init_distributed(cfg.device)
    for m in manifests:
        ds = training_set(cfg, m, **dataset_kw)
        if len(ds) < cfg.batch_size:
            raise UsageError(f"{m}: {len(ds)} usable rows, fewer than one batch (--batch-size {cfg.batch_size})")
    if int(os.environ.get("RANK", "0")) == 0:  # before init_distributed: torchrun's environment
        overrides = runfolder.start_run(cfg, Path(cfg.out), continual=continual)
        if continual:
            runfolder.write_config(cfg, Path(cfg.out), overrides)

