"""ERCLIP (erclip.py): losses by hand and against loops, the sentence
pathway, the fusions, the frozen teacher, the training manifest, and an
end-to-end run through main()."""
import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import common
from plumbing.base import DataError
from plumbing.runfolder import checkpoint_state
import lab
from lab import calibrate, registry
from lab.demos import erclip as erclip_demo
import erclip
import eval as evaluation
from plumbing import published


def unit(*shape, seed=0):
    return F.normalize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), dim=-1)


def cfg_of(**kw):
    return erclip.ERCLIPConfig(**{"backbone": "tiny", "workers": 0, "precision": "fp32", **kw})


def tiny_batch(tokenizer, transform, n=4, max_sentences=0, root=None):
    scenes = lab.world_split(lab.FINETUNE, n, seed=7)
    items = [{"image": transform(lab.render(s)), "caption": s["caption"], "long_caption": s["long_caption"],
              "index": i} for i, s in enumerate(scenes)]
    return erclip.SentenceCollate(tokenizer, max_sentences)(items)


# ----------------------------------------------------------------------------- losses
def test_preservation_loss_by_hand():
    img = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    img0 = torch.tensor([[1.0, 0.0], [1.0, 0.0]])  # cosines 1, 0
    txt = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    txt0 = torch.tensor([[0.5, math.sqrt(0.75)], [-1.0, 0.0]])  # cosines 0.5, -1
    # 1/(2B) sum_b [(1 - v.v0) + (1 - t.t0)] = 1/4 [(0 + 0.5) + (1 + 2)] = 0.875
    assert erclip.preservation_loss(img, img0, txt, txt0).item() == pytest.approx(0.875)
    assert erclip.preservation_loss(img, img, txt, txt).item() == pytest.approx(0.0, abs=1e-7)


def test_preservation_loss_matches_per_sample_loop():
    img, img0, txt, txt0 = (unit(6, 8, seed=s) for s in range(4))
    loop = sum((1 - img[b] @ img0[b]) + (1 - txt[b] @ txt0[b]) for b in range(6)) / (2 * 6)
    assert erclip.preservation_loss(img, img0, txt, txt0).item() == pytest.approx(loop.item(), rel=1e-6)


def test_losses_reduce_to_clip_and_are_weighted():
    img, txt, long_, img0, txt0 = (unit(5, 8, seed=s) for s in range(5))
    s = torch.tensor(30.0)
    off = erclip.erclip_losses(img, txt, long_, img0, txt0, s, alpha=0.0, lambda_p=0.0, label_smoothing=0.1)
    assert sum(off.values()).item() == pytest.approx(common.clip_loss(img, txt, s, 0.1).item(), rel=1e-6)
    on = erclip.erclip_losses(img, txt, long_, img0, txt0, s, alpha=0.5, lambda_p=2.0, label_smoothing=0.1)
    assert set(on) == {"loss_short", "loss_long", "loss_pres"}
    assert on["loss_long"].item() == pytest.approx(0.5 * common.clip_loss(img, long_, s, 0.1).item(), rel=1e-6)
    assert on["loss_pres"].item() == pytest.approx(2 * erclip.preservation_loss(img, img0, txt, txt0).item())
    # variant M runs without a teacher: the preservation term is an exact zero
    m = erclip.erclip_losses(img, txt, long_, None, None, s, alpha=1.0, lambda_p=0.0, label_smoothing=0.1)
    assert m["loss_pres"].item() == 0.0


# ----------------------------------------------------------------------------- sentences
@pytest.mark.parametrize("text,expected", [
    ("A cat. A dog.", ["A cat.", "A dog."]),
    ("no period at all", ["no period at all"]),
    ("  A cat.   A dog.   ", ["A cat.", "A dog."]),
    ("A cat.\nA dog.\n\nA bird on a\nbranch.", ["A cat.", "A dog.", "A bird on a branch."]),
    ("", []),
    ("   \n ", []),
    ("It is 2.5 m tall. It costs 3.99 euros.", ["It is 2.5 m tall.", "It costs 3.99 euros."]),
    ("A cat. . A dog", ["A cat.", "A dog"]),
])
def test_split_sentences(text, expected):
    assert erclip.split_sentences(text) == expected


