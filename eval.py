"""Evaluation suite shared by every method (retrieval, zero-shot, WiSE-FT, geometry, ECE, SIMAT, continual).

Every number a method file prints comes from `evaluate` below: the papers' tables are made by one piece of code.
Each loader states its protocol (BENCHMARKS: every set's layout and source), which every result record carries.

Papers whose protocols this file follows (full references, E1-E5 at length, the task list, the API: docs/eval.md)
  ERCLIP    Le, Tran, Nguyen, Zhou, Gurrin, arXiv:2610.29939, Sec. 4 (compared with Long-CLIP's protocol)
  Long-CLIP Zhang et al., ECCV 2024, arXiv:2403.15378; eval/retrieval/{coco,Urban1k}.py of beichenzbc/Long-CLIP
  m2-Mix    Oh et al., NeurIPS 2023, arXiv:2203.03897: Sec. 3 align / unif, Tab. 2 / Fig. 6 ECE, Tab. 5 SIMAT
            (Couairon et al., arXiv:2112.03162); "the m2-Mix code": github.com/changdaeoh/multimodal-mixup
  C-CLIP    Liu, Zhu, Wei, Tian, ICLR 2025, Sec. 3.3 (VLCL metrics, PD)
  ZSCL      Zheng et al., ICCV 2023, arXiv:2303.06628: MTIL's 11 test sets (protocols/mtil.py, docs/protocols.md)
  WiSE-FT   Wortsman et al., CVPR 2022, arXiv:2109.01903: ImageNet's 5 shifts, masks (protocols/imagenet_shifts.py)
  CMCL      Liu et al., "Continual Multimodal Contrastive Learning", NeurIPS 2025, arXiv:2503.14963 (Acc, BWT, R@10)

Protocol choices and deviations ("ours" is the default)
  E1. COCO val2017 5k ('coco'): the first 5 captions per image (25,000), as Long-CLIP's coco.py; 'coco-all': 25,014.
  E2. Urban1K: the caption file's first line, split on "\\n" only, as Long-CLIP's Urban1k.py (readlines()[0]).
  E3. m2-Mix align: on the images, negated (Sec. 3); the code's (on the texts, not negated): released_code_geometry.
  E4. unif = -log mean_ij exp(-2 ||v_i - t_j||^2); the code's: the images twice, not negated: released_code_geometry.
  E5. SIMAT: test split, best of 14 lambdas {0.5, 1, ..., 7}; the code's dev split, 13 (no 6.5): --simat-protocol code.

Runbook (one device, no torchrun; the tasks and the data root layout: python eval.py --help)
  python eval.py --backbone tiny                                     # synthetic world, CPU
  python eval.py --backbone ViT-B/16 --tasks erclip --data-root data/ --paper erclip
  python eval.py --backbone ViT-B/16 --pretrained runs/x/model.pt --tasks urban1k,coco --text-mode both
  python eval.py --backbone ViT-B/32 --tasks flickr30k-1cap --analyses geometry,ece --paper m2mix
  python eval.py --backbone tiny --tasks synthetic-short,synthetic-shape --wise-ft runs/x/model.pt  # WiSE-FT curve
  python eval.py --backbone ViT-B/16 --tasks imagenet-shifts --wise-ft runs/x/model.pt  # + effective robustness
  python eval.py --backbone ViT-B/16 --tasks mtil       # ZSCL's 11 MTIL test sets (docs/protocols.md)
  python eval.py --backbone tiny --continual pretrained,t1/model.pt,t2/model.pt \\
      --tasks synthetic-task-plain,synthetic-task-dark --zero-shot synthetic-shape
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from plumbing import base, flags, outfolder, published
from plumbing.results import OWN_METRICS, document, sequence_stage, staged, task_tags  # one results.json (42.3)


# =============================================================================
# 0. The command line (torch-free, so that --help and flag errors answer before torch loads)
# =============================================================================
# name -> (what must exist under the data root, where it is published)
BENCHMARKS = {
    "coco": ("coco/val2017/*.jpg + coco/annotations/captions_val2017.json",
             "https://cocodataset.org/#download (2017 Val images, 2017 Train/Val annotations)"),
    "coco-karpathy": ("coco/dataset_coco.json (Karpathy splits) + coco/val2014/*.jpg",
                      "https://cs.stanford.edu/people/karpathy/deepimagesent/ (caption_datasets.zip); "
                      "images: https://cocodataset.org/#download (2014 Val images)"),
    "flickr30k": ("flickr30k/dataset_flickr30k.json (Karpathy splits) + flickr30k/images/*.jpg",
                  "https://shannon.cs.illinois.edu/DenotationGraph/ (images); Karpathy json in "
                  "https://cs.stanford.edu/people/karpathy/deepimagesent/ (caption_datasets.zip)"),
    "flickr30k-full": ("flickr30k/results_20130124.token (the Flickr30k release's captions) + flickr30k/images/*.jpg",
                       "https://shannon.cs.illinois.edu/DenotationGraph/ (images and the .token file)"),
    "urban1k": ("Urban1k/image/<k>.jpg + Urban1k/caption/<k>.txt, k = 1..1000",
                "https://huggingface.co/datasets/BeichenZhang/Urban1k"),
    "sharegpt4v-1k": ("sharegpt4v/share-captioner_coco_lcs_sam_1246k_1107.json + the images its records name, "
                      "relative to the data root (coco/train2017/..., sam/images/...)",
                      "https://huggingface.co/datasets/Lin-Chen/ShareGPT4V (json); images: COCO train2017, SAM"),
    "docci": ("docci/docci_descriptions.jsonlines + docci/images/*.jpg", "https://google.github.io/docci/"),
    "dci": ("dci/densely_captioned_images/annotations/*.json + dci/densely_captioned_images/photos/",
            "https://github.com/facebookresearch/DCI (densely_captioned_images)"),
    "cifar10": ("cifar10/cifar-10-batches-py/test_batch + batches.meta (torchvision's folder)",
                "https://www.cs.toronto.edu/~kriz/cifar.html, or pass --download"),
    "cifar100": ("cifar100/cifar-100-python/test + meta (torchvision's folder)",
                 "https://www.cs.toronto.edu/~kriz/cifar.html, or pass --download"),
    "imagenet": ("imagenet/val/<wnid>/*.JPEG, the 1,000 ILSVRC2012 class folders",
                 "https://image-net.org/download (ILSVRC2012 validation images, sorted into wnid folders)"),
    "simat": ("simat/simat_db/{transfos.csv, triplets.csv, oscar_similarity_matrix.pt, images/}",
              "https://github.com/facebookresearch/SIMAT (images: prepare_dataset.py on Visual Genome)"),
}
BENCHMARKS.update({"coco-1cap": BENCHMARKS["coco"], "coco-all": BENCHMARKS["coco"],
                   "flickr30k-1cap": BENCHMARKS["flickr30k"], "long-dci": BENCHMARKS["dci"]})
TASK_GROUPS = {  # shorthands for --tasks
    "erclip": "urban1k,sharegpt4v-1k,docci,long-dci,coco,cifar10,cifar100,imagenet",
    "long": "urban1k,sharegpt4v-1k,docci,long-dci",
    "m2mix": "flickr30k-1cap,coco-1cap,flickr30k,coco",
    "zero-shot": "cifar10,cifar100,imagenet",
    "synthetic": "synthetic-short,synthetic-long,synthetic-unseen,synthetic-shape,synthetic-color,synthetic-background",
    "imagenet-shifts": "imagenet,imagenet-v2,imagenet-r,imagenet-a,imagenet-sketch,objectnet",  # WiSE-FT's
    "mtil": "mtil:Aircraft,mtil:Caltech101,mtil:CIFAR100,mtil:DTD,mtil:EuroSAT,mtil:Flowers,mtil:Food,mtil:MNIST,"
            "mtil:OxfordPet,mtil:StanfordCars,mtil:SUN397",  # ZSCL's 11 test sets, Order I (protocols/mtil.py)
}
CLASSIFICATION_TASKS = ["cifar10", "cifar100", "imagenet", "cifar10-longclip", "cifar100-longclip",
                        *TASK_GROUPS["imagenet-shifts"].split(",")[1:], *TASK_GROUPS["mtil"].split(",")]
# the loaders' names (REAL_RETRIEVAL_TASKS below, published.PUBLISHED, m2mix_analysis.SIMAT_PROTOCOLS; a test checks)
RETRIEVAL_NAMES = ("coco", "coco-all", "coco-1cap", "coco-karpathy", "flickr30k", "flickr30k-1cap", "flickr30k-full",
                   "urban1k", "sharegpt4v-1k", "docci", "long-dci", "dci")
PAPERS = ("erclip", "m2mix", "cclip", "clip")
SIMAT_PROTOCOL_NAMES = ("ours", "code")


def _task_help() -> str:
    lines = [f"retrieval tasks: {', '.join(RETRIEVAL_NAMES)}",
             "  synthetic world (the lab's, loaded when --tasks names one): synthetic-*, e.g. the group 'synthetic'",
             "  your data: file.jsonl|.csv|.tsv|.parquet, a Hugging Face or sidecar folder[#column] (docs/data.md)",
             f"classification tasks: {', '.join(CLASSIFICATION_TASKS)}, imagefolder:<path>", "other: simat",
             "task groups: " + "; ".join(f"{k} = {v}" for k, v in TASK_GROUPS.items()), "",
             "data root layout (--data-root):", *(f"  {name:15s} {layout}" for name, (layout, _) in BENCHMARKS.items())]
    return "\n".join(lines)


def command_line() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=_task_help(), allow_abbrev=False,
                                formatter_class=flags.HelpWithDefaults)
    p.add_argument("--backbone", "--model", default="tiny", help="OpenAI name (ViT-B/16), open_clip name, or 'tiny'")
    p.add_argument("--pretrained", default="", help="'' = default weights, an open_clip tag, or a checkpoint path")
    p.add_argument("--tasks", "--dataset", default="synthetic-short,synthetic-long,synthetic-shape,synthetic-color",
                   help="comma-separated task names or groups (see below)")
    p.add_argument("--data-root", "--dataset_root", default="data")
    p.add_argument("--text-mode", default="truncate", choices=("truncate", "sentence-mean", "both"))
    p.add_argument("--context-length", type=flags.checked(int, ">= 0"), default=0,
                   help="tokenise with this text window, e.g. 77 on a stretched Long-CLIP model (0: the model's)")
    p.add_argument("--analyses", default="", help="geometry,ece: m2-Mix's analyses on retrieval tasks")
    p.add_argument("--simat-protocol", default="ours", choices=SIMAT_PROTOCOL_NAMES,
                   help="ours: SIMAT test split, lambda 0.5..7 | code: the m2-Mix code's dev split and 13 lambdas")
    p.add_argument("--paper", default="", choices=("", *PAPERS), help="print that paper's CLIP numbers beside ours")
    p.add_argument("--download", action="store_true", help="let torchvision download CIFAR if absent")
    p.add_argument("--strict", action="store_true", help="fail when any benchmark image is missing")
    p.add_argument("--wise-ft", default="", help="fine-tuned checkpoint: evaluate the WiSE-FT curve to it")
    p.add_argument("--wise-base", default="", help="its starting weights (default: --pretrained)")
    p.add_argument("--alphas", default="0,0.25,0.5,0.75,1", type=flags.numbers, help="WiSE-FT mixing coefficients")
    p.add_argument("--resume", action="store_true", help="--wise-ft: keep the alphas --out holds (same settings)")
    p.add_argument("--er-line", type=flags.pair, help="SLOPE,INTERCEPT: a published logit-space line for effective "
                   "robustness (default ours: slope 1 through alpha 0; protocols/wise_ft.py)")
    p.add_argument("--continual", default="", help="pretrained,ckpt_after_task1,...: continual matrix over --tasks")
    p.add_argument("--zero-shot", default="", help="with --continual: tasks whose drop is reported as PD")
    p.add_argument("--synthetic-n", type=flags.checked(int, "> 0"), default=None,
                   help="first n scenes of each synthetic split")
    p.add_argument("--batch-size", "--batch_size", type=flags.checked(int, "> 0"), default=256)
    p.add_argument("--workers", "--num_workers", type=flags.checked(int, ">= 0"), default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--cache-dir", default=str(base.CACHE_DIR / "classifiers"), help="zero-shot classifier cache")
    p.add_argument("--out", "--output", default="runs/eval", help="folder for results.json")
    flags.add_fields(p, flags.Config, ("csv_img_key", "csv_caption_key", "csv_separator"))  # manifest tasks
    p.add_argument("--format", default="ours", choices=("ours", "clip_benchmark"),
                   help="clip_benchmark: also one CLIP_benchmark result file per (dataset, task) in --out")
    return p


if __name__ == "__main__":
    command_line().parse_args()  # exits here on --help or a bad flag; main() parses again with torch loaded

# The evaluation's imports: after the command line, which needs none of them.
import numpy as np
import torch
from PIL import Image

import common
from plumbing.base import DataError, UnsafeFileError, UsageError, atomic_write, markdown_table
from plumbing.cli import cli
from plumbing import loading, manifests, models, runfolder, safepickle
from protocols import clip_benchmark, imagenet_shifts, m2mix_analysis, mtil, wise_ft


# =============================================================================
# 1. Data sets and missing-data errors
# =============================================================================
@dataclass
class RetrievalSet:
    name: str
    image_paths: list
    texts: list
    text_to_image: torch.Tensor  # (M,) long: image index of text j
    protocol: str = ""
    missing: int = 0  # images listed by the benchmark but absent on disk or undecodable
    dropped: list = field(default_factory=list)  # each undecodable image or bad manifest row dropped, with why


@dataclass
class ClassificationSet:
    name: str
    image_paths: list  # file paths, or a sequence of PIL images (CIFAR)
    labels: torch.Tensor  # (N,) long
    classnames: list
    templates: list
    protocol: str = ""
    missing: int = 0
    groups: list | None = None  # ObjectNet: per class, the classifier's (ImageNet's) classes; logits = their max


class MissingData(DataError):
    """A benchmark (or a file of it) is not where the data-root layout says."""


def _require(path: Path, task: str, root):
    if path.exists():
        return path
    layout, source = BENCHMARKS[task]
    raise MissingData(f"{task}: {path} not found. Expected under the data root ({root}): {layout}. "
                      f"Get it from {source}. See docs/data.md (each benchmark's layout).")


def _finish(name, paths, texts, t2i, protocol, task=None, root=None, strict=False) -> RetrievalSet:
    """Drops images missing on disk or not decodable in full (a truncated file) with their texts, counts them
    and lists the undecodable ones; refuses an evaluation with no image at all (or any dropped image when strict)."""
    t2i = torch.as_tensor(t2i, dtype=torch.long)
    found = [Path(p).is_file() for p in paths]
    checked = iter(manifests.image_problems([p for p, f in zip(paths, found) if f]))
    problem = [next(checked) if f else "not found" for f in found]
    unreadable = [p for p in problem if p not in (None, "not found")]
    present = torch.tensor([p is None for p in problem], dtype=torch.bool)
    missing = int((~present).sum())
    if missing:
        first = next((str(p) for p, f in zip(paths, found) if not f), None)
        where = f" Expected layout: {BENCHMARKS[task][0]}; source: {BENCHMARKS[task][1]}." if task in BENCHMARKS else ""
        msg = "" if first is None else (
            f"{name}: {missing - len(unreadable)} of {len(paths)} images not found (first: {first}).{where}")
        if unreadable:
            msg += "\n" * bool(msg) + manifests.bad_rows_message(name, unreadable, what="undecodable image(s)")
        if missing == len(paths) or strict:
            raise MissingData(msg + ("" if missing == len(paths) else " (--strict)"))
        base.warn_once(f"[eval] WARNING {msg} Evaluating the {len(paths) - missing} present; "
                       f"the results record missing={missing}.")  # once: --val-every evaluates it again
        new_index = torch.cumsum(present.long(), 0) - 1  # old image index -> new
        keep_text = present[t2i]
        paths = [p for p, ok in zip(paths, present) if ok]
        texts = [t for t, ok in zip(texts, keep_text) if ok]
        t2i = new_index[t2i[keep_text]]
    return RetrievalSet(name, [str(p) for p in paths], list(texts), t2i, protocol, missing, unreadable)


def _group_captions(image_keys, caption_pairs, max_per_image=None):
    """image_keys: ordered image keys; caption_pairs: (key, text), in file order; max_per_image: keep the first
    k captions of each image (None: all). -> texts, t2i (texts in file order)."""
    index = {k: i for i, k in enumerate(image_keys)}
    texts, t2i, kept = [], [], {}
    for key, text in caption_pairs:
        if key not in index or (max_per_image is not None and kept.get(key, 0) >= max_per_image):
            continue
        kept[key] = kept.get(key, 0) + 1
        texts.append(" ".join(str(text).split()))
        t2i.append(index[key])
    return texts, t2i


# ---- retrieval benchmarks ---------------------------------------------------
# task -> captions kept per image (E1): Long-CLIP's coco.py (ERCLIP compares with it), all (25,014), m2-Mix code's 1:1
COCO_VAL2017 = {"coco": 5, "coco-all": None, "coco-1cap": 1}


def _coco_val2017(root, task="coco", strict=False):
    """COCO val2017 5k: images sorted by id, captions in annotation-file order, the first COCO_VAL2017[task] (E1)."""
    per_image = COCO_VAL2017[task]
    root = Path(root)
    ann = json.loads(_require(root / "coco/annotations/captions_val2017.json", task, root).read_text())
    _require(root / "coco/val2017", task, root)
    images = sorted(ann["images"], key=lambda im: im["id"])
    texts, t2i = _group_captions([im["id"] for im in images],
                                 ((a["image_id"], a["caption"]) for a in ann["annotations"]), per_image)
    protocol = {1: "COCO val2017 5k, first caption per image, 1:1 (m2-Mix code)",
                5: "COCO val2017 5k, first 5 captions per image (Long-CLIP's coco.py), I2T hit if any in top k",
                None: "COCO val2017 5k, all captions (5-7 per image), I2T hit if any caption in top k"}[per_image]
    protocol += f"; {len(texts)} texts before missing images are dropped"
    return _finish(task, [root / "coco/val2017" / im["file_name"] for im in images], texts, t2i, protocol,
                   task, root, strict)


def _karpathy(root, dataset, first_only=False, strict=False):
    root = Path(root)
    if dataset == "coco":
        task, js, img_dir = "coco-karpathy", root / "coco/dataset_coco.json", root / "coco"
    else:
        task = "flickr30k-1cap" if first_only else "flickr30k"
        js, img_dir = root / "flickr30k/dataset_flickr30k.json", root / "flickr30k/images"
    images = [im for im in json.loads(_require(js, task, root).read_text())["images"] if im["split"] == "test"]
    paths = [img_dir / im.get("filepath", "") / im["filename"] for im in images]
    pairs = ((i, s["raw"]) for i, im in enumerate(images) for s in im["sentences"])
    texts, t2i = _group_captions(range(len(images)), pairs, 1 if first_only else None)
    protocol = f"{dataset} Karpathy test ({len(images)} images), " + (
        "first caption per image, 1:1 (m2-Mix code)" if first_only else "all captions")
    return _finish(task, paths, texts, t2i, protocol, task, root, strict)


def _flickr30k_full(root, strict=False):
    """Long-CLIP's eval/retrieval/flickr30k.py protocol: every image of the release (31,783) against every caption
    of results_20130124.token ("<image>#<k>\t<caption>" lines, 158,915), not Karpathy's 1k test split."""
    root = Path(root)
    lines = _require(root / "flickr30k/results_20130124.token", "flickr30k-full", root).read_text(encoding="utf-8")
    pairs = [(ln.split("\t")[0].rsplit("#", 1)[0], ln.split("\t", 1)[1].strip()) for ln in lines.split("\n")
             if "\t" in ln]
    names = list(dict.fromkeys(name for name, _ in pairs))
    texts, t2i = _group_captions(names, pairs)
    return _finish("flickr30k-full", [root / "flickr30k/images" / n for n in names], texts, t2i,
                   f"Flickr30k full set ({len(names)} images, {len(texts)} captions; Long-CLIP's flickr30k.py)",
                   "flickr30k-full", root, strict)


