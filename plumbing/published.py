"""The papers' published numbers, the one home of every number a table puts beside ours, and the pure-Python
layout of ERCLIP's Tables 1-2 and m2-Mix's Tables 1 / 3 with `m2mix.py --collect` (standard library only: no torch,
no common, so --collect answers before torch loads). eval.py's published_numbers() picks a paper's CLIP row."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from plumbing.base import DataError, UsageError, atomic_write, markdown_table
from plumbing.results import read

# ERCLIP (Le, Tran, Nguyen, Zhou, Gurrin, arXiv:2610.29939), Table 1: R@1 (%)
# on the four long-caption sets as (I2T, T2I) pairs, keyed by (ViT, model).
ERCLIP_LONG_SETS = ("urban1k", "sharegpt4v-1k", "docci", "long-dci")
ERCLIP_TABLE1 = {
    ("B/32", "CLIP"): (61.20, 46.60, 83.30, 77.10, 58.04, 53.40, 34.79, 30.60),
    ("B/32", "M"): (61.40, 65.40, 83.70, 81.00, 58.66, 60.24, 38.54, 39.88),
    ("B/32", "M+P"): (62.30, 66.40, 84.00, 82.60, 59.58, 61.58, 39.65, 40.94),
    ("B/32", "RT+P"): (62.50, 65.40, 84.70, 82.00, 58.78, 61.22, 38.92, 40.61),
    ("B/16", "CLIP"): (67.50, 53.30, 84.50, 79.60, 60.76, 57.10, 36.91, 33.73),
    ("B/16", "M"): (69.30, 75.10, 86.30, 83.10, 63.20, 67.48, 41.86, 44.76),
    ("B/16", "M+P"): (68.60, 75.70, 87.50, 85.30, 63.24, 67.16, 41.57, 45.34),
    ("B/16", "RT+P"): (69.30, 73.40, 87.80, 85.70, 62.84, 67.24, 41.90, 45.51),
    ("L/14", "CLIP"): (68.20, 56.00, 84.20, 83.50, 65.70, 63.16, 36.98, 35.06),
    ("L/14", "M"): (78.30, 81.30, 89.00, 88.00, 71.62, 75.28, 47.59, 51.12),
    ("L/14", "M+P"): (76.40, 79.90, 89.50, 89.30, 72.14, 74.02, 48.46, 51.10),
    ("L/14", "RT+P"): (75.40, 80.00, 90.40, 89.70, 71.82, 73.54, 47.91, 51.17),
}
# ERCLIP Table 2: long avg I2T, T2I; COCO val2017 5k I2T, T2I R@1; zero-shot top-1 C10, C100, IN.
ERCLIP_TABLE2 = {
    ("B/32", "CLIP"): (59.33, 51.93, 50.00, 30.37, 89.76, 64.31, 63.34),
    ("B/32", "v1 LSTM"): (45.99, 44.23, 45.94, 34.32, 86.42, 56.60, 49.48),
    ("B/32", "v1 Transformer"): (60.33, 62.32, 53.34, 39.31, 88.13, 64.89, 58.04),
    ("B/32", "M"): (60.57, 61.63, 54.40, 39.16, 87.75, 62.45, 57.51),
    ("B/32", "M+P"): (61.38, 62.88, 56.40, 39.74, 87.51, 63.42, 59.64),
    ("B/32", "RT+P"): (61.22, 62.31, 55.46, 39.68, 86.49, 63.66, 59.43),
    ("B/16", "CLIP"): (62.42, 55.93, 51.72, 32.66, 90.81, 67.22, 68.35),
    ("B/16", "v1 LSTM"): (51.27, 51.17, 50.68, 38.38, 85.51, 59.87, 54.09),
    ("B/16", "v1 Transformer"): (65.94, 67.68, 59.98, 44.46, 89.22, 67.66, 62.57),
    ("B/16", "M"): (65.17, 67.61, 59.00, 44.28, 91.61, 67.92, 62.30),
    ("B/16", "M+P"): (65.23, 68.38, 61.36, 44.51, 91.83, 68.73, 64.09),
    ("B/16", "RT+P"): (65.46, 67.96, 61.34, 44.36, 89.34, 68.02, 64.15),
    ("L/14", "CLIP"): (63.77, 59.43, 56.10, 35.33, 95.70, 76.44, 75.53),
    ("L/14", "v1 LSTM"): (57.34, 59.34, 55.40, 44.53, 93.60, 74.34, 63.13),
    ("L/14", "v1 Transformer"): (70.94, 73.91, 65.62, 50.35, 94.86, 77.02, 72.30),
    ("L/14", "M"): (71.63, 73.92, 65.24, 50.55, 94.64, 76.94, 71.76),
    ("L/14", "M+P"): (71.62, 73.58, 66.58, 49.95, 95.37, 78.29, 73.36),
    ("L/14", "RT+P"): (71.38, 73.60, 66.36, 49.96, 95.92, 78.83, 73.26),
}
# m2-Mix (Oh et al., NeurIPS 2023, arXiv:2203.03897), ViT-B/32, our task -> model -> metric: Table 1 (retrieval; one
# caption per image, COCO = val2017; no m2-Mix row), Table 2 (ECE, Flickr30k), Fig. 2 (align, unif; Flickr30k).
M2MIX_TABLE1 = {
    "flickr30k-1cap": {
        "ZS": {"i2t_R@1": 71.1, "i2t_R@5": 90.4, "t2i_R@1": 68.5, "t2i_R@5": 88.9,
               "align": 0.04, "unif": 1.98, "ece_i2t": 1.90, "ece_t2i": 1.88},
        "FT": {"i2t_R@1": 81.2, "i2t_R@5": 95.4, "t2i_R@1": 80.70, "t2i_R@5": 95.8,
               "align": 0.07, "unif": 1.97, "ece_i2t": 2.26, "ece_t2i": 2.00},
        "m2-Mix": {"align": 0.17, "unif": 3.71, "ece_i2t": 1.52, "ece_t2i": 2.18},
        "m3-Mix": {"i2t_R@1": 82.1, "i2t_R@5": 96.8, "t2i_R@1": 81.9, "t2i_R@5": 95.9,
                   "ece_i2t": 1.54, "ece_t2i": 1.58},
    },
    "coco-1cap": {
        "ZS": {"i2t_R@1": 31.93, "i2t_R@5": 56.87, "t2i_R@1": 28.54, "t2i_R@5": 53.12},
        "FT": {"i2t_R@1": 36.65, "i2t_R@5": 63.60, "t2i_R@1": 36.85, "t2i_R@5": 63.88},
        "m3-Mix": {"i2t_R@1": 37.99, "i2t_R@5": 66.47, "t2i_R@1": 39.94, "t2i_R@5": 67.80},
    },
}
# Table 1's other rows (issue 60): FT at a fixed temperature (m2mix.py --method ft --base-tau T) and the baselines
# i-Mix, Un-Mix (python -m baselines.imix | baselines.unmix); (i2t R@1, R@5, t2i R@1, R@5), Flickr30k then COCO
for _name, _f30k, _coco in (("FT(tau=0.05)", (81.2, 95.3, 80.62, 95.5), (32.04, 60.18, 33.4, 61.3)),
                            ("FT(tau=0.1)", (71.2, 93.5, 75.5, 92.2), (25.23, 53.51, 27.52, 53.9)),
                            ("i-Mix", (78.2, 95.0, 77.4, 94.4), (19.84, 43.86, 19.76, 44.32)),
                            ("Un-Mix", (77.6, 95.2, 76.6, 94.2), (36.69, 64.07, 37.0, 64.36))):
    for _task, _row in (("flickr30k-1cap", _f30k), ("coco-1cap", _coco)):
        M2MIX_TABLE1[_task][_name] = dict(zip(("i2t_R@1", "i2t_R@5", "t2i_R@1", "t2i_R@5"), _row))
M2MIX_SIMAT_ZS = 34.4  # m2-Mix Table 5, ZS, CLIP (Flickr30k column); we assume the code's protocol (E5)
M2MIX_TABLE1_METRICS = ("i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10",  # R@10: ours (Table 1
                        "align", "unif", "ece_i2t", "ece_t2i")  # stops at R@5; issue 42.3)
# m2-Mix Table 3 (BERT + ResNet-50 fine-tuned on Flickr30k; i2t / t2i R@1, R@5, R@10) and Table 5's BERT + ResNet-50
# column (SIMAT); rows FT(tau=...) are FT at a fixed temperature, i-Mix and Un-Mix: baselines/ (issue 60)
M2MIX_TABLE3_METRICS = ("i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10", "simat")
M2MIX_TABLE3 = {"flickr30k-1cap": {name: dict(zip(M2MIX_TABLE3_METRICS, row)) for name, row in {
    "ZS": (0.1, 0.4, 0.9, 0.1, 0.2, 0.9, 6.1), "FT": (17.8, 46.0, 59.1, 17.3, 46.0, 59.2, 15.4),
    "FT(tau=0.05)": (17.8, 43.2, 59.8, 18.8, 45.7, 58.8, 15.9),
    "FT(tau=0.1)": (14.1, 36.2, 51.6, 13.8, 38.3, 50.9, 15.2),
    "i-Mix": (14.2, 40.4, 56.4, 17.9, 42.9, 56.6, 12.9), "Un-Mix": (18.7, 46.6, 60.2, 19.3, 47.8, 62.2, 15.8),
    "m3-Mix": (19.5, 49.0, 63.8, 21.6, 49.7, 63.6, 16.2)}.items()}}

# m2-Mix Table 4 (CMU-MOSEI, mean of five runs): accuracy (%), alignment and uniformity per observed subset; Full has
# no alignment; MulT has none (gmc.py)
M2MIX_TABLE4 = {name: dict(zip(["Full acc", "Full unif"] + [f"{s} {m}" for s in ("T", "V", "A", "T+V", "T+A", "V+A")
                                                            for m in ("acc", "align", "unif")], row)) for name, row in {
    "MulT": (80.5, 0.99, 60.0, None, 1.03, 53.9, None, 2.07, 52.7, None, 0.62, 57.8, None, 1.27, 58.8, None, 0.77,
             54.6, None, 1.36),
    "GMC": (80.1, 3.06, 78.5, 0.20, 3.03, 64.7, 0.17, 3.01, 66.0, 0.09, 3.03, 77.0, 0.07, 2.94, 77.4, 0.08, 3.00,
            67.3, 0.05, 2.98),
    "GMC+m2-Mix": (80.5, 3.18, 78.9, 0.23, 3.17, 64.2, 0.19, 3.15, 66.2, 0.12, 3.15, 77.8, 0.08, 3.08, 77.9, 0.09,
                   3.08, 67.4, 0.06, 3.10)}.items()}



def _erclip_clip_rows() -> dict:
    """ERCLIP's 'CLIP' rows of Tables 1-2 as {'ViT-B/32': {(task, metric): value}}."""
    out = {}
    for (vit, name), t1 in ERCLIP_TABLE1.items():
        if name == "CLIP":
            t2, row = ERCLIP_TABLE2[(vit, name)], {}
            for k, task in enumerate(ERCLIP_LONG_SETS):
                row[(task, "i2t_R@1")], row[(task, "t2i_R@1")] = t1[2 * k], t1[2 * k + 1]
            row[("coco", "i2t_R@1")], row[("coco", "t2i_R@1")] = t2[2], t2[3]
            row.update({(task, "top1"): v for task, v in zip(("cifar10", "cifar100", "imagenet"), t2[4:])})
            out[f"ViT-{vit}"] = row
    return out


