"""The lab's synthetic world: scenes, captions, pixels and splits, the
continual task domains, and a multimodal feature world for DNS in CMCL's
setting. Importing the lab registers the world's evaluation sets with eval.py
and its continual tasks with common.py (see lab/__init__.py).

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
                         an unseen domain ('unseen') no task trains on; a
                         knob (conflict, issue 71) renames a share of each
                         domain's colour and shape words, its own way, so
                         that the domains' supervision conflicts.

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

"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

import common
from plumbing.base import atomic_write
from plumbing.manifests import read_manifest
import eval as evaluation
from papers import cmcl

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
ALT_DESCRIPTIVE = 0.3  # share of pretraining alt-texts that open like a long caption ('there is a ...')

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
    names: tuple = ()         # (word, caption word) pairs: colours / shapes its captions call by another name
    descriptive: bool = True  # alt: False writes the ALT_DESCRIPTIVE draws plainly, the same draws (long-world-3)


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


# Conflicting supervision across the continual domains (issue 71, item 1). In today's world the domains share
# concepts and name the pixels alike (photo and sketch both draw red squares and call them "red square"), so each
# later task rehearses the earlier ones and full FT forgets a third of what it learned (docs/calibration-cclip-
# gates.json), where the papers' full FT forgets most of it. The knob, `conflict` (a strength in [0, 1]): each
# domain calls a share of its concept words (its 3 colours and 3 shapes) by another word of the same family, its
# own renaming, drawn once per domain (conflict_names); a colour word then names other pixels in another domain or
# in pretraining, so learning one domain's names overwrites another's. The renaming is one-to-one within a domain,
# so a domain's captions say exactly as much as before. Strength 0 is today's world, byte for byte (the manifests
# themselves: conflict_manifest returns them). Reaches the tasks through task_manifests / long_task_manifests /
# scene_labelled_tasks(conflict=...); no demo uses it yet (its strength: python -m lab.calibrate continual-world).
CONFLICT_FAMILIES = ("color", "shape")  # the caption words that are renamed; backgrounds: task captions never name them


def conflict_names(domain: str, strength: float) -> dict[str, str]:
    """A continual domain's renamed caption words at `strength`: word -> the word its captions use instead. The
    domain's concept words (colours, then shapes) in an order of its own; the first round(strength x 6) of them are
    renamed, each to a distinct word of its family that none of the domain's kept words holds, never to itself.
    Deterministic per domain (its own seeded stream); a higher strength renames the same words and more (their
    new names drawn again)."""
    d = TASK_DOMAINS[domain]
    if not 0.0 <= strength <= 1.0:
        raise ValueError(f"conflict strength {strength} is not in [0, 1]")
    rng = random.Random(f"clipft-lab-conflict-{domain}")
    words = [(f, w) for f, ws in (("color", d.colors), ("shape", d.shapes)) for w in ws]
    rng.shuffle(words)
    moved = words[:math.floor(strength * len(words) + 0.5)]
    names = {}
    for family in CONFLICT_FAMILIES:
        vocab = list(COLORS) if family == "color" else list(SHAPES)
        ours = [w for f, w in moved if f == family]
        kept = {w for f, w in words[len(moved):] if f == family}
        free = [w for w in vocab if w not in kept]
        while True:  # a draw of distinct new names, none a word's own (the stream is seeded: deterministic)
            new = rng.sample(free, len(ours))
            if all(a != b for a, b in zip(ours, new)):
                break
        names.update(zip(ours, new))
    return names

# name -> (domain, size, seed)
SPLITS = {
    "train": (FINETUNE, 2000, 1), "test": (FINETUNE, 400, 2), "val": (FINETUNE, 400, 5),
    "zs-test": (ZS_DOMAIN, 720, 3), "unseen": (UNSEEN, 300, 4), "zs-val": (ZS_DOMAIN, 720, 6),
    **{f"task-{d}": (dom, 600, 10 + i) for i, (d, dom) in enumerate(TASK_DOMAINS.items())},
    **{f"task-{d}-test": (dom, 200, 20 + i) for i, (d, dom) in enumerate(TASK_DOMAINS.items())},
    **{f"task-{d}-val": (dom, 200, 30 + i) for i, (d, dom) in enumerate(TASK_DOMAINS.items())},  # calibration only
}


def label_sets():
    """Zero-shot label sets of the world: name -> (classnames, templates, manifest column)."""
    return {"shape": (list(SHAPES), list(SHAPE_TEMPLATES), "shape"),
            "color": (list(COLORS), list(COLOR_TEMPLATES), "color"),
            "background": (list(BACKGROUNDS), list(BACKGROUND_TEMPLATES), "background")}


# Finer facts of a scene, for DNS's lab (issue 39): the main object's cell and the number of objects. Kept out of
# label_sets(), whose prompts are the tiny model's token rows and enter the world's fingerprint; the prompts' words
# are all the captions' own. The labels come from scene_labels_manifest's copies of the splits.
POSITION_TEMPLATES = ("an object at the {}.", "a large object at the {}.", "a picture of something at the {}.")
COUNT_TEMPLATES = ("the picture shows {} objects in total.", "{} objects.", "a picture of {} objects.")


def scene_label_sets():
    """DNS's finer label sets: name -> (classnames, templates, manifest column), as label_sets()."""
    return {"position": (list(POSITIONS), list(POSITION_TEMPLATES), "position"),
            "count": (list(NUMBERS[1:]), list(COUNT_TEMPLATES), "count")}


