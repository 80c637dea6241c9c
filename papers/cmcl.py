"""DNS's plumbing (dns.py; Liu et al., "Continual Multimodal Contrastive Learning" (CMCL), NeurIPS 2025,
arXiv:2503.14963): what a reader of the method does not need to open to understand it.

  On CLIP (dns.py --tasks): a manifest's frozen features (manifest_features), every frozen feature a run of
      linear maps needs, extracted once and cached (frozen_task_features), the maps' evaluation after each task
      (evaluate_maps) and the results table (dns_results_table).
  In CMCL's setting (dns.py --features): the code's datasets and their two feature layouts (CMCL_DATASETS,
      read_features, write_h5), its step plan (CMCL_STEPS, Step, parse_steps, read_cmcl_steps), one step's
      evaluation (evaluate_step), the paper's main table (CMCL_PAPER) and ours (cmcl_table).
  The drivers: one continual run of dns.py's learner over CLIP's tasks (run_clip) or CMCL's steps
      (run_steps), dns.run / dns.run_cmcl passing dns.DNSLearner and dns.score_drift in; the `auto`
      settings (resolve).

Layer: above common and eval (tests/test_layout.py); dns.py and the lab import it, never the reverse.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import common
from plumbing.base import DataError, atomic_write, markdown_table
from plumbing.loading import load_weights_only
from plumbing import models
from plumbing.manifests import content_sha256
from plumbing.results import of_sequence, sequence_table
from eval import (cached, continual_tables, image_features, is_classification, load_classification,
                  manifest_retrieval, masked_continual_metrics)
from papers import zscl_mtil


# --- DNS on CLIP: a manifest's frozen features --------------------------------
@torch.no_grad()
def manifest_features(model, preprocess, tokenizer, manifest, label_column: str = "", device=None) -> dict:
    """Frozen CLIP features of a manifest with this module's protocol (rows that share an image share it):
    img (N, D), txt (M, D), t2i (M,), labels (N,) from `label_column` or None. Same calls as evaluate (truncate)."""
    rs = manifest_retrieval(manifest)
    labels = None
    if label_column:
        ds = common.ManifestDataset(manifest, check_images=False)
        by_image = {str(ds.image_file(r)): r.get(label_column) for r in ds.rows}
        found = [by_image.get(p) for p in rs.image_paths]
        labels = None if any(v is None for v in found) else torch.tensor([int(v) for v in found])
    return {"img": image_features(model, preprocess, rs.image_paths, device=device),
            "txt": common.encode_texts(model, tokenizer, rs.texts, device=device),
            "t2i": rs.text_to_image.clone(), "labels": labels}


# --- CMCL's cached multimodal features (dns.py --features) ---------------------
# The released code's datasets (dataloader.py, DATASETS): each one's modalities in the order its h5 arrays hold them
# (ModalityType order, reorder()) and its evaluations (TASKS): "acc" = classification against class text features,
# "recall" = pairwise retrieval. A step (CMCL_STEPS, the code's training.py datasets_name) "name:i,j" picks
# modalities i and j of the array, no suffix = 0,1.
CMCL_DATASETS = {
    "ucf101": (("text", "video"), ("acc",)),
    "esc50": (("text", "audio"), ("recall", "acc")),
    "nyudv2": (("vision", "text", "depth"), ("recall",)),
    "vggsound_s": (("text", "audio", "video"), ("recall", "acc")),
    "clotho": (("text", "audio"), ("recall",)),
    "tvl": (("vision", "text", "tactile"), ("recall",)),
    "llvip": (("vision", "thermal"), ("recall",)),
}

# Two layouts, detected per dataset. CMCL (the code's features_storage/, written by its extractor):
#    <dir>/<dataset>_<split>_<perceptor>.h5  one (modalities, d) array per sample id, CMCL_DATASETS order, ids sorted
#    <dir>/<dataset>_class_<perceptor>.h5    one (d,) text feature per class name
#    sample classes: from the ids ("<id>__<class name>__<class index>", as the code's perceptors write them) or
#        <dir>/<dataset>_<split>_labels.json {sample id: class name} (ours; cmcl_labels() makes it from the code's JSON)
#  ours (any encoder):
#    <dir>/<dataset>/meta.json   {"modalities": [...], optional: "classes": [...], "metrics": ["recall", "acc"]}
#    <dir>/<dataset>/<split>/<modality>.npy or .pt (N, d), row i = sample i; <split>/samples.json {"ids": [...],
#        "labels": [class index or class name, ...] (optional)}; <dataset>/classes.npy or .pt (C, d): each class
#        name's text feature
def _read_array(folder: Path, stem: str) -> torch.Tensor:
    """<folder>/<stem>.npy or .pt as a float32 (N, d) tensor; a DataError names the file when it cannot be read
    (cut short, pickled objects: refused, never run), is not numeric, or is not two-dimensional."""
    path = folder / f"{stem}.npy"
    try:
        if path.exists():
            x = np.load(path, allow_pickle=False)
        elif (path := folder / f"{stem}.pt").exists():
            x = load_weights_only(path)
        else:
            raise DataError(f"missing {folder / stem}.npy (or .pt)")
        x = torch.as_tensor(np.asarray(x) if not torch.is_tensor(x) else x)
    except DataError:
        raise
    except (ValueError, TypeError, OSError, EOFError, RuntimeError, pickle.UnpicklingError) as e:
        why = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise DataError(f"{path}: not a readable feature array ({why}); write it with numpy.save or "
                               f"torch.save of one (N, d) float tensor") from None
    if not (x.is_floating_point() or x.dtype in (torch.int32, torch.int64)) or x.ndim != 2:
        raise DataError(f"{path}: a {x.dtype} array of shape {tuple(x.shape)}; expected (N, d) floats")
    return x.float()


def _h5_rows(path: Path, keys=None) -> tuple[list[str], torch.Tensor]:
    """(sorted keys, stacked arrays) of an h5 file of one numeric array per key, e.g. the code's features; a
    DataError names the file and the key for a file that h5py cannot open, an empty one, a group or strings
    where an array belongs, and arrays of different shapes."""
    import h5py
    try:
        with h5py.File(path, "r") as f:
            keys = sorted(f.keys()) if keys is None else keys  # the code sorts the keys as strings
            if not keys:
                raise DataError(f"{path}: holds no arrays")
            rows = []
            for k in keys:
                d = f[k]
                if not isinstance(d, h5py.Dataset) or d.dtype.kind not in "fiu":
                    what = "a group" if not isinstance(d, h5py.Dataset) else f"{d.dtype} data"
                    raise DataError(f"{path}: key {k!r} holds {what}, not a numeric array")
                rows.append(torch.as_tensor(d[()]).float())
    except OSError as e:
        raise DataError(f"{path}: not a readable HDF5 file ({e})") from None
    shapes = sorted({tuple(r.shape) for r in rows})
    if len(shapes) > 1:
        raise DataError(f"{path}: arrays of different shapes {shapes[:4]} (e.g. key "
                               f"{keys[[tuple(r.shape) for r in rows].index(shapes[-1])]!r})")
    return keys, torch.stack(rows)


def sample_key(key: str) -> tuple[str, str | None]:
    """(sample id, class name) of an h5 key: the code's perceptors write "<id>__<class name>__<class index>",
    read from the right, so an id that itself holds '__' (VGGSound ids whose YouTube id ends in '_') stays whole;
    a key of another form is its own id, with no class."""
    parts = key.rsplit("__", 2)
    return (parts[0], parts[1]) if len(parts) == 3 and parts[0] else (key, None)


def cmcl_labels(paired_data_json) -> dict:
    """{sample id: class name} from the code's dataset JSON (paired_data_<split>.json: a list of one-element
    lists [{"id", "name", ...}]), to be saved as <dataset>_<split>_labels.json next to the h5 files; read_features
    looks a sample up by its whole h5 key first, then by the id in it (sample_key)."""
    return {str(row[0]["id"]): row[0]["name"] for row in json.loads(Path(paired_data_json).read_text())}


def dataset_layout(root, dataset: str, perceptor: str) -> str:
    """'cmcl' or 'ours' (see above); a DataError names what is missing."""
    root = Path(root)
    if (root / f"{dataset}_train_{perceptor}.h5").exists():
        return "cmcl"
    if (root / dataset / "meta.json").exists():
        return "ours"
    raise DataError(f"no features for dataset {dataset!r} under {root}: expected "
                           f"{dataset}_train_{perceptor}.h5 (the code's layout) or {dataset}/meta.json (ours); "
                           f"see papers/cmcl.py, 'CMCL's cached multimodal features'")


def dataset_info(root, dataset: str, perceptor: str) -> dict:
    """{"modalities": (...), "metrics": (...), "layout": ...} of one dataset."""
    layout = dataset_layout(root, dataset, perceptor)
    if layout == "cmcl":
        if dataset not in CMCL_DATASETS:
            raise DataError(f"{dataset}: the code's h5 layout holds no modality names; known datasets: "
                                   f"{sorted(CMCL_DATASETS)} (use our layout, with meta.json, for others)")
        mods, metrics = CMCL_DATASETS[dataset]
        return {"modalities": mods, "metrics": metrics, "layout": layout}
    meta = json.loads((Path(root) / dataset / "meta.json").read_text())
    metrics = tuple(meta.get("metrics", ("recall", "acc") if meta.get("classes") else ("recall",)))
    return {"modalities": tuple(meta["modalities"]), "metrics": metrics, "layout": layout}


def _label_indices(given, classes: list, folder: Path) -> torch.Tensor:
    """samples.json's "labels": class indices into meta.json's "classes", or the class names themselves; a
    DataError names the first label that is neither (an index out of range, an unknown name, another type)."""
    index = {name: i for i, name in enumerate(classes)}
    out = []
    for n, label in enumerate(given):
        if isinstance(label, str) and label in index:
            out.append(index[label])
        elif isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(classes):
            out.append(label)
        else:
            raise DataError(f"{folder / 'samples.json'}: label {n} is {label!r}, neither a class name of "
                                   f"meta.json's \"classes\" ({len(classes)}: {classes[:5]}...) nor an index in "
                                   f"0..{len(classes) - 1}")
    return torch.tensor(out, dtype=torch.long)


def read_features(root, dataset: str, split: str, perceptor: str = "imagebind") -> dict:
    """One split of one dataset: {"ids": [N], "x": (N, M, d) float32, "modalities": (M names), "metrics": (...),
    "labels": (N,) long or None, "classes": [C names] or None, "class_x": (C, d) or None}."""
    root, info = Path(root), dataset_info(root, dataset, perceptor)
    labels = classes = class_x = None
    if info["layout"] == "cmcl":
        path = root / f"{dataset}_{split}_{perceptor}.h5"
        if not path.exists():
            raise DataError(f"missing {path} (the code's extractor writes it: features_storage/extract.py)")
        ids, x = _h5_rows(path)  # the code sorts the keys as strings (feature_dataset.py)
        class_path, label_path = root / f"{dataset}_class_{perceptor}.h5", root / f"{dataset}_{split}_labels.json"
        if "acc" in info["metrics"] and class_path.exists():
            classes, class_x = _h5_rows(class_path)  # the code sorts the class names
            given = json.loads(label_path.read_text()) if label_path.exists() else None  # keyed by raw id
            by_id = {i: given.get(i, given.get(sample_key(i)[0])) if given is not None else sample_key(i)[1]
                     for i in ids}
            missing = [i for i in ids if by_id[i] not in classes]
            if missing:
                raise DataError(f"{dataset} {split}: no class for {len(missing)} sample(s), e.g. "
                                       f"{missing[0]!r}; give {label_path.name} ({{sample id: class name}})")
            labels = torch.tensor([classes.index(by_id[i]) for i in ids])
    else:
        folder = root / dataset / split
        if not folder.is_dir():
            raise DataError(f"missing {folder}")
        meta = json.loads((folder / "samples.json").read_text())
        ids = [str(i) for i in meta["ids"]]
        arrays = {m: _read_array(folder, m) for m in info["modalities"]}
        if len({tuple(a.shape) for a in arrays.values()}) > 1 or next(iter(arrays.values())).shape[0] != len(ids):
            shapes = ", ".join(f"{m} {tuple(a.shape)}" for m, a in arrays.items())
            raise DataError(f"{folder}: the modalities' arrays must all be ({len(ids)} samples, d), as "
                                   f"samples.json lists them: {shapes}")
        x = torch.stack(list(arrays.values()), 1)  # (N, M, d)
        if "acc" in info["metrics"] and meta.get("labels") is not None:
            classes = json.loads((root / dataset / "meta.json").read_text())["classes"]
            class_x, labels = _read_array(root / dataset, "classes"), _label_indices(meta["labels"], classes, folder)
    where = path if info["layout"] == "cmcl" else root / dataset / split
    if x.ndim != 3 or x.shape[0] != len(ids) or x.shape[1] != len(info["modalities"]):
        raise DataError(f"{where}: features of shape {tuple(x.shape)}, expected "
                               f"({len(ids)}, {len(info['modalities'])}, d)")
    if class_x is not None and class_x.shape[-1] != x.shape[-1]:
        raise DataError(f"{dataset}: class features of width {class_x.shape[-1]}, sample features of width "
                               f"{x.shape[-1]} ({where}); both must come from the same encoder")
    bad = int((~torch.isfinite(x)).flatten(1).any(1).sum())
    if bad:
        raise DataError(f"{where}: {bad} of {len(ids)} samples hold NaN or inf features (the file, not "
                               f"the training); re-extract them or drop those samples")
    return {"ids": ids, "x": x, "labels": labels, "classes": classes, "class_x": class_x, **info}


def write_h5(path, arrays: dict):
    """The code's FeatureStorage.save_features, one dataset per key (lab.synthetic_multimodal writes with it)."""
    import h5py
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            f.create_dataset(str(k), data=v.numpy())


