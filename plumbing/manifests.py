"""Reading a training or evaluation manifest (JSONL, a JSON array, CSV / TSV) with every bad line named, and the
row check's image decoding (split across the processes, remembered on disk), below common: common's
ManifestDataset and eval.py's sets call them. Also dist_info, the one answer to "is torch.distributed
initialised, and as which rank of how many" (the row check, cli's StopSignals and common ask it). It imports
plumbing.base and, of the outside, torch.distributed, numpy and PIL."""
from __future__ import annotations

import csv
import hashlib
import json
import os
import re
from pathlib import Path
from array import array
from typing import Iterable, Sequence

import numpy as np
import torch.distributed as dist
from PIL import Image

from plumbing import base, datafolders
from plumbing.base import DataError, atomic_write
from plumbing.loading import big_image, file_sha256


MAX_LISTED = 20  # bad rows named in one error message; the rest are counted
IMAGE_KEYS = ("image", "filepath", "image_path", "file_name", "img")  # the columns a manifest's image may sit in
CAPTION_KEYS = ("caption", "title", "text", "captions")  # "captions": a list: training draws one, evaluation the first
LAYOUTS = ("a manifest: JSONL / JSON array / CSV or TSV rows with an image column ({}) and a caption column ({}), "
           "image paths relative to the manifest; {}; or webdataset tar shards 'DIR/{{00000..00099}}.tar' "
           "(docs/data.md)").format(", ".join(IMAGE_KEYS), ", ".join(CAPTION_KEYS), datafolders.FOLDER_LAYOUTS)


class Tally:
    """Problems met during a long run (images replaced in training): every one counted, the first `keep` named;
    memory stays flat however many there are. Tallies of several processes add up (merge)."""
    def __init__(self, keep: int = MAX_LISTED):
        self.keep, self.count, self.first = keep, 0, []

    def add(self, problems):
        self.count += len(problems)
        self.first += list(problems)[:self.keep - len(self.first)]

    def merge(self, others):
        for other in others:
            self.count += other.count
            self.first += other.first[:self.keep - len(self.first)]
        return self


def dist_info():
    """(rank, world, local_rank) from torchrun's environment; (0, 1, 0) otherwise."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))
    return 0, 1, 0


_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


def _not_utf8(values) -> bool:
    """The manifest is decoded with errors='surrogateescape': a non-UTF-8 byte becomes a lone surrogate, so a
    bad row can be named and skipped instead of refusing the whole file."""
    return any(isinstance(v, str) and _ESCAPED_BYTE.search(v) is not None for v in values)


def _json_array_rows(path, text) -> list[dict]:
    """A manifest that is one JSON array of row objects; each row's _line is where its object starts."""
    try:
        json.loads(text)  # strict parse first: a syntax error is named with its line
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: bad JSON ({e.msg})") from None
    decoder, sep = json.JSONDecoder(), re.compile(r"[\s,]*")
    rows, pos, line, counted = [], sep.match(text, text.index("[") + 1).end(), 1, 0
    while text[pos] != "]":
        line, counted = line + text.count("\n", counted, pos), pos
        value, pos = decoder.raw_decode(text, pos)
        if not isinstance(value, dict):
            raise DataError(f"{path}:{line}: a JSON array manifest must hold one object per row, "
                            f"found {type(value).__name__}")
        rows.append({**value, "_line": line})
        pos = sep.match(text, pos).end()
    return rows


def read_manifest(path, keep_bad: bool = False, sep: str = "") -> list[dict]:
    """Rows of a manifest: JSONL (lines end at "\\n" only, since U+2028 or \\x85 may sit inside a JSON string),
    a JSON array of objects, or CSV/TSV (separator detected; a quoted caption may span lines). Each row carries
    `_line`, the line where it starts. A line that is not UTF-8 or not JSON raises a DataError naming file and
    line; with keep_bad=True it comes back as {'_line': n, '_error': why} (ManifestDataset's skip_bad). sep: a CSV's
    separator (open_clip's --csv-separator); '' detects it."""
    return list(iter_manifest(path, keep_bad, sep))


