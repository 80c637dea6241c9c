"""Loading and saving models: the backbone names (OpenAI's spelling, open_clip's, the lab's tiny one), load_model
(open_clip tags, local files, foreign checkpoints, uni-modal towers), the tokenizer cache, save_model with its
sidecar and open_clip's hub layout (export_open_clip). Below common (common imports it); it imports nothing
above it: no common, eval, method file or lab. The lab registers its tiny backbone with open_clip
(register_tiny: open_clip.add_model_config) and hands its synthetic world to the commands it runs as an
argument (LabWorld, `world=`).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Callable

import open_clip
import torch

from plumbing import base, folders, runfolder, towers
from plumbing.base import RunError, UsageError, atomic_write
from plumbing.loading import (_atomic_save, _hub_reachable, _weights_cached, foreign_checkpoint, read_sidecar,
                              state_shapes)


def text_tower(model):
    """The modules of the text encoder, for CLIP (flat) and CustomTextCLIP (model.text)."""
    return model.text if hasattr(model, "text") else model


OPENAI_NAMES = {  # the papers' spelling -> open_clip's
    "RN50": "RN50", "RN101": "RN101", "RN50x4": "RN50x4", "RN50x16": "RN50x16", "RN50x64": "RN50x64",
    "ViT-B/32": "ViT-B-32", "ViT-B/16": "ViT-B-16", "ViT-L/14": "ViT-L-14", "ViT-L/14@336px": "ViT-L-14-336",
}
TINY_NAME = "clipft-tiny"  # the lab's CPU-sized CLIP (lab/tiny.py)

@dataclasses.dataclass(frozen=True)
class LabWorld:
    """The lab's synthetic world, as the lab hands it to what it runs (lab.WORLD, passed as `world=`; a method's
    main() takes it from the lab when its command names the lab). Nothing below the lab imports the lab."""
    tiny_weights: Callable[[], Path]  # the tiny backbone's world-pretrained weights (lab.tiny.pretrain_tiny)
    synthetic_manifest: Callable[..., Path]  # (split, root, n=None) -> manifest: --train-data synthetic
    task_manifests: Callable[[str], list]  # data_root -> [(name, train, test)]: --tasks synthetic
    long_task_manifests: Callable[[str], list]  # the same on long captions: cclip.py --tasks synthetic-long
    label_sets: Callable[[], dict]  # name -> (classnames, templates, column): dns.py --task-classes


def lab_world(world: LabWorld | None, what: str) -> LabWorld:
    """`world`, or one message when a command that names the lab's world was not run through the lab."""
    if world is None:
        raise UsageError(f"{what} is the lab's: run the method's command with it (its main() hands the lab's "
                         f"world on), python -m lab eval|export ARGS, or pass world=lab.WORLD")
    return world


def register_tiny(config: dict):
    """Makes the lab's tiny config known to open_clip under TINY_NAME (open_clip.add_model_config; the lab
    calls it when it is imported)."""
    path = base.CACHE_DIR / "configs" / f"{TINY_NAME}.json"
    if TINY_NAME not in open_clip.list_models():
        try:
            current = json.loads(path.read_text())
        except (OSError, ValueError):  # none yet, or cut short: written again
            current = None
        if current != config:  # atomic_write makes the folder
            atomic_write(path, json.dumps(config))
        open_clip.add_model_config(path)


def tiny_known() -> bool:
    """Whether the lab's tiny config is registered with open_clip (register_tiny: the lab is loaded)."""
    return TINY_NAME in open_clip.list_models()


def wants_lab(cfg) -> bool:
    """Whether a command names the lab (--demo, the tiny backbone, a setting naming the synthetic world);
    method files' main() import the lab (lazily) exactly then."""
    settings = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else vars(cfg)
    return (settings.get("backbone") in ("tiny", "lab-towers")
            or any(v is True for k, v in settings.items() if k.startswith("demo"))
            or any(isinstance(v, str) and "synthetic" in v for v in settings.values()))


