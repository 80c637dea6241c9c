"""Hand-computed cases for the shared math in common.py."""
import json
import math

import numpy as np
import open_clip
import pytest
import torch
import torch.nn.functional as F

import common
from plumbing.base import RunError
from plumbing.flags import Config, parse_config
import lab


def test_clip_loss_by_hand():
    img = torch.eye(2)
    txt = torch.eye(2)
    # logits = I; each row: -log(e / (e + 1)) = log(1 + e^-1); both directions alike
    expected = math.log(1 + math.exp(-1))
    assert common.clip_loss(img, txt, torch.tensor(1.0)).item() == pytest.approx(expected, rel=1e-6)
    # label smoothing eps over 2 classes: (1 - eps) * nll + eps * mean_c(-log p_c)
    eps = 0.2
    p = torch.tensor([math.e, 1.0]) / (math.e + 1)
    smoothed = (1 - eps) * -math.log(p[0]) + eps * -(torch.log(p).mean().item())
    assert common.clip_loss(img, txt, torch.tensor(1.0), eps).item() == pytest.approx(smoothed, rel=1e-6)


def test_clip_loss_matches_open_clip():
    g = torch.Generator().manual_seed(0)
    img = F.normalize(torch.randn(8, 16, generator=g), dim=-1)
    txt = F.normalize(torch.randn(8, 16, generator=g), dim=-1)
    ours = common.clip_loss(img, txt, torch.tensor(20.0))
    ref = open_clip.ClipLoss()(img, txt, torch.tensor(20.0))
    assert ours.item() == pytest.approx(ref.item(), rel=1e-6)


def test_encode_text_trimmed_equals_open_clip(tiny_random):
    model, _, _, tok = tiny_random
    texts = ["a red circle.", "a photo of a blue square at the top left of the picture.", "x",
             "There is a large red circle at the top left. " * 5]  # the last one overflows the context
    tokens = tok(texts)
    model.eval()
    with torch.no_grad():
        ref = model.encode_text(tokens, normalize=True)
        ours = common.encode_text(model, tokens)
    assert torch.allclose(ours, ref, atol=1e-5)
    # and on a batch of only short texts, where most columns are trimmed
    with torch.no_grad():
        assert torch.allclose(common.encode_text(model, tokens[:1]), ref[:1], atol=1e-5)


def test_encode_texts_keeps_order(tiny_random):
    model, _, _, tok = tiny_random
    texts = ["a", "a much longer caption about a green triangle", "b c", "d e f g"]
    model.eval()
    with torch.no_grad():
        ref = model.encode_text(tok(texts), normalize=True)
    assert torch.allclose(common.encode_texts(model, tok, texts, batch_size=3), ref, atol=1e-5)


def test_retrieval_metrics_by_hand():
    img = torch.eye(3)
    # texts 0,1 -> image 0; text 2 -> image 1; text 3 -> image 2
    txt = torch.tensor([[1.0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 0]])
    t2i = torch.tensor([0, 0, 1, 2])
    r = common.retrieval_metrics(img, txt, t2i, ks=(1, 2))
    # t2i: text0 -> img0 rank 1 (hit); text1 -> scores (0,0,1): gold img0 is beaten by img2 and tied with
    # img1 -> 2 better -> miss at 1 and 2; text2 -> img1 hit; text3 = [0,1,0] -> gold img2 scores 0,
    # img1 scores 1 -> miss at 1, and img0 ties at 0 -> 2 better -> miss at 2.
    assert r["t2i_R@1"] == pytest.approx(50.0)
    assert r["t2i_R@2"] == pytest.approx(50.0)
    # i2t: img0 best gold = text0 (1.0) -> hit; img1 gold text2 (1.0) tied with text3 (1.0) -> tie counts
    # against -> miss at 1, hit at 2; img2 gold text3 scores 0 < text1 (1.0); ties with text0 and text2 ->
    # 3 better -> miss.
    assert r["i2t_R@1"] == pytest.approx(100 / 3)
    assert r["i2t_R@2"] == pytest.approx(200 / 3)


