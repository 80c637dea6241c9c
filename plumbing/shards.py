"""webdataset shards: training on them (each process reads its own shards; a resumed run continues exactly where
it stopped, by shard and offset); commands/write_shards.py writes them from a manifest.

    python -m commands.write_shards MANIFEST OUT_DIR [--per-shard 1000]   # OUT_DIR/00000.tar, ..., sizes.json
    python erclip.py --train-data 'OUT_DIR/{00000..00011}.tar' ...

A shard holds, per sample, `<key>.jpg` (or .png / .webp: the image file's bytes as they are), `<key>.txt` (the
caption) and `<key>.json` ({"caption", "long_caption", any other column}), as open_clip's and FLAIR's shards do;
sizes.json ({shard file name: samples}) is open_clip's: trusted to start (it saves reading every header), checked
against the members whenever a shard is read to its end or a resume skips it whole (a wrong size is one message
naming it: the run stops, since the batches after a resume would shift); without it the samples are counted from
the tar headers by webdataset's key rule (count_samples: `./000001.jpg` is key `./000001`).
Reading (common.train through common.training_set):
  - an epoch is --train-num-samples samples (open_clip's meaning; 0: every sample of the shards once), i.e.
    steps_per_epoch = num_samples // batch size steps on every process;
  - epoch e orders the shards by a permutation seeded by (seed, e); process r of R takes shards r, r + R, ...;
    its DataLoader worker w of W takes every W-th of those, and yields the process's batches w, w + W, ... (the
    DataLoader returns them in that order). A worker whose shards run out before the epoch ends reads them again;
  - within a shard, samples pass through a shuffle buffer (SHUFFLE samples, seeded by (seed, e, shard, pass))
    that empties at the shard's end, so a shard's order depends on nothing read before it. Resuming at step s
    therefore skips whole shards by their sizes and, in the current shard, the samples already used (read, not
    decoded): the batches after a resume are the ones the uninterrupted run would have drawn (tested). open_clip
    resumes shards statistically (a fresh shuffle of the remaining epoch); this is exact;
  - the augmentation of a sample is seeded by (seed, e, shard, position), as common.SeededSamples seeds a row's;
  - there is no row check before training (a stream cannot be checked without reading it all): a sample whose
    image does not decode or that lacks its caption is replaced by the next one and counted in results.json
    (summary.undecodable_images), as with --check-images none; a whole pass over a reader's shards without a
    usable sample stops the run with one message (counts and reasons). Every shard is checked at the start for
    what makes it unreadable (tar_problem: empty, not a tar, truncated).
"""
from __future__ import annotations

import collections
import hashlib
import io
import json
import random
import re
import sys
import tarfile
import zlib
from pathlib import Path

import torch
from PIL import Image

from plumbing.base import DataError, UsageError, warn_once
from plumbing.loading import seeded, to_rgb
from plumbing.manifests import MAX_LISTED

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
SHUFFLE = 1000  # samples in a shard's shuffle buffer (their encoded bytes: ~100 MB of JPEGs per worker)


def is_shards(path) -> bool:  # a --train-data naming tar shards: 'DIR/{00000..00099}.tar', or one .tar file
    return str(path).endswith(".tar")


def expand(pattern) -> list[Path]:
    """The shards of a brace pattern, each one checked to exist (one message naming the missing ones)."""
    from braceexpand import braceexpand
    paths = [Path(p) for p in braceexpand(str(pattern))]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise DataError(f"{pattern}: {len(missing)} of {len(paths)} shard(s) not found, e.g. {missing[0]}")
    return paths


def shard_sizes(paths: list[Path], sources: list | None = None) -> list[int]:
    """Samples per shard: from sizes.json beside them (open_clip's file) when it names every shard, else counted
    from the tar headers (keys, no member read). sources, when given, gets each size's sizes.json (or None)."""
    known = {}
    for folder in {p.parent for p in paths}:
        f = folder / "sizes.json"
        if f.is_file():
            known.update({str(folder / k): (v, f) for k, v in read_sizes(f).items()})
    if all(str(p) in known for p in paths):
        if sources is not None:
            sources[:] = [known[str(p)][1] for p in paths]
        return [known[str(p)][0] for p in paths]
    if sources is not None:
        sources[:] = [None] * len(paths)
    print(f"[data] counting the samples of {len(paths)} shard(s) (no sizes.json beside them)", file=sys.stderr)
    return [count_samples(p) for p in paths]


