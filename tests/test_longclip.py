"""Long-CLIP (longclip.py): the stretching and the PCA against per-position /
per-sample references, the losses against plain CLIP and the released code's
per-rank form, the wrapper (frozen kept rows, fixed temperature, bf16),
resume, the open_clip round trip with the longer window, the data, the tables
and an end-to-end run through main()."""
import copy
import json

import open_clip
import pytest
import torch
import torch.nn.functional as F

from plumbing import models
from papers import longclip_data
import common
from plumbing.base import DataError, UsageError
from plumbing.flags import parse_config
from plumbing.loading import source_stamp
import lab
import eval as evaluation
import longclip
from lab.demos import longclip as longclip_demo
from plumbing import published

# The tiny backbone's window is 24 tokens; Long-CLIP keeps 20 of CLIP's 77, so we
# keep round(20 * 24 / 77) = 6 and stretch the rest by 4: 4 * 24 - 3 * 6 = 78 positions.
TINY_KEEP, TINY_WINDOW = 6, 78


def unit(*shape, seed=0):
    return F.normalize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), dim=-1)


def cfg_of(**kw):
    return longclip.LongCLIPConfig(**{"backbone": "tiny", "workers": 0, "precision": "fp32", "device": "cpu",
                                      "train_data": "synthetic", **kw})


def tiny_batch(tokenizer, transform, n=4):
    scenes = lab.world_split(lab.FINETUNE, n, seed=7)
    items = [{"image": transform(lab.render(s)), "caption": s["caption"], "long_caption": s["long_caption"],
              "index": i} for i, s in enumerate(scenes)]
    return longclip.LongCaptionCollate(tokenizer, "caption")(items)


# ----------------------------------------------------------------------------- stretching, Eq. (1)
def stretch_loop(pos, keep, factor):
    """The released code's table, written position by position."""
    L = len(pos)
    out = torch.zeros(factor * L - (factor - 1) * keep, pos.shape[1], dtype=torch.float64)
    pos = pos.double()
    for p in range(keep):
        out[p] = pos[p]
    for i in range(L - 1 - keep):
        for j in range(factor):
            out[keep + factor * i + j] = ((factor - j) * pos[keep + i] + j * pos[keep + i + 1]) / factor
    for j in range(factor):  # the tail, past the old table's end
        out[len(out) - factor + j] = pos[L - 1] + j * (pos[L - 1] - pos[L - 2]) / factor
    return out