def test_retrieval_ties_never_inflate():
    img = torch.ones(4, 2) / math.sqrt(2)
    txt = torch.ones(4, 2) / math.sqrt(2)
    r = common.retrieval_metrics(img, txt, torch.arange(4), ks=(1, 4))
    assert r["i2t_R@1"] == 0 and r["t2i_R@1"] == 0
    assert r["i2t_R@4"] == 100 and r["t2i_R@4"] == 100


def test_retrieval_chunked_equals_dense():
    g = torch.Generator().manual_seed(1)
    img = F.normalize(torch.randn(50, 8, generator=g), dim=-1)
    t2i = torch.arange(50).repeat_interleave(3)[torch.randperm(150, generator=g)]
    txt = F.normalize(img[t2i] + 0.8 * torch.randn(150, 8, generator=g), dim=-1)
    a = common.retrieval_metrics(img, txt, t2i, max_chunk_scores=7 * 150)
    b = common.retrieval_metrics(img, txt, t2i, max_chunk_scores=10 ** 9)
    assert a == b
    # against a per-query loop written from the definition
    sim = img @ txt.t()
    hits = 0
    for i in range(50):
        order = torch.argsort(sim[i], descending=True)
        hits += int(t2i[order[0]] == i)
    assert a["i2t_R@1"] == pytest.approx(100 * hits / 50)


def test_retrieval_requires_every_image_captioned():
    with pytest.raises(ValueError, match="no caption"):
        common.retrieval_metrics(torch.eye(3), torch.eye(3)[:2], torch.tensor([0, 1]))


def test_zero_shot_accuracy_by_hand():
    img = torch.tensor([[1.0, 0], [0, 1], [0.6, 0.8]])
    clf = torch.eye(2)  # (D, C)
    acc = common.zero_shot_accuracy(img, clf, torch.tensor([0, 1, 0]), ks=(1, 2))
    assert acc["top1"] == pytest.approx(200 / 3)
    assert acc["top2"] == pytest.approx(100.0)


def test_zero_shot_classifier_equals_open_clip(tiny_random):
    model, _, _, tok = tiny_random
    model.eval()
    names, templates = ["circle", "red square", "cat"], ["a photo of a {}.", "a {}."]
    ours = common.zero_shot_classifier(model, tok, names, templates)
    ref = open_clip.build_zero_shot_classifier(model, tok, names, templates, device="cpu")
    assert ours.shape == (model.text_projection.shape[1], 3)
    assert torch.allclose(ours, ref, atol=1e-5)


def test_continual_metrics_by_hand():
    R = np.array([[10, 20, 30],
                  [50, 22, 31],
                  [40, 60, 33],
                  [45, 55, 70.0]])
    m = common.continual_metrics(R)
    assert m["last"] == pytest.approx((45 + 55 + 70) / 3)
    assert m["avg"] == pytest.approx((50 + (40 + 60) / 2 + (45 + 55 + 70) / 3) / 3)
    assert m["bwt"] == pytest.approx(((45 - 50) + (55 - 60)) / 2)
    assert m["forgetting"] == pytest.approx(((50 - 45) + (60 - 55)) / 2)
    with pytest.raises(ValueError):
        common.continual_metrics(R[1:])


def test_warmup_cosine_schedule():
    f = common.warmup_cosine(10, 110)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(60) == pytest.approx(0.5) and f(110) == pytest.approx(0.0)


def test_param_groups_no_decay(tiny_random):
    model = tiny_random[0]
    groups = common.param_groups(lab.ClipFineTune(model), lr=1e-3, wd=0.1)
    by_decay = {g["weight_decay"]: set(g["names"]) for g in groups}
    no = by_decay[0.0]
    assert "model.logit_scale" in no and "model.token_embedding.weight" in no
    assert "model.positional_embedding" in no and "model.ln_final.weight" in no
    assert all(n.endswith("bias") is False for n in by_decay[0.1])
    assert "model.transformer.resblocks.0.mlp.c_fc.weight" in by_decay[0.1]
    assert "model.visual.proj" in by_decay[0.1]


