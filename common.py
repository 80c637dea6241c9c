"""Shared plumbing for the four method files: models, the synthetic world, data,
the AMP/DDP training loop, checkpoints, the continual-task driver and the
shared metrics.

Nothing in here is specific to one paper. Every method file (erclip.py,
m2mix.py, cclip.py, dns.py) imports what it needs from this module and holds
only what differs from plain CLIP fine-tuning.

Sections, in order:
  1. config            a dataclass + argparse builder every method extends
  2. shared math       clip_loss, encode_text (trimmed), retrieval_metrics,
                       zero-shot classifier / accuracy, continual_metrics
  3. models            load_model (OpenAI names, open_clip tags, local files,
                       the tiny synthetic backbone), checkpoint export
  4. synthetic world   a procedural image/caption world + the tiny backbone's
                       contrastive pretraining on its short captions
  5. data              manifest dataset with a validating pre-pass, loaders
  6. distributed       torchrun detection, feature gathering with gradient
  7. training loop     AdamW groups, warm-up + cosine, one AMP path, clipping,
                       logit-scale clamp, atomic checkpoints, exact resume
  8. continual driver  task sequence, score matrices, resume at boundaries

Runbook: this module is not run directly; see README.md.
"""
from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import functools
import hashlib
import io
import json
import logging
import math
import os
import random
import socket
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np
import open_clip
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image, ImageDraw

log = logging.getLogger("clipft")

CACHE_DIR = Path(os.environ.get("CLIPFT_CACHE", Path.home() / ".cache" / "clipft"))
LOGIT_SCALE_MAX = math.log(100.0)  # CLIP's clamp: temperature never below 0.01


# =============================================================================
# 1. Config
# =============================================================================
def arg(default, help: str, **kw):
    """A dataclass field that carries its argparse help text."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class Config:
    """Settings shared by every method. Method files subclass it and override
    the defaults their paper prescribes (each with its paper location)."""
    # model
    backbone: str = arg("tiny", "OpenAI name (ViT-B/16), open_clip name (ViT-B-16) or 'tiny'")
    pretrained: str = arg("", "weights: '' = default (openai, or 'synthetic' for tiny), an open_clip tag, or a checkpoint path")
    cache_dir: str = arg("", "where open_clip looks for / stores downloaded weights")
    # data
    data_root: str = arg("data", "root of every benchmark folder (see README)")
    train_data: str = arg("synthetic", "training manifest (JSONL/CSV) or 'synthetic'")
    skip_bad: bool = arg(False, "skip and count bad rows/images instead of stopping")
    workers: int = arg(2, "DataLoader workers")
    # optimisation
    epochs: int = arg(1, "epochs over the training set")
    steps: int = arg(0, "stop after this many steps (0: epochs decide)")
    batch_size: int = arg(64, "global batch size (split across ranks)")
    lr: float = arg(1e-5, "peak learning rate")
    wd: float = arg(0.1, "AdamW weight decay (not on gains, biases, embeddings, logit_scale)")
    beta1: float = arg(0.9, "AdamW beta1")
    beta2: float = arg(0.98, "AdamW beta2")
    eps: float = arg(1e-6, "AdamW eps")
    warmup: int = arg(0, "linear warm-up steps; negative = that percentage of all steps")
    grad_clip: float = arg(0.0, "clip the global gradient norm (0: off)")
    precision: str = arg("auto", "auto (fp16 on CUDA, fp32 on CPU) | fp16 | bf16 | fp32")
    grad_checkpointing: bool = arg(False, "trade compute for memory in both towers")
    label_smoothing: float = arg(0.0, "label smoothing of the contrastive cross-entropies")
    # bookkeeping
    out: str = arg("runs/default", "output folder (config, metrics.jsonl, checkpoints, results)")
    seed: int = arg(0, "seed of everything random")
    device: str = arg("auto", "auto | cpu | cuda | cuda:N")
    log_every: int = arg(10, "steps between metrics.jsonl lines")
    save_every: int = arg(200, "steps between checkpoints (always one at the end)")
    resume: str = arg("", "'latest' or a checkpoint path to continue from")
    stop_at: int = arg(0, "ours: leave after this many steps as if interrupted (tests resume)")
    find_unused: bool = arg(False, "DDP find_unused_parameters")


def parse_config(cls, argv=None, **overrides):
    """argparse built from the dataclass fields; returns a frozen cfg."""
    p = argparse.ArgumentParser(description=(sys.modules[cls.__module__].__doc__ or "").split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(cls):
        default = overrides.get(f.name, f.default if f.default is not dataclasses.MISSING else f.default_factory())
        name = "--" + f.name.replace("_", "-")
        help_ = f.metadata.get("help", "")
        if f.type in ("bool", bool):
            p.add_argument(name, action=argparse.BooleanOptionalAction, default=default, help=help_)
        else:
            typ = {"int": int, "float": float, "str": str}.get(f.type if isinstance(f.type, str) else f.type.__name__, str)
            p.add_argument(name, type=typ, default=default, help=help_, choices=f.metadata.get("choices"))
    return cls(**vars(p.parse_args(argv)))


# =============================================================================
# 2. Shared math
# =============================================================================
def clip_loss(img, txt, logit_scale, label_smoothing: float = 0.0):
    """CLIP's symmetric InfoNCE (Radford et al. 2021, Fig. 3):
        L = 1/2 [ CE(s img txt^T, I) + CE(s txt img^T, I) ]
    img, txt: (B, D) L2-normalised; logit_scale: the multiplier s = 1/tau."""
    logits = logit_scale * img.float() @ txt.float().t()  # (B, B)
    labels = torch.arange(len(img), device=img.device)
    return 0.5 * (F.cross_entropy(logits, labels, label_smoothing=label_smoothing)
                  + F.cross_entropy(logits.t(), labels, label_smoothing=label_smoothing))


def text_tower(model):
    """The modules of the text encoder, for CLIP (flat) and CustomTextCLIP (model.text)."""
    return model.text if hasattr(model, "text") else model


def encode_text(model, tokens, normalize: bool = True):
    """open_clip text encoding with the padding columns trimmed.

    Columns beyond the longest sequence of the batch are dropped before the
    transformer. Under causal attention no position attends to a later one,
    so the pooled end-token feature is exactly model.encode_text(tokens); the
    cost falls from O(context) to O(longest caption). Models without a causal
    mask (or non-argmax pooling) take the untrimmed path."""
    t = text_tower(model)
    causal = getattr(t, "attn_mask", None) is not None
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
    t = text_tower(model)
    p = getattr(t, "text_projection", None)
    if isinstance(p, nn.Linear):
        return p.out_features
    if p is not None:
        return p.shape[1]
    return t.transformer.width


class _TrimmedTextEncoder:
    """Gives open_clip's build_zero_shot_classifier our trimmed encode_text."""
    def __init__(self, model):
        self.model = model

    def encode_text(self, tokens, normalize=False):
        with autocast(tokens.device):
            return encode_text(self.model, tokens, normalize=normalize).float()


