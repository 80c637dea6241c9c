"""Pickles from data folders read without running code (issue 69.1): CIFAR's batches and meta (eval.py's cifar10 /
cifar100, MTIL's CIFAR100) and MulT's MOSEI features (papers/mosei.py). A pickle names the functions that rebuild
its objects, and pickle.load calls them: a file in a data folder could run anything. ArraysOnly builds builtin
containers, numbers, strings and bytes (pickle's own opcodes, no function) and numpy arrays (the few numpy
functions that rebuild one, checked); any other name stops the read with one message naming the file. Standard
library and numpy only."""
from __future__ import annotations

import math
import pickle
from pathlib import Path

import numpy as np

from plumbing.base import DataError


class ArraysOnly(pickle.Unpickler):
    """Admits only what numpy arrays need, under every protocol: _reconstruct + ndarray + dtype (+ scalar),
    protocol 5's _frombuffer, _codecs.encode(str, 'latin1') and bytes() (protocols <= 2's bytes); anything else
    stops. Each array's declared shape and dtype are checked against the bytes it holds and the file's budget
    before numpy builds it (numpy trusts them: an object array declaring more items than it holds crashes the
    interpreter). HOLDS ends the message; budget() may be replaced by a reader with its own limits."""
    HOLDS = "the file holds lists, dicts, strings, numbers and numpy arrays only"
    RATIO, SLACK = 2, 64 << 20  # declared array bytes per byte of file (+ SLACK): arrays hold their bytes
    SAFE = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
            ("numpy._core.multiarray", "scalar"), ("_codecs", "encode"),
            ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
            ("__builtin__", "bytes"), ("builtins", "bytes")}

    def __init__(self, f, path: Path, **kw):
        super().__init__(f, **kw)
        self.path, self.declared = Path(path), 0
        reader = self

        class Checked(np.ndarray):
            def __setstate__(self, state):
                reader.check_state(state)
                return np.ndarray.__setstate__(self, state)
        self.checked = Checked

    def refuse(self, why: str):
        raise DataError(f"{self.path}: {why}: refused (a pickle can run code when loaded; {self.HOLDS})")

    def budget(self, declared: int):
        """Refuses `declared` bytes of arrays (before they are allocated) beyond RATIO x the file's size + SLACK:
        one buffer referenced many times declares far more than the file holds."""
        size = self.path.stat().st_size
        if declared > self.RATIO * size + self.SLACK:
            self.refuse(f"its arrays declare {declared / 2**30:.2f} GiB from a file of {size / 2**20:.1f} MiB")

    def declare(self, shape, dtype, held: int | None):
        if not (isinstance(shape, tuple) and all(type(s) is int and s >= 0 for s in shape)
                and isinstance(dtype, np.dtype)):
            self.refuse(f"an array with shape {shape!r} and dtype {dtype!r}")
        count = math.prod(shape)
        need = count * (8 if dtype.hasobject else dtype.itemsize)
        if held is not None and held != need:
            self.refuse(f"an array declaring {shape} {dtype} ({need} bytes) holds {held} bytes")
        self.declared += need
        self.budget(self.declared)
        return count

    def check_state(self, state):
        if not (isinstance(state, tuple) and len(state) in (4, 5)):
            self.refuse(f"an array state {type(state).__name__} of length {len(state)}"
                        if isinstance(state, tuple) else f"an array state of type {type(state).__name__}")
        shape, dtype, _, raw = state[-4:]
        if isinstance(dtype, np.dtype) and dtype.hasobject:
            if not isinstance(raw, list) or dtype != np.dtype(object):
                self.refuse(f"an object array of {dtype} whose items are {type(raw).__name__}")
            if self.declare(shape, dtype, None) != len(raw):
                self.refuse(f"an object array declaring {shape} holds {len(raw)} items")
        elif isinstance(raw, (bytes, str)):  # str: a Python 2 pickle's bytes, read as latin1
            self.declare(shape, dtype, len(raw))
        else:
            self.refuse(f"an array whose data is {type(raw).__name__}")

    def find_class(self, module, name):
        if (module, name) not in self.SAFE:
            self.refuse(f"the pickle asks for {module}.{name}, which is not a numpy array")
        if name == "bytes":
            return self.empty_bytes
        if name == "encode":
            return self.latin1
        real = super().find_class(module, name)
        if name == "_reconstruct":
            def reconstruct(subtype, shape, tag):
                if subtype is not np.ndarray:
                    self.refuse(f"_reconstruct of {subtype!r}, not numpy.ndarray")
                return real(self.checked, shape, tag)
            return reconstruct
        if name == "_frombuffer":
            def frombuffer(buf, dtype, shape, order):
                if not isinstance(buf, (bytes, bytearray, pickle.PickleBuffer)) or order not in ("C", "F"):
                    self.refuse(f"_frombuffer of {type(buf).__name__} (order {order!r})")
                self.declare(shape, dtype, memoryview(buf).nbytes)
                return real(buf, dtype, shape, order)
            return frombuffer
        return real

    def persistent_load(self, pid):
        self.refuse("a persistent id (an object stored outside the file)")

    def empty_bytes(self, *args):  # protocols <= 2 pickle b'' (an empty array's data) as bytes()
        if args:
            self.refuse(f"bytes{args!r} (only bytes() of an empty array is numpy's)")
        return b""

    def latin1(self, obj, encoding="utf-8", errors="strict"):  # protocols <= 2's bytes
        if not isinstance(obj, str) or encoding not in ("latin1", "latin-1") or errors != "strict":
            self.refuse(f"_codecs.encode({type(obj).__name__}, {encoding!r}), not numpy's bytes")
        return obj.encode("latin1")


