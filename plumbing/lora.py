"""LoRA's adapters as files (issue 59.2): peft's adapter layout (adapter_model.safetensors + adapter_config.json)
written from the adapters of common.py's LoRA, so peft's PeftModel.from_pretrained loads them onto the untouched
backbone, and (issue 72.1) that model is the trained one: checked at write time with the installed peft, its
out_proj factors written for what that peft does with them, the trained parameters outside the adapters (the
logit scale, SigLIP's bias) beside them in extra_params.safetensors, target_modules qualified by tower, and a
README.md saying how to load it and what the check found. The adapters themselves (common.LoRA, add_lora,
merge_lora) are method math and live in common.py; this is their file format only.
"""
from __future__ import annotations

import copy
import json
import re
import sys
import textwrap
import warnings
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from plumbing import flags, folders, models
from plumbing.base import RunError, shorten

DEFAULT_TARGETS = flags.DEFAULT_LORA_TARGETS  # C-CLIP's: attention in / out and the MLP's two weights
ADAPTER_FOLDER = "lora_adapter"  # <out>/lora_adapter: the peft adapter of a --lora run
RECEIPT = "adapter_receipt.json"  # the files the adapter's write put there (plumbing.folders.atomic_folder)
EXTRAS = "extra_params.safetensors"  # what the run trained or set outside the adapters: logit_scale, logit_bias
TOLERANCE = 1e-4  # max |difference| of normalised features the peft model may have from the run's
PEFT_ISSUE = "huggingface/peft PR #3774"  # peft <= 0.21.2 applies an nn.MultiheadAttention's out_proj update twice

# The README's two lines, run as written by the write-time check (apply_extras) and tests/test_lora.py
LOAD = '''for name, value in load_file(f"{adapter}/extra_params.safetensors").items():  # logit_scale (, logit_bias)
    setattr(base.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2], torch.nn.Parameter(value))
model = PeftModel.from_pretrained(base, adapter)'''


# --- peft's adapter layout ---
# peft wraps an nn.MultiheadAttention whole: its lora_A / lora_B adapt in_proj_weight, and a nested Linear LoRA
# sits on its out_proj (keys ...attn.lora_A.weight and ...attn.base_layer.out_proj.lora_A.weight); an nn.Linear
# gets ...c_fc.lora_A.weight. One side of an attention not adapted here is written with B = 0 (no change).
def _peft_module(name: str) -> tuple[str, str]:
    """(peft target module, peft key prefix) of an adapted weight name."""
    if name.endswith(".in_proj_weight"):
        mod = name.removesuffix(".in_proj_weight")
        return mod, mod
    if name.endswith(".out_proj.weight") and ".attn." in f".{name}":
        mod = name.removesuffix(".out_proj.weight")
        return mod, f"{mod}.base_layer.out_proj"
    mod = name.removesuffix(".weight")
    return mod, mod


def target_pattern(modules, model) -> str:
    """peft's target_modules as one regular expression (peft fullmatches a string against every module name) that
    names exactly `modules` of `model`, by tower: a --lock-image run's "transformer.resblocks.0.attn" no longer
    also matches visual.transformer.resblocks.0.attn, as a list's suffix match does. Blocks of one prefix with the
    same modules are one alternative: visual\\.transformer\\.resblocks\\.(?:0|1)\\.(?:attn|mlp\\.c_fc)."""
    blocks, single = {}, []
    for name in sorted(modules):
        m = re.fullmatch(r"(.+)\.(\d+)\.(.+)", name)
        if m:
            blocks.setdefault(m[1], {}).setdefault(int(m[2]), set()).add(m[3])
        else:
            single.append(re.escape(name))
    alts = []
    for prefix, per_block in blocks.items():
        groups = {}  # the same modules in several blocks: one alternative
        for i, names in sorted(per_block.items()):
            groups.setdefault(tuple(sorted(names)), []).append(str(i))
        for names, idx in groups.items():
            alts.append(rf"{re.escape(prefix)}\.(?:{'|'.join(idx)})\.(?:{'|'.join(map(re.escape, names))})")
    pattern = "|".join(alts + single)
    matched = {n for n, _ in model.named_modules() if re.fullmatch(pattern, n)}
    if matched != set(modules):  # never: the pattern is built from the names themselves
        raise ValueError(f"target_pattern: {pattern!r} matches {sorted(matched ^ set(modules))[:4]} wrongly")
    return pattern


