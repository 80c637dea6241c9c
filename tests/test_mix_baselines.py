"""Tests of baselines/ (issue 60): i-Mix and Un-Mix as m2-Mix's Table 1 / 3 rows. Each loss against a per-sample
loop and a hand case, each against its authors' computation re-implemented here from their code on identical
inputs (kibok90/imix builder.py's N-pair branch and `mixup`; szq0214/Un-Mix main_moco_unmix.py's train() and
rand_bbox, moco/builder.py's forward), reductions, gradients, bf16, and a tiny run end to end with its resume and
m2mix.py --collect."""
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import common
from plumbing.base import UsageError
from plumbing.flags import parse_config
import lab
import m2mix
from baselines import imix, mixrun, unmix
from plumbing import models, published

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


def unit(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1).float()


def _ctx(step=0):
    return SimpleNamespace(step=step, epoch=0, generator=common.step_generator(0, step))


# ----------------------------------------------------------------------------- i-Mix
def test_imix_loss_hand_case():
    """B = 2, orthogonal keys, s = 1: p_i(j) = exp(v_i . t_j) / sum_k exp(v_i . t_k). v_0 = t_0: p_0 = (e, 1)/(e+1);
    partner swaps the rows; l_0 = -lam_0 log(e/(e+1)) - (1-lam_0) log(1/(e+1))."""
    txt = torch.eye(2)
    img_mix = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    lam, partner = torch.tensor([0.7, 0.6]), torch.tensor([1, 0])
    e = math.e
    l0 = -0.7 * math.log(e / (e + 1)) - 0.3 * math.log(1 / (e + 1))
    l1 = -0.6 * math.log(e / (e + 1)) - 0.4 * math.log(1 / (e + 1))
    assert float(imix.imix_loss(img_mix, txt, 1.0, lam, partner)) == pytest.approx((l0 + l1) / 2, abs=1e-6)


def test_imix_loss_matches_per_sample_loop():
    B, s = 7, 12.0
    img, txt = unit(B, 5, seed=1), unit(B, 5, seed=2)
    lam = torch.rand(B, generator=torch.Generator().manual_seed(3)) * 0.5 + 0.5
    partner = torch.randperm(B, generator=torch.Generator().manual_seed(4))
    total = 0.0
    for i in range(B):  # from the formula: -lam_i log p_i(i) - (1 - lam_i) log p_i(k(i))
        logp = [s * float(img[i] @ txt[j]) for j in range(B)]
        lse = math.log(sum(math.exp(x) for x in logp))
        total += -lam[i] * (logp[i] - lse) - (1 - lam[i]) * (logp[int(partner[i])] - lse)
    assert float(imix.imix_loss(img, txt, s, lam, partner)) == pytest.approx(float(total) / B, abs=1e-5)


def test_imix_at_lam_1_is_one_direction_infonce():
    img, txt = unit(6, 4, seed=5), unit(6, 4, seed=6)
    ref = F.cross_entropy(10.0 * img @ txt.t(), torch.arange(6))
    got = imix.imix_loss(img, txt, 10.0, torch.ones(6), torch.randperm(6))
    assert torch.allclose(got, ref, atol=1e-6)


def test_imix_draw_is_the_codes_folded_beta_and_a_permutation_seeded_by_step():
    lam, partner = imix.draw(common.step_generator(0, 3), 500, 1.0)
    again = imix.draw(common.step_generator(0, 3), 500, 1.0)
    assert torch.equal(lam, again[0]) and torch.equal(partner, again[1])
    assert float(lam.min()) >= 0.5 and float(lam.max()) <= 1.0  # max(lam, 1 - lam)
    assert abs(float(lam.mean()) - 0.75) < 0.03  # Beta(1, 1) folded: uniform on [0.5, 1]
    assert sorted(partner.tolist()) == list(range(500))


