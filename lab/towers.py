"""The lab's uni-modal towers (m2-Mix Sec. 5.4 in miniature): a small timm
ResNet trained as an image classifier on the world's attributes and a tiny
BERT trained by masked language modelling on the world's captions alone,
each on its own modality, never together. towers.py builds the dual encoder
('lab-towers') from them exactly as it builds BERT + ResNet-50; the shipped
weights (lab/weights/towers-<key>/) spare every demo the pretraining.

  python -m lab.towers --write-weights     (about 2 min on 2 cores; rewrites lab/weights/towers-*)
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models import register_model
from timm.models.resnet import BasicBlock, ResNet

from plumbing.base import RunError, atomic_write
from plumbing import towers
from lab.world import (BACKGROUNDS, COLORS, IMAGE_SIZE, PRETRAIN, SHAPES, render, world_fingerprint, world_split,
                       world_texts)

# Sizes: the tiny CLIP's order (lab/tiny.py): 32 px images, a 128-wide text encoder; heads to 256 as the code's.
TEXT_CFG = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                max_position_embeddings=64)
RECIPE = dict(n=12000, image_epochs=4, text_epochs=6, batch=128, lr=1e-3, wd=0.05, mask=0.15, seed=0, version=1)
CHANNELS = (32, 64, 96, 128)
WRITE_COMMAND = "python -m lab.towers --write-weights"
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@register_model
def lab_resnet(pretrained=False, **kwargs):
    """A ResNet-10 of BasicBlocks with narrow stages (32-128 channels), 0.5 M weights: the lab's ResNet-50."""
    kwargs = {k: v for k, v in kwargs.items() if not k.startswith("pretrained_cfg") and k != "cache_dir"}
    model = ResNet(BasicBlock, [1, 1, 1, 1], channels=CHANNELS, stem_width=32, **kwargs)
    model.pretrained_cfg = model.default_cfg = {}  # nothing to download
    return model


def recipe_key() -> str:
    return hashlib.sha1(json.dumps([TEXT_CFG, RECIPE, CHANNELS, world_fingerprint()], sort_keys=True)
                        .encode()).hexdigest()[:10]


def shipped_dir() -> Path:
    return Path(__file__).resolve().parent / "weights" / f"towers-{recipe_key()}"


SPEC = towers.Towers(image="lab_resnet", image_size=IMAGE_SIZE, context_length=32, embed_dim=256,  # the code's
                     text_dirs=(shipped_dir() / "text",), image_files=(shipped_dir() / "image.safetensors",))
towers.SPECS["lab-towers"] = SPEC


def write_vocabulary(folder: Path) -> Path:
    """A WordPiece vocabulary of whole words: BERT's special tokens and every word the world writes."""
    from transformers import BasicTokenizer
    split = BasicTokenizer(do_lower_case=True)
    words = sorted({w for t in world_texts() for w in split.tokenize(t)})
    folder.mkdir(parents=True, exist_ok=True)
    return atomic_write(folder / "vocab.txt", "\n".join(SPECIALS + words) + "\n")


def main_labels(s: dict) -> list[int]:
    """What the image classifier learns: shape, colour and cell of the main object, and the background."""
    main = next(o for o in s["objects"] if o["size"] == "large")
    return [s["labels"]["shape"], s["labels"]["color"], main["cell"], s["labels"]["background"]]


def _pixels(scenes, seed: int, spec: towers.Towers) -> torch.Tensor:
    mean, std = torch.tensor(spec.mean).view(3, 1, 1), torch.tensor(spec.std).view(3, 1, 1)
    pix = np.stack([np.asarray(render(s, seed=seed + i)) for i, s in enumerate(scenes)])
    return (torch.from_numpy(pix).permute(0, 3, 1, 2).float() / 255 - mean) / std


def _batches(n: int, batch: int, epochs: int, gen: torch.Generator):
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen)
        yield from (order[i:i + batch] for i in range(0, n - batch + 1, batch))


def _step(opt, sched, loss, step: int, steps: int, what: str):
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    if step % 100 == 0:
        print(f"[lab] {what} step {step}/{steps} loss {loss.item():.3f}", file=sys.stderr)


