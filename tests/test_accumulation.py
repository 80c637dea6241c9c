"""Exact gradient accumulation (--accum-freq K, common.accumulated_backward), issue 28.4: for every method, one
step over K = 4 micro-batches gives the gradient (and so the weights) of one step over the whole batch, the
in-batch terms included: ERCLIP's sentences and teacher, m2-Mix's mixes, C-CLIP's CKC (its projector's
BatchNorm over the batch) and LoRA, Long-CLIP's PCA in both scopes, DNS's projected gradient. In float64, where
only the order of float sums differs: gradients within 1e-9 relative, weights after the step within 1e-6."""
import copy
import math
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import cclip
import common
from plumbing.base import UsageError
from plumbing.flags import Config, parse_config
from plumbing import models
import dns
import erclip
import lab
import longclip
import m2mix
from _processes import spawn_two  # tests/_processes.py: two gloo processes, forked

N = 8  # rows of the whole batch; K = 4 micro-batches of 2


def _tiny():
    torch.manual_seed(0)
    model, _, _, tok = models.load_model("tiny", "random")
    return model, tok


def _scenes(n=N):
    return lab.world_split(lab.FINETUNE, n, seed=7)


def _images(n=N):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 3, lab.IMAGE_SIZE, lab.IMAGE_SIZE, generator=g)


def _erclip(fusion, lambda_p):
    model, tok = _tiny()
    cfg = erclip.ERCLIPConfig(backbone="tiny", fusion=fusion, lambda_p=lambda_p)
    items = [{"image": img, "caption": s["caption"], "long_caption": s["long_caption"]}
             for img, s in zip(_images(), _scenes())]
    return erclip.ERCLIP(model, cfg), erclip.SentenceCollate(tok)(items), None


def _longclip(scope):
    model, tok = _tiny()
    cfg = longclip.LongCLIPConfig(backbone="tiny", pca_dim=3, pca_scope=scope, keep=4)
    net = longclip.LongCLIP(model, cfg)
    items = [{"image": img, "caption": s["caption"], "long_caption": s["long_caption"]}
             for img, s in zip(_images(), _scenes())]
    return net, longclip.LongCaptionCollate(models.get_tokenizer("tiny", net.context_length))(items), None


def _m2mix(method):
    model, tok = _tiny()
    cfg = m2mix.M2MixConfig(backbone="tiny", method=method)
    return m2mix.M2Mix(model, cfg), {"image": _images(), "text": tok([s["caption"] for s in _scenes()])}, None


def _cclip():
    model, tok = _tiny()
    teacher = copy.deepcopy(model)
    common.add_lora(model)
    for mod in model.modules():  # adapters that act: B is zero at the start
        if isinstance(mod, common.LoRA):
            torch.nn.init.normal_(mod.B, std=0.02)
    net = cclip.CClip(model, teacher, cclip.projector(model.visual.output_dim, 16))
    return net, {"image": _images(), "text": tok([s["caption"] for s in _scenes()])}, None


def _dns(mode):
    g = torch.Generator().manual_seed(5)
    img, txt = (F.normalize(torch.randn(N, 16, generator=g), dim=-1) for _ in range(2))
    old = torch.randn(16, 3, generator=g, dtype=torch.float64)
    P = old @ torch.linalg.pinv(old)  # a projector on a 3-dimensional old subspace
    hooks = dns.NullSpaceProjection(mode, {k: (P, P) for k in ("W_img", "W_txt")})
    net = dns.DNSNet(16, math.log(1 / 0.07))
    net.hooks = hooks
    return net, {"img": img, "txt": txt, "index": torch.arange(N)}, hooks


CASES = {
    "clip": lambda: (lab.ClipFineTune(_tiny()[0]), _m2mix("ft")[1], None),
    "erclip-mean-teacher": lambda: _erclip("mean", 1.0),
    "erclip-rt": lambda: _erclip("rt", 0.0),
    "longclip-rank": lambda: _longclip("rank"),
    "longclip-global": lambda: _longclip("global"),
    "m2mix-m2": lambda: _m2mix("m2"),
    "m2mix-m3": lambda: _m2mix("m3"),
    "cclip-lora-ckc": _cclip,
    "dns-gradient": lambda: _dns("gradient"),
    "dns-update": lambda: _dns("update"),
}


class Grab:
    """train_step's hooks: the method's own (DNS's projection) first, then the gradients the optimizer gets."""
    def __init__(self, inner=None):
        self.inner, self.grads = inner, {}

    def before_optimizer_step(self, net):
        if self.inner is not None:
            self.inner.before_optimizer_step(net)
        self.grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}

    def after_optimizer_step(self, net):
        if self.inner is not None:
            self.inner.after_optimizer_step(net)


def _double(batch):
    return {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}