def _authors_imix(encoder, images, keys, lam, randind, temp):
    """kibok90/imix, re-implemented from builder.py (commit not recorded when written; issue 74 re-read it at
    691bf2d, the lines below are there): `mixup` (lam_expanded = lam.view(-1, 1, 1, 1); output =
    lam_expanded * input + (1 - lam_expanded) * input[randind]); the N-pair branch: q = normalize(encoder_q(im_q)),
    logits = q.mm(k.t()) / temp, labels = arange; loss = (lam * criterion(logits, labels) + (1 - lam) *
    criterion(logits, labels_aux)).mean() with criterion = CrossEntropyLoss(reduction='none')."""
    lam_expanded = lam.view([-1] + [1] * (images.dim() - 1))
    im_q = lam_expanded * images + (1.0 - lam_expanded) * images[randind]
    q = F.normalize(encoder(im_q), dim=1)
    logits = q.mm(keys.t()) / temp
    labels = torch.arange(len(images))
    criterion = torch.nn.CrossEntropyLoss(reduction="none")
    return (lam * criterion(logits, labels) + (1.0 - lam) * criterion(logits, randind)).mean()


def test_imix_matches_the_authors_code_on_identical_inputs(capsys):
    """Same images, keys, lam and permutation: our mix_inputs + imix_loss against kibok90/imix's computation, on a
    linear encoder; max abs difference printed (issue 60's report)."""
    g = torch.Generator().manual_seed(7)
    images, W = torch.randn(8, 3, 4, 4, generator=g), torch.randn(48, 6, generator=g)
    encoder = lambda x: x.flatten(1) @ W  # noqa: E731
    keys = unit(8, 6, seed=8)
    lam, randind = imix.draw(common.step_generator(1, 0), 8, 1.0)
    ours = imix.imix_loss(F.normalize(encoder(mixrun.mix_inputs(images, lam, randind)), dim=1), keys, 1 / 0.2,
                          lam, randind)
    theirs = _authors_imix(encoder, images, keys, lam, randind, 0.2)
    diff = abs(float(ours) - float(theirs))
    with capsys.disabled():
        print(f"\n[cross-check] i-Mix vs kibok90/imix (N-pair, linear encoder): max abs diff {diff:.2e}")
    assert diff < 1e-5


from test_m2mix import _batch  # noqa: E402  (m2-Mix's wrapper batch; the model: conftest's tiny_random)


def test_imix_wrapper_matches_the_authors_code_on_the_tiny_clip(tiny_random, capsys):
    """The whole step (the draw from the step's generator, the mix, the towers, the loss) against the authors'
    computation on the same model, batch and draw: the wrapper wires what the loss tests check."""
    model, _, _, tok = tiny_random
    batch, cfg = _batch(tok), imix.IMixConfig(backbone="tiny")
    net = imix.IMix(model, cfg).eval()
    with torch.no_grad():
        ours = net(batch, _ctx(5))["loss_imix"]
        lam, randind = imix.draw(_ctx(5).generator, 6, cfg.alpha)
        keys = common.encode_text(model, batch["text"])
        theirs = _authors_imix(lambda x: model.encode_image(x), batch["image"], keys, lam, randind,
                               1 / float(model.logit_scale.exp()))
    diff = abs(float(ours) - float(theirs))
    with capsys.disabled():
        print(f"\n[cross-check] i-Mix step vs kibok90/imix on the tiny CLIP: max abs diff {diff:.2e}")
    assert diff < 1e-5


# ----------------------------------------------------------------------------- Un-Mix
def test_unmix_loss_matches_per_sample_loop():
    B, s, lam = 6, 9.0, 0.3
    img_mix, txt = unit(B, 5, seed=11), unit(B, 5, seed=12)
    total = 0.0
    for i in range(B):  # row i: lam of pair i; the flipped read: x~_{B-1-i} against text i, weight 1 - lam
        for row, w in ((i, lam), (B - 1 - i, 1 - lam)):
            logits = [s * float(img_mix[row] @ txt[j]) for j in range(B)]
            total += -w * (logits[i] - math.log(sum(math.exp(x) for x in logits)))
    assert float(unmix.unmix_loss(img_mix, txt, s, lam)) == pytest.approx(total / B, abs=1e-5)


def test_unmix_hand_case_and_lam_1():
    """B = 2, keys e_0, e_1, s = 1, x~_0 = e_0, x~_1 = e_1: each row's own key has p = e/(e+1), the flipped read
    p = 1/(e+1): L = -lam log(e/(e+1)) - (1-lam) log(1/(e+1)); lam = 1 is one-direction InfoNCE."""
    e, eye = math.e, torch.eye(2)
    want = -0.25 * math.log(e / (e + 1)) - 0.75 * math.log(1 / (e + 1))
    assert float(unmix.unmix_loss(eye, eye, 1.0, 0.25)) == pytest.approx(want, abs=1e-6)
    img, txt = unit(5, 4, seed=13), unit(5, 4, seed=14)
    assert torch.allclose(unmix.unmix_loss(img, txt, 7.0, 1.0), F.cross_entropy(7.0 * img @ txt.t(),
                                                                                 torch.arange(5)), atol=1e-6)


