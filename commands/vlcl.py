"""C-CLIP's benchmark as distributed (Liu, Zhu, Wei, Tian, "C-CLIP: Multimodal Continual Learning for
Vision-Language Model", ICLR 2025, Sec. 3.2): the eight tasks and the unseen set, built from their public sources
into the layout `python cclip.py --tasks vlcl` reads.

    python -m commands.vlcl [--source research|koyoimai] [--data-root data] [--hf-cache DIR] [--task-path TASK=DIR ...]

writes data/vlcl/<task>/{train,test}.jsonl (image paths relative to them), the images the Hugging Face datasets
carry (data/vlcl/<task>/images/<source split>/<row>.<ext>: written once, named by their source row), the unseen set
data/vlcl/havg/test.jsonl, and data/vlcl/prepare.json: per task the source (dataset id, its files' fingerprint),
the split rule and seed, the row counts and the manifests' sha256. Run again, it rewrites the manifests (images
already written are kept) and names each task whose source changed since prepare.json. Offline first: Hugging
Face datasets come from the local cache (--hf-cache, else HF_HOME's) or from a folder per task (--task-path
pets=DIR: a save_to_disk folder, parquet files, or a downloaded dataset repository); nothing is fetched unless
--online. Missing sources stop the
run before anything is written, with one message listing per task what is missing and how to fetch it.

Sources, read from the two public codes (no official code exists):
  research  the first author's github.com/SmallPigPeppa/clip-lightning, clip_openai/ (dataloaders/base_hf.py,
            flickr30k_json.py, coco2014.py, data_module_dil_json_zeroshot_hf_all.py)
  koyoimai  the reimplementation github.com/KoyoImai/C-CLIP, c_clip/dataset.py (TASK_NAMES, _load_hf_split)

Deviations and choices (numbered; V1-V7):
  V1. --source research is the default: it is the paper's authors' code. Its fractional splits shuffle with numpy
      under Lightning's global seed (seed_everything 6) after whatever else drew from that generator, so they
      cannot be reproduced from the public code: the same fractions are split here by a seeded permutation
      (numpy default_rng(--seed, 6 by default), train = the first round(N f) rows, test the rest; the research
      code takes int(N f) and int(N (1 - f)), leaving a row unused: N 151 gives 120 / 30 there, 121 / 30 here;
      --split-counts research). koyoimai's splits are reproduced exactly: datasets' train_test_split(test_size=1 - f,
      seed=42).
  V2. The sources differ (research / koyoimai): Flickr30K, Karpathy's split file (train + val / test 1k) /
      nlphuji/flickr30k's own split column (train / test, its val rows unused); COCO, Karpathy 2014 (train +
      restval / test 5k) / COCO 2017 (train2017 / val2017, captions from COCO's captions_*2017.json, first 5, as
      KoyoImai's c_clip/dataset.py reads them at 1e4cd41; its HF loader reads phiyodr/coco2017's); Simpsons,
      bigdata-pw/TheSimpsons (jpg, caption.txt) / Norod78/simpsons-blip-captions; WikiArt, AterMors/wikiart_recaption
      (its text) / fusing/wikiart_captions' images with captions KoyoImai generated with BLIP-2 (a parquet in their
      repository: --task-path wikiart-captions=FILE; without it the task is reported missing); Kream 50/50 in both.
  V3. Several captions per image in training (Flickr30K, COCO, WikiArt's lists): research's base_hf.py drew one per
      sample (random.choice) only in early versions, without simpsons / lexica / kream / sketch; the versions with
      all eight tasks take text[0] or the longest (--train-captions first | longest). Ours: one row per image with a
      `captions` list, which common.ManifestDataset draws from per sample, seeded (the same on resume);
      --train-captions rows: one row per caption (koyoimai's _build_index), each caption once an epoch.
  V4. Testing: Flickr30K and COCO keep the first 5 captions per image (both codes), one row each; single-caption
      tasks one row per image; a list elsewhere: its first caption (research's evaluation base_hf.py, text[0]).
  V5. HausaVG (the unseen set): HausaNLP/HausaVG's validation split, en_text (research); koyoimai has no unseen set,
      so both settings use research's.
  V6. Captions are kept as distributed (the tokenizer lowercases; both codes cut at 77 tokens); an empty caption
      drops the row (koyoimai writes "a photo"), counted in prepare.json.
  V7. koyoimai's COCO reads the images from the local COCO 2017 folders (data/coco/{train2017,val2017}), as it does.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

TASKS = ("flickr30k", "coco", "pets", "lexica", "simpsons", "wikiart", "kream", "sketch")  # Sec. 3.2's order
UNSEEN = "havg"


@dataclass(frozen=True)
class HF:
    """A Hugging Face dataset: `repo`, its image and caption columns; splits (train, test) by name, or a fraction
    of `split` for training (the rest for testing), or a `filter` column holding each row's split."""
    repo: str
    image: str
    caption: str
    splits: tuple = ()  # (train split, test split) as distributed
    split: str = "train"  # the split a fraction or a filter column is applied to
    fraction: float = 0.0  # training share of `split`
    filter: str = ""  # a column naming each row's split (nlphuji/flickr30k)
    test_only: str = ""  # the unseen set: this split, for testing only
    captions_from: str = ""  # koyoimai's WikiArt: captions from a parquet (image_idx, caption)


