"""The lab: a synthetic world and a tiny CLIP that are a miniature of the
papers' regimes, plus the multi-seed runner, the claims table and the figure
helpers every demo uses.

Nobody without a GPU, pretrained weights and the datasets can run the papers'
experiments. The lab is the evidence they CAN run: a procedural world whose
causal structure mirrors the settings of the four papers, a CLIP small enough
to pretrain on two CPU cores, and demos that report paired statistics over
seeds fixed in advance, so that a claim either shows, shows the other way, or
is honestly not resolved at this size.

The world (what mirrors what)
-----------------------------
A scene is a 32 x 32 picture: a background and 1-4 objects on a 2 x 2 grid.
Each object has a shape (8), a colour (9), a size (2) and a cell (4); a scene
has a background (8) and a drawing style (filled / outlined).

  broad pretraining      the tiny model is pretrained contrastively on SHORT
                         alt-text captions over the whole vocabulary: every
                         shape, colour and background ("a large red circle
                         on a striped background."), like CLIP's web alt-text
                         covering ImageNet's 1,000 classes.
  narrow fine-tuning     ERCLIP's pool (the COCO n ShareGPT4V analogue,
                         split 'train') shows only 5 shapes and 6 colours, and
                         its captions never name the background: a COCO-style
                         short caption ("a large red circle at the top left
                         with 2 other objects.") and a ShareGPT4V-style long
                         one of 5-10 sentences (every object, the count,
                         pairwise relations).
  long captions          the tiny text context is 24 tokens, so a long
                         caption loses its later sentences to truncation, as
                         ShareGPT4V's do at CLIP's 77.
  zero-shot sets         the ImageNet / CIFAR analogue ('zs-test', drawn like
                         pretraining): the main object's shape and colour,
                         reported on the classes fine-tuning shows and on the
                         classes only pretraining saw, and the background, a
                         held-out family (8 classes, chance 12.5 %) that no
                         fine-tuning caption names.
  continual domains      four task domains (C-CLIP's / DNS's sequence), each
                         with its own backgrounds, concept subset and caption
                         phrase, so that one task can overwrite another, and
                         an unseen domain ('unseen') no task trains on.

Everything is written to disk as PNG files plus a JSONL manifest and read
back through common.ManifestDataset, the same path as real data.

What is deterministic
---------------------
The world is: the same split name and size give the same scenes, pixels and
captions on every machine (Python's seeded `random`, integer PIL drawing). The
tiny model's pretraining and every fine-tuning run are deterministic on ONE
machine (same weights, same numbers on a rerun), but float kernels differ
between CPUs, so another machine gets slightly different weights and numbers.
Tests therefore assert floors with margins, never exact numbers measured
elsewhere.

Statistics
----------
Every demo runs the same seeds, fixed in advance (SEEDS), from the same
pretrained weights; a claim is a paired (same-seed) difference. With n seeds,
mean d and standard deviation s of the per-seed differences, se = s / sqrt(n):
  reproduced     d has the paper's sign and |d| > 2 se
  opposite       d has the other sign and |d| > 2 se
  not resolved   otherwise
A claim that two variants are "about equal" is reproduced when the whole
interval d +- 2 se lies inside +-margin (stated with the claim), opposite when
|d| - 2 se > margin, and not resolved otherwise. A claim that a quantity lies
in the paper's range [lo, hi] is reproduced when d +- 2 se overlaps it,
opposite when the interval lies beyond 0 on the other side, and not resolved
otherwise (for example: clearly positive but below the range). Every seed's
number is kept.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import open_clip
import torch
from PIL import Image, ImageDraw

import common

# =============================================================================
# 1. The world's vocabulary
# =============================================================================
SHAPES = ("circle", "square", "triangle", "diamond", "cross", "ring", "bar", "star")
COLORS = {"red": (215, 38, 38), "green": (34, 160, 60), "blue": (40, 80, 220), "yellow": (235, 205, 30),
          "purple": (140, 55, 185), "orange": (240, 135, 20), "pink": (240, 120, 190), "cyan": (30, 200, 210),
          "brown": (130, 80, 40)}
# background -> (base colour, pattern, pattern colour)
BACKGROUNDS = {
    "plain": ((236, 236, 236), "none", None),
    "dark": ((28, 30, 48), "none", None),
    "striped": ((205, 222, 240), "stripes", (150, 180, 215)),
    "checkered": ((215, 215, 215), "checker", (160, 160, 160)),
    "dotted": ((240, 228, 200), "dots", (190, 165, 120)),
    "grainy": ((150, 150, 150), "noise", None),
    "gradient": ((250, 205, 150), "gradient", (150, 200, 250)),
    "grid": ((246, 246, 246), "grid", (110, 110, 110)),
}
POSITIONS = ("top left", "top right", "bottom left", "bottom right")  # the 2 x 2 cells, row-major
SIZES = ("small", "large")
IMAGE_SIZE = 32
NUMBERS = ("no", "one", "two", "three", "four")

# Zero-shot label sets: name -> (classnames, templates, manifest column).
SHAPE_TEMPLATES = ("a photo of a {}.", "a picture of a {}.", "a {} shape.", "an image with a {}.")
COLOR_TEMPLATES = ("a photo of something {}.", "a {} object.", "a picture of a {} thing.")
BACKGROUND_TEMPLATES = ("a photo on a {} background.", "a {} background.", "a picture with a {} background.")


@dataclasses.dataclass(frozen=True)
class Domain:
    """Where a split's scenes come from and how they are captioned."""
    backgrounds: tuple = tuple(BACKGROUNDS)
    shapes: tuple = SHAPES
    colors: tuple = tuple(COLORS)
    style: str = "filled"     # filled | outlined | mixed (pretraining: 1 in 5 outlined)
    captions: str = "coco"    # coco (short, no background) | alt (pretraining alt-text, names the background)
    phrase: str = ""          # opening words of the short captions (a continual domain's caption style)


