"""One paper's training set, built from its public sources, below common: ERCLIP's COCO + ShareGPT4V pairs
(erclip.py, and longclip.py's --recipe erclip-budget, reach it as erclip_data.coco_sharegpt4v_manifest). It
imports plumbing.base and plumbing.loading only."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from plumbing.base import DataError, atomic_write
from plumbing.loading import reusable_manifest, source_stamp


# erclip.py's --train-data auto, when its files are missing: what they are (and the images they name), then what
# else can run (issue 72.5: the message named the two JSON files only)
AUTO_NEEDS = ("COCO train2017 captions + ShareGPT4V descriptions, Sec. 4; both name COCO's train2017 images, which go "
              "in coco/train2017/", "; the GPU paths with random weights and no data: python benchmarks/gpu_check.py")


def coco_sharegpt4v_manifest(coco_captions, sharegpt4v, out_dir, n_pairs: int = 20000, holdout: int = 1000) -> Path:
    """ERCLIP's training set (its paper's Sec. 4, erclip.py's deviation 9; longclip.py's --recipe erclip-budget
    reuses it): the first n_pairs, in COCO image-id order, of the COCO train2017 images that ShareGPT4V
    describes; short caption = the image's first COCO caption, long caption = the ShareGPT4V description.
    Images of the first `holdout` ShareGPT4V records (the ShareGPT4V-1k test set) are excluded. Written once as
    JSONL (image paths relative to it) and reused while its sources are unchanged."""
    out_dir = Path(out_dir)
    path = out_dir / f"erclip-train-coco-sharegpt4v-{n_pairs}.jsonl"
    sources = {"coco_captions": coco_captions, "sharegpt4v": sharegpt4v}
    if reusable_manifest(path, sources):
        return path
    for p, what in ((coco_captions, "COCO captions_train2017.json"), (sharegpt4v, "ShareGPT4V json")):
        if not Path(p).is_file():
            raise DataError(f"{what} not found: {p} (see the data layout in README.md)")
    coco = json.loads(Path(coco_captions).read_text())
    file_of = {im["id"]: im["file_name"] for im in coco["images"]}
    first_caption = {}
    for a in coco["annotations"]:  # file order: the first annotation of an image is its first caption
        first_caption.setdefault(a["image_id"], a["caption"].strip())
    records = json.loads(Path(sharegpt4v).read_text())
    prefix = "coco/train2017/"
    held_out = {r.get("image") for r in records[:holdout]}
    long_of = {}
    for r in records[holdout:]:
        img = r.get("image", "")
        if img.startswith(prefix) and img not in held_out and img not in long_of:
            text = next((c["value"] for c in r.get("conversations", []) if c.get("from") == "gpt"), "")
            if text.strip():
                long_of[img] = text.strip()
    pool = sorted(i for i, f in file_of.items() if prefix + f in long_of and i in first_caption)
    if not pool:
        raise DataError(f"no COCO train2017 image of {coco_captions} is described in {sharegpt4v}")
    if len(pool) < n_pairs:
        print(f"[data] only {len(pool)} shared images, fewer than the {n_pairs} asked for; using all",
              file=sys.stderr)
    rel = Path("..") if out_dir.name == "erclip" else Path(".")  # images are relative to the data root
    rows = [{"image": str(rel / prefix / file_of[i]), "caption": first_caption[i],
             "long_caption": long_of[prefix + file_of[i]], "coco_id": i} for i in pool[:n_pairs]]
    atomic_write(path, "".join(json.dumps(r) + "\n" for r in rows))
    atomic_write(out_dir / (path.name + ".json"), json.dumps(
        {"coco_captions": str(coco_captions), "sharegpt4v": str(sharegpt4v), "pool": len(pool),
         "pairs": len(rows), "holdout_records": holdout, "sources": source_stamp(sources)}, indent=1))
    return path