@dataclass(frozen=True)
class Karpathy:
    """Karpathy's split file data/<name>/dataset_<name>.json (papers/m2mix_data.py's layout)."""
    name: str
    train: tuple
    test: str = "test"


@dataclass(frozen=True)
class Coco2017:
    """COCO 2017's own annotations (data/coco/annotations/captions_{train,val}2017.json), 5 captions per image."""
    name: str = "coco2017"


RESEARCH = {
    "flickr30k": Karpathy("flickr30k", ("train", "val")),
    "coco": Karpathy("coco", ("train", "restval")),
    "pets": HF("visual-layer/oxford-iiit-pet-vl-enriched", "image", "caption_enriched", splits=("train", "test")),
    "lexica": HF("vera365/lexica_dataset", "image", "prompt", splits=("train", "test")),
    "simpsons": HF("bigdata-pw/TheSimpsons", "jpg", "caption.txt", fraction=0.8),
    "wikiart": HF("AterMors/wikiart_recaption", "image", "text", fraction=0.8),
    "kream": HF("hahminlew/kream-product-blip-captions", "image", "text", fraction=0.5),
    "sketch": HF("zoheb/sketch-scene", "image", "text", fraction=0.8),
    "havg": HF("HausaNLP/HausaVG", "image", "en_text", test_only="validation"),
}
KOYOIMAI = {
    **RESEARCH,
    "flickr30k": HF("nlphuji/flickr30k", "image", "caption", split="test", filter="split"),
    "coco": Coco2017(),
    "simpsons": HF("Norod78/simpsons-blip-captions", "image", "text", fraction=0.8),
    "wikiart": HF("fusing/wikiart_captions", "image", "caption", fraction=0.8, captions_from="wikiart-captions"),
}
SOURCES = {"research": RESEARCH, "koyoimai": KOYOIMAI}
SEEDS = {"research": 6, "koyoimai": 42}  # V1: Lightning's seed_everything 6 / KoyoImai's default seed 42
TEST_CAPTIONS = 5  # V4