def finetune_classes():
    """Per label set, the classes the fine-tuning pool shows (the rest only pretraining saw)."""
    return {"shape": list(FINETUNE.shapes), "color": list(FINETUNE.colors), "background": []}


# =============================================================================
# 2. Scenes, captions, pixels
# =============================================================================
def _name(o):
    return f"{o['color']} {o['shape']}"


def _namer(names: dict):
    """_name with a domain's caption words (Domain.names) in place of the world's colour and shape words."""
    return (lambda o: f"{names.get(o['color'], o['color'])} {names.get(o['shape'], o['shape'])}") if names else _name


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
    name = _namer(dict(domain.names))  # the domain's caption words (conflict_names); none: the world's own
    if domain.captions == "alt":  # web alt-text: the main object (sometimes a second one) and the background
        second = rng.choice(others) if others and rng.random() < 0.4 else None
        what = f"a {main['size']} {name(main)}" + (f" and {_a(name(second))}" if second else "")
        caption = rng.choice((f"{what} on a {bg} background.",
                              f"{bg} background with {what}.",
                              f"{what} at the {POSITIONS[main['cell']]}, {bg} background.",
                              f"a picture of {what} on a {bg} background."))
        if others and rng.random() < ALT_DESCRIPTIVE:  # a descriptive alt-text, in the long captions' words
            other = rng.choice(others)
            if domain.descriptive:
                caption = (f"there is a {main['size']} {name(main)} at the {POSITIONS[main['cell']]} and "
                           f"{_a(name(other))}, {bg} background.")
    else:  # COCO style: the main object, where it is, one neighbour; never the background
        rest = f" next to {_a(name(others[0]))}" if others else ""
        lead = f"{domain.phrase} " if domain.phrase else ""
        caption = f"{lead}a {main['size']} {name(main)} at the {POSITIONS[main['cell']]}{rest}."
    # ShareGPT4V style: every object, the count, relations, sizes (5-10 sentences)
    sentences = [f"There is a {o['size']} {name(o)} at the {POSITIONS[o['cell']]}." for o in objs]
    sentences.append(f"The picture shows {NUMBERS[n]} object{'s' if n > 1 else ''} in total.")
    pairs = [(a, b) for i, a in enumerate(objs) for b in objs[i + 1:]]
    for a, b in rng.sample(pairs, min(3, len(pairs))):
        sentences.append(f"The {name(a)} is {_relation(a, b)} the {name(b)}.")
    n_large = sum(o["size"] == "large" for o in objs)
    sentences.append(f"{NUMBERS[n_large].capitalize()} of them {'is' if n_large == 1 else 'are'} large."
                     if n > 1 else f"The {name(main)} is large.")
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