def resolve_backbone(name: str) -> str:
    """'ViT-B/16' -> 'ViT-B-16'; 'tiny' -> the registered tiny config."""
    if name == "tiny":
        if not tiny_known():
            raise UsageError("--backbone tiny is the lab's: `import lab` first (the command line does it for "
                             "--demo, --backbone tiny and the synthetic world)")
        return TINY_NAME
    name = OPENAI_NAMES.get(name, name)
    if name.startswith(("hf-hub:", "local-dir:")):  # open_clip's hub names: their config comes with the download
        raise UsageError(f"--backbone {name}: pass the architecture's open_clip name and the downloaded folder: "
                         f"--backbone <its model_cfg's name, e.g. ViT-B-16-SigLIP> --pretrained local-dir:DIR "
                         f"(huggingface-cli download {name.split(':', 1)[1]} --local-dir DIR); runs save and "
                         f"export under that name")
    if name not in open_clip.list_models():
        raise UsageError(f"unknown backbone {name!r}; use an OpenAI name ({', '.join(OPENAI_NAMES)}), "
                         f"'tiny', or one of open_clip.list_models()")
    return name


def openai_name(backbone: str) -> str:
    return {v: k for k, v in OPENAI_NAMES.items()}.get(backbone, backbone)


def load_model(backbone: str = "tiny", pretrained: str = "", device="cpu", cache_dir: str = "",
               quick_gelu: bool | None = None, world: LabWorld | None = None, **towers_kw):
    """Returns (model, train_transform, eval_transform, tokenizer).

    backbone: OpenAI spelling ('ViT-B/16'), open_clip name ('ViT-B-16') or 'tiny'.
    pretrained: '' (OpenAI's weights; the world-pretrained weights for 'tiny'), an open_clip tag ('openai',
      'laion2b_s34b_b88k', ...), a checkpoint path, or 'random' (explicitly untrained).
    world: the lab's (LabWorld), for the tiny backbone's world-pretrained weights.
    QuickGELU is matched to the weights (OpenAI's were trained with it; open_clip's plain configs silently give
    wrong features with them): from the tag's config, our checkpoint sidecar, a foreign layout (Long-CLIP's,
    m2-Mix's: OpenAI-initialised, so on whatever the backbone's spelling), or forced for OpenAI-spelled backbones
    loading a raw file; an explicit quick_gelu contradicting the first three is refused. Never falls back to
    random weights: a download that cannot happen fails at once.
    A dual encoder of uni-modal towers (towers.SPECS, or a file saved from one) is built by towers.load, with
    towers_kw (text_weights, image_weights, seed)."""
    if towers.known(backbone) or os.path.isfile(pretrained) and "towers" in read_sidecar(pretrained):
        model, train_tf, eval_tf, tokenizer = towers.load(backbone, pretrained, device=device, cache_dir=cache_dir,
                                                          **towers_kw)
        return model, train_tf, eval_tf, CachedTokenizer(tokenizer)
    if pretrained.startswith("local-dir:") or pretrained and (os.path.isdir(pretrained) or folders.is_leftover(
            pretrained) or not os.path.exists(pretrained) and folders.leftovers(pretrained)):  # an --export folder
        return load_export(pretrained.removeprefix("local-dir:"), device, backbone)
    name = resolve_backbone(backbone)
    if name == TINY_NAME and pretrained in ("", "synthetic"):
        pretrained = str(lab_world(world, "the tiny backbone's pretrained weights").tiny_weights())
    tags = open_clip.list_pretrained_tags_by_model(name)
    pretrained = pretrained or ("openai" if "openai" in tags or len(tags) != 1 else tags[0])  # SigLIP's: webli
    kwargs = dict(device=device, cache_dir=cache_dir or None)
    context = None  # the text window; a sidecar can carry a stretched one (longclip.py)
    if pretrained == "random":
        model, train_tf, eval_tf = open_clip.create_model_and_transforms(name, pretrained=None, **kwargs)
        return model, train_tf, eval_tf, get_tokenizer(name)
    if os.path.isfile(pretrained):
        meta = model_sidecar(pretrained)
        if meta and meta.get("model") not in (None, name):
            raise UsageError(f"{pretrained} holds a {meta['model']} model, not {name}")
        context = meta.get("context_length") if meta else None
        if meta and meta.get("logit_bias") and "init_logit_bias" not in (open_clip.get_model_config(name) or {}):
            kwargs["init_logit_bias"] = SIGLIP_INIT[1]  # --loss siglip added one (pair_bias); the file holds it
        given, file_qg = pretrained, bool(meta.get("quick_gelu")) if meta else None  # None: the file does not say
        if not meta:  # another program's layout (Long-CLIP's release, m2-Mix's checkpoints): an open_clip copy
            pretrained, context = foreign_checkpoint(pretrained, cache_dir or base.CACHE_DIR)
            file_qg = True if pretrained != str(given) else None  # both OpenAI-initialised: QuickGELU
        if file_qg is not None and quick_gelu is not None and quick_gelu != file_qg:
            raise UsageError(f"{given} was trained with quick_gelu={file_qg} ("
                             f"{'its sidecar' if meta else 'an OpenAI-initialised layout'}); refusing {quick_gelu}")
        if quick_gelu is None:
            quick_gelu = file_qg if file_qg is not None else backbone in OPENAI_NAMES
        context = text_window(given, pretrained, name, context, sidecar=bool(meta and "context_length" in meta))
    else:
        tag_cfg = open_clip.get_pretrained_cfg(name, pretrained)
        if not tag_cfg:
            raise UsageError(f"{pretrained!r} is neither a file nor an open_clip tag of {name} "
                             f"(tags: {open_clip.list_pretrained_tags_by_model(name)})")
        tag_qg = bool(tag_cfg.get("quick_gelu", False))
        if quick_gelu is not None and quick_gelu != tag_qg:
            raise UsageError(f"{name}/{pretrained} was trained with quick_gelu={tag_qg}; refusing {quick_gelu}")
        quick_gelu = tag_qg
        if os.environ.get("HF_HUB_OFFLINE") == "1" or not (_weights_cached(name, pretrained, cache_dir)
                                                           or _hub_reachable()):
            raise RunError(
                f"cannot get the {name} weights '{pretrained}': they are not in the cache "
                f"({cache_dir or 'the Hugging Face / open_clip default cache'}) and the hub is unreachable. "
                f"Download them elsewhere and pass --pretrained /path/to/file.pt (or .bin/.safetensors), "
                f"or --cache-dir DIR holding the hub cache.")
    # force_context_length: open_clip would otherwise squeeze a longer positional
    # embedding into the config's window by interpolation, silently
    try:
        model, train_tf, eval_tf = open_clip.create_model_and_transforms(
            name, pretrained=pretrained, force_quick_gelu=bool(quick_gelu), force_context_length=context, **kwargs)
    except RuntimeError as e:  # torch's load_state_dict(strict=True): the file's tensors are another model's
        if not os.path.isfile(pretrained) or not str(e).startswith("Error(s) in loading state_dict"):
            raise
        raise UsageError(f"{given} does not fit the {name} architecture: {_mismatches(str(e), name)}; pass the "
                         f"backbone it was trained with (--backbone), or weights of {name}") from None
    model.quick_gelu = bool(quick_gelu)  # remembered for the checkpoint sidecar
    return model, train_tf, eval_tf, get_tokenizer(name, context)


