"""Issue 59.5: per-tower rates (--lr-image, --lr-text) and open_clip's layer-wise lr decay (--image-layer-decay,
--text-layer-decay) in common.train's AdamW groups (plumbing/param_rates.py): the rate of every parameter of the
tiny backbone by hand, a method's own rates kept, every method's groups unchanged with the flags off, the flags
through a real run, and one message for a model without the tower or the layout."""
import dataclasses
import re

import pytest
import torch
import torch.nn as nn

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
from papers import cclip_tasks
from plumbing import flags, param_rates

N = 4  # the tiny backbone's blocks per tower (lab.tiny.TINY_CFG: layers 4 and 4)


def by_hand(name: str, lr: float, image: tuple[float, float], text: tuple[float, float]) -> float:
    """The rate of one tiny-backbone parameter from the rule in the flags' help, written out by name: (tower rate,
    decay) per tower; block i of N at decay ** (N - i), the last block's final norm with it (open_clip groups it
    there), the embeddings at decay ** (N + 1), the projection at decay ** 0."""
    name = name.removeprefix("model.")
    if name == "logit_scale":
        return lr  # in no tower
    (base, decay), name = (image, name.removeprefix("visual.")) if name.startswith("visual.") else (text, name)
    if m := re.match(r"transformer\.resblocks\.(\d+)\.", name):
        return base * decay ** (N - int(m.group(1)))
    if name.startswith(("ln_post.", "ln_final.")):
        return base * decay ** 1
    if name in ("proj", "text_projection"):
        return base * decay ** 0
    assert name.split(".")[0] in ("conv1", "class_embedding", "positional_embedding", "ln_pre", "token_embedding"), name
    return base * decay ** (N + 1)


def rates_of(groups) -> dict:
    return {name: g["lr"] for g in groups for name in g["names"]}


def test_every_tiny_parameter_gets_the_rate_of_its_layer(tiny_random):
    net = lab.ClipFineTune(tiny_random[0])
    cfg = flags.Config(lr=1e-3, lr_text=3e-3, image_layer_decay=0.5, text_layer_decay=0.8)
    groups = common.param_groups(net, cfg.lr, cfg.wd, param_rates.lr_of(cfg, net))
    got = rates_of(groups)
    assert set(got) == {n for n, _ in net.named_parameters()}
    for name, lr in got.items():
        assert lr == by_hand(name, 1e-3, (1e-3, 0.5), (3e-3, 0.8)), name  # the same arithmetic: exact
    assert got["model.visual.conv1.weight"] == 1e-3 / 32 and got["model.visual.proj"] == 1e-3
    assert got["model.visual.transformer.resblocks.3.mlp.c_fc.weight"] == 5e-4 == got["model.visual.ln_post.weight"]
    assert {g["weight_decay"] for g in groups} == {0.0, cfg.wd}  # the decay split is kept inside each rate
    opt = common.make_optimizer(cfg, net, "cpu")  # what train builds: the same rates
    assert sorted(g["lr"] for g in opt.param_groups) == sorted(g["lr"] for g in groups)


def test_per_tower_rates_without_decay(tiny_random):
    net = lab.ClipFineTune(tiny_random[0])
    cfg = flags.Config(lr=1e-3, lr_image=2e-4)
    got = rates_of(common.param_groups(net, cfg.lr, cfg.wd, param_rates.lr_of(cfg, net)))
    assert {got[n] for n in got if n.startswith("model.visual.")} == {2e-4}
    assert {got[n] for n in got if not n.startswith("model.visual.")} == {1e-3}  # text tower, logit_scale: --lr


def test_flags_off_leave_every_methods_groups_as_they_were(tiny_random):
    """Without the flags, param_rates changes nothing: no rate function for a method without rates of its own
    (param_groups' default path, as before), and a method's own lr_of gives the numbers its old form gave."""
    model = tiny_random[0]
    for cls in (erclip.ERCLIPConfig, longclip.LongCLIPConfig, m2mix.M2MixConfig, cclip.CClipConfig,
                dns.DNSConfig, gmc.GMCConfig, flags.Config):
        assert param_rates.lr_of(parse_config(cls, []), lab.ClipFineTune(model)) is None, cls
    cfg = parse_config(erclip.ERCLIPConfig, ["--fusion", "rt", "--fusion-lr", "7e-4"])
    net = erclip.ERCLIP(model, cfg)
    before = rates_of(common.param_groups(  # the form erclip.py passed before issue 59
        net, cfg.lr, cfg.wd, lambda n: cfg.fusion_lr if n.startswith("fusion.") else cfg.lr))
    now = rates_of(common.param_groups(net, cfg.lr, cfg.wd, param_rates.lr_of(
        cfg, net, lambda n: cfg.fusion_lr if n.startswith("fusion.") else None)))  # erclip.py's now
    assert now == before and 7e-4 in now.values()