def world_texts() -> list[str]:
    """Every kind of text the world writes: the prompts of every label set, the short and long captions of 300
    scenes of every split and of pretraining (the tiny CLIP's token rows, the towers' WordPiece vocabulary)."""
    texts = [t.format(c) for classes, templates, _ in label_sets().values() for t in templates for c in classes]
    for domain, _, seed in [*SPLITS.values(), (PRETRAIN, 0, 100)]:
        texts += [x for sc in world_split(domain, 300, seed) for x in (sc["caption"], sc["long_caption"])]
    return texts


@functools.cache
def world_fingerprint() -> str:
    """A digest of what the world draws: the texts and labels of the first scenes
    of every split and of pretraining, and a few rendered pictures. Names the
    folder the splits are written to and keys the tiny model's weights, so a
    changed world never reads stale files."""
    h = hashlib.sha1()
    for domain, _, seed in [*SPLITS.values(), (PRETRAIN, 0, 100)]:
        for i, s in enumerate(world_split(domain, 40, seed)):
            h.update(json.dumps([s["caption"], s["long_caption"], s["labels"], s["style"]]).encode())
            if i < 2:
                h.update(np.asarray(render(s, seed=seed * 100003 + i)).tobytes())
    return h.hexdigest()[:8]


def synthetic_manifest(split: str, data_root="data", n: int | None = None) -> Path:
    """Writes (once) a split of the world as PNG files plus a JSONL manifest
    under data_root/synthetic/ and returns the manifest path. n: only the
    first n scenes (tests). Demos and tests read it back through
    common.ManifestDataset, like real data. The pictures are rendered into a
    folder of this process's own and renamed into place whole, the manifest
    written atomically after: processes that write the same split at once
    (a demo's parallel runs) never read a half-written file."""
    if split not in SPLITS:
        raise ValueError(f"unknown synthetic split {split!r}; known: {', '.join(SPLITS)}")
    domain, size, seed = SPLITS[split]
    root = Path(data_root) / "synthetic" / f"world-{world_fingerprint()}"
    name = split if n is None else f"{split}-{n}"
    manifest, folder = root / f"{name}.jsonl", root / name
    if manifest.exists():
        return manifest
    scenes = world_split(domain, n or size, seed)
    lines = [json.dumps({"image": f"{name}/{i:05d}.png", "caption": s["caption"], "long_caption": s["long_caption"],
                         "background": s["labels"]["background"], "shape": s["labels"]["shape"],
                         "color": s["labels"]["color"], "style": s["style"]}) for i, s in enumerate(scenes)]
    if len(list(folder.glob("*.png"))) != len(scenes):  # absent, or left half-written by an older version
        own = root / f".{name}.{os.getpid()}.{os.urandom(4).hex()}"  # not random: its state stays seeded
        own.mkdir(parents=True)
        for i, s in enumerate(scenes):
            render(s, seed=seed * 100003 + i).save(own / f"{i:05d}.png")
        try:
            os.rename(own, folder)  # atomic; fails when another process's whole folder is there already
        except OSError:
            if len(list(folder.glob("*.png"))) != len(scenes):
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(own, folder)
            else:
                shutil.rmtree(own, ignore_errors=True)
    atomic_write(manifest, "\n".join(lines) + "\n")
    return manifest


def _write_rows(target: Path, rows: list[dict]) -> None:
    """A manifest copy's rows (read_manifest's, a column changed or added) written as JSONL at `target` at once
    (atomic_write), without read_manifest's '_line' (a copy's lines are its own)."""
    atomic_write(target, "".join(json.dumps({k: v for k, v in r.items() if k != "_line"}) + "\n" for r in rows))