def test_stretching_by_hand():
    pos = torch.tensor([[0.0], [1.0], [2.0], [4.0]])  # L = 4
    # keep 1, factor 2: 2 * 4 - 1 = 7 rows; old index x = 1 + (p - 1) / 2 for p >= 1:
    # x = 1, 1.5, 2, 2.5, 3 -> 1, 1.5, 2, 3, 4; x = 3.5 extrapolates: 4 + 0.5 * (4 - 2) = 5
    out = longclip.stretch_positional_embedding(pos, keep=1, factor=2)
    assert out.squeeze(1).tolist() == [0.0, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("L, keep, factor", [(77, 20, 4), (24, TINY_KEEP, 4), (10, 0, 3), (9, 8, 2)])
def test_stretching_matches_the_per_position_loop(L, keep, factor):
    pos = torch.randn(L, 16, generator=torch.Generator().manual_seed(L))
    out = longclip.stretch_positional_embedding(pos, keep, factor)
    assert out.shape == (factor * L - (factor - 1) * keep, 16) and out.dtype == pos.dtype
    assert torch.equal(out[:keep], pos[:keep])  # kept exactly
    assert torch.equal(out[keep::factor][:L - keep], pos[keep:])  # every old row lands on a new one, unchanged
    assert torch.allclose(out.double(), stretch_loop(pos, keep, factor), atol=1e-6)


def test_stretching_shapes_and_limits():
    assert longclip.stretch_positional_embedding(torch.zeros(77, 4)).shape == (248, 4)
    assert longclip.stretch_positional_embedding(torch.zeros(24, 4), TINY_KEEP, 4).shape == (TINY_WINDOW, 4)
    assert longclip.default_keep(77) == 20 and longclip.default_keep(24) == TINY_KEEP
    pos = torch.randn(12, 3)
    assert torch.equal(longclip.stretch_positional_embedding(pos, 5, 1), pos)  # factor 1 is the identity
    for keep, factor in ((12, 4), (-1, 4), (3, 0)):
        with pytest.raises(ValueError, match="stretching needs"):
            longclip.stretch_positional_embedding(pos, keep, factor)


# ----------------------------------------------------------------------------- PCA, Eq. (2)
def pca_loop(x, k):
    """Per sample: mu + sum_{j<k} ((x_b - mu) . v_j) v_j, v_j the covariance's top eigenvectors."""
    x = x.double()
    mu = x.mean(0)
    evals, evecs = torch.linalg.eigh((x - mu).t() @ (x - mu))  # ascending
    V = evecs[:, torch.argsort(evals, descending=True)[:k]]
    out = torch.empty_like(x)
    for b in range(len(x)):
        out[b] = mu + sum(((x[b] - mu) @ V[:, j]) * V[:, j] for j in range(k))
    return out


@pytest.mark.parametrize("B, d, k", [(16, 8, 3), (6, 12, 2), (32, 16, 15)])
def test_pca_matches_the_per_sample_computation(B, d, k):
    x = unit(B, d, seed=B)
    assert torch.allclose(longclip.pca_reconstruct(x, k).double(), pca_loop(x, k), atol=1e-5)


def test_pca_keeps_everything_when_k_covers_the_batch():
    x = unit(8, 6, seed=1)
    assert torch.equal(longclip.pca_reconstruct(x, 6), x)  # k = d
    assert torch.equal(longclip.pca_reconstruct(unit(4, 6), 5), unit(4, 6))  # k >= B
    assert torch.allclose(pca_loop(x, 6).float(), x, atol=1e-6)  # which is what the full projection gives
    shift = torch.randn(6)
    assert torch.allclose(longclip.pca_reconstruct(x + shift, 2), longclip.pca_reconstruct(x, 2) + shift, atol=1e-5)


def test_pca_gradient_is_finite():
    x = unit(16, 8, seed=2).requires_grad_()
    w = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    (longclip.pca_reconstruct(x, 3) * w).sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- losses, Eqs. (3)-(4)
def test_losses_reduce_to_plain_clip():
    img, txt_long, txt_short = (unit(6, 8, seed=s) for s in range(3))
    s = torch.tensor(100.0)
    out = longclip.longclip_losses(img, longclip.pca_reconstruct(img, 8), txt_long, txt_short, s, 0.1)
    assert set(out) == {"loss_long", "loss_short"}
    assert out["loss_long"].item() == pytest.approx(common.clip_loss(img, txt_long, s, 0.1).item(), rel=1e-6)
    assert out["loss_short"].item() == pytest.approx(common.clip_loss(img, txt_short, s, 0.1).item(), rel=1e-6)
    coarse = longclip.pca_reconstruct(img, 2)  # the short term sees the coarse embedding, unnormalised
    out = longclip.longclip_losses(img, coarse, txt_long, txt_short, s, 0.0)
    assert out["loss_short"].item() == pytest.approx(common.clip_loss(coarse, txt_short, s).item(), rel=1e-6)


def test_released_per_rank_loss_averages_to_ours():
    """Deviation 11: the code's rank r scores its rows against the gathered columns
    (targets offset by r * b); the mean over ranks is our loss on the gathered batch.
    PCA per rank (deviation 3): each half reconstructed from its own batch."""
    ranks, b, k, eps = 2, 5, 2, 0.1
    img, txt_long, txt_short = (unit(ranks * b, 8, seed=s) for s in range(3))
    coarse = torch.cat([longclip.pca_reconstruct(img[r * b:(r + 1) * b], k) for r in range(ranks)])
    s = torch.tensor(100.0)
    per_rank = []
    for r in range(ranks):
        rows = slice(r * b, (r + 1) * b)
        target = torch.arange(r * b, (r + 1) * b)
        terms = []
        for v, t in ((img, txt_long), (coarse, txt_short)):
            i2t = s * v[rows] @ t.t()
            t2i = s * t[rows] @ v.t()
            terms.append((F.cross_entropy(i2t, target, label_smoothing=eps)
                          + F.cross_entropy(t2i, target, label_smoothing=eps)) / 2)
        per_rank.append(terms[0] + terms[1])
    ours = sum(longclip.longclip_losses(img, coarse, txt_long, txt_short, s, eps).values())
    assert ours.item() == pytest.approx(torch.stack(per_rank).mean().item(), rel=1e-6)


# ----------------------------------------------------------------------------- the stretched model
def test_stretched_model_reads_short_texts_as_before(tiny_random):
    model, _, _, tok = tiny_random
    model = copy.deepcopy(model).eval()
    short = tok(["a red circle."])
    assert int((short != 0).sum()) <= TINY_KEEP  # only kept positions in use
    with torch.no_grad():
        before = common.encode_text(model, short)
        assert longclip.stretch_text_window(model, TINY_KEEP, 4) == TINY_WINDOW
        after = common.encode_text(model, short)
    assert model.context_length == TINY_WINDOW and model.attn_mask.shape == (TINY_WINDOW, TINY_WINDOW)
    assert torch.equal(model.attn_mask, torch.full((TINY_WINDOW,) * 2, float("-inf")).triu(1))
    assert torch.allclose(before, after, atol=1e-6)
    long_tok = models.get_tokenizer("tiny", TINY_WINDOW)
    long_text = long_tok([max((s["long_caption"] for s in lab.world_split(lab.FINETUNE, 8, seed=3)),
                              key=len)])
    assert long_text.shape == (1, TINY_WINDOW) and int((long_text != 0).sum()) > 24  # past the old window
    with torch.no_grad():  # open_clip's own (untrimmed) path reads the whole window too
        assert torch.allclose(common.encode_text(model, long_text), model.encode_text(long_text, normalize=True),
                              atol=1e-5)


def test_wrapper_gradients_frozen_rows_and_fixed_temperature(tiny_random):
    model, _, eval_tf, _ = tiny_random
    model = copy.deepcopy(model)
    net = longclip.LongCLIP(model, cfg_of(pca_dim=2))
    assert net.keep == TINY_KEEP and net.context_length == TINY_WINDOW
    assert model.logit_scale.item() == pytest.approx(longclip.LN_100) and not model.logit_scale.requires_grad
    pos_before = model.positional_embedding.detach().clone()
    losses = net(tiny_batch(models.get_tokenizer("tiny", TINY_WINDOW), eval_tf, n=4))
    assert set(losses) == {"loss_long", "loss_short"} and all(torch.isfinite(v) for v in losses.values())
    sum(losses.values()).backward()
    assert all(torch.isfinite(p.grad).all() for p in net.parameters() if p.grad is not None)
    assert model.visual.conv1.weight.grad.abs().sum() > 0 and model.token_embedding.weight.grad.abs().sum() > 0
    g = model.positional_embedding.grad
    assert torch.equal(g[:TINY_KEEP], torch.zeros_like(g[:TINY_KEEP])) and g[TINY_KEEP:].abs().sum() > 0
    assert model.logit_scale.grad is None
    groups = common.param_groups(net, 1e-2, 0.01)
    torch.optim.AdamW(groups, lr=1e-2).step()
    assert torch.equal(model.positional_embedding[:TINY_KEEP], pos_before[:TINY_KEEP])  # kept rows: frozen
    assert not torch.equal(model.positional_embedding[TINY_KEEP:], pos_before[TINY_KEEP:])
    with pytest.raises(ValueError, match="stretched already"):
        longclip.LongCLIP(model, cfg_of())
    again = longclip.LongCLIP(model, cfg_of(stretch=False, log_scale=-1.0, freeze_kept=False))
    assert again.context_length == TINY_WINDOW and again.keep == TINY_KEEP


def test_bf16_autocast_step_on_cpu(tiny_random):
    model, _, eval_tf, _ = tiny_random
    net = longclip.LongCLIP(copy.deepcopy(model), cfg_of(pca_dim=2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = net(tiny_batch(models.get_tokenizer("tiny", TINY_WINDOW), eval_tf, n=4))
    loss = sum(v.float() for v in losses.values())
    assert torch.isfinite(loss) and all(v.dtype == torch.float32 for v in losses.values())
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in net.parameters() if p.grad is not None)


def test_collate_short_caption_modes(tiny_random):
    _, _, eval_tf, _ = tiny_random
    tok = models.get_tokenizer("tiny", TINY_WINDOW)
    scenes = lab.world_split(lab.FINETUNE, 2, seed=7)
    items = [{"image": eval_tf(lab.render(s)), "caption": s["caption"], "long_caption": s["long_caption"],
              "index": i} for i, s in enumerate(scenes)]
    first = longclip.LongCaptionCollate(tok, "first-sentence")(items)
    assert first["caption"] == [longclip_data.first_sentence(s["long_caption"]) for s in scenes]
    assert torch.equal(first["text"], tok(first["caption"])) and first["long_text"].shape == (2, TINY_WINDOW)
    assert longclip.LongCaptionCollate(tok, "caption")(items)["caption"] == [s["caption"] for s in scenes]
    assert longclip_data.first_sentence("The image shows a cat. It sleeps.\nOn a mat.") == "The image shows a cat"


# ----------------------------------------------------------------------------- saving, loading, resume
def test_stretched_model_round_trip_through_open_clip(tiny_random, tmp_path):
    model, _, _, _ = tiny_random
    model = copy.deepcopy(model).eval()
    longclip.stretch_text_window(model, TINY_KEEP, 4)
    with torch.no_grad():  # a trained table is no longer an interpolation
        model.positional_embedding.add_(0.01 * torch.randn_like(model.positional_embedding))
    path = models.save_model(model, tmp_path / "m.pt", "tiny", source="random")
    assert json.loads((tmp_path / "m.pt.json").read_text())["context_length"] == TINY_WINDOW
    tok = models.get_tokenizer("tiny", TINY_WINDOW)
    text = tok([s["long_caption"] for s in lab.world_split(lab.FINETUNE, 3, seed=5)])
    again, _, _, again_tok = models.load_model("tiny", str(path))
    again.eval()
    assert again.context_length == TINY_WINDOW and again_tok.context_length == TINY_WINDOW
    other, _, _ = open_clip.create_model_and_transforms(models.TINY_NAME, pretrained=str(path),
                                                        force_context_length=TINY_WINDOW)
    other.eval()
    with torch.no_grad():
        want = model.encode_text(text, normalize=True)
        for m in (again, other):
            assert torch.equal(m.positional_embedding, model.positional_embedding)
            assert torch.allclose(m.encode_text(text, normalize=True), want, atol=1e-6)
            assert torch.allclose(common.encode_text(m, text), want, atol=1e-5)
    # without the sidecar's window open_clip would squeeze the table back to 24 rows
    squeezed, _, _ = open_clip.create_model_and_transforms(models.TINY_NAME, pretrained=str(path))
    assert squeezed.positional_embedding.shape[0] == 24


def _train_cfg(tmp_path, **kw):
    return cfg_of(**{"epochs": 1, "steps": 5, "batch_size": 4, "lr": 1e-3, "warmup": 2, "pca_dim": 2,
                     "out": str(tmp_path / "run"), "save_every": 0, "log_every": 1, "seed": 0, **kw})


def _fresh(seed):
    torch.manual_seed(seed)
    return models.load_model("tiny", "random")


def test_resume_equals_uninterrupted_run(tmp_path):
    model_a, pre, _, _ = _fresh(0)
    # 16 pairs, batch 4: 4 steps per epoch, so steps 5 with a stop at 3 cross an epoch boundary
    data = common.ManifestDataset(lab.synthetic_manifest("test", tmp_path / "data", n=16), pre, need_long=True)
    collate = longclip.LongCaptionCollate(models.get_tokenizer("tiny", TINY_WINDOW), "first-sentence")
    common.train(_train_cfg(tmp_path, out=str(tmp_path / "a")), longclip.LongCLIP(model_a, _train_cfg(tmp_path)),
                 data, collate, export=False)
    model_b = _fresh(0)[0]
    cfg_b = _train_cfg(tmp_path, out=str(tmp_path / "b"), stop_at=3)
    assert common.train(cfg_b, longclip.LongCLIP(model_b, cfg_b), data, collate)["stopped_at"] == 3
    torch.manual_seed(123)
    model_c = _fresh(99)[0]
    cfg_c = _train_cfg(tmp_path, out=str(tmp_path / "b"), resume="latest")
    common.train(cfg_c, longclip.LongCLIP(model_c, cfg_c), data, collate, export=False)
    for (k, a), (_, c) in zip(model_a.state_dict().items(), model_c.state_dict().items()):
        assert torch.allclose(a, c, atol=1e-6), k
    assert model_c.positional_embedding.shape[0] == TINY_WINDOW


# ----------------------------------------------------------------------------- data, recipes, tables
def test_sharegpt4v_manifest_on_a_fixture(tmp_path):
    root = tmp_path / "data"
    (root / "coco" / "train2017").mkdir(parents=True)
    from PIL import Image
    for i in range(4):
        Image.new("RGB", (8, 8), (i, 0, 0)).save(root / "coco" / "train2017" / f"{i}.jpg")

    def rec(image, text):
        return {"id": image, "image": image, "conversations": [{"from": "human", "value": "<image>\nDescribe."},
                                                               {"from": "gpt", "value": text}]}
    records = [rec("coco/train2017/0.jpg", "Test image. Held out."),  # the ShareGPT4V-1k part (holdout 1)
               rec("coco/train2017/1.jpg", "The image shows a dog. It runs.\nOn grass."),
               rec("coco/train2017/0.jpg", "The test image again."),  # dropped: a test image
               rec("coco/train2017/2.jpg", "No period at all"),
               rec("coco/train2017/3.jpg", "")]  # dropped: empty
    sg = root / "sharegpt4v" / "sg.json"
    sg.parent.mkdir(parents=True)
    sg.write_text(json.dumps(records))
    path = longclip_data.sharegpt4v_manifest(sg, root / "longclip", holdout=1)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["caption"], r["long_caption"]) for r in rows] == [
        ("The image shows a dog", "The image shows a dog. It runs. On grass."),
        ("No period at all", "No period at all")]
    ds = common.ManifestDataset(path, need_long=True)
    assert ds.image_file(ds.rows[0]).resolve() == (root / "coco/train2017/1.jpg").resolve()
    assert json.loads((root / "longclip" / (path.name + ".json")).read_text())["dropped"] == 2