def _urban1k(root, strict=False):
    root = Path(root)
    cap_dir = _require(root / "Urban1k/caption", "urban1k", root)
    caps = sorted(cap_dir.glob("*.txt"), key=lambda p: int(p.stem) if p.stem.isdigit() else p.stem)
    if not caps:
        _require(cap_dir / "1.txt", "urban1k", root)
    # E2: the first line, split on "\n" only, as Long-CLIP's Urban1k.py (readlines()[0]); splitlines()
    # would also cut at \x0c, \x85, \u2028. read_text's universal newlines turn \r\n and \r into \n first.
    texts = [p.read_text(encoding="utf-8").split("\n")[0].strip() for p in caps]
    paths = [root / "Urban1k/image" / f"{p.stem}.jpg" for p in caps]
    return _finish("urban1k", paths, texts, range(len(paths)), f"Urban1K, {len(paths)} pairs, 1:1, first line "
                   "(split on newlines only)", "urban1k", root, strict)


def _first_json_records(path, n: int, chunk: int = 1 << 20) -> list:
    """The first n objects of a (huge) JSON array, read incrementally (the 1.2M-record ShareGPT4V file, never whole)."""
    dec, out = json.JSONDecoder(), []
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk)
        i = buf.index("[") + 1
        while len(out) < n:
            while i < len(buf) and buf[i] in " \t\r\n,":
                i += 1
            if buf[i:i + 1] == "]":
                break
            try:
                obj, i = dec.raw_decode(buf, i)  # at the end of the buffer (i = len(buf)) it raises too
            except json.JSONDecodeError:
                if not (more := f.read(chunk)):
                    if i < len(buf):
                        raise
                    break  # the file ends between two objects
                buf, i = buf[i:] + more, 0
                continue
            out.append(obj)
            if i > chunk:  # drop what is parsed, keep the buffer O(chunk)
                buf, i = buf[i:], 0
    return out