def test_pad_and_mean_fusion_match_per_caption_loop():
    counts = torch.tensor([3, 1, 2])
    e = unit(6, 8, seed=1)
    E, mask = erclip.pad_sentences(e, counts)
    assert E.shape == (3, 3, 8) and mask.tolist() == [[True] * 3, [True, False, False], [True, True, False]]
    z = erclip.mean_fusion(E, mask)
    start = 0
    for b, n in enumerate(counts.tolist()):
        assert torch.allclose(z[b], e[start:start + n].mean(0), atol=1e-6)
        start += n


def test_collate_caps_sentences_and_counts_the_dropped(tiny_random):
    _, _, eval_tf, tok = tiny_random
    full = tiny_batch(tok, eval_tf, n=6)
    capped = tiny_batch(tok, eval_tf, n=6, max_sentences=2)
    per = [len(erclip.split_sentences(t)) for t in full["long_caption"]]
    assert full["sentence_counts"].tolist() == per and full["sentences_dropped"].sum() == 0
    assert capped["sentence_counts"].tolist() == [min(2, n) for n in per]
    assert capped["sentences_dropped"].tolist() == [max(0, n - 2) for n in per]
    assert len(capped["sentence_tokens"]) == sum(min(2, n) for n in per)


def test_one_padded_sentence_batch_equals_separate_encoding(tiny_random):
    model, _, eval_tf, tok = tiny_random
    batch = tiny_batch(tok, eval_tf, n=4)
    net = erclip.ERCLIP(model, cfg_of(lambda_p=0.0)).eval()
    with torch.no_grad():
        long_emb = net.encode_long(batch["sentence_tokens"], batch["sentence_counts"])
        for b, text in enumerate(batch["long_caption"]):
            e = common.encode_text(model, tok(erclip.split_sentences(text)))  # this caption alone
            assert torch.allclose(long_emb[b], F.normalize(e.mean(0), dim=-1), atol=1e-5)


def test_a_caption_with_hundreds_of_sentences_and_one_without_a_period(tiny_random):
    model, _, eval_tf, tok = tiny_random
    image = eval_tf(lab.render(lab.world_split(lab.FINETUNE, 1, 0)[0]))
    long_caps = [" ".join(f"Object {i} is red." for i in range(300)), "a caption with no period at all"]
    items = [{"image": image, "caption": "a red circle.", "long_caption": c, "index": i}
             for i, c in enumerate(long_caps)]
    batch = erclip.SentenceCollate(tok)(items)
    assert batch["sentence_counts"].tolist() == [300, 1] and batch["sentences_dropped"].tolist() == [0, 0]
    net = erclip.ERCLIP(model, cfg_of(lambda_p=0.0, fusion="rt")).eval()
    with torch.no_grad():
        long_emb = net.encode_long(batch["sentence_tokens"], batch["sentence_counts"])
    assert long_emb.shape == (2, common.embed_dim(model)) and torch.isfinite(long_emb).all()
    capped = erclip.SentenceCollate(tok, max_sentences=8)(items)
    assert capped["sentence_counts"].tolist() == [8, 1] and capped["sentences_dropped"].tolist() == [292, 0]
    assert batch["sentence_stats"] == (301, 0, 300) and capped["sentence_stats"] == (9, 292, 8)


class _NoHostRead(torch.Tensor):
    """A tensor that fails when the step reads it back to Python (int(),
    .item(), .tolist()): what a host sync on a GPU would be."""
    def __int__(self):
        raise AssertionError("read back to the host")
    item = tolist = __int__


