"""eval.py: every loader on a fixture written in the benchmark's real layout,
missing-data errors, text modes, geometry / ECE / SIMAT by hand, WiSE-FT
endpoints, continual matrices, and end-to-end runs of main()."""
import json
import os
import math
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import common
from plumbing.base import DataError
import lab
import eval as ev
from plumbing import models, published
from protocols import m2mix_analysis, wise_ft


# ---------------------------------------------------------------- fixtures
def png(path, color=(200, 30, 30), size=8):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (size, size), color).save(path)
    return path


def write_json(path, obj):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))
    return path


def make_coco(root):
    """val2017: images 1, 2, 3 with 5, 6, 7 captions; image 4 listed but absent."""
    images = [{"id": i, "file_name": f"{i:012d}.jpg"} for i in (3, 1, 2, 4)]
    for i in (1, 2, 3):
        png(root / f"coco/val2017/{i:012d}.jpg", (40 * i, 10, 10))
    anns, k = [], 0
    for i, n in ((1, 5), (2, 6), (3, 7), (4, 5)):
        for j in range(n):
            k += 1
            anns.append({"id": k, "image_id": i, "caption": f" image {i}\ncaption {j} "})
    write_json(root / "coco/annotations/captions_val2017.json", {"images": images, "annotations": anns})


def make_karpathy(root):
    coco = {"dataset": "coco", "images": [
        {"filepath": "val2014", "filename": f"COCO_val2014_{i}.jpg", "split": s,
         "sentences": [{"raw": f"coco {i} s{j}"} for j in range(5)]}
        for i, s in ((1, "test"), (2, "train"), (3, "test"), (4, "restval"))]}
    write_json(root / "coco/dataset_coco.json", coco)
    for i in (1, 3):
        png(root / f"coco/val2014/COCO_val2014_{i}.jpg")
    flickr = {"dataset": "flickr30k", "images": [
        {"filename": f"{i}.jpg", "split": s, "sentences": [{"raw": f"flickr {i} s{j}"} for j in range(5)]}
        for i, s in ((10, "test"), (11, "val"), (12, "test"), (13, "test"))]}
    write_json(root / "flickr30k/dataset_flickr30k.json", flickr)
    for i in (10, 12, 13):
        png(root / f"flickr30k/images/{i}.jpg")


def make_urban(root):
    for k in (1, 2, 10):
        png(root / f"Urban1k/image/{k}.jpg")
        (root / "Urban1k/caption").mkdir(parents=True, exist_ok=True)
        (root / f"Urban1k/caption/{k}.txt").write_text(f"urban scene {k}. It is long.\nsecond line ignored\n")


def make_sharegpt(root, n=1005):
    """More than 1,000 records pointing at 3 images (COCO and SAM paths)."""
    imgs = ["coco/train2017/000000000009.jpg", "sam/images/sa_1.jpg", "coco/train2017/000000000025.jpg"]
    for p in imgs:
        png(root / p)
    recs = [{"id": str(i), "image": imgs[i % 3],
             "conversations": [{"from": "human", "value": "<image>\nDescribe."},
                               {"from": "gpt", "value": f"Record {i}.\nA long\n\ndescription."}]}
            for i in range(n)]
    path = root / "sharegpt4v/share-captioner_coco_lcs_sam_1246k_1107.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(recs, indent=1))
    return path, recs


def make_docci(root):
    rows = [{"example_id": f"{s}_{i}", "split": s, "image_file": f"{s}_{i}.jpg", "description": f"{s} {i} desc."}
            for s, k in (("train", 3), ("test", 4), ("qual_dev", 2), ("qual_test", 2)) for i in range(k)]
    for r in rows:
        png(root / "docci/images" / r["image_file"])
    (root / "docci").mkdir(parents=True, exist_ok=True)
    (root / "docci/docci_descriptions.jsonlines").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def make_dci(root):
    base = root / "dci/densely_captioned_images"
    for i, extra in enumerate(["a long extra caption.", "", "another extra one."]):
        write_json(base / f"annotations/sa_{i}.json", {"image": f"sa_{i}.jpg", "short_caption": f"short {i}",
                                                       "extra_caption": extra, "mask_data": {}})
        png(base / f"photos/sa_{i}.jpg")


def make_cifar(root, n_classes):
    rng = np.random.default_rng(0)
    labels = [0, 1, 2, 1]
    if n_classes == 10:
        folder, test, meta = root / "cifar10/cifar-10-batches-py", "test_batch", "batches.meta"
        meta_obj = {"label_names": ["airplane", "automobile", "bird"] + [f"c{i}" for i in range(7)]}
        batch = {"data": rng.integers(0, 255, (4, 3072), dtype=np.uint8), "labels": labels}
    else:
        folder, test, meta = root / "cifar100/cifar-100-python", "test", "meta"
        meta_obj = {"fine_label_names": ["apple", "aquarium_fish", "maple_tree"] + [f"c{i}" for i in range(97)]}
        batch = {"data": rng.integers(0, 255, (4, 3072), dtype=np.uint8), "fine_labels": labels}
    folder.mkdir(parents=True)
    (folder / test).write_bytes(pickle.dumps(batch))
    (folder / meta).write_bytes(pickle.dumps(meta_obj))
    return batch


