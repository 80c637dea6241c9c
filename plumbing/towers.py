"""Dual encoders of uni-modal pre-trained towers as open_clip models: a timm
image tower and a Hugging Face text tower, each with a linear projection to a
shared embedding, and a learned temperature (m2-Mix, Oh et al., NeurIPS 2023,
arXiv 2203.03897, Sec. 5.4: BERT + ResNet-50 fine-tuned on Flickr30k). The
weights are found offline and never downloaded; models.load_model comes here
for a backbone named in SPECS, or for a checkpoint whose sidecar says "towers".

  bert-resnet50   timm's resnet50 trunk (torchvision's ImageNet-1k weights,
                  the released code's models.resnet50(pretrained=True)) and
                  bert-base-uncased; heads 2048 -> 256 and 768 -> 256 (the code)

Where the weights are looked for, in order (nothing is downloaded):
  text    --text-weights DIR: a save_pretrained folder (config.json, the tokenizer's files, the weights); else
          the Hugging Face cache (--cache-dir, else HF_HUB_CACHE / HF_HOME) for the spec's repo ids
  image   --image-weights FILE: a state_dict of the trunk, torchvision's or timm's keys (.pth/.pt/.bin/
          .safetensors); else torchvision's cache (TORCH_HOME/hub/checkpoints), else the HF cache of timm's copy
A tower that is not found stops the run before training with one message saying what was looked for and where.
pretrained='random' (m2mix.py --random-init) keeps the towers' architecture and tokenizer (the text tower's
folder is still needed) and draws every weight at random: for smoke runs only.

Checks open_clip does not make: its pretrained_image_path loads with strict=False and only logs a mismatch (a
torchvision file, whose keys lack 'trunk.', would load nothing); here every trunk weight but the classifier must
come from the file, or the run stops naming the missing keys.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import open_clip
import torch

from plumbing import base
from plumbing.base import RunError, UsageError, atomic_write
from plumbing.loading import load_weights_only, read_sidecar, weights_loaded_next

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # what torchvision's ResNet-50 saw


@dataclass(frozen=True)
class Towers:
    """One dual encoder of uni-modal towers: what open_clip builds and where its weights are looked for."""
    image: str  # timm model name of the image trunk
    text_repos: tuple = ()  # Hugging Face repo ids of the text tower (the cache is searched for each)
    image_files: tuple = ()  # trunk weight files: absolute, or names in torchvision's hub cache
    image_repos: tuple = ()  # Hugging Face repo ids of the trunk's weights (timm's copies)
    text_dirs: tuple = ()  # text tower folders tried before the cache (the lab's shipped towers)
    embed_dim: int = 256  # the code's projection size (main.py, --noclip)
    image_size: int = 224
    context_length: int = 200  # the code's max_length (dynamic padding; ours pads, encode_text trims: the same)
    pooler: str = "cls_last_hidden_state_pooler"  # the code: CLS of BERT's last hidden state
    mean: tuple = IMAGENET_MEAN
    std: tuple = IMAGENET_STD
    init_tau: float = 0.01  # the code's temperature, fixed there; learned here from this start
    extra: dict = field(default_factory=dict)  # more vision_cfg keys (the lab's small trunk)


SPECS = {
    "bert-resnet50": Towers(image="resnet50", text_repos=("google-bert/bert-base-uncased", "bert-base-uncased"),
                            image_files=("resnet50-0676ba61.pth",), image_repos=("timm/resnet50.tv_in1k",)),
}
POOLERS = {"cls": "cls_last_hidden_state_pooler", "mean": "mean_pooler"}  # m2mix.py --text-pool


def known(backbone: str) -> bool:
    return backbone in SPECS


def find_text(spec: Towers, text_weights: str = "", cache_dir: str = "") -> tuple[Path | None, list[str]]:
    """(the text tower's folder or None, the places looked at)."""
    from huggingface_hub import snapshot_download
    if text_weights:
        d = Path(text_weights)
        return (d if (d / "config.json").is_file() else None), [f"{d}/config.json (--text-weights)"]
    looked = []
    for d in spec.text_dirs:
        looked.append(str(d))
        if (Path(d) / "config.json").is_file():
            return Path(d), looked
    for repo in spec.text_repos:
        looked.append(f"{repo} in the Hugging Face cache ({cache_dir or 'HF_HUB_CACHE / HF_HOME default'})")
        try:
            d = Path(snapshot_download(repo, cache_dir=cache_dir or None, local_files_only=True))
        except Exception:  # noqa: BLE001  not cached (huggingface_hub raises several kinds)
            continue
        if (d / "config.json").is_file():
            return d, looked
    return None, looked


def find_image(spec: Towers, image_weights: str = "", cache_dir: str = "") -> tuple[Path | None, list[str]]:
    """(the trunk's weight file or None, the places looked at)."""
    from huggingface_hub import try_to_load_from_cache
    if image_weights:
        return (Path(image_weights) if Path(image_weights).is_file() else None), [f"{image_weights} (--image-weights)"]
    hub = Path(os.environ.get("TORCH_HOME", Path.home() / ".cache" / "torch")) / "hub" / "checkpoints"
    looked = []
    for f in spec.image_files:
        p = Path(f) if os.path.isabs(f) else hub / f
        looked.append(str(p))
        if p.is_file():
            return p, looked
    for repo in spec.image_repos:
        looked.append(f"{repo} in the Hugging Face cache")
        for name in ("model.safetensors", "pytorch_model.bin"):
            p = try_to_load_from_cache(repo, name, cache_dir=cache_dir or None)
            if isinstance(p, str):
                return Path(p), looked
    return None, looked


def model_config(spec: Towers, text_dir, pretrained_text: bool) -> dict:
    """The open_clip model config: timm trunk + avg pool + linear head with bias (the code's nn.Linear(2048, d));
    HF text tower + CLS pooler + open_clip's linear projection (no bias: deviation T1 of m2mix.py)."""
    return {"embed_dim": spec.embed_dim, "init_logit_scale": math.log(1 / spec.init_tau), "custom_text": True,
            "vision_cfg": {"image_size": spec.image_size, "timm_model_name": spec.image, "timm_model_pretrained": False,
                           "timm_pool": "avg", "timm_proj": "linear", "timm_proj_bias": True, **spec.extra},
            "text_cfg": {"hf_model_name": str(text_dir), "hf_tokenizer_name": str(text_dir),
                         "hf_model_pretrained": pretrained_text, "hf_proj_type": "linear",
                         "hf_pooler_type": spec.pooler, "context_length": spec.context_length}}


def refuse_remote_code(folder) -> None:
    """Stops, with one message, before transformers reads a folder that asks to run its own Python: an
    `auto_map` in config.json or tokenizer_config.json, or a config.json without a `model_type` that
    transformers ships. open_clip's HF text tower calls AutoConfig / AutoModel / AutoTokenizer without
    trust_remote_code, so transformers would ask "run the custom code? [y/N]" on a terminal (and run it on
    `y`), or trace back without one. Nothing in this repository ever runs a model folder's code."""
    from transformers import CONFIG_MAPPING
    folder = Path(folder)
    for name in ("config.json", "tokenizer_config.json"):
        try:
            meta = json.loads((folder / name).read_text(encoding="utf-8"))
        except FileNotFoundError:
            continue
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise RunError(f"{folder / name}: not readable as JSON ({e})") from None
        if not isinstance(meta, dict):
            raise RunError(f"{folder / name}: holds a {type(meta).__name__}, not a JSON object")
        if "auto_map" in meta:
            raise RunError(f"{folder / name} asks to run Python code from its folder (auto_map: "
                           f"{sorted(meta['auto_map']) if isinstance(meta['auto_map'], dict) else meta['auto_map']}"
                           f"): refused; a text tower must be a model type transformers ships (bert, roberta, ...)")
        if name == "config.json" and meta.get("model_type") not in CONFIG_MAPPING:
            raise RunError(f"{folder / name}: model_type {meta.get('model_type')!r} is not one transformers "
                           f"ships: refused (a folder of another kind would need its own code to run)")


def _register(name: str, cfg: dict):
    path = base.CACHE_DIR / "configs" / f"{name}.json"
    atomic_write(path, json.dumps(cfg, indent=1))
    open_clip.add_model_config(path)  # the latest registration of a name wins


def _quiet_transformers():
    """transformers' 'weights not used / newly initialised' lines (BERT's MLM head, the pooler we drop)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise UsageError("the towers' text side needs transformers: pip install -r requirements.txt") from None
    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    stack = contextlib.ExitStack()
    stack.callback(hf_logging.set_verbosity, level)
    if bars:
        stack.callback(hf_logging.enable_progress_bar)
    return stack


def _read_state(path) -> dict:
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file
        return load_file(str(path))
    sd = load_weights_only(path)
    for key in ("state_dict", "model", "model_state_dict"):  # training scripts' wrappers
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    if not isinstance(sd, dict):
        raise RunError(f"{path} holds a {type(sd).__name__}, not a state_dict of the image trunk")
    return {k.removeprefix("module."): v for k, v in sd.items()}


def load_trunk(model, path, image: str):
    """The image trunk's weights from a torchvision / timm state_dict; every trunk weight but the classifier must
    be in the file (open_clip's pretrained_image_path would skip a mismatch with a log line)."""
    sd = _read_state(path)
    sd = {k.removeprefix("trunk."): v for k, v in sd.items() if not k.startswith(("fc.", "head.", "classifier."))}
    own = model.visual.trunk.state_dict()
    missing, unexpected = [k for k in own if k not in sd], [k for k in sd if k not in own]
    shapes = [k for k in sd if k in own and sd[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        raise RunError(f"{path} is not a {image} trunk: missing {missing[:3]}, unexpected {unexpected[:3]}, other "
                       f"shapes {shapes[:3]} ({len(missing)} / {len(unexpected)} / {len(shapes)} keys)")
    model.visual.trunk.load_state_dict(sd)


def _seeded(seed: int):
    """The heads' random initialisation drawn from `seed` (the same on every rank), the global RNG untouched."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.random.fork_rng(devices=[]))
    torch.manual_seed(seed)
    return stack


def load(backbone: str, pretrained: str = "", device="cpu", cache_dir: str = "", text_weights: str = "",
         image_weights: str = "", seed: int = 0, embed_dim: int = 0, pool: str = "cls", clean: str = "open_clip"):
    """(model, train_transform, eval_transform, tokenizer) as models.load_model returns them. clean: 'open_clip'
    (its HFTokenizer runs ftfy and unescapes HTML entities before BERT) or 'none' (the captions as given, as the
    released m2-Mix code hands them to BertTokenizer: T7).
    pretrained: '' (the towers' pre-trained weights, found offline), 'random', or a checkpoint file that
    models.save_model wrote for this backbone (its sidecar carries the config and the text tower's folder)."""
    meta = read_sidecar(pretrained) if pretrained and os.path.isfile(pretrained) else {}
    if pretrained not in ("", "random") and not meta.get("towers"):
        raise UsageError(f"--pretrained {pretrained!r}: for {backbone} give '' (the towers' weights), 'random', or "
                         f"a model file this repository saved for it (with its .json sidecar)")
    if meta:
        t = meta["towers"]
        name, cfg = t["backbone"], t["model_cfg"]
        text_dir = Path(pretrained).parent / t["text_dir"]
        cfg["text_cfg"].update(hf_model_name=str(text_dir), hf_tokenizer_name=str(text_dir), hf_model_pretrained=False)
        image_file, norm = None, (meta["preprocess"]["mean"], meta["preprocess"]["std"])
    else:
        name, spec = backbone, dataclasses.replace(SPECS[backbone], pooler=POOLERS[pool],
                                                   embed_dim=embed_dim or SPECS[backbone].embed_dim)
        text_dir, looked = find_text(spec, text_weights, cache_dir)
        if text_dir is None:
            raise RunError(f"{backbone}: the text tower ({', '.join(spec.text_repos) or 'its folder'}) is not here; "
                           f"looked at: {'; '.join(looked)}. Pass --text-weights DIR (a save_pretrained folder with "
                           f"config.json, the tokenizer and the weights) or --cache-dir holding the Hugging Face cache")
        image_file, looked = (None, []) if pretrained == "random" else find_image(spec, image_weights, cache_dir)
        if image_file is None and pretrained != "random":
            raise RunError(f"{backbone}: the image trunk's weights ({spec.image}) are not here; looked at: "
                           f"{'; '.join(looked)}. Pass --image-weights FILE (a torchvision or timm state_dict); "
                           f"--random-init trains random towers (smoke runs only)")
        cfg, norm = model_config(spec, text_dir, pretrained_text=pretrained != "random"), (spec.mean, spec.std)
    refuse_remote_code(text_dir)  # before open_clip hands the folder to transformers (issue 41.0)
    _register(name, cfg)
    with _quiet_transformers(), _seeded(seed), weights_loaded_next() if meta else contextlib.nullcontext():
        model, train_tf, eval_tf = open_clip.create_model_and_transforms(
            name, pretrained=None, pretrained_text=cfg["text_cfg"]["hf_model_pretrained"], device=device,
            image_mean=tuple(norm[0]), image_std=tuple(norm[1]))
    if image_file is not None:
        load_trunk(model, image_file, cfg["vision_cfg"]["timm_model_name"])
    if meta:
        sd = _read_state(pretrained)
        model.load_state_dict(sd)
    model.towers = {"backbone": name, "model_cfg": cfg, "text_dir": str(text_dir)}  # for save_model's sidecar
    tokenizer = open_clip.get_tokenizer(name)  # a new HFTokenizer (models.load_model caches its output)
    if clean == "none":  # T7: no ftfy / HTML unescaping (BERT's own normalisation still applies)
        tokenizer.clean_fn = str
    return model, train_tf, eval_tf, tokenizer


def sidecar(model, path) -> dict:
    """What save_model's sidecar keeps for a towers model: its config, and the text tower's config and tokenizer
    copied into a folder beside the file (no weights: those are in the file), so the file loads on its own."""
    from transformers import AutoTokenizer
    t = model.towers
    folder = Path(path).parent / f"{Path(path).stem}-text"
    folder.mkdir(parents=True, exist_ok=True)
    model.text.config.save_pretrained(folder)  # CustomTextCLIP's text tower
    with _quiet_transformers():
        AutoTokenizer.from_pretrained(t["text_dir"], trust_remote_code=False).save_pretrained(folder)
    cfg = json.loads(json.dumps(t["model_cfg"]))
    cfg["text_cfg"].update(hf_model_name=folder.name, hf_tokenizer_name=folder.name)
    return {"backbone": t["backbone"], "model_cfg": cfg, "text_dir": folder.name}


def tower_settings(cfg) -> dict:
    """models.load_model's settings of a towers backbone (load) from m2mix.py's config; none for CLIP."""
    if not known(cfg.backbone):
        return {}
    if cfg.tower_dim < 0:
        raise UsageError(f"--tower-dim {cfg.tower_dim}: the embedding needs a size >= 1 (0: the spec's)")
    if cfg.export:  # open_clip's hub layout would name a text tower folder of this machine
        raise UsageError("--export is not for towers: model.pt, its sidecar and model-text/ load as they are")
    return dict(text_weights=cfg.text_weights, image_weights=cfg.image_weights, seed=cfg.seed,
                embed_dim=cfg.tower_dim, pool=cfg.text_pool, clean=cfg.caption_cleaning)