def test_the_step_reads_no_sentence_count_back_from_the_device(tiny_random):
    """The collate's Python ints (sentence_stats) feed the counters and the
    padding size, so forward never syncs on the counts; the padding from the
    known maximum is the one read from the tensor."""
    model, _, eval_tf, tok = tiny_random
    batch = tiny_batch(tok, eval_tf, max_sentences=3)
    counts = batch["sentence_counts"]
    e = unit(int(counts.sum()), 16, seed=5)
    for got, want in zip(erclip.pad_sentences(e, counts, batch["sentence_stats"][2]), erclip.pad_sentences(e, counts)):
        assert torch.equal(got, want)
    net = erclip.ERCLIP(model, cfg_of(lambda_p=1.0)).eval()
    ctx = SimpleNamespace(step=0, device=torch.device("cpu"), precision="fp32")
    with torch.no_grad():
        plain = net(batch, ctx)
        guarded = dict(batch, sentence_counts=batch["sentence_counts"].as_subclass(_NoHostRead),
                       sentences_dropped=batch["sentences_dropped"].as_subclass(_NoHostRead))
        losses = net(guarded, ctx)
    assert net.sentences_seen == 2 * batch["sentence_stats"][0]
    for k in plain:
        torch.testing.assert_close(losses[k].as_subclass(torch.Tensor), plain[k])


# ----------------------------------------------------------------------------- fusions
def test_rt_fusion_starts_at_the_mean_and_gamma_learns():
    torch.manual_seed(0)
    fusion = erclip.ResidualTransformerFusion(16)
    E, mask = erclip.pad_sentences(unit(7, 16, seed=2), torch.tensor([4, 1, 2]))
    z = fusion(E, mask)
    assert torch.allclose(z, erclip.mean_fusion(E, mask), atol=1e-6)  # gamma = 0: exactly z_mean
    (z * unit(3, 16, seed=3)).sum().backward()
    assert fusion.gamma.grad is not None and fusion.gamma.grad.abs().item() > 0
    # once the gate opens, the scorer and the block receive gradient and the output moves off the mean
    with torch.no_grad():
        fusion.gamma.fill_(0.5)
    fusion.zero_grad()
    z = fusion(E, mask)
    assert not torch.allclose(z, erclip.mean_fusion(E, mask), atol=1e-4)
    (z * unit(3, 16, seed=3)).sum().backward()
    for p in [*fusion.scorer.parameters(), *fusion.block.parameters()]:
        assert torch.isfinite(p.grad).all()
    assert fusion.scorer[0].weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["rt", "transformer", "lstm"])
def test_fusions_ignore_padding(kind):
    torch.manual_seed(0)
    fusion = erclip.make_fusion(kind, 16)
    if kind == "rt":
        with torch.no_grad():
            fusion.gamma.fill_(1.0)
    E, mask = erclip.pad_sentences(unit(5, 16, seed=4), torch.tensor([3, 2]))
    z = fusion(E, mask)
    E2 = E.clone()
    E2[~mask] = 100.0  # garbage where there is no sentence
    assert torch.allclose(fusion(E2, mask), z, atol=1e-5)
    assert torch.allclose(fusion(E[1:, :2], mask[1:, :2]), z[1:], atol=1e-5)  # a shorter padded length


# ----------------------------------------------------------------------------- wrapper and teacher
def test_teacher_is_frozen_unchanged_and_not_checkpointed(tiny_random):
    model, _, eval_tf, tok = tiny_random
    model = copy.deepcopy(model)
    net = erclip.ERCLIP(model, cfg_of(fusion="rt")).train()
    assert not net.teacher.training and all(not p.requires_grad for p in net.teacher.parameters())
    before = {k: v.clone() for k, v in net.teacher.state_dict().items()}
    student_before = model.visual.conv1.weight.clone()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-3)
    batch = tiny_batch(tok, eval_tf, n=4)
    losses = net(batch)
    assert losses["loss_pres"].item() == pytest.approx(0.0, abs=1e-6)  # student == teacher at step 0
    sum(losses.values()).backward()
    assert all(p.grad is None for p in net.teacher.parameters())
    grads = [p.grad for n, p in net.named_parameters() if p.requires_grad and not n.startswith("teacher.")]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert net.fusion.gamma.grad.abs().item() > 0 and model.visual.conv1.weight.grad.abs().sum() > 0
    assert model.logit_scale.grad is None  # fixed temperature (deviation 3)
    opt.step()
    assert all(torch.equal(v, net.teacher.state_dict()[k]) for k, v in before.items())
    assert not torch.equal(model.visual.conv1.weight, student_before)
    losses = net(batch)  # the student moved, so the preservation loss now pulls it back
    assert losses["loss_pres"].item() > 0
    assert not any(k.startswith("teacher.") for k in checkpoint_state(net))
    assert erclip.ERCLIP(model, cfg_of(lambda_p=0.0)).teacher is None  # variant M needs no teacher


