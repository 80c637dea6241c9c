"""m2-Mix's training sets (m2mix.py --train-data flickr30k | coco) as JSONL manifests, from the annotation files
eval.py's retrieval readers use: Karpathy's split files (Flickr30k train, COCO train + restval; C-CLIP's benchmark
builder, commands.vlcl, reads its images too) and COCO's captions_train2017.json; and m2mix.py's choice of
training manifest and test protocols from its flags."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from plumbing import models
from protocols import class_folders
from plumbing.datafolders import kind
from plumbing.manifests import LAYOUTS
from plumbing.base import DataError, UsageError, atomic_write
from plumbing.shards import is_shards


KARPATHY_TRAIN_SPLITS = {"flickr30k": ("train",), "coco": ("train", "restval")}  # restval: the usual 113k


def karpathy_images(dataset: str, data_root) -> list[dict]:
    """Karpathy's split file data_root/<dataset>/dataset_<dataset>.json (images[].filename, filepath, split,
    sentences[].raw), an image each: {split, path, imgid, sentences (stripped, empty ones dropped)}. Images:
    flickr30k/images/<filename>, coco/<filepath>/<filename> (train2014/, val2014/)."""
    root = Path(data_root) / dataset
    ann = root / f"dataset_{dataset}.json"
    if not ann.exists():
        raise DataError(f"{ann} not found: put the Karpathy split file there (see README, data layout)")
    image_dir = root / "images" if dataset == "flickr30k" else root
    return [{"split": im["split"], "path": image_dir / im.get("filepath", "") / im["filename"],
             "imgid": im.get("imgid"), "sentences": [s["raw"].strip() for s in im["sentences"] if s["raw"].strip()]}
            for im in json.loads(ann.read_text())["images"]]


def karpathy_train_manifest(dataset: str, data_root, split: str, captions: str, out_dir) -> Path:
    """A JSONL manifest (absolute image paths) of a Karpathy split (karpathy_images); captions: 'first' or 'all'."""
    splits = KARPATHY_TRAIN_SPLITS[dataset] if split == "train" else (split,)
    rows = [{"image": str(im["path"].resolve()), "caption": c} for im in karpathy_images(dataset, data_root)
            if im["split"] in splits for c in (im["sentences"][:1] if captions == "first" else im["sentences"])]
    if not rows:
        raise DataError(f"{Path(data_root) / dataset}/dataset_{dataset}.json: no images in split(s) {splits}")
    return _write_rows(rows, Path(out_dir) / f"{dataset}-karpathy-{split}-{captions}.jsonl")


def coco2017_train_manifest(data_root, captions: str, out_dir) -> Path:
    """COCO train2017 (the paper's split, Sec. 5.1) from coco/annotations/captions_train2017.json; the first
    caption of an image is its first annotation in file order (as eval.py's coco-1cap takes it)."""
    root = Path(data_root) / "coco"
    ann_file = root / "annotations" / "captions_train2017.json"
    if not ann_file.exists():
        raise DataError(f"{ann_file} not found (see README, data layout)")
    ann = json.loads(ann_file.read_text())
    files = {im["id"]: str((root / "train2017" / im["file_name"]).resolve()) for im in ann["images"]}
    rows, seen = [], set()
    for a in ann["annotations"]:
        if captions == "all" or a["image_id"] not in seen:
            seen.add(a["image_id"])
            rows.append({"image": files[a["image_id"]], "caption": " ".join(a["caption"].split())})
    return _write_rows(rows, Path(out_dir) / f"coco-train2017-{captions}.jsonl")


def _write_rows(rows, path: Path) -> Path:
    """A JSONL manifest, written atomically, so that the ranks of a torchrun job may all write the same file."""
    return atomic_write(path, "".join(json.dumps(r) + "\n" for r in rows))


# ---- m2mix.py's choice of training manifest and test protocols (--train-data, --coco-split, --eval-tasks) ----
def train_manifest(cfg, world: models.LabWorld | None = None) -> Path:
    """The manifest m2mix.py trains on (cfg: m2mix.M2MixConfig; world: the lab's); written under <out>/data/."""
    data_dir = Path(cfg.out) / "data"
    if class_folders.folder_of(cfg.train_data):  # imagefolder:DIR or a class-folder DIR: class prompts (72.2)
        class_folders.describe(cfg.train_data, lambda line: print(line, file=sys.stderr))
        return class_folders.training_manifest(cfg.train_data)
    if cfg.train_data == "synthetic":  # the lab's world
        return models.lab_world(world, "--train-data synthetic").synthetic_manifest("train", cfg.data_root)
    if cfg.train_data == "flickr30k":
        return karpathy_train_manifest("flickr30k", cfg.data_root, "train", cfg.train_captions, data_dir)
    if cfg.train_data == "coco":
        if cfg.coco_split == "2017":
            return coco2017_train_manifest(cfg.data_root, cfg.train_captions, data_dir)
        return karpathy_train_manifest("coco", cfg.data_root, "train", cfg.train_captions, data_dir)
    return Path(cfg.train_data)


def eval_tasks(cfg) -> dict:
    """Our label -> eval.py task: the all-caption (standard) protocol and the code's one-caption
    protocol (1:1, Table 1's), on the test set matching the training split (COCO 2017 train ->
    val2017; Karpathy train -> Karpathy test, never val2017, which overlaps Karpathy's train +
    restval images)."""
    if cfg.eval_tasks:
        return {t: t for t in cfg.eval_tasks.split(",") if t and cfg.eval_tasks != "none"}
    if cfg.train_data == "synthetic":
        return {"synthetic-short": "synthetic-short"}
    if cfg.train_data == "flickr30k":
        return {"flickr30k": "flickr30k", "flickr30k-1cap": "flickr30k-1cap"}
    if cfg.train_data == "coco" and cfg.coco_split == "2017":
        return {"coco": "coco", "coco-1cap": "coco-1cap"}
    if cfg.train_data == "coco":
        one = karpathy_train_manifest("coco", cfg.data_root, "test", "first", Path(cfg.out) / "data")
        return {"coco-karpathy": "coco-karpathy", "coco-karpathy-1cap": str(one)}
    if is_shards(cfg.train_data):  # webdataset shards: no test set to go with them
        raise UsageError("--train-data names tar shards: pass --eval-tasks (eval.py tasks or "
                                "manifests; 'none': train without evaluating)")
    if Path(cfg.train_data).is_dir() and kind(cfg.train_data) is None:  # it was blamed on an evaluation task
        raise DataError(f"--train-data {cfg.train_data}: a folder of no layout read here (nor class folders, "
                        f"DIR/<class>/<image>); training data are {LAYOUTS}")
    if class_folders.folder_of(cfg.train_data):  # no test set goes with class folders: evaluate afterwards
        return {}  # (eval.py --tasks imagenet-shifts --wise-ft; docs/protocols.md), or name them in --eval-tasks
    return {Path(cfg.train_data).stem: cfg.train_data}