def read_sizes(f: Path) -> dict[str, int]:
    """sizes.json's {shard file name: samples} (a count may be a string of digits, as open_clip's int() reads it);
    anything else is one message naming the file."""
    fix = ("it should map each shard's file name to its number of samples, e.g. {\"00000.tar\": 1000} (or delete it: "
           "the samples are then counted from the tar members)")
    try:
        sizes = json.loads(f.read_bytes())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise DataError(f"{f}: not JSON ({e}); {fix}") from None
    if not isinstance(sizes, dict):
        raise DataError(f"{f}: a JSON {type(sizes).__name__}, not an object; {fix}")
    bad = [k for k, v in sizes.items() if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                               or isinstance(v, str) and v.isdecimal())]
    if bad:
        raise DataError(f"{f}: {len(bad)} size(s) are not a count of samples, e.g. {bad[0]!r}: "
                        f"{sizes[bad[0]]!r}; {fix}")
    return {k: int(v) for k, v in sizes.items()}


def tar_problem(path: Path) -> str | None:
    """What makes a shard unreadable, from its first and last 512 bytes: empty, not a tar, or truncated (a copy cut
    short: every tar writer ends the archive with zero blocks, and a cut mid-member or at a member's end would
    otherwise read as a shorter shard, its last sample lacking members). None for a sound or a compressed tar (the
    latter's errors are named as it is read)."""
    size = path.stat().st_size
    if not size:
        return "an empty file (0 bytes), not a tar file"
    with open(path, "rb") as f:
        head = f.read(512)
        if head.startswith((b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00")):  # gzip, bzip2, xz
            return None
        if any(head):  # all zeros: an empty archive
            try:
                tarfile.TarInfo.frombuf(head.ljust(512, b"\0"), "utf-8", "surrogateescape")
            except tarfile.HeaderError:
                return "not a tar file (its first 512 bytes are no tar header)"
        f.seek(max(size - 512, 0))
        tail = f.read()
    if size % 512 or any(tail):
        return "truncated (no closing zero blocks: it ends within or right after a member; a copy cut short?)"
    return None


def check_shards(pattern, paths: list[Path]):
    """One message for every shard tar_problem finds fault with."""
    bad = [(p, why) for p in paths for why in [tar_problem(p)] if why]
    if bad:
        listed = "; ".join(f"{p}: {why}" for p, why in bad[:MAX_LISTED])
        raise DataError(f"{pattern}: {len(bad)} of {len(paths)} shard(s) cannot be read: {listed}"
                        + (f"; and {len(bad) - MAX_LISTED} more" if len(bad) > MAX_LISTED else ""))


KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's tariterators.base_plus_ext: (key, extension)
META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta (and its __...__ names at the top)


def count_samples(path: Path) -> int:
    """The samples webdataset's reader makes of a shard, from its tar headers (no member read): its regular
    members, meta ones (__...__) left out, grouped into runs of one key, the key being the member's folder and
    its basename up to the first dot (`./000001.jpg`: `./000001`; `a.b.jpg`: `a`, extension `b.jpg`)."""
    n, last = 0, None
    try:
        with tarfile.open(path) as tar:
            for m in tar:
                key = KEY.match(m.name)
                if not m.isreg() or key is None or META.match(m.name):
                    continue
                if key.group(1) != last:
                    n, last = n + 1, key.group(1)
    except (tarfile.TarError, EOFError, zlib.error) as e:
        raise DataError(unreadable(path, e)) from None
    return n


def unreadable(path: Path, e: Exception) -> str:
    why = str(e.args[0]) if e.args else type(e).__name__  # webdataset appends its stream and url to the args
    cut = "unexpected end" in why or isinstance(e, EOFError)
    return f"{path}: {'truncated' if cut else 'unreadable'} ({type(e).__name__}: {why})"


def read_shard(path: Path):
    """samples_of(path), a read error being one message naming the shard (a shard cut short: truncated)."""
    try:
        yield from samples_of(path)
    except (tarfile.TarError, ValueError, OSError, EOFError, zlib.error) as e:  # ValueError: a duplicate member
        raise DataError(unreadable(path, e)) from None


def samples_of(path: Path):
    """A shard's samples in file order: {"__key__", "jpg" | "png" | ..., "txt", "json"} (bytes), through webdataset's
    tar reader (no splitting by node or worker: ShardStream splits)."""
    import webdataset as wds
    return iter(wds.WebDataset(str(path), shardshuffle=False, nodesplitter=None, workersplitter=None,
                               empty_check=False))


def shuffled(samples, rng: random.Random, size: int = SHUFFLE):
    """A shuffle buffer that empties at the end of its input: the output order is a function of the input and rng."""
    buf = []
    for s in samples:
        buf.append(s)
        if len(buf) >= size:
            i = rng.randrange(len(buf))
            buf[i], buf[-1] = buf[-1], buf[i]
            yield buf.pop()
    rng.shuffle(buf)
    yield from buf


class ShardSet:
    """common.train's training set when --train-data names shards: len() is the epoch's samples; loader() the
    process's DataLoader of collated batches (ShardStream)."""

    def __init__(self, pattern, transform=None, need_long: bool = False, num_samples: int = 0, readers: int = 1):
        """readers: processes x DataLoader workers (each one reads whole shards, so at least that many)."""
        self.pattern, self.transform, self.need_long = str(pattern), transform, need_long
        self.shards = expand(pattern)
        if len(self.shards) < readers:
            raise UsageError(f"{pattern}: {len(self.shards)} shard(s) for {readers} readers (processes x "
                                    f"DataLoader workers), each of which reads whole shards: use fewer --workers or "
                                    f"more, smaller shards (python -m commands.write_shards --per-shard)")
        check_shards(pattern, self.shards)
        sources = []
        self.sizes = shard_sizes(self.shards, sources)
        self.sizes_file = sources  # per shard, the sizes.json its size comes from (None: counted)
        self.num_samples = num_samples or sum(self.sizes)
        self.skipped = []  # no row check: see the module's docstring
        if not sum(self.sizes):
            raise DataError(f"{pattern}: the shards hold no samples")
        warn_once(f"[data] {len(self.shards)} shard(s), {sum(self.sizes)} samples, {self.num_samples} an "
                          f"epoch; no row check before training (a sample that fails is replaced and counted)")

    def __len__(self):
        return self.num_samples

    def size_mismatch(self, s: int, found: int) -> str:
        """The message for shard s holding `found` samples, not the self.sizes[s] the run counts with."""
        path, n = self.shards[s], self.sizes[s]
        if self.sizes_file[s] is None:
            return f"{path}: {found} samples read, {n} counted when the run started (was it changed since?)"
        return (f"{self.sizes_file[s]} says {path.name} holds {n} samples, its tar members hold {found}: correct it "
                f"(or delete it: the samples are then counted from the tar members) and start again; the run "
                f"cannot continue, since a resume skips whole shards by these sizes (a wrong one would shift "
                f"every batch after it)")

    def fingerprint(self) -> dict:
        """What common.data_fingerprint stores for a resume check: the epoch's samples, a sha256 of the shards'
        names, byte sizes and sample counts (a resume on other shards is refused), and one of their modification
        times ("modified": a shard edited in place keeps its size, since tar pads to 10,240-byte records, but not
        its mtime). Not a hash of the members: that reads every header of every shard at each start (hours for
        LAION-sized sets); a copy that does not keep the mtimes (cp without -p) is then refused too, with a
        message that says so."""
        stats = [p.stat() for p in self.shards]
        h = hashlib.sha256(json.dumps([(str(p), st.st_size, n)
                                       for p, st, n in zip(self.shards, stats, self.sizes)]).encode())
        modified = hashlib.sha256(json.dumps([st.st_mtime_ns for st in stats]).encode())
        return {"rows": self.num_samples, "manifest": self.pattern, "sha256": h.hexdigest(),
                "modified": modified.hexdigest()}

    def loader(self, batch: int, collate, seed: int, rank: int, world: int, workers: int, steps_per_epoch: int,
               pin_memory: bool = False):
        return _Loader(ShardStream(self, batch, collate, seed, rank, world, steps_per_epoch),
                       batch_size=None, num_workers=workers, pin_memory=pin_memory)


class ShardStream(torch.utils.data.IterableDataset):
    """One process's batches of an epoch, from `set_epoch(epoch, start)`'s batch on (see the module docstring)."""

    def __init__(self, data: ShardSet, batch: int, collate, seed: int, rank: int, world: int, steps_per_epoch: int):
        self.data, self.batch, self.collate, self.seed = data, batch, collate, seed
        self.rank, self.world, self.steps_per_epoch = rank, world, steps_per_epoch
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0):  # as common.ResumableSampler's
        self.epoch, self.start = epoch, start

    def my_shards(self, worker: int, workers: int) -> list[int]:
        """This process's and this worker's shards (indices) in epoch self.epoch."""
        order = list(range(len(self.data.shards)))
        random.Random(f"{self.seed}:{self.epoch}").shuffle(order)
        return order[self.rank::self.world][worker::workers]

    def samples(self, shards: list[int], skip: int):
        """(shard, position, pass, raw sample) of the worker's shards, over and over, the first `skip` passed over
        (whole shards by their sizes, then within the shard: read, not decoded)."""
        if not sum(self.data.sizes[s] for s in shards):  # one worker's share of empty shards: no batch to make
            raise DataError(f"{self.data.pattern}: shards {shards}, one worker's share, hold no samples")
        cycle = 0
        while True:
            for s in shards:
                n = self.data.sizes[s]
                if skip >= n:  # a resume: a size from sizes.json is checked against the members (headers only)
                    found = count_samples(self.data.shards[s]) if self.data.sizes_file[s] else n
                    if found != n:
                        raise DataError(self.data.size_mismatch(s, found))
                    skip -= n
                    continue
                rng = random.Random(f"{self.seed}:{self.epoch}:{s}:{cycle}")
                read = 0
                for pos, sample in enumerate(shuffled(read_shard(self.data.shards[s]), rng)):
                    read += 1
                    if pos >= skip:
                        yield s, pos, cycle, sample
                if read != n:  # before any sample of the next shard: a resume skips whole shards by these sizes
                    raise DataError(self.data.size_mismatch(s, read))
                skip = 0
            cycle += 1

    def item(self, s: int, pos: int, cycle: int, sample: dict) -> dict:
        """A decoded, transformed sample: {"image", "caption" (, "long_caption")}; raises BadSample naming it."""
        where = f"{self.data.shards[s]}:{sample.get('__key__')}"
        try:
            meta, txt = json.loads(member(sample, ("json",)) or "{}"), member(sample, ("txt",))
            caption = txt.decode("utf-8") if txt is not None else meta.get("caption")
        except ValueError as e:  # bad JSON, or not UTF-8
            raise BadSample(where, "unreadable .txt / .json member", f"{type(e).__name__}: {e}") from None
        if not isinstance(caption, str) or not caption.strip():
            raise BadSample(where, "no caption", "a .txt member or the .json's 'caption'")
        item = {"caption": caption}
        if self.data.need_long:
            if not isinstance(meta.get("long_caption"), str) or not meta["long_caption"].strip():
                raise BadSample(where, "no long_caption", "in its .json")
            item["long_caption"] = meta["long_caption"]
        image = member(sample, IMAGE_EXTS)
        if image is None:
            raise BadSample(where, "no image member", ", ".join(IMAGE_EXTS))
        try:
            with Image.open(io.BytesIO(image)) as im:
                image = to_rgb(im)
        except Exception as e:  # PIL raises many types
            raise BadSample(where, f"undecodable image ({type(e).__name__})", str(e)) from None
        key = f"{self.seed}:{self.epoch}:{s}:{cycle}:{pos}"
        transform = self.data.transform or (lambda im: im)
        item["image"] = seeded(int(hashlib.sha256(key.encode()).hexdigest()[:15], 16), transform, image)
        return item

    def __iter__(self):
        try:
            yield from self.batches()
        except DataError as e:  # one message from the main process, not a worker's traceback (ShardSet.loader)
            yield {"_data_error": str(e)}

    def batches(self):
        info = torch.utils.data.get_worker_info()
        w, workers = (info.id, info.num_workers) if info else (0, 1)
        mine = range(w, self.steps_per_epoch, workers)  # the process's batches this worker makes
        done = sum(1 for j in mine if j < self.start)
        shards = self.my_shards(w, workers)
        stream = self.samples(shards, done * self.batch)
        tried, reasons, example = 0, collections.Counter(), None  # counts only: no failure is kept
        cycle, usable, first_full = None, 0, None
        for _ in range(len(mine) - done):
            items, failed = [], []
            while len(items) < self.batch:
                s, pos, c, sample = next(stream)
                if first_full is None:  # a resume's first pass is partial
                    cycle, first_full = c, c + (1 if done else 0)
                if c != cycle:  # a pass over every shard of the worker's with no usable sample: none will come
                    if cycle >= first_full and not usable:
                        raise DataError(no_usable_sample(self.data, shards, tried, reasons, example))
                    cycle, usable = c, 0
                tried += 1
                try:
                    items.append(self.item(s, pos, c, sample))
                    usable += 1
                except BadSample as e:  # replaced by the next sample, counted (common.CountFailures)
                    reasons[e.reason] += 1
                    example = example or str(e)
                    failed.append(str(e) if len(failed) < MAX_LISTED else e.reason)  # the count is what matters
            if failed:
                items[0]["_failed"] = failed
            yield self.collate(items)


def member(sample: dict, exts) -> bytes | None:
    """A sample's member of one of these extensions: `jpg`, else one whose extension ends so (`b.jpg`: a key
    with several dots, `a.b.jpg`, is `a` for webdataset)."""
    found = next((sample[e] for e in exts if e in sample), None)
    if found is None:
        found = next((v for k, v in sample.items() if not k.startswith("__") and k.rsplit(".", 1)[-1] in exts), None)
    return found


class BadSample(ValueError):
    """A sample the stream replaces by the next one: where (shard:key), reason (what message groups), detail."""

    def __init__(self, where: str, reason: str, detail: str = ""):
        super().__init__(f"{where}: {reason}" + (f" ({detail})" if detail else ""))
        self.reason = reason


def no_usable_sample(data: ShardSet, shards: list[int], tried: int, reasons, example) -> str:
    names = [data.shards[s].name for s in shards]
    why = "; ".join(f"{n} {r}" for r, n in reasons.most_common())
    return (f"{data.pattern}: no usable sample in one whole pass over shard(s) {', '.join(names[:5])}"
            f"{f' and {len(names) - 5} more' if len(names) > 5 else ''} (one reader's share, "
            f"{sum(data.sizes[s] for s in shards)} samples): {tried} tried, {sum(reasons.values())} failed: {why}; "
            f"e.g. {example}. Training would never make a step: check the shards (python -m commands.write_shards "
            f"writes a .txt caption and the image as .jpg / .png / .webp for every row)")


class _Loader(torch.utils.data.DataLoader):
    """ShardStream's DataLoader: a data error found in a worker is raised here, in the main process, as the
    stream's one message (a worker's exception would come wrapped in its traceback)."""

    def __iter__(self):
        for batch in super().__iter__():
            if isinstance(batch, dict) and "_data_error" in batch:
                raise DataError(batch["_data_error"])
            yield batch
