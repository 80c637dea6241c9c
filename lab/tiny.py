"""The lab's tiny CLIP: its open_clip config, its pretraining on the world's
short alt-text captions (cached in CLIPFT_CACHE), and the measurements every
demo takes on the world (one image pass per model). ClipFineTune, plain CLIP
fine-tuning on common.train, is the pretraining's wrapper and the baseline of
the training loop's tests and of benchmarks/."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import socket
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import open_clip
import torch

from plumbing import base, models
from plumbing.loading import weights_loaded_next, _atomic_save
import common
from plumbing.base import RunError, UsageError, atomic_write
from plumbing.flags import Config
import eval as evaluation
from lab.world import (AS_DRAWN, IMAGE_SIZE, PRETRAIN, TASK_DOMAINS, LongCaptions, finetune_classes, label_sets, render,
                       synthetic_manifest, world_fingerprint, world_split, world_texts)

# =============================================================================
# 3. The tiny backbone
# =============================================================================
# Chosen by measurement on 2 CPU cores (README, "The lab"): 32 px images in
# 8 px patches (16 tokens) keep a step cheap (the previous world's 48 px images
# gave 36); 10,000 scenes x 3 epochs fit the 90 s budget (12,000 x 4 took
# about 120 s); a 24-token text context truncates
# long captions the way 77 tokens truncate ShareGPT4V's.
TINY_CFG = {
    "embed_dim": 128, "quick_gelu": False,
    "vision_cfg": {"image_size": IMAGE_SIZE, "layers": 4, "width": 128, "patch_size": 8, "head_width": 32},
    "text_cfg": {"context_length": 24, "vocab_size": 49408, "width": 128, "heads": 4, "layers": 4},
}
# version: bump when the recipe's code changes (the config, the recipe and the
# world's fingerprint are part of the key anyway)
TINY_PRETRAIN = dict(n=40000, epochs=10, batch=256, lr=1e-3, wd=0.1, warmup_pct=5, seed=0, version=5)
# long-world-3 (issue 71.2; lab/calibrate.py's docstring): the same recipe on alt-texts that never use the long
# captions' register ("there is a ... at the top left and ..."), as web alt-text never reads like GPT4-Vision's
# captions: the same scenes, pictures and draws, the 30 % drawn descriptive keeping their plain alt-text
PLAIN_ALT = {**TINY_PRETRAIN, "descriptive": False}
RECIPES = {"": TINY_PRETRAIN, "plain-alt": PLAIN_ALT}  # python -m lab.tiny --write-weights [NAME]
WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"  # the shipped weights, one file per recipe key
WRITE_COMMAND = "python -m lab.tiny --write-weights"


class ClipFineTune(common.Method):
    """Plain CLIP fine-tuning: the baseline every method is compared with, and the template of a method's model
    wrapper."""
    def __init__(self, model, label_smoothing: float = 0.0):
        super().__init__()
        self.model, self.label_smoothing = model, label_smoothing

    def features(self, batch, ctx=None):
        return {"img": self.model.encode_image(batch["image"], normalize=True),
                "txt": common.encode_text(self.model, batch["text"])}

    def losses(self, f, ctx=None):
        img, txt = common.gather(f["img"], f["txt"])
        return {"loss_clip": common.clip_loss(img, txt, self.model.logit_scale.exp(), self.label_smoothing)}


class _PretrainScenes(torch.utils.data.Dataset):
    """Pretraining scenes held in memory as normalised tensors (rendered once)."""
    def __init__(self, scenes, seed):
        mean = torch.tensor(open_clip.OPENAI_DATASET_MEAN).view(3, 1, 1)
        std = torch.tensor(open_clip.OPENAI_DATASET_STD).view(3, 1, 1)
        pix = np.stack([np.asarray(render(s, seed=seed + i)) for i, s in enumerate(scenes)])  # (N, H, W, 3)
        self.images = (torch.from_numpy(pix).permute(0, 3, 1, 2).float() / 255 - mean) / std
        self.captions = [s["caption"] for s in scenes]

    def __len__(self):
        return len(self.captions)

    def __getitem__(self, i):
        return {"image": self.images[i], "caption": self.captions[i]}


def recipe_key(recipe: dict | None = None) -> str:
    """What names a set of pretrained weights: the model config, the recipe and the world they were trained on."""
    return hashlib.sha1(json.dumps([TINY_CFG, recipe or TINY_PRETRAIN, world_fingerprint()],
                                   sort_keys=True).encode()).hexdigest()[:10]


def world_token_ids() -> list[int]:
    """Every token id a text of the lab can contain (captions, long captions and
    prompts of every split). The tokenizer splits text into words before its BPE,
    so a text's tokens are those of its words: the words of every template and
    of 300 scenes of every domain cover them (a test checks fresh captions)."""
    tok = open_clip.SimpleTokenizer()  # encode(): no context cut (Long-CLIP stretches the window)
    return sorted({i for t in world_texts() for i in tok.encode(t)} | {tok.sot_token_id, tok.eot_token_id})


def _token_init(seed: int, shape) -> torch.Tensor:
    """The token embedding's initial rows, N(0, 0.02^2) as open_clip draws them
    but from numpy's PCG64, whose stream is the same on every machine: the rows
    no lab text uses never train (embeddings get no weight decay), so the
    shipped file leaves them out and load_shipped rebuilds them exactly."""
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * np.float32(0.02))


def shipped_path(key: str | None = None) -> Path:
    return WEIGHTS_DIR / f"tiny-{key or recipe_key()}.pt"


def write_command(recipe: dict | None = None) -> str:
    """The command that pretrains `recipe` (default: the shipped TINY_PRETRAIN) and writes its shipped file."""
    if recipe is None or recipe == TINY_PRETRAIN:
        return WRITE_COMMAND
    name = next((k for k, v in RECIPES.items() if k and v == recipe), None)
    return f"{WRITE_COMMAND} {name}" if name else f"lab.tiny.write_weights({recipe})"


def write_shipped(model, path: Path, recipe: dict, seconds: float) -> Path:
    """The shipped form of pretrained weights: every tensor but the token
    embedding, which keeps only the rows of world_token_ids(); a card
    path.json records the recipe, the key and the file's sha256."""
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    ids = torch.tensor(world_token_ids())
    emb = sd.pop("token_embedding.weight")
    _atomic_save({"state": sd, "token_ids": ids, "token_rows": emb[ids].clone()}, path)
    card = {"key": path.stem.removeprefix("tiny-"), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "config": TINY_CFG, "recipe": recipe, "world": world_fingerprint(), "command": write_command(recipe),
            "pretrain_seconds": round(seconds), "torch": torch.__version__, "open_clip": open_clip.__version__}
    atomic_write(Path(f"{path}.json"), json.dumps(card, indent=1))
    return path