SIGLIP_INIT = (math.log(10.0), -10.0)  # SigLIP's t' = log 10 and b = -10 (Zhai et al. 2023, Sec. 3, the bias term)
# --siglip-init open_clip: open_clip_train/main.py (main) asks for SIGLIP_INIT (init_logit_scale, init_logit_bias),
# but create_model then loads the CLIP checkpoint (open_clip/factory.py, load_checkpoint), whose logit_scale
# replaces ln 10 and which, having no logit_bias, gets one of zeros (open_clip issue 712): s kept, b = 0
OPEN_CLIP_SIGLIP_BIAS = 0.0


def pair_bias(model, loss: str, init: str = "paper"):
    """--loss siglip (common.siglip_loss): the model's logit_bias (a SigLIP backbone's own; else one added: init
    "paper" at SIGLIP_INIT, the logit scale set to ln 10; "open_clip" at b = 0, the model's logit scale kept, as
    open_clip's fine-tuning of a CLIP checkpoint starts; its export's config then builds it too); None for
    --loss clip."""
    if init not in ("paper", "open_clip"):
        raise ValueError(f"pair_bias: init is 'paper' or 'open_clip', not {init!r}")
    if loss != "siglip":
        return None
    if getattr(model, "logit_bias", None) is None:
        if init == "paper":
            with torch.no_grad():
                model.logit_scale.fill_(SIGLIP_INIT[0])
        bias = SIGLIP_INIT[1] if init == "paper" else OPEN_CLIP_SIGLIP_BIAS
        model.logit_bias = torch.nn.Parameter(torch.tensor(bias, device=model.logit_scale.device))
    return model.logit_bias