PRETRAIN = Domain(style="mixed", captions="alt")          # the whole vocabulary
ZS_DOMAIN = Domain(style="mixed", captions="alt")         # zero-shot sets are drawn like pretraining
FINETUNE = Domain(shapes=SHAPES[:5], colors=tuple(COLORS)[:6])  # ERCLIP's / m2-Mix's pool: a subset, COCO style
# Continual domains (C-CLIP, DNS): each its own backgrounds, concepts and caption phrase.
TASK_DOMAINS = {
    "photo": Domain(("plain", "gradient"), ("circle", "square", "triangle"), ("red", "green", "blue"),
                    phrase="a photo of"),
    "night": Domain(("dark",), ("diamond", "cross", "ring"), ("yellow", "orange", "cyan"),
                    phrase="a night shot of"),
    "pattern": Domain(("striped", "checkered", "grid"), ("bar", "star", "circle"), ("purple", "pink", "brown"),
                      phrase="a patterned card with"),
    "sketch": Domain(("plain", "dotted"), ("square", "triangle", "star"), ("red", "blue", "purple"),
                     style="outlined", phrase="a line drawing of"),
}
UNSEEN = Domain(("grainy",), phrase="a grainy snapshot of")  # no task trains on it

# name -> (domain, size, seed)
SPLITS = {
    "train": (FINETUNE, 2000, 1), "test": (FINETUNE, 400, 2), "val": (FINETUNE, 400, 5),
    "zs-test": (ZS_DOMAIN, 720, 3), "unseen": (UNSEEN, 300, 4),
    **{f"task-{d}": (dom, 600, 10 + i) for i, (d, dom) in enumerate(TASK_DOMAINS.items())},
    **{f"task-{d}-test": (dom, 200, 20 + i) for i, (d, dom) in enumerate(TASK_DOMAINS.items())},
}


def label_sets():
    """Zero-shot label sets of the world: name -> (classnames, templates, manifest column)."""
    return {"shape": (list(SHAPES), list(SHAPE_TEMPLATES), "shape"),
            "color": (list(COLORS), list(COLOR_TEMPLATES), "color"),
            "background": (list(BACKGROUNDS), list(BACKGROUND_TEMPLATES), "background")}


def finetune_classes():
    """Per label set, the classes the fine-tuning pool shows (the rest only pretraining saw)."""
    return {"shape": list(FINETUNE.shapes), "color": list(FINETUNE.colors), "background": []}


# =============================================================================
# 2. Scenes, captions, pixels
# =============================================================================
def _name(o):
    return f"{o['color']} {o['shape']}"


def _a(words: str) -> str:
    return ("an " if words[0] in "aeiou" else "a ") + words


def _relation(a, b):
    ra, ca, rb, cb = a["cell"] // 2, a["cell"] % 2, b["cell"] // 2, b["cell"] % 2
    if ra == rb:
        return "to the left of" if ca < cb else "to the right of"
    if ca == cb:
        return "above" if ra < rb else "below"
    return ("above and to the left of" if ca < cb else "above and to the right of") if ra < rb else \
        ("below and to the left of" if ca < cb else "below and to the right of")


def scene(rng: random.Random, domain: Domain) -> dict:
    """One scene and its texts. The main object (the one short captions and
    zero-shot labels are about) is the first large object in cell order."""
    n = rng.choice((1, 2, 2, 3, 3, 4)) if domain.captions == "alt" else rng.choice((2, 2, 3, 3, 4))
    cells = sorted(rng.sample(range(4), n))
    objs = [dict(shape=rng.choice(domain.shapes), color=rng.choice(domain.colors), size=rng.choice(SIZES), cell=c)
            for c in cells]
    if not any(o["size"] == "large" for o in objs):
        rng.choice(objs)["size"] = "large"
    main = next(o for o in objs if o["size"] == "large")
    bg = rng.choice(domain.backgrounds)
    style = domain.style if domain.style != "mixed" else ("outlined" if rng.random() < 0.2 else "filled")
    others = [o for o in objs if o is not main]
    if domain.captions == "alt":  # web alt-text: the main object (sometimes a second one) and the background
        second = rng.choice(others) if others and rng.random() < 0.4 else None
        what = f"a {main['size']} {_name(main)}" + (f" and {_a(_name(second))}" if second else "")
        caption = rng.choice((f"{what} on a {bg} background.",
                              f"{bg} background with {what}.",
                              f"{what} at the {POSITIONS[main['cell']]}, {bg} background.",
                              f"a picture of {what} on a {bg} background."))
    else:  # COCO style: the main object, where it is, one neighbour; never the background
        rest = f" next to {_a(_name(others[0]))}" if others else ""
        lead = f"{domain.phrase} " if domain.phrase else ""
        caption = f"{lead}a {main['size']} {_name(main)} at the {POSITIONS[main['cell']]}{rest}."
    # ShareGPT4V style: every object, the count, relations, sizes (5-10 sentences)
    sentences = [f"There is a {o['size']} {_name(o)} at the {POSITIONS[o['cell']]}." for o in objs]
    sentences.append(f"The picture shows {NUMBERS[n]} object{'s' if n > 1 else ''} in total.")
    pairs = [(a, b) for i, a in enumerate(objs) for b in objs[i + 1:]]
    for a, b in rng.sample(pairs, min(3, len(pairs))):
        sentences.append(f"The {_name(a)} is {_relation(a, b)} the {_name(b)}.")
    n_large = sum(o["size"] == "large" for o in objs)
    sentences.append(f"{NUMBERS[n_large].capitalize()} of them {'is' if n_large == 1 else 'are'} large."
                     if n > 1 else f"The {_name(main)} is large.")
    if style == "outlined":
        sentences.append("The shapes are drawn as outlines.")
    return dict(objects=objs, background=bg, style=style, caption=caption, long_caption=" ".join(sentences),
                labels=dict(shape=SHAPES.index(main["shape"]), color=list(COLORS).index(main["color"]),
                            background=list(BACKGROUNDS).index(bg)))