def _sharegpt4v_1k(root, strict=False):
    root = Path(root)
    js = _require(root / "sharegpt4v/share-captioner_coco_lcs_sam_1246k_1107.json", "sharegpt4v-1k", root)
    recs = _first_json_records(js, 1000)
    texts = [" ".join(r["conversations"][1]["value"].replace("\n", " ").split()) for r in recs]
    return _finish("sharegpt4v-1k", [root / r["image"] for r in recs], texts, range(len(recs)),
                   f"ShareGPT4V-1k: first {len(recs)} records of {js.name}, 1:1", "sharegpt4v-1k", root, strict)


def _docci(root, strict=False):
    root = Path(root)
    js = _require(root / "docci/docci_descriptions.jsonlines", "docci", root)
    recs = [json.loads(line) for line in js.read_text(encoding="utf-8").splitlines() if line.strip()]
    recs = [r for r in recs if r["split"] == "test"]
    return _finish("docci", [root / "docci/images" / r["image_file"] for r in recs],
                   [" ".join(r["description"].split()) for r in recs], range(len(recs)),
                   f"DOCCI test split ({len(recs)} pairs), 1:1", "docci", root, strict)


def _dci(root, field="extra_caption", strict=False):
    task = "long-dci" if field == "extra_caption" else "dci"
    root = Path(root)
    ann_dir = _require(root / "dci/densely_captioned_images/annotations", task, root)
    anns = (json.loads(p.read_text(encoding="utf-8")) for p in sorted(ann_dir.glob("*.json")))  # one at a time
    pairs = [(a["image"], text) for a in anns if (text := " ".join(str(a.get(field) or "").split()))]
    paths = [root / "dci/densely_captioned_images/photos" / image for image, _ in pairs]
    texts = [text for _, text in pairs]
    if not paths:
        raise MissingData(f"{task}: no annotation in {ann_dir} has a non-empty {field!r}. "
                          f"Expected: {BENCHMARKS[task][0]}; source: {BENCHMARKS[task][1]}")
    return _finish(task, paths, texts, range(len(paths)),
                   f"DCI annotations with non-empty {field} ({len(paths)} pairs), 1:1", task, root, strict)