COMPILE_BACKEND = "inductor"  # torch.compile's default (the tests set aot_eager: the same graph capture, no C++ build)


def compile_towers(model) -> list[str]:
    """--torchcompile (open_clip's): torch.compile each tower in place (nn.Module.compile: the module's calls go
    through the compiled graph, its parameters and state_dict names stay, so checkpoints, resume and exports are
    unchanged): a CLIP's visual and text transformer (a custom-text model's text), else every child module that
    holds parameters. Returns the compiled children's names."""
    names = [n for n in ("visual", "transformer", "text") if isinstance(getattr(model, n, None), torch.nn.Module)]
    names = names or [n for n, child in model.named_children() if any(True for _ in child.parameters())]
    for n in names:
        getattr(model, n).compile(backend=COMPILE_BACKEND)
    return names


def load_export(folder, device="cpu", backbone: str | None = None):
    """(model, train_transform, eval_transform, tokenizer) of a folder in open_clip's hub layout (what --export and
    commands.export write): open_clip builds it from the folder's own config, QuickGELU and text window included,
    as open_clip.create_model_from_pretrained('local-dir:FOLDER') does. backbone: the architecture the caller
    will save and export the model as (a run's sidecar, its --export); a folder of another one is refused
    (unchecked for 'tiny' while the lab is not loaded). An interrupted export's leftovers are never loaded."""
    folder = Path(folder)
    if folders.is_leftover(folder):
        real = folder.parent / folders.LEFTOVER.match(folder.name)["name"]
        raise UsageError(f"--pretrained {folder}: the temporary or set-aside copy of an interrupted export into "
                         f"{real}, not a model to load: pass {real} (the next export into it removes this copy)")
    if not folder.is_dir():
        left = folders.leftovers(folder)
        raise UsageError(f"--pretrained {folder}: no such folder" + (
            f"; an export into it was interrupted and left {', '.join(p.name for p in left)}: run the export "
            f"again (it first puts the previous folder back), or rename the .old-* copy to {folder.name}"
            if left else ""))
    config = folder / "open_clip_config.json"
    if not config.is_file() or not (folder / "open_clip_model.safetensors").is_file():
        run = f" (a run folder: pass {folder / 'model.pt'})" if (folder / "model.pt").is_file() else ""
        raise UsageError(f"--pretrained {folder}: a folder, but not open_clip's hub layout (open_clip_config.json "
                         f"and open_clip_model.safetensors){run}; pass a model file, a folder --export wrote, or "
                         f"a tag")
    try:
        cfg = json.loads(config.read_text())["model_cfg"]
        if not isinstance(cfg, dict):
            raise TypeError(f"model_cfg is {type(cfg).__name__}, not an object")
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{config}: not open_clip's config ({type(e).__name__}: {e})") from None
    if backbone and (backbone != "tiny" or tiny_known()):
        name = resolve_backbone(backbone)
        if not same_architecture(cfg, open_clip.get_model_config(name)):
            like = [n for n in open_clip.list_models() if same_architecture(cfg, open_clip.get_model_config(n))]
            said = "tiny" if like and like[0] == TINY_NAME else openai_name(like[0]) if like else None
            raise UsageError(f"--pretrained {folder} holds {'a ' + like[0] if like else 'another'} model, not "
                             f"{name} (--backbone {backbone}); runs save and export it under --backbone, so pass "
                             f"--backbone {said or 'the one it was exported from'}")
    ref = f"local-dir:{folder}"
    model, train_tf, eval_tf = open_clip.create_model_and_transforms(ref, device=device)
    model.quick_gelu = bool(cfg.get("quick_gelu", False))  # remembered for a later save's sidecar
    return model, train_tf, eval_tf, CachedTokenizer(open_clip.get_tokenizer(ref))