def test_cclip_keeps_its_rates_and_the_decay_scales_them(tiny_random):
    """C-CLIP's make_lr_of names every parameter's rate (its --lr-image / --lr-text, the paper's presets), so the
    shared tower rates never apply to it: its numbers stay; a layer decay multiplies them."""
    model = tiny_random[0]
    cfg = parse_config(cclip.CClipConfig, ["--lr", "1e-5", "--lr-image", "2e-6", "--lr-text", "3e-5"])
    net = cclip.CClip(model, None, None, 0.0, 0.0, "sum")
    own = cclip.make_lr_of(cfg, *cclip_tasks.task_lrs(cfg, "flickr30k"))  # the preset: not the flags' values
    got = rates_of(common.param_groups(net, cfg.lr, cfg.wd, param_rates.lr_of(cfg, net, own)))
    assert got == {n: own(n) for n, _ in net.named_parameters()}
    decayed = dataclasses.replace(cfg, image_layer_decay=0.5)
    got = rates_of(common.param_groups(net, cfg.lr, cfg.wd, param_rates.lr_of(decayed, net, own)))
    assert got["model.visual.conv1.weight"] == own("model.visual.conv1.weight") * 0.5 ** 5
    assert got["model.visual.proj"] == own("model.visual.proj") and got["model.logit_scale"] == cfg.lr
    assert got["model.token_embedding.weight"] == own("model.token_embedding.weight")  # text: no decay asked


def test_a_methods_own_rate_wins_in_a_tower(tiny_random):
    """m2-Mix's --head-lr names the projections inside the towers: they keep it, the rest of the tower takes
    --lr-image (and a decay multiplies both)."""
    net = lab.ClipFineTune(tiny_random[0])
    cfg = flags.Config(lr=1e-3, lr_image=2e-4, image_layer_decay=0.5)
    rate = param_rates.lr_of(cfg, net, lambda n: 9e-3 if n == "model.visual.proj" else None)
    assert rate("model.visual.proj") == 9e-3 and rate("model.visual.conv1.weight") == 2e-4 * 0.5 ** 5


def test_a_run_trains_at_the_rates_the_rule_gives(tmp_path):
    """Through a real run (erclip.py): the optimizer in the checkpoint holds exactly the rates the rule gives."""
    root = tmp_path / "data"
    lab.synthetic_manifest("train", root, n=16)
    erclip.main(["--data-root", str(root), "--train-data", "synthetic", "--train-pairs", "16", "--batch-size", "8",
                 "--steps", "2", "--warmup", "0", "--lr", "1e-4", "--lr-text", "3e-4", "--image-layer-decay",
                 "0.5", "--workers", "0", "--device", "cpu", "--eval-tasks", "none", "--pretrained", "random",
                 "--out", str(tmp_path / "r")])
    state = torch.load(tmp_path / "r" / "checkpoints" / "last.pt", weights_only=True)["optimizer"]
    assert {g["initial_lr"] for g in state["param_groups"]} == {1e-4 * 0.5 ** k for k in range(6)} | {3e-4}


def test_the_decays_are_checked_at_parse_time(capsys):
    assert flags.parse_config(flags.Config, ["--visual-layer-decay", "0.7"]).image_layer_decay == 0.7  # open_clip's
    for bad in ("0", "1.5", "-0.1", "nan"):
        with pytest.raises(SystemExit):
            flags.parse_config(flags.Config, ["--text-layer-decay", bad])
        assert "must be in (0, 1]" in capsys.readouterr().err


def test_a_model_without_the_tower_or_its_layout_is_one_message(tiny_random):
    class Maps(nn.Module):  # DNS's and GMC's nets: no CLIP tower
        def __init__(self):
            super().__init__()
            self.model = nn.Linear(2, 2)
    for flag, field in (("--lr-image", dict(lr_image=1e-4)), ("--text-layer-decay", dict(text_layer_decay=0.5))):
        with pytest.raises(UsageError, match=f"{flag}: this run's model \\(Linear\\) has no"):
            param_rates.lr_of(flags.Config(**field), Maps())

    class ResNetCLIP(nn.Module):  # a tower of another layout (open_clip's ModifiedResNet, timm, Hugging Face)
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.visual = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3))
    rate = param_rates.lr_of(flags.Config(lr_image=1e-4), ResNetCLIP())  # a rate needs no layers
    assert rate("model.visual.0.weight") == 1e-4
    with pytest.raises(UsageError, match="--image-layer-decay: the image tower \\(Sequential\\) is not a "
                                                "transformer of open_clip's layout"):
        param_rates.lr_of(flags.Config(image_layer_decay=0.5), ResNetCLIP())
    groups = param_rates.layer_groups(tiny_random[0], "image")  # open_clip's names and order
    assert [g for g, _ in groups] == ["embeddings", "layer.0", "layer.1", "layer.2", "layer.3", "proj"]


def test_resume_refuses_a_changed_decay_and_override_says_what_it_cannot_change(tmp_path):
    root = tmp_path / "data"
    lab.synthetic_manifest("train", root, n=16)
    argv = ["--data-root", str(root), "--train-data", "synthetic", "--train-pairs", "16", "--batch-size", "8",
            "--steps", "3", "--workers", "0", "--device", "cpu", "--eval-tasks", "none", "--pretrained", "random",
            "--out", str(tmp_path / "r")]
    erclip.main([*argv, "--stop-at", "1"])
    with pytest.raises(RunError, match=r"changed settings: --image-layer-decay 1.0 \(run\) -> 0.5 \(now\)"):
        erclip.main([*argv, "--resume", "latest", "--image-layer-decay", "0.5"])
    with pytest.raises(RunError, match="not how the parameters split into groups"):  # was a traceback
        erclip.main([*argv, "--resume", "latest", "--override-resume", "--image-layer-decay", "0.5"])
    assert erclip.main([*argv, "--resume", "latest"])["summary"]["steps"] == 3