def _authors_rand_bbox(size, lam, cx, cy):
    """szq0214/Un-Mix, UnMix_MoCo/for_ImageNet/main_moco_unmix.py, rand_bbox (commit not recorded when written;
    issue 74 re-read it at 6bdefb4, unchanged there), with its two np.random.randint draws given as cx, cy."""
    W, H = size[2], size[3]
    cut_rat = np.sqrt(1.0 - lam)
    cut_w, cut_h = int(W * cut_rat), int(H * cut_rat)
    return (np.clip(cx - cut_w // 2, 0, W), np.clip(cy - cut_h // 2, 0, H),
            np.clip(cx + cut_w // 2, 0, W), np.clip(cy + cut_h // 2, 0, H))


def _authors_unmix(encoder, images, keys, lam, temp, glob, cx=0, cy=0):
    """szq0214/Un-Mix, re-implemented from UnMix_MoCo/for_ImageNet/main_moco_unmix.py's train() and
    UnMix_MoCo/for_ImageNet/moco/builder.py's forward (commit not recorded when written; issue 74 re-read both
    at 6bdefb4, the lines below are there), the queue's
    logits replaced by the batch's keys (our deviation 2): the mixture with images_reverse = flip(images); for a
    region one the box pasted and lam = 1 - box / (W H); q_mixed = normalize(encoder(mixed)), q_mixed_flip =
    flip(q_mixed); loss_m = CE(q_mixed k^T / T, labels), loss_m_flip = CE(q_mixed_flip k^T / T, labels); the mixed
    part of loss = loss_o + lam * loss_m + (1 - lam) * loss_m_flip."""
    images_reverse = torch.flip(images, (0,))
    if glob:
        mixed = lam * images + (1 - lam) * images_reverse
    else:
        mixed = images.clone()
        bbx1, bby1, bbx2, bby2 = _authors_rand_bbox(images.size(), lam, cx, cy)
        mixed[:, :, bbx1:bbx2, bby1:bby2] = images_reverse[:, :, bbx1:bbx2, bby1:bby2]
        lam = 1 - ((bbx2 - bbx1) * (bby2 - bby1) / (images.size()[-1] * images.size()[-2]))
    q_mixed = F.normalize(encoder(mixed), dim=1)
    q_mixed_flip = torch.flip(q_mixed, (0,))
    labels = torch.arange(len(images))
    loss_m = F.cross_entropy(q_mixed @ keys.t() / temp, labels)
    loss_m_flip = F.cross_entropy(q_mixed_flip @ keys.t() / temp, labels)
    return lam * loss_m + (1 - lam) * loss_m_flip, lam


@pytest.mark.parametrize("glob", [True, False])
def test_unmix_matches_the_authors_code_on_identical_inputs(glob, capsys):
    g = torch.Generator().manual_seed(21)
    images, W = torch.randn(8, 3, 9, 7, generator=g), torch.randn(189, 6, generator=g)
    encoder = lambda x: x.flatten(1) @ W  # noqa: E731
    keys, lam, cx, cy = unit(8, 6, seed=22), 0.62, 3, 5
    if glob:
        mixed = mixrun.mix_inputs(images, lam, torch.arange(7, -1, -1))
        our_lam = lam
    else:
        mixed, our_lam = unmix.region_mix(images, unmix.cut_box(images.shape, lam, cx, cy))
    ours = unmix.unmix_loss(F.normalize(encoder(mixed), dim=1), keys, 1 / 0.2, our_lam)
    theirs, their_lam = _authors_unmix(encoder, images, keys, lam, 0.2, glob, cx, cy)
    diff = abs(float(ours) - float(theirs))
    with capsys.disabled():
        print(f"\n[cross-check] Un-Mix vs szq0214/Un-Mix ({'global' if glob else 'region'} mixture, linear "
              f"encoder): max abs diff {diff:.2e}, lam {our_lam:.4f} vs {their_lam:.4f}")
    assert our_lam == pytest.approx(their_lam, abs=1e-12) and diff < 1e-5
    if not glob:  # a box really pasted: 4 x 2 of 9 x 7 at lam 0.62 (cut 0.616: 5 x 4, half-widths 2 x 2)
        assert our_lam == pytest.approx(1 - 16 / 63)


def test_unmix_draw_mixes_global_and_region_at_the_set_rate():
    draws = [unmix.draw(common.step_generator(0, s), (8, 3, 16, 16), 1.0, 0.5) for s in range(400)]
    share = sum(box is None for _, box in draws) / len(draws)
    assert 0.42 < share < 0.58
    assert all(0 <= x1 <= x2 <= 16 and 0 <= y1 <= y2 <= 16 for _, b in draws if b for x1, y1, x2, y2 in [b])
    assert unmix.draw(common.step_generator(0, 9), (8, 3, 16, 16), 1.0, 0.5) == draws[9]


def test_unmix_wrapper_is_clip_plus_the_mixed_terms_and_clip_at_weight_0(tiny_random):
    model, _, _, tok = tiny_random
    batch = _batch(tok)
    net = unmix.UnMix(model, unmix.UnMixConfig(backbone="tiny", mix_weight=0.0)).eval()
    with torch.no_grad():
        f = net.features(batch, _ctx(2))
        losses = net.losses(f, _ctx(2))
        img, txt = model.encode_image(batch["image"], normalize=True), common.encode_text(model, batch["text"])
        clip = common.clip_loss(img, txt, model.logit_scale.exp())
    assert torch.allclose(losses["loss_clip"], clip, atol=1e-5) and float(losses["loss_unmix"]) == 0.0
    assert not torch.allclose(f["img_mix"], f["img"])  # the mixed half is another batch


# ----------------------------------------------------------------------------- both: gradients, bf16, flags
@pytest.mark.parametrize("mod, cls, cfg_cls", [(imix, imix.IMix, imix.IMixConfig),
                                               (unmix, unmix.UnMix, unmix.UnMixConfig)])
def test_gradients_reach_both_towers_and_a_fixed_tau_freezes_the_scale(mod, cls, cfg_cls):
    torch.manual_seed(0)
    model, _, _, tok = models.load_model("tiny", "random")
    net = cls(model, cfg_cls(backbone="tiny")).train()
    loss = sum(net(_batch(tok), _ctx(1)).values())
    loss.backward()
    for tower in (model.visual, model.transformer):
        grads = [p.grad for p in tower.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    assert model.logit_scale.grad is not None
    cls(model, cfg_cls(backbone="tiny", tau=0.2))
    assert not model.logit_scale.requires_grad


@pytest.mark.parametrize("cls, cfg_cls", [(imix.IMix, imix.IMixConfig), (unmix.UnMix, unmix.UnMixConfig)])
def test_bf16_autocast_step_on_cpu_is_finite(tiny_random, cls, cfg_cls):
    model, _, _, tok = tiny_random
    net = cls(model, cfg_cls(backbone="tiny"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = net(_batch(tok), _ctx(0))
    assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in losses.values())


# ----------------------------------------------------------------------------- end to end, resume, --collect
def _args(tmp_path, out, manifest, *more):
    return ["--backbone", "tiny", "--train-data", str(manifest), "--data-root", str(tmp_path / "data"),
            "--out", str(out), "--steps", "4", "--batch-size", "8", "--lr", "1e-4", "--precision", "fp32",
            "--device", "cpu", "--workers", "0", "--log-every", "1", "--save-every", "0", *more]


@pytest.mark.parametrize("mod, row, term", [(imix, "i-Mix", "loss_imix"), (unmix, "Un-Mix", "loss_unmix")])
def test_tiny_run_end_to_end_resumes_exactly_and_collects(tmp_path, mod, row, term, results_files_are_strict_json,
                                                          model_files_as_readme_says):
    """main() on the synthetic world (the lab's world handed over), 4 steps; the same run stopped after 2 and
    resumed ends at the same weights; results.json is the schema --collect reads, its row beside ZS."""
    manifest = lab.synthetic_manifest("train", tmp_path / "data", n=32)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    res = mod.main(_args(tmp_path, straight, manifest), world=lab.WORLD)
    assert res["summary"]["steps"] == 4
    assert {(r["model"], r["stage"]) for r in res["records"]} == {("ZS", "base"), (row, "tuned")}
    assert term in json.loads((straight / "metrics.jsonl").read_text().splitlines()[-1])
    saved = results_files_are_strict_json(straight, mod.__name__.split(".")[-1])
    assert {r["metric"] for r in saved["records"]} >= {"i2t_R@1", "t2i_R@5", "align", "ece_i2t"}
    model_files_as_readme_says("m2mix", straight)  # the same files as m2mix.py's runs

    stopped = mod.main(_args(tmp_path, resumed, manifest, "--stop-at", "2"), world=lab.WORLD)
    assert "stopped_at" in stopped["summary"]
    mod.main(_args(tmp_path, resumed, manifest, "--resume", "latest"), world=lab.WORLD)
    a, b = (torch.load(d / "model.pt", map_location="cpu", weights_only=True) for d in (straight, resumed))
    assert max(float((a[k].float() - b[k].float()).abs().max()) for k in a) < 1e-6
    steps = [json.loads(x)["step"] for x in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]

    table = m2mix.main(["--collect", f"{straight},{tmp_path / 'resumed'}"])
    assert f"| {row} |" in table and "| ZS |" in table


def test_accumulation_is_refused_before_anything_loads(tmp_path):
    with pytest.raises(UsageError, match="pairs the rows of one batch"):
        imix.main(_args(tmp_path, tmp_path / "o", tmp_path / "none.jsonl", "--accum-freq", "2"), world=lab.WORLD)


def test_the_tiny_backbone_without_the_labs_world_is_one_message(tmp_path):
    """mixrun.run without the lab's world (a caller's; main() takes it from the lab since issue 69.7)."""
    cfg = parse_config(unmix.UnMixConfig, _args(tmp_path, tmp_path / "o", tmp_path / "none.jsonl"))
    with pytest.raises(UsageError, match="is the lab's"):
        mixrun.run(cfg, unmix.UnMix, "unmix")


def test_table1_puts_the_papers_baseline_rows_beside_ours():
    recs = [{"task": "flickr30k-1cap", "model": name, "metric": "i2t_R@1", "value": 50.0}
            for name in ("ZS", "FT", "i-Mix", "Un-Mix", "FT(tau=0.05)")]
    one = published.m2mix_table1(recs)
    for name, paper in (("i-Mix", 78.2), ("Un-Mix", 77.6), ("FT(tau=0.05)", 81.2), ("FT(tau=0.1)", 71.2)):
        line = next(x for x in one.splitlines() if x.startswith(f"| {name} |"))
        assert f"({paper})" in line
    assert published.M2MIX_TABLE1["coco-1cap"]["i-Mix"]["t2i_R@5"] == 44.32  # Table 1, as printed


def test_baselines_import_no_method_file():
    """Issue 60: a baseline imports plumbing, common, eval, papers, commands, never a method file (the layer
    rule alone would allow it: baselines/ stands above the method files). One exception, by design: the rows on
    DNS's maps (baselines/maps.py) import dns.py, whose maps and vanilla mode ARE the setting they run in."""
    from tests.test_layout import METHODS, imports
    allowed = {"maps.py": {"dns"}}
    for path in (ROOT / "baselines").glob("*.py"):
        wrong = [t for t, _ in imports(path) if t.split(".")[0] in METHODS and t not in allowed.get(path.name, ())]
        assert not wrong, path


def test_table_3s_towers_run_a_baseline_and_collect_into_table_3(tmp_path):
    """m2-Mix's Table 3 has the baselines on BERT + ResNet-50: the lab's stand-in towers (lab-towers) run Un-Mix
    through the same entry, and --collect lays the run out as Table 3 (SIMAT column), its row beside ZS."""
    manifest = lab.synthetic_manifest("train", tmp_path / "data", n=16)
    out = tmp_path / "towers"
    args = _args(tmp_path, out, manifest)
    args[args.index("tiny")], args[args.index("4")] = "lab-towers", "2"
    unmix.main(args, world=lab.WORLD)
    table = m2mix.main(["--collect", str(out)])
    assert "| simat |" in table.splitlines()[1] and "| Un-Mix |" in table
