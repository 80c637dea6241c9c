"""WiSE-FT (Wortsman et al., "Robust fine-tuning of zero-shot models", CVPR 2022, arXiv:2109.01903, Eq. 1): the
weight-space interpolation between two checkpoints, the curve `eval.py --wise-ft` evaluates along it (each alpha's
numbers written as it finishes, `--resume` keeping them), the effective robustness of each point, and the reader
of the checkpoint files it interpolates, with their checks (issue 69.3, 72.3). cclip.py's research merge schedule
interpolates with interpolate_weights.

Effective robustness (Taori et al., "Measuring Robustness to Natural Distribution Shifts in Image Classification",
NeurIPS 2020, arXiv:2007.00644, its definition of effective robustness; the section number is not checked here, no
copy of the paper being on this machine): rho(f) = acc_shift(f) - beta(acc_ImageNet(f)), beta a line fit in logit
space, logit(beta(x)) = slope * logit(x) + intercept, to the accuracies of baseline models. WiSE-FT measures its
points against such fits over many models (its Fig. 1: zero-shot CLIP models, standard ImageNet models); one run
has one zero-shot model, so the default line here is ours: slope 1 through the alpha-0 (zero-shot) point, which
gives alpha 0 an effective robustness of 0 by construction. --er-line SLOPE,INTERCEPT supplies a published fit;
results.json says which."""
from __future__ import annotations

import math
import sys
import time
import zipfile
from pathlib import Path

import torch