def plain(x):
    """An array rebuilt by ArraysOnly as a plain numpy.ndarray (it is built as a checked subclass); anything else
    as it is."""
    return x.view(np.ndarray) if isinstance(x, np.ndarray) else x


def load(path, reader=ArraysOnly):
    """What the pickle at `path` holds, read by `reader` (latin1: Python 2's pickles, as CIFAR's are); a refused,
    truncated or unreadable file is one DataError naming it."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return reader(f, path, encoding="latin1").load()
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001  truncated, or not a pickle
        raise DataError(f"{path}: not a readable pickle ({type(e).__name__}: {e})") from None


def cifar(batch_path, meta_path, n_classes: int) -> tuple[np.ndarray, list[int], list[str]]:
    """(images (N, 3072) uint8, channel-major; labels; class names) of one batch of torchvision's CIFAR folder
    (cifar-10-batches-py: 'data', 'labels', batches.meta's 'label_names'; cifar-100-python: 'fine_labels',
    meta's 'fine_label_names'), both files read by ArraysOnly and checked: one message naming the file."""
    labels_key, names_key = ("labels", "label_names") if n_classes == 10 else ("fine_labels", "fine_label_names")
    meta, batch = load(meta_path), load(batch_path)
    names = meta.get(names_key) if isinstance(meta, dict) else None
    if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
        raise DataError(f"{meta_path}: no list of class names under {names_key!r}; torchvision's CIFAR-"
                        f"{n_classes} meta file holds one")
    data = plain(batch.get("data")) if isinstance(batch, dict) else None
    labels = plain(batch.get(labels_key)) if isinstance(batch, dict) else None
    if not (isinstance(data, np.ndarray) and data.ndim == 2 and data.shape[1] == 3072 and data.dtype.kind in "ui"):
        raise DataError(f"{batch_path}: no 'data' array of (N, 3072) integers (32x32 RGB images, channel-major); "
                        f"found {getattr(data, 'shape', type(data).__name__)}")
    labels = labels.tolist() if isinstance(labels, np.ndarray) else labels
    if not (isinstance(labels, list) and len(labels) == len(data)
            and all(type(k) is int and 0 <= k < len(names) for k in labels)):
        raise DataError(f"{batch_path}: {labels_key!r} is not {len(data)} class indices below {len(names)} "
                        f"(one per image, {meta_path.name} names {len(names)} classes)")
    return np.asarray(data, np.uint8), labels, names