def conflict_manifest(path, conflict: float = 0.0) -> Path:
    """A copy of a continual domain's split manifest (`task-D`, `task-D-test`, `task-D-val`, `-n` and its
    scene_labels_manifest copy too) whose 'caption' and 'long_caption' are its scenes' captions drawn again with the
    domain's conflict_names at strength `conflict` (written once, next to the original, so image paths still hold);
    conflict 0: `path` itself. Every split of one domain is renamed alike; the rows must be the world's scenes."""
    path = Path(path)
    if not conflict:
        return path
    target = path.with_name(f"{path.stem}-conflict{conflict:.3g}.jsonl")
    if target.exists():
        return target
    stem = path.stem.removesuffix("-scene-labels")
    split, _, n = stem.rpartition("-")
    split, n = (split, int(n)) if n.isdigit() and split in SPLITS else (stem, None)
    domain = split.removeprefix("task-").removesuffix("-test").removesuffix("-val")
    if split not in SPLITS or domain not in TASK_DOMAINS:
        raise ValueError(f"{path}: not a continual domain's split manifest")
    dom, size, seed = SPLITS[split]
    renamed = dataclasses.replace(dom, names=tuple(sorted(conflict_names(domain, conflict).items())))
    rows, scenes = read_manifest(path), world_split(dom, n or size, seed)
    if len(rows) != len(scenes) or any(r["caption"] != s["caption"] for r, s in zip(rows, scenes)):
        raise ValueError(f"{path}: its rows are not the world's {split!r} scenes (a stale copy?)")
    _write_rows(target, [{**r, "caption": s["caption"], "long_caption": s["long_caption"]}
                         for r, s in zip(rows, world_split(renamed, n or size, seed))])
    return target


def task_manifests(data_root="data", n_train=None, n_test=None, conflict: float = 0.0) -> list[tuple[str, Path, Path]]:
    """The continual domains in order: (name, train manifest, test manifest); conflict: their captions renamed
    (conflict_manifest; 0, the default: today's world)."""
    return [(d, conflict_manifest(synthetic_manifest(f"task-{d}", data_root, n_train), conflict),
             conflict_manifest(synthetic_manifest(f"task-{d}-test", data_root, n_test), conflict))
            for d in TASK_DOMAINS]


# Where the window reads (issue 71, item 2). The long captions open with their object sentences, in cell order
# ("There is a large red circle at the top left."), so the 24-token window reads the first one or two objects, in
# words pretraining already taught: ALT_DESCRIPTIVE of its alt-texts open the same way ("there is a large red circle
# at the top left and ..."). CLIP reads that window at 23 % truncated long R@1 (val), above its sentence-mean 14 %, and
# ERCLIP's sentence-level training adds 1-3 points there against 13 read sentence by sentence
# (docs/calibration-erclip-gates.json). Two knobs of how the fine-tuning pool's long captions are written
# (LongCaptions; the default is the shared world, whose manifests are returned as they are), chosen by rules on CLIP
# and M alone (python -m lab.calibrate long-world, long-world-2):
#   lead      the first `lead` whole-scene sentences (the count, the relations, the sizes, the style) open the caption
#             ahead of its object sentences, as ShareGPT4V's captions open with a sentence about the whole image
#             (Long-CLIP's training code takes a caption's first sentence as its short caption: beichenzbc/Long-CLIP,
#             train/sharegpt4v.py). Only the order moves.
#   register  that share of the object sentences is written in a register pretraining never used ("The top left
#             holds a large red circle."; REGISTER), as ShareGPT4V's captions, written by a captioning model, are not
#             CLIP's web alt-text. The same facts, one sentence for one; which sentences move is drawn per caption
#             (its own seeded stream), and a higher share rewrites the same sentences and more.
# Every picture, short caption and the tiny model's window are the shared world's, so nothing is pretrained again.
OBJECT_SENTENCE = "There is a "  # how every object sentence of a long caption opens (scene(): one per object)
OBJECT_PATTERN = re.compile(r"There is a (small|large) (\w+ \w+) at the ((?:top|bottom) (?:left|right))\.")
REGISTER = "The {pos} holds a {size} {name}."


