"""Writes a manifest's rows as webdataset shards that plumbing/shards.py reads (--train-data
'DIR/{00000..00099}.tar'): per sample the image file's bytes (.jpg / .png / .webp; another format, which the
reader skips, re-encoded as PNG), `<key>.txt` (the caption) and `<key>.json` (every column), and open_clip's
sizes.json.

    python -m commands.write_shards MANIFEST OUT_DIR [--per-shard 1000]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def command_line(argv=None) -> argparse.Namespace:
    """python -m commands.write_shards's settings (standard library only: --help and flag errors answer
    before torch loads)."""
    p = argparse.ArgumentParser(description="Write a manifest's rows as webdataset shards (+ sizes.json).",
                                allow_abbrev=False)
    p.add_argument("manifest", help="a JSONL / CSV manifest (image path relative to it, caption, ...)")
    p.add_argument("out_dir", help="folder for 00000.tar, 00001.tar, ... and sizes.json")
    p.add_argument("--per-shard", type=int, default=1000, help="samples per shard")
    a = p.parse_args(argv)
    if a.per_shard < 1:
        p.error("--per-shard must be >= 1")
    return a


if __name__ == "__main__":  # --help and flag errors before torch loads
    command_line(sys.argv[1:])

import io  # noqa: E402

from PIL import Image  # noqa: E402

import common  # noqa: E402
from plumbing.base import DataError, atomic_write  # noqa: E402
from plumbing.cli import cli  # noqa: E402
from plumbing.loading import to_rgb  # noqa: E402
from plumbing.shards import IMAGE_EXTS  # noqa: E402


def image_member(path: Path) -> tuple[str, bytes | None]:
    """(extension, bytes) of a row's image as a member the reader reads (shards.IMAGE_EXTS): a .jpg / .png / .webp
    file's bytes as they are, any other format (.gif, .bmp, .tiff, ...) re-encoded as a lossless PNG (the first
    frame; a mode PNG has not as shards.py would read it, to_rgb); ("why", None) when it does not decode."""
    ext = path.suffix.lower().lstrip(".")
    if ext in IMAGE_EXTS:
        return "jpg" if ext == "jpeg" else ext, path.read_bytes()
    try:
        with Image.open(path) as im:
            im.load()
            png = io.BytesIO()
            (im if im.mode in ("1", "L", "LA", "P", "RGB", "RGBA") else to_rgb(im)).save(png, "PNG")
    except Exception as e:  # PIL raises many types
        return f"undecodable image ({type(e).__name__}: {e})", None
    return "png", png.getvalue()


def write_shards(manifest, out_dir, per_shard: int = 1000) -> str:
    """Every good row of a manifest as shards in out_dir (webdataset.ShardWriter), plus sizes.json; returns the
    brace pattern to pass as --train-data."""
    import webdataset as wds
    ds = common.ManifestDataset(manifest, check_images="none")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sizes, skipped = {}, []
    with wds.ShardWriter(str(out / "%05d.tar"), maxcount=per_shard, verbose=0) as sink:  # a new shard after
        for i, row in enumerate(ds.rows):  # per_shard samples (or 3 GB)
            path = ds.image_file(row)
            ext, data = image_member(path)
            if data is None:
                skipped.append(f"{path}: {ext}")
                continue
            meta = {k: v for k, v in row.items() if not k.startswith("_") and k != ds.image_key}
            meta["caption"] = ds._caption(row)
            sink.write({"__key__": f"{i:09d}", ext: data, "txt": meta["caption"], "json": json.dumps(meta)})
            name = Path(sink.fname).name
            sizes[name] = sizes.get(name, 0) + 1
    if not sizes:
        raise DataError(f"{manifest}: no row written: {len(skipped)} image(s) not decodable, e.g. {skipped[0]}")
    if skipped:
        print(f"[shards] {len(skipped)} row(s) not written, their image not decodable to re-encode, e.g. "
              f"{skipped[0]}", file=sys.stderr)
    atomic_write(out / "sizes.json", json.dumps(sizes, indent=1))
    last = len(sizes) - 1
    return str(out / f"{{00000..{last:05d}}}.tar") if last else str(out / "00000.tar")


def main(argv=None):
    a = command_line(argv)
    print(f"--train-data '{write_shards(a.manifest, a.out_dir, a.per_shard)}'")


if __name__ == "__main__":
    cli(main)