@torch.no_grad()
def zero_shot_classifier(model, tokenizer, classnames, templates, device=None, classes_per_batch=50):
    """CLIP's prompt ensemble: per class, mean of the normalised template
    embeddings, renormalised. Returns (D, C). Reuses open_clip's builder with
    the trimmed text encoding."""
    device = device or next(model.parameters()).device
    return open_clip.build_zero_shot_classifier(
        _TrimmedTextEncoder(model), tokenizer, list(classnames), list(templates),
        num_classes_per_batch=classes_per_batch, device=device).float()


@torch.no_grad()
def zero_shot_accuracy(img, classifier, labels, ks=(1, 5)):
    """Top-k accuracy (percent) of logits img @ classifier. img (N, D)
    normalised, classifier (D, C), labels (N,). A tie with the gold class
    counts against it."""
    logits = img.float() @ classifier.float().to(img.device)  # (N, C)
    gold = logits.gather(1, labels.view(-1, 1).to(img.device))
    n_better = (logits >= gold).sum(1) - 1
    return {f"top{k}": 100.0 * (n_better < k).float().mean().item() for k in ks if k <= logits.shape[1]}


@torch.no_grad()
def retrieval_metrics(img, txt, text_to_image, ks=(1, 5, 10), max_chunk_scores: int = 2 ** 24):
    """Recall@k in percent for both directions.

    img (N, D), txt (M, D) normalised; text_to_image (M,) = index of text j's
    image (several captions per image allowed). Image-to-text: a hit when any
    of the image's captions ranks in the top k; text-to-image: when the text's
    image does. A candidate scoring equal to the best gold counts as ranked
    above it, so ties never inflate recall. Rows are processed in chunks of
    at most max_chunk_scores scores (64 MiB of float32), so 5k x 25k never
    needs the dense matrix."""
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
    """Standard continual-learning summaries of a (T+1) x T score matrix.
    R[i][j] = score on task j after training tasks 1..i; row 0 = before any
    training. With tasks numbered 1..T (column j-1 holds task j):
      last       = mean_j R[T][j]
      avg        = mean_{i=1..T} mean_{j<=i} R[i][j]
      bwt        = mean_{j<T} (R[T][j] - R[j][j])
      forgetting = mean_{j<T} (max_{0<=i<T} R[i][j] - R[T][j])   (row 0 included)
    """
    R = np.asarray(R, dtype=float)
    T = R.shape[1]
    if R.shape[0] != T + 1:
        raise ValueError(f"continual_metrics needs a (T+1) x T matrix, got {R.shape}")
    out = {"last": R[T].mean(),
           "avg": np.mean([R[i, :i].mean() for i in range(1, T + 1)])}
    if T > 1:
        out["bwt"] = np.mean([R[T, j - 1] - R[j, j - 1] for j in range(1, T)])
        out["forgetting"] = np.mean([R[:T, j - 1].max() - R[T, j - 1] for j in range(1, T)])
    else:
        out["bwt"] = out["forgetting"] = 0.0
    return {k: float(v) for k, v in out.items()}


# =============================================================================
# 3. Models
# =============================================================================
OPENAI_NAMES = {  # the papers' spelling -> open_clip's
    "RN50": "RN50", "RN101": "RN101", "RN50x4": "RN50x4", "RN50x16": "RN50x16", "RN50x64": "RN50x64",
    "ViT-B/32": "ViT-B-32", "ViT-B/16": "ViT-B-16", "ViT-L/14": "ViT-L-14", "ViT-L/14@336px": "ViT-L-14-336",
}
TINY_NAME = "clipft-tiny"
TINY_CFG = {  # ours: a CPU-sized CLIP whose context (24) truncates long captions like CLIP's 77
    "embed_dim": 128, "quick_gelu": False,
    "vision_cfg": {"image_size": 48, "layers": 4, "width": 128, "patch_size": 8, "head_width": 32},
    "text_cfg": {"context_length": 24, "vocab_size": 49408, "width": 128, "heads": 4, "layers": 4},
}


def _register_tiny():
    path = CACHE_DIR / "configs" / f"{TINY_NAME}.json"
    if TINY_NAME not in open_clip.list_models():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or json.loads(path.read_text()) != TINY_CFG:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(TINY_CFG))
            os.replace(tmp, path)
        open_clip.add_model_config(path)


def resolve_backbone(name: str) -> str:
    """'ViT-B/16' -> 'ViT-B-16'; 'tiny' -> the registered tiny config."""
    if name == "tiny":
        _register_tiny()
        return TINY_NAME
    name = OPENAI_NAMES.get(name, name)
    if name not in open_clip.list_models():
        raise ValueError(f"unknown backbone {name!r}; use an OpenAI name ({', '.join(OPENAI_NAMES)}), "
                         f"'tiny', or one of open_clip.list_models()")
    return name


def _hub_reachable(timeout=3.0) -> bool:
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _weights_cached(name, tag, cache_dir) -> bool:
    cfg = open_clip.get_pretrained_cfg(name, tag)
    hub = cfg.get("hf_hub", "")
    if hub:
        from huggingface_hub import try_to_load_from_cache
        repo_id = "/".join(hub.strip("/").split("/")[:2])
        for fname in ("open_clip_pytorch_model.bin", "open_clip_model.safetensors"):
            hit = try_to_load_from_cache(repo_id, fname, cache_dir=cache_dir or None)
            if isinstance(hit, str):
                return True
    url = cfg.get("url", "")
    if url:
        root = Path(cache_dir or Path.home() / ".cache" / "clip")
        return (root / os.path.basename(url)).exists()
    return False