# The lab (which eval never imports) registers its world's synthetic-* sets here on import: name -> loader(root, n=None)
SYNTHETIC_RETRIEVAL: dict = {}
SYNTHETIC_CLASSIFICATION: dict = {}


def register_synthetic(retrieval: dict, classification: dict):
    SYNTHETIC_RETRIEVAL.update(retrieval)
    RETRIEVAL_TASKS.update(retrieval)
    SYNTHETIC_CLASSIFICATION.update(classification)
    CLASSIFICATION_TASKS[:0] = [k for k in classification if k not in CLASSIFICATION_TASKS]


def _check_lab_loaded(name: str):  # after the lab's registered sets were looked up
    if name.startswith("synthetic-") and not SYNTHETIC_RETRIEVAL:  # loaded: an unknown name, said as such below
        raise UsageError(f"{name!r} is a set of the lab's synthetic world, which is not loaded: run "
                                f"the command as python -m lab eval ARGS (or import lab first)")


REAL_RETRIEVAL_TASKS = {
    **{task: (lambda root, strict=False, task=task: _coco_val2017(root, task, strict)) for task in COCO_VAL2017},
    "coco-karpathy": lambda root, strict=False: _karpathy(root, "coco", False, strict),
    "flickr30k": lambda root, strict=False: _karpathy(root, "flickr30k", False, strict),
    "flickr30k-1cap": lambda root, strict=False: _karpathy(root, "flickr30k", True, strict),
    "flickr30k-full": _flickr30k_full,
    "urban1k": _urban1k, "sharegpt4v-1k": _sharegpt4v_1k, "docci": _docci, "long-dci": _dci,
    "dci": lambda root, strict=False: _dci(root, "short_caption", strict),
}
RETRIEVAL_TASKS = dict(REAL_RETRIEVAL_TASKS)  # + the lab's, once registered


def manifest_retrieval(path, column="caption", strict=False) -> RetrievalSet:
    """A user manifest (JSONL/CSV, image paths relative to it): a text per row from `column`; rows may share images."""
    ds = common.ManifestDataset(path, check_images=False, skip_bad=True)  # _finish decodes the images
    if ds.skipped:  # ManifestDataset drops rows whose image is absent; count them as missing
        msg = manifests.bad_rows_message(path, ds.skipped)
        if strict:
            raise MissingData(msg)  # else ManifestDataset's warning has named them, once per process
    index, t2i, texts = {}, [], []  # index: image path -> image index, in order of first appearance
    for r in ds.rows:
        t2i.append(index.setdefault(str(ds.image_file(r)), len(index)))
        texts.append(r[column] if column in r else ds._caption(r))
    rs = _finish(Path(path).stem, list(index), texts, t2i, f"manifest {path}, column {column}", strict=strict)
    rs.missing += len(ds.skipped)
    rs.dropped = ds.skipped + rs.dropped
    return rs


def load_retrieval(name: str, root="data", strict: bool = False, synthetic_n=None) -> RetrievalSet:
    """A retrieval benchmark by task name, or a manifest path ('x.jsonl', 'x.csv#long_caption' to read another
    column). strict: a missing image is an error instead of being dropped and counted."""
    if name in SYNTHETIC_RETRIEVAL:
        return SYNTHETIC_RETRIEVAL[name](root, synthetic_n)
    _check_lab_loaded(name)
    if name in REAL_RETRIEVAL_TASKS:
        return REAL_RETRIEVAL_TASKS[name](root, strict=strict)
    path, _, column = name.partition("#")
    if path.endswith((".jsonl", ".json", ".csv", ".tsv", ".parquet")) or Path(path).is_dir():  # folders: 42.2
        return manifest_retrieval(path, column or "caption", strict)
    raise UsageError(f"unknown retrieval task {name!r}; known: {', '.join(RETRIEVAL_TASKS)}, or a manifest path")


# ---- classification ---------------------------------------------------------
# OpenAI's 18 CIFAR prompts (CLIP repository, notebooks/Prompt_Engineering_for_ImageNet.ipynb / data/prompts.md).
CIFAR_TEMPLATES = [
    "a photo of a {}.", "a blurry photo of a {}.", "a black and white photo of a {}.", "a low contrast photo of a {}.",
    "a high contrast photo of a {}.", "a bad photo of a {}.", "a good photo of a {}.", "a photo of a small {}.",
    "a photo of a big {}.", "a photo of the {}.", "a blurry photo of the {}.", "a black and white photo of the {}.",
    "a low contrast photo of the {}.", "a high contrast photo of the {}.", "a bad photo of the {}.",
    "a good photo of the {}.", "a photo of the small {}.", "a photo of the big {}."]


def imagenet_templates() -> list:
    """OpenAI's 80 ImageNet prompts as format strings (open_clip ships them as lambdas)."""
    from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES
    return [t("{}") for t in OPENAI_IMAGENET_TEMPLATES]


class _CifarImages:
    """CIFAR test images as PIL images, from the pickled arrays of torchvision's folder."""
    def __init__(self, data):
        self.data = data  # (N, 3072) uint8, channel-major

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return Image.fromarray(self.data[i].reshape(3, 32, 32).transpose(1, 2, 0))


def _cifar(root, n_classes: int, download=False, longclip: bool = False) -> ClassificationSet:
    """torchvision's CIFAR folders, read directly (no md5 check: any faithful copy works); download: via torchvision.
    longclip: Long-CLIP's protocol (eval/classification/cifar/cifar10.py: the 80 ImageNet templates and torchvision's
    raw class names, 'aquarium_fish'), as the task cifar10-longclip / cifar100-longclip."""
    task = f"cifar{n_classes}"
    root = Path(root)
    folder = root / task / ("cifar-10-batches-py" if n_classes == 10 else "cifar-100-python")
    test_file, meta_file = (("test_batch", "batches.meta") if n_classes == 10 else ("test", "meta"))
    if download and not (folder / test_file).exists():
        import torchvision
        cls = torchvision.datasets.CIFAR10 if n_classes == 10 else torchvision.datasets.CIFAR100
        cls(str(root / task), train=False, download=True)
    data, labels, names = safepickle.cifar(_require(folder / test_file, task, root),
                                           _require(folder / meta_file, task, root), n_classes)  # issue 69.1
    images = _CifarImages(data)
    if longclip:
        return ClassificationSet(f"{task}-longclip", images, torch.tensor(labels), list(names), imagenet_templates(),
                                 protocol=f"CIFAR-{n_classes} test ({len(labels)}), Long-CLIP's: 80 ImageNet "
                                          f"templates, torchvision's raw class names")
    classnames = [c.replace("_", " ") for c in names]  # OpenAI's spelling ("aquarium fish")
    return ClassificationSet(task, images, torch.tensor(labels), classnames, list(CIFAR_TEMPLATES),
                             protocol=f"CIFAR-{n_classes} test ({len(labels)}), 18 OpenAI CIFAR templates, "
                                      f"class names with spaces")


IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")


def _image_folder(folder: Path):
    classes = sorted(d.name for d in folder.iterdir() if d.is_dir())
    files = [(str(p), c) for c, name in enumerate(classes) for p in sorted((folder / name).iterdir())
             if p.suffix.lower() in IMAGE_EXTS]
    return classes, [p for p, _ in files], torch.tensor([c for _, c in files], dtype=torch.long)


def _imagenet(root) -> ClassificationSet:
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES
    root = Path(root)
    val = _require(root / "imagenet/val", "imagenet", root)
    wnids, paths, labels = _image_folder(val)
    if len(wnids) != len(IMAGENET_CLASSNAMES):
        raise MissingData(f"imagenet: {val} holds {len(wnids)} class folders, expected {len(IMAGENET_CLASSNAMES)} "
                          f"(sorted wnids align with open_clip's IMAGENET_CLASSNAMES). {BENCHMARKS['imagenet'][1]}")
    if not paths:
        raise MissingData(f"imagenet: no images in {val}/<wnid>/")
    return ClassificationSet("imagenet", paths, labels, list(IMAGENET_CLASSNAMES), imagenet_templates(),
                             protocol=f"ImageNet val ({len(paths)}), 80 OpenAI templates")