# CMCL's step plan (training.py's datasets_name) and main table: (final Acc, BWT_A, final R@10, BWT_R@10) %
CMCL_STEPS = "ucf101~esc50~nyudv2:0,2~clotho~vggsound_s:0,1~vggsound_s:0,2~vggsound_s:1,2~tvl:0,2~tvl:1,2~tvl:0,1~llvip"
CMCL_PAPER = {"ImageBind vanilla": (47.32, -5.72, 38.56, -3.34), "ImageBind Co2L": (50.13, -3.74, 38.66, -1.77),
              "ImageBind DNS": (52.52, -0.02, 40.89, -1.07), "LanguageBind vanilla": (51.86, -15.71, 36.02, -10.19),
              "LanguageBind CILA": (59.30, -2.63, 40.48, -1.09), "LanguageBind DNS": (64.07, -0.09, 42.44, -3.00),
              "UniBind C-FLAT": (51.25, -4.36, 40.51, -1.48), "UniBind DNS": (52.86, 0.31, 41.44, -1.19)}
ABBREV = {"vision": "V", "text": "T", "audio": "A", "thermal": "TH", "depth": "D", "imu": "IM", "video": "VI",
          "tactile": "TA", "point": "P"}  # the code's ModalityTypeAbb


@dataclass(frozen=True)
class Step:  # a dataset and the two modalities it pairs: (i, j) indices into its modalities, their names
    dataset: str
    pair: tuple
    modalities: tuple

    @property
    def name(self) -> str:  # the code's naming: ucf101(T-VI)
        return f"{self.dataset}({'-'.join(ABBREV.get(m, m) for m in self.modalities)})"