def load_model(backbone: str = "tiny", pretrained: str = "", device="cpu", cache_dir: str = "",
               quick_gelu: bool | None = None):
    """Returns (model, train_transform, eval_transform, tokenizer).

    backbone: OpenAI spelling ('ViT-B/16'), open_clip name ('ViT-B-16') or 'tiny'.
    pretrained: '' (OpenAI's weights; the world-pretrained weights for 'tiny'),
      an open_clip tag ('openai', 'laion2b_s34b_b88k', ...), a checkpoint path,
      or 'random' (explicitly untrained).
    QuickGELU is matched to the weights: OpenAI's were trained with it and
    open_clip's plain configs silently give wrong features with them, so it is
    taken from the tag's config, from our checkpoint sidecar, or forced for
    OpenAI-spelled backbones loading a raw file. Never falls back to random
    weights: a download that cannot happen fails at once and says why."""
    name = resolve_backbone(backbone)
    if name == TINY_NAME and pretrained in ("", "synthetic"):
        pretrained = str(pretrain_tiny())
    pretrained = pretrained or "openai"
    kwargs = dict(device=device, cache_dir=cache_dir or None)
    if pretrained == "random":
        model, train_tf, eval_tf = open_clip.create_model_and_transforms(name, pretrained=None, **kwargs)
        return model, train_tf, eval_tf, open_clip.get_tokenizer(name)
    if os.path.isfile(pretrained):
        meta = read_sidecar(pretrained)
        if meta and meta.get("model") not in (None, name):
            raise ValueError(f"{pretrained} holds a {meta['model']} model, not {name}")
        if quick_gelu is None:
            quick_gelu = meta.get("quick_gelu") if meta else backbone in OPENAI_NAMES
    else:
        tag_cfg = open_clip.get_pretrained_cfg(name, pretrained)
        if not tag_cfg:
            raise ValueError(f"{pretrained!r} is neither a file nor an open_clip tag of {name} "
                             f"(tags: {open_clip.list_pretrained_tags_by_model(name)})")
        tag_qg = bool(tag_cfg.get("quick_gelu", False))
        if quick_gelu is not None and quick_gelu != tag_qg:
            raise ValueError(f"{name}/{pretrained} was trained with quick_gelu={tag_qg}; refusing {quick_gelu}")
        quick_gelu = tag_qg
        if os.environ.get("HF_HUB_OFFLINE") == "1" or not (_weights_cached(name, pretrained, cache_dir)
                                                           or _hub_reachable()):
            raise RuntimeError(
                f"cannot get the {name} weights '{pretrained}': they are not in the cache "
                f"({cache_dir or 'the Hugging Face / open_clip default cache'}) and the hub is unreachable. "
                f"Download them elsewhere and pass --pretrained /path/to/file.pt (or .bin/.safetensors), "
                f"or --cache-dir DIR holding the hub cache.")
    model, train_tf, eval_tf = open_clip.create_model_and_transforms(
        name, pretrained=pretrained, force_quick_gelu=bool(quick_gelu), **kwargs)
    model.quick_gelu = bool(quick_gelu)  # remembered for the checkpoint sidecar
    return model, train_tf, eval_tf, open_clip.get_tokenizer(name)


def read_sidecar(path):
    p = Path(str(path) + ".json")
    return json.loads(p.read_text()) if p.exists() else {}


def _atomic_save(obj, path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_model(model, path, backbone: str, source: str = ""):
    """A plain open_clip state_dict (loadable by
    open_clip.create_model_and_transforms(name, pretrained=path)) plus a JSON
    sidecar `path.json` with what is needed to rebuild it."""
    path = Path(path)
    sd = {k.removeprefix("module."): v.detach().cpu() for k, v in model.state_dict().items()}
    bad = [k for k in sd if "lora" in k.lower() or "parametrizations" in k]
    if bad:
        raise ValueError(f"save_model: adapter keys left in the state_dict ({bad[:3]}...); merge first")
    _atomic_save(sd, path)
    name = resolve_backbone(backbone)
    pp = getattr(model.visual, "preprocess_cfg", {})
    meta = {"model": name, "backbone": backbone, "source_weights": source,
            "quick_gelu": bool(getattr(model, "quick_gelu", False)),
            "context_length": int(text_tower(model).context_length),
            "preprocess": {k: (list(v) if isinstance(v, tuple) else v) for k, v in pp.items()},
            "open_clip": open_clip.__version__, "torch": torch.__version__}
    Path(str(path) + ".json").write_text(json.dumps(meta, indent=1))
    return path


# =============================================================================
# 4. The synthetic world
# =============================================================================
SHAPES = ("circle", "square", "triangle", "diamond", "cross")
COLORS = {"red": (215, 38, 38), "green": (34, 160, 60), "blue": (40, 80, 220),
          "yellow": (235, 205, 30), "purple": (140, 55, 185), "orange": (240, 135, 20)}
POSITIONS = ("top left", "top", "top right", "left", "center", "right", "bottom left", "bottom", "bottom right")
# Each domain: background, drawing style and the phrase its captions use.
DOMAINS = {
    "plain":   dict(bg=(235, 235, 235), pattern="none", style="fill", phrase="a photo of"),
    "dark":    dict(bg=(30, 30, 40), pattern="none", style="fill", phrase="a dark picture of"),
    "stripes": dict(bg=(200, 220, 240), pattern="stripes", style="fill", phrase="a striped scene with"),
    "outline": dict(bg=(245, 240, 225), pattern="none", style="outline", phrase="a line drawing of"),
    "noise":   dict(bg=(150, 150, 150), pattern="noise", style="fill", phrase="a grainy image of"),
    "checker": dict(bg=(210, 210, 210), pattern="checker", style="fill", phrase="a tiled picture of"),
}
PRETRAIN_DOMAINS = ("plain", "dark", "stripes", "outline", "noise")
UNSEEN_DOMAIN = "checker"
CLASS_TEMPLATES = ("a photo of a {}.", "a picture of a {}.", "a {} shape.", "an image with a {}.")
COLOR_TEMPLATES = ("a photo of something {}.", "a {} object.", "a picture of a {} thing.")


def world_sample(rng: random.Random, domain: str):
    """One scene: 1-4 objects on distinct grid cells, and its texts."""
    n = rng.choice((1, 2, 2, 3, 3, 4))
    cells = rng.sample(range(9), n)
    objs = [dict(shape=rng.choice(SHAPES), color=rng.choice(list(COLORS)),
                 size=rng.choice(("small", "large")), cell=c) for c in cells]
    main = max(objs, key=lambda o: (o["size"] == "large", -objs.index(o)))  # first large one, else first
    d = DOMAINS[domain]
    short = f"{d['phrase']} a {main['size']} {main['color']} {main['shape']} at the {POSITIONS[main['cell']]}."
    sentences = [f"There is a {o['size']} {o['color']} {o['shape']} at the {POSITIONS[o['cell']]}."
                 for o in sorted(objs, key=lambda o: o["cell"])]
    sentences.append(f"The picture is {d['phrase']} {n} object{'s' if n > 1 else ''}.")
    return dict(objects=objs, domain=domain, caption=short, long_caption=" ".join(sentences),
                labels=dict(shape=SHAPES.index(main["shape"]), color=list(COLORS).index(main["color"])))


def render(scene, size: int = 48, seed: int = 0) -> Image.Image:
    d = DOMAINS[scene["domain"]]
    img = Image.new("RGB", (size, size), d["bg"])
    draw = ImageDraw.Draw(img)
    if d["pattern"] == "stripes":
        for x in range(0, size, 6):
            draw.rectangle([x, 0, x + 2, size], fill=(170, 190, 215))
    elif d["pattern"] == "checker":
        for x in range(0, size, 8):
            for y in range(0, size, 8):
                if (x + y) // 8 % 2:
                    draw.rectangle([x, y, x + 7, y + 7], fill=(170, 170, 170))
    cell = size / 3
    for o in scene["objects"]:
        cx, cy = (o["cell"] % 3 + 0.5) * cell, (o["cell"] // 3 + 0.5) * cell
        r = cell * (0.47 if o["size"] == "large" else 0.3)
        col = COLORS[o["color"]]
        kw = dict(fill=col) if d["style"] == "fill" else dict(outline=col, width=2)
        box = [cx - r, cy - r, cx + r, cy + r]
        if o["shape"] == "circle":
            draw.ellipse(box, **kw)
        elif o["shape"] == "square":
            draw.rectangle(box, **kw)
        elif o["shape"] == "triangle":
            draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], **kw)
        elif o["shape"] == "diamond":
            draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], **kw)
        else:  # cross
            w = r / 2.5
            draw.rectangle([cx - r, cy - w, cx + r, cy + w], fill=col)
            draw.rectangle([cx - w, cy - r, cx + w, cy + r], fill=col)
    if d["pattern"] == "noise":
        arr = np.asarray(img).astype(np.int16)
        arr = arr + np.random.default_rng(seed).integers(-40, 41, arr.shape)
        img = Image.fromarray(arr.clip(0, 255).astype(np.uint8))
    return img


