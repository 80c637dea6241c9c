"""MTIL, Multi-domain Task-Incremental Learning (Zheng et al., "Preventing Zero-Shot Transfer Degradation in
Continual Learning of Vision-Language Models" (ZSCL), ICCV 2023, arXiv:2303.06628, Sec. 4.1; the authors' code
github.com/Thunderbeee/ZSCL, mtil/): the 11 datasets read from torchvision's folder layouts, ZSCL's splits, class
names and templates, its two orders, the task sequence as training manifests, and its Transfer / Average / Last.

Facts taken from ZSCL's code (they live in protocols/mtil.json, not here): the orders (scripts/ZSCL.sh: Order I,
ZSCL_minus.sh: Order II), each dataset's templates and the class names it fixes (src/datasets/collections.py:
Caltech101, EuroSAT, Flowers; the others are torchvision's, read from the layout with "_" -> " " as its
process_labels does), the ViT-B/16 zero-shot row of results.ipynb. Splits as collections.py builds them:
torchvision's train / test (Aircraft "train", DTD partition 1 "train", Pets "trainval"), and for the datasets
without one (Caltech101, EuroSAT, SUN397) torch.utils.data.random_split(0.8, seed 42) of the whole set.

The readers are written here, not torchvision's classes, so that a copy of the data needs no md5 match and the
missing-data message names every missing file at once; tests/test_mtil.py checks each one against torchvision's
class on a fixture in the real layout. Deviations:
  1. SUN397: the images in sorted path order before the split; torchvision lists them with Path.rglob, whose
     order is the file system's, so ZSCL's split of SUN397 is not reproducible across machines.
  2. CIFAR-100 is read from cifar100/cifar-100-python/ (eval.py's cifar100 folder) or cifar-100-python/.
  3. Training captions: ZSCL trains with cross-entropy over the task's class prompts (templates[0], finetune.py);
     the contrastive methods here train on (image, templates[0] of its class) pairs (docs/protocols.md).

Transfer / Average / Last (results.ipynb's statistics(), rows = after each task, no pretrained row):
  Transfer_j = mean_{1<=i<j} R[i][j] (j = 2..T: accuracy on task j before it is learned, after tasks 1..i)
  Average_j  = mean_{i=1..T} R[i][j]        Last_j = R[T][j]
each then averaged over its tasks. R[0] (the pretrained model) is printed beside them, in none of the three.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from plumbing import safepickle
from plumbing.base import CACHE_DIR, DataError, UsageError, atomic_write, inside_folder, markdown_table, shorten

DATA = json.loads(Path(__file__).with_name("mtil.json").read_text())
ORDERS = DATA["orders"]  # order1 / order2 -> the 11 dataset names in training order
DATASETS = tuple(ORDERS["order1"])
PREFIX = "mtil:"  # eval.py's name of a dataset's test set: mtil:Aircraft
MNIST_CLASSES = ["0 - zero", "1 - one", "2 - two", "3 - three", "4 - four", "5 - five", "6 - six", "7 - seven",
                 "8 - eight", "9 - nine"]  # torchvision's MNIST.classes
# dataset -> what must exist under the data root (torchvision's folder names, as ZSCL's --data-location holds them)
LAYOUTS = {
    "Aircraft": "fgvc-aircraft-2013b/data/{variants.txt, images_variant_train.txt, images_variant_test.txt, images/}",
    "Caltech101": "caltech101/101_ObjectCategories/<category>/image_0001.jpg ...",
    "CIFAR100": "cifar100/cifar-100-python/{train, test, meta} (or cifar-100-python/ under the root)",
    "DTD": "dtd/dtd/{labels/train1.txt, labels/test1.txt, images/<class>/}",
    "EuroSAT": "eurosat/2750/<class>/*.jpg",
    "Flowers": "flowers-102/{jpg/image_00001.jpg ..., imagelabels.mat, setid.mat}",
    "Food": "food-101/{meta/train.json, meta/test.json, images/<class>/}",
    "MNIST": "MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte",
    "OxfordPet": "oxford-iiit-pet/{annotations/trainval.txt, annotations/test.txt, images/}",
    "StanfordCars": "stanford_cars/{devkit/cars_meta.mat, devkit/cars_train_annos.mat, cars_train/, "
                    "cars_test_annos_withlabels.mat, cars_test/}",
    "SUN397": "SUN397/{ClassName.txt, <letter>/<class>/sun_*.jpg}",
}


class MissingMTIL(DataError):
    """MTIL data not where the layout (LAYOUTS, docs/data.md) says."""


@dataclass
class Listing:
    """One split of one dataset: images (file paths, or an ArrayImages), labels, ZSCL's class names and templates."""
    dataset: str
    split: str
    images: object
    labels: list
    classnames: list
    templates: list
    layout: str = field(default="")


