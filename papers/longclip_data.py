"""Long-CLIP's data plumbing (longclip.py): its training manifest from ShareGPT4V (deviations 8, 9),
the manifest of each --train-data, the short caption of the released code (deviation 8), and an
erclip.py results file read back for the same-budget comparison (--erclip-results)."""
from __future__ import annotations

import json
from pathlib import Path

from plumbing.base import DataError, atomic_write
from plumbing.loading import reusable_manifest, source_stamp
from plumbing import models
from papers import erclip_data
from plumbing.results import pick, read


def first_sentence(text: str) -> str:
    """Deviation 8: the released code's short caption, the text before the first '. '."""
    return text.replace("\n", " ").split(". ")[0].strip()


def sharegpt4v_manifest(sharegpt4v, out_dir, holdout: int = 1000) -> Path:
    """Long-CLIP's training set (deviations 8, 9): the ShareGPT4V records after the first `holdout` (the
    ShareGPT4V-1k test set) whose image is not a test image; long caption = the reply (conversations[1])
    with newlines as spaces, caption = its first sentence. Written once as JSONL under out_dir (image
    paths relative to it; ShareGPT4V's are relative to the data root), rebuilt when the json changes (its
    sidecar records the source)."""
    out_dir = Path(out_dir)
    path = out_dir / f"longclip-train-sharegpt4v-{holdout}.jsonl"
    sources = {"sharegpt4v": sharegpt4v}
    if reusable_manifest(path, sources):  # written once, rebuilt when the json changed
        return path
    if not Path(sharegpt4v).is_file():
        raise DataError(f"ShareGPT4V json not found: {sharegpt4v} (see the data layout in README.md)")
    records = json.loads(Path(sharegpt4v).read_text())
    held_out = {r.get("image") for r in records[:holdout]}
    rows = []
    for r in records[holdout:]:
        conv = r.get("conversations", [])
        text = " ".join(str(conv[1].get("value", "")).split()) if len(conv) > 1 else ""
        if text and r.get("image") and r["image"] not in held_out:  # else dropped (counted in the sidecar)
            rows.append({"image": str(Path("..") / r["image"]), "caption": first_sentence(text) or text,
                         "long_caption": text})
    if not rows:
        raise DataError(f"{sharegpt4v}: no training record after the first {holdout}")
    atomic_write(path, "".join(json.dumps(r) + "\n" for r in rows))  # makes out_dir
    atomic_write(out_dir / (path.name + ".json"), json.dumps(
        {"sharegpt4v": str(sharegpt4v), "pairs": len(rows), "dropped": len(records) - holdout - len(rows),
         "holdout_records": holdout, "sources": source_stamp(sources)}))
    return path


def train_manifest(cfg, world: models.LabWorld | None = None) -> Path:
    """The training manifest of a longclip.LongCLIPConfig's --train-data (world: the lab's)."""
    root = Path(cfg.data_root)
    sharegpt4v = cfg.sharegpt4v or root / "sharegpt4v" / "share-captioner_coco_lcs_sam_1246k_1107.json"
    if cfg.train_data == "synthetic":
        lab = models.lab_world(world, "--train-data synthetic")
        return lab.synthetic_manifest("train", root, n=cfg.train_pairs or None)
    if cfg.train_data == "coco-sharegpt4v":  # ERCLIP's file, shared (deviation 12)
        coco = cfg.coco_captions or root / "coco" / "annotations" / "captions_train2017.json"
        return erclip_data.coco_sharegpt4v_manifest(coco, sharegpt4v, root / "erclip", cfg.train_pairs or 20000)
    if cfg.train_data == "sharegpt4v":
        return sharegpt4v_manifest(sharegpt4v, root / "longclip")
    return Path(cfg.train_data)


def read_erclip_results(path) -> tuple[str, list, float]:
    """(variant, tuned records, lambda_p) of an erclip.py results.json (plumbing.results' schema: the records of
    stage 'tuned'; a file written before it: its 'tuned' list)."""
    p = Path(path)
    try:
        res = read(p, "--erclip-results")
        return res["variant"], pick(res["records"], stage="tuned"), float(res["config"]["lambda_p"])
    except (KeyError, TypeError) as e:
        raise DataError(f"--erclip-results {p}: not an erclip.py results.json ({type(e).__name__}: {e})")