def peft_out_proj_factor() -> float | None:
    """How many times the installed peft applies an nn.MultiheadAttention's out_proj LoRA update in its forward:
    1 by LoRA's math, 2 in peft 0.21.2 (its merge adds the nested Linear's delta, then that Linear's own merge
    adds it again; PEFT_ISSUE). Measured on a 4-wide attention with in_proj's B = 0: the output moves linearly in
    out_proj's weight, so peft's change is k times the change of W + B A. None without peft."""
    try:
        import peft
    except ImportError:
        return None
    g = torch.Generator().manual_seed(0)
    host = nn.Module()
    host.attn = nn.MultiheadAttention(4, 1)
    plain = copy.deepcopy(host.attn).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft.inject_adapter_in_model(peft.LoraConfig(r=1, lora_alpha=1, target_modules=["attn"]), host)
    out_proj = host.attn.base_layer.out_proj
    with torch.no_grad():
        out_proj.lora_A["default"].weight.copy_(torch.randn(1, 4, generator=g))
        out_proj.lora_B["default"].weight.copy_(torch.randn(4, 1, generator=g))
        x = torch.randn(3, 2, 4, generator=g)  # (L, N, E)
        y0 = plain(x, x, x, need_weights=False)[0]
        plain.out_proj.weight += out_proj.lora_B["default"].weight @ out_proj.lora_A["default"].weight
        once = plain(x, x, x, need_weights=False)[0] - y0
        got = host.attn.eval()(x, x, x, need_weights=False)[0] - y0
    k = float((got * once).sum() / (once * once).sum())
    if (got - k * once).abs().max() > 1e-4 * once.abs().max():  # not a multiple of the update: unknown
        return float("nan")
    return round(k, 3)


def extra_params(model) -> dict:
    """The model's parameters a peft adapter does not hold but the trained model has: logit_scale, a SigLIP
    logit_bias (--loss siglip: trained, its scale set at the start), and any other parameter that trained beside
    the adapters (requires_grad outside them). {name: a float32 CPU copy}."""
    out = {}
    for name, p in model.named_parameters():
        if ".parametrizations." in name:  # an adapter, or the weight it adapts
            continue
        if name in ("logit_scale", "logit_bias") or p.requires_grad:
            out[name] = p.detach().cpu().float().contiguous()
    return out


def window_note(model, backbone: str) -> str:
    """'' when the model's text window is its backbone's; else what a peft user must build first (longclip.py
    stretches the window: a new positional table, context_length and causal mask the adapter cannot carry)."""
    import open_clip
    try:
        config = open_clip.get_model_config(models.resolve_backbone(backbone)) or {}
    except Exception:  # noqa: BLE001  (an unnamed or foreign backbone: nothing to compare with)
        return ""
    want = config.get("text_cfg", {}).get("context_length")
    have = getattr(models.text_tower(model), "context_length", want)
    return "" if want in (None, have) else (
        f"the run's text window is {have} positions, {backbone}'s {want} (Long-CLIP's stretch): load the adapter "
        f"onto the backbone stretched as the run did (longclip.stretch_text_window(base, keep, factor): the run's "
        f"--keep and --factor), not the plain one")


def apply_extras(model, folder):
    """The README's first two lines (LOAD): extra_params.safetensors' parameters set on the base model before
    PeftModel.from_pretrained, added where the base has none (a CLIP backbone's logit_bias)."""
    from safetensors.torch import load_file
    for name, value in load_file(str(Path(folder) / EXTRAS)).items():
        setattr(model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2], nn.Parameter(value))
    return model


