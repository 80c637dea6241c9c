"""CLIP_benchmark's result files (LAION-AI/CLIP_benchmark, cli.py) from eval.py's records: one JSON per (dataset,
task) in its schema and file names, so `clip_benchmark build *.json` tabulates our runs beside theirs. Moved out of
eval.py (issue 61) unchanged; eval.clip_benchmark_files passes eval's is_classification in. Standard library only."""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

# CLIP_benchmark's (LAION-AI/CLIP_benchmark, cli.py) result files: one JSON per (dataset, task), fractions, its names
CLIP_BENCHMARK_DATASETS = {"coco-karpathy": "mscoco_captions", "flickr30k": "flickr30k", "cifar10": "cifar10",
                           "cifar100": "cifar100", "imagenet": "imagenet1k"}  # the same splits under its names


def clip_benchmark_files(records, model: str, pretrained: str, is_classification) -> dict:
    """{file name: content} of CLIP_benchmark's schema {dataset, model, pretrained, task, metrics, language} and
    file names ({dataset}_{pretrained}_{model}_{language}_{task}.json), so `clip_benchmark build *.json` tabulates
    our runs beside theirs. Its image_retrieval_recall@K is our t2i_R@K, text_retrieval_recall@K our i2t_R@K;
    acc1 / acc5 / mean_per_class_recall our top1 / top5 / mean_per_class_recall; every value a fraction. Tasks
    without a CLIP_benchmark name keep ours (a manifest: its file name); SIMAT and the analyses are left out.
    is_classification(task) -> bool: eval.py's."""
    out, slug = {}, os.path.basename(pretrained) if os.path.isfile(pretrained) else (pretrained or "default")
    for task in dict.fromkeys(r["task"] for r in records):
        if task == "simat":
            continue
        value = {r["metric"]: r["value"] / 100.0 for r in records
                 if r["task"] == task and r.get("text_mode") in ("truncate", "prompt-ensemble")}
        if is_classification(task):
            kind, metrics = "zeroshot_classification", {"acc1": value.get("top1"), "acc5": value.get("top5"),
                                                        "mean_per_class_recall": value.get("mean_per_class_recall")}
        else:
            ks = sorted(int(m.split("@")[1]) for m in value if m.startswith("t2i_R@"))
            kind, metrics = "zeroshot_retrieval", {
                **{f"image_retrieval_recall@{k}": value[f"t2i_R@{k}"] for k in ks},
                **{f"text_retrieval_recall@{k}": value[f"i2t_R@{k}"] for k in ks}}
        dataset = CLIP_BENCHMARK_DATASETS.get(task, Path(task).stem if Path(task).suffix else task)
        tag = dataset if task in CLIP_BENCHMARK_DATASETS else (  # ours: unique per task path (two test.jsonl)
            f"{dataset}-{hashlib.sha256(task.encode()).hexdigest()[:8]}")
        out[re.sub(r"[^A-Za-z0-9._-]", "_", f"{tag}_{slug}_{model}_en_{kind}.json")] = {  # safe on any file system
            "dataset": dataset, "model": model, "pretrained": pretrained or "default", "task": kind,
            "metrics": metrics, "language": "en"}
    return out