def summary_first(long_caption: str, lead: int) -> str:
    """A long caption with its first `lead` whole-scene sentences (every sentence that does not open with
    OBJECT_SENTENCE) moved, in their order, ahead of its object sentences; the others keep their order. The same
    sentences, each as often as before."""
    if lead < 0:
        raise ValueError(f"lead {lead} is not >= 0")
    sentences = evaluation.split_sentences(long_caption)
    moved = [i for i, x in enumerate(sentences) if not x.startswith(OBJECT_SENTENCE)][:lead]
    return " ".join(sentences[i] for i in moved + [i for i in range(len(sentences)) if i not in moved])


def long_register(long_caption: str, share: float) -> str:
    """A long caption with each object sentence rewritten in REGISTER with probability `share` (one draw per object
    sentence, from a stream seeded by the caption: deterministic, and a higher share rewrites a superset)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"register share {share} is not in [0, 1]")
    rng = random.Random(f"clipft-lab-register-{long_caption}")
    out = []
    for x in evaluation.split_sentences(long_caption):
        m = OBJECT_PATTERN.fullmatch(x)
        if m and rng.random() < share:
            x = REGISTER.format(size=m[1], name=m[2], pos=m[3])
        out.append(x)
    return " ".join(out)


@dataclasses.dataclass(frozen=True)
class LongCaptions:
    """How the fine-tuning pool's long captions are written (the knobs above); the default: as drawn."""
    lead: int = 0
    register: float = 0.0

    def rewrite(self, long_caption: str) -> str:
        return summary_first(long_register(long_caption, self.register), self.lead)

    def manifest(self, path) -> Path:
        """A copy of a synthetic split's manifest with its long captions rewritten (written once, next to the
        original, so image paths still hold); the shared world's: `path` itself."""
        path = Path(path)
        if self == AS_DRAWN:
            return path
        tag = (f"-register{self.register:.3g}" if self.register else "") + (f"-lead{self.lead}" if self.lead else "")
        target = path.with_name(f"{path.stem}{tag}.jsonl")
        if not target.exists():
            _write_rows(target, [{**r, "long_caption": self.rewrite(r["long_caption"])} for r in read_manifest(path)])
        return target

    def synthetic_manifest(self, split: str, data_root="data", n: int | None = None) -> Path:
        """synthetic_manifest with the long captions rewritten: a LabWorld's synthetic_manifest."""
        return self.manifest(synthetic_manifest(split, data_root, n))


AS_DRAWN = LongCaptions()


def long_caption_manifest(path) -> Path:
    """A copy of a synthetic manifest whose 'caption' is the row's long
    caption (written once, next to the original, so image paths still hold)."""
    path = Path(path)
    target = path.with_name(f"{path.stem}-long-as-caption.jsonl")
    if not target.exists():
        _write_rows(target, [{**r, "caption": r["long_caption"]} for r in read_manifest(path)])
    return target


def scene_labels_manifest(path) -> Path:
    """A copy of a synthetic split's manifest (`split` or `split-n`) with the columns of scene_label_sets():
    'position' (the main object's cell) and 'count' (objects - 1), from the split's scenes drawn again; written once,
    next to the original. The rows' captions must be the scenes' (a stale manifest is refused)."""
    path = Path(path)
    target = path.with_name(f"{path.stem}-scene-labels.jsonl")
    if target.exists():
        return target
    split, _, n = path.stem.rpartition("-")
    split, n = (split, int(n)) if n.isdigit() and split in SPLITS else (path.stem, None)
    if split not in SPLITS:
        raise ValueError(f"{path}: not a synthetic split's manifest")
    domain, size, seed = SPLITS[split]
    rows = read_manifest(path)
    scenes = world_split(domain, n or size, seed)
    if len(rows) != len(scenes) or any(r["caption"] != s["caption"] for r, s in zip(rows, scenes)):
        raise ValueError(f"{path}: its rows are not the world's {split!r} scenes (a stale copy?)")
    out = []
    for r, s in zip(rows, scenes):
        main = next(o for o in s["objects"] if o["size"] == "large")
        out.append({**r, "position": main["cell"], "count": len(s["objects"]) - 1})
    _write_rows(target, out)
    return target