from plumbing.base import UsageError, atomic_write, markdown_table
from plumbing.loading import file_sha256, load_weights_only, state_shapes
from plumbing.results import from_json, to_json


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
    the curve evaluated ImageNet and all five shifts (protocols/imagenet_shifts.py)."""
    from protocols.imagenet_shifts import SHIFTS, shift_average
    points = []
    for point in curve:
        top1 = {r["task"]: r["value"] for r in point["records"] if r["metric"] == "top1"}
        if "imagenet" not in top1 or shift_average(top1) is None:
            return []
        points.append({"alpha": point["alpha"], "imagenet": top1["imagenet"], **{s: top1[s] for s in SHIFTS},
                       "avg shifts": shift_average(top1)})
    return points


def robustness_figure(points, path, caption: str = "", line: dict | None = None) -> str:
    """WiSE-FT's effective-robustness plot (its Fig. 1 shape): the average over the five shifts against ImageNet
    top-1, one point per alpha joined in order, the zero-shot end (alpha 0) and the fine-tuned end (alpha 1)
    marked, the baseline line of er_line (effective robustness is a point's height above it; the legend gives
    each alpha's) and y = x. Linear axes in percent (WiSE-FT draws them logit-scaled)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    x, y = [p["imagenet"] for p in points], [p["avg shifts"] for p in points]
    fig, ax = plt.subplots(figsize=(5.6, 4.8))
    lo, hi = max(min(x + y) - 2, 0), min(max(x + y) + 2, 100)
    ax.plot([lo, hi], [lo, hi], color="0.8", lw=1, ls="--", label="y = x")
    if line:
        grid = [lo + (hi - lo) * i / 100 for i in range(101)]
        ax.plot(grid, [line_at(line, g) for g in grid], color="tab:gray", lw=1.2,
                label=f"baseline (logit slope {line['slope']:.2f}, intercept {line['intercept']:.2f}; "
                      f"{'given' if line['source'].startswith('--er-line') else 'ours: through alpha 0'})")
    er = {p["alpha"]: p.get("effective robustness") for p in points}
    ax.plot(x, y, "-o", color="tab:blue", ms=4, label="WiSE-FT; effective robustness (points): " + ", ".join(
        f"alpha {a:g} {v:+.1f}" if v is not None else f"alpha {a:g}" for a, v in er.items()))
    ends = {0.0: ("*", "tab:green", "zero-shot (alpha 0)"), 1.0: ("s", "tab:red", "fine-tuned (alpha 1)")}
    for p in points:
        if p["alpha"] in ends:
            marker, colour, label = ends[p["alpha"]]
            ax.plot(p["imagenet"], p["avg shifts"], marker, color=colour, ms=12, label=label, zorder=3)
    ax.set_xlabel("ImageNet top-1 (%)")
    ax.set_ylabel("mean top-1 over the 5 shifts (%)")
    ax.set_title("Effective robustness along the WiSE-FT curve", fontsize=10)
    ax.legend(fontsize=6, loc="best")
    if caption:
        fig.text(0.01, 0.005, caption, fontsize=5.5, color="0.4", wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
    return str(path)


def command_run(argv, script: str = "eval.py") -> str:
    """The command line this process runs, for the figure's caption and results.json: the command plumbing.cli
    recorded (`python -m lab eval ...` through the lab, `python eval.py ...`), else `python <script> argv`."""
    import shlex

    from plumbing import runfolder
    recorded = runfolder.COMMAND
    if recorded and list(recorded[1:]) == list(argv):
        head = recorded[0] if recorded[0].startswith("python") else f"python {recorded[0]}"
        return f"{head} {shlex.join(recorded[1:])}"
    return f"python {script} {shlex.join(argv)}"


def preflight(a, tasks, log=None) -> dict:
    """eval.py --wise-ft before any model is built: both weight files checked (check_checkpoint), the curve's
    settings (settings_of) and, under --resume, the finished alphas in --out of other settings refused. Returns the
    settings for run."""
    for flag, path in (("--wise-ft", a.wise_ft), ("--wise-base", a.wise_base)):
        if path:
            check_checkpoint(path, flag, a.backbone)
    settings = settings_of(a, tasks)
    if a.resume and a.out:
        finished_alphas(a.out, a.alphas, settings, True, log or (lambda s: None))
    return settings


def run(a, model, settings: dict, evaluate_fn, command: str, log=None) -> dict:
    """eval.py --wise-ft after the model is built: theta0 (--wise-base, else the model's weights) and theta1
    (--wise-ft) read and matched to the model, the curve run and kept alpha by alpha (run_curve), its table
    printed, and with ImageNet and its five shifts the points with their effective robustness, the line they are
    measured against and the figure (<out>/wise-ft-robustness.png, captioned with `command`). Returns what goes
    into results.json."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    own = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    theta0 = match_model(load_state_dict(a.wise_base), own, "--wise-base", a.wise_base, log) if a.wise_base else own
    theta1 = match_model(load_state_dict(a.wise_ft), own, "--wise-ft", a.wise_ft, log)
    curve = run_curve(model, theta0, theta1, a.alphas, evaluate_fn, a.out or None, settings, a.resume, log)
    print(wise_ft_table(curve))
    out = {"wise_ft": curve, "command": command}
    if points := robustness_points(curve):  # ImageNet + its 5 shifts: the effective-robustness curve
        line = er_line(points, a.er_line)
        points = effective_robustness(points, line)
        if a.out:
            atomic_write(Path(a.out) / "wise-ft-robustness.png", lambda tmp: robustness_figure(
                points, tmp, command if len(command) <= 400 else command[:397] + "...", line))
        print("\n" + markdown_table(points, list(points[0])))
        if line:
            print(f"effective robustness against the line {line['source']}")
        out.update(robustness=points, er_line=line)
    return out


# ----------------------------------------------------------------------------- the checkpoints' checks (69.3)
def _peek(path, flag: str) -> tuple[dict | None, dict]:
    """({key: shape} of the open_clip state_dict in `path`, unwrapped as load_state_dict unwraps it, or None for a
    TorchScript archive; a training checkpoint's config or {}), reading a safetensors header only and a torch zip
    through mmap. An unreadable file is one message naming `flag`."""
    path = str(path)
    try:
        if path.endswith(".safetensors"):
            return state_shapes(path, flag), {}
    except UsageError as e:  # a header that lies about its sizes, a file cut short: the flag first
        raise UsageError(f"{flag} {e}") from None
    try:
        sd = load_weights_only(path, mmap=zipfile.is_zipfile(path))
    except RuntimeError as e:
        if "TorchScript" in str(e):
            return None, {}
        return state_shapes(path, flag), {}  # its one message for a file cut short or not torch's
    except (OSError, EOFError, ValueError) as e:
        raise UsageError(f"{flag} {path}: not a readable model file ({str(e).splitlines()[0][:160]}); copy it "
                         f"again, or pass another checkpoint") from None
    config = sd.get("config") if isinstance(sd, dict) and isinstance(sd.get("config"), dict) else {}
    for key in ("state_dict", "net", "model"):
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    if not isinstance(sd, dict) or not any(isinstance(v, torch.Tensor) for v in sd.values()):
        raise UsageError(f"{flag} {path}: holds no state_dict of tensors ({type(sd).__name__}); pass a model file "
                         f"(a run's model.pt or model.safetensors)")
    if any(k.startswith("model.") for k in sd):
        sd = {k.removeprefix("model."): v for k, v in sd.items() if k.startswith("model.")}
    return {k.removeprefix("module."): tuple(v.shape) for k, v in sd.items() if isinstance(v, torch.Tensor)}, config


def check_checkpoint(path, flag: str, backbone: str) -> None:
    """Before any model is built: `path` (--wise-ft's or --wise-base's) exists and reads (a lying safetensors
    header is one message), is no LoRA run's training checkpoint (its weights held as original + A / B), and its
    sidecar or training config names --backbone's architecture. One UsageError naming `flag` otherwise."""
    from plumbing import models
    if not Path(path).is_file():
        raise UsageError(f"{flag} {path}: no such file; pass a fine-tuned model file (a run's model.pt or "
                         f"model.safetensors, or its checkpoints/last.pt)")
    shapes, config = _peek(path, flag)
    adapters = [k for k in shapes or {} if "parametrizations" in k or "lora_" in k]
    if adapters:
        merged = Path(path).resolve().parent.parent / "model.pt"
        where = (f"that run's {merged} holds them merged: pass it" if merged.is_file() else
                 "finish that run first (its command with --resume latest), then pass its model.pt")
        raise UsageError(f"{flag} {path}: a LoRA run's training checkpoint (its weights are held as the original "
                         f"plus the adapters' A and B, e.g. {adapters[0]}), not plain weights to interpolate; "
                         f"{where} (LoRA is merged into the weights when training ends)")
    theirs = models.model_sidecar(path).get("backbone") or config.get("backbone")
    if isinstance(theirs, str) and theirs:
        try:
            same = models.resolve_backbone(theirs) == models.resolve_backbone(backbone)
        except UsageError:
            same = False
        if not same:
            raise UsageError(f"{flag} {path}: fine-tuned from backbone {theirs} (its "
                             f"{'sidecar ' + str(path) + '.json' if not config else 'training config'}), but "
                             f"--backbone is {backbone}: WiSE-FT interpolates two weights of one architecture; "
                             f"pass --backbone {theirs} (its --pretrained or --wise-base the weights it started "
                             f"from)")


def match_model(sd: dict, model_sd: dict, flag: str, path, log=None) -> dict:
    """`sd` (a checkpoint's) made to interpolate with the built model's `model_sd`: a SigLIP run's logit_bias that
    the model lacks is left out, and one the model has but the file lacks is the model's (a constant added to every
    logit: no ranking or top-1 of the evaluation depends on it), with one line; any other key or shape that
    differs is one message (a checkpoint of another architecture)."""
    log = log or (lambda s: print(s, file=sys.stderr))
    sd = dict(sd)
    if "logit_bias" in sd.keys() ^ model_sd.keys():
        had = "logit_bias" in sd
        sd.pop("logit_bias", None) if had else sd.setdefault("logit_bias", model_sd["logit_bias"])
        how = "left out (the model has none)" if had else "taken from the model (the file has none)"
        log(f"[wise-ft] {flag} {path}: SigLIP's logit_bias {how}: a constant added to every logit, it changes no "
            f"ranking or top-1 here")
    extra, missing = sorted(sd.keys() - model_sd.keys()), sorted(model_sd.keys() - sd.keys())
    shapes = [k for k in sd.keys() & model_sd.keys() if tuple(sd[k].shape) != tuple(model_sd[k].shape)]
    if extra or missing or shapes:
        said = ([f"{len(shapes)} tensors of another shape (e.g. {shapes[0]}: {tuple(sd[shapes[0]].shape)} in the "
                 f"file, {tuple(model_sd[shapes[0]].shape)} in the model)"] if shapes else []) + (
            [f"{len(extra)} keys the model lacks (e.g. {extra[0]})"] if extra else []) + (
            [f"{len(missing)} of the model's keys missing (e.g. {missing[0]})"] if missing else [])
        raise UsageError(f"{flag} {path}: not weights of --backbone's architecture: {'; '.join(said)}; pass the "
                         f"--backbone it was trained with, or a checkpoint fine-tuned from this one")
    return sd


# ----------------------------------------------------------------------------- the curve, kept alpha by alpha
ALPHA_FOLDER = "wise-ft"  # <out>/wise-ft/alpha-<a>.json: one file per finished alpha (outfolder.EVAL_FILES)


def alpha_file(out, alpha: float) -> Path:
    return Path(out) / ALPHA_FOLDER / f"alpha-{alpha:g}.json"


def settings_of(a, tasks) -> dict:
    """What the curve's numbers depend on (eval.py's flags; the weight files by sha256): --resume keeps a finished
    alpha only when these are the same."""
    def weights(v):
        return {"path": str(Path(v).resolve()), "sha256": file_sha256(v)} if v and Path(v).is_file() else v
    return {"backbone": a.backbone, "pretrained": weights(a.pretrained), "wise_base": weights(a.wise_base),
            "wise_ft": weights(a.wise_ft), "tasks": list(tasks), "data_root": str(Path(a.data_root).resolve()),
            "text_mode": a.text_mode, "context_length": a.context_length, "synthetic_n": a.synthetic_n,
            "analyses": a.analyses, "simat_protocol": a.simat_protocol, "strict": a.strict}


def finished_alphas(out, alphas, settings: dict, resume: bool, log) -> dict:
    """{alpha: records} that --resume keeps from `out` (written by an earlier run of the same settings); a file of
    other settings under --resume is one message naming them; without --resume one line says what is redone."""
    found = {}
    for alpha in alphas:
        f = alpha_file(out, alpha)
        try:
            found[alpha] = from_json(f.read_text(encoding="utf-8"), restore=True)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            log(f"[wise-ft] {f}: unreadable ({type(e).__name__}); alpha {alpha:g} is evaluated again")
    if not resume:
        if found:
            log(f"[wise-ft] {Path(out) / ALPHA_FOLDER} holds alpha {', '.join(f'{x:g}' for x in found)} of an "
                f"earlier curve: evaluated again and replaced (--resume keeps those of the same settings)")
        return {}
    for alpha, saved in found.items():
        then = saved.get("settings") if isinstance(saved.get("settings"), dict) else {}
        differ = [k for k in settings if then.get(k) != settings[k]]
        if differ:
            raise UsageError(f"--resume: {alpha_file(out, alpha)} was evaluated with other settings (differing: "
                             f"{', '.join(differ)}; {differ[0]} was {str(then.get(differ[0]))[:80]}, now "
                             f"{str(settings[differ[0]])[:80]}); rerun without --resume to evaluate every alpha "
                             f"afresh (replacing those files), or choose another --out")
    if not found:
        log(f"[wise-ft] --resume: no finished alpha in {Path(out) / ALPHA_FOLDER} yet; evaluating all")
    return {alpha: saved["records"] for alpha, saved in found.items()}


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, minutes = divmod(seconds // 60, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds % 60:02d}s"


def run_curve(model, theta0: dict, theta1: dict, alphas, evaluate_fn, out=None, settings=None, resume=False,
              log=None) -> list:
    """wise_ft's curve, kept as it goes: each alpha's records written atomically to <out>/wise-ft/alpha-<a>.json
    as soon as it finishes (a stop keeps them), finished alphas of the same settings skipped under --resume, and a
    progress line per alpha (i/n, elapsed, an estimate of the time left from the alphas timed so far)."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    done = finished_alphas(out, alphas, settings or {}, resume, log) if out else {}
    todo = [x for x in alphas if x not in done]
    t0, timings, curve, n = time.time(), [], [], len(alphas)

    def evaluate(model, alpha):
        if alpha in done:
            log(f"[wise-ft] alpha {alpha:g} ({len(curve) + 1}/{n}): kept from {alpha_file(out, alpha)}")
            return done[alpha]
        eta = (f"about {_clock(sum(timings) / len(timings) * (len(todo) - len(timings)))} left" if timings else
               "time left known after the first alpha")
        log(f"[wise-ft] alpha {alpha:g} ({len(curve) + 1}/{n}): evaluating; elapsed {_clock(time.time() - t0)}, "
            f"{eta}")
        start = time.time()
        records = evaluate_fn(model)
        timings.append(time.time() - start)
        if out:
            atomic_write(alpha_file(out, alpha), to_json({"alpha": alpha, "settings": settings,
                                                          "seconds": timings[-1], "records": records}))
        return records

    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        for alpha in alphas:
            if alpha not in done:
                model.load_state_dict(interpolate_weights(theta0, theta1, float(alpha)))
            curve.append({"alpha": float(alpha), "records": evaluate(model, alpha)})
    finally:
        model.load_state_dict(saved)
    log(f"[wise-ft] {n} alphas in {_clock(time.time() - t0)} ({len(todo)} evaluated, {n - len(todo)} kept)")
    return curve


# ----------------------------------------------------------------------------- effective robustness
ER_DEFAULT = ("ours: slope 1 in logit space through the alpha 0 (zero-shot) point, so alpha 0 scores 0; WiSE-FT "
              "fits the line to many zero-shot CLIP models: pass that fit as --er-line SLOPE,INTERCEPT")


def _held(percent: float) -> float:
    return min(max(percent, 0.01), 99.99)  # 0 % and 100 % have no logit: accuracies held 0.01 % inside


def _logit(percent: float) -> float:
    p = _held(percent) / 100
    return math.log(p / (1 - p))


def er_line(points, given=None) -> dict:
    """The baseline line logit(shift avg) = slope * logit(ImageNet) + intercept: `given` (slope, intercept), or
    ours through the alpha-0 point (ER_DEFAULT); with where it came from."""
    if given:
        return {"slope": float(given[0]), "intercept": float(given[1]), "source": "--er-line (given)"}
    zero = next((p for p in points if p["alpha"] == 0), None)
    if zero is None:
        return {}
    return {"slope": 1.0, "intercept": _logit(zero["avg shifts"]) - _logit(zero["imagenet"]), "source": ER_DEFAULT}


def line_at(line: dict, imagenet: float) -> float:
    """beta(x) in percent: the shift average the line predicts at ImageNet top-1 x."""
    return 100 / (1 + math.exp(-(line["slope"] * _logit(imagenet) + line["intercept"])))


def effective_robustness(points, line: dict) -> list[dict]:
    """Each point with 'effective robustness': its shift average minus the line's at its ImageNet top-1 (points,
    percent; Taori et al. 2020's rho; accuracies held in [0.01, 99.99] %). Without a line (no alpha 0, no
    --er-line) the points as they are."""
    if not line:
        return points
    return [{**p, "effective robustness": _held(p["avg shifts"]) - line_at(line, p["imagenet"])} for p in points]