class ArrayImages:
    """In-memory images (CIFAR's (N, 3072) rows, MNIST's (N, 28, 28)) as PIL images, read lazily."""
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        from PIL import Image
        x = self.data[i]
        return Image.fromarray(x.reshape(3, 32, 32).transpose(1, 2, 0) if x.ndim == 1 else x).convert("RGB")


def _need(path: Path, dataset: str) -> Path:
    if not path.exists():
        raise MissingMTIL(f"{dataset}: {path} not found")
    return path


def _bad(dataset: str, path, what: str, line: int | None = None):
    """MissingMTIL for a file that is there but not in its format: the file, its line (1-based) and what is wrong
    (issue 69.3)."""
    return MissingMTIL(f"{dataset}: {path}{f' line {line}' if line else ''}: {what}")


def _rows(path: Path, dataset: str, sep: str, what: str):
    """A list file's non-empty lines split once at `sep` as (line number, first, rest); a line without it is
    _bad naming the line and the format `what`."""
    rows = []
    for n, line in enumerate(_need(path, dataset).read_text(errors="replace").splitlines(), 1):
        if line.strip():
            first, found, rest = line.strip().partition(sep)
            if not (found and first and rest):
                raise _bad(dataset, path, f"{line.strip()[:80]!r} is not {what}", n)
            rows.append((n, first, rest))
    return rows


def _key(mat: dict, key: str, path: Path, dataset: str):
    """A .mat file's variable, or _bad naming the file, the variable and what the file holds."""
    if key not in mat:
        held = ", ".join(k for k in mat if not k.startswith("__")) or "no variables"
        raise _bad(dataset, path, f"holds no {key!r} (it holds {held})")
    return mat[key]


def _spaces(names):
    return [str(n).replace("_", " ") for n in names]


def random_split_indices(n: int, ratio: float = 0.8, seed: int = 42):
    """torch.utils.data.random_split(dataset, [int(ratio n), n - int(ratio n)], Generator().manual_seed(seed))'s
    two index lists, as ZSCL's split_dataset calls it."""
    import torch
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return perm[:int(ratio * n)], perm[int(ratio * n):]


def _loadmat(path: Path, dataset: str):
    """A MATLAB .mat file (Flowers', StanfordCars' annotations) through scipy; a missing one, scipy absent, or
    a file scipy cannot read: MissingMTIL naming it."""
    _need(path, dataset)
    try:
        from scipy.io import loadmat
    except ModuleNotFoundError:
        raise MissingMTIL(f"{dataset}: reading {path} needs scipy, which is not installed (pip install -r "
                          f"requirements.txt)") from None
    try:
        return loadmat(path, squeeze_me=True)
    except Exception as e:  # scipy's MatReadError, ValueError, or an IndexError on a truncated header
        raise MissingMTIL(f"{dataset}: {path} is not a readable MATLAB .mat file ({type(e).__name__}: {e})") \
            from None


