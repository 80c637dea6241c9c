"""Issue 59.2: --lora RANK for every method on one implementation (common.LoRA / add_lora / merge_lora, C-CLIP's
moved there): only the adapters train, a resumed run is the uninterrupted one, model.pt and --export hold a plain
open_clip model (merged at coefficient 1), and <out>/lora_adapter is a peft adapter that peft loads onto the
untouched backbone and that gives the trained model's features, logit scale and SigLIP bias (issue 72.1: checked
at write time, at a learning rate that moves the weights, with and without --lock-image). cclip.py's --lora R is
its own LoRA at rank R; dns.py and gmc.py refuse it with one message."""
import json
import re

import pytest
import torch

import cclip
import common
from plumbing.base import UsageError
import dns
import erclip
import lab
import longclip
import m2mix
from plumbing import models
from test_cclip import _argv as cclip_argv  # C-CLIP's two-task run on the tiny backbone

FAST = ["--steps", "2", "--warmup", "0", "--batch-size", "8", "--workers", "0", "--device", "cpu", "--lr", "1e-2",
        "--save-every", "0", "--log-every", "1"]


def _run(method, tmp_path, name, *extra):
    root = tmp_path / "data"
    if not root.exists():
        lab.synthetic_manifest("train", root, n=16)
    argv = ["--data-root", str(root), "--train-data", "synthetic", "--eval-tasks", "none", "--out",
            str(tmp_path / name), *FAST, *extra]
    if method is erclip:
        argv += ["--train-pairs", "16"]
    if method is m2mix:
        argv += ["--backbone", "tiny", "--method", "m2", "--precision", "fp32"]
    if method is longclip:
        argv += ["--pca-dim", "4"]
    return method.main(argv)


def _features(model, x):
    with torch.no_grad():
        return model.encode_image(x, normalize=True)


@pytest.mark.parametrize("method", [erclip, longclip, m2mix], ids=["erclip", "longclip", "m2mix"])
def test_only_the_adapters_train_and_the_saved_model_is_plain(method, tmp_path):
    _run(method, tmp_path, "r", "--lora", "2")
    saved = torch.load(tmp_path / "r" / "model.pt", weights_only=True)
    base = models.load_model("tiny", world=lab.WORLD)[0].state_dict()
    assert not [k for k in saved if "lora" in k or "parametrizations" in k]
    targets = [k for k in saved if k.endswith(("attn.in_proj_weight", "attn.out_proj.weight", "mlp.c_fc.weight",
                                               "mlp.c_proj.weight"))]
    assert len(targets) == 4 * 8  # 4 weights in each of the tiny backbone's 8 blocks
    moved = {k for k in saved if k in base and not torch.equal(saved[k], base[k])}
    own = {"positional_embedding", "logit_scale"} if method is longclip else set()  # its deviations 1 and 5
    assert moved - own and moved - own <= set(targets)  # only the adapted weights trained (logit_scale too)
    assert json.loads((tmp_path / "r" / "lora_adapter" / "adapter_config.json").read_text())["r"] == 2
    readme = (tmp_path / "r" / "lora_adapter" / "README.md").read_text()  # Long-CLIP's window: said, not silent
    assert ("longclip.stretch_text_window(base, keep, factor)" in readme) == (method is longclip)


def _peft_model(folder, base=None):
    """The adapter loaded as its README says: the extras on the backbone as loaded, then PeftModel."""
    import peft
    from safetensors.torch import load_file
    from plumbing import lora as lora_files
    assert lora_files.LOAD in (folder / "README.md").read_text()
    scope = {"load_file": load_file, "torch": torch, "PeftModel": peft.PeftModel, "adapter": str(folder),
             "base": base if base is not None else models.load_model("tiny", world=lab.WORLD)[0].eval()}
    exec(lora_files.LOAD, scope)  # the README's lines, as written
    return scope["model"].eval()


def _scores(model, x, tokens):
    with torch.no_grad():
        img, txt = model.encode_image(x, normalize=True), model.encode_text(tokens, normalize=True)
        bias = getattr(model, "logit_bias", None)
        return img, txt, model.logit_scale.exp() * img @ txt.t() + (0 if bias is None else bias)


