"""ImageNet's five distribution shifts as WiSE-FT evaluates them (Wortsman et al., "Robust fine-tuning of zero-shot
models", CVPR 2022, arXiv:2109.01903, Sec. 2 / Tab. 1; github.com/mlfoundations/wise-ft, src/datasets/ and
src/models/eval.py), read from each release's own layout under the data root; FLYP and CaRot report the same five.

  imagenet-v2      imagenetv2-matched-frequency-format-val/<index 0..999>/*.jpeg (label = the folder's number;
                   imagenetv2_pytorch's layout), 1,000 classes
  imagenet-r       imagenet-r/<wnid>/ (200 folders), labels in sorted-folder order; logits masked to its 200 classes
  imagenet-a       imagenet-a/<wnid>/ (200 folders), as imagenet-r with its own 200
  imagenet-sketch  sketch/<wnid>/ (1,000 folders), 1,000 classes
  objectnet        objectnet-1.0/images/<folder>/ for the 113 folders that map to ImageNet (the others are left out),
                   a 2-pixel border cropped off each image; each class's logit = the max over the ImageNet classes
                   it maps to (project_logits)

The class subsets (imagenet_a.py / imagenet_r.py's CLASS_SUBLIST) and ObjectNet's map (objectnet.py's get_metadata
over objectnet_metadata/) are data, in protocols/imagenet_shifts.json. Masking a zero-shot head's logits to a
subset equals a head built from the subset's class names alone (the same rows of img @ W), so imagenet-r / -a are
read as 200-class sets; ObjectNet's max over groups is not a linear head and keeps its groups.
Class names and templates: ImageNet's (OpenAI's names, the 80 templates), as WiSE-FT's get_classnames('openai').
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from plumbing.base import DataError, inside_folder, shorten, warn_once

DATA = json.loads(Path(__file__).with_name("imagenet_shifts.json").read_text())
SUBSETS = {"imagenet-r": DATA["imagenet-r"], "imagenet-a": DATA["imagenet-a"]}  # ImageNet indices, sorted
OBJECTNET = [tuple(row) for row in DATA["objectnet"]]  # (folder, class name, [ImageNet indices]), folders sorted
SHIFTS = ("imagenet-v2", "imagenet-r", "imagenet-a", "imagenet-sketch", "objectnet")
LAYOUTS = {
    "imagenet-v2": ("imagenetv2-matched-frequency-format-val/<class index>/*.jpeg",
                    "https://huggingface.co/datasets/vaishaal/ImageNetV2 (imagenetv2-matched-frequency.tar.gz)"),
    "imagenet-r": ("imagenet-r/<wnid>/*.jpg, its 200 class folders", "https://github.com/hendrycks/imagenet-r"),
    "imagenet-a": ("imagenet-a/<wnid>/*.jpg, its 200 class folders",
                   "https://github.com/hendrycks/natural-adv-examples"),
    "imagenet-sketch": ("sketch/<wnid>/*.JPEG, the 1,000 class folders",
                        "https://github.com/HaohanWang/ImageNet-Sketch"),
    "objectnet": ("objectnet-1.0/images/<folder>/*.png (the release's 313 folders; 113 are read)",
                  "https://objectnet.dev/download.html (objectnet-1.0.zip)"),
}
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


class MissingShift(DataError):
    """A distribution-shift set not where LAYOUTS says."""


class CroppedImages:
    """ObjectNet's images with WiSE-FT's crop (objectnet.py crop(): (2, 2, width - 2, height - 2)), read lazily."""
    def __init__(self, paths):
        self.paths = list(paths)

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        from PIL import Image
        with Image.open(self.paths[i]) as im:
            w, h = im.size
            return im.convert("RGB").crop((2, 2, w - 2, h - 2))


def _files(folder: Path):
    return sorted(str(p) for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)


FOLDERS = {"imagenet-v2": "imagenetv2-matched-frequency-format-val", "imagenet-r": "imagenet-r",
           "imagenet-a": "imagenet-a", "imagenet-sketch": "sketch", "objectnet": "objectnet-1.0/images"}


def _need(path: Path, name: str, root) -> Path:
    if not path.is_dir():
        layout, source = LAYOUTS[name]
        raise MissingShift(f"{name}: {path} not found. Expected under the data root ({root}): {layout}. Get it "
                           f"from {source}. See docs/data.md, 'ImageNet distribution shifts'.")
    return path


def read(name: str, root, imagenet_classnames) -> dict:
    """One shift under the data root: {images (paths or CroppedImages), labels (N,), classnames (the zero-shot
    head's), groups (ObjectNet: per ObjectNet class, the ImageNet classes it maps to, labels index these; else
    None), protocol}."""
    root = Path(root)
    names = list(imagenet_classnames)
    if name == "imagenet-v2":
        base = _need(root / FOLDERS[name], name, root)
        pairs = [(f, int(d.name)) for d in sorted(base.iterdir(), key=lambda d: d.name) if d.name.isdigit()
                 for f in _files(d)]
        classes, groups = names, None
        absent = [str(k) for k in range(len(names)) if not (base / str(k)).is_dir()]
    elif name in ("imagenet-r", "imagenet-a", "imagenet-sketch"):
        base = _need(root / FOLDERS[name], name, root)
        folders = sorted(d.name for d in base.iterdir() if d.is_dir())
        sub = SUBSETS.get(name, range(1000))
        if len(folders) != len(sub):
            raise MissingShift(f"{name}: {base} holds {len(folders)} class folders, expected {len(sub)} "
                               f"({LAYOUTS[name][0]}; the sorted wnids give the labels). See docs/data.md, "
                               f"'ImageNet distribution shifts'.")
        pairs = [(f, k) for k, d in enumerate(folders) for f in _files(base / d)]
        classes, groups, absent = [names[i] for i in sub], None, []
    elif name == "objectnet":
        base = _need(root / FOLDERS[name], name, root)
        pairs = [(f, k) for k, (folder, _, _) in enumerate(OBJECTNET) if (base / folder).is_dir()
                 for f in _files(base / folder)]
        classes, groups = names, [list(ids) for _, _, ids in OBJECTNET]  # the head: ImageNet's; labels: groups
        absent = [folder for folder, _, _ in OBJECTNET if not (base / folder).is_dir()]
    else:
        raise DataError(f"unknown shift {name!r}; known: {', '.join(SHIFTS)}")
    if not pairs:
        raise MissingShift(f"{name}: no images under {base} ({LAYOUTS[name][0]})")
    images = [p for p, _ in pairs]
    inside_folder(root / FOLDERS[name].split("/")[0], images, name)  # a linked image leading out: refused
    protocol = (f"{name} ({len(images)} images, {len(classes)} classes), WiSE-FT's protocol"
                + (f": {len(groups)} classes, each logit the max over its ImageNet ones, 2-px crop" if groups else ""))
    if absent:  # issue 69.7: they were skipped without a word
        total = len(groups) if groups else len(classes)
        protocol += f", {len(absent)} of its {total} class folders absent (not WiSE-FT's whole set)"
        warn_once(f"[{name}] {len(absent)} of the {total} class folders it reads are absent under {base}, skipped: "
                  + shorten(", ".join(absent), 300) + f"; its accuracy is over the {total - len(absent)} there, "
                  f"not WiSE-FT's whole set ({LAYOUTS[name][0]}; {LAYOUTS[name][1]})")
    return {"images": CroppedImages(images) if name == "objectnet" else images,
            "labels": torch.tensor([k for _, k in pairs], dtype=torch.long), "classnames": classes,
            "groups": groups, "protocol": protocol}


def project_logits(logits: torch.Tensor, groups) -> torch.Tensor:
    """ObjectNet's logits (N, 113) from ImageNet's (N, 1000): class k's = max over its ImageNet classes groups[k]
    (WiSE-FT, objectnet.py ObjectNetBase.project_logits)."""
    return torch.stack([logits[:, g].max(dim=1).values for g in groups], dim=1)


def grouped_accuracy(img, classifier, labels, groups, ks=(1, 5)) -> dict:
    """Top-k accuracy (percent) of project_logits(img @ classifier); img (N, D), classifier (D, 1000) over ImageNet's
    classes; a tie with the gold class counts against it (as common.zero_shot_accuracy)."""
    logits = project_logits(img.float() @ classifier.float().to(img.device), groups)
    gold = logits.gather(1, labels.view(-1, 1).to(img.device))
    n_better = (logits >= gold).sum(1) - 1
    return {f"top{k}": 100.0 * (n_better < k).float().mean().item() for k in ks if k <= logits.shape[1]}


def shift_average(values: dict) -> float | None:
    """The mean top-1 over the five shifts (WiSE-FT's 'avg. shifts'), or None unless all five are there."""
    return sum(values[s] for s in SHIFTS) / len(SHIFTS) if all(s in values for s in SHIFTS) else None
