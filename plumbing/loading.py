"""Reading files safely, below common: torch loads that refuse pickled code, model sidecars, other programs'
checkpoint layouts (Long-CLIP's release, m2-Mix's wrapper) converted once, whether open_clip's weights are
cached, write-once manifests' source stamps, file hashes, images decoded to RGB, and a sample's randomness
seeded from one number. It imports torch, open_clip, numpy and PIL, and of the repository plumbing.base only."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import random
import socket
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np
import open_clip
import torch
from PIL import Image

from plumbing.base import DataError, UnsafeFileError, UsageError, atomic_write, shorten, warn_once


def _hub_reachable(timeout=3.0) -> bool:
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _weights_cached(name, tag, cache_dir) -> bool:
    cfg = open_clip.get_pretrained_cfg(name, tag)
    hub = cfg.get("hf_hub", "")
    if hub:
        from huggingface_hub import try_to_load_from_cache
        repo_id = "/".join(hub.strip("/").split("/")[:2])
        for fname in ("open_clip_pytorch_model.bin", "open_clip_model.safetensors"):
            if isinstance(try_to_load_from_cache(repo_id, fname, cache_dir=cache_dir or None), str):
                return True
    url = cfg.get("url", "")
    if url:
        root = Path(cache_dir or Path.home() / ".cache" / "clip")
        return (root / os.path.basename(url)).exists()
    return False


def foreign_checkpoint(path, cache_dir) -> tuple[str, int | None]:
    """(file open_clip loads, text window or None) for a checkpoint in another program's layout, else (path, None).
    m2-Mix's main.py saves {'model_state_dict': ...}; Long-CLIP's release (model_longclip.py) keeps positions < 20
    in positional_embedding, the rest in positional_embedding_res: cat(PE[:20], PE_res[20:]). Extra keys dropped."""
    try:  # a TorchScript archive (OpenAI's own files), safetensors or anything else: open_clip's to read, as before
        sd, what = (None if str(path).endswith(".safetensors") else load_weights_only(path)), []
    except Exception:  # noqa: BLE001
        return str(path), None
    if isinstance(sd, dict) and isinstance(sd.get("model_state_dict"), dict):
        sd, what = sd["model_state_dict"], ["m2-Mix's {'model_state_dict'} wrapper"]
    if not isinstance(sd, dict) or "positional_embedding_res" not in sd and not what:
        return str(path), None
    if "positional_embedding_res" in sd:
        sd = dict(sd)
        sd["positional_embedding"] = torch.cat([sd["positional_embedding"][:20],
                                                sd.pop("positional_embedding_res")[20:]])
        what.append("Long-CLIP's split positional embedding")
    extra = [k for k in sd if k.split(".")[0] in ("text_projection_mix", "shared_projection1", "shared_projection2",
                                                  "prompts_weights", "input_resolution", "context_length",
                                                  "vocab_size")]
    sd = {k: v.float() if v.is_floating_point() else v for k, v in sd.items() if k not in extra}
    out = Path(cache_dir) / "converted" / f"{Path(path).stem}-{os.stat(path).st_size}-{int(os.stat(path).st_mtime)}.pt"
    if not zipfile.is_zipfile(out):  # none yet, or cut short: (re)written whole
        if out.exists():
            print(f"[clipft] {out}: the converted copy is truncated: converting again", file=sys.stderr)
        atomic_write(out, lambda tmp: torch.save(sd, tmp))
    print(f"[clipft] {path}: read as {' and '.join(what)}" + (f"; dropped {extra}" if extra else ""), file=sys.stderr)
    return str(out), sd["positional_embedding"].shape[0]


def read_sidecar(path):
    """The `path.json` save_model wrote beside a model file ({} when there is none); one that is not a JSON object
    is refused with one message naming it."""
    p = Path(str(path) + ".json")
    try:
        meta = json.loads(p.read_text()) if p.exists() else {}
    except (ValueError, UnicodeDecodeError) as e:
        meta, why = None, f"is not readable JSON ({e})"
    else:
        kind = {list: "an array", str: "a string", bool: "true or false", type(None): "null"}.get(type(meta),
                                                                                                 "a number")
        why = f"holds {kind}, not an object of settings"
    if not isinstance(meta, dict):
        raise UsageError(f"{p}, the sidecar of {path} (its backbone, QuickGELU and text window), {why}; restore "
                         f"it, or delete it to read {path} as a plain state_dict")
    return meta


def state_shapes(path, flag: str = "--pretrained") -> dict[str, tuple[int, ...]] | None:
    """{key: shape} of a model file's state_dict, read without its tensors (safetensors' header; torch's zip through
    mmap) and unwrapped as open_clip unwraps it ({'state_dict': ...}, 'module.'); None for files open_clip reads its
    own way (a TorchScript archive: OpenAI's files; numpy's .npz / .npy). A file cut short, empty, or holding no
    tensors is refused with one message naming it (and `flag`, the option that passed it)."""
    path = str(path)
    if path.endswith((".npz", ".npy")):
        return None
    try:
        if path.endswith(".safetensors"):
            from safetensors import safe_open  # installed with open_clip
            with safe_open(path, "pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        with open(path, "rb") as f:
            head = f.read(4)
        if not head or head.startswith(b"PK") and not zipfile.is_zipfile(path):  # torch.save's zip, its end lost
            raise ValueError("empty" if not head else "cut short: a zip archive without its directory at the end")
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                if any(n.endswith("/constants.pkl") for n in z.namelist()):  # TorchScript
                    return None
        sd = load_weights_only(path, mmap=zipfile.is_zipfile(path))  # mmap: zip archives only
    except UnsafeFileError:
        raise
    except Exception as e:  # noqa: BLE001  SafetensorError, torch's zip and unpickling errors, OSError
        reason = shorten((str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0])
        raise UsageError(f"{path}: not a readable model file ({reason}); copy it again, or pass another "
                         f"{flag}") from None
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not any(isinstance(v, torch.Tensor) for v in sd.values()):
        raise UsageError(f"{path}: holds no state_dict (a {type(sd).__name__}"
                         f"{' of ' + ', '.join(map(str, list(sd)[:5])) if isinstance(sd, dict) else ''}), not the "
                         f"tensors of a model")
    if next(iter(sd)).startswith("module"):
        sd = {k[7:]: v for k, v in sd.items()}
    return {k: tuple(v.shape) for k, v in sd.items() if isinstance(v, torch.Tensor)}


RANDOM_INIT = "No pretrained weights loaded for model"  # open_clip's warning, factory.create_model


@contextlib.contextmanager
def weights_loaded_next():
    """Drops open_clip's "No pretrained weights loaded ... Model initialized randomly" warning while a model is
    built whose weights are loaded right after (the lab's shipped tiny weights, a saved towers model); every other
    message, and that one everywhere else, passes."""
    def keep(record):
        return not str(record.msg).startswith(RANDOM_INIT)
    loggers = [logging.getLogger(), logging.getLogger("open_clip.factory")]  # open_clip logs on the root logger
    for lg in loggers:
        lg.addFilter(keep)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(keep)


def source_stamp(sources: dict) -> dict:
    """What a write-once manifest was built from: per source, its resolved
    path, size and modification time (recorded in the manifest's sidecar)."""
    def stamp(p):
        p = Path(p).resolve()
        return {"path": str(p), "bytes": p.stat().st_size, "mtime": p.stat().st_mtime} if p.is_file() \
            else {"path": str(p), "missing": True}
    return {k: stamp(v) for k, v in sources.items()}


def reusable_manifest(path, sources: dict) -> bool:
    """True when the write-once manifest `path` exists and its sidecar records these very sources (a source no
    longer at its recorded path cannot be checked: the manifest stands). A manifest built from other files (another
    --coco-captions, a changed ShareGPT4V json, an old sidecar without sources) is rebuilt, with a message."""
    if not Path(path).exists():
        return False
    recorded, now = read_sidecar(path).get("sources") or {}, source_stamp(sources)
    if all(v == recorded.get(k) or (v.get("missing") and v["path"] == recorded.get(k, {}).get("path"))
           for k, v in now.items()) and recorded:
        return True
    print(f"[data] {path} was built from other source files than {', '.join(map(str, sources.values()))}: "
          f"rebuilding it", file=sys.stderr)
    return False


# PIL's DecompressionBombWarning (a two-line print from inside PIL, once per worker) becomes big_image's one line
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def big_image(im: Image.Image):
    """One line for an image over PIL's decompression-bomb limit (issue 55.3: an 11000x11000 PNG printed PIL's raw
    warning): it is decoded whole, slowly; over twice the limit PIL refuses it (the row check names it)."""
    limit = Image.MAX_IMAGE_PIXELS
    if limit and im.width * im.height > limit:
        warn_once(f"warning: {getattr(im, 'filename', '') or 'an image'}: {im.width}x{im.height} pixels, over PIL's "
                  f"decompression-bomb limit ({limit:,}): decoded whole, which is slow; resize it to train faster")


def to_rgb(im: Image.Image) -> Image.Image:
    """PIL's convert('RGB') clips a 16- or 32-bit integer image at 255 (a 16-bit PNG comes out 99.5 % white):
    such images are scaled to 8 bits by their type's range first (16 bits: / 257), in training and evaluation."""
    big_image(im)
    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        a = np.asarray(im, dtype=np.float64)
        top = 65535.0 if im.mode.startswith("I;16") or a.max() <= 65535 else float(np.iinfo(np.int32).max)
        im = Image.fromarray(np.clip(np.rint(a * 255.0 / top), 0, 255).astype(np.uint8), "L")
    return im.convert("RGB")


def _atomic_save(obj, path: Path):
    """torch.save through atomic_write (training checkpoints, exported models)."""
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def seeded(s: int, fn: Callable, *args):
    """fn(*args) with torch's CPU generator, Python's and NumPy's seeded from s, and put back afterwards (CUDA's
    is untouched): a sample's augmentation as a function of s alone."""
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(s)
        random.seed(s)
        np.random.seed(s % 2 ** 32)
        try:
            return fn(*args)
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def load_weights_only(path, map_location="cpu", mmap: bool = False):
    """torch.load(weights_only=True): tensors, numbers, strings and plain containers only, so a swapped or
    tampered checkpoint or cache cannot run code when read. What this repository saves (checkpoints, feature and
    classifier caches) is written in those forms; anything else is refused with the file named."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        reason = shorten(str(e).strip().splitlines()[-1])
        raise UnsafeFileError(f"{path}: refused to load: it holds Python objects beyond tensors and plain "
                              f"containers, which this repository never writes (another program's file, an "
                              f"older version's, or tampered with); delete it if it is a cache ({reason})") from None


def file_sha256(path) -> str:
    """The sha256 of a file's content, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class EvalImages:
    """Evaluation images as the model sees them (decoded, then the evaluation transform), remembered per process
    up to `budget` bytes: a continual run evaluates every task's test set after every task (C-CLIP's R[i][j]),
    and the lab's demos evaluate the same sets in every run. Keyed by the file (path, size, mtime) and the
    transform's description, so a changed file or another preprocessing is read again. The transform must be
    deterministic (the evaluation's resize / centre crop / normalise); the first items in set order are kept."""
    def __init__(self, budget: int = 256 << 20):
        self.budget, self.used, self.items = budget, 0, {}

    def get(self, path, transform):
        try:
            st = os.stat(path)
            key = (str(path), st.st_size, st.st_mtime_ns, repr(transform))
            hit = self.items.get(key)
            if hit is None:
                with Image.open(path) as im:
                    hit = transform(to_rgb(im))
        except Exception as e:  # PIL raises many types; name the file (a worker's traceback would not)
            raise DataError(f"undecodable image {path} ({type(e).__name__}: {e})") from None
        if key not in self.items:
            size = hit.numel() * hit.element_size() if torch.is_tensor(hit) else self.budget
            if self.used + size <= self.budget:
                self.items[key], self.used = hit, self.used + size
        return hit


EVAL_IMAGES = EvalImages()