def world_split(domains: Sequence[str], n: int, seed: int):
    """n deterministic scenes drawn evenly from the given domains."""
    rng = random.Random(f"clipft-world-{seed}")
    return [world_sample(rng, domains[i % len(domains)]) for i in range(n)]


# name -> (domains, size, seed). Continual tasks use the caption phrase and
# background of one domain each; 'unseen' is a domain no split trains on.
SYNTHETIC_SPLITS = {
    "train": (PRETRAIN_DOMAINS, 2000, 1), "test": (PRETRAIN_DOMAINS, 500, 2),
    "unseen": ((UNSEEN_DOMAIN,), 300, 3),
    **{f"task-{d}": ((d,), 600, 10 + i) for i, d in enumerate(PRETRAIN_DOMAINS[:4])},
    **{f"task-{d}-test": ((d,), 200, 20 + i) for i, d in enumerate(PRETRAIN_DOMAINS[:4])},
}


def synthetic_manifest(split: str, data_root="data", n: int | None = None) -> Path:
    """Writes (once) a split of the synthetic world as PNG files plus a JSONL
    manifest under data_root/synthetic/, and returns the manifest path. The
    demos and tests read it back through ManifestDataset, like real data."""
    if split not in SYNTHETIC_SPLITS:
        raise ValueError(f"unknown synthetic split {split!r}; known: {', '.join(SYNTHETIC_SPLITS)}")
    domains, size, seed = SYNTHETIC_SPLITS[split]
    size = n or size
    root = Path(data_root) / "synthetic"
    name = split if n is None else f"{split}-{n}"
    manifest = root / f"{name}.jsonl"
    if manifest.exists():
        return manifest
    (root / name).mkdir(parents=True, exist_ok=True)
    lines = []
    for i, s in enumerate(world_split(domains, size, seed)):
        rel = f"{name}/{i:05d}.png"
        render(s, seed=seed * 100003 + i).save(root / rel)
        lines.append(json.dumps({"image": rel, "caption": s["caption"], "long_caption": s["long_caption"],
                                 "domain": s["domain"], "shape": s["labels"]["shape"],
                                 "color": s["labels"]["color"]}))
    tmp = manifest.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, manifest)
    return manifest


def synthetic_label_sets():
    """Zero-shot label sets of the world: name -> (classnames, templates, manifest column)."""
    return {"shape": (list(SHAPES), list(CLASS_TEMPLATES), "shape"),
            "color": (list(COLORS), list(COLOR_TEMPLATES), "color")}


class _SceneSet(torch.utils.data.Dataset):
    """In-memory scenes for the tiny backbone's pretraining (short captions only)."""
    def __init__(self, scenes, transform, tokenizer, seed):
        self.scenes, self.transform, self.tokenizer, self.seed = scenes, transform, tokenizer, seed

    def __len__(self):
        return len(self.scenes)

    def __getitem__(self, i):
        s = self.scenes[i]
        return {"image": self.transform(render(s, seed=self.seed + i)), "caption": s["caption"]}


TINY_PRETRAIN = dict(n=10000, epochs=5, batch=128, lr=1e-3, wd=0.1, seed=0, version=3)  # version: bump when the world changes