def test_decay_all_puts_every_parameter_in_one_decayed_group(tiny_random):
    """--decay-all (issue 25.4): the m2-Mix code's and the C-CLIP research code's AdamW over all parameters."""
    net = lab.ClipFineTune(tiny_random[0])
    groups = common.param_groups(net, lr=1e-3, wd=0.1, decay_all=True)
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.1
    assert set(groups[0]["names"]) == {n for n, p in net.named_parameters() if p.requires_grad}
    opt = common.make_optimizer(Config(lr=1e-3, wd=0.1, decay_all=True), net, "cpu")
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1]
    assert 0.0 in [g["weight_decay"] for g in common.make_optimizer(Config(lr=1e-3), net, "cpu").param_groups]


def test_results_files_record_the_switches_that_were_on(tmp_path):
    """Issue 25: every method's results.json holds its settings and, as 'switches', the ones off their defaults,
    so a number can be traced to its protocol (--decay-all, --recall-protocol cmcl, ...)."""
    common.write_results(tmp_path, {"x": 1}, Config(lr=1e-3, decay_all=True))
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["switches"] == {"lr": 1e-3, "decay_all": True} and saved["config"]["wd"] == 0.1 and saved["x"] == 1


def test_a_non_finite_embedding_is_an_error_never_a_hit():
    """Issue 26.1: a NaN row compares False with everything, so counting 'candidates at least as good' gave it rank
    -1: a hit at every k (a model with NaN in visual.proj scored R@1 100 / zero-shot 100). Now one error naming the
    task and how many rows."""
    img, txt = F.normalize(torch.randn(3, 4), dim=-1), F.normalize(torch.randn(3, 4), dim=-1)
    assert common.retrieval_metrics(img, txt, torch.arange(3))["i2t_R@1"] <= 100
    img[1, 0] = float("nan")
    with pytest.raises(RunError, match=r"coco: 1 of 3 image rows are not finite"):
        common.retrieval_metrics(img, txt, torch.arange(3), name="coco")
    txt[2] = float("inf")
    with pytest.raises(RunError, match=r"1 of 3 image rows, 1 of 3 text rows"):
        common.retrieval_metrics(img, txt, torch.arange(3))
    with pytest.raises(RunError, match=r"cifar10: 1 of 3 image rows"):
        common.zero_shot_accuracy(img, torch.eye(4), torch.tensor([0, 1, 2]), name="cifar10")
    clf = torch.eye(4)
    clf[:, 3] = float("nan")
    with pytest.raises(RunError, match=r"1 of 4 classifier rows"):
        common.zero_shot_accuracy(F.normalize(torch.randn(3, 4), dim=-1), clf, torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("flag,value,rule", [
    ("--wd", "-1", ">= 0"), ("--grad-clip", "nan", ">= 0"), ("--beta1", "1.5", "in [0, 1)"),
    ("--label-smoothing", "2", "in [0, 1)"), ("--lambda-p", "-5", ">= 0"), ("--fusion-lr", "-1", ">= 0"),
    ("--alpha", "inf", ">= 0")])
def test_out_of_range_settings_stop_at_parse_time(flag, value, rule, capsys):
    """Issue 26.14: these were accepted and ran (weight decay -1, gradient ascent on the fusion, lambda_p -5 as M)."""
    import erclip
    with pytest.raises(SystemExit) as e:
        parse_config(erclip.ERCLIPConfig, [flag, value])
    assert e.value.code == 2 and f"must be {rule}, got {value}" in capsys.readouterr().err
    assert parse_config(erclip.ERCLIPConfig, [flag, "0"])  # the edge is allowed


def test_a_flag_prefix_is_not_a_flag(capsys):
    """Issue 26 (minor): argparse's prefix matching made `--step 3` mean `--steps 3` silently."""
    with pytest.raises(SystemExit):
        parse_config(Config, ["--step", "3"])
    assert "unrecognized arguments: --step" in capsys.readouterr().err
