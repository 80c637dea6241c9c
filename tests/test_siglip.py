"""Issue 59.1: SigLIP's sigmoid loss (common.siglip_loss) for every method whose term is a CLIP loss (--loss siglip):
equal to open_clip's SigLipLoss on identical inputs, on one process and on two (our gathered global batch against
open_clip's neighbour exchange, gloo), each method's step computing it on its own features, the logit_bias added at
SigLIP's init to a CLIP backbone and carried through model.pt and --export, SigLIP backbones by open_clip's names
(offline: one message each), and the methods that refuse it."""
import copy
import math
import os
import socket

import open_clip
import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import SigLipLoss

import cclip
import common
from plumbing.base import RunError, UsageError
from plumbing.flags import parse_config
import dns
import erclip
import gmc
import lab
import longclip
import m2mix
from plumbing import models
from _processes import spawn_two  # tests/_processes.py: two gloo processes, forked


def _features(n=12, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    img = F.normalize(torch.randn(n, d, generator=g), dim=-1)
    txt = F.normalize(img + 0.7 * torch.randn(n, d, generator=g), dim=-1)  # partners a little alike
    return img, txt


@pytest.mark.parametrize("scale, bias", [(10.0, -10.0), (1 / 0.07, -3.5), (100.0, 2.0)])
def test_the_loss_and_its_gradients_equal_open_clips(scale, bias):
    img, txt = _features()
    ours_in = [t.clone().requires_grad_(True) for t in (img, txt, torch.tensor(scale), torch.tensor(bias))]
    theirs_in = [t.clone().requires_grad_(True) for t in (img, txt, torch.tensor(scale), torch.tensor(bias))]
    ours = common.siglip_loss(*ours_in)
    theirs = SigLipLoss()(*theirs_in)
    ours.backward()
    theirs.backward()
    assert abs(ours.item() - theirs.item()) <= 1e-6 * max(1.0, abs(theirs.item()))
    for a, b in zip(ours_in, theirs_in):
        assert (a.grad - b.grad).abs().max() <= 1e-6 * max(1.0, float(b.grad.abs().max()))


def test_the_loss_is_the_papers_sum_over_pairs():
    """Eq. 1 written out pair by pair: -1/B sum_ij log sigma(z_ij (s x_i.y_j + b)), z = +1 on the diagonal."""
    img, txt = _features(n=5)
    s, b = 7.0, -4.0
    total = sum(-math.log(1 / (1 + math.exp(-(1 if i == j else -1) * (s * float(img[i] @ txt[j]) + b))))
                for i in range(5) for j in range(5)) / 5
    assert abs(float(common.siglip_loss(img, txt, s, b)) - total) < 1e-5
    assert common.contrastive_loss(img, txt, s) == common.clip_loss(img, txt, s)  # no bias: CLIP's loss


def _two_ranks(rank, port, tmp, impl):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    x_img, x_txt = _features(n=8, seed=3)
    out = {}
    for path in ("ours", "open_clip"):
        torch.manual_seed(0)
        W = torch.nn.Linear(16, 16, bias=False)  # the same weights on both ranks, as DDP keeps them
        scale, bias = torch.tensor(10.0, requires_grad=True), torch.tensor(-10.0, requires_grad=True)
        local = slice(rank * 4, rank * 4 + 4)
        img, txt = F.normalize(W(x_img[local]), dim=-1), F.normalize(W(x_txt[local]), dim=-1)
        if path == "ours":  # every method's form: gather with gradient, the loss over the global batch
            loss = common.siglip_loss(*common.gather(img, txt), scale, bias)
        else:
            loss = SigLipLoss(rank=rank, world_size=2, dist_impl=impl)(img, txt, scale, bias)
        loss.backward()
        grads = [W.weight.grad, scale.grad, bias.grad]
        for g in grads:  # DDP's average over ranks
            torch.distributed.all_reduce(g)
            g /= 2
        out[path] = [g.clone() for g in grads]
    if rank == 0:
        torch.save(out, os.path.join(tmp, f"grads-{impl}.pt"))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["bidir", "gather"])