def pretrain_tiny(force: bool = False) -> Path:
    """The tiny backbone's 'pretrained' weights: contrastive training from
    scratch on the world's SHORT captions only (CLIP's situation: short
    alt-text pretraining, then asked about long captions). Deterministic,
    cached in CLIPFT_CACHE after the first run (about 3 minutes on 2 cores)."""
    key = hashlib.sha1(json.dumps([TINY_CFG, TINY_PRETRAIN], sort_keys=True).encode()).hexdigest()[:10]
    path = CACHE_DIR / f"tiny-synthetic-{key}.pt"
    if path.exists() and not force:
        return path
    _register_tiny()
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    import fcntl  # one process pretrains; others (parallel tests, ranks) wait for its file
    with open(CACHE_DIR / f"{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists() and not force:
            return path
        return _pretrain_tiny(path, key)


def _pretrain_tiny(path: Path, key: str) -> Path:
    t0 = time.time()
    print(f"[clipft] pretraining the tiny backbone on the synthetic world's short captions -> {path}",
          file=sys.stderr)
    torch.manual_seed(TINY_PRETRAIN["seed"])
    model, train_tf, _ = open_clip.create_model_and_transforms(TINY_NAME, pretrained=None)
    tok = open_clip.get_tokenizer(TINY_NAME)
    scenes = world_split(PRETRAIN_DOMAINS, TINY_PRETRAIN["n"], seed=100)
    cfg = Config(epochs=TINY_PRETRAIN["epochs"], batch_size=TINY_PRETRAIN["batch"], lr=TINY_PRETRAIN["lr"],
                 wd=TINY_PRETRAIN["wd"], warmup=-5, grad_clip=1.0, precision="fp32", workers=0,
                 out=str(CACHE_DIR / f"tiny-pretrain-{key}"), save_every=0, log_every=50, device="cpu",
                 beta2=0.98)
    net = ClipFineTune(model)
    train(cfg, net, _SceneSet(scenes, train_tf, tok, seed=100), Collate(tok), export=False)
    model.quick_gelu = False
    save_model(model, path, "tiny", source=f"synthetic world pretraining {TINY_PRETRAIN}")
    print(f"[clipft] tiny backbone pretrained in {time.time() - t0:.0f}s", file=sys.stderr)
    return path


# =============================================================================
# 5. Data
# =============================================================================
IMAGE_KEYS = ("image", "filepath", "image_path", "file_name", "img")
CAPTION_KEYS = ("caption", "title", "text")


class DataError(ValueError):
    pass


def read_manifest(path) -> list[dict]:
    """Rows of a JSONL or CSV/TSV manifest (separator detected)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"manifest not found: {path}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not valid UTF-8 ({e.reason})") from None
    if path.suffix in (".jsonl", ".json") or text.lstrip().startswith("{"):
        rows = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(dict(json.loads(line), _line=i))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{i}: bad JSON ({e.msg})") from None
        return rows
    first = text.splitlines()[0] if text else ""
    try:
        sep = csv.Sniffer().sniff(first, delimiters=",\t;|").delimiter
    except csv.Error:
        sep = ","
    return [dict(r, _line=i) for i, r in enumerate(csv.DictReader(io.StringIO(text), delimiter=sep), 2)]


class ManifestDataset(torch.utils.data.Dataset):
    """Image-caption pairs from a manifest: image path relative to the
    manifest, a caption, an optional long caption, optional extra columns.

    A pre-pass before any training step checks every row: required columns,
    empty captions, missing or undecodable images. It raises a DataError
    naming file and line, or with skip_bad=True drops and counts them
    (`self.skipped`)."""

    def __init__(self, path, transform=None, need_long: bool = False, skip_bad: bool = False,
                 check_images: bool = True, extra: Sequence[str] = ()):
        self.path, self.transform = Path(path), transform
        rows = read_manifest(self.path)
        if not rows:
            raise DataError(f"{self.path}: no rows")
        cols = set(rows[0]) - {"_line"}
        self.image_key = next((k for k in IMAGE_KEYS if k in cols), None)
        self.caption_key = next((k for k in CAPTION_KEYS if k in cols), None)
        if self.caption_key is None and "captions" in cols:
            self.caption_key = "captions"
        missing = [n for n, k in (("image", self.image_key), ("caption", self.caption_key)) if k is None]
        if need_long and "long_caption" not in cols:
            missing.append("long_caption")
        missing += [k for k in extra if k not in cols]
        if missing:
            raise DataError(f"{self.path}: missing column(s) {missing}; available: {sorted(cols)}")
        self.need_long, self.extra = need_long, tuple(extra)
        self.rows, self.skipped = [], []
        for r in rows:
            problem = self._check(r, check_images)
            if problem is None:
                self.rows.append(r)
            elif skip_bad:
                self.skipped.append(f"{self.path}:{r['_line']}: {problem}")
            else:
                raise DataError(f"{self.path}:{r['_line']}: {problem} (use --skip-bad to skip and count)")
        if self.skipped:
            log.warning("%s: skipped %d bad rows, e.g. %s", self.path, len(self.skipped), self.skipped[0])
        if not self.rows:
            raise DataError(f"{self.path}: every row is bad")

    def _caption(self, r):
        c = r[self.caption_key]
        return c[0] if isinstance(c, list) and c else c

    def _check(self, r, check_images):
        cap = self._caption(r)
        if not isinstance(cap, str) or not cap.strip():
            return "empty caption"
        if self.need_long and not str(r.get("long_caption") or "").strip():
            return "empty long_caption"
        p = self.image_file(r)
        if not p.is_file():
            return f"image not found: {p}"
        if check_images:
            try:
                with Image.open(p) as im:
                    im.verify()
            except Exception as e:  # PIL raises many types for corrupt files
                return f"undecodable image {p} ({type(e).__name__}: {e})"
        return None

    def image_file(self, r) -> Path:
        return self.path.parent / str(r[self.image_key])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        with Image.open(self.image_file(r)) as im:
            image = im.convert("RGB")
        item = {"image": self.transform(image) if self.transform else image,
                "caption": self._caption(r), "index": i}
        if self.need_long:
            item["long_caption"] = r["long_caption"]
        for k in self.extra:
            item[k] = r[k]
        return item


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
    """Seeded shuffle per epoch, sharded across ranks, that can start part
    way into an epoch (exact resume without replaying the data)."""
    def __init__(self, n, batch_size, seed=0, shuffle=True, rank=0, world=1):
        self.n, self.batch, self.seed, self.shuffle, self.rank, self.world = n, batch_size, seed, shuffle, rank, world
        self.epoch, self.skip_batches = 0, 0

    def set_epoch(self, epoch, skip_batches=0):
        self.epoch, self.skip_batches = epoch, skip_batches

    def _indices(self):
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            idx = torch.randperm(self.n, generator=g).tolist()
        else:
            idx = list(range(self.n))
        per_rank = self.n // self.world // self.batch * self.batch  # drop_last, same count per rank
        return idx[self.rank * per_rank:(self.rank + 1) * per_rank]

    def __iter__(self):
        return iter(self._indices()[self.skip_batches * self.batch:])

    def __len__(self):
        return len(self._indices()) - self.skip_batches * self.batch


# =============================================================================
# 6. Distributed
# =============================================================================
def dist_info():
    """(rank, world, local_rank) from torchrun's environment; (0, 1, 0) otherwise."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))
    return 0, 1, 0


def init_distributed(device: str = "auto"):
    """Initialises the process group under torchrun; picks the device."""
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", 0))
        use_cuda = torch.cuda.is_available() and device != "cpu"
        if use_cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world, local = dist_info()
    if device == "auto":
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and world > 1:
        device = f"cuda:{local}"
    return torch.device(device)


def gather(*features):
    """All ranks' features, concatenated in rank order, WITH gradient
    (open_clip's gather_features, gather_with_grad=True). Every rank then
    computes the loss over the global batch; because DDP averages gradients
    over ranks and the gather's backward sums them, the result equals one
    process on the global batch (tests/test_train.py checks it)."""
    rank, world, _ = dist_info()
    if world == 1:
        return features if len(features) > 1 else features[0]
    from open_clip.loss import gather_features
    out = []
    for i in range(0, len(features), 2):
        a = features[i]
        b = features[i + 1] if i + 1 < len(features) else a
        ga, gb = gather_features(a, b, gather_with_grad=True, rank=rank, world_size=world)
        out += [ga, gb] if i + 1 < len(features) else [ga]
    return tuple(out) if len(out) > 1 else out[0]


# =============================================================================
# 7. Training loop
# =============================================================================
def resolve_precision(precision: str, device) -> str:
    """'auto' -> fp16 on CUDA, fp32 elsewhere. fp16 off CUDA is accepted for
    testing the grad-scaler path (tests/test_fp16.py), with a warning: CPU
    half-precision matrix products are slow, and bf16 needs no scaler."""
    dev = torch.device(device).type
    if precision == "auto":
        return "fp16" if dev == "cuda" else "fp32"
    if precision not in ("fp16", "bf16", "fp32"):
        raise ValueError(f"unknown precision {precision!r}")
    if precision == "fp16" and dev != "cuda":
        _warn_once(f"warning: --precision fp16 on {dev} is meant for testing the grad-scaler path (slow); "
                   f"use bf16 or fp32 to train on {dev}")
    return precision


@functools.lru_cache(maxsize=None)
def _warn_once(message: str):
    print(message, file=sys.stderr)


def autocast(device, precision: str = "auto"):
    """One AMP path: fp16 or bf16 autocast, or nothing for fp32. For
    inference ('auto'): fp16 on CUDA, fp32 on CPU."""
    dev = torch.device(device).type
    precision = resolve_precision(precision, device)
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(dev, dtype=torch.float16 if precision == "fp16" else torch.bfloat16)


def no_decay(name: str, p: torch.Tensor) -> bool:
    """Gains, biases, embeddings and the logit scale get no weight decay."""
    return p.ndim < 2 or any(s in name for s in ("logit_scale", "logit_bias", "embedding", "class_embedding",
                                                  "ln_", "norm", ".bn", "bias"))


def param_groups(net, lr, wd, lr_of: Callable[[str], float] | None = None):
    """AdamW groups keyed by (learning rate, decay) over trainable parameters."""
    groups = {}
    for name, p in net.named_parameters():
        if not p.requires_grad:
            continue
        g_lr = lr_of(name) if lr_of else lr
        key = (g_lr, not no_decay(name, p))
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


class ClipFineTune(nn.Module):
    """Plain CLIP fine-tuning: the baseline every method is compared with,
    and the template of a method's model wrapper. forward(batch, ctx)
    returns a dict of named, already-weighted loss terms."""
    def __init__(self, model, label_smoothing: float = 0.0):
        super().__init__()
        self.model, self.label_smoothing = model, label_smoothing

    def forward(self, batch, ctx=None):
        img = self.model.encode_image(batch["image"], normalize=True)
        txt = encode_text(self.model, batch["text"])
        img, txt = gather(img, txt)
        return {"loss_clip": clip_loss(img, txt, self.model.logit_scale.exp(), self.label_smoothing)}


def _rng_state():
    s = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def _set_rng_state(s):
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def checkpoint_state(net):
    skip = tuple(getattr(net, "no_checkpoint", ()))
    return {k: v for k, v in net.state_dict().items() if not (skip and k.startswith(skip))}


def load_checkpoint_state(net, sd):
    skip = tuple(getattr(net, "no_checkpoint", ()))
    missing, unexpected = net.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (skip and k.startswith(skip))]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def latest_checkpoint(out) -> Path | None:
    p = Path(out) / "checkpoints" / "last.pt"
    return p if p.exists() else None