def iter_manifest(path, keep_bad: bool = False, sep: str = ""):
    """read_manifest's rows one at a time: a JSONL or CSV file is read line by line, so a million-row manifest
    is never in memory whole (issue 55.3: ManifestDataset packs each row as it comes). A JSON array and a
    data folder are read whole. The file's errors (missing, not a regular file) come at the first row."""
    path = Path(path)
    if str(path).startswith("imagefolder:"):  # a script that does not read class folders (issue 72.2)
        raise DataError(f"{path}: class folders train on class-prompt captions with m2mix.py and the baselines' "
                        f"runs (docs/protocols.md, 'Fine-tuning on class folders'); this script trains on long "
                        f"captions too, which class folders lack. {LONG_CAPTIONS}")
    if not path.exists():
        raise DataError(f"manifest not found: {path}")
    if not path.is_dir() and not path.is_file():  # issue 55.3: /dev/zero was read until killed, a pipe read twice
        raise DataError(f"{path}: not a regular file (a device, a pipe or a socket): a manifest is read more than "
                        f"once and must end; write it to a file first (e.g. cat ... > rows.jsonl)")

    def bad(line, why):
        if not keep_bad:
            raise DataError(f"{path}:{line}: {why}")
        return {"_line": line, "_error": why}

    def checked(rows):  # every row's last check, a file's and a data folder's alike (issue 55.2)
        for r in rows:
            yield (bad(r["_line"], r["_error"]) if "_error" in r else
                   bad(r["_line"], "not valid UTF-8") if _not_utf8(r.values()) else r)

    if path.is_dir() or path.suffix == ".parquet":  # a Hugging Face folder, images with sidecars (issue 42.2)
        yield from checked(datafolders.rows(path, IMAGE_KEYS, LAYOUTS))
        return
    start = _first_char(path)
    csv_file = start not in "[{" and path.suffix not in (".jsonl", ".json")
    # JSONL lines end at "\n" only; csv reads its own line ends (newline=""); utf-8-sig drops a byte-order mark
    with open(path, encoding="utf-8-sig", errors="surrogateescape", newline="" if csv_file else "\n") as f:
        if start == "[":
            yield from checked(_json_array_rows(path, f.read()))
        elif csv_file:
            yield from checked(_csv_rows(f, sep))
        else:
            yield from checked(_jsonl_rows(f, bad))


def _first_char(path) -> str:
    """The file's first character that is not white space ('' when there is none), read 64 KiB at a time: a
    one-line JSON array is not read whole just to see its '['."""
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
        while chunk := f.read(1 << 16):
            if shown := chunk.lstrip():
                return shown[0]
    return ""


def _jsonl_rows(lines, bad):
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if _not_utf8([line]):
            yield bad(i, "not valid UTF-8")
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            yield bad(i, f"bad JSON ({e.msg})")
            continue
        yield dict(value, _line=i) if isinstance(value, dict) else bad(i, "not a JSON object")


def _csv_rows(f, sep):
    sep = {"\\t": "\t", "tab": "\t"}.get(sep, sep)  # open_clip's "\t" as typed in a shell
    if len(sep) > 1:
        raise DataError(f"--csv-separator {sep!r}: one character (or \\t), as csv reads it")
    try:
        sep = sep or csv.Sniffer().sniff(f.readline(), delimiters=",\t;|").delimiter
    except csv.Error:
        sep = ","
    f.seek(0)
    reader = csv.DictReader(f, delimiter=sep)
    reader.fieldnames  # reads the header
    end = reader.line_num  # line_num: lines consumed so far (a quoted field may span several)
    for r in reader:
        yield dict(r, _line=end + 1)
        end = reader.line_num


LONG_CAPTIONS = ("A long caption comes from a manifest's long_caption column, or, in a folder of images with "
                 "sidecars, from NAME.json beside NAME.jpg: {\"caption\": \"...\", \"long_caption\": \"...\"} (a "
                 "NAME.txt holds the short caption only; docs/data.md)")


def columns(path, cols, keys, need_long: bool = False, extra=()) -> tuple[str, str]:
    """A manifest's image and caption columns among `cols` (its first good row's): the named one (open_clip's
    --csv-img-key / --csv-caption-key, `keys`) when given, else the first of IMAGE_KEYS / CAPTION_KEYS present.
    A missing required column (and long_caption with need_long, each of extra) is one DataError."""
    image = next((k for k in ((keys[0],) if keys[0] else IMAGE_KEYS) if k in cols), None)
    caption = next((k for k in ((keys[1],) if keys[1] else CAPTION_KEYS) if k in cols), None)
    missing = [n for n, k in ((keys[0] or "image", image), (keys[1] or "caption", caption)) if k is None]
    missing += ["long_caption"] * (need_long and "long_caption" not in cols) + [k for k in extra if k not in cols]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing}; available: {sorted(cols)}" + (
            f". {LONG_CAPTIONS}" if "long_caption" in missing else ""))
    return image, caption