def _step(net, batch, hooks, accum):
    """One train_step in float64 -> (gradients the optimizer got, weights after the step, loss terms)."""
    net, hooks = copy.deepcopy((net, hooks))
    if hooks is not None:
        net.hooks = hooks
    net.double().train()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-3, foreach=False)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    ctx = SimpleNamespace(step=0, epoch=0, total_steps=1, device=torch.device("cpu"), precision="fp32",
                          generator=common.step_generator(0, 0))
    grab = Grab(hooks)
    losses, _, _ = common.train_step(net, _double(batch), ctx, opt, scaler, hooks=grab, accum=accum)
    return grab.grads, {n: p.detach().clone() for n, p in net.named_parameters()}, losses


def _relative(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


@pytest.mark.parametrize("case", list(CASES))
def test_four_micro_batches_give_the_whole_batchs_step(case):
    net, batch, hooks = CASES[case]()
    grads1, weights1, losses1 = _step(net, batch, hooks, 1)
    grads4, weights4, losses4 = _step(net, batch, hooks, 4)
    assert set(losses1) == set(losses4) and len(losses1) >= 1
    for k in losses1:  # the same loss, computed once over the whole batch
        assert float(losses4[k].detach()) == pytest.approx(float(losses1[k].detach()), rel=1e-12), k
    assert grads1.keys() == grads4.keys() and len(grads1) > 0
    total = sum(g.square().sum() for g in grads1.values()).sqrt()
    moving = 0
    for n, g in grads1.items():  # (a bias before BatchNorm has gradient 0: rounding noise, hence the floor)
        assert (grads4[n] - g).norm() <= 1e-9 * g.norm() + 1e-13 * total, (n, _relative(grads4[n], g))
        moving += bool(g.norm() > 1e-9 * total)
    assert moving >= 2  # the towers (or maps) got gradient, not only the temperature
    for n, w in weights1.items():
        assert _relative(weights4[n], w) < 1e-6, n


def test_erclip_micro_batches_carry_their_own_sentences():
    net, batch, _ = _erclip("mean", 0.0)
    parts = net.split_batch(batch, 4)
    assert [len(p["image"]) for p in parts] == [2] * 4
    assert sum(len(p["sentence_tokens"]) for p in parts) == len(batch["sentence_tokens"])
    assert torch.equal(torch.cat([p["sentence_tokens"] for p in parts]), batch["sentence_tokens"])
    for p in parts:
        assert len(p["sentence_tokens"]) == int(p["sentence_counts"].sum()) == p["sentence_stats"][0]
    seen = net.sentences_seen
    _step(net, batch, None, 4)
    assert net.sentences_seen == seen  # _step trains a copy; the copy counted each sentence once:
    net2 = copy.deepcopy(net).double()
    common.train_step(net2, _double(batch), SimpleNamespace(step=0, epoch=0, device=torch.device("cpu"),
                      precision="fp32", generator=common.step_generator(0, 0)),
                      torch.optim.SGD(net2.parameters(), lr=0.0), torch.amp.GradScaler("cpu", enabled=False),
                      accum=4)
    assert net2.sentences_seen == batch["sentence_stats"][0]


def test_dropout_draws_the_same_masks_in_both_passes():
    """LoRA dropout (C-CLIP): K micro-batches draw other masks than one batch would, so the reference is the
    whole-batch loss over features computed micro-batch by micro-batch from the same seed; the second pass must
    draw the first pass's masks to match it."""
    model, tok = _tiny()
    common.add_lora(model, dropout=0.5)
    for mod in model.modules():
        if isinstance(mod, common.LoRA):
            torch.nn.init.normal_(mod.B, std=0.02)
    net = cclip.CClip(model).double().train()
    batch = _double({"image": _images(), "text": tok([s["caption"] for s in _scenes()])})
    ctx = SimpleNamespace(step=0, epoch=0, device=torch.device("cpu"), precision="fp32", generator=None)
    torch.manual_seed(11)
    parts = [net.features(mb, ctx) for mb in common.split_batch(batch, 4)]
    whole = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    sum(net.losses(whole, ctx).values()).backward()
    ref = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    net.zero_grad(set_to_none=True)
    torch.manual_seed(11)
    common.accumulated_backward(net, batch, ctx, torch.amp.GradScaler("cpu", enabled=False), 4)
    for n, g in ref.items():
        assert _relative(net.get_parameter(n).grad, g) < 1e-9, n


def _weight_casts(net, batch, k, keep_cache=True):
    """How many times each weight was cast to bf16 in one accumulated step, and the gradients. keep_cache=False
    runs the step as it was before issue 75.2: autocast's cache dropped after every pass."""
    from torch.utils._python_dispatch import TorchDispatchMode
    # the matrices autocast casts (an embedding added with an explicit .to(dtype), as open_clip's positional
    # embedding is, is the model's own cast, never cached)
    weights = {p.data_ptr(): n for n, p in net.named_parameters() if p.ndim == 2 and "embedding" not in n}
    casts = dict.fromkeys(weights.values(), 0)

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
                name = weights.get(args[0].data_ptr())
                if name is not None:
                    casts[name] += 1
            return func(*args, **kwargs)
    net.zero_grad(set_to_none=True)
    ctx = SimpleNamespace(step=0, epoch=0, device=torch.device("cpu"), precision="bf16",
                          generator=common.step_generator(0, 0))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    torch.manual_seed(5)
    with Casts():
        if keep_cache:
            common.accumulated_backward(net, batch, ctx, scaler, k)
        else:
            common._accumulated_backward(net, batch, ctx, scaler, k)
    return casts, {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


def test_an_accumulated_step_casts_each_weight_once():
    """Issue 75.2: under bf16 / fp16 autocast each weight's low-precision copy is made once per step, not once per
    pass (k passes without a graph, k replays): on a GPU every cast is a host dispatch. The gradients are the
    ones the step gave with a cast per pass, bit for bit."""
    model, tok = _tiny()
    net = lab.ClipFineTune(model).train()
    batch = {"image": _images(), "text": tok([s["caption"] for s in _scenes()])}
    once, grads = _weight_casts(net, batch, 4)
    per_pass, grads_before = _weight_casts(net, batch, 4, keep_cache=False)
    cast = {n for n, c in per_pass.items() if c}
    assert len(cast) >= 10  # the towers' linear layers
    assert {once[n] for n in cast} == {1}
    assert min(per_pass[n] for n in cast) >= 8  # 4 passes without a graph + 4 replays (before the change)
    assert grads.keys() == grads_before.keys()
    for n, g in grads_before.items():
        assert torch.equal(grads[n], g), n


def test_accum_freq_is_checked_and_scales_the_per_gpu_batch():
    cfg = parse_config(Config, ["--batch-size-per-gpu", "16", "--accum-freq", "4"])
    assert cfg.batch_size == 64  # open_clip: global = per-GPU micro-batch x processes x accum_freq
    with pytest.raises(SystemExit):
        parse_config(Config, ["--accum-freq", "0"])
    with pytest.raises(UsageError, match="does not divide"):
        common.split_batch({"image": torch.zeros(6, 1)}, 4)


def test_training_with_accumulation_follows_the_one_batch_run(tmp_path):
    """common.train end to end in float32 (the weights as they are trained): 4 steps of batch 8 with
    --accum-freq 4 and without; the runs differ by float32 rounding only."""
    data = lab.synthetic_manifest("train", tmp_path / "data", n=16)
    start, out = None, {}
    for k in (1, 4):
        torch.manual_seed(0)
        model, train_tf, _, tok = models.load_model("tiny", "random")
        start = start or {n: v.clone() for n, v in model.state_dict().items()}
        cfg = Config(steps=4, batch_size=8, lr=1e-3, warmup=1, workers=0, precision="fp32", save_every=0,
                            log_every=1, device="cpu", seed=0, out=str(tmp_path / f"k{k}"), accum_freq=k)
        common.train(cfg, lab.ClipFineTune(model), common.ManifestDataset(data, train_tf), common.Collate(tok),
                     export=False)
        out[k] = model.state_dict()
    moved = sum((v - start[n]).square().sum() for n, v in out[1].items()).sqrt()
    diff = sum((out[4][n] - v).square().sum() for n, v in out[1].items()).sqrt()
    assert moved > 0 and diff < 1e-3 * moved


def _ddp_worker(rank, world, port, tmp, data):
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, train_tf, _, tok = models.load_model("tiny", "random")
    cfg = Config(steps=3, batch_size=8, lr=1e-3, warmup=1, workers=0, precision="fp32", save_every=0,
                        log_every=1, device="cpu", seed=0, out=str(tmp / "ddp"), accum_freq=2)
    common.train(cfg, lab.ClipFineTune(model), common.ManifestDataset(data, train_tf), common.Collate(tok),
                 export=False)
    if rank == 0:
        torch.save(model.state_dict(), tmp / "ddp_weights.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_processes_accumulating_train_like_one_process(tmp_path):
    """2 gloo processes x 2 micro-batches of 2 (the reducer bypassed, one average per step) = 1 process, batch 8."""
    data = lab.synthetic_manifest("train", tmp_path / "data", n=16)
    torch.manual_seed(0)
    model, train_tf, _, tok = models.load_model("tiny", "random")
    start = {n: v.clone() for n, v in model.state_dict().items()}
    cfg = Config(steps=3, batch_size=8, lr=1e-3, warmup=1, workers=0, precision="fp32", save_every=0,
                        log_every=1, device="cpu", seed=0, out=str(tmp_path / "one"))
    common.train(cfg, lab.ClipFineTune(model), common.ManifestDataset(data, train_tf), common.Collate(tok),
                 export=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn_two(_ddp_worker, 2, port, tmp_path, data)
    two = torch.load(tmp_path / "ddp_weights.pt", weights_only=True)
    one = model.state_dict()
    moved = sum((v - start[n]).square().sum() for n, v in one.items()).sqrt()
    diff = sum((two[n] - v).square().sum() for n, v in one.items()).sqrt()
    assert moved > 0 and diff < 1e-3 * moved