def parse_steps(spec: str, modalities_of) -> list[Step]:
    """'cmcl' (CMCL_STEPS) or 'dataset[:i,j]~...' (the code's syntax); modalities_of(dataset) -> its names."""
    steps = []
    for part in filter(None, (p.strip() for p in (CMCL_STEPS if spec == "cmcl" else spec).split("~"))):
        name, _, idx = part.partition(":")
        mods = modalities_of(name)
        try:
            pair = tuple(int(i) for i in idx.split(",")) if idx else (0, 1)
        except ValueError:
            raise DataError(f"step {part!r}: expected dataset[:i,j] with integer modality indices") from None
        if len(pair) != 2 or pair[0] == pair[1] or not all(0 <= i < len(mods) for i in pair):
            raise DataError(f"step {part!r}: {name} has modalities {list(mods)}; give two distinct "
                                   f"indices in 0..{len(mods) - 1}")
        steps.append(Step(name, pair, (mods[pair[0]], mods[pair[1]])))
    if not steps:
        raise DataError(f"--tasks {spec!r}: no steps")
    return steps


# --- continual runs of linear maps over frozen features (dns.py) --------------
def read_cmcl_steps(root, spec: str, perceptor: str):
    """dns.py --features ROOT --tasks SPEC: the steps (parse_steps) and every train / test feature set they use
    (read_features), all of one width D. Returns (steps, {(dataset, split): features}, D)."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"--features {root}: no such folder")
    steps = parse_steps(spec, lambda d: dataset_info(root, d, perceptor)["modalities"])
    data = {(d, s): read_features(root, d, s, perceptor)
            for d in dict.fromkeys(st.dataset for st in steps) for s in ("train", "test")}
    dims = {v["x"].shape[2] for v in data.values()}
    if len(dims) != 1:
        raise DataError(f"features of different widths {sorted(dims)} under {root}")
    return steps, data, dims.pop()


def frozen_task_features(cfg, tasks, device, world=None) -> dict:
    """Every frozen feature a run of linear maps needs (dns.py; cfg: its DNSConfig), extracted once and cached:
    per task the train pairs and the test set, the per-task class prompts, the zero-shot sets."""
    if cfg.pretrained == "random":  # tests: random weights made a function of the seed, so caching them is sound
        torch.manual_seed(cfg.seed)
    model, _, preprocess, tok = models.load_model(cfg.backbone, cfg.pretrained, device=device, cache_dir=cfg.cache_dir,
                                                  world=world)
    model.eval()
    weights = (cfg.pretrained if cfg.pretrained != "random" else f"random-seed{cfg.seed}") or "default"
    if cfg.backbone == "tiny" and cfg.pretrained in ("", "synthetic"):
        weights = str(models.lab_world(world, "the tiny backbone's pretrained weights").tiny_weights())
    elif os.path.isfile(weights):
        weights += f"@{os.path.getsize(weights)}-{os.path.getmtime(weights)}"
    base = {"backbone": cfg.backbone, "weights": weights}
    cache = cfg.feature_cache or str(Path(cfg.out) / "features")

    def of_manifest(path, column):
        key = base | {"manifest": str(Path(path).resolve()), "column": column,
                      "sha256": content_sha256(path)}  # a file's bytes, a data folder's rows
        return cached(cache, key, lambda: manifest_features(model, preprocess, tok, path, column, device))

    column, task_clf = "", None
    if cfg.task_classes:
        classnames, templates, column = models.lab_world(world, "--task-classes").label_sets()[cfg.task_classes]
        task_clf = cached(cache, base | {"classes": classnames, "templates": templates},
                          lambda: common.zero_shot_classifier(model, tok, classnames, templates, device=device).cpu())
    def of_test(name):  # MTIL's test sets (protocols/mtil.py) are classification sets: their class prompts as txt
        if not is_classification(name):
            return of_manifest(name, column)
        key = base | {"classes": name, "root": str(Path(cfg.data_root).resolve())}
        return cached(cache, key, lambda: zscl_mtil.class_features(model, preprocess, tok, name, cfg.data_root, device))
    feats = {"tasks": [{"train": of_manifest(t.train, ""), "test": of_test(t.test)} for t in tasks],
             "task_clf": task_clf, "zeroshot": {}, "logit_scale": float(model.logit_scale.detach())}
    for name in filter(None, cfg.zero_shot.split(",")):
        def zero_shot_set(name=name):
            cs = load_classification(name, cfg.data_root)
            return {"img": image_features(model, preprocess, cs.image_paths, device=device),
                    "clf": common.zero_shot_classifier(model, tok, cs.classnames, cs.templates, device=device).cpu(),
                    "labels": cs.labels}
        feats["zeroshot"][name] = cached(cache, base | {"zeroshot": name, "root": str(Path(cfg.data_root).resolve())},
                                         zero_shot_set)
    return feats


@torch.no_grad()
def evaluate_maps(maps, tests, task_clf=None, zeroshot=None) -> dict:
    """dns.py's run_continual evaluate() (maps: its ModalityMaps): per task R@1 / R@10 both directions and their
    means R@1 / R@10, per-task classification 'acc' when every test set has labels; scalars: zero-shot top-1 per set.
    Everything through the maps (biases included with --bias); class-prompt features (D, C) through the text map."""
    W_img, W_txt, *biases = (w.float() for w in maps.snapshot())
    b_img, b_txt = biases if biases else (0.0, 0.0)
    map_img, map_txt = (lambda x: x @ W_img.t() + b_img), (lambda x: x @ W_txt.t() + b_txt)  # (N, D) -> (N, D)
    with_acc = task_clf is not None and all(f["labels"] is not None for f in tests)
    per_task = {}
    for f in tests:
        img, txt = map_img(f["img"]), map_txt(f["txt"])
        if f.get("classes"):  # a classification test set (MTIL): top-1 against its class prompts, through the maps
            acc = common.zero_shot_accuracy(img, txt.t(), f["labels"], ks=(1,))["top1"]
            per_task.setdefault("top1", []).append(acc)
            continue
        r = common.retrieval_metrics(img, txt, f["t2i"], ks=(1, 5, 10))
        r["R@1"], r["R@10"] = (0.5 * (r[f"i2t_R@{k}"] + r[f"t2i_R@{k}"]) for k in (1, 10))
        if with_acc:
            r["acc"] = common.zero_shot_accuracy(img, map_txt(task_clf.t()).t(), f["labels"], ks=(1,))["top1"]
        for k, v in r.items():
            per_task.setdefault(k, []).append(v)
    scalars = {f"{name}_top1": common.zero_shot_accuracy(map_img(z["img"]), map_txt(z["clf"].t()).t(),
                                                          z["labels"], ks=(1,))["top1"]
               for name, z in (zeroshot or {}).items()}
    return {"per_task": per_task, "scalars": scalars}


@torch.no_grad()
def evaluate_step(model, step: Step, test: dict, ks=(1, 5, 10), protocol: str = "full", seed: int = 0) -> dict:
    """One step's test set through the current maps (dns.py's ModalityMaps, model.map(modality, x)): R@k (%, mean of
    both directions, sample i's partner is sample i; 'A->B R@k', 'B->A R@k' each); 'acc' (top-1 %, the non-text
    modality against the text map of the class features) where the dataset has classes and the pair has text (the
    code's eval_util.eval); else NaN. protocol 'cmcl': R@k averaged over 5 random subsets of 1,000 samples (all when
    fewer), drawn from `seed`, as eval_util.eval does; 'full': the whole test set."""
    (a, b), (i, j) = step.modalities, step.pair
    x_a, x_b = model.map(a, test["x"][:, i].float()), model.map(b, test["x"][:, j].float())
    g = torch.Generator().manual_seed(seed)
    subsets = [torch.randperm(len(x_a), generator=g)[:1000] for _ in range(5)] if protocol == "cmcl" else [None]
    rs = [common.retrieval_metrics(x_a if s is None else x_a[s], x_b if s is None else x_b[s],
                                   torch.arange(len(x_b) if s is None else len(s)), ks=ks, name=step.name,
                                   sides=(a, b))
          for s in subsets]
    r = {key: sum(m[key] for m in rs) / len(rs) for key in rs[0]}
    row = {f"R@{k}": 0.5 * (r[f"i2t_R@{k}"] + r[f"t2i_R@{k}"]) for k in ks}
    row |= {f"{d} R@{k}": r[f"{x}_R@{k}"] for k in ks for d, x in (("A->B", "i2t"), ("B->A", "t2i"))}
    row["acc"] = float("nan")
    if test["labels"] is not None and "text" in (a, b):
        query = x_b if a == "text" else x_a
        classifier = model.map("text", test["class_x"].float()).t()  # (D, C)
        row["acc"] = common.zero_shot_accuracy(query, classifier, test["labels"], ks=(1,))["top1"]
    return row


def dns_results_row(name: str, results: dict) -> dict:
    """One row of dns_results_table: final and BWT of R@10 (and Acc), old-score drift, timing, zero-shot."""
    m, drift = results["continual"]["metrics"], results["drift"]
    row = {"method": name, "R@10": m["R@10"]["last"], "BWT_R@10": m["R@10"]["bwt"],
           "drift old (train)": (sum(drift["train"]) / len(drift["train"])) if drift["train"] else 0.0,
           "drift old (test)": (sum(drift["test"]) / len(drift["test"])) if drift["test"] else 0.0,
           "proj ms/step": results["timing"]["projection_ms_per_step"],
           "ms/step": 1e3 * results["timing"]["sec_per_step"]}
    if "acc" in m:
        row |= {"Acc": m["acc"]["last"], "Acc avg": m["acc"]["avg"], "BWT_A": m["acc"]["bwt"]}
    scalars = results["continual"]["scalars"]
    for k in scalars[-1]:  # zero-shot top-1: CLIP (identity maps) -> after the last task
        row[f"ZS {k.removeprefix('synthetic-').removesuffix('_top1')}"] = f"{scalars[0][k]:.1f} -> {scalars[-1][k]:.1f}"
    return row


def dns_results_table(named_results) -> str:
    """dns.py's table on CLIP features: [(name, results)] -> markdown."""
    rows = [dns_results_row(n, r) for n, r in named_results]
    for r in rows:  # drifts are small: scientific notation
        r.update({c: f"{r[c]:.1e}" for c in ("drift old (train)", "drift old (test)")})
    cols = list(dict.fromkeys(c for r in rows for c in r))
    first = ["method", "Acc", "Acc avg", "BWT_A", "R@10", "BWT_R@10"]
    cols = [c for c in first if c in cols] + [c for c in cols if c not in first]
    return markdown_table(rows, cols, floatfmt="{:.2f}")


