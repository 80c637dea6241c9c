"""CMU-MOSEI's aligned features as GMC reads them (gmc.py, m2-Mix Sec. 5.5): MulT's pickle read
without running code (numpy arrays only, any pickle protocol), its .npz copy (--convert), and the
splits checked before training, non-finite features set to 0 and counted (labels: refused). Memory
is checked before it is asked for: what the arrays declare against the file's size (a pickle's
arrays hold their bytes, an .npz entry its header's size) and the machine's memory. The layout:
docs/gmc.md, 'The data as distributed'."""
from __future__ import annotations

if __name__ == "__main__":  # issue 55.3: it ran nothing and exited 0 on any flag, after 6 s of imports
    raise SystemExit("papers/mosei.py is gmc.py's MOSEI reader, not a command: python gmc.py --data "
                     "data/mosei/mosei_data.pkl [--convert]")

import math
import os
import zipfile
import zlib
from pathlib import Path

import numpy as np
import torch

from plumbing.base import DataError, UsageError, atomic_write, markdown_table
from plumbing import published, safepickle

MODALITIES = ("text", "audio", "vision")  # GMC's order (0, 1, 2)
SLACK = 64 << 20  # bytes any file may declare beyond its ratio (small files, headers, copies)
PICKLE_RATIO, NPZ_RATIO, STR_RATIO = 2, 64, 4  # declared bytes per byte of file: arrays hold their
# bytes in a pickle; deflate packs real features a few times, a bomb ~1000x; str arrays are UCS-4


def _ram() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _budget(path: Path, need: int, ratio: int, what: str) -> None:
    """Refuses `need` bytes (before they are allocated) above ratio x the file's size + SLACK or
    the machine's memory."""
    size, ram = path.stat().st_size, _ram()
    hint = ("; an .npz saved compressed: np.savez it uncompressed, as --convert writes"
            if ratio == NPZ_RATIO else "")
    if need > ratio * size + SLACK or (ram is not None and need > ram):
        raise DataError(
            f"{path}: {what} would take {need / 2**30:.2f} GiB of memory from a file of "
            f"{size / 2**20:.1f} MiB (at most {ratio}x its size + {SLACK >> 20} MiB"
            f"{f', and the machine has {ram / 2**30:.0f} GiB' if ram else ''}): refused before "
            f"allocating (a crafted or corrupted file{hint})")


class NumpyOnly(safepickle.ArraysOnly):
    """plumbing.safepickle's reader (numpy arrays and builtin containers only), with MOSEI's memory budget:
    the arrays' declared bytes against PICKLE_RATIO x the file's size and the machine's memory."""
    HOLDS = "the MOSEI file holds numpy arrays only"

    def budget(self, declared: int):
        _budget(self.path, declared, PICKLE_RATIO, "the pickle's arrays")


LAYOUT = "GMC's layout: {'train'|'valid'|'test': {'text', 'audio', 'vision', 'labels'}}"


def _kind(x) -> str:
    return "ndarray" if isinstance(x, np.ndarray) else type(x).__name__


def _plain(tree, path: Path) -> dict:
    """{split: {key: ndarray}} from what the pickle held, or one message naming what is not."""
    if not isinstance(tree, dict):
        raise DataError(f"{path}: the file holds {_kind(tree)}, not a dict of "
                               f"splits; {LAYOUT}")
    out = {}
    for split, d in tree.items():
        if not isinstance(split, str) or not isinstance(d, dict):
            raise DataError(f"{path}: split {split!r} is {_kind(d)}, not a dict "
                                   f"of arrays; {LAYOUT}")
        out[split] = {}
        for key, a in d.items():
            if not isinstance(key, str) or not isinstance(a, np.ndarray):
                raise DataError(f"{path}: {split}/{key!r} is {_kind(a)}, not a "
                                       f"numpy array; {LAYOUT}")
            out[split][key] = a.view(np.ndarray)
    return out