# Published CLIP numbers (pretrained, no fine-tuning) whose protocol matches one of our tasks: paper -> backbone ->
# {(task, metric): value}.
PUBLISHED = {
    # ERCLIP Tab. 1-2, rows "CLIP": COCO = val2017 5k, first 5 captions per image (Long-CLIP's
    # protocol, our task 'coco'); long-caption sets truncated at the context
    "erclip": _erclip_clip_rows(),
    # m2-Mix Tab. 1 (ZS), Tab. 2 (ECE, ZS), Fig. 2a (align, unif), Tab. 5 (SIMAT, ZS); ViT-B/32
    "m2mix": {"ViT-B/32": {**{(task, metric): v for task, models in M2MIX_TABLE1.items()
                              for metric, v in models["ZS"].items()},
                           ("simat", "simat"): M2MIX_SIMAT_ZS},
              "bert-resnet50": {("simat" if m == "simat" else "flickr30k-1cap", m): v
                                for m, v in M2MIX_TABLE3["flickr30k-1cap"]["ZS"].items()}},
    "cclip": {"ViT-B/16": {("imagenet", "top1"): 67.73}},  # C-CLIP (ICLR 2025) Sec. 5: pretrained, zero-shot ImageNet
    "clip": {  # OpenAI weights, standard protocols: the result tables of open_clip and CLIP_benchmark
        #        (github.com/mlfoundations/open_clip, github.com/LAION-AI/CLIP_benchmark)
        "ViT-B/16": {("coco-karpathy", "i2t_R@1"): 52.4, ("coco-karpathy", "t2i_R@1"): 33.1,
                     ("flickr30k", "i2t_R@1"): 82.2, ("flickr30k", "t2i_R@1"): 62.2,
                     ("imagenet", "top1"): 68.3, ("cifar10", "top1"): 90.8, ("cifar100", "top1"): 66.9},
        "ViT-L/14": {("coco-karpathy", "i2t_R@1"): 56.3, ("coco-karpathy", "t2i_R@1"): 36.5,
                     ("flickr30k", "i2t_R@1"): 85.2, ("flickr30k", "t2i_R@1"): 65.0,
                     ("imagenet", "top1"): 75.5, ("cifar10", "top1"): 95.7, ("cifar100", "top1"): 76.1},
    },
}
# C-CLIP Sec. 5: zero-shot ImageNet top-1 (%) of ViT-B/16 after two tasks, approximate ("~") as the text gives them,
# C-CLIP vs full fine-tuning (pretrained: PUBLISHED["cclip"]); the paper column of lab/demos/cclip.py's zero-shot claim
CCLIP_IMAGENET_AFTER_2_TASKS = {"C-CLIP": 65.1, "full FT": 25.0}