def test_sharegpt4v_manifest_is_rebuilt_when_its_json_changes(tmp_path, capsys):
    """Issue 23 item 5: the write-once manifest records its source in the
    sidecar; the same json is reused, a changed one rebuilds the file."""
    def rec(image, text):
        return {"image": image, "conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": text}]}
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([rec("coco/train2017/0.jpg", "Held out."), rec("coco/train2017/1.jpg", "First. One.")]))
    path = longclip_data.sharegpt4v_manifest(sg, tmp_path / "longclip", holdout=1)
    assert json.loads((tmp_path / "longclip" / (path.name + ".json")).read_text())["sources"] == \
        source_stamp({"sharegpt4v": sg})
    assert longclip_data.sharegpt4v_manifest(sg, tmp_path / "longclip", holdout=1) == path
    assert "rebuilding" not in capsys.readouterr().err  # the same json: reused
    sg.write_text(json.dumps([rec("coco/train2017/0.jpg", "Held out."), rec("coco/train2017/2.jpg", "Changed. Two."),
                              rec("coco/train2017/3.jpg", "Three.")]))
    assert longclip_data.sharegpt4v_manifest(sg, tmp_path / "longclip", holdout=1) == path
    assert "rebuilding it" in capsys.readouterr().err
    assert [json.loads(line)["caption"] for line in path.read_text().splitlines()] == ["Changed", "Three."]