def test_preservation_pulls_toward_the_teacher(tiny_random):
    model, _, eval_tf, tok = tiny_random
    net = erclip.ERCLIP(copy.deepcopy(model), cfg_of())
    batch = tiny_batch(tok, eval_tf, n=4)
    with torch.no_grad():  # move the student off the teacher
        for p in net.model.visual.parameters():
            p.add_(0.02 * torch.randn_like(p))
    opt = torch.optim.SGD(net.model.visual.parameters(), lr=0.5)
    first = None
    for _ in range(3):  # descend on L_pres alone
        pres = net(batch)["loss_pres"]
        first = first if first is not None else pres.item()
        opt.zero_grad()
        pres.backward()
        opt.step()
    assert net(batch)["loss_pres"].item() < first


def test_bf16_autocast_step_on_cpu(tiny_random):
    model, _, eval_tf, tok = tiny_random
    net = erclip.ERCLIP(copy.deepcopy(model), cfg_of(fusion="rt"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = net(tiny_batch(tok, eval_tf, n=4))
    loss = sum(v.float() for v in losses.values())
    assert torch.isfinite(loss) and all(v.dtype == torch.float32 for v in losses.values())
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in net.parameters() if p.grad is not None)


# ----------------------------------------------------------------------------- training data
def _fixture_pool(tmp_path):
    """Tiny annotation files in the real formats (COCO captions json, ShareGPT4V json)."""
    root = tmp_path / "data"
    (root / "coco" / "train2017").mkdir(parents=True)
    images = [{"id": i, "file_name": f"{i:012d}.jpg", "height": 8, "width": 8} for i in (30, 9, 25, 77, 4)]
    for im in images:
        Image.new("RGB", (8, 8), (im["id"], 0, 0)).save(root / "coco" / "train2017" / im["file_name"])
    annotations = [{"image_id": 25, "id": 1, "caption": "first of 25."}, {"image_id": 9, "id": 2, "caption": "nine A."},
                   {"image_id": 25, "id": 0, "caption": "second of 25."},
                   {"image_id": 9, "id": 3, "caption": "nine B."},
                   {"image_id": 30, "id": 4, "caption": "thirty."}, {"image_id": 4, "id": 5, "caption": "four."},
                   {"image_id": 77, "id": 6, "caption": "seventy-seven."}]
    ann = root / "coco" / "annotations" / "captions_train2017.json"
    ann.parent.mkdir(parents=True)
    ann.write_text(json.dumps({"images": images, "annotations": annotations}))

    def rec(i, image, text):
        return {"id": str(i), "image": image, "conversations": [
            {"from": "human", "value": "<image>\nDescribe."}, {"from": "gpt", "value": text}]}
    records = [rec(0, "coco/train2017/000000000004.jpg", "held out: test record."),  # ShareGPT4V-1k
               rec(1, "sam/images/sa_1.jpg", "a sam image."),
               rec(2, "coco/train2017/000000000030.jpg", "Long thirty. Second sentence."),
               rec(3, "coco/train2017/000000000009.jpg", "Long nine.\nMore."),
               rec(4, "coco/train2017/000000000009.jpg", "a later duplicate."),
               rec(5, "coco/train2017/000000000025.jpg", "Long 25."),
               rec(6, "coco/train2017/000000000004.jpg", "the held-out image again.")]  # 77: not described
    sg = root / "sharegpt4v" / "share-captioner_coco_lcs_sam_1246k_1107.json"
    sg.parent.mkdir(parents=True)
    sg.write_text(json.dumps(records))
    return root, ann, sg


def test_build_train_manifest_on_a_fixture(tmp_path):
    root, ann, sg = _fixture_pool(tmp_path)
    path = erclip.build_train_manifest(ann, sg, root / "erclip", n_pairs=2, holdout=1)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    # pool {9, 25, 30} in image-id order, the first 2; 4 is held out, 77 undescribed, sam ignored
    assert [r["coco_id"] for r in rows] == [9, 25]
    assert [r["caption"] for r in rows] == ["nine A.", "first of 25."]  # first caption in file order
    assert rows[0]["long_caption"] == "Long nine.\nMore."  # first ShareGPT4V record of the image
    ds = common.ManifestDataset(path, need_long=True)  # image paths resolve against the data root
    assert len(ds) == 2 and ds.image_file(ds.rows[0]).resolve() == (root / "coco/train2017/000000000009.jpg").resolve()
    everything = erclip.build_train_manifest(ann, sg, root / "erclip", n_pairs=10, holdout=1)
    assert [json.loads(line)["coco_id"] for line in everything.read_text().splitlines()] == [9, 25, 30]
    ann.unlink()  # cached: a second call does not read the sources again
    assert erclip.build_train_manifest(ann, sg, root / "erclip", n_pairs=2, holdout=1) == path
    with pytest.raises(DataError, match="captions_train2017.json"):
        erclip.build_train_manifest(ann, sg, root / "erclip", n_pairs=3, holdout=1)


def test_main_fails_clearly_without_real_data(tmp_path):
    with pytest.raises(DataError, match="captions_train2017.json not found"):
        erclip.main(["--train-data", "coco-sharegpt4v", "--data-root", str(tmp_path), "--out", str(tmp_path / "o")])
    with pytest.raises(DataError, match="urban1k"):
        evaluation.check_tasks(["urban1k"], tmp_path)


def test_paper_tables_layout():
    records = [{"task": t, "metric": m, "value": 50.0} for t in published.ERCLIP_LONG_SETS + ("coco",)
               for m in ("i2t_R@1", "t2i_R@1")]
    records += [{"task": t, "metric": "top1", "value": 60.0} for t in ("cifar10", "cifar100", "imagenet")]
    text = erclip.paper_tables([("CLIP", records, 0.0), ("M+P", records, 1.0)], published.vit_key("ViT-B/16"))
    assert "| paper M+P | B/16 | 68.60 | 75.70 |" in text and "| M+P (ours) | B/16 | 50.00 |" in text
    assert "| paper M+P | B/16 | yes | 65.23 | 68.38 | 61.36 |" in text
    assert "| M+P (ours) | B/16 | yes | 50.00 | 50.00 | 50.00 | 50.00 | 60.00 | 60.00 | 60.00 |" in text


# ----------------------------------------------------------------------------- end to end
def _run(tmp_path, *extra):
    return erclip.main(["--data-root", str(tmp_path / "data"), "--train-pairs", "16", "--batch-size", "8",
                        "--steps", "3", "--warmup", "1", "--lr", "1e-4", "--workers", "0", "--log-every", "1",
                        "--device", "cpu", *extra])


def test_main_end_to_end_on_the_synthetic_world(tmp_path, model_files_as_readme_says,
                                                results_files_are_strict_json):
    out = tmp_path / "run"
    small = str(lab.synthetic_manifest("train", tmp_path / "data", n=16))  # a 16-image retrieval set
    result = _run(tmp_path, "--fusion", "rt", "--max-sentences", "2", "--out", str(out), "--eval-tasks", small)
    summary = result["summary"]
    assert summary["steps"] == 3 and summary["sentences_dropped"] > 0 and summary["gamma"] != 0.0
    assert {r["task"] for r in result["tuned"]} == {small} and result["base"]
    initial = torch.load(lab.pretrain_tiny())
    tuned = torch.load(out / "model.pt")
    assert not torch.equal(initial["visual.conv1.weight"], tuned["visual.conv1.weight"])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # L_pres = mean(1 - cos) >= 0 up to float32 rounding (at step 1 the student IS the teacher)
    assert all(math.isfinite(m["loss_long"]) and m["loss_pres"] >= -1e-6 for m in metrics)
    ck = torch.load(out / "checkpoints" / "last.pt", weights_only=False)
    assert not any(k.startswith("teacher.") for k in ck["net"]) and any(k.startswith("fusion.") for k in ck["net"])
    saved = results_files_are_strict_json(out, "erclip")  # issue 42.3: one schema, strict JSON
    assert (out / "model.pt").exists() and saved["variant"] == "RT+P"
    assert {r["stage"] for r in saved["records"]} == {"base", "tuned"}
    model_files_as_readme_says("erclip", out)


def test_resume_rebuilds_the_teacher_and_matches_a_straight_run(tmp_path):
    common_args = ["--pretrained", "random", "--eval-tasks", "none", "--fusion", "rt"]
    _run(tmp_path, *common_args, "--out", str(tmp_path / "straight"))
    _run(tmp_path, *common_args, "--out", str(tmp_path / "resumed"), "--stop-at", "2")
    _run(tmp_path, *common_args, "--out", str(tmp_path / "resumed"), "--resume", "latest")
    a = torch.load(tmp_path / "straight" / "model.pt")
    b = torch.load(tmp_path / "resumed" / "model.pt")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


@pytest.mark.slow
def test_demo_writes_claims_results_and_figure(tmp_path, shrink_world, check_demo_results):
    """The demo's plumbing on a shrunken world (2 steps per run): every seed
    of every variant is kept, the claims carry the agreed keys, the PNG exists."""
    shrink_world({"train": 64, "test": 16, "zs-test": 24}.get)
    out = tmp_path / "demo"
    erclip.main(["--demo", "--seeds", "0,1", "--processes", "1", "--steps", "2", "--warmup", "1",
                 "--batch-size", "16", "--data-root", str(tmp_path / "data"), "--out", str(out)])
    saved = check_demo_results(out, "erclip-demo.png", ("M", "M+P", "RT+P", "RT+P own lr"), min_claims=8,
                               checks=erclip_demo.CHECK_ONLY)
    verdicts = {c["claim"]: c["verdict"] for c in saved["claims"]}
    assert verdicts["RT+P about equal to M+P on long R@1 (RT+P - M+P; within the registry's margin)"] == \
        "by construction"
    # issue 70: every margin from the claims registry with its source; the truncated long-R@1 claim gated by the
    # committed val check at three pilot seeds outside every seed set (not met: shares 0.09, 0.15, 0.23, all
    # below 1/3 by more than 2 se), its verdict without the gate kept beside
    gate = calibrate.record("erclip-gates")
    assert len(gate["pilots"]) == 3 and not {int(s) for s in gate["pilots"]} & {*lab.SEEDS, *range(10, 15),
                                                                                 *range(30, 35)}
    long_claim = saved["claims"][0]
    assert long_claim["gate"]["met"] is False and long_claim["verdict"] == "outside the lab's regime"
    assert "ungated" in long_claim and long_claim["gate"]["se"] > 0
    assert all(c["margin_source"]["rule"] for c in saved["claims"] if c["direction"] in "+-=")  # 2 steps: may be 0
    assert saved["registry"]["sha256"] == registry.sha256("erclip")
    assert any("below M+P on zero-shot" in c for c in verdicts)  # the fusion alone, not against M
    assert all("long sent" in r for runs in saved["per_seed"].values() for r in runs)
    cards = {n: json.loads((out / f"{n}-seed0" / "config.json").read_text()) for n in ("RTP", "RTP-own-lr")}
    assert cards["RTP"]["fusion_lr"] == 0.0 and cards["RTP-own-lr"]["fusion_lr"] == erclip_demo.DEMO_FUSION_LR > 0


def test_own_evaluation_tasks_print_their_own_numbers(tmp_path, capsys):
    """Issue 42.3: with the user's own training manifest and --eval-tasks, erclip printed the paper's Tables 1-2
    with empty cells and never the user's numbers; now its own table (R@1/5/10 both ways, top-1), before and
    after fine-tuning."""
    train = lab.synthetic_manifest("train", tmp_path / "data", n=16)  # a manifest path, not the lab's name
    small = str(lab.synthetic_manifest("test", tmp_path / "data", n=12))
    result = _run(tmp_path, "--train-data", str(train), "--out", str(tmp_path / "run"), "--eval-tasks", small)
    shown = capsys.readouterr().out
    assert "Table 1" not in shown and "i2t_R@10" in shown and "t2i_R@5" in shown
    assert shown.count(f"| {small} |") == 2 and {r["task"] for r in result["tuned"]} == {small}
