"""Stand-ins for two protocols' data (issue 61): tiny copies of MTIL's 11 datasets and of ImageNet with its five
distribution shifts, each written in its REAL folder layout (torchvision's, as ZSCL reads MTIL; the releases' own,
as WiSE-FT reads the shifts), with a few generated images per class. They let the loaders be tested on the files
they will meet and the drivers run end to end on CPU (`cclip.py --tasks mtil-order1`, `eval.py --tasks
imagenet-shifts --wise-ft`); their numbers mean nothing about the real benchmarks.

    python -m lab.protocol_data DIR        # writes DIR/{fgvc-aircraft-2013b, ..., imagenet, imagenet-r, ...}

Images: a class's colour plus seeded noise, so a model can tell a few classes apart. Class counts are small where
the layout itself names the classes (Aircraft's variants.txt, CIFAR's meta, ...), and the real counts where ZSCL
or WiSE-FT fixes them (Caltech101 101 folders, EuroSAT 10, ImageNet 1,000, ImageNet-R / -A 200 folders)."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
from PIL import Image

from protocols import imagenet_shifts


def _image(rng, label: int, size: int = 32) -> Image.Image:
    colour = np.array([(37 * label) % 256, (91 * label + 60) % 256, (53 * label + 120) % 256], float)
    x = np.clip(colour + rng.normal(0, 25, (size, size, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(x)


def _save(path: Path, rng, label: int, fmt: str = "JPEG"):
    path.parent.mkdir(parents=True, exist_ok=True)
    _image(rng, label).save(path, format=fmt)


def write_mtil(root, classes: int = 3, per_class: int = 4, seed: int = 0) -> Path:
    """The 11 MTIL datasets under root in torchvision's layouts; `classes` classes with `per_class` images per
    split where the layout names its classes (all 10 of EuroSAT's, ImageFolder refuses an empty class)."""
    from scipy.io import savemat
    root, rng = Path(root), np.random.default_rng(seed)
    names = [f"class_{k}" for k in range(classes)]
    # Aircraft: variants.txt, images_variant_<split>.txt ("<id> <variant>"), images/<id>.jpg
    air = root / "fgvc-aircraft-2013b" / "data"
    air.mkdir(parents=True, exist_ok=True)
    (air / "variants.txt").write_text("".join(f"Variant {k}-{k}00\n" for k in range(classes)))
    for split in ("train", "test"):
        lines = []
        for k in range(classes):
            for j in range(per_class):
                image_id = f"{split[:2]}{k}{j:04d}"
                _save(air / "images" / f"{image_id}.jpg", rng, k)
                lines.append(f"{image_id} Variant {k}-{k}00\n")
        (air / f"images_variant_{split}.txt").write_text("".join(lines))
    # Caltech101: 101 category folders (+ BACKGROUND_Google, which torchvision drops), images in the first ones
    cal = root / "caltech101" / "101_ObjectCategories"
    for k in range(101):
        (cal / f"cat_{k:03d}").mkdir(parents=True, exist_ok=True)
        for j in range(per_class if k < classes else 0):
            _save(cal / f"cat_{k:03d}" / f"image_{j + 1:04d}.jpg", rng, k)
    _save(cal / "BACKGROUND_Google" / "image_0001.jpg", rng, 99)
    # CIFAR-100: pickled dicts (data (N, 3072) channel-major, fine_labels; meta fine_label_names)
    cif = root / "cifar100" / "cifar-100-python"
    cif.mkdir(parents=True, exist_ok=True)
    (cif / "meta").write_bytes(pickle.dumps({"fine_label_names": [f"fine_{n}" for n in names]}))
    for split in ("train", "test"):
        labels = [k for k in range(classes) for _ in range(per_class)]
        data = np.stack([np.asarray(_image(rng, k)).transpose(2, 0, 1).reshape(-1) for k in labels])
        (cif / split).write_bytes(pickle.dumps({"data": data, "fine_labels": labels}))
    # DTD: labels/<split>1.txt ("<class>/<file>"), images/<class>/<file>
    dtd = root / "dtd" / "dtd"
    (dtd / "labels").mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        lines = []
        for k, n in enumerate(names):
            for j in range(per_class):
                _save(dtd / "images" / n / f"{n}_{split}{j:04d}.jpg", rng, k)
                lines.append(f"{n}/{n}_{split}{j:04d}.jpg\n")
        (dtd / "labels" / f"{split}1.txt").write_text("".join(lines))
    # EuroSAT: 2750/<Class>/<Class>_<n>.jpg, all 10 classes (ZSCL names 10)
    for k in range(10):
        for j in range(2 if k >= classes else per_class * 2):
            _save(root / "eurosat" / "2750" / f"Class{k}" / f"Class{k}_{j + 1}.jpg", rng, k)
    # Flowers-102: jpg/image_%05d.jpg, imagelabels.mat (labels 1..102), setid.mat (trnid / valid / tstid)
    flo = root / "flowers-102"
    n = classes * per_class * 3
    labels = np.array([1 + (i // 3) % classes for i in range(n)], np.uint8)  # every split holds every class
    for i in range(n):
        _save(flo / "jpg" / f"image_{i + 1:05d}.jpg", rng, int(labels[i]) - 1)
    savemat(flo / "imagelabels.mat", {"labels": labels})
    ids = np.arange(1, n + 1, dtype=np.uint16)
    savemat(flo / "setid.mat", {"trnid": ids[0::3], "valid": ids[1::3], "tstid": ids[2::3]})
    # Food-101: meta/<split>.json {class: ["class/id", ...]}, images/<class>/<id>.jpg
    food = root / "food-101"
    (food / "meta").mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        meta = {}
        for k, c in enumerate(names):
            meta[c] = [f"{c}/{split}{j}" for j in range(per_class)]
            for p in meta[c]:
                _save(food / "images" / f"{p}.jpg", rng, k)
        (food / "meta" / f"{split}.json").write_text(json.dumps(meta))
    # MNIST: raw/<stem>-images-idx3-ubyte (magic 2051), <stem>-labels-idx1-ubyte (magic 2049), big-endian sizes
    mn = root / "MNIST" / "raw"
    mn.mkdir(parents=True, exist_ok=True)
    for stem in ("train", "t10k"):
        labels = np.array([k for k in range(classes) for _ in range(per_class)], np.uint8)
        images = np.stack([np.asarray(_image(rng, int(k), 28).convert("L")) for k in labels])
        head = (2051).to_bytes(4, "big") + b"".join(int(s).to_bytes(4, "big") for s in images.shape)
        (mn / f"{stem}-images-idx3-ubyte").write_bytes(head + images.tobytes())
        (mn / f"{stem}-labels-idx1-ubyte").write_bytes((2049).to_bytes(4, "big") + len(labels).to_bytes(4, "big")
                                                        + labels.tobytes())
    # Oxford-IIIT Pet: annotations/{trainval,test}.txt ("<Breed_id> <class 1..37> <species> <breed id>"), images/
    pet = root / "oxford-iiit-pet"
    (pet / "annotations").mkdir(parents=True, exist_ok=True)
    breeds = ["Abyssinian", "american_bulldog", "Bengal", "great_pyrenees"][:classes] + names[4:]
    for split in ("trainval", "test"):
        lines = []
        for k, b in enumerate(breeds):
            for j in range(per_class):
                image_id = f"{b}_{split[:2]}{j}"
                _save(pet / "images" / f"{image_id}.jpg", rng, k)
                lines.append(f"{image_id} {k + 1} {1 + k % 2} {k + 1}\n")
        (pet / "annotations" / f"{split}.txt").write_text("".join(lines))
    # Stanford Cars: devkit/cars_meta.mat class_names, annotation structs (fname, class 1-based) per split
    car = root / "stanford_cars"
    (car / "devkit").mkdir(parents=True, exist_ok=True)
    savemat(car / "devkit" / "cars_meta.mat", {"class_names": np.array([f"Car Model {k} 2012" for k in
                                                                         range(classes)], dtype=object)})
    for split, annos, folder in (("train", car / "devkit" / "cars_train_annos.mat", car / "cars_train"),
                                 ("test", car / "cars_test_annos_withlabels.mat", car / "cars_test")):
        rows = np.zeros(classes * per_class, dtype=[("fname", object), ("class", object)])
        for i in range(len(rows)):
            rows[i] = (f"{split}{i:05d}.jpg", i // per_class + 1)
            _save(folder / f"{split}{i:05d}.jpg", rng, i // per_class)
        savemat(annos, {"annotations": rows})
    # SUN397: ClassName.txt ("/a/abbey", nested classes as "/b/bakery/shop"), <letter>/<class>/sun_*.jpg
    sun = root / "SUN397"
    sun_classes = [f"/{c[0]}/{c}" for c in names[:-1]] + [f"/{names[-1][0]}/{names[-1]}/indoor"]
    sun.mkdir(parents=True, exist_ok=True)
    (sun / "ClassName.txt").write_text("".join(c + "\n" for c in sun_classes))
    for k, c in enumerate(sun_classes):
        for j in range(per_class * 2):
            _save(sun / c.lstrip("/") / f"sun_{k}{j:04d}.jpg", rng, k)
    return root


def write_imagenet_shifts(root, per_class: int = 2, classes=(1, 6, 11, 13), seed: int = 0) -> Path:
    """ImageNet val (and a train split, imagenet/train/<wnid>/, for class-folder fine-tuning: issue 72.2) and its
    five shifts under root in the layouts WiSE-FT reads: imagenet/val/<wnid>/,
    imagenetv2-matched-frequency-format-val/<index>/, imagenet-r/<wnid>/ and imagenet-a/<wnid>/ (their 200 folders),
    sketch/<wnid>/, objectnet-1.0/images/<folder>/. Images for the ImageNet indices `classes` (and for ObjectNet
    the first folders mapped to any of them, or its first four folders); every class folder exists."""
    root, rng = Path(root), np.random.default_rng(seed)
    wnids = [f"n{k:08d}" for k in range(1000)]  # sorted like the real wnids, so the folder order is the index order
    for k in range(1000):
        for base in (root / "imagenet" / "val", root / "imagenet" / "train", root / "sketch"):
            (base / wnids[k]).mkdir(parents=True, exist_ok=True)
        (root / "imagenetv2-matched-frequency-format-val" / str(k)).mkdir(parents=True, exist_ok=True)
    for f, _, _ in imagenet_shifts.OBJECTNET:  # the 113 folders read (an absent one is named: issue 69.7)
        (root / "objectnet-1.0" / "images" / f).mkdir(parents=True, exist_ok=True)
    for name in ("imagenet-r", "imagenet-a"):
        for k in imagenet_shifts.SUBSETS[name]:
            (root / name / wnids[k]).mkdir(parents=True, exist_ok=True)
    for k in classes:
        for j in range(per_class):
            _save(root / "imagenet" / "val" / wnids[k] / f"ILSVRC2012_val_{k:04d}{j}.JPEG", rng, k)
            _save(root / "imagenet" / "train" / wnids[k] / f"{wnids[k]}_{j}.JPEG", rng, k)
            _save(root / "sketch" / wnids[k] / f"sketch_{j}.JPEG", rng, k)
            _save(root / "imagenetv2-matched-frequency-format-val" / str(k) / f"{j}.jpeg", rng, k)
            for name in ("imagenet-r", "imagenet-a"):
                if k in imagenet_shifts.SUBSETS[name]:
                    _save(root / name / wnids[k] / f"{name}_{j}.jpg", rng, k)
    folders = [f for f, _, ids in imagenet_shifts.OBJECTNET if set(ids) & set(classes)] or [
        f for f, _, _ in imagenet_shifts.OBJECTNET[:4]]
    for f in folders:
        ids = dict((g, i) for g, _, i in imagenet_shifts.OBJECTNET)[f]
        for j in range(per_class):
            _save(root / "objectnet-1.0" / "images" / f / f"{j}.png", rng, ids[0], "PNG")
    _save(root / "objectnet-1.0" / "images" / "not_in_imagenet" / "0.png", rng, 0, "PNG")  # ignored, as WiSE-FT
    return root


# What main writes at the top of DIR (tests/test_reliability5.py checks it against a run): a DIR holding any of
# them that this command did not write is refused (issue 69.2), anything else there is left alone.
WRITES = ("fgvc-aircraft-2013b", "caltech101", "cifar100", "dtd", "eurosat", "flowers-102", "food-101", "MNIST",
          "oxford-iiit-pet", "stanford_cars", "SUN397", "imagenet", "sketch",
          "imagenetv2-matched-frequency-format-val", "imagenet-r", "imagenet-a", "objectnet-1.0")


def command_line():
    import argparse
    p = argparse.ArgumentParser(prog="python -m lab.protocol_data", allow_abbrev=False, description=(
        "Writes the stand-in layouts of MTIL's 11 datasets and of ImageNet with its five shifts under DIR (about "
        "12 MB; docs/protocols.md). DIR may be new, empty, this command's earlier output, or a folder holding "
        "none of the folders it writes (a data root: the rest is left alone)."))
    p.add_argument("dir", metavar="DIR", nargs="?", default="data-fixture", help="the folder (default: %(default)s)")
    return p


def main(argv=None):
    from plumbing import outfolder
    from plumbing.base import UsageError
    target = Path(command_line().parse_args(argv).dir)
    if target.exists() and not target.is_dir():
        raise UsageError(f"DIR {target}: a file is there; give a folder (new, empty, or this command's output)")
    if (problem := outfolder.write_problem(target)) is not None:
        raise UsageError(f"DIR {target}: cannot be created or written ({problem[1]}: {problem[0]})")
    outfolder.claim(target, "lab.protocol_data", "DIR", WRITES)  # issue 69.2: never over someone's data
    write_mtil(target)
    write_imagenet_shifts(target)
    print(f"wrote MTIL's and ImageNet shifts' stand-in layouts under {target} (see docs/protocols.md)")
    return target


if __name__ == "__main__":
    from plumbing.cli import cli
    cli(main)