def render(s: dict, seed: int = 0) -> Image.Image:
    """The scene's pixels: drawn at 2x and downsampled (anti-aliased)."""
    S = 2 * IMAGE_SIZE
    base, pattern, pc = BACKGROUNDS[s["background"]]
    img = Image.new("RGB", (S, S), base)
    draw = ImageDraw.Draw(img)
    if pattern == "stripes":
        for x in range(0, S, 8):
            draw.rectangle([x, 0, x + 2, S], fill=pc)
    elif pattern == "checker":
        for x in range(0, S, 8):
            for y in range(0, S, 8):
                if (x + y) // 8 % 2:
                    draw.rectangle([x, y, x + 7, y + 7], fill=pc)
    elif pattern == "dots":
        for x in range(4, S, 8):
            for y in range(4, S, 8):
                draw.ellipse([x - 1, y - 1, x + 1, y + 1], fill=pc)
    elif pattern == "grid":
        for x in range(0, S, 8):
            draw.line([x, 0, x, S], fill=pc)
            draw.line([0, x, S, x], fill=pc)
    elif pattern == "gradient":
        for y in range(S):
            t = y / (S - 1)
            draw.line([0, y, S, y], fill=tuple(round(a + (b - a) * t) for a, b in zip(base, pc)))
    cell = S / 2
    for o in s["objects"]:
        cx, cy = (o["cell"] % 2 + 0.5) * cell, (o["cell"] // 2 + 0.5) * cell
        r = cell * (0.44 if o["size"] == "large" else 0.28)
        col = COLORS[o["color"]]
        outline = s["style"] == "outlined"
        kw = dict(outline=col, width=3) if outline else dict(fill=col)
        box = [cx - r, cy - r, cx + r, cy + r]
        shape = o["shape"]
        if shape == "circle":
            draw.ellipse(box, **kw)
        elif shape == "ring":
            draw.ellipse(box, outline=col, width=max(3, round(r / 2.5)))
        elif shape == "square":
            draw.rectangle(box, **kw)
        elif shape == "bar":
            draw.rectangle([cx - r, cy - r / 2.6, cx + r, cy + r / 2.6], **kw)
        elif shape == "triangle":
            draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], **kw)
        elif shape == "diamond":
            draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], **kw)
        elif shape == "star":
            pts = [(cx + (r if k % 2 == 0 else r * 0.42) * math.sin(k * math.pi / 5),
                    cy - (r if k % 2 == 0 else r * 0.42) * math.cos(k * math.pi / 5)) for k in range(10)]
            draw.polygon(pts, **kw)
        else:  # cross
            w = r / 2.6
            for b in ([cx - r, cy - w, cx + r, cy + w], [cx - w, cy - r, cx + w, cy + r]):
                draw.rectangle(b, **kw)
    img = img.resize((IMAGE_SIZE, IMAGE_SIZE), Image.LANCZOS)
    if pattern == "noise":
        arr = np.asarray(img).astype(np.int16)
        arr = arr + np.random.default_rng(seed).integers(-45, 46, arr.shape)
        img = Image.fromarray(arr.clip(0, 255).astype(np.uint8))
    return img


def world_split(domain: Domain, n: int, seed: int) -> list[dict]:
    """n deterministic scenes of a domain."""
    rng = random.Random(f"clipft-lab-{seed}")
    return [scene(rng, domain) for _ in range(n)]