# ---------------------------------------------------------------- loaders
def test_coco_first_five_all_captions_and_first_caption(tmp_path, capsys):
    make_coco(tmp_path)
    rs = ev.load_retrieval("coco", tmp_path)  # E1: the first 5 captions per image, as Long-CLIP's coco.py
    assert rs.missing == 1  # image 4 is listed but absent: counted, its 5 captions dropped
    assert [Path(p).name for p in rs.image_paths] == [f"{i:012d}.jpg" for i in (1, 2, 3)]  # sorted by id
    assert len(rs.texts) == 15 and torch.bincount(rs.text_to_image).tolist() == [5, 5, 5]
    assert rs.texts[:6] == [f"image 1 caption {j}" for j in range(5)] + ["image 2 caption 0"]  # file order
    assert "image 3 caption 5" not in rs.texts and "first 5 captions" in rs.protocol
    assert rs.texts[0] == "image 1 caption 0"  # whitespace and newlines normalised
    assert "1 of 4 images not found" in capsys.readouterr().err
    every = ev.load_retrieval("coco-all", tmp_path)
    assert len(every.texts) == 18 and torch.bincount(every.text_to_image).tolist() == [5, 6, 7]
    assert "all captions" in every.protocol and every.texts[-1] == "image 3 caption 6"
    one = ev.load_retrieval("coco-1cap", tmp_path)
    assert one.texts == ["image 1 caption 0", "image 2 caption 0", "image 3 caption 0"]
    assert one.text_to_image.tolist() == [0, 1, 2]
    with pytest.raises(ev.MissingData, match="1 of 4 images not found"):
        ev.load_retrieval("coco", tmp_path, strict=True)


def test_karpathy_test_splits(tmp_path):
    make_karpathy(tmp_path)
    c = ev.load_retrieval("coco-karpathy", tmp_path)
    assert [Path(p).name for p in c.image_paths] == ["COCO_val2014_1.jpg", "COCO_val2014_3.jpg"]
    assert Path(c.image_paths[0]).parent == tmp_path / "coco/val2014"
    assert len(c.texts) == 10 and c.missing == 0
    f = ev.load_retrieval("flickr30k", tmp_path)
    assert len(f.image_paths) == 3 and len(f.texts) == 15 and f.texts[5] == "flickr 12 s0"
    f1 = ev.load_retrieval("flickr30k-1cap", tmp_path)
    assert f1.texts == ["flickr 10 s0", "flickr 12 s0", "flickr 13 s0"]


def test_urban_first_line_breaks_at_newlines_only(tmp_path):
    """E2: Long-CLIP's Urban1k.py reads readlines()[0]; splitlines() would cut
    at a form feed, \\x85 or \\u2028 inside the caption."""
    make_urban(tmp_path)
    (tmp_path / "Urban1k/caption/2.txt").write_text("Form\x0cfeed and\u2028more\x85words.\nsecond line\n",
                                                   encoding="utf-8")
    (tmp_path / "Urban1k/caption/10.txt").write_bytes(b"windows line\r\nsecond\r\n")
    u = ev.load_retrieval("urban1k", tmp_path)
    assert u.texts[1] == "Form\x0cfeed and\u2028more\x85words."
    assert u.texts[2] == "windows line"


def test_urban_docci_dci(tmp_path):
    make_urban(tmp_path)
    make_docci(tmp_path)
    make_dci(tmp_path)
    u = ev.load_retrieval("urban1k", tmp_path)
    assert [Path(p).name for p in u.image_paths] == ["1.jpg", "2.jpg", "10.jpg"]  # numeric order
    assert u.texts[2] == "urban scene 10. It is long."  # first line only
    d = ev.load_retrieval("docci", tmp_path)
    assert d.texts == [f"test {i} desc." for i in range(4)] and d.text_to_image.tolist() == [0, 1, 2, 3]
    ld = ev.load_retrieval("long-dci", tmp_path)
    assert ld.texts == ["a long extra caption.", "another extra one."]  # empty extra_caption skipped
    assert [Path(p).name for p in ld.image_paths] == ["sa_0.jpg", "sa_2.jpg"]
    assert ev.load_retrieval("dci", tmp_path).texts == ["short 0", "short 1", "short 2"]


def test_sharegpt4v_first_1000(tmp_path):
    path, recs = make_sharegpt(tmp_path)
    rs = ev.load_retrieval("sharegpt4v-1k", tmp_path)
    assert len(rs.texts) == 1000 and len(rs.image_paths) == 1000 and rs.missing == 0
    assert rs.texts[999] == "Record 999. A long description."
    assert rs.image_paths[1] == str(tmp_path / "sam/images/sa_1.jpg")
    # the incremental reader agrees with json.load whatever the chunk size
    assert ev._first_json_records(path, 7, chunk=50) == recs[:7]
    assert len(ev._first_json_records(path, 5000, chunk=4096)) == 1005


