"""The shared training loop: AMP, non-finite guard, checkpoints, resume, DDP."""
import json
import os
import socket

import open_clip
import pytest
import torch

from plumbing import base, models
import common
from plumbing.base import RunError, atomic_write
from plumbing.flags import Config, parse_config
import lab
from _processes import spawn_two  # tests/_processes.py: two gloo processes, forked


def _cfg(tmp_path, **kw):
    base = dict(epochs=1, steps=6, batch_size=8, lr=1e-3, wd=0.1, warmup=2, workers=0, precision="fp32",
                out=str(tmp_path / "run"), save_every=0, log_every=1, device="cpu", seed=0)
    base.update(kw)
    return Config(**base)


def _data(tmp_path, pre, n=32):
    return common.ManifestDataset(lab.synthetic_manifest("test", tmp_path / "data", n=n), pre)


def _fresh_tiny(seed=0):
    torch.manual_seed(seed)
    return models.load_model("tiny", "random")


def test_train_writes_logs_and_checkpoint(tmp_path):
    model, pre, _, tok = _fresh_tiny()
    summary = common.train(_cfg(tmp_path), lab.ClipFineTune(model), _data(tmp_path, pre), common.Collate(tok))
    out = tmp_path / "run"
    assert summary["steps"] == 6
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in lines] == list(range(1, 7)) and "loss_clip" in lines[0]
    assert json.loads((out / "config.json").read_text())["batch_size"] == 8
    assert (out / "checkpoints" / "last.pt").exists() and (out / "model.pt").exists()
    assert model.logit_scale.item() <= common.LOGIT_SCALE_MAX + 1e-6


def test_logit_scale_is_clamped(tmp_path):
    model, pre, _, tok = _fresh_tiny()
    with torch.no_grad():
        model.logit_scale.fill_(common.LOGIT_SCALE_MAX + 1.0)
    common.train(_cfg(tmp_path, steps=1, lr=1e-6), lab.ClipFineTune(model), _data(tmp_path, pre),
                 common.Collate(tok), export=False)
    assert model.logit_scale.item() == pytest.approx(common.LOGIT_SCALE_MAX)


def test_bf16_autocast_step_on_cpu(tmp_path):
    model, pre, _, tok = _fresh_tiny()
    before = model.visual.conv1.weight.detach().clone()
    s = common.train(_cfg(tmp_path, steps=2, precision="bf16"), lab.ClipFineTune(model),
                     _data(tmp_path, pre), common.Collate(tok), export=False)
    assert s["precision"] == "bf16" and torch.isfinite(torch.tensor(s["final_losses"]["loss_clip"]))
    assert not torch.equal(before, model.visual.conv1.weight)


def test_fp16_on_cpu_is_for_testing_and_says_so_once(capsys):
    """fp16 + GradScaler on CPU runs (tests/test_fp16.py exercises it), with one warning line."""
    base.warn_once.cache_clear()
    assert common.resolve_precision("fp16", "cpu") == "fp16"
    assert common.resolve_precision("fp16", "cpu") == "fp16"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "meant for testing" in err and "bf16" in err
    assert common.resolve_precision("auto", "cpu") == "fp32" and common.resolve_precision("auto", "cuda") == "fp16"
    with pytest.raises(ValueError, match="unknown precision"):
        common.resolve_precision("fp8", "cpu")


@pytest.mark.parametrize("method,on_cuda", [("erclip", "fp16"), ("longclip", "fp16"), ("m2mix", "fp16"),
                                            ("cclip", "fp16"), ("dns", "fp32"), ("gmc", "fp32")])
def test_each_methods_default_precision_on_cuda(method, on_cuda):
    """Issue 57.1: GMC's code (a Lightning Trainer at its default, 32) and CMCL's (TrainingArguments without
    fp16 / bf16) train in fp32, so gmc.py and dns.py default to fp32 on CUDA; the CLIP methods' auto is fp16
    there. fp32 on CPU for every method (the demos unchanged); --precision auto still gives fp16 on CUDA."""
    module = __import__(method)
    config = next(v for v in vars(module).values() if isinstance(v, type) and v.__module__ == method
                  and v.__name__.endswith("Config"))
    default = parse_config(config, []).precision
    assert common.resolve_precision(default, "cuda") == on_cuda
    assert common.resolve_precision(default, "cpu") == "fp32"
    assert parse_config(config, ["--precision", "auto"]).precision == "auto"
    assert parse_config(config, ["--precision", "amp"]).precision == "fp16"  # open_clip's name too


class _Exploding(lab.ClipFineTune):
    def forward(self, batch, ctx=None):
        out = super().forward(batch, ctx)
        if ctx.step >= 3:
            out["loss_bad"] = torch.tensor(float("nan"))
        return out


def test_non_finite_loss_stops_and_keeps_last_checkpoint(tmp_path):
    model, pre, _, tok = _fresh_tiny()
    cfg = _cfg(tmp_path, save_every=2)
    with pytest.raises(FloatingPointError, match=r"step 4: .*loss_bad"):  # metrics.jsonl's numbering
        common.train(cfg, _Exploding(model), _data(tmp_path, pre), common.Collate(tok))
    ck = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=False)
    assert ck["step"] == 2
    assert all(torch.isfinite(v).all() for v in ck["net"].values() if v.is_floating_point())


