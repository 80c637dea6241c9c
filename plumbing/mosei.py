"""CMU-MOSEI's aligned features as GMC reads them (gmc.py, m2-Mix Sec. 5.5): MulT's pickle read
without running code (numpy arrays only), its .npz copy (--convert), and the splits checked before
training, non-finite values set to 0 and counted. The layout: docs/gmc.md, 'The data as
distributed'."""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

import common

MODALITIES = ("text", "audio", "vision")  # GMC's order (0, 1, 2)


class NumpyOnly(pickle.Unpickler):
    """Admits the globals numpy arrays need (and _codecs.encode, Python 2 pickles' bytes);
    anything else stops."""
    SAFE = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
            ("numpy._core.multiarray", "scalar"), ("_codecs", "encode")}

    def find_class(self, module, name):
        if (module, name) not in self.SAFE:
            raise common.DataError(f"the pickle asks for {module}.{name}, which is not a numpy "
                                   f"array: refused (a pickle can run code when loaded; the MOSEI "
                                   f"file holds numpy arrays only)")
        return super().find_class(module, name)


def read_arrays(path) -> dict:
    """{split: {key: ndarray}} from the pickle (restricted) or its .npz ('split/key' entries)."""
    path = Path(path)
    if not path.is_file():
        raise common.UsageError(f"--data {path}: no such file. The aligned CMU-MOSEI pickle is "
                                f"MulT's processed mosei_senti_data.pkl "
                                f"(github.com/yaohungt/Multimodal-Transformer; GMC's code calls "
                                f"it mosei_data.pkl): docs/gmc.md, 'The data as distributed'")
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            out = {}
            for k in z.files:
                split, _, key = k.partition("/")
                out.setdefault(split, {})[key] = z[k]
            return out
    with open(path, "rb") as f:
        try:
            return NumpyOnly(f, encoding="latin1").load()
        except common.DataError:
            raise
        except Exception as e:  # noqa: BLE001  truncated or not a pickle
            raise common.DataError(f"{path}: not a readable pickle ({type(e).__name__}: "
                                   f"{e})") from None


def convert(path) -> Path:
    """The pickle's arrays as a .npz beside it (no pickle inside: np.load(allow_pickle=False)
    reads it)."""
    arrays = read_arrays(path)
    flat = {f"{s}/{k}": (v.astype(str) if v.dtype == object else v)
            for s, d in arrays.items() for k, v in d.items()}
    out = Path(path).with_suffix(".npz")
    common.atomic_write(out, lambda tmp: np.savez(open(tmp, "wb"), **flat))
    return out


def load_splits(path, nonfinite: str = "zero") -> tuple[dict, dict]:
    """({split: {'text'|'audio'|'vision': float32 (N, T, d), 'label': (N,)}}, {what: non-finite
    count}), shapes checked first: one message names the split and the key that is wrong."""
    arrays, out, fixed = read_arrays(path), {}, {}
    for split in ("train", "valid", "test"):
        if split not in arrays or not isinstance(arrays[split], dict):
            raise common.DataError(f"{path}: no '{split}' split (found {sorted(arrays)[:5]}); "
                                   f"GMC's layout: {{'train'|'valid'|'test': {{'text', 'audio', "
                                   f"'vision', 'labels'}}}}")
        d, n = arrays[split], None
        for key in (*MODALITIES, "labels"):
            a = d.get(key)
            if not isinstance(a, np.ndarray) or (a.ndim != 3 if key != "labels"
                                                 else a.size != len(a)):
                raise common.DataError(f"{path}: {split}/{key} is {getattr(a, 'shape', a)!r}; "
                                       f"want (N, steps, dim) for features, N values for labels")
            if n is not None and len(a) != n:
                raise common.DataError(f"{path}: {split}/{key} has {len(a)} rows, {split}/text {n}")
            n = len(a)
        steps = {d[k].shape[1] for k in MODALITIES}
        if len(steps) > 1:
            raise common.DataError(f"{path}: {split}'s modalities have {sorted(steps)} steps; GMC "
                                   f"reads aligned ones")
        out[split] = {}
        for key in (*MODALITIES, "labels"):
            a = d[key].astype(np.float32)
            bad = ~np.isfinite(a)
            if bad.any():
                if nonfinite == "refuse":
                    raise common.DataError(f"{path}: {split}/{key} has {int(bad.sum())} non-finite "
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