def cmcl_row(results: dict) -> dict:
    """The CMCL table's row: final Acc / R@10, their BWT, the old tasks' test-score drift (mean, % relative);
    with R@1 and its BWT (the lab's demos) where the run has them."""
    m, drift = results["continual"]["metrics"], results["drift"]["test"]
    r1 = {"R@1": m["R@1"]["last"], "BWT_R@1": m["R@1"]["bwt"]} if "R@1" in m else {}
    return {"Acc": m["acc"]["last"], "BWT_A": m["acc"]["bwt"], **r1, "R@10": m["R@10"]["last"],
            "BWT_R@10": m["R@10"]["bwt"], "drift %": 100 * sum(drift) / max(1, len(drift))}


def cmcl_table(named_results) -> str:
    """dns.py's table in CMCL's setting: [(name, results)] -> markdown."""
    rows = [{"method": n} | cmcl_row(r) for n, r in named_results]
    return markdown_table(rows, ["method", "Acc", "BWT_A", "R@10", "BWT_R@10", "drift %"], floatfmt="{:.2f}")


# --- dns.py's drivers: its learner (dns.DNSLearner) over CLIP's tasks or CMCL's steps ---------------
def start(cfg):
    """One process (deviation 11), the device, the --out folder."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("dns.py trains D x D maps on cached features: run it as one process (deviation 11)")
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    return common.init_distributed(cfg.device)


def frozen_maps(old_rank: dict, dim: int) -> list:
    """The maps that could not move: dW = G - P_out G P_in is 0 when the old features span every direction on
    both sides (old rank dim of dim, out and in); old_rank: a task summary's {"<map>_out": k, "<map>_in": k}."""
    return sorted(m for m in {k.rsplit("_", 1)[0] for k in old_rank}
                  if old_rank.get(f"{m}_out", 0) >= dim and old_rank.get(f"{m}_in", 0) >= dim)


