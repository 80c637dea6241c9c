"""Each method's math, as it runs by default, is in the method's file (issue 56, item 2): one default
training step of every method on the lab's tiny backbone (gmc.py: its own small model), traced with
sys.setprofile from the loss computation through the parameter update (common.train_step: forward,
loss, backward, clipping, the method's hooks, the optimizer and scheduler step). Every Python function
the step calls must be defined in the method's own file, in common.py, in plumbing/ (the machinery:
errors, settings, models, files) or in a library (torch, open_clip); a function of another repository
file (another method, eval.py, the lab, a paper's driver in papers/) that runs in the step is math a
reviewer of the method file would not find there."""
import copy
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import cclip
import common
import dns
import erclip
import gmc
import lab
import longclip
import m2mix
from papers import cclip_tasks, mosei
from plumbing import models

ROOT = Path(__file__).resolve().parents[1]
B = 8  # rows of a CLIP method's batch (DNS: its default batch on cached features)


def allowed_files(method: str) -> set:
    """The repository files whose functions may run in `method`'s step."""
    return {ROOT / f"{method}.py", ROOT / "common.py", *(ROOT / "plumbing").glob("*.py")}


def traced(step):
    """Runs step() under sys.setprofile (this thread and any thread started meanwhile) -> (step's return
    value, {(file, qualified name)} of every Python function called)."""
    calls = set()

    def profile(frame, event, arg):
        if event == "call":
            calls.add((frame.f_code.co_filename, frame.f_code.co_qualname))

    previous = sys.getprofile()
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        out = step()
    finally:
        sys.setprofile(previous)
        threading.setprofile(None)
    return out, calls


def outside(method: str, calls) -> list:
    """'file: function' for each traced function defined in a repository file `method` may not call
    (tests/: this harness, standing in for the method's driver)."""
    allowed, found = allowed_files(method), set()
    for filename, name in calls:
        path = Path(filename).resolve()
        if filename.startswith("<") or not path.is_relative_to(ROOT) or path.is_relative_to(ROOT / "tests"):
            continue
        if path not in allowed:
            found.add(f"{path.relative_to(ROOT)}: {name}")
    return sorted(found)


def clip_step(net, batch, cfg, lr_of=None, schedule=None, hooks=None):
    """One common.train_step as common.train sets it up (its optimizer, schedule, scaler and ctx) at
    step 0; returns the step as a function of nothing."""
    device, total = torch.device("cpu"), 100
    opt = common.make_optimizer(cfg, net, device, lr_of)
    multipliers = schedule(opt, total, total) if schedule else common.warmup_cosine(cfg.warmup, total)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, multipliers)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    ctx = SimpleNamespace(step=0, epoch=0, total_steps=total, device=device, precision="fp32",
                          generator=common.step_generator(cfg.seed, 0))
    net.train()
    return lambda: common.train_step(net, batch, ctx, opt, scaler, sched, grad_clip=cfg.grad_clip,
                                     hooks=hooks)


def items(n=B):
    g = torch.Generator().manual_seed(3)
    return [{"image": torch.randn(3, lab.IMAGE_SIZE, lab.IMAGE_SIZE, generator=g), "caption": s["caption"],
             "long_caption": s["long_caption"]} for s in lab.world_split(lab.FINETUNE, n, seed=7)]


def erclip_step(tiny, tmp_path, monkeypatch):  # as erclip.train_erclip
    model, _, _, tok = tiny
    cfg = erclip.ERCLIPConfig(backbone="tiny")
    net = erclip.ERCLIP(model, cfg)
    lr_of = ((lambda name: cfg.fusion_lr if name.startswith("fusion.") else cfg.lr)
             if cfg.fusion_lr else None)
    return traced(clip_step(net, erclip.SentenceCollate(tok, cfg.max_sentences)(items()), cfg, lr_of))[1]


def longclip_step(tiny, tmp_path, monkeypatch):  # as longclip.train_longclip
    model = tiny[0]
    cfg = longclip.LongCLIPConfig(backbone="tiny")
    net = longclip.LongCLIP(model, cfg)
    tok = models.get_tokenizer(cfg.backbone, net.context_length)
    return traced(clip_step(net, longclip.LongCaptionCollate(tok, cfg.short_caption)(items()), cfg))[1]


def m2mix_step(tiny, tmp_path, monkeypatch):  # as m2mix.finetune
    model, _, _, tok = tiny
    cfg = m2mix.M2MixConfig(backbone="tiny")
    net = m2mix.M2Mix(model, cfg)
    hooks = m2mix.Fp16Storage(model) if cfg.fp16_weights else None
    heads = ("model.visual.head.", "model.text.proj.")
    lr_of = (lambda n: cfg.head_lr if n.startswith(heads) else cfg.lr) if cfg.head_lr else None
    return traced(clip_step(net, common.Collate(tok)(items()), cfg, lr_of, hooks=hooks))[1]