def command_line(argv=None) -> argparse.Namespace:
    """The settings (standard library only: --help and flag errors answer before torch loads)."""
    p = argparse.ArgumentParser(description="Build C-CLIP's 8 tasks and the unseen set under <data-root>/vlcl.",
                                allow_abbrev=False)
    p.add_argument("--source", choices=tuple(SOURCES), default="research", help="whose sources and splits (V1, V2)")
    p.add_argument("--data-root", default="data", help="root of the benchmark folders (flickr30k/, coco/, vlcl/)")
    p.add_argument("--hf-cache", default="", help="Hugging Face datasets cache ('': HF_HOME's)")
    p.add_argument("--task-path", action="append", default=[], metavar="TASK=DIR",
                   help="a folder (save_to_disk, parquet files, a dataset repository) for a task; "
                        "wikiart-captions=FILE: KoyoImai's BLIP-2 WikiArt captions")
    p.add_argument("--seed", type=int, default=None, help="seed of the fractional splits (default: the source's, V1)")
    p.add_argument("--train-captions", choices=("draw", "rows", "first", "longest"), default="draw",
                   help="several captions per image in training: draw one per sample | one row per caption | "
                        "the first | the longest (V3)")
    p.add_argument("--split-counts", choices=("ours", "research"), default="ours",
                   help="fractional splits: train round(N f), test the rest | int(N f) / int(N (1 - f)) (V1)")
    p.add_argument("--online", action="store_true", help="let datasets download what the cache lacks")
    a = p.parse_args(argv)
    bad = [t for t in a.task_path if "=" not in t or t.split("=")[0] not in (*TASKS, UNSEEN, "wikiart-captions")]
    if bad:
        p.error(f"--task-path TASK=DIR with TASK one of {', '.join((*TASKS, UNSEEN, 'wikiart-captions'))}: {bad[0]!r}")
    a.paths = dict(t.split("=", 1) for t in a.task_path)
    a.seed = SEEDS[a.source] if a.seed is None else a.seed
    return a


if __name__ == "__main__":
    command_line(sys.argv[1:])  # --help and flag errors before torch loads

from plumbing.base import DataError, UsageError, atomic_write
from plumbing.cli import cli
from plumbing.loading import file_sha256
from papers import m2mix_data  # noqa: E402


def fetch_hint(repo: str) -> str:
    return f"huggingface-cli download --repo-type dataset {repo}  (or --task-path with a folder holding it)"


# ----------------------------------------------------------------------------- reading the sources
def _datasets():
    try:
        import datasets
    except ImportError:
        raise UsageError("vlcl.py reads Hugging Face datasets: pip install datasets") from None
    return datasets


def load_hf(src: HF, split: str, hf_cache: str, path: str, online: bool):
    """One split of `src` without decoding images, from --task-path (save_to_disk folder, parquet files or a
    dataset repository folder) or the Hugging Face cache. Raises FileNotFoundError when it is not there."""
    datasets = _datasets()
    if path:
        p = Path(path)
        if (p / "dataset_dict.json").exists() or (p / "state.json").exists():
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise FileNotFoundError(f"{p} has no split '{split}' (it holds {', '.join(ds) or 'none'})")
                ds = ds[split]
        elif p.exists():
            try:
                ds = datasets.load_dataset(str(p), split=split)
            except ValueError as e:  # an unknown split: datasets names the ones there are
                raise FileNotFoundError(f"{p}: no split '{split}' ({e})") from None
        else:
            raise FileNotFoundError(f"{p} not found")
    else:
        from huggingface_hub import constants
        was = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
        constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = not online or was[0]  # the cache only
        try:
            ds = datasets.load_dataset(src.repo, split=split, cache_dir=hf_cache or None)
        except Exception as e:  # offline and not cached: datasets raises several types
            raise FileNotFoundError(f"{src.repo} (split {split}) is not in the Hugging Face cache "
                                    f"({hf_cache or 'HF_HOME'}): {type(e).__name__}") from None
        finally:
            constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = was
    if src.image in ds.features and isinstance(ds.features[src.image], datasets.Image):
        ds = ds.cast_column(src.image, datasets.Image(decode=False))  # the bytes as distributed
    return ds


def split_rows(n: int, fraction: float, seed: int, source: str, ds=None, counts: str = "ours") -> tuple[list, list]:
    """(train rows, test rows) of n rows: V1. koyoimai: datasets' train_test_split(test_size=1 - f, seed) as
    KoyoImai calls it (the rows it puts in each part, by index); research: a default_rng(seed) permutation, cut at
    round(n f) (counts 'ours') or taking int(n f) / int(n (1 - f)) rows as the research code does (counts
    'research': a row may be left unused)."""
    if source == "koyoimai" and ds is not None:
        parts = ds.add_column("_row", list(range(n))).select_columns(["_row"]).train_test_split(
            test_size=round(1.0 - fraction, 6), seed=seed)
        return list(parts["train"]["_row"]), list(parts["test"]["_row"])
    import numpy as np
    order = np.random.default_rng(seed).permutation(n).tolist()
    if counts == "research":
        cut, rest = int(n * fraction), int(n * (1.0 - fraction))
        return order[:cut], order[cut:cut + rest]
    cut = round(n * fraction)
    return order[:cut], order[cut:]