def step_generator(seed: int, step: int, device="cpu"):
    """The randomness a loss consumes at a step (mixing ratios, ...): the
    same on every rank, reproducible on resume without saving any state."""
    return torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + step)


def make_optimizer(cfg: Config, net: nn.Module, device, lr_of=None, fused: bool | None = None):
    """AdamW over param_groups. Fused by default on CUDA: one kernel for all
    tensors, which also takes the scaler's inf flag and skips an overflowed
    step on the device (no host sync). fused=True on CPU is for tests."""
    groups = param_groups(net, cfg.lr, cfg.wd, lr_of)
    for g in groups:
        g.pop("names")
    fused = torch.device(device).type == "cuda" if fused is None else fused
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)


def train_step(net, batch, ctx, opt, scaler, sched=None, *, grad_clip: float = 0.0, hooks=None, forward=None):
    """One optimisation step: the body of train's loop, called as is by
    tests/test_fp16.py and benchmarks/gpu_check.py. ctx needs .device and
    .precision (and whatever net.forward reads); forward defaults to net
    (train passes the DDP wrapper).

      1. forward under autocast; the loss terms are summed in float32
      2. non-finite guard on the UNSCALED loss: a NaN/inf loss stops the run;
         a scaled overflow (inf gradients from a too-large loss scale) is
         not a non-finite loss and is left to the scaler
      3. backward of loss * scale (the scale is 1, i.e. off, unless fp16)
      4. unscale the gradients when clipping or hooks need their true values
      5. clip the global gradient norm
      6. hooks.before_optimizer_step(net) (DNS projects the gradients here)
      7. scaler.step: AdamW, skipped when any gradient is inf/NaN;
         scaler.update: the scale halves after a skipped step and doubles
         after 2000 clean ones
      8. the LR scheduler steps on every iteration, skipped or not
         (open_clip_train calls scheduler(step) with the iteration index
         whatever the scaler did): the schedule and the data order are
         functions of the iteration, and a skip costs one step of schedule
      9. hooks.after_optimizer_step(net); then CLIP's clamp of the logit
         scale to [0, ln 100], idempotent: on a skipped step the weights
         are unchanged and already inside (only a value outside the range,
         possible before the first step, is moved)

    A skipped step leaves weights, AdamW moments and step counts bitwise
    unchanged. Returns (losses, loss, skipped): skipped is a 0-dim bool
    tensor on the scaler's device (None when the scaler is off); reading it
    syncs on CUDA, so train reads it at log steps only."""
    forward = forward or net
    with autocast(ctx.device, ctx.precision):
        losses = forward(batch, ctx)
    loss = sum(v.float() for v in losses.values())
    if not torch.isfinite(loss):
        terms = {k: float(v.detach()) for k, v in losses.items()}
        raise FloatingPointError(f"non-finite loss at step {ctx.step}: {terms}")
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    if grad_clip > 0 or hooks is not None:
        scaler.unscale_(opt)  # clip and project the true gradients, not the scaled ones
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], grad_clip)
    if hooks is not None:
        hooks.before_optimizer_step(net)
    scale = scaler._get_scale_async().clone() if scaler.is_enabled() else None  # update() works in place
    scaler.step(opt)
    scaler.update()
    skipped = scaler._get_scale_async() < scale if scale is not None else None  # only a skip lowers it
    if sched is not None:
        with warnings.catch_warnings():  # torch takes a skipped FIRST step for a misordered scheduler call
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            sched.step()
    if hooks is not None:
        hooks.after_optimizer_step(net)
    logit_scale = getattr(net.model, "logit_scale", None)
    if logit_scale is not None:
        with torch.no_grad():  # CLIP: clamp the temperature at 0.01 after every step
            logit_scale.clamp_(0, LOGIT_SCALE_MAX)
    return losses, loss, skipped