SIDECAR_FIELDS = {"model": (str, "a backbone name"), "backbone": (str, "a backbone name"),
                  "quick_gelu": (bool, "true or false"), "context_length": (int, "a whole number of positions >= 1"),
                  "towers": (dict, "an object"), "logit_bias": (bool, "true or false")}


def same_architecture(a: dict, b: dict) -> bool:
    """Whether two open_clip model configs build the same modules: every key both hold agrees, QuickGELU and
    the text window aside (an export records the weights' own; Long-CLIP stretches the window)."""
    for key in a.keys() & b.keys():
        if key in ("quick_gelu", "context_length"):
            continue
        both_dicts = isinstance(a[key], dict) and isinstance(b[key], dict)
        if not (same_architecture(a[key], b[key]) if both_dicts else a[key] == b[key]):
            return False
    return True


def model_sidecar(path) -> dict:
    """read_sidecar(path) with the fields load_model reads checked: a wrong type is one message naming the file."""
    meta = read_sidecar(path)
    for key, (kind, what) in SIDECAR_FIELDS.items():
        v = meta.get(key)
        right = isinstance(v, kind) and not (kind is int and (isinstance(v, bool) or v < 1))  # bool is an int
        if key in meta and not right:
            raise UsageError(f"{path}.json, the sidecar of {path}: {key} is {json.dumps(v)[:80]}, not {what}; "
                             f"restore it, or delete it to read {path} as a plain state_dict")
    return meta


def text_window(given, file, name: str, context: int | None, sidecar: bool) -> int | None:
    """The text window to build for weights `file` (from `given`): the rows of their positional embedding. A sidecar's
    (or a foreign layout's) context_length that disagrees is refused, never met by interpolation (open_clip would
    stretch or squeeze the table silently); without one the weights' window is built, with a line when it is not the
    config's. A text width other than the config's is another architecture: refused."""
    shapes = state_shapes(file)
    key = next((k for k in ("positional_embedding", "text.positional_embedding") if k in (shapes or {})), None)
    if key is None or len(shapes[key]) != 2:
        return context
    text_cfg = open_clip.get_model_config(name)["text_cfg"]
    cfg = open_clip.model.CLIPTextCfg(**text_cfg)
    extra = 1 if text_cfg.get("embed_cls") else 0  # CoCa's class token has a position of its own
    rows, width = shapes[key]
    if width != cfg.width:
        raise UsageError(f"{given}: its text positional embedding is {width} wide, {name}'s text tower "
                         f"{cfg.width}: weights of another architecture; pass the backbone it was trained with")
    if context is not None and rows != context + extra:
        raise UsageError(f"{given}: {'its sidecar ' + str(given) + '.json' if sidecar else 'its layout'} says "
                         f"context_length {context}, but the weights' positional embedding has {rows - extra} "
                         f"positions; refusing to interpolate between them: restore the sidecar (or delete it to "
                         f"load the weights' own window)")
    if context is None and rows != cfg.context_length + extra:
        print(f"[clipft] {given}: the weights' text window is {rows - extra} positions ({name}'s config: "
              f"{cfg.context_length}): built with {rows - extra}", file=sys.stderr)
    return rows - extra