def _caption_list(value) -> list[str]:
    values = value if isinstance(value, list) else [value]
    return [" ".join(str(v).split()) for v in values if isinstance(v, str) and v.strip()]


def _image_bytes(value) -> tuple[bytes, str]:
    """(bytes, extension) of an undecoded Image cell ({'bytes', 'path'}) or raw bytes."""
    from PIL import Image
    data = value["bytes"] if isinstance(value, dict) else value
    if data is None and isinstance(value, dict) and value.get("path"):
        data = Path(value["path"]).read_bytes()
    with Image.open(io.BytesIO(data)) as im:
        fmt = (im.format or "png").lower()
    return data, {"jpeg": "jpg"}.get(fmt, fmt)


# ----------------------------------------------------------------------------- writing a task
@dataclass
class Written:
    train: list = field(default_factory=list)
    test: list = field(default_factory=list)
    dropped: int = 0


def hf_task(task: str, src: HF, out: Path, cfg, source: str, splits: dict) -> tuple[Written, dict]:
    """A Hugging Face task's rows (images written under out/images/<split>/) and its source record; splits: the
    datasets check_source loaded, by split name."""
    get = splits.__getitem__
    parts, rule = {}, ""
    if src.test_only:
        parts["test"] = [(src.test_only, get(src.test_only), None)]
        rule = f"{src.test_only} split, testing only"
    elif src.splits:
        parts = {part: [(split, get(split), None)] for part, split in zip(("train", "test"), src.splits)}
        rule = f"{src.splits[0]} / {src.splits[1]} as distributed"
    else:
        ds = get(src.split)
        if src.filter:
            names = ds[src.filter]
            rows = {s: [i for i, v in enumerate(names) if v == s] for s in ("train", "test")}
            rule = f"the '{src.filter}' column: train / test rows of split {src.split}"
        else:
            train, test = split_rows(len(ds), src.fraction, cfg.seed, source, ds, cfg.split_counts)
            rows = {"train": train, "test": test}
            rule = (f"{src.fraction:g} / {1 - src.fraction:g} of split {src.split}: " +
                    ("datasets' train_test_split" if source == "koyoimai" else "numpy default_rng permutation") +
                    f", seed {cfg.seed}")
        parts = {k: [(src.split, ds, sorted(v))] for k, v in rows.items()}
    captions = None
    if src.captions_from:  # V2: koyoimai's generated WikiArt captions, by image index
        f = cfg.paths[src.captions_from]
        table = _datasets().load_dataset("parquet", data_files=f, split="train")
        captions = dict(zip(table["image_idx"], table["caption"]))
    w, fingerprints = Written(), {}
    for part, pieces in parts.items():
        for split, ds, rows in pieces:
            fingerprints[split] = ds._fingerprint
            folder = out / "images" / split
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(len(ds)) if rows is None else rows:
                row = ds[i]
                caps = _caption_list(captions.get(i) if captions is not None else row[src.caption])
                if not caps:
                    w.dropped += 1
                    continue
                data, ext = _image_bytes(row[src.image])
                image = folder / f"{i:07d}.{ext}"  # the name is the source row
                if not image.is_file() or image.read_bytes() != data:  # new, changed, or cut by a kill
                    atomic_write(image, data)
                rel = str(image.relative_to(out))
                getattr(w, part).extend(_rows(rel, caps, part, cfg.train_captions, i))
    return w, {"dataset": src.repo, "fingerprints": fingerprints, "split": rule, "columns": [src.image, src.caption]}


