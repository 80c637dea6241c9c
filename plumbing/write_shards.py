"""Writes a manifest's rows as webdataset shards that plumbing/shards.py reads (--train-data
'DIR/{00000..00099}.tar'): per sample the image file's bytes, `<key>.txt` (the caption) and `<key>.json` (every
column), and open_clip's sizes.json.

    python -m plumbing.write_shards MANIFEST OUT_DIR [--per-shard 1000]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def command_line(argv=None) -> argparse.Namespace:
    """python -m plumbing.write_shards's settings (standard library only: --help and flag errors answer
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

import common  # noqa: E402
from plumbing.base import atomic_write  # noqa: E402
from plumbing.cli import cli  # noqa: E402


def write_shards(manifest, out_dir, per_shard: int = 1000) -> str:
    """Every good row of a manifest as shards in out_dir (webdataset.ShardWriter), plus sizes.json; returns the
    brace pattern to pass as --train-data."""
    import webdataset as wds
    ds = common.ManifestDataset(manifest, check_images="none")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sizes = {}
    with wds.ShardWriter(str(out / "%05d.tar"), maxcount=per_shard, verbose=0) as sink:  # a new shard after
        for i, row in enumerate(ds.rows):  # per_shard samples (or 3 GB)
            path = ds.image_file(row)
            ext = path.suffix.lower().lstrip(".")
            meta = {k: v for k, v in row.items() if not k.startswith("_") and k != ds.image_key}
            meta["caption"] = ds._caption(row)
            sink.write({"__key__": f"{i:09d}", "jpg" if ext == "jpeg" else ext: path.read_bytes(),
                        "txt": meta["caption"], "json": json.dumps(meta)})
            name = Path(sink.fname).name
            sizes[name] = sizes.get(name, 0) + 1
    atomic_write(out / "sizes.json", json.dumps(sizes, indent=1))
    last = len(sizes) - 1
    return str(out / f"{{00000..{last:05d}}}.tar") if last else str(out / "00000.tar")


def main(argv=None):
    a = command_line(argv)
    print(f"--train-data '{write_shards(a.manifest, a.out_dir, a.per_shard)}'")


if __name__ == "__main__":
    cli(main)