def load_shipped(path: Path) -> dict:
    """The full state_dict from a shipped file (its sha256 checked against its card)."""
    try:
        card = json.loads(Path(f"{path}.json").read_text())
        card["sha256"], card["recipe"]["seed"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RunError(f"{path}.json, the card of the shipped tiny weights, is missing or broken "
                              f"({type(e).__name__}: {e}); restore it (git checkout lab/weights) or rewrite the "
                              f"weights with {WRITE_COMMAND}") from None
    if hashlib.sha256(Path(path).read_bytes()).hexdigest() != card["sha256"]:
        raise UsageError(f"{path}: its sha256 is not the one its card records; rewrite it with "
                                f"{WRITE_COMMAND}")
    blob = torch.load(path, map_location="cpu", weights_only=True)
    emb = _token_init(card["recipe"]["seed"], (TINY_CFG["text_cfg"]["vocab_size"], TINY_CFG["text_cfg"]["width"]))
    emb[blob["token_ids"]] = blob["token_rows"]
    return {**blob["state"], "token_embedding.weight": emb}


# Issue 39, item 3: the float-rounding perturbation of a whole demo. CLIPFT_PERTURB=N (N >= 1) hands every run the
# pretrained weights with each nonzero float moved one unit in the last place, up or down by a draw of seed N
# (perturbed_weights); never a demo's setting, recorded in its results file as `perturb`.
PERTURB = int(os.environ.get("CLIPFT_PERTURB", "0") or 0)


def perturbed_weights(seed: int, path: Path | None = None) -> Path:
    """The tiny pretrained weights (or the full state_dict at `path`) with every nonzero float tensor entry moved
    one ulp towards +inf or -inf (each direction drawn from `seed`): a perturbation at float-rounding level, the
    same on every machine. Cached beside the source file, with its sidecar."""
    path = Path(path or pretrain_tiny(perturb=0))
    out = path.with_name(f"{path.stem}-ulp{seed}{path.suffix}")
    if _cached(out):
        return out
    sd = torch.load(path, map_location="cpu", weights_only=True)
    g = torch.Generator().manual_seed(seed)
    for k, v in sd.items():
        if v.is_floating_point():
            towards = torch.where(torch.rand(v.shape, generator=g) < 0.5, -torch.inf, torch.inf).to(v.dtype)
            sd[k] = torch.where(v == 0, v, torch.nextafter(v, towards))
    _atomic_save(sd, out)
    atomic_write(Path(f"{out}.json"), Path(f"{path}.json").read_text())
    return out


def pretrain_tiny(force: bool = False, perturb: int | None = None, recipe: dict | None = None) -> Path:
    """The tiny backbone's 'pretrained' weights, as a full state_dict in
    CLIPFT_CACHE: expanded from the shipped file of the current recipe
    (lab/weights/), so every machine starts from the same weights and nothing
    pretrains; without one (a changed recipe) it pretrains into the cache and
    says how to ship the new weights. perturb (default CLIPFT_PERTURB): > 0
    returns perturbed_weights(perturb) instead. recipe: another of RECIPES
    (default TINY_PRETRAIN, the weights every demo starts from)."""
    perturb = PERTURB if perturb is None else perturb
    if perturb:
        return perturbed_weights(perturb, pretrain_tiny(force, perturb=0, recipe=recipe))
    recipe = recipe or TINY_PRETRAIN
    key = recipe_key(recipe)
    path = base.CACHE_DIR / f"tiny-synthetic-{key}.pt"
    if _cached(path) and not force:
        return path
    models.register_tiny(TINY_CFG)
    base.CACHE_DIR.mkdir(parents=True, exist_ok=True)
    import fcntl  # one process writes; others (parallel tests, ranks) wait for its file, saying for whom
    with open(base.CACHE_DIR / f"{path.name}.lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            print(f"[lab] waiting for {lock.read().strip() or 'another process'}, which is writing {path}",
                  file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        lock.truncate(0)
        lock.write(f"PID {os.getpid()} on {socket.gethostname()}")
        lock.flush()
        if _cached(path, say=True) and not force:
            return path
        shipped = shipped_path(key)
        if shipped.exists() and not force:
            with weights_loaded_next():  # open_clip's "initialized randomly": the shipped weights load next
                model, _, _ = open_clip.create_model_and_transforms(models.TINY_NAME, pretrained=None)
            model.load_state_dict(load_shipped(shipped))
            model.quick_gelu = False
            return models.save_model(model, path, "tiny", source=f"{shipped.name} (recipe {recipe})")
        print(f"[lab] no shipped weights for recipe key {key} (lab/weights/): pretraining into the cache; ship "
              f"them with {write_command(recipe)}", file=sys.stderr)
        model, _ = _pretrain_tiny(recipe, _work_dir(key))
        return models.save_model(model, path, "tiny", source=f"synthetic world pretraining {recipe}")


def _cached(path: Path, say: bool = False) -> bool:
    """Whether the cached full weights are there whole: a zip with its central directory (a cut file has none)
    and a sidecar that parses. A broken pair is removed, with one line naming it, and rebuilt by the caller."""
    if not path.exists():
        return False
    try:
        json.loads(Path(f"{path}.json").read_text())
        whole = zipfile.is_zipfile(path)
    except (OSError, ValueError):
        whole = False
    if not whole and say:
        print(f"[lab] {path} (or its .json sidecar) is truncated or broken: rebuilding it", file=sys.stderr)
        path.unlink(missing_ok=True)
    return whole


def _work_dir(key: str) -> Path:
    """The pretraining's working folder, out of the user's view (a hidden folder of the cache); removed when
    the pretraining finishes, resumed from its checkpoint after an interrupt."""
    return base.CACHE_DIR / ".work" / f"tiny-pretrain-{key}"


def _pretrain_tiny(p: dict, out: Path):
    """Contrastive pretraining from scratch on the world's short alt-text
    captions (CLIP's situation: short web captions over a broad vocabulary,
    then asked about long ones). Deterministic on one machine. Returns (model, seconds)."""
    t0 = time.time()
    print(f"[lab] pretraining the tiny backbone on the world's alt-text captions ({p})", file=sys.stderr)
    models.register_tiny(TINY_CFG)
    torch.manual_seed(p["seed"])
    model, _, _ = open_clip.create_model_and_transforms(models.TINY_NAME, pretrained=None)
    with torch.no_grad():
        model.token_embedding.weight.copy_(_token_init(p["seed"], model.token_embedding.weight.shape))
    tok = open_clip.get_tokenizer(models.TINY_NAME)
    domain = dataclasses.replace(PRETRAIN, descriptive=p.get("descriptive", True))
    scenes = _PretrainScenes(world_split(domain, p["n"], seed=100), seed=100)
    cfg = Config(epochs=p["epochs"], batch_size=p["batch"], lr=p["lr"], wd=p["wd"], warmup=-p["warmup_pct"],
                        grad_clip=1.0, precision="fp32", workers=0, out=str(out), save_every=0, log_every=50,
                        device="cpu", seed=p["seed"])
    ck = out / "checkpoints" / "last.pt"
    if zipfile.is_zipfile(ck):  # an interrupted pretraining (a signal saved its step): continue it
        print(f"[lab] continuing the interrupted pretraining from {ck}", file=sys.stderr)
        cfg = dataclasses.replace(cfg, resume="latest")
    else:  # none, or killed before its checkpoint: start it again
        cfg = dataclasses.replace(cfg, overwrite=True)
    try:
        common.train(cfg, ClipFineTune(model), scenes, common.Collate(tok), export=False)
    except RunError as e:
        if e.code <= 128:
            raise
        raise RunError(f"the tiny backbone's pretraining was stopped by signal {e.code - 128}; its "
                              f"checkpoint is kept in {out}, and the next command that needs the tiny weights "
                              f"continues it", code=e.code) from None
    shutil.rmtree(out, ignore_errors=True)  # its checkpoint (92 MB) is not the weights; the caller saves those
    model.quick_gelu = False
    print(f"[lab] tiny backbone pretrained in {time.time() - t0:.0f}s", file=sys.stderr)
    return model, time.time() - t0


def _family(recipe: dict):
    """Which of RECIPES' lines a recipe belongs to (a newer version of a line replaces its shipped file)."""
    return recipe.get("descriptive")


def write_weights(recipe: dict | None = None, weights_dir: Path | None = None) -> Path:
    """Pretrains with the recipe and writes its shipped file (the older files of the same line, as its card says,
    are removed; another line's stay)."""
    recipe, folder = recipe or TINY_PRETRAIN, Path(weights_dir or WEIGHTS_DIR)
    key = recipe_key(recipe)
    torch.set_num_threads(2)  # the recipe's machine: 2 CPU threads (the kernels' sums depend on the thread count)
    model, seconds = _pretrain_tiny(recipe, _work_dir(key))
    folder.mkdir(parents=True, exist_ok=True)
    for card in folder.glob("tiny-*.pt.json"):
        if _family(json.loads(card.read_text())["recipe"]) == _family(recipe):
            Path(str(card).removesuffix(".json")).unlink(missing_ok=True)
            card.unlink()
    return write_shipped(model, folder / f"tiny-{key}.pt", recipe, seconds)


# =============================================================================
# 4. Measurements on the world (one image pass per model)
# =============================================================================
@torch.no_grad()
def zero_shot_report(model, preprocess, tokenizer, data_root="data", n=None, split="zs-test") -> dict:
    """Zero-shot top-1 (%) on 'zs-test' ('zs-val': calibration) per label set,
    overall and split into the classes fine-tuning shows ('<set> seen') and
    those only pretraining saw ('<set> held-out'); the background family is
    held out entirely."""
    ds = common.ManifestDataset(synthetic_manifest(split, data_root, n), check_images=False,
                                extra=("shape", "color", "background"))
    img = evaluation.image_features(model, preprocess, [str(ds.image_file(r)) for r in ds.rows])
    out, seen = {}, finetune_classes()
    for name, (classes, templates, column) in label_sets().items():
        clf = common.zero_shot_classifier(model, tokenizer, classes, templates)
        labels = torch.tensor([int(r[column]) for r in ds.rows])
        correct = (img @ clf).argmax(1) == labels
        out[name] = 100.0 * correct.float().mean().item()
        if seen[name]:
            mask = torch.tensor([classes[i] in seen[name] for i in labels.tolist()])
            out[f"{name} seen"] = 100.0 * correct[mask].float().mean().item()
            out[f"{name} held-out"] = 100.0 * correct[~mask].float().mean().item()
    return out


@torch.no_grad()
def retrieval_report(model, preprocess, tokenizer, split="test", data_root="data", n=None,
                     sentence_mean: bool = False, captions: LongCaptions = AS_DRAWN) -> dict:
    """R@1 (%) both ways on a split's short and long captions (long truncated
    at the context, as the papers evaluate; optionally also sentence-mean);
    captions: how the long captions are written (world.LongCaptions)."""
    ds = common.ManifestDataset(captions.synthetic_manifest(split, data_root, n), need_long=True, check_images=False)
    img = evaluation.image_features(model, preprocess, [str(ds.image_file(r)) for r in ds.rows])
    t2i = torch.arange(len(ds.rows))
    out = {}
    modes = [("short", "caption", "truncate"), ("long", "long_caption", "truncate")]
    if sentence_mean:
        modes.append(("long-sent", "long_caption", "sentence-mean"))
    for label, column, mode in modes:
        txt = evaluation.text_features(model, tokenizer, [r[column] for r in ds.rows], mode)
        m = common.retrieval_metrics(img, txt, t2i, ks=(1,))
        out[f"{label} I2T"], out[f"{label} T2I"] = m["i2t_R@1"], m["t2i_R@1"]
    return out


def domain_report(model, preprocess, tokenizer, data_root="data", n=None) -> dict:
    """Per continual domain, R@1 (%, mean of I2T and T2I) on its test split:
    '<domain>' with the short captions (DNS's tasks), '<domain> long' with the
    long ones truncated (C-CLIP's --tasks synthetic-long)."""
    out = {}
    for name in TASK_DOMAINS:
        r = retrieval_report(model, preprocess, tokenizer, f"task-{name}-test", data_root, n)
        out[name], out[f"{name} long"] = (r["short I2T"] + r["short T2I"]) / 2, (r["long I2T"] + r["long T2I"]) / 2
    return out


if __name__ == "__main__":
    flag, name = (sys.argv[1:] + ["", ""])[:2] if len(sys.argv) <= 3 else ("", "")
    if flag != "--write-weights" or name not in RECIPES:
        sys.exit(f"usage: {WRITE_COMMAND} [{' | '.join(k for k in RECIPES if k)}]   (pretrains with "
                 f"lab.tiny.TINY_PRETRAIN, or the recipe named, and writes lab/weights/)")
    import lab  # noqa: F401  registers the tiny backbone
    print(write_weights(RECIPES[name]))
