"""GPU check: the CUDA paths that the CPU test suite cannot run, in one
prepared script for the day a GPU is lent.

    python benchmarks/gpu_check.py                  # one GPU (two: + NCCL DDP), <= 10 minutes
    python benchmarks/gpu_check.py --skip-bench     # without benchmarks/bench.py --quick (~2-4 of the minutes)

Run it when a GPU is available, and again after changing common.train,
a method's forward or the benchmark. Models have random weights
(pretrained='random', no download); inputs are random images and captions.
What it runs, in order (each section is skipped with a message when the time
budget --budget would be exceeded):
  1. per method (plain CLIP, ERCLIP M+P and RT+P, m2-Mix, m3-Mix, C-CLIP with
     LoRA + the old model, DNS with gradient- and update-mode projection on
     ViT-B/16 features, Long-CLIP with its stretched window and batch PCA):
     --steps steps of common.train_step in fp16 autocast with a GradScaler
     and fused AdamW, the same steps in fp32 from the same weights, the
     losses compared; seconds per step; peak memory
     (torch.cuda.max_memory_allocated over the fp16 steps, optimizer state
     included)
  2. a forced overflow (an injected inf gradient) with fused AdamW, with and
     without gradient clipping: the step is skipped with weights and AdamW
     state bitwise unchanged, the scale halves, the next step trains
  3. common.train end to end in fp16 (pinned memory, fused AdamW, checkpoints
     with the scaler state) with a forced overflow at step 1: the skip leaves
     the checkpointed state bitwise unchanged, and a run stopped before and
     after it and resumed ends where an uninterrupted run does
  4. a 2-process NCCL DDP run of common.train when two GPUs exist (skipped
     with a message otherwise): every rank ends with the same weights
  5. throughput (benchmarks/throughput.py, issue 75): per method pairs/s, GFLOP
     per pair and model FLOP utilisation against the chip's dense peak (and a
     measured bf16 matmul rate) over >= 30 fixed-shape steps, fp16 + GradScaler
     beside bf16; for the plain step a batch sweep to the memory limit,
     --torchcompile, --accum-freq 4's parts timed apart, and the real loop with
     JPEG decoding in DataLoader workers
  6. benchmarks/bench.py --quick on CUDA (its records go into this JSON; the
     committed benchmarks/results.json is left alone)
Writes one JSON (--out, default runs/gpu_check.json), prints a markdown
table, exits 1 when a check failed. On a machine without CUDA it prints one
line and exits 2. Everything but the CUDA calls is imported and run on CPU by
tests/test_fp16.py (tiny backbone), which shares Stepper and check_method
with this script.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from plumbing.base import markdown_table
from plumbing.flags import Config
from plumbing.loading import load_weights_only
from plumbing import models  # noqa: E402
import lab  # noqa: E402,F401  the tiny backbone (--backbone tiny, the CPU tests) registers itself

SWEEP = (64, 128, 256, 512, 1024)  # the plain step's batch sweep (section 5), until one does not fit
METHODS = ("plain", "erclip-m+p", "erclip-rt+p", "m2-mix", "m3-mix", "c-clip", "dns-gradient", "dns-update",
           "longclip")
WORDS = (("a man", "a woman", "two dogs", "a small child", "a red bus", "a cat", "a group of people"),
         ("is sitting on", "stands next to", "is looking at", "walks past", "is playing with"),
         ("a wooden bench", "a white truck", "a frisbee on the beach", "a tall building", "a kitchen table"))


# =============================================================================
# Inputs and methods
# =============================================================================
def captions(n: int, seed: int = 0) -> list[str]:
    """Short COCO-like sentences (8-12 tokens)."""
    g = torch.Generator().manual_seed(seed)
    pick = [torch.randint(len(w), (n,), generator=g).tolist() for w in WORDS]
    return [f"{WORDS[0][a]} {WORDS[1][b]} {WORDS[2][c]}." for a, b, c in zip(*pick)]


def items(n: int, image_size: int, seed: int = 0, sentences: int = 6) -> list[dict]:
    """Dataset items as common's datasets give them: a random image, a
    caption and a long caption of `sentences` sentences."""
    g = torch.Generator().manual_seed(seed)
    caps = captions(n, seed)
    return [{"image": torch.randn(3, image_size, image_size, generator=g), "caption": caps[i],
             "long_caption": " ".join(captions(sentences, seed * 1000 + i + 1)), "index": i} for i in range(n)]


def image_size(model) -> int:
    s = model.visual.image_size
    return s[0] if isinstance(s, (tuple, list)) else s


@dataclass
class Case:
    """One method's training step: the wrapper, a batch on the device, the hooks."""
    method: str
    net: nn.Module
    batch: dict
    hooks: object = None


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def build(method: str, model, tokenizer, batch_size: int, device, seed: int = 0, sentences: int = 6,
          backbone: str = "tiny") -> Case:
    """The method's wrapper around `model` (modified in place: LoRA adapters,
    a teacher copy, Long-CLIP's stretched window) and a batch, on `device`,
    as the method's script builds them with the paper's default settings.
    sentences: per long caption (ERCLIP, Long-CLIP); backbone: the model's
    name (Long-CLIP reads its original window from it)."""
    device = torch.device(device)
    model = model.to(device)
    data = items(batch_size, image_size(model), seed, sentences)
    if method == "plain":
        return Case(method, lab.ClipFineTune(model).to(device), to_device(common.Collate(tokenizer)(data), device))
    if method in ("erclip-m+p", "erclip-rt+p"):
        import erclip
        cfg = erclip.ERCLIPConfig(fusion="mean" if method == "erclip-m+p" else "rt", lambda_p=1.0)
        batch = erclip.SentenceCollate(tokenizer, cfg.max_sentences)(data)
        return Case(method, erclip.ERCLIP(model, cfg).to(device), to_device(batch, device))
    if method in ("m2-mix", "m3-mix"):
        import m2mix
        net = m2mix.M2Mix(model, m2mix.M2MixConfig(method=method[:2]))
        return Case(method, net.to(device), to_device(common.Collate(tokenizer)(data), device))
    if method == "c-clip":
        import cclip
        teacher = copy.deepcopy(model)  # the old model (for task 1: the pretrained one)
        common.add_lora(model)
        net = cclip.CClip(model, teacher, cclip.projector(common.embed_dim(model)))
        return Case(method, net.to(device), to_device(common.Collate(tokenizer)(data), device))
    if method in ("dns-gradient", "dns-update"):
        import dns
        batch = to_device(common.Collate(tokenizer)(data), device)
        with torch.no_grad(), common.autocast(device, "fp16" if device.type == "cuda" else "fp32"):
            img = model.encode_image(batch["image"], normalize=True).float()  # (B, D) the cached features
            txt = common.encode_text(model, batch["text"]).float()
        dim = img.shape[1]
        g = torch.Generator().manual_seed(seed + 1)  # old tasks' features on a low-rank subspace
        old = F.normalize(torch.randn(4 * dim, dim // 8, generator=g) @ torch.randn(dim // 8, dim, generator=g), dim=-1)
        Z, _ = dns.update_covariance(torch.zeros(dim, dim, dtype=torch.float64), 0, old.double())
        net = dns.DNSNet(dim, float(model.logit_scale.detach())).to(device)
        hooks = dns.NullSpaceProjection(method.split("-")[1], dns.build_projectors(net.model, Z, Z, 0.01))
        return Case(method, net, {"img": img, "txt": txt}, hooks)
    if method == "longclip":
        import longclip
        cfg = longclip.LongCLIPConfig(backbone=backbone)
        net = longclip.LongCLIP(model, cfg)
        collate = longclip.LongCaptionCollate(models.get_tokenizer(backbone, net.context_length), cfg.short_caption)
        return Case(method, net.to(device), to_device(collate(data), device))
    raise ValueError(f"unknown method {method!r}; one of {METHODS}")


# =============================================================================
# Steps, overflow, snapshots
# =============================================================================
class InfGradient(torch.autograd.Function):
    """A loss term of value 0 whose gradient on `p` is +inf: a forced
    overflow, what a too-large loss scale gives, at a chosen step."""
    @staticmethod
    def forward(ctx, p):
        ctx.shape = p.shape
        return torch.zeros((), device=p.device, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        return torch.full(ctx.shape, math.inf, device=grad.device, dtype=torch.float32)


def with_overflow(net, param, at_steps):
    """net's forward, plus at the steps in at_steps the InfGradient term on `param`."""
    def forward(batch, ctx):
        losses = net(batch, ctx)
        if ctx.step in at_steps:
            losses["loss_overflow"] = InfGradient.apply(param)
        return losses
    return forward


class Stepper:
    """A method's net with its optimizer (common.make_optimizer: fused AdamW
    on CUDA unless `fused` says otherwise), a GradScaler (on for fp16),
    a scheduler, and common.train_step."""
    def __init__(self, case: Case, device, precision: str, *, lr: float = 1e-5, grad_clip: float = 0.0,
                 init_scale: float = 2.0 ** 16, fused: bool | None = None, seed: int = 0, accum: int = 1):
        self.case, self.device, self.seed, self.accum = case, torch.device(device), seed, accum
        self.precision = common.resolve_precision(precision, self.device)
        self.grad_clip = grad_clip
        self.opt = common.make_optimizer(Config(lr=lr), case.net, self.device, fused=fused)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0)
        self.scaler = torch.amp.GradScaler(self.device.type, init_scale=init_scale, enabled=self.precision == "fp16")
        self.step_index = 0
        case.net.train()

    def trained(self):
        return [(n, p) for n, p in self.case.net.named_parameters() if p.requires_grad]

    def step(self, overflow: bool = False) -> dict:
        """One common.train_step; overflow=True injects an inf gradient on the first trained parameter."""
        net = self.case.net
        ctx = SimpleNamespace(step=self.step_index, epoch=0, total_steps=0, device=self.device,
                              precision=self.precision, generator=common.step_generator(self.seed, self.step_index))
        forward = with_overflow(net, self.trained()[0][1], {self.step_index}) if overflow else None
        losses, loss, skipped = common.train_step(net, self.case.batch, ctx, self.opt, self.scaler, self.sched,
                                                  grad_clip=self.grad_clip, hooks=self.case.hooks, forward=forward,
                                                  accum=self.accum)
        self.step_index += 1
        return {"loss": float(loss.detach()), "terms": {k: float(v.detach()) for k, v in losses.items()},
                "skipped": bool(skipped) if skipped is not None else False,
                "scale": self.scaler.get_scale() if self.scaler.is_enabled() else None}

    def snapshot(self) -> dict:
        """Copies of every trained weight and every AdamW state tensor."""
        snap = {f"param {n}": p.detach().clone() for n, p in self.trained()}
        names = {id(p): n for n, p in self.trained()}
        for p, st in self.opt.state.items():
            for k, v in st.items():
                snap[f"adamw {k} {names[id(p)]}"] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(v)
        return snap


def changed(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ in any bit (or exist on one side only)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


def overflow_check(case: Case, device, precision: str = "fp16", grad_clip: float = 0.0,
                   fused: bool | None = None, init_scale: float = 2.0 ** 10) -> dict:
    """Step 0 normal; step 1 with an injected inf gradient must be skipped
    (weights and AdamW state bitwise unchanged, scale halved); step 2 trains.
    The initial scale is low enough that no step overflows by itself."""
    s = Stepper(case, device, precision, grad_clip=grad_clip, fused=fused, lr=1e-3, init_scale=init_scale)
    name = f"overflow skip ({case.method}, {precision}, clip {grad_clip}, fused {s.opt.defaults.get('fused')})"
    problems, recs, snaps = [], [], []
    try:
        for overflow in (False, True, False):
            snaps.append(s.snapshot())
            recs.append(s.step(overflow=overflow))
        snaps.append(s.snapshot())
    except FloatingPointError as e:  # a step taken on inf gradients leaves NaN weights behind
        problems.append(f"step {len(recs)} failed: {e}")
    if len(snaps) > 2 and changed(snaps[1], snaps[2]):
        problems.append(f"the skipped step changed {changed(snaps[1], snaps[2])[:3]}")
    if len(recs) > 1:
        first, over = recs[0], recs[1]
        if first["skipped"] or not over["skipped"]:
            problems.append(f"skipped steps {[r['skipped'] for r in recs]}, expected [False, True, False]")
        if over["scale"] != first["scale"] / 2:
            problems.append(f"scale {first['scale']} -> {over['scale']}, not halved")
    if len(recs) == 3 and (recs[2]["skipped"] or not changed(snaps[2], snaps[3])):
        problems.append("the step after the overflow did not train")
    if any(not torch.isfinite(v).all() for k, v in snaps[-1].items() if v.is_floating_point()):
        problems.append("non-finite weights or AdamW state after the overflow")
    return {"check": name, "ok": not problems, "problems": problems, "scales": [r["scale"] for r in recs]}


def check_method(method: str, base_model, tokenizer, device, *, batch_size: int = 64, steps: int = 3,
                 precision: str = "fp16", reference: str = "fp32", tol: float = 2e-2, lr: float = 1e-5,
                 sentences: int = 6, backbone: str = "tiny", accum: int = 1) -> dict:
    """`steps` steps of `method` in `precision` (over `accum` micro-batches) and in `reference` from the
    same weights and batch: losses finite, and each within tol (relative) of
    the reference's loss after as many applied updates (a step the scaler
    skipped applies none: fp16 often skips its first steps while the scale
    settles). On CUDA also seconds per step and the peak memory of the steps
    after the first (optimizer state allocated)."""
    device = torch.device(device)
    runs = {}
    for prec in (reference, precision):
        torch.manual_seed(0)
        case = build(method, copy.deepcopy(base_model), tokenizer, batch_size, device, sentences=sentences,
                     backbone=backbone)
        s = Stepper(case, device, prec, lr=lr, grad_clip=1.0, accum=accum if prec == precision else 1)
        recs, times, peak = [], [], None
        for i in range(steps):
            if i == 1 and device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            recs.append(s.step())
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        if device.type == "cuda" and steps > 1:
            peak = torch.cuda.max_memory_allocated(device) / 2 ** 20
        runs[prec] = {"losses": [r["loss"] for r in recs], "skipped": [r["skipped"] for r in recs],
                      "scale": recs[-1]["scale"], "sec_per_step": min(times[1:] or times), "peak_mib": peak}
        del case, s
    ours, ref = runs[precision], runs[reference]
    rel, applied = [], 0
    for loss, skipped in zip(ours["losses"], ours["skipped"]):
        ref_loss = ref["losses"][applied]  # the reference after the same number of updates
        rel.append(abs(loss - ref_loss) / max(abs(ref_loss), 1e-6))
        applied += not skipped
    problems = []
    if not all(math.isfinite(v) for v in ours["losses"] + ref["losses"]):
        problems.append("non-finite loss")
    elif max(rel) > tol:
        problems.append(f"{precision} losses differ from {reference} by {max(rel):.2g} (> {tol})")
    return {"check": f"{method} step ({precision}{f', --accum-freq {accum}' if accum > 1 else ''} vs {reference})",
            "method": method, "ok": not problems,
            "problems": problems, "losses": ours["losses"], "reference_losses": ref["losses"],
            "max_rel_diff": max(rel), "skipped": ours["skipped"], "scale": ours["scale"],
            "sec_per_step": ours["sec_per_step"], "reference_sec_per_step": ref["sec_per_step"],
            "peak_mib": ours["peak_mib"], "reference_peak_mib": ref["peak_mib"]}


# =============================================================================
# common.train end to end, DDP, the benchmark
# =============================================================================
class RandomPairs(torch.utils.data.Dataset):
    """n random images with captions, generated from the index (no files)."""
    def __init__(self, n: int, size: int, seed: int = 0):
        self.data = items(n, size, seed, sentences=1)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


def train_config(out, device, precision, **kw) -> Config:
    base = dict(steps=4, batch_size=8, lr=1e-5, warmup=1, workers=0, precision=precision, out=str(out),
                save_every=0, log_every=1, device=str(device), seed=0, grad_clip=1.0)
    return Config(**(base | kw))


class OverflowAt(lab.ClipFineTune):
    """Plain CLIP fine-tuning whose loss gets the InfGradient term (on the
    first trained parameter) at the given steps: a forced overflow inside
    common.train."""
    def __init__(self, model, steps=()):
        super().__init__(model)
        self.steps = set(steps)

    def forward(self, batch, ctx=None):
        losses = super().forward(batch, ctx)
        if ctx is not None and ctx.step in self.steps:
            losses["loss_overflow"] = InfGradient.apply(next(p for p in self.parameters() if p.requires_grad))
        return losses


def resume_check(backbone: str, device, precision: str, tmp, batch_size: int = 8, steps: int = 4,
                 overflow_at: int = 1) -> dict:
    """common.train with a forced overflow at step `overflow_at` (0-based),
    once straight through and once stopped before it, stopped after it and
    resumed to the end (two resumes). Checks: the skipped step left weights
    and AdamW state bitwise unchanged, halved the scale and advanced the LR
    schedule by one; the resumed run logs the restored scale and ends with
    the straight run's weights (bitwise on CPU; CUDA kernels may differ in
    the last bits, tolerated to 1e-5); every loss is finite."""
    device = torch.device(device)
    tmp = Path(tmp)

    def run(out, **kw):
        torch.manual_seed(0)
        model, _, _, tok = models.load_model(backbone, "random")
        net = OverflowAt(model, {overflow_at})
        summary = common.train(train_config(out, device, precision, steps=steps, batch_size=batch_size, **kw), net,
                               RandomPairs(4 * batch_size, image_size(model)), common.Collate(tok), export=False)
        return net, summary

    def checkpoint(out):
        return load_weights_only(out / "checkpoints" / "last.pt")

    def metrics(out):
        return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}

    straight, s_sum = run(tmp / "straight")
    run(tmp / "stopped", stop_at=overflow_at)
    before = checkpoint(tmp / "stopped")
    run(tmp / "stopped", stop_at=overflow_at + 1, resume="latest")
    after = checkpoint(tmp / "stopped")
    resumed, r_sum = run(tmp / "stopped", resume="latest")

    def tensors(ck):
        out = {f"net {k}": v for k, v in ck["net"].items()}
        for i, st in ck["optimizer"]["state"].items():
            out.update({f"adamw {k} {i}": v for k, v in st.items()})
        return out
    problems = []
    fp16 = precision == "fp16"
    if fp16 and changed(tensors(before), tensors(after)):
        problems.append(f"the skipped step changed {changed(tensors(before), tensors(after))[:3]}")
    if fp16 and after["scaler"]["scale"] != before["scaler"]["scale"] / 2:
        problems.append(f"scale {before['scaler']['scale']} -> {after['scaler']['scale']}, not halved")
    if after["scheduler"]["last_epoch"] != before["scheduler"]["last_epoch"] + 1:
        problems.append("the LR schedule did not count the skipped step")
    if fp16 and not (s_sum["skipped_steps"] == r_sum["skipped_steps"] == after["skipped_steps"] == 1):
        problems.append(f"skipped steps counted {s_sum['skipped_steps']}, {r_sum['skipped_steps']}, "
                        f"{after['skipped_steps']}, not 1")
    m_straight, m_resumed = metrics(tmp / "straight"), metrics(tmp / "stopped")
    scales = [m_straight[i].get("grad_scale") for i in range(1, steps + 1)]
    if [m_resumed[i].get("grad_scale") for i in range(overflow_at + 2, steps + 1)] != scales[overflow_at + 1:]:
        problems.append("the resumed run's scale differs from the straight run's (scaler state not restored?)")
    diff = max(float((x.float() - y.float()).abs().max())
               for x, y in zip(straight.state_dict().values(), resumed.state_dict().values()))
    tol = 0.0 if device.type == "cpu" else 1e-5
    if diff > tol:
        problems.append(f"resumed run differs from the straight one by {diff:.3g} (> {tol})")
    losses = [r["loss"] for r in m_straight.values()] + [r["loss"] for r in m_resumed.values()]
    if not all(math.isfinite(v) for v in losses):
        problems.append("non-finite loss")
    return {"check": f"common.train: overflow at step {overflow_at}, stop, resume ({backbone}, {precision})",
            "ok": not problems, "problems": problems, "max_weight_diff": diff, "grad_scales": scales,
            "skipped_steps": s_sum["skipped_steps"], "lr": [m_straight[i]["lr"] for i in range(1, steps + 1)]}


def _ddp_worker(rank, world, port, tmp, backbone, device_type, precision, batch_size):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = "cpu" if device_type == "cpu" else "auto"  # auto: cuda:<local rank>, NCCL
    model, _, _, tok = models.load_model(backbone, "random")
    data = RandomPairs(4 * batch_size, image_size(model))
    summary = common.train(train_config(Path(tmp) / "ddp", device, precision, steps=2, batch_size=batch_size,
                                        log_every=100), lab.ClipFineTune(model), data, common.Collate(tok),
                           export=False)
    flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    torch.save({"weights": flat.cpu(), "summary": summary}, Path(tmp) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def ddp_check(backbone: str, device_type: str, precision: str, batch_size: int = 8) -> dict:
    """Two processes train 2 steps through common.train (NCCL on two GPUs,
    gloo on CPU): both end with the same weights and finite losses."""
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_ddp_worker, args=(2, port, tmp, backbone, device_type, precision, batch_size), nprocs=2, join=True)
        res = [load_weights_only(Path(tmp) / f"rank{r}.pt") for r in range(2)]
    diff = float((res[0]["weights"] - res[1]["weights"]).abs().max())
    losses = [v for r in res for v in r["summary"]["final_losses"].values()]
    problems = [] if diff == 0 else [f"ranks' weights differ by {diff:.3g}"]
    if not all(math.isfinite(v) for v in losses):
        problems.append("non-finite loss")
    return {"check": f"2-process DDP ({'NCCL' if device_type == 'cuda' else 'gloo'}, {backbone}, {precision})",
            "ok": not problems, "problems": problems, "rank_weight_diff": diff,
            "world_size": res[0]["summary"]["world_size"], "losses": losses}


def bench_quick(out_json, timeout: float, extra=("--quick",)) -> dict:
    """benchmarks/bench.py (quick mode) in a subprocess; its records."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench.py"), *extra, "--out", str(out_json)]
    name, t0 = "bench.py " + " ".join(extra), time.time()
    # its own process group: bench.py starts children of its own, and a timeout must end them too
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, _ = p.communicate()
        return {"check": name, "ok": False, "problems": [f"timed out after {timeout:.0f}s"], "table": stdout[-6000:]}
    ok = p.returncode == 0 and Path(out_json).exists()
    return {"check": name, "ok": ok, "seconds": time.time() - t0,
            "problems": [] if ok else [f"exit {p.returncode}: {stderr.strip().splitlines()[-1:]}"],
            "records": json.loads(Path(out_json).read_text()) if ok else [], "table": stdout[-6000:]}


# =============================================================================
# Main
# =============================================================================
def throughput_check(method: str, base_model, tokenizer, device, *, batch_size: int, backbone: str,
                     peak: float | None, steps: int = 30, sweep=(), compiled: bool = False, accum: int = 0,
                     data_loop: bool = False, train_tf=None) -> dict:
    """Section 5 for one method: step_throughput in fp16 (GradScaler) and bf16 at batch_size; then, as asked,
    a bf16 batch sweep, the bf16 step with the towers compiled, --accum-freq's parts, the loop with data."""
    import throughput

    def stepper(precision, b=batch_size, compile_towers=False):
        torch.manual_seed(0)
        case = build(method, copy.deepcopy(base_model), tokenizer, b, device, backbone=backbone)
        if compile_towers:
            models.compile_towers(case.net.model)
        return Stepper(case, device, precision)

    precisions = ("fp16", "bf16") if torch.device(device).type == "cuda" else ("bf16",)
    rows = [throughput.step_throughput(stepper(p), batch_size, steps=steps, peak=peak) for p in precisions]
    for r in rows:
        r["variant"] = "step"
    for r in throughput.batch_sweep(lambda b: stepper("bf16", b), sweep, steps=steps, peak=peak):
        rows.append({**r, "variant": "batch sweep"})
    if compiled:
        t0 = time.time()
        s = stepper("bf16", compile_towers=True)
        s.step()  # the compile
        rows.append({**throughput.step_throughput(s, batch_size, steps=steps, peak=peak), "variant": "compiled",
                     "compile_seconds": time.time() - t0})
    out = {"check": f"{method} throughput", "ok": True, "problems": [], "method": method, "rows": rows}
    if accum:
        s = stepper("bf16")
        out["accum_breakdown"] = throughput.accum_breakdown(s.case, device, "bf16", accum)
    if data_loop:
        out["data_loop"] = throughput.data_loop_throughput(stepper("bf16"), train_tf, tokenizer, batch_size,
                                                          steps=steps, workers=min(8, os.cpu_count() or 1))
    return out


def throughput_rows(results: list[dict]) -> list[dict]:
    """The markdown rows of section 5: one per measured (method, variant, batch, precision)."""
    rows = []
    for r in results:
        for t in r.get("rows", ()):
            if t.get("out_of_memory"):
                rows.append({"method": r["method"], "variant": t["variant"], "batch": t["batch_size"],
                             "precision": "", "pairs/s": "out of memory", "GFLOP/pair": "", "TFLOP/s": "", "MFU": ""})
                continue
            rows.append({"method": r["method"], "variant": t["variant"], "batch": t["batch_size"],
                         "precision": t["precision"], "pairs/s": f"{t['pairs_per_s']:.0f}",
                         "GFLOP/pair": f"{t['gflop_per_pair']:.1f}", "TFLOP/s": f"{t['achieved_tflops']:.1f}",
                         "MFU": f"{100 * t['mfu']:.1f} %" if t["mfu"] is not None else "no peak"})
    return rows


def summary_rows(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        detail = r.get("problems") and "; ".join(r["problems"]) or ""
        if "max_rel_diff" in r:
            detail = detail or (f"loss {r['losses'][-1]:.4f} vs {r['reference_losses'][-1]:.4f}, "
                                f"rel diff {r['max_rel_diff']:.1e}, skipped {sum(r['skipped'])}")
        rows.append({"check": r["check"], "ok": {True: "yes", False: "NO", None: "skipped"}[r["ok"]],
                     "s/step": f"{r['sec_per_step']:.3f}" if r.get("sec_per_step") else "",
                     "peak MiB": f"{r['peak_mib']:.0f}" if r.get("peak_mib") else "",
                     "fp32 peak MiB": f"{r['reference_peak_mib']:.0f}" if r.get("reference_peak_mib") else "",
                     "detail": detail})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--out", default="runs/gpu_check.json", help="the JSON written")
    p.add_argument("--backbone", default="ViT-B/16", help="backbone (random weights)")
    p.add_argument("--batch-size", type=int, default=64, help="batch of the per-method steps")
    p.add_argument("--steps", type=int, default=3, help="steps per method and precision")
    p.add_argument("--methods", default=",".join(METHODS), help="comma list of " + ", ".join(METHODS))
    p.add_argument("--skip-bench", action="store_true", help="do not run benchmarks/bench.py --quick")
    p.add_argument("--skip-throughput", action="store_true", help="do not run section 5 (throughput)")
    p.add_argument("--throughput-steps", type=int, default=30, help="timed steps per throughput row (>= 30)")
    p.add_argument("--budget", type=float, default=540, help="seconds; sections that would not fit are skipped")
    p.add_argument("--device", default="cuda", help="cuda (cpu only for testing this script)")
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_check.py needs CUDA, and torch {torch.__version__} sees no GPU here; run it on a machine "
              f"with one (see the README)", file=sys.stderr)
        return 2
    t0, device = time.time(), torch.device(a.device)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []

    def left():
        return a.budget - (time.time() - t0)

    def run(name, need, fn):
        if left() < need:
            results.append({"check": name, "ok": None, "problems": [f"skipped: {left():.0f}s left, needs ~{need}s"]})
        else:
            print(f"[{time.time() - t0:5.0f}s] {name}", flush=True)
            results.append(fn())

    torch.manual_seed(0)
    base, train_tf, _, tok = models.load_model(a.backbone, "random", device=str(device))
    methods = [m for m in a.methods.split(",") if m]
    for m in methods:
        run(f"{m} step", 30, lambda m=m: check_method(m, base, tok, device, batch_size=a.batch_size, steps=a.steps,
                                                      backbone=a.backbone))
    for m in methods:  # exact accumulation under fp16's grad scaler: the same losses as one fp32 batch
        run(f"{m} step, --accum-freq 4", 30, lambda m=m: check_method(
            m, base, tok, device, batch_size=a.batch_size, steps=a.steps, backbone=a.backbone, accum=4))
    for clip in (0.0, 1.0):  # without clipping the scaler unscales inside step(); with it, before clipping
        run("overflow skip", 20, lambda clip=clip: overflow_check(
            build(methods[0], copy.deepcopy(base), tok, min(a.batch_size, 16), device, backbone=a.backbone),
            device, grad_clip=clip))
    with tempfile.TemporaryDirectory() as tmp:
        run("common.train overflow + resume", 90, lambda: resume_check(a.backbone, device, "fp16", tmp))
    if device.type == "cuda" and torch.cuda.device_count() >= 2:
        run("2-process DDP", 120, lambda: ddp_check(a.backbone, "cuda", "fp16"))
    else:
        msg = f"skipped: {torch.cuda.device_count() if device.type == 'cuda' else 0} GPU(s), needs 2"
        results.append({"check": "2-process NCCL DDP", "ok": None, "problems": [msg]})
        print(msg, flush=True)
    if not a.skip_throughput:
        import throughput
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        peak, key = throughput.peak_tflops(name)
        measured = throughput.matmul_tflops(device, n=8192 if device.type == "cuda" else 256, repeat=5)
        results.append({"check": "bf16 matmul rate", "ok": True, "problems": [], "device": name,
                        "peak_tflops": peak, "peak_key": key, "measured_tflops": measured})
        print(f"{name}: dense bf16 peak {peak or 'not in the table'} TFLOP/s ({key or '-'}), measured 8192^3 bf16 "
              f"matmul {measured:.0f} TFLOP/s", flush=True)
        for m in methods:
            plain = m == "plain"
            run(f"{m} throughput", 120 if plain else 30, lambda m=m, plain=plain: throughput_check(
                m, base, tok, device, batch_size=a.batch_size, backbone=a.backbone, peak=peak or measured,
                steps=a.throughput_steps, sweep=SWEEP if plain else (), compiled=plain, accum=4 if plain else 0,
                data_loop=plain, train_tf=train_tf))
    if not a.skip_bench:
        run("bench.py --quick", 150, lambda: bench_quick(out.with_name(out.stem + "_bench.json"), max(60, left() - 10)))
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "backbone": a.backbone,
            "batch_size": a.batch_size, "steps": a.steps, "seconds": time.time() - t0}
    out.write_text(json.dumps({"info": info, "results": results}, indent=1, default=str))
    print(f"\n{info['device']}, torch {info['torch']}, {a.backbone} (random weights), batch {a.batch_size}, "
          f"{info['seconds']:.0f}s; {out}")
    print(markdown_table(summary_rows(results),
                                ["check", "ok", "s/step", "peak MiB", "fp32 peak MiB", "detail"]))
    if any(r.get("rows") for r in results):
        print("\nThroughput (pairs/s over the median step; MFU = achieved / the chip's dense peak):\n")
        print(markdown_table(throughput_rows(results), ["method", "variant", "batch", "precision", "pairs/s",
                                                               "GFLOP/pair", "TFLOP/s", "MFU"]))
    bench = next((r for r in results if r["check"].startswith("bench.py") and r.get("table")), None)
    if bench:
        print("\nbench.py --quick:\n" + bench["table"])
    return 1 if any(r["ok"] is False for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