def synthetic_manifest(split: str, data_root="data", n: int | None = None) -> Path:
    """Writes (once) a split of the world as PNG files plus a JSONL manifest
    under data_root/synthetic/ and returns the manifest path. n: only the
    first n scenes (tests). Demos and tests read it back through
    common.ManifestDataset, like real data."""
    if split not in SPLITS:
        raise ValueError(f"unknown synthetic split {split!r}; known: {', '.join(SPLITS)}")
    domain, size, seed = SPLITS[split]
    root = Path(data_root) / "synthetic"
    name = split if n is None else f"{split}-{n}"
    manifest = root / f"{name}.jsonl"
    if manifest.exists():
        return manifest
    (root / name).mkdir(parents=True, exist_ok=True)
    lines = []
    for i, s in enumerate(world_split(domain, n or size, seed)):
        rel = f"{name}/{i:05d}.png"
        render(s, seed=seed * 100003 + i).save(root / rel)
        lines.append(json.dumps({"image": rel, "caption": s["caption"], "long_caption": s["long_caption"],
                                 "background": s["labels"]["background"], "shape": s["labels"]["shape"],
                                 "color": s["labels"]["color"], "style": s["style"]}))
    common.atomic_write(manifest, "\n".join(lines) + "\n")
    return manifest


def task_manifests(data_root="data", n_train=None, n_test=None) -> list[tuple[str, Path, Path]]:
    """The continual domains in order: (name, train manifest, test manifest)."""
    return [(d, synthetic_manifest(f"task-{d}", data_root, n_train), synthetic_manifest(f"task-{d}-test", data_root, n_test))
            for d in TASK_DOMAINS]


# --- a multimodal feature world (DNS in CMCL's setting; features, not pixels) ---
def synthetic_multimodal(out, layout: str = "cmcl", perceptor: str = "imagebind", datasets: dict | None = None,
                         dim: int = 24, n_train: int = 128, n_test: int = 64, n_classes: int = 5, latent: int = 12,
                         active: int = 6, spread: float = 0.6, noise: float = 0.3, seed: int = 0) -> Path:
    """A multimodal world for tests and the demo, written in `layout` ('cmcl'
    or 'ours'). Every sample has latent factors z (latent,); a dataset uses
    `active` of them (its own random subset, so datasets overlap in part);
    classes are cluster means in z. Modality m sees x_m = normalise(A_m z +
    noise e), A_m = A_shared + spread B_m (dim, latent): shared structure (so
    the identity maps start partly aligned, like a pretrained binding model)
    plus a modality-specific part and modality-specific noise e. Class text
    features: normalise(A_text mu_c), noise-free. datasets: name -> (modality
    names, has classes); default: eval.CMCL_DATASETS with their real names.
    The layouts are eval.read_features'; DNS's demo in CMCL's setting and its
    tests run on this world (dns.py --demo-cmcl)."""
    import eval as evaluation  # the layouts' reader and writer (eval imports lab)
    g = torch.Generator().manual_seed(seed)
    datasets = datasets or {k: (m, "acc" in t) for k, (m, t) in evaluation.CMCL_DATASETS.items()}
    names = sorted({m for mods, _ in datasets.values() for m in mods})
    A_shared = torch.randn(dim, latent, generator=g) / math.sqrt(latent)
    A = {m: A_shared + spread * torch.randn(dim, latent, generator=g) / math.sqrt(latent) for m in names}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for d, (mods, has_classes) in datasets.items():
        mask = torch.zeros(latent)
        mask[torch.randperm(latent, generator=g)[:active]] = 1.0
        mu = torch.randn(n_classes, latent, generator=g) * 1.5 * mask
        class_names = [f"{d} class {c}" for c in range(n_classes)]
        class_x = torch.nn.functional.normalize(mu @ A.get("text", A_shared).t(), dim=-1)  # (C, d)
        if layout == "ours":
            meta = {"modalities": list(mods)} | ({"classes": class_names} if has_classes else {})
            (out / d).mkdir(parents=True, exist_ok=True)
            (out / d / "meta.json").write_text(json.dumps(meta))
            if has_classes:
                torch.save(class_x, out / d / "classes.pt")
        elif has_classes:
            evaluation.write_h5(out / f"{d}_class_{perceptor}.h5", dict(zip(class_names, class_x)))
        for split, n in (("train", n_train), ("test", n_test)):
            labels = torch.randint(n_classes, (n,), generator=g)
            z = (mu[labels] if has_classes else 0) + torch.randn(n, latent, generator=g) * mask
            x = torch.stack([torch.nn.functional.normalize(z @ A[m].t() + noise * torch.randn(n, dim, generator=g),
                                                           dim=-1) for m in mods], 1)  # (N, M, d)
            ids = [f"{d}_{split}_{i:05d}" for i in range(n)]
            if layout == "ours":
                (out / d / split).mkdir(exist_ok=True)
                for k, m in enumerate(mods):
                    torch.save(x[:, k].clone(), out / d / split / f"{m}.pt")
                (out / d / split / "samples.json").write_text(json.dumps(
                    {"ids": ids} | ({"labels": labels.tolist()} if has_classes else {})))
            else:
                evaluation.write_h5(out / f"{d}_{split}_{perceptor}.h5", dict(zip(ids, x)))
                if has_classes:
                    (out / f"{d}_{split}_labels.json").write_text(
                        json.dumps({i: class_names[c] for i, c in zip(ids, labels.tolist())}))
    return out


