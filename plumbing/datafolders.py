"""Folders read as training or evaluation data (issue 42.2), turned into manifest rows: the layouts researchers
keep besides a manifest file.

- A Hugging Face `datasets` folder: what `Dataset.save_to_disk` writes (state.json, dataset_info.json,
  data-*.arrow), or parquet files (the Hub's `data/train-00000-of-00001.parquet`, or one `.parquet` file). Its
  columns are the rows' keys; an image column (a `datasets.Image` feature, or a string column named as a
  manifest's image) is written once as image files into the cache folder (CLIPFT_CACHE, `folder-data/`), with
  a manifest there, keyed by the folder's path and fingerprint (state.json's `_fingerprint`; parquet: the files'
  sizes and times), so a changed dataset is converted again. A `save_to_disk` of a DatasetDict (dataset_dict.json)
  is several splits: name one (`DIR/train`).
- Images with sidecars, as webdataset's extracted shards and many datasets ship them: `NAME.jpg` with
  `NAME.txt` (its caption) and / or `NAME.json` (an object whose keys become the row's: caption, long_caption,
  ...), anywhere under the folder, in sorted path order.

Rows come back with absolute image paths (so `manifest.parent / image` is the image) and `_line`, the row's
number (1-based) in that order. An ImageFolder (class subfolders, no sidecars) is a classification set:
evaluation reads it as `imagefolder:DIR`; m2mix.py and the baselines' runs train on its class prompts
(protocols/class_folders.py); anywhere else it is refused with those pointers."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from plumbing.base import CACHE_DIR, DataError
from plumbing.folders import recover

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
SIDECARS = (".txt", ".json")
FOLDER_LAYOUTS = ("a Hugging Face datasets folder (save_to_disk's, or parquet files) whose columns are the keys; "
                  "a folder of images with .txt / .json sidecars (NAME.jpg + NAME.txt)")


def kind(path) -> str | None:
    """'hf-disk' | 'hf-dict' | 'parquet' | 'sidecars' | 'imagefolder' | None (an empty or unknown folder)."""
    path = Path(path)
    if path.is_file():
        return "parquet" if path.suffix == ".parquet" else None
    if (path / "state.json").is_file() and any(path.glob("*.arrow")):
        return "hf-disk"
    if (path / "dataset_dict.json").is_file():
        return "hf-dict"
    if any(path.rglob("*.parquet")):
        return "parquet"
    images = [p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES]
    if any(p.with_suffix(s).is_file() for p in images for s in SIDECARS):
        return "sidecars"
    if images and all(p.parent.parent == path for p in images):
        return "imagefolder"
    return None


# The conversion cache's format: 2 since issue 55.2 (rows.jsonl in ASCII JSON, split at "\n" only: a caption
# holding U+2028 or \x85 split the old one's lines, and the broken conversion stayed cached)
CACHE_FORMAT = 2


def rows(path, image_keys, layouts: str) -> list[dict]:
    """Manifest rows of a data folder (see the module's docstring); a DataError naming the accepted layouts when
    `path` is none of them. image_keys: the column names a manifest's image may sit in; layouts: the accepted
    layouts in words, for the message."""
    path, found = Path(path), kind(path)
    if found == "sidecars":
        return _sidecar_rows(path)
    if found in ("hf-disk", "parquet"):
        return _hf_rows(path, found, image_keys)
    if found == "hf-dict":
        splits = _json_object(path / "dataset_dict.json").get("splits", [])
        raise DataError(f"{path} holds a DatasetDict (splits {', '.join(splits)}): name one split, e.g. "
                        f"{path / (splits[0] if splits else 'train')}")
    if found == "imagefolder":
        raise DataError(f"{path} is an ImageFolder (class subfolders): a classification set, which has no captions "
                        f"to retrieve with or long captions to train on; evaluate it as imagefolder:{path}; m2mix.py "
                        f"trains on its class prompts (docs/protocols.md). Data with captions: {layouts}")
    raise DataError(f"{path} is a folder of no layout read here; training and evaluation data are {layouts}")


def _json_object(file: Path) -> dict:
    """A Hugging Face folder's metadata file (dataset_dict.json, state.json) as a JSON object, or one DataError
    naming the file (issue 55.2: `[]` or text that is not JSON were tracebacks)."""
    try:
        value = json.loads(file.read_bytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{file}: not Hugging Face's metadata, not JSON ({type(e).__name__}: {e})") from None
    if not isinstance(value, dict):
        raise DataError(f"{file}: not Hugging Face's metadata: a JSON object expected, found {type(value).__name__}")
    return value


def _sidecar_rows(folder: Path) -> list[dict]:
    """One row per image, with its .json sidecar's columns and its .txt sidecar as the caption. A sidecar that is
    not UTF-8, or a .json that is not one JSON object, makes its row {'_error': why, naming the file} (the row
    check's message, or skipped and counted with --skip-bad)."""
    out = []
    images = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    for i, image in enumerate(images, 1):
        row = {}
        if (meta := image.with_suffix(".json")).is_file():
            try:
                value = json.loads(meta.read_bytes().decode("utf-8"))
            except UnicodeDecodeError as e:
                value = {"_error": f"{meta}: not valid UTF-8 (byte {e.start})"}
            except ValueError as e:
                value = {"_error": f"{meta}: not a JSON object ({type(e).__name__}: {e})"}
            if not isinstance(value, dict):
                value = {"_error": f"{meta}: a sidecar must be a JSON object, found {type(value).__name__}"}
            row.update(value)
        if (text := image.with_suffix(".txt")).is_file():
            try:
                row["caption"] = text.read_bytes().decode("utf-8").strip()
            except UnicodeDecodeError as e:
                row.setdefault("_error", f"{text}: not valid UTF-8 (byte {e.start})")
        out.append({**row, "image": str(image.resolve()), "_line": i})
    return out


def _fingerprint(path: Path, found: str) -> str:
    if found == "hf-disk":
        state = _json_object(path / "state.json")
        files = state.get("_data_files", [])
        if not isinstance(files, list) or not all(isinstance(f, dict) and "filename" in f for f in files):
            raise DataError(f"{path / 'state.json'}: not Hugging Face's metadata (_data_files: a list of "
                            f"{{'filename': ...}} expected)")
        key = [state.get("_fingerprint"), [f["filename"] for f in files]]
    else:
        files = [path] if path.is_file() else sorted(path.rglob("*.parquet"))
        key = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key.append(CACHE_FORMAT)
    return hashlib.sha256(json.dumps([str(path.resolve()), key]).encode()).hexdigest()[:20]


def _hf_rows(path: Path, found: str, image_keys) -> list[dict]:
    """A Hugging Face folder's rows, its images written once under the cache folder (see the docstring)."""
    target = CACHE_DIR / "folder-data" / _fingerprint(path, found)
    manifest = target / "rows.jsonl"
    if not manifest.is_file():
        _convert(path, found, image_keys, target)
    rows = []
    for i, line in enumerate(filter(None, manifest.read_text(encoding="utf-8").split("\n")), 1):
        r = json.loads(line)
        if isinstance(r.get("_image"), str):
            r[r.pop("_image_key")] = str(target / r.pop("_image"))
        rows.append({**r, "_line": i})
    return rows


def _convert(path: Path, found: str, image_keys, target: Path):
    key, records = _records(path, found, image_keys)
    print(f"[data] {path}: a Hugging Face dataset; its rows and images are written once into {target}",
          file=sys.stderr, flush=True)
    recover(target)  # an interrupted conversion's hidden folder, its process gone (one still running: left alone)
    tmp = target.with_name(f".{target.name}.new-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "images").mkdir(parents=True)
    base = path if path.is_dir() else path.parent
    lines = []
    for i, row in enumerate(records):
        image = row.get(key) if key else None
        if isinstance(image, dict):  # an Image feature's bytes (or a path beside the dataset)
            data = image.get("bytes")
            if data is None and image.get("path"):
                src = Path(image["path"]) if Path(image["path"]).is_absolute() else base / image["path"]
                outside = not Path(os.path.realpath(src)).is_relative_to(os.path.realpath(base))  # issue 55.3
                if outside:
                    row = {**row, key: None, "_error": f"its image path {image['path']} is outside the dataset "
                                                       f"folder {base}: not read"}
                data = src.read_bytes() if src.is_file() and not outside else None
            if data is not None:
                name = f"images/{i:08d}{_suffix(data, image.get('path'))}"
                (tmp / name).write_bytes(data)
                row = {**row, key: None, "_image": name, "_image_key": key}
        elif isinstance(image, str):  # a path, relative to the dataset folder
            row = {**row, key: str((base / image).resolve())}
        lines.append(json.dumps({k: v for k, v in row.items() if _plain(v)}))  # ASCII: no line break inside
        if (i + 1) % 10000 == 0:
            print(f"[data] {path}: {i + 1} rows written", file=sys.stderr, flush=True)
    (tmp / "rows.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp / "source.json").write_text(json.dumps({"source": str(path.resolve()), "layout": found, "rows": len(lines),
                                                 "image_column": key}))
    try:
        os.rename(tmp, target)  # several processes (torchrun) may convert at once: the first one in is kept
    except OSError:
        if not (target / "rows.jsonl").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _records(path: Path, found: str, image_keys):
    """(the image column or None, an iterator of the rows as dicts; an image as {'bytes', 'path'}): a save_to_disk
    folder through datasets (memory-mapped), parquet files through pyarrow, batch by batch (no copy in a cache)."""
    try:
        if found == "hf-disk":
            import datasets
            ds = datasets.load_from_disk(str(path))
            key = next((k for k, f in ds.features.items() if isinstance(f, datasets.Image)), None)
            if key is not None:
                return key, iter(ds.cast_column(key, datasets.Image(decode=False)))  # bytes as stored
            return next((k for k in image_keys if k in ds.features), None), iter(ds)
        import pyarrow as pa
        import pyarrow.parquet as pq
        files = [pq.ParquetFile(f) for f in ([path] if path.is_file() else sorted(path.rglob("*.parquet")))]
    except ImportError:
        raise DataError(f"{path} is a Hugging Face datasets folder: pip install datasets to read it") from None
    except Exception as e:  # noqa: BLE001 (arrow's and datasets' own errors: one message naming the folder)
        raise DataError(f"{path}: not readable as a Hugging Face dataset ({type(e).__name__}: {e})") from None
    schema = files[0].schema_arrow
    key = next((f.name for f in schema if pa.types.is_struct(f.type) and f.type.get_field_index("bytes") >= 0),
               None) or next((k for k in image_keys if k in schema.names), None)
    return key, (r for f in files for batch in f.iter_batches(batch_size=256) for r in batch.to_pylist())


def _plain(v) -> bool:
    """A value a manifest row keeps: text, numbers, lists of them (captions), None."""
    return v is None or isinstance(v, (str, int, float, bool)) or isinstance(v, list) and all(map(_plain, v))


def _suffix(data: bytes, name) -> str:
    if name and Path(name).suffix.lower() in IMAGE_SUFFIXES:
        return Path(name).suffix.lower()
    return ".png" if data[:4] == b"\x89PNG" else ".jpg" if data[:2] == b"\xff\xd8" else ".img"
