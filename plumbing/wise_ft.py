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


def robustness_points(curve) -> list[dict]:
    """Per alpha: ImageNet top-1, each shift's and their mean ('avg shifts', WiSE-FT Tab. 1's column); [] unless
    the curve evaluated ImageNet and all five shifts (plumbing/imagenet_shifts.py)."""
    from plumbing.imagenet_shifts import SHIFTS, shift_average
    points = []
    for point in curve:
        top1 = {r["task"]: r["value"] for r in point["records"] if r["metric"] == "top1"}
        if "imagenet" not in top1 or shift_average(top1) is None:
            return []
        points.append({"alpha": point["alpha"], "imagenet": top1["imagenet"], **{s: top1[s] for s in SHIFTS},
                       "avg shifts": shift_average(top1)})
    return points


def robustness_figure(points, path, caption: str = "") -> str:
    """WiSE-FT's effective-robustness plot (its Fig. 1 shape): the average over the five shifts against ImageNet
    top-1, one point per alpha joined in order, the zero-shot end (alpha 0) and the fine-tuned end (alpha 1)
    marked, and the y = x line for reference. Linear axes in percent (WiSE-FT draws them logit-scaled)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    x, y = [p["imagenet"] for p in points], [p["avg shifts"] for p in points]
    fig, ax = plt.subplots(figsize=(5.2, 4.4))
    lo, hi = min(x + y) - 2, max(x + y) + 2
    ax.plot([lo, hi], [lo, hi], color="0.8", lw=1, ls="--", label="y = x")
    ax.plot(x, y, "-o", color="tab:blue", ms=4, label="WiSE-FT, alpha in " + ", ".join(f"{p['alpha']:g}"
                                                                                       for p in points))
    ends = {0.0: ("*", "tab:green", "zero-shot (alpha 0)"), 1.0: ("s", "tab:red", "fine-tuned (alpha 1)")}
    for p in points:
        if p["alpha"] in ends:
            marker, colour, label = ends[p["alpha"]]
            ax.plot(p["imagenet"], p["avg shifts"], marker, color=colour, ms=12, label=label, zorder=3)
    ax.set_xlabel("ImageNet top-1 (%)")
    ax.set_ylabel("mean top-1 over the 5 shifts (%)")
    ax.set_title("Effective robustness along the WiSE-FT curve", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    if caption:
        fig.text(0.01, 0.005, caption, fontsize=6, color="0.4")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
    return str(path)