def _any_image_folder(path) -> ClassificationSet:
    folder = Path(path)
    if not folder.is_dir():
        raise MissingData(f"imagefolder: {folder} is not a folder (expected <folder>/<class>/<image>)")
    classes, paths, labels = _image_folder(folder)
    names_file = folder / "classnames.txt"
    names = (names_file.read_text().splitlines() if names_file.exists() else [c.replace("_", " ") for c in classes])
    if len(names) != len(classes) or not paths:
        raise MissingData(f"imagefolder {folder}: {len(classes)} class folders, {len(names)} class names, "
                          f"{len(paths)} images")
    return ClassificationSet(f"imagefolder:{path}", paths, labels, names, imagenet_templates(),
                             protocol=f"ImageFolder {folder} ({len(paths)} images), 80 OpenAI templates")


def load_classification(name: str, root="data", download: bool = False, synthetic_n=None) -> ClassificationSet:
    """A zero-shot classification set by name; download=True: torchvision fetches an absent CIFAR (never implicitly)."""
    if name in SYNTHETIC_CLASSIFICATION:
        return SYNTHETIC_CLASSIFICATION[name](root, synthetic_n)
    _check_lab_loaded(name)
    if name in ("cifar10", "cifar100", "cifar10-longclip", "cifar100-longclip"):
        return _cifar(root, int(name.removeprefix("cifar").removesuffix("-longclip")), download, "-" in name)
    if name == "imagenet":
        return _imagenet(root)
    if name.startswith("imagefolder:"):
        return _any_image_folder(name.partition(":")[2])
    if name.startswith(mtil.PREFIX):  # ZSCL's MTIL test sets (protocols/mtil.py)
        t = mtil.read(root, name.removeprefix(mtil.PREFIX), "test")
        return ClassificationSet(name, t.images, torch.tensor(t.labels), t.classnames, t.templates,
                                 f"MTIL {t.dataset} test ({len(t.labels)}), ZSCL's split, names, templates")
    if name in imagenet_shifts.SHIFTS:  # WiSE-FT's protocol (protocols/imagenet_shifts.py)
        from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES
        s = imagenet_shifts.read(name, root, IMAGENET_CLASSNAMES)
        return ClassificationSet(name, s["images"], s["labels"], s["classnames"], imagenet_templates(), s["protocol"],
                                 groups=s["groups"])
    raise UsageError(f"unknown classification task {name!r}; known: {', '.join(CLASSIFICATION_TASKS)}, "
                     f"imagefolder:<path>")


# + the lab's synthetic-* sets, once registered


def is_classification(name: str) -> bool:
    return name in CLASSIFICATION_TASKS or name.startswith("imagefolder:")


def task_list(spec: str, train_data: str, paper_tasks, synthetic_tasks) -> list[str]:
    """A method script's --eval-tasks: 'none', 'auto' (the paper's tasks; the lab's on the synthetic world), a list."""
    if spec == "none":
        return []
    if spec == "auto":
        return list(synthetic_tasks if train_data == "synthetic" else paper_tasks)
    return [t for t in spec.split(",") if t]


def check_tasks(tasks, data_root, flag: str = "--eval-tasks"):
    """Loads every evaluation set's index before training, so missing data fails in seconds, not after the run, in
    one message naming every set that cannot be loaded; an unknown name is the caller's flag's error (UsageError)."""
    failed = []
    for t in tasks:
        try:
            if is_classification(t):
                load_classification(t, data_root)
            elif t != "simat":
                load_retrieval(t, data_root)
        except UsageError as e:
            raise UsageError(f"{flag}: {e}") from None
        except Exception as e:
            failed.append(f"evaluation task {t!r} cannot be loaded from {data_root}: {e}")
    if failed:
        raise DataError("\n".join(failed) + f" (pass {flag} to choose others, or none)")


# =============================================================================
# 2. Features (each computed once per task and model)
# =============================================================================
class _Images(torch.utils.data.Dataset):
    def __init__(self, paths, transform):
        self.paths, self.transform = paths, transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        item = self.paths[i]
        if isinstance(item, Image.Image):
            return self.transform(loading.to_rgb(item))
        return loading.EVAL_IMAGES.get(item, self.transform)  # decoded and transformed once per process


@torch.no_grad()
def image_features(model, preprocess, paths, batch_size=256, workers=0, device=None):
    """Normalised image features (N, D), float32 on CPU; AMP on CUDA. `paths`: file paths or PIL images."""
    device = device or next(model.parameters()).device
    loader = torch.utils.data.DataLoader(_Images(paths, preprocess), batch_size=batch_size, num_workers=workers,
                                         pin_memory=str(device).startswith("cuda"))
    feats = []
    for x in loader:
        with common.autocast(device):
            feats.append(model.encode_image(x.to(device, non_blocking=True), normalize=True).float().cpu())
    return torch.cat(feats)


_SENTENCE_END = re.compile(r"(?<=\.)\s+")


def split_sentences(text: str) -> list[str]:
    """ERCLIP's sentence splitter (Le et al., Sec. 3.1; erclip.py deviation 7), shared by ERCLIP's training and
    the 'sentence-mean' text mode: a '.' followed by whitespace (or the end) closes a sentence, so '2.5' stays
    whole. Whitespace collapses; fragments with no letter/digit are dropped."""
    sentences = (" ".join(s.split()) for s in _SENTENCE_END.split(text.strip()))
    return [s for s in sentences if any(ch.isalnum() for ch in s)]


def text_features(model, tokenizer, texts, text_mode="truncate", device=None):
    """truncate: the papers' protocol (cut at the context, end token kept). sentence-mean: each sentence
    encoded within the window, normalised embeddings averaged, renormalised."""
    if text_mode == "truncate":
        return common.encode_texts(model, tokenizer, texts, device=device)
    if text_mode == "sentence-mean":
        per_text = [split_sentences(t) or [t] for t in texts]
        owner = [i for i, sents in enumerate(per_text) for _ in sents]  # text index of each sentence
        f = common.encode_texts(model, tokenizer, [s for sents in per_text for s in sents], device=device)
        out = torch.zeros(len(texts), f.shape[1]).index_add_(0, torch.tensor(owner), f)
        return torch.nn.functional.normalize(out, dim=-1)
    raise ValueError(f"unknown text mode {text_mode!r}")


_CLASSIFIER_CACHE: dict = {}


@torch.no_grad()
def _text_fingerprint(model) -> str:
    """Identifies the text tower's current weights (changes when they train)."""
    h = hashlib.sha1()
    for name, p in models.text_tower(model).named_parameters():
        if not name.startswith("visual."):
            p = p.detach().double()
            h.update(f"{name}{tuple(p.shape)}{p.sum().item():.10e}{p.square().sum().item():.10e}".encode())
    return h.hexdigest()


def zero_shot_head(model, tokenizer, classnames, templates, device=None, cache_dir=None):
    """common.zero_shot_classifier (D, C), cached per (text weights, classnames, templates); on disk with cache_dir."""
    key = hashlib.sha1(json.dumps([_text_fingerprint(model), list(classnames), list(templates)]).encode()).hexdigest()
    if key in _CLASSIFIER_CACHE:
        return _CLASSIFIER_CACHE[key]
    def compute():
        return common.zero_shot_classifier(model, tokenizer, classnames, templates, device=device).cpu()
    clf = cached(cache_dir, None, compute, f"classifier-{key[:16]}.pt") if cache_dir else compute()
    _CLASSIFIER_CACHE[key] = clf
    return clf


def cached(cache_dir, key: dict | None, compute, name: str = ""):
    """compute() once per key, stored as <cache_dir>/<sha1(key)>.pt (or `name`): tensors in plain containers,
    written atomically, read back with weights_only=True: a tampered file is refused (UnsafeFileError), never run;
    one that cannot be read otherwise (truncated by a kill) is rebuilt, with one line naming it (issue 26.6)."""
    path = Path(cache_dir) / (name or hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20] + ".pt")
    if path.exists():
        try:
            return loading.load_weights_only(path)
        except UnsafeFileError:
            raise
        except Exception as e:  # noqa: BLE001 - a broken cache file, whatever broke it, is rebuilt
            print(f"[eval] cache file {path} could not be read ({type(e).__name__}): rebuilt", file=sys.stderr)
    value = compute()
    atomic_write(path, lambda tmp: torch.save(value, tmp))
    return value