def scene_labelled_tasks(data_root="data", long: bool = False, test: str = "test", conflict: float = 0.0) -> str:
    """DNS's lab tasks: the continual domains as a --tasks spec whose `test` splits ('test' or 'val') carry the
    scene_label_sets() columns; long: trained and tested on the long captions; conflict: their captions renamed
    (conflict_manifest; 0, the default: today's world)."""
    spec = []
    for d in TASK_DOMAINS:
        tr = conflict_manifest(synthetic_manifest(f"task-{d}", data_root), conflict)
        te = conflict_manifest(scene_labels_manifest(synthetic_manifest(f"task-{d}-{test}", data_root)), conflict)
        if long:
            tr, te = long_caption_manifest(tr), long_caption_manifest(te)
        spec.append(f"{d}={tr}:{te}")
    return ",".join(spec)


def long_task_manifests(data_root="data", conflict: float = 0.0) -> list[tuple[str, str, str]]:
    """The continual domains trained and tested on their long captions
    (C-CLIP's --tasks synthetic-long): (name, train manifest, test manifest);
    conflict: their captions renamed (conflict_manifest; 0: today's world)."""
    return [(d, str(long_caption_manifest(tr)), str(long_caption_manifest(te)))
            for d, tr, te in task_manifests(data_root, conflict=conflict)]


# --- a multimodal feature world (DNS in CMCL's setting; features, not pixels) ---
def synthetic_multimodal(out, layout: str = "cmcl", perceptor: str = "imagebind", datasets: dict | None = None,
                         dim: int = 24, n_train: int = 128, n_test: int = 64, n_classes: int = 5, latent: int = 12,
                         active: int = 6, spread: float = 0.6, noise: float = 0.3, conflict: float = 0.0,
                         seed: int = 0) -> Path:
    """A multimodal world for tests and the demo, written in `layout` ('cmcl'
    or 'ours'). Every sample has latent factors z (latent,); a dataset uses
    `active` of them (its own random subset, so datasets overlap in part);
    classes are cluster means in z. Modality m sees x_m = normalise(A_m z +
    noise e), A_m = A_shared + spread B_m (dim, latent): shared structure (so
    the identity maps start partly aligned, like a pretrained binding model)
    plus a modality-specific part and modality-specific noise e; conflict > 0
    adds a part of each dataset's own (conflict C_{d,m}), so that a map fitted
    to one dataset misaligns another (tasks that forget). Class text
    features: normalise(A_text mu_c), noise-free. datasets: name -> (modality
    names, has classes); default: papers.cmcl.CMCL_DATASETS with their real names.
    The layouts are papers.cmcl.read_features'; DNS's demo in CMCL's setting and its
    tests run on this world (dns.py --demo-cmcl)."""
    g = torch.Generator().manual_seed(seed)
    datasets = datasets or {k: (m, "acc" in t) for k, (m, t) in cmcl.CMCL_DATASETS.items()}
    names = sorted({m for mods, _ in datasets.values() for m in mods})
    A_shared = torch.randn(dim, latent, generator=g) / math.sqrt(latent)
    A = {m: A_shared + spread * torch.randn(dim, latent, generator=g) / math.sqrt(latent) for m in names}
    g_conflict = torch.Generator().manual_seed(seed + 7919)  # its own stream: conflict 0 draws the same world

    def mixing(m):  # a modality's mixing in the next dataset: the shared one, moved by the dataset's own part
        return A[m] + conflict * torch.randn(dim, latent, generator=g_conflict) / math.sqrt(latent) if conflict \
            else A[m]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for d, (mods, has_classes) in datasets.items():
        A_d = {m: mixing(m) for m in dict.fromkeys((*mods, *(("text",) if "text" in A else ())))}
        mask = torch.zeros(latent)
        mask[torch.randperm(latent, generator=g)[:active]] = 1.0
        mu = torch.randn(n_classes, latent, generator=g) * 1.5 * mask
        class_names = [f"{d} class {c}" for c in range(n_classes)]
        class_x = torch.nn.functional.normalize(mu @ (A_d["text"] if "text" in A else A_shared).t(), dim=-1)
        if layout == "ours":
            meta = {"modalities": list(mods)} | ({"classes": class_names} if has_classes else {})
            (out / d).mkdir(parents=True, exist_ok=True)
            (out / d / "meta.json").write_text(json.dumps(meta))
            if has_classes:
                torch.save(class_x, out / d / "classes.pt")
        elif has_classes:
            cmcl.write_h5(out / f"{d}_class_{perceptor}.h5", dict(zip(class_names, class_x)))
        for split, n in (("train", n_train), ("test", n_test)):
            labels = torch.randint(n_classes, (n,), generator=g)
            z = (mu[labels] if has_classes else 0) + torch.randn(n, latent, generator=g) * mask
            x = torch.stack([torch.nn.functional.normalize(z @ A_d[m].t() + noise * torch.randn(n, dim, generator=g),
                                                           dim=-1) for m in mods], 1)  # (N, M, d)
            ids = [f"{d}_{split}_{i:05d}" for i in range(n)]
            if layout == "ours":
                (out / d / split).mkdir(exist_ok=True)
                for k, m in enumerate(mods):
                    torch.save(x[:, k].clone(), out / d / split / f"{m}.pt")
                (out / d / split / "samples.json").write_text(json.dumps(
                    {"ids": ids} | ({"labels": labels.tolist()} if has_classes else {})))
            else:
                cmcl.write_h5(out / f"{d}_{split}_{perceptor}.h5", dict(zip(ids, x)))
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
# The world's evaluation sets (registered with eval.py by lab/__init__.py)
# =============================================================================
def synthetic_retrieval(split: str, root, column: str, n=None) -> evaluation.RetrievalSet:
    """n: the first n scenes only (tests, demos); None = the whole split."""
    ds = common.ManifestDataset(synthetic_manifest(split, root, n), need_long=True, check_images=False)
    paths = [str(ds.image_file(r)) for r in ds.rows]
    texts = [r[column] for r in ds.rows]
    return evaluation.RetrievalSet(f"synthetic-{split}-{column}", paths, texts, torch.arange(len(paths)),
                                   protocol=f"synthetic world, split {split}, 1:1, {column}")