def test_resume_equals_uninterrupted_run(tmp_path):
    """Stop at step 3 of 7 (across an epoch boundary: 4 steps per epoch), resume, compare."""
    model_a, pre, _, tok = _fresh_tiny()
    data = _data(tmp_path, pre)
    common.train(_cfg(tmp_path, steps=7, out=str(tmp_path / "a")), lab.ClipFineTune(model_a), data,
                 common.Collate(tok), export=False)
    model_b = _fresh_tiny()[0]
    cfg_b = _cfg(tmp_path, steps=7, out=str(tmp_path / "b"), stop_at=3)
    assert common.train(cfg_b, lab.ClipFineTune(model_b), data, common.Collate(tok))["stopped_at"] == 3
    torch.manual_seed(123)  # the resumed process starts from another RNG state
    model_c = _fresh_tiny(seed=99)[0]
    common.train(_cfg(tmp_path, steps=7, out=str(tmp_path / "b"), resume="latest"), lab.ClipFineTune(model_c),
                 data, common.Collate(tok), export=False)
    for (k, a), (_, c) in zip(model_a.state_dict().items(), model_c.state_dict().items()):
        assert torch.allclose(a, c, atol=1e-6), k


def test_resume_without_checkpoint_fails(tmp_path):
    model, pre, _, tok = _fresh_tiny()
    with pytest.raises(RunError, match="no checkpoint"):
        common.train(_cfg(tmp_path, resume="latest"), lab.ClipFineTune(model), _data(tmp_path, pre),
                     common.Collate(tok))


def test_checkpoint_round_trip_through_open_clip(tmp_path):
    model, _, pre, tok = _fresh_tiny()
    model.eval()
    path = models.save_model(model, tmp_path / "m.pt", "tiny", source="random")
    meta = json.loads((tmp_path / "m.pt.json").read_text())
    assert meta["model"] == models.TINY_NAME and meta["context_length"] == 24 and meta["quick_gelu"] is False
    sd = torch.load(path, weights_only=True)
    assert not any(k.startswith("module.") for k in sd)
    other, _, _ = open_clip.create_model_and_transforms(models.TINY_NAME, pretrained=str(path))
    other.eval()
    x = torch.randn(2, 3, lab.IMAGE_SIZE, lab.IMAGE_SIZE)
    t = tok(["a red circle.", "a photo of a blue square."])
    with torch.no_grad():
        assert torch.allclose(model.encode_image(x), other.encode_image(x), atol=1e-6)
        assert torch.allclose(model.encode_text(t), other.encode_text(t), atol=1e-6)
    again = models.load_model("tiny", str(path))[0].eval()
    with torch.no_grad():
        assert torch.allclose(model.encode_text(t), again.encode_text(t), atol=1e-6)


def _ddp_worker(rank, world, port, tmp, batch):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = models.load_model("tiny", "random")[0]
    net = lab.ClipFineTune(model)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    half = len(batch["image"]) // world
    local = {k: v[rank * half:(rank + 1) * half] for k, v in batch.items()}
    loss = ddp(local)["loss_clip"]
    loss.backward()
    if rank == 0:
        torch.save({"loss": loss.detach(), "grads": {n: p.grad for n, p in net.named_parameters()}},
                   os.path.join(tmp, "ddp.pt"))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_ddp_two_processes_match_one(tmp_path):
    torch.manual_seed(0)
    model = models.load_model("tiny", "random")[0]
    tok = open_clip.get_tokenizer(models.TINY_NAME)
    g = torch.Generator().manual_seed(1)
    size = lab.TINY_CFG["vision_cfg"]["image_size"]
    batch = {"image": torch.randn(8, 3, size, size, generator=g),
             "text": tok([f"a photo of a {c} {s}." for c, s in zip(lab.COLORS, lab.SHAPES * 2)][:6]
                         + ["a red cross.", "a dark picture of a blue diamond."])}
    net = lab.ClipFineTune(model)
    loss = net(batch)["loss_clip"]
    loss.backward()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn_two(_ddp_worker, 2, port, str(tmp_path), batch)
    res = torch.load(tmp_path / "ddp.pt", weights_only=False)
    assert res["loss"].item() == pytest.approx(loss.item(), rel=1e-5)
    for n, p in net.named_parameters():
        assert torch.allclose(res["grads"][n], p.grad, atol=1e-6, rtol=1e-4), n


def test_atomic_write_text_bytes_callable_and_failure(tmp_path):
    p = tmp_path / "sub" / "f.json"
    assert atomic_write(p, "ünïcode") == p and p.read_text(encoding="utf-8") == "ünïcode"
    atomic_write(p, b"\x00\x01")
    assert p.read_bytes() == b"\x00\x01"
    atomic_write(p, lambda tmp: torch.save({"x": 1}, tmp))
    assert torch.load(p) == {"x": 1}

    def half_written(tmp):
        tmp.write_text("partial")
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        atomic_write(p, half_written)
    assert torch.load(p) == {"x": 1}  # the old file is intact
    assert sorted(x.name for x in p.parent.iterdir()) == ["f.json"]  # no temporary file left


def test_a_dependencys_warning_is_shown_once_per_run_not_every_step(tmp_path):
    """Issue 42.4: under torchrun open_clip's all_gather FutureWarning printed twice per rank per step (24 lines for
    6 steps): a warnings filter set inside every step reset Python's once-per-place memo. Now it is set once."""
    import warnings
    import lab
    from plumbing import models

    class Noisy(lab.ClipFineTune):
        def features(self, batch, ctx=None):
            warnings.warn("a dependency's deprecation", FutureWarning)
            return super().features(batch, ctx)

    data = lab.synthetic_manifest("train", tmp_path / "data", n=16)
    model, train_tf, _, tok = models.load_model("tiny", "random")
    cfg = Config(steps=4, batch_size=8, workers=0, precision="fp32", out=str(tmp_path / "run"), log_every=1,
                        device="cpu")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        common.train(cfg, Noisy(model), common.ManifestDataset(data, train_tf), common.Collate(tok), export=False)
    assert sum(issubclass(w.category, FutureWarning) for w in seen) == 1