# =============================================================================
# 3. SIMAT (m2-Mix Tab. 5; its score, geometry and ECE: protocols/m2mix_analysis.py)
# =============================================================================
def simat(model, preprocess, tokenizer, root="data", split="test", lambdas=m2mix_analysis.SIMAT_LAMBDAS,
          batch_size=256, device=None) -> dict:
    """SIMAT on the public layout: simat_db/images/<'A subj rel obj'>/<region_id>.jpg, triplets.csv (region_id,
    subj, rel, obj[, dataset_id]), transfos.csv (region_id, value, target, target_ids, norm2, is_test), and the
    OSCAR matrix oscar_similarity_matrix.pt (images in dataset_id order x captions). Image order = dataset_id,
    else ImageFolder order (sorted folder, file). Words are encoded bare, as in the SIMAT release.
    split: 'test' (rows with is_test True) or 'dev' (the others)."""
    if split not in ("test", "dev"):
        raise ValueError(f"SIMAT split is 'test' or 'dev', not {split!r}")
    found = [d for d in (Path(root) / "simat/simat_db", Path(root) / "simat") if (d / "transfos.csv").exists()]
    d = found[0] if found else _require(Path(root) / "simat/simat_db/transfos.csv", "simat", root).parent
    with open(d / "triplets.csv", newline="") as f:
        trip = [{**r, "folder": f"A {r['subj']} {r['rel']} {r['obj']}"} for r in csv.DictReader(f)]
    by_dataset_id = "dataset_id" in trip[0]
    trip.sort(key=lambda r: int(r["dataset_id"]) if by_dataset_id else (r["folder"], f"{r['region_id']}.jpg"))
    rid2did = {int(r["region_id"]): i for i, r in enumerate(trip)}
    paths = [d / "images" / r["folder"] / f"{r['region_id']}.jpg" for r in trip]
    missing = sum(not p.is_file() for p in paths)
    if missing:
        raise MissingData(f"simat: {missing} of {len(paths)} images not found (e.g. "
                          f"{next(p for p in paths if not p.is_file())}); run SIMAT's prepare_dataset.py. "
                          f"{BENCHMARKS['simat'][1]}")
    with open(d / "transfos.csv", newline="") as f:
        tr = [r for r in csv.DictReader(f) if (r["is_test"] == "True") == (split == "test")]
    oscar = torch.as_tensor(loading.load_weights_only(_require(d / "oscar_similarity_matrix.pt", "simat", root)))
    img = image_features(model, preprocess, [str(p) for p in paths], batch_size, device=device)
    words = sorted({r["value"] for r in tr} | {r["target"] for r in tr})
    w = dict(zip(words, common.encode_texts(model, tokenizer, words, device=device)))
    scores = m2mix_analysis.simat_score(img, torch.tensor([rid2did[int(r["region_id"])] for r in tr]),
                         torch.stack([w[r["value"]] for r in tr]), torch.stack([w[r["target"]] for r in tr]),
                         [int(r["target_ids"]) for r in tr], oscar, [float(r["norm2"]) ** -0.5 for r in tr], lambdas)
    best = max(scores, key=scores.get)
    return {"simat": scores[best], "simat_best_lambda": best, **{f"simat@lambda={k:g}": v for k, v in scores.items()},
            "queries": len(tr)}


# =============================================================================
# 4. Evaluate
# =============================================================================
def evaluate(model, preprocess, tokenizer, tasks, data_root="data", text_mode="truncate", batch_size=256,
             device=None, model_name="", weights="", analyses=(), download=False, strict=False, workers=0,
             cache_dir=None, synthetic_n=None, log=None, simat_protocol="ours"):
    """Evaluates `model` on each task; one record per (task, metric, text mode).
    text_mode: 'truncate' (the papers' protocol), 'sentence-mean', 'both', or a list. Image features are computed
    once per task, text features once per task and mode. analyses: ('geometry', 'ece') adds m2-Mix's geometry and
    calibration (from the same features) to retrieval tasks. A task may also be 'simat' (simat_protocol: 'ours' or
    'code', E5). Records: task, metric, value, protocol, text_mode, missing (images absent on disk), n (queries),
    model, weights. synthetic_n: evaluate on the first n scenes of the synthetic splits."""
    model.eval()
    modes = (["truncate", "sentence-mean"] if text_mode == "both" else
             [text_mode] if isinstance(text_mode, str) else list(text_mode))
    records = []
    base = {"model": model_name, "weights": weights}
    for name in tasks:
        t0 = time.time()
        if name == "simat":
            split, lambdas = m2mix_analysis.SIMAT_PROTOCOLS[simat_protocol]
            res = simat(model, preprocess, tokenizer, data_root, split=split, lambdas=lambdas,
                        batch_size=batch_size, device=device)
            n = res.pop("queries")
            protocol = (f"SIMAT {split} split, max over lambda in {{{', '.join(f'{x:g}' for x in lambdas)}}}"
                        + (" (m2-Mix code)" if simat_protocol == "code" else ""))
            records += [{"task": name, "metric": m, "value": v, "protocol": protocol,
                         "text_mode": "words", "missing": 0, "n": n, **base} for m, v in res.items()]
        elif is_classification(name):
            cs = load_classification(name, data_root, download=download, synthetic_n=synthetic_n)
            img = image_features(model, preprocess, cs.image_paths, batch_size, workers, device=device)
            clf = zero_shot_head(model, tokenizer, cs.classnames, cs.templates, device=device, cache_dir=cache_dir)
            res = (imagenet_shifts.grouped_accuracy(img, clf, cs.labels, cs.groups) if cs.groups else
                   {**common.zero_shot_accuracy(img, clf, cs.labels, name=name),
                    "mean_per_class_recall": mean_per_class_recall(img, clf, cs.labels)})
            records += [{"task": name, "metric": m, "value": v, "protocol": cs.protocol,
                         "text_mode": "prompt-ensemble", "missing": cs.missing, "n": len(cs.labels), **base}
                        for m, v in res.items()]
        else:
            rs = load_retrieval(name, data_root, strict=strict, synthetic_n=synthetic_n)
            img = image_features(model, preprocess, rs.image_paths, batch_size, workers, device=device)
            for mode in modes:
                txt = text_features(model, tokenizer, rs.texts, mode, device=device)
                res = common.retrieval_metrics(img, txt, rs.text_to_image, name=name)
                if analyses:
                    extra = m2mix_analysis.analyze_retrieval(img, txt, rs.text_to_image,
                                                             model.logit_scale.exp().item())
                    res.update({k: v for k, v in extra.items()  # the ece_* keys with 'ece', the others with 'geometry'
                                if ("ece" if k.startswith("ece") else "geometry") in analyses})
                records += [{"task": name, "metric": m, "value": v, "protocol": rs.protocol, "text_mode": mode,
                             "missing": rs.missing, "n": len(rs.texts), **base,
                             **({"dropped": rs.dropped} if rs.dropped else {})} for m, v in res.items()]
        if log:
            log(f"[eval] {name}: {time.time() - t0:.1f}s")
    return records


# =============================================================================
# Published numbers (their one home: plumbing/published.py) and the tables that print them
# =============================================================================
def published_numbers(paper: str, backbone: str) -> dict:
    """The paper's CLIP row {(task, metric): value} for this backbone (OpenAI or open_clip spelling), or {}."""
    if paper not in published.PUBLISHED:
        raise ValueError(f"unknown paper {paper!r}; known: {', '.join(published.PUBLISHED)}")
    openai = models.openai_name(backbone)
    return published.PUBLISHED[paper].get(openai, {})


def erclip_tables(rows1, rows2, window: bool = False) -> str:
    (c1, c2), cut = published.erclip_cols(window), "cut at the window" if window else "truncated at the context"
    return (f"Table 1: long-caption retrieval, R@1 (%), captions {cut}\n\n" + markdown_table(rows1, c1, "{:.2f}")
            + "\n\nTable 2: long avg R@1, COCO 5k R@1, zero-shot top-1 (%)\n\n"
            + markdown_table(rows2, c2, "{:.2f}"))