def _mismatches(message: str, name: str) -> str:
    """torch's load_state_dict error in a few clauses: the first three differences, and how many more."""
    size = re.compile(r"size mismatch for (\S+): copying a param with shape torch.Size\((\[.*?\])\) from checkpoint, "
                      r"the shape in current model is torch.Size\((\[.*?\])\)")
    lines = [ln.strip() for ln in message.splitlines()[1:] if ln.strip()]
    said = [base.shorten(size.sub(rf"\1 is \2 in the file, \3 in {name}", ln).rstrip(".")) for ln in lines]
    return "; ".join(said[:3]) + (f" (and {len(said) - 3} more)" if len(said) > 3 else "")


def get_tokenizer(backbone: str, context_length: int | None = None):
    """open_clip's tokenizer of the backbone (context_length: pad / truncate to that window instead, end token
    kept in the last slot), remembering the last 65,536 texts: captions come back every epoch and evaluation,
    prompts every zero-shot head, and the pure-Python BPE costs ~60 us a text."""
    name = resolve_backbone(backbone)
    model_cfg = open_clip.get_model_config(name)
    config = json.dumps(model_cfg, sort_keys=True)
    hf = (model_cfg or {}).get("text_cfg", {}).get("hf_tokenizer_name")

    def unreachable(why):
        return RunError(f"{name}'s tokenizer is the Hugging Face hub's {hf}: not in the cache and the hub is "
                        f"unreachable ({why}); download it elsewhere (huggingface-cli download {hf}) and set "
                        f"HF_HOME to that cache")
    # asked first: offline, transformers reaches its OSError only after ~30 s of hub retries (issue 68.4)
    if hf and not _tokenizer_cached(hf) and (os.environ.get("HF_HUB_OFFLINE") == "1" or not _hub_reachable()):
        raise unreachable("HF_HUB_OFFLINE=1" if os.environ.get("HF_HUB_OFFLINE") == "1" else "no connection")
    try:
        return _cached_tokenizer(name, context_length, config)
    except OSError as e:  # transformers' own: an HF tokenizer (SigLIP's) neither cached nor reachable
        raise unreachable(base.shorten(str(e).splitlines()[0], 120)) from None


def _tokenizer_cached(repo: str) -> bool:
    """A Hugging Face tokenizer's files in the hub cache (what transformers reads offline)."""
    from huggingface_hub import try_to_load_from_cache
    return any(isinstance(try_to_load_from_cache(repo, f), str) for f in ("tokenizer.json", "tokenizer_config.json"))


@functools.lru_cache(maxsize=None)
def _cached_tokenizer(name: str, context_length: int | None, config: str):
    """One CachedTokenizer per (backbone, window, config) in a process: its remembered texts serve every model
    loaded after (the lab's demos load a model per run; tokens depend on the text alone)."""
    return CachedTokenizer(_open_clip_tokenizer(name, context_length, config))


@functools.lru_cache(maxsize=None)
def _open_clip_tokenizer(name: str, context_length: int | None, config: str):
    """open_clip.get_tokenizer builds its tokenizer anew on every call (the BPE merges read and parsed: ~0.12 s of
    CPU, a quarter of loading the tiny model); one per (backbone, window, model config) serves every model: it
    keeps no state but its BPE memo. `config` is in the key so that a re-registered config gets its own."""
    return open_clip.get_tokenizer(name, context_length=context_length)