def _idx(path: Path, dims: int):
    """An MNIST idx file (big-endian: magic 0 0 8 <dimension count>, the sizes, uint8 data). The header is read
    and checked against the file's size before the data (a huge or cut file is refused unread, issue 69.7)."""
    with _need(path, "MNIST").open("rb") as f:
        head = f.read(4 + 4 * dims)
        if len(head) < 4 + 4 * dims or head[:4] != bytes([0, 0, 8, dims]):
            raise _bad("MNIST", path, f"not an idx file of {dims}-dimensional uint8 data (its first bytes are "
                                      f"{head[:4].hex(' ') or 'missing'}, want 00 00 08 {dims:02x})")
        shape = [int.from_bytes(head[4 + 4 * k: 8 + 4 * k], "big") for k in range(dims)]
        size = int(np.prod(shape))
        held = path.stat().st_size - len(head)
        if held != size:
            raise _bad("MNIST", path, f"its header says {' x '.join(map(str, shape))} = {size} bytes of data, the "
                                      f"file holds {held} ({'cut short' if held < size else 'more than that'})")
        return np.frombuffer(f.read(), np.uint8).reshape(shape)


def _aircraft(root, split):
    base = root / "fgvc-aircraft-2013b" / "data"
    classes = [line.strip() for line in _need(base / "variants.txt", "Aircraft").read_text(errors="replace")
               .splitlines()]
    index = {c: k for k, c in enumerate(classes)}
    listed = base / f"images_variant_{split}.txt"
    rows = _rows(listed, "Aircraft", " ", "'<image id> <variant>'")
    for n, _, c in rows:
        if c not in index:
            raise _bad("Aircraft", listed, f"variant {c!r} is not in {base / 'variants.txt'}", n)
    return [str(base / "images" / f"{i}.jpg") for _, i, _ in rows], [index[c] for _, _, c in rows], _spaces(classes)


def _caltech101(root, split):
    base = _need(root / "caltech101" / "101_ObjectCategories", "Caltech101")
    cats = sorted(p.name for p in base.iterdir() if p.name != "BACKGROUND_Google")
    paths, labels = [], []
    for k, c in enumerate(cats):  # torchvision: image_0001.jpg .. image_<n>.jpg, n = the folder's file count
        n = len(list((base / c).iterdir()))
        paths += [str(base / c / f"image_{i:04d}.jpg") for i in range(1, n + 1)]
        labels += [k] * n
    return _split(paths, labels, split, cats)


def _split(paths, labels, split, classes):
    train, test = random_split_indices(len(paths))
    keep = train if split == "train" else test
    return [paths[i] for i in keep], [labels[i] for i in keep], classes


def _cifar100(root, split):
    base = next((p for p in (root / "cifar100" / "cifar-100-python", root / "cifar-100-python") if p.exists()),
                root / "cifar100" / "cifar-100-python")
    data, labels, names = safepickle.cifar(_need(base / split, "CIFAR100"), _need(base / "meta", "CIFAR100"), 100)
    return ArrayImages(data), labels, _spaces(names)


def _dtd(root, split):
    base = root / "dtd" / "dtd"
    rows = [(c, n) for _, c, n in _rows(base / "labels" / f"{split}1.txt", "DTD", "/", "'<class>/<image>'")]
    classes = sorted({c for c, _ in rows})
    return [str(base / "images" / c / n) for c, n in rows], [classes.index(c) for c, _ in rows], _spaces(classes)


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")  # ImageFolder's


def _eurosat(root, split):
    base = _need(root / "eurosat" / "2750", "EuroSAT")
    classes = sorted(p.name for p in base.iterdir() if p.is_dir())
    pairs = [(str(f), k) for k, c in enumerate(classes) for f in sorted((base / c).rglob("*"))
             if f.suffix.lower() in IMAGE_SUFFIXES]
    return _split([p for p, _ in pairs], [k for _, k in pairs], split, classes)


def _flowers(root, split):
    base = root / "flowers-102"
    ids = np.atleast_1d(_key(_loadmat(base / "setid.mat", "Flowers"), "trnid" if split == "train" else "tstid",
                             base / "setid.mat", "Flowers"))
    labels = np.atleast_1d(_key(_loadmat(base / "imagelabels.mat", "Flowers"), "labels", base / "imagelabels.mat",
                                "Flowers"))
    wrong = next((i for i in ids.tolist() if not (isinstance(i, (int, float)) and float(i).is_integer()
                                                       and 1 <= i <= len(labels))), None)
    if wrong is not None or not len(ids):
        raise _bad("Flowers", base / "setid.mat", f"image id {wrong!r} is not one of imagelabels.mat's 1..{len(labels)}"
                   if len(ids) else f"lists no {split} images")
    return ([str(base / "jpg" / f"image_{int(i):05d}.jpg") for i in ids], [int(labels[int(i) - 1]) - 1 for i in ids],
            None)