def results_table(records, metrics=OWN_METRICS, published=None) -> str:
    """Markdown table, one row per task (and text mode when several); with `published` ({(task, metric): value})
    a 'paper' column after each metric; a 'missing' column when some benchmark lacked images."""
    modes = {r["text_mode"] for r in records if not is_classification(r["task"])} - {"words"}
    rows = {}
    for r in records:
        if r["metric"] not in metrics:
            continue
        label = r["task"] + (f" [{r['text_mode']}]" if len(modes) > 1 and r["text_mode"] in modes else "")
        row = rows.setdefault(label, {"task": label, "missing": r.get("missing", 0)})
        row[r["metric"]] = r["value"]
        if published and (r["task"], r["metric"]) in published:
            row[f"{r['metric']} (paper)"] = float(published[(r["task"], r["metric"])])
    cols = ["task"]
    for m in (m for m in metrics if any(m in row for row in rows.values())):  # columns some task has
        cols += [m, f"{m} (paper)"] if published and any(k[1] == m for k in published) else [m]
    if any(row["missing"] for row in rows.values()):
        cols.append("missing")
    return markdown_table(list(rows.values()), cols)


ANALYSIS_METRICS = ("align", "unif", "align_code", "unif_code", "wi_align", "wi_unif_img", "wi_unif_txt", "gap",
                    "ece_scale", "ece_i2t", "ece_t2i", "ece_i2t_min", "ece_i2t_best_tau", "ece_t2i_min",
                    "ece_t2i_best_tau", "simat", "simat_best_lambda")


def analysis_table(records, published=None) -> str:
    """Geometry / ECE / SIMAT records: a row per (task, text mode), a column per metric; a '(paper)' row per task."""
    rows, cols = {}, ["task"]
    for r in records:
        if r["metric"] not in ANALYSIS_METRICS:
            continue
        label = r["task"] + ("" if r["text_mode"] in ("truncate", "words") else f" [{r['text_mode']}]")
        rows.setdefault(label, {"task": label})[r["metric"]] = r["value"]
        paper = (published or {}).get((r["task"], r["metric"]))
        if paper is not None:
            rows.setdefault(f"{r['task']} (paper)", {"task": f"{r['task']} (paper)"})[r["metric"]] = float(paper)
    cols += [m for m in ANALYSIS_METRICS if any(m in row for row in rows.values())]
    return markdown_table(list(rows.values()), cols, floatfmt="{:.3g}") if rows else ""


# =============================================================================
# 5. Continual evaluation (C-CLIP, DNS)
# =============================================================================
def continual_row(records, tasks, metrics=("i2t_R@1", "t2i_R@1"), zero_shot=()) -> dict:
    """A continual-matrix row from evaluate()'s records, in the format of common.run_continual's evaluate():
    per_task[metric][j] = score on tasks[j]; scalars['<task>/<metric>'] of zero-shot tasks (PD: row 0 - last row)."""
    value = {(r["task"], r["metric"], r["text_mode"]): r["value"] for r in records}
    first_mode = {r["task"]: r["text_mode"] for r in reversed(records)}  # reversed: each task's first record wins
    per_task = {m: [value[(t, m, first_mode[t])] for t in tasks] for m in metrics}
    scalars = {f"{r['task']}/{r['metric']}": r["value"] for r in records
               if r["task"] in zero_shot and r["text_mode"] == first_mode[r["task"]]}
    return {"per_task": per_task, "scalars": scalars}


def continual_summary(rows) -> dict:
    """common.summarize_continual of continual_row's rows (row 0: before any training): matrices, metrics, PD."""
    return common.summarize_continual({"rows": [r["per_task"] for r in rows], "scalars": [r["scalars"] for r in rows],
                                       "seconds": [0.0] * len(rows), "steps": [0] * len(rows)})


def continual_headline(summary, unseen, zero_shot) -> dict:
    """C-CLIP's ablation row (Sec. 5.2.1 shape): final and average R@1, BWT, forgetting, learned (what a task gains
    while it is trained: mean_j R[j][j] - R[j-1][j]), unseen-set I2T R@1 (Sec. 3.3), the mean zero-shot PD over
    the sets, and the mean over the sets of the largest drop below the pretrained accuracy after any task."""
    m, R = summary["metrics"]["R@1"], summary["matrices"]["R@1"]
    pds = [summary["pd"][f"{z}/top1"] for z in zero_shot if f"{z}/top1" in summary["pd"]]
    rows = summary["scalars"]  # the worst drop along the way, which the final PD can hide
    drops = [max(rows[0][f"{z}/top1"] - r[f"{z}/top1"] for r in rows) for z in zero_shot if f"{z}/top1" in rows[0]]
    return {"last R@1": m["last"], "avg R@1": m["avg"], "BWT": m["bwt"], "forgetting": m["forgetting"],
            "learned": sum(R[j][j - 1] - R[j - 1][j - 1] for j in range(1, len(R))) / (len(R) - 1),
            "unseen I2T R@1": summary["scalars"][-1].get(f"{unseen}/i2t_R@1") if unseen else None,
            "zero-shot PD": sum(pds) / len(pds) if pds else None,
            "worst zero-shot drop": sum(drops) / len(drops) if drops else None}


def continual_tables(summary, tasks) -> str:
    """Markdown: each metric's matrix R (rows = after task i; one direction's R@5 / R@10: in the summaries and the
    records only), its summaries, and PD."""
    parts = []
    for m, R in summary["matrices"].items():
        if m.endswith(("@5", "@10")) and not m.startswith("R@"):  # one direction's R@5 / R@10: not printed
            continue
        rows = [{"after": "pretrained" if i == 0 else f"task {i}", **dict(zip(tasks, map(float, row)))}
                for i, row in enumerate(R)]
        parts.append(f"R[i][j], {m}:\n\n" + markdown_table(rows, ["after", *tasks]))
    mrows = [{"metric": m, **v} for m, v in summary["metrics"].items()]
    parts.append(markdown_table(mrows, ["metric", "last", "avg", "bwt", "forgetting"]))
    if summary["pd"]:
        parts.append(markdown_table([{"zero-shot": k, "PD": float(v)} for k, v in summary["pd"].items()],
                                           ["zero-shot", "PD"]))
    return "\n\n".join(parts)


def masked_continual_metrics(R) -> dict:
    """common.continual_metrics when every entry of the last row exists; otherwise the same definitions over the
    tasks that have the metric (NaN columns, e.g. accuracy on a dataset without classes, are left out)."""
    R = np.asarray(R, dtype=float)
    T = R.shape[1]
    cols = [j for j in range(T) if np.isfinite(R[T, j])]
    if len(cols) == T:
        return common.continual_metrics(R)
    if not cols:
        return {k: float("nan") for k in ("last", "avg", "bwt", "forgetting")}
    seen = [R[i, [j for j in cols if j < i]].mean() for i in range(1, T + 1) if any(j < i for j in cols)]
    old = [j for j in cols if j < T - 1]  # column j is task j+1; R[j+1, j] = right after learning it
    return {"last": float(R[T, cols].mean()), "avg": float(np.mean(seen)),
            "bwt": float(np.mean([R[T, j] - R[j + 1, j] for j in old])) if old else 0.0,
            "forgetting": float(np.mean([R[:T, j].max() - R[T, j] for j in old])) if old else 0.0}


def evaluate_checkpoints(backbone, checkpoints, tasks, zero_shot=(), data_root="data", device="cpu",
                         metrics=("i2t_R@1", "t2i_R@1"), world=None, **kw) -> dict:
    """Continual evaluation of checkpoints: [0] before any training ('pretrained': the backbone's default weights),
    [i] after task i; tasks[j]: task j+1's test set (world: the lab's, for the tiny backbone's weights). Returns
    common.summarize_continual's dict (+ 'records')."""
    if len(checkpoints) != len(tasks) + 1:
        raise UsageError(f"--continual: need {len(tasks) + 1} checkpoints for {len(tasks)} task(s) (pretrained "
                                f"+ one per task), got {len(checkpoints)}")
    rows, records = [], []
    for i, ck in enumerate(checkpoints):
        model, _, preprocess, tok = models.load_model(backbone, "" if ck == "pretrained" else ck, device=device,
                                                      world=world)
        recs = evaluate(model, preprocess, tok, [*tasks, *zero_shot], data_root, model_name=backbone, weights=ck,
                        device=device, **kw)
        rows.append(continual_row(recs, tasks, metrics, zero_shot))
        records += [dict(r, row=i) for r in recs]
    return {**continual_summary(rows), "records": records}