def test_recipes_and_clear_failures(tmp_path):
    cfg = parse_config(longclip.LongCLIPConfig, ["--recipe", "erclip-budget"],
                              **longclip.RECIPES["erclip-budget"])
    assert (cfg.lr, cfg.wd, cfg.warmup, cfg.batch_size, cfg.epochs, cfg.beta2, cfg.eps) == \
        (5e-6, 0.05, 200, 64, 1, 0.98, 1e-6)
    assert cfg.train_data == "coco-sharegpt4v" and cfg.short_caption == "caption" and cfg.log_scale < 0
    paper = parse_config(longclip.LongCLIPConfig, [])
    assert (paper.lr, paper.wd, paper.warmup, paper.batch_size, paper.label_smoothing) == (1e-6, 0.01, 200, 2048, 0.1)
    assert paper.log_scale == pytest.approx(4.6052, abs=1e-4) and paper.train_data == "auto"
    assert longclip._recipe(["--lr", "1", "--recipe=erclip-budget"]) == "erclip-budget"
    demo = parse_config(longclip.LongCLIPConfig, ["--demo"], **{**longclip.RECIPES["erclip-budget"],
                                                                       **longclip_demo.DEMO})
    assert (demo.recipe, demo.train_data, demo.lr, demo.wd, demo.warmup, demo.steps, demo.batch_size) == \
        ("erclip-budget", "synthetic", 1.5e-4, 0.05, 4, 40, 32)
    from lab.demos import erclip as erclip_demo  # ERCLIP's demo settings, copied (the two runs are independent)
    assert all(getattr(demo, k) == v for k, v in erclip_demo.DEMO.items() if k in ("lr", "wd", "warmup", "steps"))
    assert (demo.label_smoothing, demo.precision, demo.workers, demo.pca_dim, demo.log_scale) == \
        (0.1, "fp32", 0, 8, -1.0) and demo.short_caption == "caption"
    with pytest.raises(DataError, match="ShareGPT4V json not found"):
        longclip.main(["--train-data", "sharegpt4v", "--data-root", str(tmp_path), "--out", str(tmp_path / "o")])
    with pytest.raises(DataError, match="captions_train2017.json not found"):
        longclip.main(["--recipe", "erclip-budget", "--data-root", str(tmp_path), "--out", str(tmp_path / "o")])
    with pytest.raises(DataError, match="erclip-results"):
        longclip.main(["--erclip-results", str(tmp_path / "none.json"), "--train-data", "synthetic"])