def _read_npz(path: Path) -> dict:
    """The .npz's 'split/key' entries; every entry's header (shape, dtype) checked against its
    stored size, pickled entries refused and the total against the budget, before any is read."""
    fmt = np.lib.format
    try:
        with zipfile.ZipFile(path) as z:
            infos, total = z.infolist(), 0
            for info in infos:
                if not info.filename.endswith(".npy"):
                    raise DataError(f"{path}: entry {info.filename!r} is not a .npy array")
                with z.open(info) as f:
                    version = fmt.read_magic(f)
                    shape, _, dtype = (fmt.read_array_header_1_0(f) if version == (1, 0)
                                       else fmt.read_array_header_2_0(f))
                    head = f.tell()
                if dtype.hasobject:
                    raise DataError(f"{path}: entry {info.filename!r} holds pickled "
                                           f"objects ({dtype}): refused (np.load(allow_pickle="
                                           f"False) reads plain arrays only)")
                need = math.prod(shape) * dtype.itemsize
                if info.file_size != head + need:
                    raise DataError(f"{path}: entry {info.filename!r} declares {shape} "
                                           f"{dtype} ({need} bytes) but holds "
                                           f"{info.file_size - head} bytes: truncated or crafted")
                total += need
                _budget(path, total, NPZ_RATIO, "the .npz's arrays")
            out = {}
            for info in infos:
                with z.open(info) as f:
                    split, _, key = info.filename[:-4].partition("/")
                    out.setdefault(split, {})[key] = fmt.read_array(f, allow_pickle=False)
            return out
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError, OSError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"{path}: not a readable .npz: truncated or corrupted "
                               f"({type(e).__name__}: {e})") from None