# --- ERCLIP's Tables 1-2 layout (erclip.py, longclip.py, the ERCLIP sweeps), written once ---
ERCLIP_EVAL_TASKS = (*ERCLIP_LONG_SETS, "coco", "cifar10", "cifar100", "imagenet")  # ERCLIP Sec. 4
ERCLIP_SYNTHETIC_TASKS = ("synthetic-long", "synthetic-short", "synthetic-shape", "synthetic-color")  # the lab's
PUBLISHED_LONGCLIP = {"ViT-B/16": (79.30, 79.40, 94.60, 93.40, 63.18, 71.50, 42.20, 48.46),  # ERCLIP Tab. 1, grey
                      "ViT-L/14": (82.50, 86.10, 97.20, 97.30, 66.58, 78.56, 46.53, 54.28)}  # rows: ~1M pairs, 248 tok
# ERCLIP Sec. 4.4's points (backbone not stated; R@1: mean of I2T, T2I); Sec. 4.3's epoch 1 -> 5 ranges (Fig. 3: none)
ERCLIP_LAMBDA_IN = {0.0: 58.2, 2.0: 60.8}
ERCLIP_DATA = {1000: {"long": 56.3, "COCO": 40.8, "IN": 63.5}, 10000: {"long": 61.9}, 50000: {"COCO": 49.3, "IN": 59.7}}
ERCLIP_EPOCH_CHANGE = {"Long avg": "-0.4 to -1.2 (every variant)", "COCO": "+0.5 to +1.2 (B/32, B/16); flat (L/14)",
                       "C10": "-1.2 to -1.8 without P; -0.5 with P (B/32)"}