@pytest.mark.parametrize("extra", [[], ["--lock-image"], ["--loss", "siglip"]], ids=["both", "lock-image", "siglip"])
def test_the_peft_adapter_is_the_trained_model(extra, tmp_path, capsys):
    """Issue 72.1: at a learning rate that moves the weights (features 1e-2 and more from the backbone's), peft
    (0.21.2) builds the trained model from the backbone and <out>/lora_adapter within 1e-4, with the default
    targets (out_proj included: its B written for peft's double application), logit_scale and SigLIP's
    logit_bias carried (the logits equal), and a --lock-image run wraps no image-tower module."""
    import peft
    _run(erclip, tmp_path, "r", "--lora", "4", *extra, "--export", str(tmp_path / "e"))
    said = capsys.readouterr().err
    folder = tmp_path / "r" / "lora_adapter"
    assert f"[lora] {folder}: peft {peft.__version__} loads it as the trained model" in said
    trained = models.load_model("tiny", str(tmp_path / "r" / "model.pt"))[0].eval()
    base = models.load_model("tiny", world=lab.WORLD)[0].eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 32, 32, generator=g)
    tokens = torch.randint(1, 400, (4, trained.context_length), generator=g)
    want, before = _scores(trained, x, tokens), _scores(base, x, tokens)
    exported = models.load_model("tiny", str(tmp_path / "e"))[0].eval()
    assert all(torch.equal(a, b) for a, b in zip(_scores(exported, x, tokens), want))
    moved = [(w - b).abs().max() for w, b in zip(want[:2], before[:2])]
    locked = extra == ["--lock-image"]
    assert moved[1] > 1e-2 and (moved[0] == 0 if locked else moved[0] > 1e-2)  # it moved, far beyond 1e-4
    adapted = _peft_model(folder, base)
    got = _scores(adapted.base_model.model, x, tokens)
    assert (got[0] - want[0]).abs().max() < 1e-4 and (got[1] - want[1]).abs().max() < 1e-4
    assert (got[2] - want[2]).abs().max() < 1e-4 * want[2].abs().max()  # the logits: scale (and bias) carried
    clip = adapted.base_model.model
    assert torch.equal(clip.logit_scale, trained.logit_scale)
    if "siglip" in extra:
        assert trained.logit_bias is not None and torch.equal(clip.logit_bias, trained.logit_bias)
    wrapped = {n for n, m in clip.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert wrapped and any(n.startswith("visual.") for n in wrapped) != locked  # no image-tower module if locked
    merged = _peft_model(folder).merge_and_unload()  # peft's merge gives the trained weights too
    assert (_scores(merged, x, tokens)[1] - want[1]).abs().max() < 1e-4


def _moved_adapters(model, rank=2):
    common.add_lora(model, rank=rank, alpha=4.0)
    with torch.no_grad():
        for lora in common.adapters(model).values():
            lora.B.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    return common.adapters(model)


def test_the_write_time_check_says_when_peft_would_differ(tiny_random, tmp_path, capsys, monkeypatch):
    """The check can fail: written as if peft applied out_proj once, peft 0.21.2's model differs from the trained
    one, and one line (and the README) says by how much; without peft, one line says it was not checked."""
    from plumbing import lora as lora_files
    model = tiny_random[0]
    found = _moved_adapters(model)
    monkeypatch.setattr(lora_files, "peft_out_proj_factor", lambda: 1.0)
    check = lora_files.export_peft(model, found, tmp_path / "a", "tiny")["lora_adapter_check"]
    line = capsys.readouterr().err
    assert check["checked"] and not check["passed"] and check["image"] > 1e-3, check
    assert f"[lora] {tmp_path / 'a'}: warning: peft" in line and "differs from the trained one by up to" in line
    assert "differs from the trained one" in (tmp_path / "a" / "README.md").read_text()
    monkeypatch.setitem(__import__("sys").modules, "peft", None)  # peft not installed
    monkeypatch.setattr(lora_files, "peft_out_proj_factor", lambda: None)
    check = lora_files.export_peft(model, found, tmp_path / "b", "tiny")["lora_adapter_check"]
    assert check == {"checked": False, "out_proj_factor": 1.0}
    assert "warning: not checked with peft (peft is not installed" in capsys.readouterr().err


def test_pefts_out_proj_factor_is_measured():
    """peft 0.21.2 applies an nn.MultiheadAttention's out_proj update twice (huggingface/peft PR #3774)."""
    import peft
    from plumbing import lora as lora_files
    k = lora_files.peft_out_proj_factor()
    assert k == 2.0 if peft.__version__ == "0.21.2" else k in (1.0, 2.0)


def test_the_adapter_file_holds_every_factor_in_pefts_names(tiny_random, tmp_path):
    """Default targets (out_proj included): every adapter's A and B under the key peft's own
    get_peft_model_state_dict gives that weight (out_proj's B divided by the installed peft's factor, 2 for
    0.21.2), and the config peft reads (r, lora_alpha, target_modules: a pattern naming exactly the adapted
    modules)."""
    import re
    from safetensors.torch import load_file
    from plumbing import lora as lora_files
    model = tiny_random[0]
    found = _moved_adapters(model)
    folder = tmp_path / "adapter"
    lora_files.export_peft(model, found, folder, "tiny")
    sd = load_file(str(folder / "adapter_model.safetensors"))
    got = found["visual.transformer.resblocks.1.attn.out_proj.weight"]
    key = "base_model.model.visual.transformer.resblocks.1.attn.base_layer.out_proj.lora_"
    k = lora_files.peft_out_proj_factor()
    assert torch.equal(sd[key + "A.weight"], got.A.detach()) and torch.equal(sd[key + "B.weight"], got.B.detach() / k)
    got = found["transformer.resblocks.0.mlp.c_fc.weight"]
    assert torch.equal(sd["base_model.model.transformer.resblocks.0.mlp.c_fc.lora_B.weight"], got.B.detach())
    config = json.loads((folder / "adapter_config.json").read_text())
    targets = {n for n, _ in model.named_modules() if re.fullmatch(config["target_modules"], n)}
    assert (config["r"], config["lora_alpha"], len(targets)) == (2, 4.0, 8 * 3)
    assert targets == {n.rpartition(".")[0].removesuffix(".out_proj") for n in found}
    assert len(sd) == 8 * 4 * 2  # A and B of in_proj, out_proj, c_fc, c_proj in 8 blocks


def test_a_resumed_lora_run_is_the_uninterrupted_one(tmp_path):
    _run(erclip, tmp_path, "whole", "--lora", "2", "--steps", "3")
    _run(erclip, tmp_path, "parts", "--lora", "2", "--steps", "3", "--stop-at", "1")
    ckpt = torch.load(tmp_path / "parts" / "checkpoints" / "last.pt", weights_only=True)
    state = ckpt["net"]
    assert any(k.endswith("parametrizations.in_proj_weight.0.A") for k in state), list(ckpt)  # adapters saved
    _run(erclip, tmp_path, "parts", "--lora", "2", "--steps", "3", "--resume", "latest")
    a = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "parts" / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_merge_at_one_is_the_adapted_function_and_partial_merges_add_up(tiny_random):
    """The shared implementation's arithmetic (C-CLIP merges at alpha = 0.5): after training-like updates to B,
    merge(1) gives the adapted model's features; merge(0.5) puts theta + 0.5 DeltaW in each weight."""
    import copy

    def adapted():
        model = copy.deepcopy(tiny_random[0]).eval()
        torch.manual_seed(0)
        names = common.add_lora(model, rank=2, alpha=4.0)
        with torch.no_grad():
            for lora in common.adapters(model).values():
                lora.B.normal_(0, 0.05)
        return model, names
    x = torch.randn(2, 3, 32, 32)
    model, names = adapted()
    want = _features(model, x)
    common.merge_lora(model, 1.0)
    assert (_features(model, x) - want).abs().max() < 1e-5 and not common.adapters(model)
    model, names = adapted()
    deltas = {n: lora.delta().detach().clone() for n, lora in common.adapters(model).items()}
    originals = {n: model.get_submodule(n.rpartition(".")[0]).parametrizations[n.rpartition(".")[2]].original
                 .detach().clone() for n in names}
    common.merge_lora(model, 0.5)
    for n in names:
        assert torch.allclose(model.get_parameter(n), originals[n] + 0.5 * deltas[n], atol=1e-7)


def test_cclip_takes_the_shared_flag_as_its_own_lora(tmp_path):
    root = tmp_path / "d"
    cclip.main(cclip_argv(root, tmp_path / "c", "--method", "full", "--lora", "2", "--steps", "1"))
    said = json.loads((tmp_path / "c" / "config.json").read_text())
    said = said.get("config", said)
    assert said["method"] == "lora" and said["lora_rank"] == 2 and said["lora"] == 0


def test_dns_refuses_lora_with_one_message():
    with pytest.raises(UsageError, match="dns.py trains maps over frozen features"):
        dns.main(["--lora", "2", "--tasks", "synthetic", "--backbone", "tiny"])


def test_a_locked_tower_gets_no_adapters_and_does_not_move(tmp_path):
    """LoRA on one tower: --lock-image puts adapters in the text tower only; the image tower ends as it began."""
    _run(erclip, tmp_path, "r", "--lora", "2", "--lock-image")
    saved = torch.load(tmp_path / "r" / "model.pt", weights_only=True)
    base = models.load_model("tiny", world=lab.WORLD)[0].state_dict()
    moved = {k for k in saved if k in base and not torch.equal(saved[k], base[k])}
    assert moved and not [k for k in moved if k.startswith("visual.")]
    pattern = json.loads((tmp_path / "r" / "lora_adapter" / "adapter_config.json").read_text())["target_modules"]
    model = models.load_model("tiny", world=lab.WORLD)[0]
    assert {n for n, _ in model.named_modules() if re.fullmatch(pattern, n)} == \
        {f"transformer.resblocks.{i}.{m}" for i in range(4) for m in ("attn", "mlp.c_fc", "mlp.c_proj")}


def test_the_docs_show_the_lines_the_adapters_readme_holds():
    """docs/training.md's loading lines are the ones every adapter's README.md holds (plumbing.lora.LOAD, run by
    the write-time check and by test_the_peft_adapter_is_the_trained_model)."""
    from pathlib import Path
    from plumbing import lora as lora_files
    assert lora_files.LOAD in (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