def train(cfg: Config, net: nn.Module, train_set, collate, *, lr_of=None, export: bool = True,
          hooks=None, method_state: Callable[[], dict] | None = None):
    """Trains `net` (a wrapper with .model = the open_clip model, whose
    forward(batch, ctx) returns the loss terms) and returns a summary dict.

    hooks: optional object with before_optimizer_step(net) (after unscaling
    and clipping) and after_optimizer_step(net); DNS projects there. Each
    step is train_step (its docstring gives the order and what a step
    skipped by the fp16 grad scaler does); metrics.jsonl logs grad_scale and
    skipped_steps when fp16 is on."""
    device = init_distributed(cfg.device)
    rank, world, _ = dist_info()
    precision = resolve_precision(cfg.precision, device)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    net.to(device)
    if cfg.grad_checkpointing:
        net.model.set_grad_checkpointing(True)
    if cfg.batch_size % world:
        raise ValueError(f"batch size {cfg.batch_size} is not divisible by {world} ranks")
    local_batch = cfg.batch_size // world
    if len(train_set) < cfg.batch_size:
        raise ValueError(f"training set ({len(train_set)}) smaller than one batch ({cfg.batch_size})")
    sampler = ResumableSampler(len(train_set), local_batch, cfg.seed, True, rank, world)
    loader = torch.utils.data.DataLoader(
        train_set, batch_size=local_batch, sampler=sampler, num_workers=cfg.workers, collate_fn=collate,
        pin_memory=device.type == "cuda", drop_last=True, generator=torch.Generator().manual_seed(cfg.seed),
        persistent_workers=False)
    steps_per_epoch = len(train_set) // cfg.batch_size
    total = cfg.steps or cfg.epochs * steps_per_epoch
    warmup = cfg.warmup if cfg.warmup >= 0 else round(-cfg.warmup / 100 * total)
    opt = make_optimizer(cfg, net, device, lr_of)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(warmup, total))
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    ddp = nn.parallel.DistributedDataParallel(
        net, device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=cfg.find_unused) if world > 1 else net

    step = 0
    n_skipped = torch.zeros((), dtype=torch.long, device=device)  # fp16: overflowed steps (weights untouched)
    if cfg.resume:
        ck = latest_checkpoint(out) if cfg.resume == "latest" else Path(cfg.resume)
        if ck is None or not ck.exists():
            raise FileNotFoundError(f"--resume {cfg.resume}: no checkpoint in {out / 'checkpoints'}")
        state = torch.load(ck, map_location="cpu", weights_only=False)
        load_checkpoint_state(net, state["net"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        if scaler.is_enabled() and not state["scaler"]:  # an fp32/bf16 run continued in fp16
            print(f"{ck} has no grad-scaler state (saved without fp16); starting at the default scale",
                  file=sys.stderr)
        else:
            scaler.load_state_dict(state["scaler"])  # scale and growth tracker: a no-op without fp16
        _set_rng_state(state["rng"])
        step = state["step"]
        n_skipped.fill_(state.get("skipped_steps", 0))
        if rank == 0:
            print(f"resumed from {ck} at step {step}", file=sys.stderr)

    def save(tag="last"):
        if rank != 0:
            return
        bad = [n for n, p in net.named_parameters() if not torch.isfinite(p).all()]
        if bad:  # never overwrite a good checkpoint with a broken state
            raise FloatingPointError(f"non-finite weights at step {step} ({bad[:3]}); checkpoint not written")
        _atomic_save({"net": checkpoint_state(net), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                      "scaler": scaler.state_dict(), "rng": _rng_state(), "step": step, "skipped_steps": int(n_skipped),
                      "method": method_state() if method_state else None, "config": dataclasses.asdict(cfg)},
                     out / "checkpoints" / f"{tag}.pt")

    from tqdm.auto import tqdm
    bar = tqdm(total=total, initial=step, disable=rank != 0 or not sys.stderr.isatty(), desc=out.name)
    metrics_f = open(out / "metrics.jsonl", "a") if rank == 0 else None
    net.train()
    t_start, t_log, last = time.time(), time.time(), {}
    logit_scale = getattr(net.model, "logit_scale", None)
    while step < total:
        epoch = step // steps_per_epoch
        sampler.set_epoch(epoch, step % steps_per_epoch)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
            ctx = SimpleNamespace(step=step, epoch=epoch, total_steps=total, device=device,
                                  generator=step_generator(cfg.seed, step), precision=precision)
            try:
                losses, loss, skipped = train_step(net, batch, ctx, opt, scaler, sched, grad_clip=cfg.grad_clip,
                                                   hooks=hooks, forward=ddp)
            except FloatingPointError as e:
                raise FloatingPointError(f"{e}; last good checkpoint kept in {out / 'checkpoints'}") from None
            if skipped is not None:
                n_skipped += skipped  # stays on the device; read at log steps
            step += 1
            bar.update(1)
            last = {k: float(v.detach()) for k, v in losses.items()}
            if rank == 0 and (step % cfg.log_every == 0 or step == total):
                dt = (time.time() - t_log) / cfg.log_every
                t_log = time.time()
                rec = {"step": step, "epoch": epoch, "lr": sched.get_last_lr()[0], "loss": float(loss.detach()), **last,
                       "logit_scale": float(logit_scale.detach().exp()) if logit_scale is not None else None,
                       "sec_per_step": dt}
                if scaler.is_enabled():
                    rec.update(grad_scale=scaler.get_scale(), skipped_steps=int(n_skipped))
                metrics_f.write(json.dumps(rec) + "\n")
                metrics_f.flush()
                bar.set_postfix(loss=f"{float(loss.detach()):.4f}")
            if cfg.save_every and step % cfg.save_every == 0 and step < total:
                save()
            if step >= total or (cfg.stop_at and step >= cfg.stop_at):
                break
        if cfg.stop_at and step >= cfg.stop_at and step < total:
            save()
            bar.close()
            return {"stopped_at": step, "total_steps": total}
    bar.close()
    if metrics_f:
        metrics_f.close()
    summary = {"steps": step, "total_steps": total, "train_seconds": time.time() - t_start,
               "final_losses": last, "world_size": world, "precision": precision, "device": str(device),
               "skipped_steps": int(n_skipped), "grad_scale": scaler.get_scale() if scaler.is_enabled() else None}
    if rank == 0:
        save()
        if export:
            save_model(net.model, out / "model.pt", cfg.backbone, source=cfg.pretrained or "default")
    return summary


def write_results(out, results: dict):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1, default=float))
    os.replace(tmp, out / "results.json")


