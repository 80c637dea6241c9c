"""Per-tower learning rates (--lr-image, --lr-text: ours) and layer-wise lr decay (--image-layer-decay,
--text-layer-decay: open_clip's) in common.train's AdamW groups, for every method.

The layer partition and its scale are open_clip's (mlfoundations/open_clip: src/open_clip_train/optim.py,
lr_scales_for_groups and layer_decay_param_groups; the partition in src/open_clip/transformer.py,
VisionTransformer.layer_groups and _text_layer_groups), written again here because the pinned open_clip 3.3.0
predates them. Each tower, input -> output, is G = n + 2 groups:

  embeddings   image: conv1, class and positional embeddings, ln_pre; text: token and positional embeddings
  layer.i      block i of the n transformer blocks (the last one together with ln_post / ln_final)
  proj         the projection

and group k gets lr x decay ** (G - 1 - k): the projection x 1, block i x decay ** (n - i), the embeddings
x decay ** (n + 1). This is open_clip's layer_groups, not BEiT's get_num_layer_for_vit (microsoft/unilm at 2312c6f,
beit/optim_factory.py), though both number the embeddings 0, block i i + 1, the head n + 1: open_clip puts ln_pre
with the embeddings and ln_post / ln_final with the last block; BEiT's ViT has no ln_pre (a name it does not match
goes to n + 1) and keeps its final norm with the head. A parameter in no group (logit_scale, a method's own
modules, an attentional pooler) keeps its rate, as in open_clip. Imports torch only."""
from __future__ import annotations

from typing import Callable

import torch.nn as nn

from plumbing.base import UsageError

TOWERS = ("image", "text")


def text_tower(model: nn.Module) -> list:
    """The text tower's members as open_clip's _text_layer_groups reads them off a CLIP model (the text attributes
    sit on the model itself), or model.text (open_clip's CustomTextCLIP: its TextTransformer, or a Hugging Face
    tower)."""
    if isinstance(getattr(model, "text", None), nn.Module):
        return [model.text]
    names = ("token_embedding", "positional_embedding", "cls_emb", "transformer", "ln_final", "text_projection")
    return [m for m in (getattr(model, n, None) for n in names) if m is not None]


def tower_members(model: nn.Module, tower: str) -> list:
    """The modules and parameters of one tower (image: model.visual), whatever its structure; [] for none."""
    if tower == "image":
        visual = getattr(model, "visual", None)
        return [visual] if isinstance(visual, nn.Module) else []
    return text_tower(model) if hasattr(model, "encode_text") else []


def layer_groups(model: nn.Module, tower: str) -> list[tuple[str, list]] | None:
    """open_clip's ordered [(name, members)] of a tower, input -> output (the module docstring), or None when the
    tower is not a transformer of open_clip's layout (a ResNet, timm or Hugging Face tower)."""
    module = getattr(model, "visual", None) if tower == "image" else model
    if tower == "text" and isinstance(getattr(model, "text", None), nn.Module):
        module = model.text  # CustomTextCLIP: open_clip's TextTransformer, or a Hugging Face tower (no blocks)
    blocks = getattr(getattr(module, "transformer", None), "resblocks", None)
    if module is None or not isinstance(blocks, nn.ModuleList):
        return None
    if tower == "image":
        embed, last, proj = ("conv1", "class_embedding", "positional_embedding", "ln_pre"), "ln_post", "proj"
    else:
        embed, last, proj = ("token_embedding", "positional_embedding", "cls_emb"), "ln_final", "text_projection"
    found = [m for m in (getattr(module, n, None) for n in embed) if m is not None]
    groups = [("embeddings", found)] if found else []
    for i, block in enumerate(blocks):
        tail = [getattr(module, last)] if i == len(blocks) - 1 and getattr(module, last, None) is not None else []
        groups.append((f"layer.{i}", [block, *tail]))
    if getattr(module, proj, None) is not None:
        groups.append(("proj", [getattr(module, proj)]))
    return groups


def _parameters(members) -> list[nn.Parameter]:
    return [p for m in members for p in ([m] if isinstance(m, nn.Parameter) else m.parameters())]


def lr_scales(groups: list[tuple[str, list]], decay: float) -> dict[int, float]:
    """{id(parameter): decay ** (G - 1 - k)} for group k of the G groups (open_clip's lr_scales_for_groups)."""
    return {id(p): decay ** (len(groups) - 1 - k) for k, (_, members) in enumerate(groups)
            for p in _parameters(members)}


def lr_of(cfg, net: nn.Module, method_lr_of: Callable[[str], float | None] | None = None):
    """The peak lr of each parameter name of `net` (a method's wrapper, the model at net.model) for param_groups:
    the method's lr_of(name) where it names one (not None: ERCLIP's fusion, m2-Mix's heads, C-CLIP's towers); else
    the parameter's tower's --lr-image / --lr-text, when set; else --lr; then times its tower's layer scale.
    None when every parameter is at --lr (no method rates, no flag): the groups of a run without the flags are
    the ones they were. A flag for a tower the model does not have, or a decay for a tower of another layout,
    is one UsageError."""
    rates = {t: getattr(cfg, f"lr_{t}", 0.0) for t in TOWERS}
    decays = {t: getattr(cfg, f"{t}_layer_decay", 1.0) for t in TOWERS}
    if method_lr_of is None and not any(rates.values()) and all(d == 1.0 for d in decays.values()):
        return None
    model = getattr(net, "model", net)
    tower_of, scale = {}, {}  # id(parameter) -> its tower, its layer scale
    for t in TOWERS:
        if not rates[t] and decays[t] == 1.0:
            continue
        members = tower_members(model, t)
        flags = [f for f, on in ((f"--lr-{t}", rates[t]), (f"--{t}-layer-decay", decays[t] != 1.0)) if on]
        if not members and flags:
            raise UsageError(f"{' / '.join(flags)}: this run's model ({type(model).__name__}) has no {t} tower "
                             f"(an open_clip model's {'visual' if t == 'image' else 'text'} encoder); drop the flag")
        tower_of.update(dict.fromkeys(map(id, _parameters(members)), t))
        if decays[t] != 1.0:
            groups = layer_groups(model, t)
            if groups is None:
                where = type(getattr(model, "visual", None) if t == "image" else getattr(model, "text", model))
                raise UsageError(f"--{t}-layer-decay: the {t} tower ({where.__name__}) is not a transformer of "
                                 f"open_clip's layout (blocks in transformer.resblocks), the one whose layers "
                                 f"are known here; drop the flag, or use --lr-{t} for the whole tower")
            scale.update(lr_scales(groups, decays[t]))
    named = {name: id(p) for name, p in net.named_parameters()}

    def rate(name: str) -> float:
        key = named.get(name)
        base = method_lr_of(name) if method_lr_of is not None else None
        if base is None:
            tower = tower_of.get(key)
            base = rates[tower] if tower and rates[tower] else cfg.lr
        return base * scale.get(key, 1.0)
    return rate