def say_frozen(summary: dict, dim: int, task: str) -> dict:
    """A line on stderr for each map the projector held fixed on `task` (issue 42.5: silent before)."""
    for m in frozen_maps((summary or {}).get("old_rank", {}), dim):
        print(f"[dns] {task}: {m} could not move (the projector keeps all {dim} directions of its old features on "
              f"both sides: old rank {dim} of {dim}); a larger --lambda-min (or --lambda-relative) leaves it "
              f"room", file=sys.stderr)
    return summary


def say_leak(summary: dict, task: str, mode: str) -> dict:
    """The task's line on Thm. 4's condition, measured (issue 57.5): ||P_out dW P_in|| / ||dW|| of each map's
    change over the task (dns.null_space_leak; the summary's null_space_leak), or why there is none."""
    leak = (summary or {}).get("null_space_leak")
    if leak is not None:
        maps = ", ".join(f"{k} {v:.1e}" for k, v in leak.items() if k not in ("max", "why"))
        print(f"[dns] {task} ({mode}): null-space leak ||P_out dW P_in|| / ||dW|| over the task: "
              + (f"max {leak['max']:.1e} ({maps})" if leak["max"] is not None else f"- ({leak['why']})"))
    return summary


def continual(cfg, learner, tasks, learn_task, evaluate) -> dict:
    """common.run_continual, the learner's state saved at task boundaries and read back weights-only; a line for
    each map a task's projector held fixed (say_frozen) and one on what the task's change leaked (say_leak)."""
    dim = next(learner.net.model.parameters()).shape[0]  # every map W_<m> is (D, D)

    def learn(i, task, *a):
        name = getattr(task, "name", str(task))
        return say_leak(say_frozen(learn_task(i, task, *a), dim, name), name, cfg.mode)
    return common.run_continual(
        Path(cfg.out), tasks, learn, evaluate,
        lambda path: atomic_write(path, lambda tmp: torch.save(learner.state_dict(), tmp)),
        lambda path: learner.load_state_dict(load_weights_only(path)), resume=bool(cfg.resume))