def pretrain_image(scenes, p: dict) -> nn.Module:
    """The trunk, trained with four classification heads (shape, colour, cell, background) on pixels alone."""
    torch.manual_seed(p["seed"])
    trunk = timm.create_model("lab_resnet", num_classes=0)
    sizes = (len(SHAPES), len(COLORS), 4, len(BACKGROUNDS))
    heads = nn.Linear(trunk.num_features, sum(sizes))
    x, y = _pixels(scenes, 100, SPEC), torch.tensor([main_labels(s) for s in scenes])
    params = [*trunk.parameters(), *heads.parameters()]
    opt = torch.optim.AdamW(params, lr=p["lr"], weight_decay=p["wd"])
    steps = p["image_epochs"] * (len(x) // p["batch"])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, p["lr"], total_steps=steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(p["seed"])
    for step, idx in enumerate(_batches(len(x), p["batch"], p["image_epochs"], gen)):
        logits = heads(trunk(x[idx])).split(sizes, dim=1)
        loss = sum(F.cross_entropy(lg, y[idx, k]) for k, lg in enumerate(logits))
        _step(opt, sched, loss, step, steps, "image tower")
    return trunk.eval()


def pretrain_text(texts, folder: Path, p: dict):
    """A tiny BERT trained by masked language modelling (BERT's 80/10/10 masking) on captions alone."""
    from transformers import BertConfig, BertForMaskedLM, BertTokenizer
    tok = BertTokenizer(str(write_vocabulary(folder)), do_lower_case=True)
    torch.manual_seed(p["seed"])
    model = BertForMaskedLM(BertConfig(vocab_size=len(tok.vocab), **TEXT_CFG))
    ids = tok(texts, padding="max_length", truncation=True, max_length=SPEC.context_length, return_tensors="pt")
    x, attn = ids["input_ids"], ids["attention_mask"]
    opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], weight_decay=p["wd"])
    steps = p["text_epochs"] * (len(x) // p["batch"])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, p["lr"], total_steps=steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(p["seed"] + 1)
    special = torch.tensor(tok.all_special_ids)
    for step, idx in enumerate(_batches(len(x), p["batch"], p["text_epochs"], gen)):
        inp, labels = x[idx].clone(), x[idx].clone()
        r = torch.rand(inp.shape, generator=gen)
        picked = (r < p["mask"]) & ~torch.isin(inp, special)
        labels[~picked] = -100
        u = torch.rand(inp.shape, generator=gen)
        inp[picked & (u < 0.8)] = tok.mask_token_id  # 80 % [MASK], 10 % a random word, 10 % kept
        rand = picked & (u >= 0.8) & (u < 0.9)
        inp[rand] = torch.randint(len(SPECIALS), len(tok.vocab), (int(rand.sum()),), generator=gen)
        loss = model(input_ids=inp, attention_mask=attn[idx], labels=labels).loss
        _step(opt, sched, loss, step, steps, "text tower (MLM)")
    model.bert.save_pretrained(folder)  # the encoder only; its MLM head is not part of the tower
    tok.save_pretrained(folder)


def write_weights() -> Path:
    """Pretrains both towers with RECIPE and writes lab/weights/towers-<key>/ (older towers-* removed)."""
    from safetensors.torch import save_file
    torch.set_num_threads(2)
    t0, p, out = time.time(), RECIPE, shipped_dir()
    scenes = world_split(PRETRAIN, p["n"], seed=100)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(pretrain_image(scenes, p).state_dict(), str(tmp / "image.safetensors"))
    pretrain_text([t for s in scenes for t in (s["caption"], s["long_caption"])], tmp / "text", p)
    card = {"key": recipe_key(), "recipe": p, "text_config": TEXT_CFG, "channels": CHANNELS,
            "world": world_fingerprint(), "command": WRITE_COMMAND, "pretrain_seconds": round(time.time() - t0),
            "torch": torch.__version__, "timm": timm.__version__}
    atomic_write(tmp / "card.json", json.dumps(card, indent=1))
    for old in out.parent.glob("towers-*"):
        if old != tmp:
            shutil.rmtree(old)
    tmp.rename(out)
    print(f"[lab] towers written to {out} in {time.time() - t0:.0f}s", file=sys.stderr)
    return out


def check_shipped():
    """One message when the shipped towers are not those of the current recipe and world."""
    if not (shipped_dir() / "card.json").is_file():
        raise RunError(f"the lab's pretrained towers for recipe {recipe_key()} are not in lab/weights/ "
                              f"(the world or the recipe changed): write them with {WRITE_COMMAND}")


if __name__ == "__main__":
    if "--write-weights" in sys.argv:
        write_weights()