def vit_key(backbone: str) -> str:  # 'ViT-B/16', 'ViT-B-16' -> 'B/16', the key of ERCLIP's tables
    return "/".join(m.groups()) if (m := re.search(r"([BLH])[-/](\d+)", backbone)) else backbone


def erclip_cols(window: bool = False) -> tuple[list, list]:  # Tables 1, 2; window: a 'window' column (longclip.py)
    t1 = [f"{s} {d}" for s in ("Urban1K", "ShareGPT4V", "DOCCI", "Long-DCI", "Avg") for d in ("I2T", "T2I")]
    t2 = ["L_pres", "Long avg I2T", "Long avg T2I", "COCO I2T", "COCO T2I", "C10", "C100", "IN"]
    return tuple(["model", "ViT", *["window"] * window, *c] for c in (t1, t2))


def erclip_rows(records, name, vit, pres="-", window=None) -> tuple[dict, dict]:
    """Our rows of ERCLIP's Tables 1, 2; window: the text window read (a column; windowless records match any)."""
    def value(task, metric):
        return next((r["value"] for r in records if r["task"] == task and r["metric"] == metric
                     and (window is None or r.get("window") in (None, window))), None)
    t1 = [value(t, m) for t in ERCLIP_LONG_SETS for m in ("i2t_R@1", "t2i_R@1")]
    avg = [sum(v) / len(v) if None not in v else None for v in (t1[0::2], t1[1::2])]
    t2 = [*avg, value("coco", "i2t_R@1"), value("coco", "t2i_R@1"), *(value(t, "top1") for t in ERCLIP_EVAL_TASKS[-3:])]
    (c1, c2), w = erclip_cols(window is not None), [] if window is None else [window]
    return dict(zip(c1, [name, vit, *w, *t1, *avg])), dict(zip(c2, [name, vit, *w, pres, *t2]))