def test_paper_tables_layout():
    records = [{"task": t, "metric": m, "value": 50.0, "window": w} for t in published.ERCLIP_LONG_SETS + ("coco",)
               for m in ("i2t_R@1", "t2i_R@1") for w in (77, 248)]
    records = [dict(r, value=60.0) if r["window"] == 248 else r for r in records]
    records += [{"task": t, "metric": "top1", "value": 70.0, "window": None}
                for t in ("cifar10", "cifar100", "imagenet")]
    erclip_records = [{k: v for k, v in r.items() if k != "window"} for r in records if r["window"] in (77, None)]
    text = longclip.paper_tables([("ERCLIP M+P (ours)", erclip_records, 77, "yes"),
                                  ("Long-CLIP (ours)", records, 77, "no"), ("Long-CLIP (ours)", records, 248, "no")],
                                 "ViT-B/16")
    assert "| paper CLIP (ERCLIP Tab. 1-2) | B/16 | 77 | 67.50 | 53.30 |" in text
    assert "| paper Long-CLIP, ~1M pairs (ERCLIP Tab. 1) | B/16 | 248 | 79.30 | 79.40 |" in text
    assert "| 42.20 | 48.46 | 69.82 | 73.19 |" in text  # the printed averages
    assert "| Long-CLIP (ours) | B/16 | 248 | 60.00 | 60.00 |" in text
    assert "| Long-CLIP (ours) | B/16 | 77 | no | 50.00 | 50.00 | 50.00 | 50.00 | 70.00 | 70.00 | 70.00 |" in text
    assert "| ERCLIP M+P (ours) | B/16 | 77 | yes | 50.00 |" in text