def read_arrays(path) -> dict:
    """{split: {key: ndarray}} from the pickle (restricted) or its .npz ('split/key' entries)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--data {path}: no such file. The aligned CMU-MOSEI pickle is "
                                f"MulT's processed mosei_senti_data.pkl "
                                f"(github.com/yaohungt/Multimodal-Transformer; GMC's code calls "
                                f"it mosei_data.pkl): docs/gmc.md, 'The data as distributed'")
    if path.suffix == ".npz":
        return _read_npz(path)
    return _plain(safepickle.load(path, NumpyOnly), path)


def _items(a: np.ndarray, where: str, path: Path, spent: int = 0) -> np.ndarray:
    """An object array's items as a plain array: numbers (None: NaN) as float64, strings as str,
    bytes as bytes (their size with `spent` bytes already held checked first); anything else
    (dicts, arrays, mixed kinds, ints beyond float64) one message."""
    items = a.ravel().tolist()
    kinds = {"number" if x is None or isinstance(x, (int, float, np.number, np.bool_))
             else _kind(x) for x in items}
    if len(kinds) > 1 or not kinds <= {"number", "str", "bytes"}:
        raise DataError(f"{path}: {where} is an object array of {', '.join(sorted(kinds))}; "
                               f"want numbers (or strings for keys GMC does not read)")
    if kinds in ({"str"}, {"bytes"}):
        longest, width = max(len(x) for x in items), 4 if "str" in kinds else 1  # UCS-4 | bytes
        _budget(path, spent + len(items) * longest * width, STR_RATIO,
                f"{where} as a numpy string array")
        return np.array(items, dtype=("U" if "str" in kinds else "S") + str(max(longest, 1))
                        ).reshape(a.shape)
    try:
        return np.array([np.nan if x is None else x for x in items], np.float64).reshape(a.shape)
    except OverflowError:
        raise DataError(f"{path}: {where} holds an integer beyond float64's range") from None


def convert(path) -> Path:
    """The pickle's arrays as a .npz beside it (no pickle inside: np.load(allow_pickle=False)
    reads it)."""
    path = Path(path)
    arrays = read_arrays(path)
    flat, spent = {}, 0
    for s, d in arrays.items():
        for k, v in d.items():
            flat[f"{s}/{k}"] = _items(v, f"{s}/{k}", path, spent) if v.dtype.hasobject else v
            spent += flat[f"{s}/{k}"].nbytes
    out = path.with_suffix(".npz")
    atomic_write(out, lambda tmp: np.savez(open(tmp, "wb"), **flat))
    return out


def load_splits(path, nonfinite: str = "zero") -> tuple[dict, dict]:
    """({split: {'text'|'audio'|'vision': float32 (N, T, d), 'label': (N,)}}, {what: non-finite
    count}), shapes checked first: one message names the split and the key that is wrong.
    Non-finite features: set to 0 and counted (G6) or refused; non-finite labels: refused."""
    path = Path(path)
    arrays, out, fixed = read_arrays(path), {}, {}
    for split in ("train", "valid", "test"):
        if split not in arrays:
            raise DataError(f"{path}: no '{split}' split (found {sorted(arrays)[:5]}); "
                                   f"{LAYOUT}")
        d, n = arrays[split], None
        for key in (*MODALITIES, "labels"):
            a = d.get(key)
            if not isinstance(a, np.ndarray) or (a.ndim != 3 if key != "labels"
                                                 else a.ndim == 0 or a.size != len(a)):
                raise DataError(f"{path}: {split}/{key} is {getattr(a, 'shape', a)!r}; "
                                       f"want (N, steps, dim) for features, N values for labels")
            if n is not None and len(a) != n:
                raise DataError(f"{path}: {split}/{key} has {len(a)} rows, {split}/text {n}")
            n = len(a)
        steps = {d[k].shape[1] for k in MODALITIES}
        if len(steps) > 1:
            raise DataError(f"{path}: {split}'s modalities have {sorted(steps)} steps; GMC "
                                   f"reads aligned ones")
        out[split] = {}
        for key in (*MODALITIES, "labels"):
            a = d[key]
            if a.dtype.hasobject:
                a = _items(a, f"{split}/{key}", path)
            if a.dtype.kind not in "biuf":
                raise DataError(f"{path}: {split}/{key} holds {a.dtype} values; want "
                                       f"numbers")
            a = a.astype(np.float32)
            bad = ~np.isfinite(a)
            if bad.any():
                if key == "labels":
                    rows = np.flatnonzero(bad.reshape(len(a), -1).any(1)).tolist()
                    raise DataError(f"{path}: {split}/labels has {len(rows)} non-finite "
                                           f"values (NaN, inf or None) in rows {rows[:5]}"
                                           f"{'...' if len(rows) > 5 else ''}: a sentiment label "
                                           f"is not set to 0 (neutral) as features are; fix or "
                                           f"drop those rows")
                if nonfinite == "refuse":
                    raise DataError(f"{path}: {split}/{key} has {int(bad.sum())} non-finite "
                                           f"values ({int(np.isneginf(a).sum())} -inf); "
                                           f"--nonfinite zero sets them to 0")
                fixed[f"{split}/{key}"] = int(bad.sum())
                a[bad] = 0.0
            if key != "labels":
                out[split][key] = torch.from_numpy(a)
            else:
                out[split]["label"] = torch.from_numpy(a.reshape(-1))
    return out, fixed


class Split(torch.utils.data.Dataset):
    def __init__(self, arrays: dict):
        self.arrays = arrays

    def __len__(self):
        return len(self.arrays["label"])

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.arrays.items()}


def table4(rows: dict, subsets) -> str:
    """gmc.py's Table 4 layout: our rows (name -> [per-seed results]: mean +- std) under the paper's
    (published.M2MIX_TABLE4); subsets: gmc.SUBSETS' names, Full first."""
    cols = ["Full acc", "Full unif"] + [f"{s} {m}" for s in list(subsets)[1:]
                                        for m in ("acc", "align", "unif")]
    lines = []
    for name, paper in published.M2MIX_TABLE4.items():
        lines.append({"method": f"{name} (paper)",
                      **{c: "-" if paper.get(c) is None else f"{paper[c]:g}" for c in cols}})
    for name, runs in rows.items():
        cells = {}
        for c in cols:
            v = np.array([r[c] for r in runs])
            cells[c] = f"{v.mean():.2f}" + (f" ± {v.std(ddof=1):.2f}" if len(v) > 1 else "")
        lines.append({"method": f"{name} (ours, {len(runs)} seed{'s' * (len(runs) > 1)})", **cells})
    return markdown_table(lines, ["method", *cols])
