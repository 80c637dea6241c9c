"""The lab's tiny CLIP: its open_clip config, its pretraining on the world's
short alt-text captions (cached in CLIPFT_CACHE), and the measurements every
demo takes on the world (one image pass per model)."""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import open_clip
import torch

import common
import eval as evaluation
from lab.world import IMAGE_SIZE, PRETRAIN, finetune_classes, label_sets, render, synthetic_manifest, world_split

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
# version: bump when the world or the recipe changes (it is part of the cache key)
TINY_PRETRAIN = dict(n=10000, epochs=3, batch=128, lr=1e-3, wd=0.1, warmup_pct=5, seed=0, version=4)


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


def pretrain_tiny(force: bool = False) -> Path:
    """The tiny backbone's 'pretrained' weights: contrastive training from
    scratch on the world's short alt-text captions (CLIP's situation: short
    web captions over a broad vocabulary, then asked about long ones).
    Deterministic on one machine, cached in CLIPFT_CACHE after the first run."""
    key = hashlib.sha1(json.dumps([TINY_CFG, TINY_PRETRAIN], sort_keys=True).encode()).hexdigest()[:10]
    path = common.CACHE_DIR / f"tiny-synthetic-{key}.pt"
    if path.exists() and not force:
        return path
    common.register_tiny(TINY_CFG)
    common.CACHE_DIR.mkdir(parents=True, exist_ok=True)
    import fcntl  # one process pretrains; others (parallel tests, ranks) wait for its file
    with open(common.CACHE_DIR / f"{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists() and not force:
            return path
        return _pretrain_tiny(path, key)


def _pretrain_tiny(path: Path, key: str) -> Path:
    t0 = time.time()
    print(f"[lab] pretraining the tiny backbone on the world's alt-text captions -> {path}", file=sys.stderr)
    p = TINY_PRETRAIN
    torch.manual_seed(p["seed"])
    model, _, _ = open_clip.create_model_and_transforms(common.TINY_NAME, pretrained=None)
    tok = open_clip.get_tokenizer(common.TINY_NAME)
    scenes = _PretrainScenes(world_split(PRETRAIN, p["n"], seed=100), seed=100)
    cfg = common.Config(epochs=p["epochs"], batch_size=p["batch"], lr=p["lr"], wd=p["wd"], warmup=-p["warmup_pct"],
                        grad_clip=1.0, precision="fp32", workers=0, out=str(common.CACHE_DIR / f"tiny-pretrain-{key}"),
                        save_every=0, log_every=50, device="cpu", seed=p["seed"])
    common.train(cfg, common.ClipFineTune(model), scenes, common.Collate(tok), export=False)
    model.quick_gelu = False
    common.save_model(model, path, "tiny", source=f"synthetic world pretraining {p}")
    print(f"[lab] tiny backbone pretrained in {time.time() - t0:.0f}s", file=sys.stderr)
    return path


# =============================================================================
# 4. Measurements on the world (one image pass per model)
# =============================================================================
@torch.no_grad()
def zero_shot_report(model, preprocess, tokenizer, data_root="data", n=None) -> dict:
    """Zero-shot top-1 (%) on 'zs-test' per label set, overall and split into
    the classes fine-tuning shows ('<set> seen') and those only pretraining
    saw ('<set> held-out'); the background family is held out entirely."""
    ds = common.ManifestDataset(synthetic_manifest("zs-test", data_root, n), check_images=False,
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
                     sentence_mean: bool = False) -> dict:
    """R@1 (%) both ways on a split's short and long captions (long truncated
    at the context, as the papers evaluate; optionally also sentence-mean)."""
    ds = common.ManifestDataset(synthetic_manifest(split, data_root, n), need_long=True, check_images=False)
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