def _rows(image: str, caps: list[str], part: str, train_captions: str, source_row) -> list[dict]:
    """The manifest rows of one image: V3 (training), V4 (testing)."""
    if part == "test":
        return [{"image": image, "caption": c, "source_row": source_row} for c in caps[:TEST_CAPTIONS]]
    if train_captions == "rows":
        return [{"image": image, "caption": c, "source_row": source_row} for c in caps]
    if train_captions in ("first", "longest"):  # the research base_hf.py versions that hold the eight tasks
        return [{"image": image, "caption": caps[0] if train_captions == "first" else max(caps, key=len),
                 "source_row": source_row}]
    return [{"image": image, "captions": caps, "source_row": source_row}]  # every row a list: one column


def check_source(task: str, src, cfg) -> dict:
    """Raises FileNotFoundError naming what `task` lacks (its files, or the splits it reads); returns the Hugging
    Face splits it loaded ({} for the other sources), which hf_task reads."""
    if isinstance(src, Karpathy):
        ann = Path(cfg.data_root) / src.name / f"dataset_{src.name}.json"
        if not ann.is_file():
            raise FileNotFoundError(f"{ann} (Karpathy's caption_datasets.zip, with the images beside it)")
    elif isinstance(src, Coco2017):
        for split in ("train2017", "val2017"):
            ann = Path(cfg.data_root) / "coco" / "annotations" / f"captions_{split}.json"
            if not ann.is_file():
                raise FileNotFoundError(f"{ann} (cocodataset.org, annotations_trainval2017.zip)")
    else:
        splits = {split: load_hf(src, split, cfg.hf_cache, cfg.paths.get(task, ""), cfg.online)
                  for split in ((src.test_only,) if src.test_only else src.splits or (src.split,))}
        if src.captions_from and not Path(cfg.paths.get(src.captions_from, "")).is_file():
            raise FileNotFoundError(f"--task-path {src.captions_from}=FILE (KoyoImai's wikiart_blip_captions.parquet)")
        for split, ds in splits.items():  # what hf_task reads, checked before anything is written
            wanted = [src.image] + ([] if src.captions_from else [src.caption])
            lacking = [c for c in wanted if c not in ds.column_names]
            if lacking:
                raise FileNotFoundError(f"split '{split}' has no column {' or '.join(map(repr, lacking))} (its "
                                        f"columns: {', '.join(ds.column_names)})")
            if len(ds) and not isinstance(ds.features[src.image], _datasets().Image) and not isinstance(
                    ds[0][src.image], (bytes, dict)):
                raise FileNotFoundError(f"split '{split}': column '{src.image}' holds "
                                        f"{type(ds[0][src.image]).__name__} values, not images")
        return splits
    return {}


def karpathy_task(task: str, src: Karpathy, out: Path, cfg) -> tuple[Written, dict]:
    ann = Path(cfg.data_root) / src.name / f"dataset_{src.name}.json"
    w = Written()
    for im in m2mix_data.karpathy_images(src.name, cfg.data_root):
        part = "train" if im["split"] in src.train else "test" if im["split"] == src.test else None
        if part is None:
            continue
        caps = _caption_list(im["sentences"])
        if not caps:
            w.dropped += 1
            continue
        getattr(w, part).extend(_rows(os.path.relpath(im["path"], out), caps, part, cfg.train_captions, im["imgid"]))
    return w, {"file": str(ann), "sha256": file_sha256(ann),
               "split": f"{'+'.join(src.train)} / {src.test} (Karpathy)"}


def coco2017_task(out: Path, cfg) -> tuple[Written, dict]:
    root, w, record = Path(cfg.data_root) / "coco", Written(), {"split": "train2017 / val2017"}
    for part, split in (("train", "train2017"), ("test", "val2017")):
        ann = root / "annotations" / f"captions_{split}.json"
        data = json.loads(ann.read_text())
        caps = {}
        for a in data["annotations"]:
            caps.setdefault(a["image_id"], []).append(a["caption"])
        for im in sorted(data["images"], key=lambda im: im["id"]):
            c = _caption_list(caps.get(im["id"], []))[:TEST_CAPTIONS]  # koyoimai: exactly 5 per image
            if not c:
                w.dropped += 1
                continue
            rel = os.path.relpath(root / split / im["file_name"], out)
            getattr(w, part).extend(_rows(rel, c, part, cfg.train_captions, im["id"]))
        record[f"{split}_sha256"] = file_sha256(ann)
    return w, record