def test_two_processes_give_open_clips_distributed_gradient(tmp_path, impl):
    """Our DDP form (gathered features, the global batch's loss on every rank) and open_clip's (local images against
    every rank's texts, exchanged between neighbours, or gathered) give the same averaged gradient, and both the
    one-process gradient of the whole batch."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spawn_two(_two_ranks, port, str(tmp_path), impl)
    got = torch.load(tmp_path / f"grads-{impl}.pt")
    torch.manual_seed(0)
    W = torch.nn.Linear(16, 16, bias=False)
    scale, bias = torch.tensor(10.0, requires_grad=True), torch.tensor(-10.0, requires_grad=True)
    x_img, x_txt = _features(n=8, seed=3)
    common.siglip_loss(F.normalize(W(x_img), dim=-1), F.normalize(W(x_txt), dim=-1), scale, bias).backward()
    one = [W.weight.grad, scale.grad, bias.grad]
    for a, b, c in zip(got["ours"], got["open_clip"], one):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6) and torch.allclose(a, c, rtol=1e-5, atol=1e-6)


def _batch(tok, n=6, size=32):
    g = torch.Generator().manual_seed(1)
    return {"image": torch.randn(n, 3, size, size, generator=g),
            "text": tok([f"a photo of a {c} {s}." for c, s in zip(lab.COLORS, lab.SHAPES * 2)][:n])}


def test_each_method_takes_its_clip_terms_as_siglips(tiny_random):
    """ERCLIP's L_short / L_long, Long-CLIP's two terms, m2-Mix's base term, C-CLIP's task loss: with --loss siglip
    each equals siglip_loss on the step's own features, scale and the model's logit_bias (added at SigLIP's init)."""
    model0, _, _, tok = tiny_random
    batch = _batch(tok)

    def fresh(cfg):
        return copy.deepcopy(model0)

    cfg = parse_config(erclip.ERCLIPConfig, ["--loss", "siglip", "--lambda-p", "0"])
    net = erclip.ERCLIP(fresh(cfg), cfg)
    assert net.model.logit_bias.item() == -10.0 and abs(net.model.logit_scale.exp().item() - 10.0) < 1e-5
    bias, scale = net.model.logit_bias, net.model.logit_scale.exp()
    img, txt, long = _features(6, 16, 1)[0], _features(6, 16, 2)[1], _features(6, 16, 3)[0]
    terms = erclip.erclip_losses(img, txt, long, None, None, scale, 1.0, 0.0, 0.1, bias)
    assert torch.allclose(terms["loss_short"], common.siglip_loss(img, txt, scale, bias))
    assert torch.allclose(terms["loss_long"], common.siglip_loss(img, long, scale, bias))

    terms = longclip.longclip_losses(img, long, txt, long, scale, 0.1, bias)
    assert torch.allclose(terms["loss_long"], common.siglip_loss(img, txt, scale, bias))
    assert torch.allclose(terms["loss_short"], common.siglip_loss(long, long, scale, bias))

    for method_cfg, make in (
            (parse_config(m2mix.M2MixConfig, ["--loss", "siglip", "--method", "ft", "--backbone", "tiny"]),
             lambda m, c: m2mix.M2Mix(m, c)),
            (parse_config(cclip.CClipConfig, ["--loss", "siglip", "--backbone", "tiny"]),
             lambda m, c: cclip.CClip(m, loss="siglip"))):
        model = fresh(method_cfg)
        models.pair_bias(model, "siglip")
        net = make(model, method_cfg)
        with torch.no_grad():
            f = net.features(batch, None)
            ctx = type("Ctx", (), {"epoch": 0, "generator": torch.Generator().manual_seed(0)})()
            losses = net.losses(f, ctx)
            i, t = F.normalize(f["img"], dim=-1), F.normalize(f["txt"], dim=-1)
            want = common.siglip_loss(i, t, model.logit_scale.exp(), model.logit_bias)
        assert torch.allclose(losses["loss_clip"], want, atol=1e-5), type(net).__name__


def test_siglip_init_open_clip_starts_where_open_clips_fine_tuning_does(tiny_random, tmp_path):
    """--siglip-init open_clip (issue 74.1): open_clip_train's --siglip asks for s = 10, b = -10, then loads the
    CLIP checkpoint (open_clip/factory.py load_checkpoint), which brings its logit scale and, having no
    logit_bias, a zero one. Each method's net built with the flag starts at that model's (s, b); without it at
    SigLIP's (the default, unchanged)."""
    model0, _, _, _ = tiny_random
    with torch.no_grad():
        model0.logit_scale.fill_(math.log(100.0))  # a CLIP checkpoint's trained scale
    path = tmp_path / "clip.pt"
    torch.save(model0.state_dict(), path)
    theirs = open_clip.create_model(models.TINY_NAME, pretrained=str(path), init_logit_scale=math.log(10),
                                    init_logit_bias=-10)
    assert theirs.logit_bias.item() == 0.0 and theirs.logit_scale.item() == pytest.approx(math.log(100.0))
    siglip = ["--loss", "siglip", "--siglip-init", "open_clip"]
    for net_class, cfg_class, extra in ((erclip.ERCLIP, erclip.ERCLIPConfig, ["--lambda-p", "0"]),
                                        (longclip.LongCLIP, longclip.LongCLIPConfig, ["--no-stretch"]),
                                        (m2mix.M2Mix, m2mix.M2MixConfig, ["--backbone", "tiny"])):
        net = net_class(copy.deepcopy(model0), parse_config(cfg_class, siglip + extra))
        assert net.model.logit_bias.item() == theirs.logit_bias.item()
        assert net.model.logit_scale.item() == theirs.logit_scale.item()
    model = copy.deepcopy(model0)
    models.pair_bias(model, "siglip", parse_config(cclip.CClipConfig, siglip).siglip_init)  # cclip.main's
    assert model.logit_bias.item() == 0.0 and model.logit_scale.item() == theirs.logit_scale.item()
    paper = erclip.ERCLIP(copy.deepcopy(model0), parse_config(erclip.ERCLIPConfig, ["--loss", "siglip"]))
    assert paper.model.logit_bias.item() == -10.0 and paper.model.logit_scale.item() == pytest.approx(math.log(10))


def test_siglip_init_values_are_checked_when_the_flags_are_parsed(capsys):
    """One argparse line for a value that is not paper / open_clip, for open_clip without --loss siglip (it
    would do nothing) and in dns.py (its b is frozen at -10, deviation 14); a programming error for the API."""
    for cls, argv, said in ((erclip.ERCLIPConfig, ["--loss", "siglip", "--siglip-init", "big_vision"],
                             "invalid choice"),
                            (m2mix.M2MixConfig, ["--siglip-init", "open_clip"], "add --loss siglip"),
                            (dns.DNSConfig, ["--loss", "siglip", "--siglip-init", "open_clip"], "invalid choice")):
        with pytest.raises(SystemExit):
            parse_config(cls, argv)
        assert said in capsys.readouterr().err
    assert parse_config(dns.DNSConfig, ["--loss", "siglip"]).siglip_init == "paper"
    with pytest.raises(ValueError, match="'paper' or 'open_clip'"):
        models.pair_bias(torch.nn.Module(), "siglip", "zero")


def test_dns_takes_siglip_at_its_frozen_scale():
    net = dns.DNSNet(16, math.log(1 / 0.07), loss="siglip")
    img, txt = _features()
    got = net.losses({"img": img, "txt": txt})["loss_clip"]
    assert torch.allclose(got, common.siglip_loss(img, txt, 1 / 0.07, -10.0), atol=1e-5)
    assert [n for n, _ in net.named_parameters()] == ["model.W_img", "model.W_txt"]  # b is no parameter


def test_a_siglip_run_saves_and_exports_its_bias(tmp_path):
    """Through erclip.py: the bias trains (it moves from -10), model.pt's sidecar says it is there and loads back
    with it, the export's config builds it (open_clip's init_logit_bias), both the same model as the run's."""
    root = tmp_path / "data"
    lab.synthetic_manifest("train", root, n=16)
    erclip.main(["--data-root", str(root), "--train-data", "synthetic", "--train-pairs", "16", "--batch-size", "8",
                 "--steps", "2", "--warmup", "0", "--lr", "1e-2", "--workers", "0", "--device", "cpu",
                 "--eval-tasks", "none", "--loss", "siglip", "--out", str(tmp_path / "r"),
                 "--export", str(tmp_path / "e")])
    saved = models.load_model("tiny", str(tmp_path / "r" / "model.pt"))[0]
    exported = models.load_model("tiny", str(tmp_path / "e"))[0]
    bias, exported_bias = float(saved.logit_bias.detach()), float(exported.logit_bias.detach())
    assert bias != -10.0 and bias == exported_bias
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(saved.encode_image(x), exported.encode_image(x))
    assert '"init_logit_bias": -10.0' in (tmp_path / "e" / "open_clip_config.json").read_text()


def test_a_siglip_backbone_keeps_its_own_bias_and_scale():
    """A SigLIP architecture (open_clip's ViT-B-16-SigLIP, random weights: no download) has its logit_bias:
    --loss siglip trains that one and leaves the scale as it is."""
    model = open_clip.create_model("ViT-B-16-SigLIP", pretrained=None)
    with torch.no_grad():
        model.logit_scale.fill_(3.0)
        model.logit_bias.fill_(-7.0)
    assert models.pair_bias(model, "siglip") is model.logit_bias
    assert float(model.logit_bias.detach()) == -7.0 and float(model.logit_scale.detach()) == 3.0
    assert models.pair_bias(model, "clip") is None


def test_siglip_backbones_offline_and_hub_names_are_one_message(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RunError, match="ViT-B-16-SigLIP weights 'webli'"):  # its one tag, by default
        models.load_model("ViT-B-16-SigLIP", "")
    with pytest.raises(RunError, match="tokenizer is the Hugging Face hub's timm/ViT-B-16-SigLIP"):
        models.load_model("ViT-B-16-SigLIP", "random")
    with pytest.raises(UsageError, match="--pretrained local-dir:DIR"):
        models.load_model("hf-hub:timm/ViT-B-16-SigLIP", "")


def test_gmc_refuses_siglip_and_lora():
    for flag in (["--loss", "siglip"], ["--lora", "4"]):
        with pytest.raises(UsageError, match="GMC trains its encoders from scratch"):
            gmc.main(["--data", "nowhere.pkl", *flag])
    with pytest.raises(SystemExit):
        parse_config(erclip.ERCLIPConfig, ["--loss", "sigmoid"])


@pytest.mark.parametrize("name", ["longclip", "m2mix", "cclip"])
def test_every_method_runs_end_to_end_with_siglip(name, tmp_path):
    """The CLI path of the others (erclip.py's is above): a short run trains the added logit_bias."""
    from test_lora import _run  # the shared tiny-run arguments
    from test_cclip import _argv as cclip_argv
    if name == "cclip":
        cclip.main(cclip_argv(tmp_path / "d", tmp_path / "r", "--loss", "siglip", "--steps", "2", "--lr", "1e-2"))
        model = tmp_path / "r" / "model.pt"
    else:
        _run({"longclip": longclip, "m2mix": m2mix}[name], tmp_path, "r", "--loss", "siglip")
        model = tmp_path / "r" / "model.pt"
    bias = torch.load(model, weights_only=True)["logit_bias"]
    assert torch.isfinite(bias) and bias.item() != -10.0


def test_cclip_main_passes_siglip_init_on(tmp_path):
    """cclip.py adds the bias in main() (before its LoRA): a short run with --siglip-init open_clip ends near
    b = 0 and the random tiny model's own scale ln(1 / 0.07), far from SigLIP's b = -10, s = 10 (3 steps a task at
    lr 1e-3 move either by well under 0.1)."""
    from test_cclip import _argv as cclip_argv
    cclip.main(cclip_argv(tmp_path / "d", tmp_path / "r", "--loss", "siglip", "--siglip-init", "open_clip"))
    saved = torch.load(tmp_path / "r" / "model.pt", weights_only=True)
    assert abs(saved["logit_bias"].item()) < 0.1
    assert abs(saved["logit_scale"].item() - math.log(1 / 0.07)) < 0.1
