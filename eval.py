"""Evaluation suite shared by every method (core; benchmark loaders grow here).

Importable API (used by the method files and tests):
  load_retrieval(name, root) -> RetrievalSet(image_paths, texts, text_to_image, ...)
  load_classification(name, root) -> ClassificationSet(image_paths, labels, classnames, templates)
  evaluate(model, preprocess, tokenizer, tasks, data_root, text_mode, ...) -> list of records
  results_table(records) -> markdown

Run: python eval.py --backbone tiny --tasks synthetic-short,synthetic-long,synthetic-shape
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image

import common


# =============================================================================
# Data sets
# =============================================================================
@dataclass
class RetrievalSet:
    name: str
    image_paths: list
    texts: list
    text_to_image: torch.Tensor  # (M,) long: image index of text j
    protocol: str = ""
    missing: int = 0  # images listed by the benchmark but absent on disk


@dataclass
class ClassificationSet:
    name: str
    image_paths: list
    labels: torch.Tensor  # (N,) long
    classnames: list
    templates: list
    protocol: str = ""
    missing: int = 0


def _synthetic_retrieval(split: str, root, column: str) -> RetrievalSet:
    ds = common.ManifestDataset(common.synthetic_manifest(split, root), need_long=True, check_images=False)
    paths = [str(ds.image_file(r)) for r in ds.rows]
    texts = [r[column] for r in ds.rows]
    return RetrievalSet(f"synthetic-{split}-{column}", paths, texts, torch.arange(len(paths)),
                        protocol=f"synthetic world, split {split}, 1:1, {column}")


def synthetic_tasks():
    """Evaluation task names of the synthetic world -> loader."""
    tasks = {
        "synthetic-short": lambda root: _synthetic_retrieval("test", root, "caption"),
        "synthetic-long": lambda root: _synthetic_retrieval("test", root, "long_caption"),
        "synthetic-unseen": lambda root: _synthetic_retrieval("unseen", root, "caption"),
        "synthetic-unseen-long": lambda root: _synthetic_retrieval("unseen", root, "long_caption"),
    }
    for d in common.PRETRAIN_DOMAINS[:4]:
        tasks[f"synthetic-task-{d}"] = (lambda d: lambda root: _synthetic_retrieval(f"task-{d}-test", root,
                                                                                     "caption"))(d)
    return tasks


RETRIEVAL_TASKS = synthetic_tasks()


def manifest_retrieval(path, column="caption") -> RetrievalSet:
    """Any user manifest (JSONL/CSV): one text per row; rows that share an
    image path share the image."""
    ds = common.ManifestDataset(path, check_images=False)
    index, paths, t2i, texts = {}, [], [], []
    for r in ds.rows:
        p = str(ds.image_file(r))
        if p not in index:
            index[p] = len(paths)
            paths.append(p)
        t2i.append(index[p])
        texts.append(r[column] if column in r else ds._caption(r))
    return RetrievalSet(Path(path).stem, paths, texts, torch.tensor(t2i), protocol=f"manifest {path}")


def load_retrieval(name: str, root="data") -> RetrievalSet:
    if name in RETRIEVAL_TASKS:
        return RETRIEVAL_TASKS[name](root)
    if name.endswith((".jsonl", ".csv", ".tsv")):
        return manifest_retrieval(name)
    raise ValueError(f"unknown retrieval task {name!r}; known: {', '.join(RETRIEVAL_TASKS)}")


def load_classification(name: str, root="data") -> ClassificationSet:
    sets = common.synthetic_label_sets()
    if name.startswith("synthetic-") and name.removeprefix("synthetic-") in sets:
        classnames, templates, column = sets[name.removeprefix("synthetic-")]
        ds = common.ManifestDataset(common.synthetic_manifest("test", root), check_images=False, extra=(column,))
        return ClassificationSet(name, [str(ds.image_file(r)) for r in ds.rows],
                                 torch.tensor([int(r[column]) for r in ds.rows]), classnames, templates,
                                 protocol="synthetic world, test split, main object")
    raise ValueError(f"unknown classification task {name!r}; known: "
                     f"{', '.join('synthetic-' + k for k in sets)}")


CLASSIFICATION_TASKS = tuple("synthetic-" + k for k in common.synthetic_label_sets())


# =============================================================================
# Features
# =============================================================================
class _Images(torch.utils.data.Dataset):
    def __init__(self, paths, transform):
        self.paths, self.transform = paths, transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        with Image.open(self.paths[i]) as im:
            return self.transform(im.convert("RGB"))


@torch.no_grad()
def image_features(model, preprocess, paths, batch_size=256, workers=0, device=None):
    device = device or next(model.parameters()).device
    loader = torch.utils.data.DataLoader(_Images(paths, preprocess), batch_size=batch_size, num_workers=workers,
                                         pin_memory=str(device).startswith("cuda"))
    feats = []
    for x in loader:
        with common.autocast(device):
            feats.append(model.encode_image(x.to(device, non_blocking=True), normalize=True).float().cpu())
    return torch.cat(feats)


def text_features(model, tokenizer, texts, text_mode="truncate", device=None):
    """truncate: the papers' protocol (cut at the context, end token kept).
    sentence-mean: each sentence encoded within the window, normalised
    embeddings averaged, renormalised."""
    if text_mode == "truncate":
        return common.encode_texts(model, tokenizer, texts, device=device)
    if text_mode == "sentence-mean":
        from erclip import split_sentences  # the same splitter ERCLIP trains with
        sents, owner = [], []
        for i, t in enumerate(texts):
            s = split_sentences(t) or [t]
            sents += s
            owner += [i] * len(s)
        f = common.encode_texts(model, tokenizer, sents, device=device)
        out = torch.zeros(len(texts), f.shape[1]).index_add_(0, torch.tensor(owner), f)
        return torch.nn.functional.normalize(out, dim=-1)
    raise ValueError(f"unknown text mode {text_mode!r}")


# =============================================================================
# Evaluate
# =============================================================================
def evaluate(model, preprocess, tokenizer, tasks, data_root="data", text_mode="truncate", batch_size=256,
             device=None, model_name="", weights=""):
    """Evaluates `model` on each task; one record per (task, metric)."""
    model.eval()
    records = []
    for name in tasks:
        if name in CLASSIFICATION_TASKS:
            cs = load_classification(name, data_root)
            img = image_features(model, preprocess, cs.image_paths, batch_size, device=device)
            clf = common.zero_shot_classifier(model, tokenizer, cs.classnames, cs.templates, device=device)
            res = common.zero_shot_accuracy(img.to(clf.device), clf, cs.labels)
            protocol, missing = cs.protocol, cs.missing
        else:
            rs = load_retrieval(name, data_root)
            img = image_features(model, preprocess, rs.image_paths, batch_size, device=device)
            txt = text_features(model, tokenizer, rs.texts, text_mode, device=device)
            res = common.retrieval_metrics(img, txt, rs.text_to_image)
            protocol, missing = rs.protocol, rs.missing
        for metric, value in res.items():
            records.append({"task": name, "metric": metric, "value": value, "protocol": protocol,
                            "text_mode": text_mode, "missing": missing, "model": model_name, "weights": weights})
    return records


def results_table(records, metrics=("i2t_R@1", "t2i_R@1", "top1")) -> str:
    rows = {}
    for r in records:
        if r["metric"] in metrics:
            rows.setdefault(r["task"], {"task": r["task"]})[r["metric"]] = r["value"]
    return common.markdown_table(list(rows.values()), ["task", *metrics])


def main(argv=None):
    all_tasks = [*RETRIEVAL_TASKS, *CLASSIFICATION_TASKS]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="tasks: " + ", ".join(all_tasks))
    p.add_argument("--backbone", default="tiny")
    p.add_argument("--pretrained", default="")
    p.add_argument("--tasks", default="synthetic-short,synthetic-long,synthetic-shape,synthetic-color")
    p.add_argument("--data-root", default="data")
    p.add_argument("--text-mode", default="truncate", choices=("truncate", "sentence-mean"))
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    device = common.init_distributed(a.device)
    model, _, preprocess, tok = common.load_model(a.backbone, a.pretrained, device=device)
    records = evaluate(model, preprocess, tok, a.tasks.split(","), a.data_root, a.text_mode,
                       model_name=a.backbone, weights=a.pretrained or "default")
    print(results_table(records))
    if a.out:
        common.write_results(a.out, {"records": records})
    return records


if __name__ == "__main__":
    main()