def run_clip(cfg, learner_class, score_drift, show: bool = True, world=None) -> dict:
    """dns.run: one continual run (one mode) on CLIP features of the --tasks manifests (learner_class:
    dns.DNSLearner, score_drift: dns.score_drift; world: the lab's, models.LabWorld)."""
    cfg = resolve_eval_sets(cfg)
    device, out = start(cfg), Path(cfg.out)
    tasks = common.parse_tasks(cfg.tasks, cfg.data_root, world)
    feats = frozen_task_features(cfg, tasks, device, world)
    learner = learner_class(feats["tasks"][0]["train"]["img"].shape[1], feats["logit_scale"], cfg.label_smoothing,
                            cfg.loss, cfg.bias)

    pairs = lambda f: (f["img"][f["t2i"]], f["txt"])  # noqa: E731  unique-image features -> a pair per caption

    def learn_task(i, task, task_out, resume):
        return learner.learn(cfg, *pairs(feats["tasks"][i]["train"]), task_out, resume)

    summary = continual(cfg, learner, tasks, learn_task, lambda: evaluate_maps(
        learner.net.model, [f["test"] for f in feats["tasks"]], feats["task_clf"], feats["zeroshot"]))
    # stability, measured: each old task's scores right after it vs at the end
    drift = {"train": [], "test": []}
    for j in range(len(tasks) - 1):
        f = feats["tasks"][j]
        drift["train"].append(score_drift(*pairs(f["train"]), learner.history[j], learner.history[-1]))
        drift["test"].append(score_drift(f["test"]["img"], f["test"]["txt"], learner.history[j], learner.history[-1]))
    steps = sum(s["steps"] for s in learner.summaries)
    timing = {"sec_per_step": sum(s["train_seconds"] for s in learner.summaries) / max(1, steps),
              "projection_ms_per_step": 1e3 * sum(s["projection_seconds"] for s in learner.summaries)
              / max(1, sum(s["steps"] for s in learner.summaries if s["old_rank"])),  # over projected steps
              "projector_build_seconds": sum(s["projector_build_seconds"] for s in learner.summaries)}
    results = of_sequence(getattr(learner, "name", "dns"), summary, tasks, drift=drift, timing=timing,
                          tasks=learner.summaries)
    common.write_results(out, results, cfg)  # plumbing.results' schema, the settings
    if show:  # the user's numbers (42.3), R[i][j] per metric as cclip.py prints them (42.4), the method's row
        print(sequence_table(summary, tasks))
        matrices = continual_tables(summary, [t.name for t in tasks])
        print(f"\n## {cfg.mode}: R[i][j] on each task's test set\n\n{matrices}\n")
        if "mtil" in summary:  # ZSCL's Transfer / Average / Last in place of the retrieval row
            zscl_mtil.report(f"dns {cfg.mode}", summary, tasks, cfg.backbone)
        else:
            print(dns_results_table([(cfg.mode, results)]))
    return results