# ----------------------------------------------------------------------------- the command
def prepare(cfg) -> dict:
    """Every task of --source into data/vlcl; returns prepare.json's content."""
    sources, root = SOURCES[cfg.source], Path(cfg.data_root) / "vlcl"
    names = [*TASKS, UNSEEN]
    record_file = root / "prepare.json"
    old = json.loads(record_file.read_text()) if record_file.is_file() else {}
    missing, found = [], {}
    for task in names:  # every source looked for first: a missing one stops the run before anything is written
        try:
            found[task] = check_source(task, sources[task], cfg)
        except FileNotFoundError as e:
            src = sources[task]
            missing.append(f"  {task}: {e}" + (f"; fetch: {fetch_hint(src.repo)}" if isinstance(src, HF) else ""))
    if missing:
        raise DataError(f"{len(missing)} of {len(names)} C-CLIP source(s) missing or unreadable (--source "
                               f"{cfg.source}; nothing was written; "
                               f"offline: the Hugging Face cache {cfg.hf_cache or '(HF_HOME)'} and --task-path):\n"
                               + "\n".join(missing))
    record_file.unlink(missing_ok=True)  # the build is marked complete (prepare.json) only at its end
    built = {}
    for task in names:
        src, out = sources[task], root / task
        print(f"[vlcl] {task}: reading {getattr(src, 'repo', None) or getattr(src, 'name', '')}", file=sys.stderr)
        if isinstance(src, Karpathy):
            built[task] = karpathy_task(task, src, out, cfg)
        elif isinstance(src, Coco2017):
            built[task] = coco2017_task(out, cfg)
        else:
            built[task] = hf_task(task, src, out, cfg, cfg.source, found[task])
    settings = {"source": cfg.source, "seed": cfg.seed, "train_captions": cfg.train_captions,
                "split_counts": cfg.split_counts}
    rec = {"settings": settings, "tasks": {}}
    for task, (w, source) in built.items():
        out = root / task
        entry = {"source": source, "dropped_empty_captions": w.dropped}
        for part in ("train", "test"):
            rows = getattr(w, part)
            if not rows:  # never a previous build's manifest beside this record
                (out / f"{part}.jsonl").unlink(missing_ok=True)
                continue
            path = atomic_write(out / f"{part}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
            images = len({r["image"] for r in rows})
            entry[part] = {"rows": len(rows), "images": images, "sha256": file_sha256(path)}
        was = old.get("tasks", {}).get(task)
        if was and old.get("settings") == settings and was["source"] != source:
            print(f"[vlcl] {task}: its source changed since {record_file} was written; rebuilt", file=sys.stderr)
        rec["tasks"][task] = entry
        counts = ", ".join(f"{p} {entry[p]['rows']} rows / {entry[p]['images']} images" for p in ("train", "test")
                           if p in entry)
        print(f"[vlcl] {task}: {counts}", file=sys.stderr)
    atomic_write(record_file, json.dumps(rec, indent=1))
    return rec


def unusable(rec: dict) -> list[str]:
    """The tasks prepare() could not give both splits (the unseen set: its test split), with why."""
    needs = {**{t: ("train", "test") for t in TASKS}, UNSEEN: ("test",)}
    return [f"  {task}: no {' / '.join(p for p in parts if p not in rec['tasks'][task])} rows "
            f"({rec['tasks'][task]['dropped_empty_captions']} dropped for an empty caption)"
            for task, parts in needs.items() if any(p not in rec["tasks"][task] for p in parts)]


def main(argv=None):
    a = command_line(argv)
    empty = unusable(prepare(a))
    if empty:
        raise DataError(f"the benchmark in {Path(a.data_root) / 'vlcl'} is not usable: {len(empty)} "
                               f"task(s) came out empty (prepare.json records them):\n" + "\n".join(empty))
    print(f"python cclip.py --tasks vlcl --data-root {a.data_root}")


if __name__ == "__main__":
    cli(main)