class CachedTokenizer:
    """tokenizer(texts) -> (N, context) LongTensor, the same as the wrapped tokenizer's; other attributes pass."""
    def __init__(self, tokenizer, size: int = 1 << 16):
        self.tokenizer, self.size, self.rows = tokenizer, size, {}

    def __call__(self, texts, context_length: int | None = None):
        texts = [texts] if isinstance(texts, str) else list(texts)
        new = list(dict.fromkeys(t for t in texts if (t, context_length) not in self.rows))
        if new:
            if len(self.rows) + len(new) > self.size:  # full: start afresh with every text of this call
                self.rows.clear()
                new = list(dict.fromkeys(texts))
            tokens = self.tokenizer(new) if context_length is None else self.tokenizer(new, context_length)
            self.rows.update(((t, context_length), r) for t, r in zip(new, tokens.clone()))
        return torch.stack([self.rows[(t, context_length)] for t in texts])

    def __getattr__(self, name):  # only for names the wrapper lacks (unpickling asks before __dict__ is set)
        if name == "tokenizer":
            raise AttributeError(name)
        return getattr(self.tokenizer, name)


def save_model(model, path, backbone: str, source: str = "", twin: bool = True):
    """A plain open_clip state_dict (open_clip.create_model_and_transforms(name, pretrained=path) loads it) plus
    a JSON sidecar `path.json` with what is needed to rebuild it; twin: a .pt also gets a .safetensors copy."""
    path = Path(path)
    sd = {k.removeprefix("module."): v.detach().cpu() for k, v in model.state_dict().items()}
    bad = [k for k in sd if "lora" in k.lower() or "parametrizations" in k]
    if bad:
        raise ValueError(f"save_model: adapter keys left in the state_dict ({bad[:3]}...); merge first")
    _atomic_save(sd, path)
    name = resolve_backbone(backbone)
    pp = getattr(model.visual, "preprocess_cfg", {})
    meta = {"model": name, "backbone": backbone, "source_weights": source,
            "quick_gelu": bool(getattr(model, "quick_gelu", False)),
            "context_length": int(text_tower(model).context_length),
            **({"logit_bias": True} if getattr(model, "logit_bias", None) is not None else {}),
            "preprocess": {k: (list(v) if isinstance(v, tuple) else v) for k, v in pp.items()},
            "open_clip": open_clip.__version__, "torch": torch.__version__}
    if hasattr(model, "towers"):  # uni-modal towers: their config and the text tower's folder (towers.py)
        meta["towers"] = towers.sidecar(model, path)
    atomic_write(Path(str(path) + ".json"), json.dumps(meta, indent=1))
    if path.suffix == ".pt" and twin:  # the same tensors as safetensors (no pickle), with the same sidecar
        safe = path.with_suffix(".safetensors")
        atomic_write(safe, lambda tmp: safetensors_save(sd, tmp))
        atomic_write(Path(str(safe) + ".json"), json.dumps(meta, indent=1))
    return path


def safetensors_save(sd: dict, path):
    """safetensors' save_file, with the mode every other file gets (it creates 0600 files, whatever the umask)."""
    from safetensors.torch import save_file  # installed with open_clip
    save_file({k: v.detach().cpu().contiguous() for k, v in sd.items()}, str(path))
    folders.follow_umask(path)


def open_clip_config(model, backbone: str) -> dict:
    """open_clip_config.json for `model` (open_clip's hub layout): the backbone's model_cfg with the weights'
    QuickGELU and text window, which plain open_clip would otherwise get wrong (GELU for OpenAI weights; a
    stretched window interpolated back), and the preprocessing open_clip's push_to_hub records."""
    cfg = copy.deepcopy(open_clip.get_model_config(resolve_backbone(backbone)))
    cfg["quick_gelu"] = bool(getattr(model, "quick_gelu", False))
    if getattr(model, "logit_bias", None) is not None:  # --loss siglip gave a CLIP backbone one (pair_bias)
        cfg.setdefault("init_logit_bias", SIGLIP_INIT[1])
    cfg.setdefault("text_cfg", {})["context_length"] = int(text_tower(model).context_length)
    pp = getattr(model.visual, "preprocess_cfg", {})
    keep = {k: (list(v) if isinstance(v, tuple) else v) for k, v in pp.items()
            if k in ("mean", "std", "interpolation", "resize_mode")}
    return {"model_cfg": cfg, "preprocess_cfg": keep}