def low_rank_tasks(dim=32, rank=6, shared=3, n=256, noise=0.3, seed=0):
    """Two tasks of paired features that lie exactly on rank-`rank` subspaces;
    task 2's subspaces share `shared` directions with task 1's (so the tasks
    interfere). Text latent = image latent + noise. Returns [(img, txt)] * 2.
    DNS's stability guarantee is exact on such features (dns.guarantee_check)."""
    g = torch.Generator().manual_seed(seed)
    k = 2 * rank - shared
    Q_img = torch.linalg.qr(torch.randn(dim, k, generator=g))[0]  # (D, k) orthonormal
    Q_txt = torch.linalg.qr(torch.randn(dim, k, generator=g))[0]
    tasks = []
    for cols in (slice(0, rank), slice(rank - shared, k)):
        z = torch.randn(n, rank, generator=g)
        img = torch.nn.functional.normalize(z @ Q_img[:, cols].t(), dim=-1)
        txt = torch.nn.functional.normalize((z + noise * torch.randn(n, rank, generator=g)) @ Q_txt[:, cols].t(),
                                            dim=-1)
        tasks.append((img, txt))
    return tasks


# =============================================================================
# 3. The tiny backbone
# =============================================================================
# Chosen by measurement on 2 CPU cores (README, "The lab"): 32 px images in
# 8 px patches (16 tokens) keep a step cheap (the previous world's 48 px images
# gave 36); 10,000 scenes x 3 epochs fit the 90 s budget (12,000 x 4 took
# about 120 s); a 24-token text context truncates
# long captions the way 77 tokens truncate ShareGPT4V's.
TINY_CFG = {
    "embed_dim": 128, "quick_gelu": False,
    "vision_cfg": {"image_size": IMAGE_SIZE, "layers": 4, "width": 128, "patch_size": 8, "head_width": 32},
    "text_cfg": {"context_length": 24, "vocab_size": 49408, "width": 128, "heads": 4, "layers": 4},
}
# version: bump when the world or the recipe changes (it is part of the cache key)
TINY_PRETRAIN = dict(n=10000, epochs=3, batch=128, lr=1e-3, wd=0.1, warmup_pct=5, seed=0, version=4)


class _PretrainScenes(torch.utils.data.Dataset):
    """Pretraining scenes held in memory as normalised tensors (rendered once)."""
    def __init__(self, scenes, seed):
        mean = torch.tensor(open_clip.OPENAI_DATASET_MEAN).view(3, 1, 1)
        std = torch.tensor(open_clip.OPENAI_DATASET_STD).view(3, 1, 1)
        pix = np.stack([np.asarray(render(s, seed=seed + i)) for i, s in enumerate(scenes)])  # (N, H, W, 3)
        self.images = (torch.from_numpy(pix).permute(0, 3, 1, 2).float() / 255 - mean) / std
        self.captions = [s["caption"] for s in scenes]

    def __len__(self):
        return len(self.captions)

    def __getitem__(self, i):
        return {"image": self.images[i], "caption": self.captions[i]}