def cclip_step(tiny, tmp_path, monkeypatch):  # as cclip.run's learn_task, task 1
    model, _, _, tok = tiny
    cfg = cclip.CClipConfig(backbone="tiny")
    teacher = copy.deepcopy(model)
    common.add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets.split(","))
    head = cclip.projector(model.visual.output_dim, cfg.proj_hidden)
    net = cclip.CClip(model, teacher, head, cfg.ckc_weight, cfg.label_smoothing, cfg.ckc_directions)
    lr_of = cclip.make_lr_of(cfg, *cclip_tasks.task_lrs(cfg, "task"))
    schedule = (cclip_tasks.epoch_warmup_cosine(B // cfg.batch_size, min(5, cfg.epochs - 1), cfg.epochs,
                                                0.01 * cfg.lr, 0.01 * cfg.lr) if cfg.schedule == "research"
                else None)
    return traced(clip_step(net, common.Collate(tok)(items()), cfg, lr_of, schedule))[1]


def dns_step(tiny, tmp_path, monkeypatch):
    """DNSLearner.learn's first step of task 2 (task 1's features are the past), all settings default."""
    model, _, _, tok = tiny
    cfg = dns.DNSConfig(backbone="tiny", device="cpu")
    n = cfg.batch_size
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # the cached frozen features of two tasks' pairs
        img = model.encode_image(torch.randn(2 * n, 3, lab.IMAGE_SIZE, lab.IMAGE_SIZE, generator=g),
                                 normalize=True)
        txt = common.encode_text(model, tok([s["caption"] for s in lab.world_split(lab.FINETUNE, 2 * n, 9)]))
    learner = dns.DNSLearner(img.shape[1], float(model.logit_scale.detach()), cfg.label_smoothing, cfg.loss, cfg.bias)
    learner.learn(cfg, img[:n], txt[:n], tmp_path / "task1")
    calls, real = [], common.train_step

    def first_traced(*a, **kw):
        if calls:
            return real(*a, **kw)
        out, found = traced(lambda: real(*a, **kw))
        calls.append(found)
        return out
    monkeypatch.setattr(common, "train_step", first_traced)
    summary = learner.learn(cfg, img[n:], txt[n:], tmp_path / "task2")
    assert summary["old_rank"], "task 2 has a past: its step is projected"
    return calls[0]


def gmc_step(tiny, tmp_path, monkeypatch):  # as gmc.run (GMC's own encoders, not CLIP)
    cfg = gmc.GMCConfig()
    dims, steps = (5, 4, 3), 6
    g = torch.Generator().manual_seed(2)
    torch.manual_seed(cfg.seed)
    net = gmc.GMCNet(gmc.GMC(dims, steps, layers=cfg.layers), cfg)
    batch = {m: torch.randn(cfg.batch_size, steps, d, generator=g) for m, d in zip(mosei.MODALITIES, dims)}
    batch["label"] = torch.randn(cfg.batch_size, generator=g)
    constant = lambda opt, steps_per_epoch, total: lambda step: 1.0  # noqa: E731  gmc.run's schedule
    return traced(clip_step(net, batch, cfg, schedule=constant))[1]


STEPS = {"erclip": erclip_step, "longclip": longclip_step, "m2mix": m2mix_step, "cclip": cclip_step,
         "dns": dns_step, "gmc": gmc_step}


@pytest.mark.parametrize("method", list(STEPS))
def test_a_default_step_runs_only_the_method_file_common_and_the_machinery(method, tiny_random, tmp_path,
                                                                          monkeypatch):
    calls = STEPS[method](tiny_random, tmp_path, monkeypatch)
    own = [name for f, name in calls if Path(f).resolve() == ROOT / f"{method}.py"]
    assert own, f"no function of {method}.py ran: the trace saw nothing of the step"
    found = outside(method, calls)
    assert not found, (f"{method}'s default step runs functions defined outside {method}.py, common.py and "
                       f"plumbing/'s machinery:\n  " + "\n  ".join(found))


def test_the_trace_sees_a_function_of_another_file():
    """The check itself: a step that calls into the lab is caught, and named."""
    _, calls = traced(lambda: lab.world_split(lab.FINETUNE, 2, seed=0))
    assert any(f.startswith("lab/world.py: world_split") for f in outside("dns", calls))