# CMCL's own setting: M modalities, modality-pair steps, features from files
CMCL_METRICS = tuple(f"{d} R@{k}" for d in ("A->B", "B->A") for k in (1, 5, 10)) + ("acc",)  # 42.3's table
NO_ACC = {"acc": "no accuracy: the step's dataset has no classes, or its pair no text side (as CMCL's eval_util)"}


def run_steps(cfg, learner_class, score_drift, show: bool = True) -> dict:
    """dns.run_cmcl: DNS on CMCL's step sequence from cached features (--features); learner_class:
    dns.DNSLearner, score_drift: dns.score_drift."""
    root = Path(cfg.features)
    spec = "cmcl" if cfg.tasks in ("auto", "synthetic") else cfg.tasks  # --tasks left at its default: the code's steps
    steps, data, dim = read_cmcl_steps(root, spec, cfg.perceptor)
    start(cfg)
    modalities = list(dict.fromkeys(m for st in steps for m in st.modalities))
    learner = learner_class(dim, math.log(1 / 0.07), cfg.label_smoothing, cfg.loss, cfg.bias, modalities)
    tasks = [common.Task(st.name, str(root / st.dataset), str(root / st.dataset)) for st in steps]
    if len({t.name for t in tasks}) != len(tasks):
        raise DataError("every step must pair a different dataset / modality pair")

    def learn_task(k, task, task_out, resume):
        st, x = steps[k], data[(steps[k].dataset, "train")]["x"]
        return learner.learn(cfg, x[:, st.pair[0]], x[:, st.pair[1]], task_out, resume, pair=st.modalities,
                             cov_x=(x[:, 0], x[:, 1]))

    def evaluate():
        rows = [evaluate_step(learner.net.model, st, data[(st.dataset, "test")], protocol=cfg.recall_protocol,
                              seed=cfg.seed) for st in steps]
        return {"per_task": {k: [r[k] for r in rows] for k in rows[0]}, "scalars": {}}

    summary = continual(cfg, learner, tasks, learn_task, evaluate)
    if "stopped_at" in summary:
        return summary
    summary["metrics"] = {k: masked_continual_metrics(R) for k, R in summary["matrices"].items()}
    drift = []  # each old step's test scores: right after it vs at the end
    for k, st in enumerate(steps[:-1]):
        x = data[(st.dataset, "test")]["x"]
        maps = [learner.net.model.pair_maps(h, *st.modalities) for h in (learner.history[k], learner.history[-1])]
        drift.append(score_drift(x[:, st.pair[0]], x[:, st.pair[1]], *maps))  # before, after
    results = of_sequence(getattr(learner, "name", "dns"), summary, tasks, NO_ACC, steps=[st.name for st in steps],
                          drift={"test": drift}, tasks=learner.summaries)
    common.write_results(cfg.out, results, cfg)  # plumbing.results' schema, the settings
    if show:  # the user's numbers (42.3), R[i][j] per metric as cclip.py prints them (42.4), CMCL's row
        print(sequence_table(summary, tasks, CMCL_METRICS))
        names = [st.name for st in steps]
        print(f"\n## {cfg.mode}: R[i][j] on each step's test set\n\n{continual_tables(summary, names)}\n")
        print(cmcl_table([(cfg.mode, results)]))
    return results


def resolve_eval_sets(cfg):
    """--task-classes / --zero-shot auto: the lab's sets only when the lab is the data (--tasks synthetic), else none:
    the tiny backbone on a user's own tasks is not evaluated on the lab's synthetic sets."""
    synthetic = cfg.tasks == "synthetic"
    return dataclasses.replace(
        cfg, task_classes=("shape" if synthetic else "") if cfg.task_classes == "auto" else cfg.task_classes,
        zero_shot=("synthetic-shape,synthetic-color" if synthetic else "") if cfg.zero_shot == "auto"
        else cfg.zero_shot)


def resolve(cfg):
    """--tasks auto (the paper's data has no layout here: synthetic with --backbone tiny), then the eval sets."""
    return resolve_eval_sets(common.resolve_auto(cfg, "tasks", None, [], "ImageBind's seven datasets"))