def pretrain_tiny(force: bool = False) -> Path:
    """The tiny backbone's 'pretrained' weights: contrastive training from
    scratch on the world's short alt-text captions (CLIP's situation: short
    web captions over a broad vocabulary, then asked about long ones).
    Deterministic on one machine, cached in CLIPFT_CACHE after the first run."""
    key = hashlib.sha1(json.dumps([TINY_CFG, TINY_PRETRAIN], sort_keys=True).encode()).hexdigest()[:10]
    path = common.CACHE_DIR / f"tiny-synthetic-{key}.pt"
    if path.exists() and not force:
        return path
    common.register_tiny()
    common.CACHE_DIR.mkdir(parents=True, exist_ok=True)
    import fcntl  # one process pretrains; others (parallel tests, ranks) wait for its file
    with open(common.CACHE_DIR / f"{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists() and not force:
            return path
        return _pretrain_tiny(path, key)


def _pretrain_tiny(path: Path, key: str) -> Path:
    t0 = time.time()
    print(f"[lab] pretraining the tiny backbone on the world's alt-text captions -> {path}", file=sys.stderr)
    p = TINY_PRETRAIN
    torch.manual_seed(p["seed"])
    model, _, _ = open_clip.create_model_and_transforms(common.TINY_NAME, pretrained=None)
    tok = open_clip.get_tokenizer(common.TINY_NAME)
    scenes = _PretrainScenes(world_split(PRETRAIN, p["n"], seed=100), seed=100)
    cfg = common.Config(epochs=p["epochs"], batch_size=p["batch"], lr=p["lr"], wd=p["wd"], warmup=-p["warmup_pct"],
                        grad_clip=1.0, precision="fp32", workers=0, out=str(common.CACHE_DIR / f"tiny-pretrain-{key}"),
                        save_every=0, log_every=50, device="cpu", seed=p["seed"])
    common.train(cfg, common.ClipFineTune(model), scenes, common.Collate(tok), export=False)
    model.quick_gelu = False
    common.save_model(model, path, "tiny", source=f"synthetic world pretraining {p}")
    print(f"[lab] tiny backbone pretrained in {time.time() - t0:.0f}s", file=sys.stderr)
    return path


# =============================================================================
# 4. Measurements on the world (one image pass per model)
# =============================================================================
@torch.no_grad()
def zero_shot_report(model, preprocess, tokenizer, data_root="data", n=None) -> dict:
    """Zero-shot top-1 (%) on 'zs-test' per label set, overall and split into
    the classes fine-tuning shows ('<set> seen') and those only pretraining
    saw ('<set> held-out'); the background family is held out entirely."""
    import eval as evaluation
    ds = common.ManifestDataset(synthetic_manifest("zs-test", data_root, n), check_images=False,
                                extra=("shape", "color", "background"))
    img = evaluation.image_features(model, preprocess, [str(ds.image_file(r)) for r in ds.rows])
    out, seen = {}, finetune_classes()
    for name, (classes, templates, column) in label_sets().items():
        clf = common.zero_shot_classifier(model, tokenizer, classes, templates)
        labels = torch.tensor([int(r[column]) for r in ds.rows])
        correct = (img @ clf).argmax(1) == labels
        out[name] = 100.0 * correct.float().mean().item()
        if seen[name]:
            mask = torch.tensor([classes[i] in seen[name] for i in labels.tolist()])
            out[f"{name} seen"] = 100.0 * correct[mask].float().mean().item()
            out[f"{name} held-out"] = 100.0 * correct[~mask].float().mean().item()
    return out


@torch.no_grad()
def retrieval_report(model, preprocess, tokenizer, split="test", data_root="data", n=None,
                     sentence_mean: bool = False) -> dict:
    """R@1 (%) both ways on a split's short and long captions (long truncated
    at the context, as the papers evaluate; optionally also sentence-mean)."""
    import eval as evaluation
    ds = common.ManifestDataset(synthetic_manifest(split, data_root, n), need_long=True, check_images=False)
    img = evaluation.image_features(model, preprocess, [str(ds.image_file(r)) for r in ds.rows])
    t2i = torch.arange(len(ds.rows))
    out = {}
    modes = [("short", "caption", "truncate"), ("long", "long_caption", "truncate")]
    if sentence_mean:
        modes.append(("long-sent", "long_caption", "sentence-mean"))
    for label, column, mode in modes:
        txt = evaluation.text_features(model, tokenizer, [r[column] for r in ds.rows], mode)
        m = common.retrieval_metrics(img, txt, t2i, ks=(1,))
        out[f"{label} I2T"], out[f"{label} T2I"] = m["i2t_R@1"], m["t2i_R@1"]
    return out


# =============================================================================
# 5. Seeds, paired statistics, claims
# =============================================================================
SEEDS = (0, 1, 2)  # fixed before any demo was run; every demo uses all of them


def paired(runs: dict, a: str, b: str, key: str, base: dict | None = None) -> list[float]:
    """Per-seed paired differences runs[a][i][key] - runs[b][i][key]; a b that
    is not in runs (the pretrained model) means `base`, the same for every seed."""
    other = runs[b] if b in runs else [base] * len(runs[a])
    return [x[key] - y[key] for x, y in zip(runs[a], other)]


def paired_stats(diffs: Sequence[float]) -> tuple[float, float, float]:
    """(mean, sample std, standard error) of per-seed paired differences."""
    d = np.asarray(diffs, dtype=float)
    std = float(d.std(ddof=1)) if len(d) > 1 else float("nan")
    return float(d.mean()), std, std / math.sqrt(len(d)) if len(d) > 1 else float("nan")


def verdict(diffs: Sequence[float], direction: str, margin: float = 0.0, interval=None) -> str:
    """direction '+' or '-': the paper's sign of the difference; '=': the
    paper says about equal (within +-margin); 'range': the paper gives an
    interval (lo, hi) for the quantity. See the module docstring."""
    mean, _, se = paired_stats(diffs)
    if not math.isfinite(se):
        return "not resolved"
    if direction == "range":
        lo, hi = interval
        if mean + 2 * se >= lo and mean - 2 * se <= hi:
            return "reproduced"
        return "opposite" if mean + 2 * se < 0 <= lo or mean - 2 * se > 0 >= hi else "not resolved"
    if direction == "=":
        if abs(mean) + 2 * se < margin:
            return "reproduced"
        return "opposite" if abs(mean) - 2 * se > margin else "not resolved"
    sign = 1.0 if direction == "+" else -1.0
    if abs(mean) > 2 * se and mean != 0:
        return "reproduced" if mean * sign > 0 else "opposite"
    return "not resolved"


def claim(text: str, paper: str, diffs: Sequence[float], direction: str, margin: float = 0.0,
          interval=None, **extra) -> dict:
    """One row of a claims table (the keys results.json's `claims` list uses)."""
    mean, std, se = paired_stats(diffs)
    kind = {"margin": margin} if direction == "=" else {"interval": list(interval)} if direction == "range" else {}
    return {"claim": text, "paper": paper, "mean": mean, "std": std, "n_seeds": len(diffs),
            "per_seed": [float(x) for x in diffs], "verdict": verdict(diffs, direction, margin, interval),
            "direction": direction, "se": se, **kind, **extra}


def claims_table(claims: Sequence[dict]) -> str:
    rows = [{"claim": c["claim"], "paper": c["paper"],
             "ours (mean ± std)": f"{c['mean']:+.2f} ± {c['std']:.2f}",
             "per seed": ", ".join(f"{x:+.1f}" for x in c["per_seed"]), "verdict": c["verdict"]} for c in claims]
    return common.markdown_table(rows, ["claim", "paper", "ours (mean ± std)", "per seed", "verdict"])


def mean_std_table(per_seed: dict, columns: Sequence[str], first: str = "model") -> str:
    """per_seed: row name -> list (one dict per seed) -> 'mean ± std' cells."""
    rows = []
    for name, runs in per_seed.items():
        row = {first: name}
        for c in columns:
            vals = np.array([r[c] for r in runs], dtype=float)
            row[c] = f"{vals.mean():.1f} ± {vals.std(ddof=1):.1f}" if len(vals) > 1 else f"{vals[0]:.1f}"
        rows.append(row)
    return common.markdown_table(rows, [first, *columns])


def report_demo(out, head: str, base: dict, runs: dict, claims: list, columns: Sequence[str], t0: float,
                figure: Callable[[Path], Path], **extra) -> dict:
    """Prints a demo's mean ± std table and claims table, draws its figure and
    writes out/results.json with every seed's numbers; returns the record."""
    out = Path(out)
    table = mean_std_table({"CLIP": [base], **runs}, columns)
    fig = figure(out)
    wall = time.time() - t0
    print(f"{head}\n\n{table}\n\nClaims (paired differences, verdict by 2 standard errors):\n\n"
          f"{claims_table(claims)}\n\nwall time {wall:.0f}s")
    record = {"settings": "demo settings (not the paper's)", **extra, "seeds": list(SEEDS), "base": base,
              "per_seed": runs, "claims": claims, "table": table, "figure": str(fig), "wall_seconds": wall,
              "machine": common.machine_info()}
    common.write_results(out, record)
    return record


def run_seeds(seeds: Sequence[int], fn: Callable[[int], dict], log=print) -> list[dict]:
    """fn(seed) for every seed, in order; nothing dropped."""
    out = []
    for s in seeds:
        t0 = time.time()
        out.append(fn(s))
        log(f"[lab] seed {s} done in {time.time() - t0:.0f}s")
    return out


# =============================================================================
# 6. Figures (matplotlib, Agg: no display needed)
# =============================================================================
def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path) -> Path:
    common.atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=130, bbox_inches="tight", format="png"))
    pyplot().close(fig)
    return Path(path)