def _food(root, split):
    base = root / "food-101"
    path = _need(base / "meta" / f"{split}.json", "Food")
    try:
        meta = json.loads(path.read_text(errors="replace"))
    except json.JSONDecodeError as e:
        raise _bad("Food", path, f"not valid JSON ({e.msg}, column {e.colno})", e.lineno) from None
    if not (isinstance(meta, dict) and all(isinstance(v, list) and all(isinstance(f, str) for f in v)
                                           for v in meta.values())):
        raise _bad("Food", path, 'not a JSON object of {"<class>": ["<class>/<image id>", ...]}')
    classes = sorted(meta)
    pairs = [(str(base / "images" / f"{p}.jpg"), classes.index(c)) for c, files in meta.items() for p in files]
    return [p for p, _ in pairs], [k for _, k in pairs], _spaces(classes)


def _mnist(root, split):
    base = root / "MNIST" / "raw"
    stem = "train" if split == "train" else "t10k"
    images = _idx(base / f"{stem}-images-idx3-ubyte", 3)
    labels = _idx(base / f"{stem}-labels-idx1-ubyte", 1)
    if len(images) != len(labels):
        raise _bad("MNIST", base / f"{stem}-labels-idx1-ubyte", f"{len(labels)} labels for {len(images)} images "
                                                                f"in {stem}-images-idx3-ubyte")
    return ArrayImages(images), [int(x) for x in labels], list(MNIST_CLASSES)


def _pets(root, split):
    base = root / "oxford-iiit-pet"
    listed = base / "annotations" / f"{'trainval' if split == 'train' else split}.txt"
    rows = [(n, i, k.split()[0]) for n, i, k in _rows(listed, "OxfordPet", " ", "'<image id> <class id> ...'")]
    for n, _, k in rows:
        if not (k.isascii() and k.isdigit() and int(k) >= 1):
            raise _bad("OxfordPet", listed, f"class id {k!r} is not a whole number from 1", n)
    labels = [int(k) - 1 for _, _, k in rows]
    rows = [(i, k) for _, i, k in rows]
    # torchvision: each label's breed from its image ids ("american_bulldog_12" -> "American Bulldog")
    names = dict(sorted({(k, i.rsplit("_", 1)[0]) for i, k in zip((i for i, _ in rows), labels)}))
    classes = [" ".join(part.title() for part in names[k].split("_")) for k in sorted(names)]
    return [str(base / "images" / f"{i}.jpg") for i, _ in rows], labels, classes


def _cars(root, split):
    base = root / "stanford_cars"
    path = base / "devkit" / "cars_meta.mat"
    meta = _key(_loadmat(path, "StanfordCars"), "class_names", path, "StanfordCars")
    annos, images = ((base / "devkit" / "cars_train_annos.mat", base / "cars_train") if split == "train" else
                     (base / "cars_test_annos_withlabels.mat", base / "cars_test"))
    rows = np.atleast_1d(_key(_loadmat(annos, "StanfordCars"), "annotations", annos, "StanfordCars"))
    if not (rows.dtype.names and {"fname", "class"} <= set(rows.dtype.names)):
        raise _bad("StanfordCars", annos, "its annotations have no 'fname' and 'class' fields")
    return ([str(images / str(a["fname"])) for a in rows], [int(a["class"]) - 1 for a in rows],
            _spaces(np.atleast_1d(meta).tolist()))


def _sun397(root, split):
    base = root / "SUN397"
    classes = [c[3:].strip() for c in _need(base / "ClassName.txt", "SUN397").read_text(errors="replace")
               .splitlines() if c.strip()]
    index = {c: k for k, c in enumerate(classes)}
    files = sorted(base.rglob("sun_*.jpg"))  # deviation 1: sorted
    labels = [index.get("/".join(f.relative_to(base).parts[1:-1])) for f in files]
    if None in labels:
        raise _bad("SUN397", files[labels.index(None)].parent,
                   f"a folder of images not named in {base / 'ClassName.txt'}")
    return _split([str(f) for f in files], labels, split, _spaces(classes))