def content_sha256(path) -> str:
    """A data source's content: a manifest file's bytes; a data folder's rows (plumbing.datafolders: its captions,
    columns and image paths), so that a resume or a feature cache sees a changed folder."""
    path = Path(path)
    if path.is_file():
        return file_sha256(path)
    rows = json.dumps(read_manifest(path), sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(rows.encode("utf-8", errors="surrogateescape")).hexdigest()


def image_problem(path) -> str | None:
    """None when the image decodes in full, else what is wrong with it. Not PIL's verify(), which reads headers
    and checksums only (a truncated JPEG, or a PNG broken under valid checksums, passes it): load() decodes
    everything; draft() lets a JPEG decode at reduced scale (up to 8x faster), still reading the whole stream."""
    try:
        with Image.open(path) as im:
            big_image(im)
            im.draft("RGB", (64, 64))
            im.load()
    except Exception as e:  # PIL raises many types for corrupt files
        return f"undecodable image {path} ({type(e).__name__}: {e})"
    return None


_DECODED: dict[tuple, str | None] = {}  # (path, mtime_ns, size, ctime_ns) -> image_problem, for this process


def _remembered(cache_file: Path) -> dict:
    """The memo's {(path, mtime_ns, size, ctime_ns): problem}; a memo that is missing, not JSON or not of that
    shape (`[]`, `null`, an older layout) is nothing remembered: those images are decoded again."""
    try:
        memo = json.loads(Path(cache_file).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(memo, dict):
        return {}
    return {(p, *v[:3]): v[3] for p, v in memo.items() if isinstance(v, list) and len(v) == 4
            and all(isinstance(x, int) for x in v[:3]) and (v[3] is None or isinstance(v[3], str))}


def image_problems(paths, threads: int = 8, cache_file: Path | None = None, across_ranks: bool = False):
    """image_problem of each path, decoded in threads (PIL releases the GIL). A file decoded before and unchanged
    since (same mtime and size) is not decoded again: in this process (the preflight's row check is training's)
    and, with cache_file, in any earlier run (a JSON of [mtime_ns, size, ctime_ns, problem] per path, written by
    rank 0; the ctime changes on every write, so an image rewritten in place with its size and mtime put back is
    decoded again)
    across_ranks (every rank calls it, with the same paths): each rank decodes its share and all share the
    results (all_gather_object), so N processes check the images once, not N times."""
    from concurrent.futures import ThreadPoolExecutor
    paths = [str(p) for p in paths]  # each distinct file looked at once (a manifest may repeat an image)
    keys = {p: (p, st.st_mtime_ns, st.st_size, st.st_ctime_ns)
            for p, st in ((p, os.stat(p)) for p in dict.fromkeys(paths))}
    if cache_file is not None:
        _DECODED.update(_remembered(cache_file))
    todo = [k for k in keys.values() if k not in _DECODED]
    rank, world, _ = dist_info() if across_ranks else (0, 1, 0)
    mine = todo[rank::world]
    with ThreadPoolExecutor(max(1, min(threads, os.cpu_count() or 1))) as pool:
        found = list(zip(mine, pool.map(image_problem, [k[0] for k in mine], chunksize=64)))
    if world > 1 and todo:
        shares = [None] * world
        dist.all_gather_object(shares, found)
        found = [kp for share in shares for kp in share]
    _DECODED.update(found)
    if cache_file is not None and todo and rank == 0:
        atomic_write(cache_file, json.dumps({k[0]: [*k[1:], _DECODED[k]] for k in keys.values()}))
    return [_DECODED[keys[p]] for p in paths]


def image_check_cache(manifest) -> Path:
    """Where the row check remembers a manifest's decoded images (CLIPFT_CACHE/image-checks/)."""
    return (base.CACHE_DIR / "image-checks"
            / f"{hashlib.sha1(str(Path(manifest).resolve()).encode()).hexdigest()[:16]}.json")


IMAGE_SAMPLE = 1000  # --check-images sample: rows decoded before training (a fixed seeded choice)


def bad_rows_message(where, problems: Sequence[str], hint: str = "", what: str = "bad row(s)") -> str:
    """Every bad row up to MAX_LISTED, then how many more."""
    more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    return f"{where}: {len(problems)} {what}{hint}:\n  " + "\n  ".join(problems[:MAX_LISTED]) + more


class CompactRows(Sequence):
    """A manifest's rows as packed columns: per column, every row's value in one bytearray (b"s" + UTF-8 for text,
    b"j" + JSON otherwise, nothing where the row lacks the column) with its end offsets in an int64 array. A few
    buffers instead of millions of dicts, whose reference counts, touched by every read, make each forked
    DataLoader worker copy the pages they live on; rows[i] is the row's dict again, decoded on access. Filled a
    row at a time (append: ManifestDataset streams a manifest into it); keep() drops rows after the fact."""

    def __init__(self, rows: Iterable[dict] = ()):
        self.data: dict[str, bytearray] = {}
        self.ends: dict[str, array] = {}
        self.n, self.index = 0, None  # index: the kept rows' positions, once keep() has dropped some
        for r in rows:
            self.append(r)

    def append(self, row: dict):
        for c, v in row.items():
            if c not in self.data:  # a column first seen now: the earlier rows lack it
                self.data[c], self.ends[c] = bytearray(), array("q", [0] * self.n)
            self.data[c] += (b"s" + v.encode("utf-8", "surrogateescape") if isinstance(v, str)
                             else b"j" + json.dumps(v).encode())
        for c, ends in self.ends.items():
            ends.append(len(self.data[c]))
        self.n += 1

    def keep(self, mask: Sequence[bool]):
        """Keep only the rows whose mask is true (rows[i] renumbered over them)."""
        mask = np.asarray(mask, bool)
        self.index = None if mask.all() else np.flatnonzero(mask)

    def __len__(self):
        return self.n if self.index is None else len(self.index)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        i = i if self.index is None else int(self.index[i])
        row = {}
        for c, data in self.data.items():
            begin, end = (self.ends[c][i - 1] if i else 0), self.ends[c][i]
            if end > begin:
                value = bytes(data[begin + 1:end])
                row[c] = value.decode("utf-8", "surrogateescape") if data[begin] == ord("s") else json.loads(value)
        return row