EXPORT_RECEIPT = "export_receipt.json"  # the files an export wrote: only such a folder is ever replaced (issue 55.1)


def check_export(folder, flag: str = "--export", out=None):
    """Before anything is trained or loaded: `folder` must be a new path, an empty folder or a previous export
    holding nothing but what it wrote (it is replaced whole, folders.atomic_folder; a run folder, a downloaded
    model or an export with files added is refused, naming them), where this process can write
    (folders.check_target), and neither the run's --out `out` nor a folder holding it (replacing it would remove
    the run). One UsageError otherwise."""
    folders.check_target(folder, flag, EXPORT_RECEIPT)
    if out is not None:
        target, run = Path(os.path.realpath(folder)), Path(os.path.realpath(out))
        if target == run or target in run.parents:
            raise UsageError(f"{flag} {folder}: the run's --out {out} is {'that folder' if target == run else 'in it'}"
                             f"; an export replaces its folder whole and would remove the run: give a folder "
                             f"outside --out (a subfolder of --out is fine)")


def export_open_clip(model, folder, backbone: str) -> Path:
    """open_clip's hub layout in `folder`: open_clip_model.safetensors and open_clip_config.json, so that
    open_clip.create_model_from_pretrained('local-dir:<folder>') (or 'hf-hub:<repo>' after an upload) builds the
    same model with the same features. Models with an HF tokenizer name it in model_cfg; OpenAI's BPE ships with
    open_clip. Written whole or not at all (folders.atomic_folder: a kill leaves the previous export or this one)."""
    check_export(folder)
    sd = {k.removeprefix("module."): v for k, v in model.state_dict().items()}
    config = json.dumps(open_clip_config(model, backbone), indent=2)

    def write(tmp: Path):
        safetensors_save(sd, tmp / "open_clip_model.safetensors")
        (tmp / "open_clip_config.json").write_text(config)
    return folders.atomic_folder(folder, write, marker=EXPORT_RECEIPT)


def export_after_training(model, folder, backbone: str, run_model: Path) -> dict:
    """--export at the end of a run: the summary's entry. A failure (full disk, a folder that turned unusable) is
    printed with the command that exports the saved model, and the run goes on to write its results (then
    exits 1: export_failure); SIGINT / SIGTERM during the export stop the run with one message naming what is
    saved and the commands that finish it."""
    command = f"python -m commands.export --backbone {backbone} --pretrained {run_model} --out {folder}"
    try:
        return {"export": str(export_open_clip(model, folder, backbone))}
    except folders.FolderInterrupted as e:
        raise RunError(f"{e}. Training had finished and its model is saved as {run_model}; results.json is not "
                       f"written. Finish the run (evaluation and export, no training) with:\n  "
                       f"{runfolder.resume_command()}\nor export the saved model alone with:\n  {command}",
                       e.code) from None
    except (RunError, UsageError, OSError) as e:
        print(f"[export] --export {folder} failed: {base.printable(str(e))}; the run goes on and writes its "
              f"results; export the saved model later with: {command}", file=sys.stderr)
        return {"export_failed": str(e), "export_command": command}


def save_trained(model, cfg, out: Path) -> dict:
    """The end of common.train (rank 0): the trained model as <out>/model.pt (save_model: its sidecar and
    .safetensors twin), then --export's folder (export_after_training); returns the summary's export entries."""
    save_model(model, out / "model.pt", cfg.backbone, source=cfg.pretrained or "default")
    return export_after_training(model, cfg.export, cfg.backbone, out / "model.pt") if cfg.export else {}


def export_failure(results: dict, written) -> None:
    """After a run's results are written (common.write_results): the run ends with one message and exit code 1
    when its --export failed (export_after_training's entry, in results['summary'] or at the top)."""
    summary = results.get("summary") if isinstance(results.get("summary"), dict) else results
    if summary.get("export_failed"):
        raise RunError(f"the run finished and its results are in {written}, but its --export failed: "
                       f"{summary['export_failed']}. Export the saved model with:\n  {summary['export_command']}")