def retrieval_tasks() -> dict:
    """Evaluation task names of the world -> loader(root, n=None)."""
    tasks = {
        "synthetic-short": lambda root, n=None: synthetic_retrieval("test", root, "caption", n),
        "synthetic-long": lambda root, n=None: synthetic_retrieval("test", root, "long_caption", n),
        "synthetic-unseen": lambda root, n=None: synthetic_retrieval("unseen", root, "caption", n),
        "synthetic-unseen-long": lambda root, n=None: synthetic_retrieval("unseen", root, "long_caption", n),
    }
    for d in TASK_DOMAINS:
        tasks[f"synthetic-task-{d}"] = (lambda d: lambda root, n=None: synthetic_retrieval(
            f"task-{d}-test", root, "caption", n))(d)
    return tasks


def classification_set(name: str, root, n=None, split: str = "zs-test") -> evaluation.ClassificationSet:
    """'synthetic-shape' / '-color' / '-background': zero-shot on 'zs-test' (lab/calibrate.py: 'zs-val')."""
    classnames, templates, column = label_sets()[name.removeprefix("synthetic-").removesuffix("-val")]
    ds = common.ManifestDataset(synthetic_manifest(split, root, n), check_images=False, extra=(column,))
    return evaluation.ClassificationSet(name, [str(ds.image_file(r)) for r in ds.rows],
                                        torch.tensor([int(r[column]) for r in ds.rows]), classnames, templates,
                                        protocol=f"synthetic world, {split} split, {column} "
                                                 f"({len(classnames)} classes)")


def classification_tasks() -> dict:
    return {"synthetic-" + k: (lambda k: lambda root, n=None: classification_set("synthetic-" + k, root, n))(k)
            for k in label_sets()}