def markdown_table(rows: list[dict], columns: Sequence[str], floatfmt="{:.1f}") -> str:
    def fmt(v):
        return floatfmt.format(v) if isinstance(v, float) else ("" if v is None else str(v))
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "\n".join("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows)


# =============================================================================
# 8. Continual driver (shared by cclip.py and dns.py)
# =============================================================================
@dataclass(frozen=True)
class Task:
    name: str
    train: str  # manifest path
    test: str   # manifest path (the train manifest when none is given)


def parse_tasks(spec: str, data_root="data") -> list[Task]:
    """'name=train.jsonl[:test.jsonl],...' in order, or 'synthetic' for the
    world's four domain tasks (plain, dark, stripes, outline)."""
    if spec == "synthetic":
        return [Task(d, str(synthetic_manifest(f"task-{d}", data_root)),
                     str(synthetic_manifest(f"task-{d}-test", data_root))) for d in PRETRAIN_DOMAINS[:4]]
    tasks = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, eq, paths = part.partition("=")
        if not eq or not paths:
            raise ValueError(f"task {part!r}: expected name=train_manifest[:test_manifest]")
        train_p, _, test_p = paths.partition(":")
        for p in (train_p, test_p or train_p):
            if not Path(p).exists():
                raise DataError(f"task {name}: manifest not found: {p}")
        tasks.append(Task(name, train_p, test_p or train_p))
    if len({t.name for t in tasks}) != len(tasks):
        raise ValueError("task names must be unique")
    return tasks


def run_continual(out, tasks: Sequence[Task], learn_task: Callable, evaluate: Callable,
                  save_state: Callable, load_state: Callable, resume: bool = False, log=print) -> dict:
    """Trains the tasks in order and keeps, per metric, the matrix
    R[i][j] = score on task j after learning tasks 1..i (row 0: before any
    training), plus per-row scalars such as zero-shot accuracy.

    learn_task(i, task, task_out, resume) trains task i in place and returns
    common.train's summary (one with 'stopped_at' ends the sequence early);
    evaluate() -> {"per_task": {metric: [score per task]}, "scalars": {name: value}};
    save_state(path) / load_state(path) store / restore the method's state at
    a task boundary. Everything is written after each task, so a crash loses
    at most the task in flight, which itself resumes from its last checkpoint."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state_file, boundary = out / "continual.json", out / "boundary.pt"
    rec = {"tasks": [dataclasses.asdict(t) for t in tasks], "rows": [], "scalars": [], "seconds": [], "steps": []}
    if resume and state_file.exists():
        rec = json.loads(state_file.read_text())
        if [t["name"] for t in rec["tasks"]] != [t.name for t in tasks]:
            raise ValueError(f"{state_file} was written for another task sequence")
        if len(rec["rows"]) > 1:
            load_state(boundary)
        log(f"resuming the task sequence after {len(rec['rows']) - 1} finished task(s)")

    def record(row, seconds, steps):
        rec["rows"].append(row["per_task"])
        rec["scalars"].append(row.get("scalars", {}))
        rec["seconds"].append(seconds)
        rec["steps"].append(steps)
        tmp = state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, indent=1))
        os.replace(tmp, state_file)

    if not rec["rows"]:
        record(evaluate(), 0.0, 0)
    for i, task in enumerate(tasks):
        if i + 1 < len(rec["rows"]):
            continue
        t0 = time.time()
        task_out = out / f"task{i + 1}-{task.name}"
        summary = learn_task(i, task, task_out, resume and latest_checkpoint(task_out) is not None) or {}
        seconds = time.time() - t0
        if "stopped_at" in summary:  # --stop-at inside this task: nothing recorded, --resume latest goes on
            log(f"task {i + 1} ({task.name}) stopped at step {summary['stopped_at']}; continue with --resume latest")
            return {"stopped_at": summary["stopped_at"], "task": i + 1}
        save_state(boundary)
        record(evaluate(), seconds, summary.get("steps", 0))
        log(f"task {i + 1}/{len(tasks)} ({task.name}) learned in {seconds:.0f}s")
    return summarize_continual(rec)


def summarize_continual(rec) -> dict:
    """Matrices and continual_metrics per metric; PD for every scalar
    (value before training minus value at the end)."""
    metrics = list(rec["rows"][0])
    matrices = {m: [row[m] for row in rec["rows"]] for m in metrics}
    summary = {"matrices": matrices, "metrics": {m: continual_metrics(R) for m, R in matrices.items()},
               "scalars": rec["scalars"], "seconds_per_task": rec["seconds"][1:], "steps_per_task": rec["steps"][1:]}
    first, last = rec["scalars"][0], rec["scalars"][-1]
    summary["pd"] = {k: first[k] - last[k] for k in first if k in last}
    return summary