# ----------------------------------------------------------------------------- end to end
def test_main_end_to_end_on_the_synthetic_world(tmp_path, model_files_as_readme_says,
                                                results_files_are_strict_json, capsys):
    out = tmp_path / "run"
    small = str(lab.synthetic_manifest("train", tmp_path / "data", n=16))  # a 16-image retrieval set
    folder = tmp_path / "zs"  # a 4-image zero-shot set (2 colours)
    for c, color in enumerate(("red", "blue")):
        (folder / color).mkdir(parents=True)
        for i, scene in enumerate(lab.world_split(lab.FINETUNE, 2, seed=c)):
            lab.render(scene).save(folder / color / f"{i}.png")
    zero_shot = f"imagefolder:{folder}"
    result = longclip.main(["--train-data", "synthetic", "--data-root", str(tmp_path / "data"), "--train-pairs", "16",
                            "--batch-size", "8", "--steps", "3", "--warmup", "1", "--lr", "1e-4", "--workers", "0",
                            "--log-every", "1", "--device", "cpu", "--pretrained", "random", "--pca-dim", "4",
                            "--eval-tasks", f"{small},{zero_shot}", "--out", str(out)])
    summary = result["summary"]
    assert summary["steps"] == 3 and summary["context_length"] == TINY_WINDOW and summary["keep"] == TINY_KEEP
    assert {r["window"] for r in result["tuned"] if r["task"] == small} == {24, TINY_WINDOW}
    assert {r["window"] for r in result["tuned"] if r["task"] == zero_shot} == {None}
    assert {r["window"] for r in result["base"] if r["task"] == zero_shot} == {None}
    assert {r["window"] for r in result["base"] if r["task"] == small} == {24}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3 and all(m["logit_scale"] == pytest.approx(100.0, rel=1e-5) for m in metrics)
    saved = results_files_are_strict_json(out, "longclip")  # issue 42.3: one schema, strict JSON
    assert saved["windows"] == [24, TINY_WINDOW] and saved["tables"] in capsys.readouterr().out
    # the user's own tasks: a row per stage, task and window, R@1/5/10 both ways and top-1 (issue 42.3)
    assert f"| tuned | {small} | {TINY_WINDOW} |" in saved["tables"] and "| t2i_R@10 | top1 |" in saved["tables"]
    assert {(r["stage"], r["window"]) for r in saved["records"] if r["task"] == small} == {
        ("base", 24), ("tuned", 24), ("tuned", TINY_WINDOW)}
    model_files_as_readme_says("longclip", out)
    model, _, pre, tok = models.load_model("tiny", str(out / "model.pt"))  # the export, with its window
    assert model.context_length == TINY_WINDOW and tok.context_length == TINY_WINDOW
    rec = evaluation.evaluate(model, pre, tok, [small], str(tmp_path / "data"))
    want = next(r["value"] for r in result["tuned"] if r["task"] == small and r["metric"] == "i2t_R@1"
                and r["window"] == TINY_WINDOW)
    assert next(r["value"] for r in rec if r["metric"] == "i2t_R@1") == pytest.approx(want)
    # eval.py's CLI reads the export through its own window, or through the original one
    for window in (TINY_WINDOW, 24):
        cli = evaluation.main(["--backbone", "tiny", "--pretrained", str(out / "model.pt"), "--tasks", small,
                               "--data-root", str(tmp_path / "data"), "--out", str(tmp_path / f"eval{window}"),
                               "--device", "cpu"] + (["--context-length", str(window)] if window == 24 else []))
        want = next(r["value"] for r in result["tuned"] if r["task"] == small and r["metric"] == "t2i_R@1"
                    and r["window"] == window)
        assert next(r["value"] for r in cli if r["metric"] == "t2i_R@1") == pytest.approx(want)
    with pytest.raises(UsageError, match="--context-length 200 is longer than the model's text window"):
        evaluation.main(["--backbone", "tiny", "--pretrained", str(out / "model.pt"), "--tasks", small,
                         "--context-length", "200", "--out", ""])