def matrix_figure(matrices: dict, tasks: Sequence[str], path, caption: str, unit: str = "R@1 (%)",
                  row_first: str = "CLIP") -> Path:
    """Continual demos (C-CLIP, DNS): the R[i][j] matrix of each method as a
    heat-map, side by side, on one colour scale. matrices: method -> list of
    per-seed matrices (rows: before training, after task 1..T; columns: the
    tasks); cells show the mean over seeds and, below it, the std."""
    plt = pyplot()
    means = {k: np.mean(np.asarray(v, dtype=float), 0) for k, v in matrices.items()}
    stds = {k: np.std(np.asarray(v, dtype=float), 0, ddof=1) if len(v) > 1 else np.zeros_like(means[k])
            for k, v in matrices.items()}
    lo, hi = min(m.min() for m in means.values()), max(m.max() for m in means.values())
    fig, axes = plt.subplots(1, len(means), figsize=(3.3 * len(means) + 1, 3.6), squeeze=False)
    rows = [row_first] + [f"after {t}" for t in tasks]
    for ax, (name, m) in zip(axes[0], means.items()):
        im = ax.imshow(m, vmin=lo, vmax=hi, cmap="viridis", aspect="auto")
        for i in range(m.shape[0]):
            for j in range(m.shape[1]):
                ax.text(j, i, f"{m[i, j]:.1f}\n±{stds[name][i, j]:.1f}", ha="center", va="center", fontsize=6.5,
                        color="white" if m[i, j] < (lo + hi) / 2 else "black")
        ax.set_xticks(range(len(tasks)), [f"test {t}" for t in tasks], rotation=30, fontsize=7)
        ax.set_yticks(range(len(rows)), rows if ax is axes[0][0] else [""] * len(rows), fontsize=7)
        ax.set_title(f"{name} ({len(matrices[name])} seeds)", fontsize=9)
    fig.colorbar(im, ax=list(axes[0]), label=f"{unit}, mean over seeds", shrink=0.85)
    fig.suptitle(caption, fontsize=8)
    return save_figure(fig, path)


