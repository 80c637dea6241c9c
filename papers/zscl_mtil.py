"""ZSCL's MTIL protocol as the continual drivers report it (Zheng et al., "Preventing Zero-Shot Transfer Degradation in
Continual Learning of Vision-Language Models", ICCV 2023, arXiv:2303.06628, Sec. 4.1 and Tab. 1; the authors' code
github.com/Thunderbeee/ZSCL, mtil/results.ipynb for the three metrics).

`--tasks mtil-order1 | mtil-order2` reaches every continual driver through common.parse_tasks (protocols/mtil.py:
the 11 datasets, ZSCL's splits, names, templates and orders, each task's training manifest, its test set as the
eval.py name mtil:<Dataset>); common.summarize_continual adds ZSCL's Transfer / Average / Last of the top-1 matrix
as the summary's 'mtil' (results.json: continual.mtil). This module prints it (report) beside ZSCL's published
zero-shot row for ViT-B/16, and gives dns.py's features of a test set that is a classification set (class_features).
"""
from __future__ import annotations

import common
import eval as evaluation
from protocols import mtil


def report(method: str, summary: dict, tasks, backbone: str = "") -> dict:
    """Prints ZSCL's Table 1 shape (Transfer / Average / Last per dataset and their means, the pretrained row above;
    ZSCL's zero-shot row for ViT-B/16 when that is the backbone) and returns the headline row."""
    names = [getattr(t, "name", t) for t in tasks]
    published = mtil.DATA["zero_shot_vit_b16"] if backbone in ("ViT-B/16", "ViT-B-16") else None
    table = mtil.table(summary["mtil"], names, published)
    print(f"\n## {method}: MTIL ({', '.join(names)}), top-1 (%); ZSCL's Transfer / Average / Last\n\n{table}")
    m = summary["mtil"]
    row = {"method": method, "Transfer": m["Transfer"], "Average": m["Average"], "Last": m["Last"]}
    return {"rows": [row], "table": table, "summary": summary}


def class_features(model, preprocess, tokenizer, name: str, data_root, device=None) -> dict:
    """A classification test set's frozen features for dns.py's maps: img (N, D), its class prompts' zero-shot head
    as txt (C, D) (the renormalised template mean per class), labels (N,); 'classes' marks it for evaluate_maps."""
    cs = evaluation.load_classification(name, data_root)
    return {"img": evaluation.image_features(model, preprocess, cs.image_paths, device=device),
            "txt": common.zero_shot_classifier(model, tokenizer, cs.classnames, cs.templates, device=device).cpu().t(),
            "labels": cs.labels, "classes": True}