def test_manifest_with_column_and_missing_image(tmp_path):
    png(tmp_path / "m/a.png")
    png(tmp_path / "m/b.png")
    rows = [{"image": "a.png", "caption": "a", "long_caption": "A. Long."},
            {"image": "b.png", "caption": "b", "long_caption": "B. Long."},
            {"image": "a.png", "caption": "a2", "long_caption": "A2."},
            {"image": "gone.png", "caption": "c", "long_caption": "C."}]
    (tmp_path / "m/x.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    rs = ev.load_retrieval(str(tmp_path / "m/x.jsonl"), tmp_path)
    assert rs.texts == ["a", "b", "a2"] and rs.text_to_image.tolist() == [0, 1, 0] and rs.missing == 1
    assert ev.load_retrieval(str(tmp_path / "m/x.jsonl") + "#long_caption", tmp_path).texts[0] == "A. Long."


def test_flickr30k_full_is_long_clips_whole_release(tmp_path):
    """Issue 25.13: 'flickr30k-full' = Long-CLIP's flickr30k.py, every image of results_20130124.token with its
    five captions (image i's are lines 5i..5i+4), beside Karpathy's 1k test ('flickr30k'); protocol recorded."""
    lines = [f"{i}.jpg#{k}\tcaption {i}.{k} \n" for i in (7, 3, 9) for k in range(5)]
    (tmp_path / "flickr30k").mkdir()
    (tmp_path / "flickr30k/results_20130124.token").write_text("".join(lines))
    for i in (7, 3, 9):
        png(tmp_path / f"flickr30k/images/{i}.jpg")
    rs = ev.load_retrieval("flickr30k-full", tmp_path)
    assert [Path(p).name for p in rs.image_paths] == ["7.jpg", "3.jpg", "9.jpg"] and len(rs.texts) == 15
    assert rs.texts[6] == "caption 3.1" and rs.text_to_image.tolist() == [i // 5 for i in range(15)]
    assert "Long-CLIP" in rs.protocol and "3 images, 15 captions" in rs.protocol
    with pytest.raises(ev.MissingData, match="results_20130124.token"):
        ev.load_retrieval("flickr30k-full", tmp_path / "nowhere")


def test_cifar_imagenet_imagefolder(tmp_path):
    b10 = make_cifar(tmp_path, 10)
    make_cifar(tmp_path, 100)
    c10 = ev.load_classification("cifar10", tmp_path)
    assert c10.labels.tolist() == [0, 1, 2, 1] and c10.classnames[:2] == ["airplane", "automobile"]
    assert len(c10.templates) == 18 and c10.templates[0] == "a photo of a {}."
    im = c10.image_paths[1]
    assert im.size == (32, 32) and np.array_equal(np.asarray(im)[..., 0].ravel(), b10["data"][1][:1024])
    c100 = ev.load_classification("cifar100", tmp_path)
    assert c100.classnames[1:3] == ["aquarium fish", "maple tree"] and len(c100.classnames) == 100
    # Long-CLIP's CIFAR protocol (issue 25.8): the 80 ImageNet templates, torchvision's raw class names
    long100 = ev.load_classification("cifar100-longclip", tmp_path)
    assert long100.classnames[1:3] == ["aquarium_fish", "maple_tree"] and long100.templates == ev.imagenet_templates()
    assert len(long100.templates) == 80 and long100.name == "cifar100-longclip" and "Long-CLIP" in long100.protocol
    assert ev.load_classification("cifar10-longclip", tmp_path).labels.tolist() == c10.labels.tolist()
    # ImageNet: sorted wnid folders align with open_clip's class names
    wnids = [f"n{i:08d}" for i in range(1000)]
    for w in wnids:
        (tmp_path / "imagenet/val" / w).mkdir(parents=True)
    png(tmp_path / f"imagenet/val/{wnids[0]}/a.JPEG")
    png(tmp_path / f"imagenet/val/{wnids[999]}/b.JPEG")
    inet = ev.load_classification("imagenet", tmp_path)
    assert inet.labels.tolist() == [0, 999] and len(inet.templates) == 80 and len(inet.classnames) == 1000
    assert inet.templates[0] == "a bad photo of a {}."
    (tmp_path / "imagenet/val" / wnids[5]).rmdir()
    with pytest.raises(ev.MissingData, match="999 class folders"):
        ev.load_classification("imagenet", tmp_path)
    png(tmp_path / "folder/red_apple/1.png")
    png(tmp_path / "folder/pear/2.jpg")
    f = ev.load_classification(f"imagefolder:{tmp_path / 'folder'}", tmp_path)
    assert f.classnames == ["pear", "red apple"] and f.labels.tolist() == [0, 1]


@pytest.mark.parametrize("task,expected", [
    ("coco", "coco/annotations/captions_val2017.json"), ("coco-karpathy", "coco/dataset_coco.json"),
    ("flickr30k", "flickr30k/dataset_flickr30k.json"), ("urban1k", "Urban1k/caption"),
    ("sharegpt4v-1k", "sharegpt4v/share-captioner_coco_lcs_sam_1246k_1107.json"),
    ("docci", "docci/docci_descriptions.jsonlines"), ("long-dci", "dci/densely_captioned_images/annotations"),
    ("cifar10", "cifar10/cifar-10-batches-py/test_batch"), ("cifar100", "cifar100/cifar-100-python/test"),
    ("imagenet", "imagenet/val")])
def test_missing_benchmark_names_expected_path_and_source(tmp_path, task, expected):
    load = ev.load_classification if ev.is_classification(task) else ev.load_retrieval
    with pytest.raises(ev.MissingData) as e:
        load(task, tmp_path)
    msg = str(e.value)
    assert str(tmp_path / expected) in msg and "Get it from http" in msg


def test_all_images_missing_is_an_error(tmp_path):
    make_docci(tmp_path)
    for p in (tmp_path / "docci/images").iterdir():
        p.unlink()
    with pytest.raises(ev.MissingData, match="4 of 4 images not found"):
        ev.load_retrieval("docci", tmp_path)


# ---------------------------------------------------------------- text modes
def _erclip_or_skip():
    try:
        import erclip  # noqa: F401
    except ImportError:
        pytest.skip("erclip.py (split_sentences) not written yet")
    return erclip


def test_sentence_mean_equals_truncate_on_one_sentence(tiny_random):
    _erclip_or_skip()
    model, _, _, tok = tiny_random
    texts = ["a photo of a red circle.", "a dark picture of a blue square."]
    a = ev.text_features(model, tok, texts, "truncate")
    b = ev.text_features(model, tok, texts, "sentence-mean")
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_sentence_mean_is_normalised_mean_of_sentences(tiny_random):
    erclip = _erclip_or_skip()
    model, _, _, tok = tiny_random
    text = "There is a red circle at the top. There is a blue square at the left. The picture has 2 objects."
    sents = erclip.split_sentences(text)
    assert len(sents) == 3
    per = ev.text_features(model, tok, sents, "truncate")
    expected = F.normalize(per.mean(0, keepdim=True), dim=-1)
    torch.testing.assert_close(ev.text_features(model, tok, [text], "sentence-mean"), expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        ev.text_features(model, tok, [text], "nope")


# ---------------------------------------------------------------- geometry, ECE, SIMAT
def test_geometry_by_hand():
    e = torch.eye(3)  # v_i = t_i = e_i: positives at distance 0, every negative at ||e_i - e_k||^2 = 2
    g = m2mix_analysis.geometry(e, e.clone())
    assert g["align"] == pytest.approx(2.0)  # -(0 - 2)
    assert g["unif"] == pytest.approx(-math.log((3 + 6 * math.exp(-4)) / 9))  # 3 pairs at d=0, 6 at d=2
    assert g["wi_align"] == pytest.approx(0.0)
    assert g["wi_unif_img"] == pytest.approx(-4.0) and g["wi_unif_txt"] == pytest.approx(-4.0)
    assert g["gap"] == pytest.approx(0.0, abs=1e-7)


def test_geometry_matches_loop_and_chunks():
    g = torch.Generator().manual_seed(0)
    img = F.normalize(torch.randn(7, 5, generator=g), dim=-1)
    txt = F.normalize(torch.randn(7, 5, generator=g), dim=-1)
    d = lambda a, b: float((a - b).square().sum())  # noqa: E731
    n = len(img)
    align = -np.mean([d(img[i], txt[i]) - min(d(img[i], txt[k]) for k in range(n) if k != i) for i in range(n)])
    unif = -math.log(np.mean([math.exp(-2 * d(img[i], txt[j])) for i in range(n) for j in range(n)]))
    wi_img = math.log(np.mean([math.exp(-2 * d(img[i], img[j])) for i in range(n) for j in range(n) if i != j]))
    for chunk in (2, 1024):
        out = m2mix_analysis.geometry(img, txt, chunk=chunk)
        assert out["align"] == pytest.approx(align, abs=1e-5) and out["unif"] == pytest.approx(unif, abs=1e-5)
        assert out["wi_unif_img"] == pytest.approx(wi_img, abs=1e-5)


def test_released_code_geometry_matches_its_formulas():
    """E3, E4: the m2-Mix code's align (anchored on texts, not negated) and
    unif (log mean exp(-2 d^2) over the pairs of the images duplicated), from
    loops and torch.pdist, against the chunked closed form."""
    g = torch.Generator().manual_seed(3)
    img = F.normalize(torch.randn(7, 5, generator=g), dim=-1)
    txt = F.normalize(torch.randn(7, 5, generator=g), dim=-1)
    d = lambda a, b: float((a - b).square().sum())  # noqa: E731
    n = len(img)
    align = np.mean([d(txt[i], img[i]) - min(d(txt[i], img[k]) for k in range(n) if k != i) for i in range(n)])
    x = torch.cat([img, img]).double()
    unif = math.log(torch.pdist(x).pow(2).mul(-2).exp().mean().item())
    for chunk in (3, 1024):
        out = m2mix_analysis.released_code_geometry(img, txt, chunk=chunk)
        assert out["align_code"] == pytest.approx(align, abs=1e-5)
        assert out["unif_code"] == pytest.approx(unif, abs=1e-5)
    ours = m2mix_analysis.geometry(img, txt)
    assert ours["align"] != pytest.approx(-out["align_code"], abs=1e-3)  # anchored differently, not a sign flip


def test_ece_by_hand_and_against_loop():
    e = torch.eye(2)
    # scale ln 3: each query's softmax over sims (1, 0) is (0.75, 0.25); all correct -> ECE = |1 - 0.75| = 25%
    assert m2mix_analysis.ece(e, e, [0, 1], math.log(3), direction="i2t") == pytest.approx(25.0)
    assert m2mix_analysis.ece(e, e.flip(0), [0, 1], math.log(3), direction="t2i") == pytest.approx(75.0)  # all wrong
    g = torch.Generator().manual_seed(1)
    img = F.normalize(torch.randn(6, 4, generator=g), dim=-1)
    txt = F.normalize(torch.randn(10, 4, generator=g), dim=-1)
    t2i = torch.tensor([0, 0, 1, 2, 3, 3, 4, 5, 5, 5])
    for direction in ("i2t", "t2i"):
        q, c = (img, txt) if direction == "i2t" else (txt, img)
        conf, acc = [], []
        for i in range(len(q)):  # per-query loop from the definition
            p = torch.softmax(5.0 * c @ q[i], 0)
            top = int(p.argmax())
            conf.append(float(p.max()))
            acc.append(float(t2i[top] == i) if direction == "i2t" else float(top == t2i[i]))
        bins = [min(int(x * 15), 14) for x in conf]
        ref = sum(abs(sum(a for a, bb in zip(acc, bins) if bb == b) - sum(x for x, bb in zip(conf, bins) if bb == b))
                  for b in range(15)) / len(q)
        assert m2mix_analysis.ece(img, txt, t2i, 5.0, 15, direction) == pytest.approx(100 * ref, abs=1e-4)
    curve = m2mix_analysis.ece_curve(img, txt, t2i, taus=(0.01, 0.2))
    assert list(curve) == [0.01, 0.2] and curve[0.2] == pytest.approx(m2mix_analysis.ece(img, txt, t2i, 5.0))


def test_simat_score_by_hand():
    img = torch.eye(3)
    oscar = torch.tensor([[0.0, 0.0], [0.9, 0.1], [0.2, 0.8]])  # image x target caption
    # q0: from image 0, delta e2 - e1 -> image 1, target caption 0: hit.
    # q1: from image 1 with delta 0: x = the source itself, which must be skipped;
    #     the tie between images 0 and 2 goes to image 0 -> oscar[0, 1] = 0: miss.
    src = torch.tensor([0, 1])
    value = torch.stack([img[0], img[1]])
    target = torch.stack([img[1], img[1]])
    out = m2mix_analysis.simat_score(img, src, value, target, [0, 1], oscar, [1.0, 3.0], lambdas=(1.0,))
    assert out == {1.0: pytest.approx(25.0)}  # weights normalised to (0.25, 0.75)


def test_simat_on_release_layout(tmp_path, tiny_random):
    model, _, pre, tok = tiny_random
    db = tmp_path / "simat/simat_db"
    trip = [(11, "dog", "on", "grass"), (12, "cat", "on", "grass"), (13, "dog", "on", "bed")]
    (db).mkdir(parents=True)
    (db / "triplets.csv").write_text("region_id,subj,rel,obj\n" + "".join(f"{r},{s},{v},{o}\n" for r, s, v, o in trip))
    for i, (r, s, v, o) in enumerate(trip):
        png(db / f"images/A {s} {v} {o}/{r}.jpg", (80 * i, 50, 50))
    (db / "transfos.csv").write_text(",transfo_id,region_id,field,value,target,norm,query_ids,target_ids,"
                                     "dataset_id,norm2,is_test\n0,0,11,subj,dog,cat,1,0,1,0,4,True\n"
                                     "1,1,11,obj,grass,bed,1,0,2,0,9,True\n2,2,12,subj,cat,dog,1,1,0,1,4,False\n")
    torch.save(torch.eye(3), db / "oscar_similarity_matrix.pt")
    out = ev.simat(model, pre, tok, tmp_path, lambdas=(0.5, 1.0))
    assert out["queries"] == 2 and set(out) >= {"simat", "simat_best_lambda", "simat@lambda=0.5"}
    assert 0.0 <= out["simat"] <= 100.0 and out["simat"] == max(out["simat@lambda=0.5"], out["simat@lambda=1"])
    # E5: ours = the test rows over 0.5, 1, ..., 7; the m2-Mix code's = the dev rows over 13 lambdas (no 6.5)
    for protocol, n, n_lambdas in (("ours", 2, 14), ("code", 1, 13)):
        recs = ev.evaluate(model, pre, tok, ["simat"], tmp_path, simat_protocol=protocol)
        lambdas = {r["metric"] for r in recs if r["metric"].startswith("simat@")}
        assert len(lambdas) == n_lambdas and all(r["n"] == n for r in recs)
        assert ("simat@lambda=6.5" in lambdas) == (protocol == "ours") and "simat@lambda=7" in lambdas
        assert ("dev split" in recs[0]["protocol"]) == (protocol == "code")
    with pytest.raises(ValueError):
        ev.simat(model, pre, tok, tmp_path, split="val")


# ---------------------------------------------------------------- WiSE-FT
def test_wise_ft_endpoints_and_checks(tmp_path, tiny_random):
    import copy
    m0, _, _, tok = tiny_random
    m1 = copy.deepcopy(m0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in m1.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    theta0 = {k: v.clone() for k, v in m0.state_dict().items()}
    theta1 = {k: v.clone() for k, v in m1.state_dict().items()}
    tokens = tok(["a photo of a red circle."])
    x = torch.rand(1, 3, lab.IMAGE_SIZE, lab.IMAGE_SIZE)
    feats = lambda m: (m.encode_image(x), m.encode_text(tokens))  # noqa: E731
    with torch.no_grad():
        ref0, ref1 = feats(m0), feats(m1)
        curve = wise_ft.wise_ft(m0, theta0, theta1, [0.0, 0.5, 1.0], lambda m: feats(m))
    for got, ref in ((curve[0]["records"], ref0), (curve[2]["records"], ref1)):
        for a, b in zip(got, ref):
            assert torch.equal(a, b)
    assert not torch.allclose(curve[1]["records"][0], ref0[0])
    assert all(torch.equal(m0.state_dict()[k], theta0[k]) for k in theta0)  # weights restored
    mid = wise_ft.interpolate_weights(theta0, theta1, 0.5)
    k = "visual.conv1.weight"
    torch.testing.assert_close(mid[k], (theta0[k] + theta1[k]) / 2)
    with pytest.raises(ValueError, match="differ in keys"):
        wise_ft.interpolate_weights(theta0, {kk: v for kk, v in theta1.items() if kk != k}, 0.5)
    with pytest.raises(ValueError, match="shape"):
        wise_ft.interpolate_weights(theta0, {**theta1, k: theta1[k][:1]}, 0.5)
    # state_dicts from a saved model and from a training checkpoint ({'net': {'model.*': ...}})
    models.save_model(m1, tmp_path / "m.pt", "tiny")
    torch.save({"net": {f"model.{kk}": v for kk, v in theta1.items()} | {"teacher.x": torch.zeros(1)}},
               tmp_path / "last.pt")
    for f in ("m.pt", "last.pt"):
        sd = wise_ft.load_state_dict(tmp_path / f)
        assert set(sd) == set(theta1) and all(torch.equal(sd[kk], theta1[kk]) for kk in sd)


# ---------------------------------------------------------------- continual
def test_continual_matrix_metrics_and_pd():
    # rows: pretrained, after task 1, after task 2; columns: tasks A, B; zero-shot 'zs' drops 60 -> 50
    R = [[10.0, 20.0], [50.0, 25.0], [40.0, 70.0]]
    zs = [60.0, 55.0, 50.0]
    rows = []
    for row, z in zip(R, zs):
        recs = [{"task": t, "metric": "i2t_R@1", "value": v, "text_mode": "truncate"} for t, v in zip("AB", row)]
        recs += [{"task": t, "metric": "t2i_R@1", "value": v + 1, "text_mode": "truncate"} for t, v in zip("AB", row)]
        recs.append({"task": "zs", "metric": "top1", "value": z, "text_mode": "prompt-ensemble"})
        rows.append(ev.continual_row(recs, ["A", "B"], zero_shot=("zs",)))
    assert rows[1] == {"per_task": {"i2t_R@1": [50.0, 25.0], "t2i_R@1": [51.0, 26.0]}, "scalars": {"zs/top1": 55.0}}
    s = ev.continual_summary(rows)
    assert s["matrices"]["i2t_R@1"] == R
    m = s["metrics"]["i2t_R@1"]
    assert m["last"] == pytest.approx(55.0)  # (40 + 70) / 2
    assert m["avg"] == pytest.approx((50 + (40 + 70) / 2) / 2)
    assert m["bwt"] == pytest.approx(40 - 50)
    assert m["forgetting"] == pytest.approx(50 - 40)  # max over rows 0..1 of task A, minus the last
    assert s["pd"] == {"zs/top1": pytest.approx(10.0)}
    table = ev.continual_tables(s, ["A", "B"])
    assert "R[i][j], i2t_R@1" in table and "| task 2 | 40.0 | 70.0 |" in table and "zs/top1" in table


def test_evaluate_checkpoints_sequence(tmp_path, tiny_random):
    import copy
    m = copy.deepcopy(tiny_random[0])
    cks = []
    for i in range(3):  # three different weights: the model nudged between 'tasks'
        with torch.no_grad():
            m.text_projection.add_(0.1 * torch.randn(m.text_projection.shape,
                                                     generator=torch.Generator().manual_seed(i)))
        cks.append(str(models.save_model(m, tmp_path / f"ck{i}.pt", "tiny")))
    tasks = ["synthetic-task-photo", "synthetic-task-night"]
    s = ev.evaluate_checkpoints("tiny", cks, tasks, ("synthetic-shape",), tmp_path, synthetic_n=8, batch_size=8)
    assert np.array(s["matrices"]["i2t_R@1"]).shape == (3, 2)
    assert set(s["metrics"]) == {"i2t_R@1", "t2i_R@1"} and "synthetic-shape/top1" in s["pd"]
    assert {r["row"] for r in s["records"]} == {0, 1, 2}
    with pytest.raises(ValueError, match="need 3 checkpoints"):
        ev.evaluate_checkpoints("tiny", cks[:2], tasks)


# ---------------------------------------------------------------- evaluate / tables / cache
def test_evaluate_real_layout_fixtures(tmp_path, tiny_random):
    model, _, pre, tok = tiny_random
    make_coco(tmp_path)
    make_urban(tmp_path)
    make_cifar(tmp_path, 10)
    recs = ev.evaluate(model, pre, tok, ["coco", "urban1k", "cifar10"], tmp_path, analyses=("geometry", "ece"),
                       model_name="tiny", weights="random")
    by = {(r["task"], r["metric"]): r for r in recs}
    assert by[("coco", "i2t_R@1")]["missing"] == 1 and by[("coco", "i2t_R@1")]["n"] == 15  # first 5 per image
    assert by[("urban1k", "t2i_R@10")]["value"] == 100.0  # 3 candidates
    assert 0 <= by[("cifar10", "top1")]["value"] <= 100 and by[("cifar10", "top1")]["text_mode"] == "prompt-ensemble"
    assert {"align", "unif", "align_code", "unif_code", "ece_i2t", "ece_t2i_min", "gap"} <= {
        m for t, m in by if t == "coco"}
    assert all(set(r) >= {"task", "metric", "value", "protocol", "text_mode", "missing", "model", "weights"}
               for r in recs)
    table = ev.results_table(recs, published={("coco", "i2t_R@1"): 51.72})
    assert "i2t_R@1 (paper)" in table and "51.7" in table and "missing" in table.splitlines()[0]
    assert "align" in ev.analysis_table(recs)


def test_classifier_cache(tmp_path, tiny_random):
    model, _, _, tok = tiny_random
    ev._CLASSIFIER_CACHE.clear()
    a = ev.zero_shot_head(model, tok, ["cat", "dog"], ["a {}."], cache_dir=tmp_path)
    assert ev.zero_shot_head(model, tok, ["cat", "dog"], ["a {}."], cache_dir=tmp_path) is a
    assert len(list(tmp_path.glob("classifier-*.pt"))) == 1
    ev._CLASSIFIER_CACHE.clear()
    torch.testing.assert_close(ev.zero_shot_head(model, tok, ["cat", "dog"], ["a {}."], cache_dir=tmp_path), a)
    torch.testing.assert_close(a, common.zero_shot_classifier(model, tok, ["cat", "dog"], ["a {}."]))
    with torch.no_grad():
        model.token_embedding.weight[0, 0] += 1.0  # new text weights -> a new classifier
        try:
            assert ev.zero_shot_head(model, tok, ["cat", "dog"], ["a {}."]) is not a
        finally:
            model.token_embedding.weight[0, 0] -= 1.0


def test_published_numbers_spellings():
    assert ev.published_numbers("erclip", "ViT-B-16")[("imagenet", "top1")] == 68.35
    assert ev.published_numbers("erclip", "ViT-B/16") == ev.published_numbers("erclip", "ViT-B-16")
    assert ev.published_numbers("cclip", "tiny") == {}
    with pytest.raises(ValueError):
        ev.published_numbers("nope", "ViT-B/16")


def test_published_clip_rows_come_from_the_paper_tables():
    """One home: the CLIP baselines are read off the papers' tables in eval.py."""
    b32 = ev.published_numbers("erclip", "ViT-B/32")
    assert b32[("urban1k", "i2t_R@1")] == 61.20 and b32[("long-dci", "t2i_R@1")] == 30.60  # Table 1, row CLIP
    assert b32[("coco", "t2i_R@1")] == 30.37 and b32[("cifar100", "top1")] == 64.31  # Table 2, row CLIP
    assert len(b32) == 13 and set(published.PUBLISHED["erclip"]) == {"ViT-B/32", "ViT-B/16", "ViT-L/14"}
    m2 = ev.published_numbers("m2mix", "ViT-B/32")
    assert m2[("coco-1cap", "t2i_R@5")] == published.M2MIX_TABLE1["coco-1cap"]["ZS"]["t2i_R@5"] == 53.12
    assert m2[("simat", "simat")] == 34.4


def test_help_lists_every_task(capsys):
    with pytest.raises(SystemExit):
        ev.main(["--help"])
    out = capsys.readouterr().out
    for t in [*ev.REAL_RETRIEVAL_TASKS, *ev.CLASSIFICATION_TASKS, "simat", "imagefolder:", "synthetic-*"]:
        assert t.startswith("synthetic-") and t != "synthetic-*" or t in out, t  # the lab's: by pattern


def test_main_end_to_end_synthetic(tmp_path, results_files_are_strict_json):
    """The pretrained tiny backbone on the synthetic world: table + results.json."""
    out = tmp_path / "out"
    recs = ev.main(["--backbone", "tiny", "--tasks", "synthetic-short,synthetic-long,synthetic-color",
                    "--synthetic-n", "48", "--data-root", str(tmp_path), "--out", str(out),
                    "--analyses", "geometry,ece", "--cache-dir", str(tmp_path / "cache")], world=lab.WORLD)
    res = results_files_are_strict_json(out, "eval")  # issue 42.3: one schema, strict JSON
    assert res["records"] == json.loads(json.dumps(recs)) and {r["stage"] for r in recs} == {"eval"}
    by = {(r["task"], r["metric"]): r["value"] for r in recs}
    chance = 100 / 48
    assert by[("synthetic-short", "i2t_R@1")] > 5 * chance  # pretrained on short captions
    assert by[("synthetic-short", "t2i_R@1")] > 5 * chance
    assert by[("synthetic-color", "top1")] > 100 / 6 + 20  # 6 colours
    assert {"align", "ece_i2t", "ece_t2i_best_tau"} <= {m for t, m in by}
    assert all(r["weights"] == "default" and r["model"] == "tiny" for r in recs)


def test_undecodable_images_are_dropped_counted_and_listed(tmp_path, capsys):
    """A truncated JPEG passes PIL's verify(); the loaders decode it in full,
    drop it like a missing image (--strict refuses) and list it."""
    for i in range(3):
        png(tmp_path / f"{i}.png", color=(40 * i, 0, 0))
    g = torch.Generator().manual_seed(0)
    Image.fromarray(torch.randint(0, 255, (48, 48, 3), generator=g, dtype=torch.uint8).numpy()).save(tmp_path / "t.jpg")
    data = (tmp_path / "t.jpg").read_bytes()
    (tmp_path / "t.jpg").write_bytes(data[:len(data) // 2])
    rows = [{"image": f"{i}.png", "caption": f"image {i}"} for i in range(3)]
    rows.insert(1, {"image": "t.jpg", "caption": "truncated"})
    rows.append({"image": "absent.png", "caption": "absent"})
    man = tmp_path / "m.jsonl"
    man.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rs = ev.manifest_retrieval(man)
    assert rs.texts == ["image 0", "image 1", "image 2"] and rs.missing == 2
    assert len(rs.dropped) == 2 and "m.jsonl:5: image not found" in rs.dropped[0] and "t.jpg" in rs.dropped[1]
    assert "undecodable image" in rs.dropped[1] and "t.jpg" in capsys.readouterr().err
    with pytest.raises(ev.MissingData, match=r"m.jsonl:5: image not found"):
        ev.manifest_retrieval(man, strict=True)
    (tmp_path / "absent.png").write_bytes((tmp_path / "0.png").read_bytes())
    with pytest.raises(ev.MissingData, match=r"(?s)1 undecodable image\(s\).*t.jpg.*--strict"):
        ev.manifest_retrieval(man, strict=True)
    with pytest.raises(DataError, match=r"undecodable image .*t.jpg"):
        ev.image_features(models.load_model("tiny", "random")[0], lambda im: torch.zeros(3, 32, 32),
                          [tmp_path / "t.jpg"])


def test_a_synthetic_name_says_whether_the_lab_is_loaded(tmp_path):
    """With the lab loaded (conftest imports it) an unknown synthetic-* name is an unknown task; without it,
    every synthetic-* name says to load the lab."""
    with pytest.raises(ValueError, match="unknown retrieval task 'synthetic-nope'"):
        ev.load_retrieval("synthetic-nope", tmp_path)
    with pytest.raises(ValueError, match="unknown classification task 'synthetic-nope'"):
        ev.load_classification("synthetic-nope", tmp_path)
    code = ("import common, eval\n"
            "for load in (eval.load_retrieval, eval.load_classification):\n"
            "    try:\n        load('synthetic-short')\n    except common.UsageError as e:\n        print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("the lab's synthetic world, which is not loaded") == 2


def test_a_broken_cache_entry_is_rebuilt_with_one_line(tmp_path, tiny_random, capsys):
    """Issue 26.6: the zero-shot classifier cache was written with a bare torch.save and a truncated entry broke
    every later run; now it is written atomically, and an entry that cannot be read is rebuilt, named."""
    import torch
    model, _, _, tok = tiny_random
    ev._CLASSIFIER_CACHE.clear()
    first = ev.zero_shot_head(model, tok, ["circle", "square"], ["a {}."], cache_dir=tmp_path)
    (entry,) = tmp_path.glob("classifier-*.pt")
    entry.write_bytes(entry.read_bytes()[:40])  # a kill half-way through the write, as it was possible before
    ev._CLASSIFIER_CACHE.clear()
    again = ev.zero_shot_head(model, tok, ["circle", "square"], ["a {}."], cache_dir=tmp_path)
    assert torch.equal(first, again) and f"cache file {entry} could not be read" in capsys.readouterr().err
    assert torch.equal(torch.load(entry, weights_only=True), first)  # the rebuilt entry reads back
    assert not list(tmp_path.glob("*.tmp*"))


def test_evaluation_images_are_prepared_once_per_process_and_again_when_the_file_changes(tmp_path):
    """Issue 39.4 (the C-CLIP demo's budget): a continual run evaluates every test set after every task; the
    evaluation images are decoded and transformed once per process (loading.EvalImages), the same tensors as
    before, read again when the file or the transform changes, and never beyond the byte budget."""
    import torchvision.transforms as T
    from PIL import Image
    from plumbing import loading
    path = tmp_path / "a.png"
    Image.new("RGB", (8, 8), (10, 20, 30)).save(path)
    memo, tf = loading.EvalImages(budget=10 ** 6), T.Compose([T.ToTensor()])
    first = memo.get(path, tf)
    assert memo.get(path, tf) is first and torch.equal(first, tf(Image.open(path).convert("RGB")))
    other = T.Compose([T.ToTensor(), T.Normalize((0.5,) * 3, (0.5,) * 3)])
    assert not torch.equal(memo.get(path, other), first)  # another preprocessing: prepared again
    Image.new("RGB", (8, 8), (200, 20, 30)).save(path)
    os.utime(path, ns=(10 ** 18, 10 ** 18))
    assert not torch.equal(memo.get(path, tf), first)  # a changed file: read again
    small = loading.EvalImages(budget=8 * 8 * 3 * 4)  # room for one image's tensor
    small.get(path, tf)
    small.get(path, other)
    assert small.used <= small.budget and len(small.items) == 1
    (tmp_path / "bad.png").write_bytes(b"not an image")
    with pytest.raises(DataError, match="undecodable image .*bad.png"):
        memo.get(tmp_path / "bad.png", tf)