def bar_panels(runs: dict, base: dict, units: dict, path, caption: str, paper: dict | None = None,
               paper_names: Sequence[str] = ()) -> Path:
    """One panel per column (units = {column: axis label}): bars = mean over
    seeds with ± std error bars, first `base` ("identity", one value), then
    each run of runs = {name: [per-seed dicts]}; beside them, hatched, the
    paper's values paper[column] (named paper_names) where it has them."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(units), figsize=(3.0 * len(units), 3.4))
    for ax, (col, unit) in zip(axes, units.items()):
        names = ["identity", *runs]
        vals = [np.array([base[col]])] + [np.array([r[col] for r in v], dtype=float) for v in runs.values()]
        ax.bar(range(len(names)), [v.mean() for v in vals], yerr=[v.std(ddof=1) if len(v) > 1 else 0 for v in vals],
               color=["0.6", "tab:red", "tab:blue", "tab:green"], capsize=3)
        if col in (paper or {}):
            ax.bar([len(names), len(names) + 1], paper[col], color="none", edgecolor=["tab:red", "tab:blue"],
                   hatch="//")
            names += list(paper_names)
        ax.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=7)
        ax.set_ylabel(unit, fontsize=8)
        ax.axhline(0, color="k", lw=0.5)
    fig.suptitle(caption, fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


# =============================================================================
# 7. Sweeps: one folder per run, resume by skipping finished runs, curves
# =============================================================================
def sweep_run(out, name: str, fn: Callable[[Path], dict]) -> dict:
    """One run of a sweep, in its own folder out/name. A finished run (its
    run.json exists) is read back and skipped, so a sweep that stopped part
    way resumes at the first unfinished run; an unfinished folder is cleared
    and its run starts afresh (runs are never continued from a half state).
    fn(folder) trains and measures; its dict is written to folder/run.json."""
    folder = Path(out) / name
    done = folder / "run.json"
    if done.exists():
        print(f"[sweep] {name}: finished earlier, skipped ({done})", file=sys.stderr)
        return json.loads(done.read_text())
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    record = {"run": name, **fn(folder)}
    common.atomic_write(done, json.dumps(record, indent=1, default=float))
    return record


def prefix_manifest(src, n: int, dst) -> Path:
    """The first n rows of a manifest (all of them when it has fewer), image
    paths made absolute so that the copy can live anywhere: a data-size sweep
    trains on prefixes of ONE fixed order."""
    src = Path(src)
    rows = common.read_manifest(src)
    key = next((k for k in common.IMAGE_KEYS if rows and k in rows[0]), None)
    lines = []
    for r in rows[:n]:
        r = {k: v for k, v in r.items() if k != "_line"}
        if key is not None:
            r[key] = str((src.parent / str(r[key])).resolve())
        lines.append(json.dumps(r))
    if len(rows) < n:
        print(f"[sweep] {src} has {len(rows)} rows, fewer than {n}: all of them are used", file=sys.stderr)
    return common.atomic_write(dst, "\n".join(lines) + "\n")


class EpochSnapshots:
    """Hooks for common.train that keep the model's weights after the last
    step of every epoch: saved (common.save_model) to folder/epoch<k>.pt, or
    with folder=None kept in memory (the lab's small models). One run thus
    gives the per-epoch checkpoints a training-length sweep evaluates
    afterwards. Reads the weights only (no gradient, no random number), so
    the run is the one it would be without the hooks. The copy is taken
    before train_step's logit-scale clamp, a no-op unless the temperature is
    trained past ln 100. snapshots: one path or state_dict per epoch."""

    def __init__(self, folder, backbone: str, steps_per_epoch: int):
        self.folder, self.backbone, self.steps_per_epoch = folder, backbone, max(1, steps_per_epoch)
        self.step, self.snapshots = 0, []

    def before_optimizer_step(self, net):
        pass

    def after_optimizer_step(self, net):
        self.step += 1
        if self.step % self.steps_per_epoch or common.dist_info()[0] != 0:
            return
        if self.folder is None:
            self.snapshots.append({k: v.detach().clone() for k, v in net.model.state_dict().items()})
        else:
            path = Path(self.folder) / f"epoch{self.step // self.steps_per_epoch}.pt"
            self.snapshots.append(common.save_model(net.model, path, self.backbone, source=f"step {self.step}"))


def curves_figure(panels: Sequence[dict], path, caption: str, xlabel: str, log_x: bool = False) -> Path:
    """A sweep's figure: one panel per measure. panel: title, ylabel, series
    {name: (xs, per_seed)} with per_seed (n_seeds, len(xs)) drawn as the mean
    over seeds with a +-1 std band and every seed as a dot; optional paper
    {label: (xs, ys)} drawn as black squares joined by a dashed line. xs may
    be strings (categories): then no lines join the points."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels) + 0.6, 3.6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        series = panel.get("series", {})
        for i, (name, (xs, per_seed)) in enumerate(series.items()):
            ys = np.atleast_2d(np.asarray(per_seed, dtype=float))  # (n_seeds, len(xs))
            categorical = isinstance(xs[0], str)
            x = np.arange(len(xs)) + 0.12 * (i - (len(series) - 1) / 2) if categorical else np.asarray(xs, float)
            mean = ys.mean(0)
            std = ys.std(0, ddof=1) if len(ys) > 1 else np.zeros(len(mean))
            label = f"{name} ({len(ys)} seeds)" if len(ys) > 1 else name
            if categorical:
                color = ax.errorbar(x, mean, yerr=std, fmt="o", capsize=4, label=label).lines[0].get_color()
                ax.set_xticks(np.arange(len(xs)), xs, rotation=25, fontsize=7)
            else:
                color = ax.plot(x, mean, "-o", ms=4, label=label)[0].get_color()
                ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.2, lw=0)
            for row in (ys if len(ys) > 1 else ()):
                ax.scatter(x, row, s=6, color=color, alpha=0.5)
        for style, (label, (xs, ys)) in zip(("s--", "^:", "v-."), panel.get("paper", {}).items()):
            ax.plot(xs, ys, style[0] if isinstance(xs[0], str) else style, color="black", ms=6, label=label)
        if log_x:
            ax.set_xscale("log")
        ax.set(xlabel=panel.get("xlabel", xlabel), ylabel=panel["ylabel"], title=panel["title"])
        ax.title.set_fontsize(9)
        ax.legend(fontsize=7)
    fig.suptitle(caption, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    return save_figure(fig, path)
