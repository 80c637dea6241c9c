"""WiSE-FT (Wortsman et al., "Robust fine-tuning of zero-shot models", CVPR 2022, Eq. 1): the weight-space
interpolation between two checkpoints, the curve `python eval.py --wise-ft` evaluates along it, and the reader of
the checkpoint files it interpolates. cclip.py's research merge schedule interpolates with interpolate_weights."""
from __future__ import annotations

import torch

from plumbing.base import markdown_table
from plumbing.loading import load_weights_only


def load_state_dict(path) -> dict:
    """A plain open_clip state_dict from: models.save_model files, training checkpoints (common.train's
    {'net': ...}, keys 'model.*'), open_clip / OpenAI .pt/.bin files, or .safetensors. Pickles are read with
    weights_only=True (other objects are refused, not run); OpenAI's TorchScript archives with torch.jit.load."""
    path = str(path)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        sd = load_file(path)
    else:
        try:
            sd = load_weights_only(path)
        except RuntimeError as e:
            if "TorchScript" not in str(e):
                raise
            sd = torch.jit.load(path, map_location="cpu").state_dict()
    for key in ("state_dict", "net", "model"):
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    if any(k.startswith("model.") for k in sd):  # a method wrapper's state: keep the CLIP model
        sd = {k.removeprefix("model."): v for k, v in sd.items() if k.startswith("model.")}
    return {k.removeprefix("module."): v for k, v in sd.items()}


def interpolate_weights(theta0: dict, theta1: dict, alpha: float) -> dict:
    """WiSE-FT (Wortsman et al. 2022, Eq. 1): theta(alpha) = (1 - alpha) theta0 + alpha theta1, key by key. The
    two state_dicts must have the same keys and shapes; non-float entries (integer buffers) must be equal."""
    k0, k1 = set(theta0), set(theta1)
    if k0 != k1:
        raise ValueError(f"WiSE-FT: the state_dicts differ in keys: only in theta0 {sorted(k0 - k1)[:5]}, "
                         f"only in theta1 {sorted(k1 - k0)[:5]}")
    out = {}
    for k in theta0:
        a, b = theta0[k], theta1[k]
        if a.shape != b.shape:
            raise ValueError(f"WiSE-FT: {k} has shape {tuple(a.shape)} in theta0 and {tuple(b.shape)} in theta1")
        if not a.is_floating_point() and not torch.equal(a, b):
            raise ValueError(f"WiSE-FT: non-float entry {k} differs between the state_dicts")
        out[k] = ((1 - alpha) * a.float() + alpha * b.float()).to(a.dtype) if a.is_floating_point() else a.clone()
    return out


def wise_ft(model, theta0: dict, theta1: dict, alphas, evaluate_fn) -> list:
    """Evaluates theta(alpha) for each alpha with evaluate_fn(model) -> records (or any value); restores the
    model's weights afterwards. Returns [{'alpha': a, 'records': ...}]."""
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = []
    try:
        for a in alphas:
            model.load_state_dict(interpolate_weights(theta0, theta1, float(a)))
            out.append({"alpha": float(a), "records": evaluate_fn(model)})
    finally:
        model.load_state_dict(saved)
    return out


def wise_ft_table(curve, metrics=("i2t_R@1", "t2i_R@1", "top1")) -> str:
    """One row per alpha, one column per (task, metric): the target-task score against zero-shot retention."""
    rows, cols = [], {"alpha": None}  # cols: the columns in order of first appearance
    for point in curve:
        row = {"alpha": f"{point['alpha']:g}"}
        for r in point["records"]:
            if r["metric"] in metrics:
                c = f"{r['task']} {r['metric']}" + ("" if r["text_mode"] in ("truncate", "prompt-ensemble")
                                                    else f" [{r['text_mode']}]")
                row[c] = r["value"]
                cols.setdefault(c)
        rows.append(row)
    return markdown_table(rows, list(cols))
