"""Class folders as training data (issue 72.2): `--train-data imagefolder:DIR`, or a --train-data DIR in the
class-folder layout (DIR/<class>/<image>, no caption sidecars: plumbing.datafolders' 'imagefolder'), trains CLIP on
class-prompt captions, as robust fine-tuning on ImageNet does (WiSE-FT, FLYP) before `eval.py --tasks
imagenet-shifts --wise-ft`.

Captions: OpenAI's 80 ImageNet templates (open_clip's OPENAI_IMAGENET_TEMPLATES, the ones eval.py's zero-shot heads
use) filled with the image's class name. Each image is one row holding its 80 prompts (`captions`); training draws
one of them per image per epoch, seeded per sample (common.ManifestDataset's draw_caption under SeededSamples: the
same draw on --resume). FLYP (Goyal et al., "Finetune like you pretrain: Improved finetuning of zero-shot vision
models", CVPR 2023, arXiv:2212.00638; github.com/locuslab/FLYP, datacreation_scripts/imagenet_csv_creator.py)
writes one row per (image, template) instead: every image appears with all 80 prompts in an epoch, an epoch 80
times as long. Ours keeps an epoch one pass over the images (the same steps per epoch as any manifest); the
manifest itself is written by protocols/mtil.py's training_manifest (every_template=True), in CLIPFT_CACHE.

Class names: DIR/classnames.txt (one per line, in sorted-folder order; eval.py's imagefolder: reads the same file);
else 1,000 folders named as ImageNet's wnids (n########) are ImageNet's classes, OpenAI's names in sorted-wnid
order (open_clip's IMAGENET_CLASSNAMES, as eval.py's imagenet task reads val/); else the folder names, "_" -> " "."""
from __future__ import annotations

import re
from pathlib import Path

from plumbing.base import CACHE_DIR, DataError
from plumbing.datafolders import IMAGE_SUFFIXES, kind

PREFIX = "imagefolder:"
TEMPLATES = "OpenAI's 80 ImageNet templates (open_clip's OPENAI_IMAGENET_TEMPLATES), one drawn per image per epoch"


def folder_of(train_data) -> Path | None:
    """The class folder `train_data` names (imagefolder:DIR, or a DIR in that layout), else None."""
    text = str(train_data or "")
    if text.startswith(PREFIX):
        return Path(text[len(PREFIX):])
    path = Path(text)
    return path if text and path.is_dir() and kind(path) == "imagefolder" else None


def class_names(folder: Path, classes: list[str]) -> tuple[list[str], str]:
    """(names in sorted-folder order, where they came from); see the module's docstring."""
    names_file = folder / "classnames.txt"
    if names_file.is_file():
        names = [n.strip() for n in names_file.read_text(encoding="utf-8").splitlines() if n.strip()]
        if len(names) != len(classes):
            raise DataError(f"{names_file}: {len(names)} class names for {len(classes)} class folders in {folder}; "
                            f"one name a line, in the sorted order of the folders")
        return names, str(names_file)
    if len(classes) == 1000 and all(re.fullmatch(r"n\d{8}", c) for c in classes):
        from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES
        return list(IMAGENET_CLASSNAMES), "ImageNet's wnids: OpenAI's class names (IMAGENET_CLASSNAMES)"
    return [c.replace("_", " ") for c in classes], "the folder names, '_' as ' '"


def training_manifest(train_data, flag: str = "--train-data", cache=None) -> Path:
    """The manifest (JSONL in CLIPFT_CACHE/class-folders/) that class folders train as: one row per image, its
    class's prompt in every template (`captions`) and its label. One DataError naming `flag` for a folder that is
    missing or holds no class folder with images."""
    from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES

    from protocols import mtil
    folder = folder_of(train_data) or Path(train_data)
    if not folder.is_dir():
        raise DataError(f"{flag} {train_data}: {folder} is not a folder; class folders are DIR/<class>/<image> "
                        f"(docs/protocols.md, 'Fine-tuning on class folders')")
    classes = sorted(d.name for d in folder.iterdir() if d.is_dir())
    paths, labels = [], []
    for k, c in enumerate(classes):
        for p in sorted((folder / c).iterdir()):
            if p.suffix.lower() in IMAGE_SUFFIXES:
                paths.append(str(p.resolve()))
                labels.append(k)
    if not paths:
        raise DataError(f"{flag} {train_data}: no images in class folders under {folder} (expected "
                        f"{folder}/<class>/<image>, {len(classes)} folders found)")
    names, _ = class_names(folder, classes)
    listing = mtil.Listing(f"imagefolder-{folder.name}", "train", paths, labels, names,
                           [t("{}") for t in OPENAI_IMAGENET_TEMPLATES])
    return mtil.training_manifest(listing, cache or CACHE_DIR / "class-folders", every_template=True)


_SAID: set = set()  # the folders described in this process (the run resolves its data more than once)


def describe(train_data, say) -> None:
    """One line for the run's log, once per folder: its classes, where their names came from, the captions; and
    that no evaluation goes with it by default."""
    folder = folder_of(train_data)
    if str(folder) in _SAID:
        return
    _SAID.add(str(folder))
    classes = sorted(d.name for d in folder.iterdir() if d.is_dir())
    say(f"[data] --train-data {train_data}: class folders ({len(classes)} classes, names: "
        f"{class_names(folder, classes)[1]}); captions: {TEMPLATES}; no evaluation goes with them unless "
        f"--eval-tasks names one (afterwards: eval.py --tasks imagenet-shifts --wise-ft <out>/model.pt)")