READERS = {"Aircraft": _aircraft, "Caltech101": _caltech101, "CIFAR100": _cifar100, "DTD": _dtd,
           "EuroSAT": _eurosat, "Flowers": _flowers, "Food": _food, "MNIST": _mnist, "OxfordPet": _pets,
           "StanfordCars": _cars, "SUN397": _sun397}


def read(root, dataset: str, split: str) -> Listing:
    """One split ('train' | 'test') of one MTIL dataset under the data root, with ZSCL's class names and
    templates. A missing file: MissingMTIL naming it, the layout and docs/data.md."""
    try:
        images, labels, classes = READERS[dataset](Path(root), split)
    except MissingMTIL as e:
        raise MissingMTIL(f"MTIL {e}; expected under the data root ({root}): {LAYOUTS[dataset]}. See "
                          f"docs/data.md, 'MTIL'.") from None
    fixed = DATA["classnames"].get(dataset)  # ZSCL's own names where it fixes them
    if fixed and classes is not None and len(classes) != len(fixed):  # class-named folders (issue 69.7)
        folder = Path(root) / LAYOUTS[dataset].split("/<")[0]
        raise DataError(f"MTIL {dataset}: {folder} holds {len(classes)} class folders, ZSCL's {dataset} has "
                        f"{len(fixed)} classes; a folder's class is its place in sorted order, so move out what is "
                        f"not one of them. Its folders: " + shorten(", ".join(classes), 400))
    classes = fixed or classes
    if not isinstance(images, ArrayImages):
        inside_folder(Path(root) / LAYOUTS[dataset].split("/")[0], images, f"MTIL {dataset}")
    if labels and max(labels) >= len(classes):
        raise DataError(f"MTIL {dataset} ({root}): label {max(labels)} but {len(classes)} class names")
    return Listing(dataset, split, images, labels, list(classes), list(DATA["templates"][dataset]),
                   LAYOUTS[dataset])


def missing(root, datasets=DATASETS) -> list[str]:
    """'dataset: what is missing' for each dataset that cannot be read (both splits)."""
    out = []
    for d in datasets:
        for split in ("train", "test"):
            try:
                READERS[d](Path(root), split)
            except (MissingMTIL, OSError) as e:  # MissingMTIL's text starts with the dataset's name
                out.append(str(e) if isinstance(e, MissingMTIL) else f"{d}: {e}")
                break
    return out


def order_of(spec: str) -> list[str] | None:
    """--tasks mtil-order1 / mtil-order2 -> the dataset order; 'mtil-order1:N' its first N tasks (ours: a smoke run
    or a test; ZSCL reports all 11); anything else -> None."""
    name, _, first = spec.partition(":")
    order = ORDERS.get(name.removeprefix("mtil-")) if name.startswith("mtil-") else None
    if order is None or not first:
        return order
    if not first.isdigit() or not 1 <= int(first) <= len(order):
        raise UsageError(f"--tasks {spec}: after ':' the number of MTIL tasks to run, 1..{len(order)}")
    return order[:int(first)]


def training_manifest(listing: Listing, cache=None, every_template: bool = False) -> Path:
    """A training manifest of the split: one row per image {image (absolute path), caption = templates[0] of its
    class (deviation 3), label}; every_template: `captions`, the class's prompt in every template, of which
    training draws one per image per epoch (seeded; protocols/class_folders.py). In-memory images (CIFAR, MNIST)
    are written out as PNG files once, beside it in CLIPFT_CACHE/mtil/<dataset>-<fingerprint>/, as
    plumbing.datafolders does for Hugging Face folders."""
    paths = None if isinstance(listing.images, ArrayImages) else list(listing.images)
    key = [listing.dataset, listing.split, listing.labels, listing.templates if every_template else
           listing.templates[0], listing.classnames,
           paths if paths is not None else hashlib.sha1(listing.images.data.tobytes()).hexdigest()]
    folder = Path(cache or CACHE_DIR / "mtil") / (
        f"{listing.dataset}-{listing.split}-" + hashlib.sha1(json.dumps(key).encode()).hexdigest()[:16])
    manifest = folder / "train.jsonl"
    if manifest.exists():
        return manifest
    if paths is None:
        paths = []
        for i in range(len(listing.images)):
            png = folder / "images" / f"{i:06d}.png"
            atomic_write(png, lambda tmp, i=i: listing.images[i].save(tmp, format="PNG"))
            paths.append(str(png))
    rows = [json.dumps({"image": str(Path(p).resolve()), "label": k, **(
        {"captions": [t.format(listing.classnames[k]) for t in listing.templates]} if every_template else
        {"caption": listing.templates[0].format(listing.classnames[k])})}) for p, k in zip(paths, listing.labels)]
    atomic_write(manifest, "\n".join(rows) + "\n")
    return manifest