@pytest.mark.slow
def test_demo_writes_claims_results_and_figure(tmp_path, shrink_world, check_demo_results):
    """The demo's plumbing on a shrunken world (2 steps per run; ERCLIP M+P by
    subprocess on the same training manifest): every seed of every run is
    kept, the claims carry the agreed keys, the PNG exists."""
    shrink_world({"train": 64, "test": 16, "zs-test": 24}.get)
    out = tmp_path / "demo"
    longclip.main(["--demo", "--seeds", "0,1", "--steps", "2", "--warmup", "1", "--batch-size", "16", "--data-root",
                   str(tmp_path / "data"), "--out", str(out)])
    names = {"ERCLIP M+P", "Long-CLIP, window 24", "Long-CLIP, window 78"}
    saved = check_demo_results(out, "longclip-demo.png", names, min_claims=5)
    assert set(saved["per_seed"]) == names
    for s in lab.seeds():  # the subprocess trained on the demo's (shrunken) manifest, for 2 steps
        summary = json.loads((out / f"ERCLIP-MP-seed{s}" / "results.json").read_text())["summary"]
        assert summary["steps"] == 2 and summary["train_pairs"] == 64


def test_short_caption_code_is_the_codes_split_exactly():
    """--short-caption code (deviation 8, issue 25.8): sharegpt4v.py's caption.replace("\\n", " ").split(". ")[0],
    nothing stripped and no fallback; first-sentence (ours) strips and falls back to the whole caption."""
    texts = [" A man rides.  A dog runs.", ". Opens with a stop. Then more.", "One line\nno stop", "Ends. "]
    items = [{"caption": "unused", "long_caption": t} for t in texts]
    tok = lambda xs, *a, **k: torch.zeros(len(xs), 4, dtype=torch.long)  # noqa: E731  (tokens not under test)
    code = longclip.LongCaptionCollate(tok, "code")(items)["caption"]
    ours = longclip.LongCaptionCollate(tok, "first-sentence")(items)["caption"]
    assert code == [" A man rides", "", "One line no stop", "Ends"]
    assert ours == ["A man rides", ". Opens with a stop. Then more.", "One line no stop", "Ends"]
    assert longclip.LongCaptionCollate(tok, "caption")(items)["caption"] == ["unused"] * 4


def test_log_scale_flag_sets_the_codes_temperature(tiny_random):
    """Deviation 5 (issue 25.8): ours sets logit_scale to ln 100 = 4.605170; the code's --log_scale 4.6052 is a
    flag away, and the two differ by 2.9e-5 in the log scale (100.003 against 100)."""
    for value in (longclip.LN_100, 4.6052):
        model = copy.deepcopy(tiny_random[0])
        longclip.LongCLIP(model, cfg_of(log_scale=value))
        assert float(model.logit_scale.detach()) == pytest.approx(value, abs=1e-6)  # float32
    assert 4.6052 - longclip.LN_100 == pytest.approx(2.9e-5, abs=1e-6)