def export_peft(model, found: dict, folder, base_model: str = "", pretrained: str = "") -> dict:
    """peft's adapter layout of `found` ({adapted weight's name: its adapter, with .A (r, in), .B (out, r) and .scale
    = alpha / r}: common.adapters(model)) in `folder`: adapter_model.safetensors with
    base_model.model.<module>.lora_{A,B}.weight and adapter_config.json (LoRA, r, lora_alpha, target_modules: a
    regular expression naming the adapted modules of their towers only), extra_params.safetensors (extra_params)
    and README.md, so PeftModel.from_pretrained(<the backbone as loaded, extras applied>, folder) builds the
    adapted model. An attention's out_proj B is written divided by the installed peft's factor
    (peft_out_proj_factor); the written folder is loaded with peft before it is put in place (check_with_peft),
    and one line says what the check found. Every adapter must share one rank and scale (peft's config has one).
    `model` still holds its adapters (before common.merge_lora). Returns {"lora_adapter": folder,
    "lora_adapter_check": the check's numbers}."""
    from safetensors.torch import save_file  # installed with open_clip
    if not found:
        raise ValueError("export_peft: the model has no LoRA adapters")
    ranks = {(m.A.shape[0], m.scale) for m in found.values()}
    if len(ranks) != 1:
        raise ValueError(f"export_peft: adapters of several ranks / scales {sorted(ranks)}; peft's config has one")
    (rank, scale), = ranks
    folders.check_target(folder, "the LoRA adapter folder", RECEIPT)  # issue 69.2: before the probe and the copy
    factor = peft_out_proj_factor()
    out_k = factor if factor and factor == factor and factor > 0 else 1.0  # nan / 0 / None: as trained
    sd, modules = {}, set()
    for name, m in found.items():
        mod, prefix = _peft_module(name)
        modules.add(mod)
        k = out_k if prefix.endswith(".base_layer.out_proj") else 1.0  # peft applies B A k times: B / k
        sd[f"base_model.model.{prefix}.lora_A.weight"] = m.A.detach().cpu().float().contiguous()
        sd[f"base_model.model.{prefix}.lora_B.weight"] = (m.B.detach().cpu().float() / k).contiguous()
    for mod in sorted(modules):  # an attention adapted on one side only: the other side at B = 0
        attn = model.get_submodule(mod)
        if not isinstance(attn, nn.MultiheadAttention):
            continue
        for prefix, rows in ((mod, 3 * attn.embed_dim), (f"{mod}.base_layer.out_proj", attn.embed_dim)):
            key = f"base_model.model.{prefix}.lora_"
            if key + "A.weight" not in sd:
                sd[key + "A.weight"] = torch.zeros(rank, attn.embed_dim)
                sd[key + "B.weight"] = torch.zeros(rows, rank)
    config = {"peft_type": "LORA", "task_type": None, "r": rank, "lora_alpha": scale * rank, "lora_dropout": 0.0,
              "target_modules": target_pattern(modules, model), "bias": "none", "fan_in_fan_out": False,
              "init_lora_weights": True, "modules_to_save": None, "base_model_name_or_path": base_model}
    extras = extra_params(model)
    out_proj = any(name.endswith(".out_proj.weight") for name in found)
    note, check = window_note(model, base_model), {}

    def write(tmp: Path):
        save_file(sd, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
        save_file(extras, str(tmp / EXTRAS))
        check.update(check_with_peft(model, tmp, extras) if factor is not None else {"checked": False})
        check.update(out_proj_factor=out_k if out_proj else None, **({"base": note} if note else {}))
        (tmp / "README.md").write_text(readme(base_model, pretrained, rank, scale * rank, extras, check))
    # issue 69.2 / 69.6: whole or not at all, the export's permissions, and never over a folder it did not write
    try:
        folder = folders.atomic_folder(Path(folder), write, what="LoRA adapter", marker=RECEIPT)
    except folders.FolderInterrupted as e:  # at a run's end: named beside what the run keeps, and how to finish
        from plumbing.cli import interrupted_message
        raise RunError(f"{e}; {interrupted_message(e.signum)[0]}", e.code) from None
    print(f"[lora] {folder}: {said(check, extras)}", file=sys.stderr, flush=True)
    return {"lora_adapter": str(folder), "lora_adapter_check": check}


@torch.no_grad()
def check_with_peft(model, folder, extras: dict) -> dict:
    """Loads `folder` with peft onto a copy of the base model (`model`'s adapted weights as they were before
    training; the extras set to NaN, and a logit_bias removed, before the README's lines put them back) and
    compares the normalised image and text features and the logits of two random images and token rows with
    `model`'s (the trained model: its adapters in place), on its device in float32. Returns {"checked", "passed",
    "peft", "image", "text", "logits"} (max |difference|s), or {"checked": False, "error"}."""
    import peft
    was = model.training
    try:
        model.eval()
        device = next(model.parameters()).device
        inputs = _probe_inputs(model, device)
        want = _scores(model, *inputs)
        model.train(was)
        base = unadapted_copy(model).eval()
        for name in extras:  # nothing of the run's left where the extras file must supply it
            mod, _, attr = name.rpartition(".")
            setattr(base.get_submodule(mod), attr, None if attr == "logit_bias" else
                    nn.Parameter(torch.full_like(base.get_parameter(name), float("nan"))))
        apply_extras(base, folder)
        base.to(device)
        with warnings.catch_warnings(record=True) as said_:
            warnings.simplefilter("always")
            adapted = peft.PeftModel.from_pretrained(base, str(folder)).eval()
        got = _scores(adapted.base_model.model, *inputs)
        del adapted, base
    except Exception as e:  # noqa: BLE001  (said in one line, never silent; the adapter is still written)
        model.train(was)
        return {"checked": False, "peft": _peft_version(), "error": shorten(f"{type(e).__name__}: {e}", 300)}
    diff = {k: float((got[k] - want[k]).abs().max()) for k in want}
    warned = [shorten(str(w.message)) for w in said_ if "adapter" in str(w.message).lower()]
    passed = diff["image"] <= TOLERANCE and diff["text"] <= TOLERANCE and diff["logits"] <= TOLERANCE * max(
        1.0, float(want["scale"])) and not warned
    return {"checked": True, "passed": passed, "peft": _peft_version(), **{k: diff[k] for k in
            ("image", "text", "logits")}, **({"peft_warnings": warned} if warned else {})}


def unadapted_copy(model):
    """A copy of `model` with its adapters taken off: each adapted weight the one the run started from (its
    parametrization's original). Not parametrize.remove_parametrizations: a deep copy shares the parametrized
    class it would edit with `model`, whose adapters must stay until common.merge_lora."""
    base = copy.deepcopy(model)
    for mod in [m for m in base.modules() if parametrize.is_parametrized(m)]:
        originals = {name: plist.original for name, plist in mod.parametrizations.items()}
        del mod._modules["parametrizations"]
        mod.__class__ = mod.__class__.__bases__[0]  # the module's own class again (parametrize injected one)
        for name, w in originals.items():
            mod.register_parameter(name, nn.Parameter(w.detach(), requires_grad=False))
    return base


def _peft_version() -> str:
    import peft
    return peft.__version__


def _probe_inputs(model, device):
    """Two random images at the model's size and two token rows of its text window (last token the largest id:
    the end token argmax pooling takes)."""
    g = torch.Generator().manual_seed(0)
    size = getattr(getattr(model, "visual", None), "image_size", 224)
    size = (size, size) if isinstance(size, int) else tuple(size)
    tower = models.text_tower(model)
    window = getattr(tower, "context_length", None) or getattr(model, "context_length", 77)
    vocab = getattr(tower, "vocab_size", None) or getattr(model, "vocab_size", 49408)
    tokens = torch.randint(1, vocab - 1, (2, window), generator=g)
    tokens[:, -1] = vocab - 1
    return torch.randn(2, 3, *size, generator=g).to(device), tokens.to(device)


def _scores(model, images, tokens) -> dict:
    """Normalised features, the logit scale and the logits scale * img txt^T + bias, in float32 on the CPU."""
    img = model.encode_image(images, normalize=True).float().cpu()
    txt = model.encode_text(tokens, normalize=True).float().cpu()
    scale = model.logit_scale.exp().float().cpu() if getattr(model, "logit_scale", None) is not None else \
        torch.tensor(1.0)
    bias = getattr(model, "logit_bias", None)
    logits = scale * img @ txt.t() + (bias.float().cpu() if bias is not None else 0)
    return {"image": img, "text": txt, "logits": logits, "scale": scale}


def said(check: dict, extras: dict) -> str:
    """The one line at the end of a --lora run (and the README's): what the write-time check found."""
    k = check.get("out_proj_factor")
    carried = f"{', '.join(extras)} in {EXTRAS} (README.md: how to load)" if extras else ""
    out = (f"; out_proj's lora_B written divided by {k:g}: peft {check.get('peft')} applies an "
           f"nn.MultiheadAttention's out_proj update {k:g} times ({PEFT_ISSUE})" if k and k != 1 else "")
    carried += f"; warning: {check['base']}" if check.get("base") else ""
    if not check.get("checked"):
        why = check.get("error") or "peft is not installed (pip install -r requirements.txt)"
        return (f"warning: not checked with peft ({why}); out_proj's factors are written as trained, which peft "
                f"<= 0.21.2 applies twice ({PEFT_ISSUE}); model.pt and --export hold the trained model; {carried}")
    if not check["passed"]:
        warned = f" (peft warned: {check['peft_warnings'][0]})" if check.get("peft_warnings") else ""
        return (f"warning: peft {check['peft']} loads it as a model that differs from the trained one by up to "
                f"{check['image']:.2g} (image features) / {check['text']:.2g} (text) / {check['logits']:.2g} "
                f"(logits), above {TOLERANCE:g}{warned}: use model.pt or --export's folder (the trained model){out}")
    return (f"peft {check['peft']} loads it as the trained model (max difference: image features "
            f"{check['image']:.1g}, text {check['text']:.1g}, logits {check['logits']:.1g}; tolerance "
            f"{TOLERANCE:g}){out}; {carried}")


def readme(backbone: str, pretrained: str, rank: int, alpha: float, extras: dict, check: dict) -> str:
    """The adapter folder's README.md: what it is, the lines that load it as the trained model, what the
    write-time check found."""
    base = f"{backbone}" + (f" (--pretrained {pretrained})" if pretrained else "")
    k = check.get("out_proj_factor")
    out = (f"\nout_proj: peft {check.get('peft')} applies an nn.MultiheadAttention's out_proj LoRA update {k:g} "
           f"times in its forward and merge ({PEFT_ISSUE}), so each attention's "
           f"`base_layer.out_proj.lora_B.weight` is written divided by {k:g}: peft then gives the trained weight "
           f"W + (alpha / r) B A. A peft that applies it once needs that B multiplied by {k:g}.\n"
           if k and k != 1 else "")
    out = "\n" + textwrap.fill(out.strip(), 116) + "\n" if out else ""
    return f"""# LoRA adapter of a --lora run (peft's layout)

Rank {rank}, lora_alpha {alpha:g}, on {base} as the run loaded it (plumbing.models.load_model, or open_clip with
the same weights). `extra_params.safetensors` holds what the trained model has outside the adapters:
{', '.join(extras) or 'nothing'}. Load the trained model:

```python
import torch
from peft import PeftModel
from safetensors.torch import load_file
# base: the backbone above, as loaded; adapter: this folder
{LOAD}
```
{out}
Write-time check (one line, as the run printed it): {said(check, extras)}.
"""