def mean_per_class_recall(img, classifier, labels) -> float:
    """Balanced accuracy (percent): the mean over the classes present of each one's top-1 recall, CLIP_benchmark's
    mean_per_class_recall (sklearn's balanced_accuracy_score of the argmax); a tie goes against the gold class."""
    logits = img.float() @ classifier.float().to(img.device)
    labels = labels.to(img.device)
    hit = ((logits >= logits.gather(1, labels.view(-1, 1))).sum(1) == 1).float()
    count = torch.bincount(labels, minlength=logits.shape[1]).float()
    recall = torch.zeros_like(count).index_add_(0, labels, hit) / count.clamp(min=1)
    return 100.0 * recall[count > 0].mean().item()


def clip_benchmark_files(records, model: str, pretrained: str) -> dict:
    """CLIP_benchmark's result files {file name: content} of the records (protocols/clip_benchmark.py)."""
    return clip_benchmark.clip_benchmark_files(records, model, pretrained, is_classification)


def validator(cfg, preprocess, tasks=()) -> Callable | None:
    """common.train's validate= for --val-every (None when it is off): the model evaluated on --val-data's sets
    (comma-separated; each tagged by its name: results.task_tags), or the run's first evaluation task, through the
    model's own text window (Long-CLIP's stretched one)."""
    if not cfg.val_every:
        return None
    chosen = [t.strip() for t in cfg.val_data.split(",") if t.strip()] or list(tasks)[:1]
    if not chosen:
        raise UsageError("--val-every needs a validation set: pass --val-data (eval.py tasks or manifests)")
    check_tasks(chosen, cfg.data_root, "--val-data")
    tags = task_tags(chosen)

    def validate(model):
        tokenizer = models.get_tokenizer(cfg.backbone, models.text_tower(model).context_length)
        return {f"{tags[r['task']]}/{r['metric']}": r["value"] for r in evaluate(
            model, preprocess, tokenizer, chosen, cfg.data_root, model_name=cfg.backbone, weights="during training")}
    return validate


# =============================================================================
# 6. Main
# =============================================================================


def _expand(spec: str) -> list:
    out = []
    for t in filter(None, (s.strip() for s in spec.split(","))):
        out += _expand(TASK_GROUPS[t]) if t in TASK_GROUPS else [t]
    return out


def main(argv=None, world=None):
    a = command_line().parse_args(argv)
    flags.note_spellings(sys.argv[1:] if argv is None else argv, flags.CLIP_BENCHMARK, "CLIP_benchmark's")
    if a.out.endswith(".json"):
        raise UsageError(f"--out / --output {a.out}: a folder here (results.json, and CLIP_benchmark's files "
                                f"with --format clip_benchmark), not a file name")
    flags.CSV_COLUMNS.update({k: getattr(a, k) for k in flags.CSV_COLUMNS})  # the manifests in --tasks
    if a.format == "clip_benchmark" and (a.wise_ft or a.continual):
        raise UsageError("--format clip_benchmark writes one evaluation's results; not with --wise-ft or "
                                "--continual")
    if (a.resume or a.er_line) and not a.wise_ft:
        raise UsageError(f"{'--resume' if a.resume else '--er-line'} belongs to a WiSE-FT curve: add --wise-ft")
    if models.wants_lab(a) and not models.tiny_known():  # eval.py never imports the lab (it sits above)
        raise UsageError("--backbone tiny and the synthetic-* sets are the lab's: run this command as "
                                "python -m lab eval ARGS (the lab registers them when it is imported)")
    common.check_device(a)
    runfolder.EVALUATING = Path(a.out)  # what a stop keeps (plumbing/cli.py, issue 72.3)
    if a.out:  # issue 69.2 (a finished run's results.json was replaced): checked, and claimed before any write
        outfolder.claim(Path(a.out), "eval", "--out", outfolder.EVAL_FILES)
    tasks = _expand(a.tasks)
    check_tasks([t for t in [*tasks, *_expand(a.zero_shot)] if not (a.download and is_classification(t))],
                a.data_root, "--tasks")  # names and indexes before any model (--download fetches CIFAR later)
    curve_settings = wise_ft.preflight(a, tasks) if a.wise_ft else None  # its files, --resume's: before any model
    device = common.init_distributed(a.device)
    kw = dict(text_mode=a.text_mode, batch_size=a.batch_size, analyses=tuple(filter(None, a.analyses.split(","))),
              download=a.download, strict=a.strict, workers=a.workers, cache_dir=a.cache_dir,
              synthetic_n=a.synthetic_n, simat_protocol=a.simat_protocol, log=lambda s: print(s, file=sys.stderr))
    published = published_numbers(a.paper, a.backbone) if a.paper else None
    if a.paper and not published:
        print(f"[eval] {a.paper} publishes no CLIP row for {a.backbone}", file=sys.stderr)
    t0 = time.time()
    results = document("eval", [], tasks=tasks, config=vars(a))  # stages: eval, alpha A, task i (row i)
    if a.continual:
        zs = _expand(a.zero_shot)
        summary = evaluate_checkpoints(a.backbone, a.continual.split(","), tasks, zs, a.data_root, device,
                                       world=world, **kw)
        print(continual_tables(summary, tasks))
        results.update(continual=summary, records=[dict(r, stage=sequence_stage(r["row"]))
                                                   for r in summary.pop("records")])
    else:
        model, _, preprocess, tok = models.load_model(a.backbone, a.pretrained, device=device, world=world)
        if a.context_length:  # another window than the model's (longclip.py evaluates both)
            if a.context_length > models.text_tower(model).context_length:
                raise UsageError(f"--context-length {a.context_length} is longer than the model's text "
                                        f"window ({models.text_tower(model).context_length})")
            tok = models.get_tokenizer(a.backbone, a.context_length)
            results["context_length"] = a.context_length
        if a.wise_ft:  # each alpha kept as it finishes, effective robustness, the figure: protocols/wise_ft.py
            curve = wise_ft.run(a, model, curve_settings, lambda m: evaluate(
                m, preprocess, tok, tasks, a.data_root, device=device, model_name=a.backbone,
                weights=f"wise-ft:{a.wise_ft}", **kw), wise_ft.command_run(sys.argv[1:] if argv is None else argv))
            results.update(curve, records=[r for c in curve["wise_ft"] for r in staged(
                c["records"], f"alpha {c['alpha']:g}", alpha=c["alpha"])])
        else:
            records = evaluate(model, preprocess, tok, tasks, a.data_root, device=device, model_name=a.backbone,
                               weights=a.pretrained or "default", **kw)
            print(results_table(records, published=published))
            if extra := analysis_table(records, published):
                print("\n" + extra)
            results["records"] = staged(records, "eval")
    results["seconds"] = time.time() - t0
    results["protocols"] = {r["task"]: r["protocol"] for r in results.get("records", [])}  # e.g. COCO's captions
    if published:
        results["published"] = {f"{t}/{m}": v for (t, m), v in published.items()}
    bench = (clip_benchmark_files(results["records"], models.resolve_backbone(a.backbone), a.pretrained)
             if a.out and a.format == "clip_benchmark" and results.get("records") else {})  # not with --wise-ft
    if a.out:  # its own earlier output, or nothing there it would replace; its receipt
        outfolder.claim(Path(a.out), "eval", "--out", (*outfolder.EVAL_FILES, *bench))
    for name, content in bench.items():
        atomic_write(Path(a.out) / name, json.dumps(content, indent=1))
    if a.out:
        common.write_results(a.out, results)
        print(f"[eval] wrote {Path(a.out) / 'results.json'} ({results['seconds']:.0f}s)", file=sys.stderr)
    return results.get("records", [])


if __name__ == "__main__":
    cli(main)