def m2mix_table1(records, paper_tables=None, metrics=M2MIX_TABLE1_METRICS) -> str:
    """m2-Mix's Table 1 layout (ZS, FT, FT(tau), m2-Mix, m3-Mix: m2mix.py's runs; i-Mix, Un-Mix: baselines/), per
    task, with align / unif / ECE; a
    cell reads "ours (paper)" where the paper reports the same protocol, "- (paper)" for a row we did not run.
    paper_tables=M2MIX_TABLE3, metrics=M2MIX_TABLE3_METRICS: Table 3's layout, SIMAT
    (Table 5) as a column."""
    by, simat = {}, {}
    for r in records:
        if r["task"] == "simat" and "simat" in metrics:
            simat[r["model"]] = r["value"]
        else:
            by.setdefault(r["task"], {}).setdefault(r["model"], {})[r["metric"]] = r["value"]
    out = []
    for task, models in by.items():
        paper = (M2MIX_TABLE1 if paper_tables is None else paper_tables).get(task, {})
        rows = []
        for name in dict.fromkeys([*(n for n in ("ZS", "FT") if n in models), *paper, *models]):
            row, ours_row = {"method": name}, {**models.get(name, {}),
                                               **({"simat": simat[name]} if name in simat else {})}
            for m in metrics:
                ours, theirs = ours_row.get(m), paper.get(name, {}).get(m)
                digits = 1 if "R@" in m or m == "simat" else 2 if "ece" in m else 3
                row[m] = "-" if ours is None else f"{ours:.{digits}f}"
                row[m] += "" if theirs is None else f" ({theirs})"
            rows.append(row)
        head = f"### {task}" + (" - ours (paper)" if paper else "")
        out.append(head + "\n" + markdown_table(rows, ("method", *metrics)))
    return "\n\n".join(out)


COLLECTED = ("m2mix", "imix", "unmix")  # the results.json methods --collect reads: m2mix.py and baselines/


def collect(run_dirs, write: bool = True) -> str:
    """m2mix.py --collect: Table 1 (Table 3 with SIMAT for the uni-modal towers, known from a run's model sidecar)
    from several runs' results.json, each row from the first run that has it; torch-free, so it answers in well
    under a second. write: also into <first run>/collect.md (said on the last line)."""
    records, seen, towers = [], set(), False
    for d in run_dirs:
        try:
            results = read(Path(d) / "results.json")  # plumbing.results' schema (or the file before it)
            method = results.get("method", "m2mix") if "records" in results else "no records"
        except DataError as e:
            method = f"{type(e).__name__}: {e}"
        if method not in COLLECTED:
            raise UsageError(f"--collect {d}: no readable results.json of an m2mix.py run (or of its baselines, "
                             f"python -m baselines.imix / unmix) there ({method})")
        sidecar = Path(d) / "model.pt.json"
        towers = towers or (sidecar.is_file() and "towers" in json.loads(sidecar.read_text()))
        for r in results["records"]:
            key = (r["task"], r["model"], r["metric"])
            if key not in seen:
                seen.add(key)
                records.append(r)
    text = m2mix_table1(records, M2MIX_TABLE3, M2MIX_TABLE3_METRICS) if towers else m2mix_table1(records)
    if write:
        target = Path(run_dirs[0]) / "collect.md"
        atomic_write(target, text + "\n")
        text += f"\n\n(written to {target})"
    return text


def collect_command(cfg):
    """flags.answer_early's --collect: print, write, exit 0, before torch loads (a bad folder: one message)."""
    try:
        print(collect(cfg.collect.split(",")))
    except UsageError as e:
        sys.exit(f"error: {e}")