def sequence(spec: str, root, cache=None) -> list[tuple[str, str, str]]:
    """--tasks mtil-order1 | mtil-order2 -> [(name, training manifest, eval.py test-set name)] in ZSCL's order.
    Every dataset is checked first: one MissingMTIL names all that are missing."""
    order = order_of(spec)
    if order is None:
        raise UsageError(f"--tasks {spec}: MTIL's orders are {', '.join('mtil-' + o for o in ORDERS)}")
    lost = missing(root, order)
    if lost:
        raise MissingMTIL(f"--tasks {spec}: {len(lost)} of MTIL's {len(order)} datasets cannot be read under the "
                          f"data root {root}:\n  " + "\n  ".join(f"{m} (layout: {LAYOUTS[m.split(':')[0]]})"
                                                              for m in lost)
                          + "\nEach sits in torchvision's folder for it (ZSCL's --data-location); see docs/data.md, "
                            "'MTIL', for the tree and the sources.")
    return [(d, str(training_manifest(read(root, d, "train"), cache)), PREFIX + d) for d in order]


def is_mtil(tests) -> bool:
    """A task sequence whose test sets are all MTIL datasets (test names as sequence() gives them)."""
    return bool(tests) and all(str(t).startswith(PREFIX) for t in tests)


def transfer_average_last(R) -> dict:
    """ZSCL's Transfer / Average / Last (module docstring) of a (T+1) x T accuracy matrix, R[0] = pretrained:
    per task (None where undefined: Transfer of task 1) and their means."""
    R = np.asarray(R, dtype=float)
    T = R.shape[1]
    if R.shape[0] != T + 1:
        raise ValueError(f"transfer_average_last needs a (T+1) x T matrix, got {R.shape}")
    transfer = [None] + [float(R[1:j + 1, j].mean()) for j in range(1, T)]  # column j = task j+1: rows 1..j
    average = [float(R[1:, j].mean()) for j in range(T)]
    last = [float(v) for v in R[T]]
    return {"zero_shot": [float(v) for v in R[0]], "transfer": transfer, "average": average, "last": last,
            "Transfer": float(np.mean(transfer[1:])) if T > 1 else None, "Average": float(np.mean(average)),
            "Last": float(np.mean(last))}


def summary(tests, matrices: dict) -> dict:
    """common.summarize_continual's addition: {'mtil': transfer_average_last of the top-1 matrix} when every test
    set is MTIL's, else {}."""
    return {"mtil": transfer_average_last(matrices["top1"])} if is_mtil(tests) and "top1" in matrices else {}


def table(m: dict, names, published: dict | None = None) -> str:
    """The Transfer / Average / Last matrix as ZSCL's Table 1 prints it: a row per metric, a column per dataset
    (training order) and their mean; the pretrained row above; published: a zero-shot row of the paper's."""
    rows = []
    if published:
        rows.append({"": "zero-shot (ZSCL, ViT-B/16)", **{n: published.get(n) for n in names},
                     "mean": float(np.mean([published[n] for n in names]))})
    rows.append({"": "zero-shot (row 0)", **dict(zip(names, m["zero_shot"])), "mean": float(np.mean(m["zero_shot"]))})
    for key in ("transfer", "average", "last"):
        rows.append({"": key.title(), **dict(zip(names, m[key])), "mean": m[key.title()]})
    return markdown_table(rows, ["", *names, "mean"], "{:.1f}")
