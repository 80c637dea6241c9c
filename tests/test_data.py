"""The manifest dataset: reading, validation and clear errors (the world itself: test_lab.py)."""
import hashlib
import json

import pytest
import torch
from PIL import Image

from plumbing import loading, manifests
from papers import erclip_data
import common
from plumbing.base import DataError
from plumbing.cli import cli
from plumbing.loading import to_rgb
from plumbing.manifests import read_manifest
import lab


def _digest(path):
    return hashlib.sha1(path.read_bytes()).hexdigest()


def test_manifest_dataset_reads_jsonl_and_csv(tmp_path):
    man = lab.synthetic_manifest("test", tmp_path, n=6)
    ds = common.ManifestDataset(man, need_long=True, extra=("shape",))
    item = ds[0]
    assert isinstance(item["image"], Image.Image) and item["caption"] and item["long_caption"]
    rows = [json.loads(line) for line in man.read_text().splitlines()]
    tsv = man.parent / "m.tsv"
    tsv.write_text("filepath\ttitle\n" + "".join(f"{r['image']}\t{r['caption']}\n" for r in rows))
    ds2 = common.ManifestDataset(tsv)
    assert len(ds2) == 6 and ds2[3]["caption"] == rows[3]["caption"]


def _one_row_manifest(tmp_path, **row):
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps(row) + "\n")
    return p


def _good_image(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "ok.png")
    return "ok.png"


def test_missing_column_lists_available(tmp_path):
    p = _one_row_manifest(tmp_path, image=_good_image(tmp_path), text_long="x")
    with pytest.raises(DataError,
                       match=r"missing column\(s\) \['caption'\]; available: \['image', 'text_long'\]"):
        common.ManifestDataset(p)
    p = _one_row_manifest(tmp_path, image="ok.png", caption="a")
    with pytest.raises(DataError, match="long_caption"):
        common.ManifestDataset(p, need_long=True)


@pytest.mark.parametrize("problem", ["missing", "corrupt", "empty"])
def test_bad_rows_name_file_and_line(tmp_path, problem):
    good = _good_image(tmp_path)
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    rows = [{"image": good, "caption": "fine"}] * 2
    rows.append({"missing": {"image": "nope.png", "caption": "a"},
                 "corrupt": {"image": "bad.png", "caption": "a"},
                 "empty": {"image": good, "caption": "  "}}[problem])
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=rf"m.jsonl:3: .*"
                       rf"{ {'missing': 'not found', 'corrupt': 'undecodable', 'empty': 'empty caption'}[problem] }"):
        common.ManifestDataset(p)
    ds = common.ManifestDataset(p, skip_bad=True)
    assert len(ds) == 2 and len(ds.skipped) == 1 and "m.jsonl:3" in ds.skipped[0]


def test_every_caption_of_a_list_is_checked_not_only_the_first(tmp_path):
    """Issue 41 (elsewhere): rows with `captions: [...]` (vlcl.py's layout) were checked on their first caption,
    so a non-string member was a traceback at step 1 and an empty one trained silently."""
    good = _good_image(tmp_path)
    rows = [{"image": good, "captions": ["a", "b"]}, {"image": good, "captions": ["a", 7]},
            {"image": good, "captions": ["a", "b", " "]}, {"image": good, "captions": []}]
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as e:
        common.ManifestDataset(p)
    assert "m.jsonl:2: captions[1] is not text (int 7)" in str(e.value)
    assert "m.jsonl:3: empty captions[2]" in str(e.value) and "m.jsonl:4: captions is not text" in str(e.value)
    ds = common.ManifestDataset(p, skip_bad=True, draw_caption=True)
    assert len(ds) == 1 and len(ds.skipped) == 3


def test_undecodable_bytes_and_bad_json(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_bytes(b'{"image": "a.png", "caption": "ok"}\n{"image": "b.png", "caption": "\xff\xfe"}\n')
    with pytest.raises(DataError, match="m.jsonl:2: not valid UTF-8"):
        read_manifest(p)
    p.write_text('{"image": "a.png", "caption": "ok"}\n{"image": \n')
    with pytest.raises(DataError, match="m.jsonl:2: bad JSON"):
        read_manifest(p)
    with pytest.raises(DataError, match="manifest not found"):
        read_manifest(tmp_path / "absent.jsonl")


def test_collate_tokenises_and_stacks(tiny_random):
    _, _, pre, tok = tiny_random
    items = [{"image": torch.zeros(3, 4, 4), "caption": "a red circle.", "index": i, "long_caption": "A. B."}
             for i in range(3)]
    b = common.Collate(tok)(items)
    assert b["image"].shape == (3, 3, 4, 4) and b["text"].shape == (3, 24)
    assert b["index"].tolist() == [0, 1, 2] and b["long_caption"] == ["A. B."] * 3


def test_sampler_resumes_mid_epoch_and_shards():
    s = common.ResumableSampler(20, 4, seed=3)
    s.set_epoch(1)
    full = list(s)
    s.set_epoch(1, skip_batches=2)
    assert list(s) == full[8:]
    r0, r1 = common.ResumableSampler(20, 4, 3, rank=0, world=2), common.ResumableSampler(20, 4, 3, rank=1, world=2)
    r0.set_epoch(0), r1.set_epoch(0)
    assert not set(r0) & set(r1) and len(list(r0)) == len(list(r1)) == 8


def _broken_images(tmp_path):
    """A truncated JPEG and a PNG whose compressed data is broken under valid
    CRCs: both pass PIL's verify() and fail only when decoded."""
    import struct
    import zlib
    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 255, (64, 64, 3), generator=g, dtype=torch.uint8).numpy()
    Image.fromarray(pixels).save(tmp_path / "full.jpg", quality=90)
    data = (tmp_path / "full.jpg").read_bytes()
    (tmp_path / "trunc.jpg").write_bytes(data[:len(data) // 2])
    Image.fromarray(pixels).save(tmp_path / "full.png")
    png = bytearray((tmp_path / "full.png").read_bytes())
    i = png.find(b"IDAT")
    n = struct.unpack(">I", png[i - 4:i])[0]
    for k in range(i + 4 + n // 3, i + 4 + n // 3 + 64):
        png[k] ^= 0x55
    png[i + 4 + n:i + 8 + n] = struct.pack(">I", zlib.crc32(bytes(png[i:i + 4 + n])))
    (tmp_path / "broken.png").write_bytes(bytes(png))
    for name in ("trunc.jpg", "broken.png"):
        with Image.open(tmp_path / name) as im:
            im.verify()  # the old row check's test: both pass it
    return ["trunc.jpg", "broken.png"]


def test_images_are_fully_decoded_in_the_row_check(tmp_path):
    good = _good_image(tmp_path)
    bad = _broken_images(tmp_path)
    rows = [{"image": good, "caption": "fine"}, {"image": bad[0], "caption": "a"},
            {"image": good, "caption": "fine"}, {"image": bad[1], "caption": "b"}]
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as e:
        common.ManifestDataset(p)
    msg = str(e.value)
    assert "2 bad row(s)" in msg and "--skip-bad" in msg
    assert "m.jsonl:2: undecodable image" in msg and "trunc.jpg" in msg  # every bad row, not only the first
    assert "m.jsonl:4: undecodable image" in msg and "broken.png" in msg
    ds = common.ManifestDataset(p, skip_bad=True)
    assert len(ds) == 2 and [s.split(": ")[0] for s in ds.skipped] == [f"{p}:2", f"{p}:4"]
    # without the row check, the first load names manifest line and file, also from a DataLoader worker
    unchecked = common.ManifestDataset(p, check_images=False)
    with pytest.raises(DataError, match=r"m.jsonl:4: undecodable image .*broken.png"):
        unchecked[3]
    loader = torch.utils.data.DataLoader(unchecked, batch_size=None, num_workers=1, collate_fn=lambda x: x)
    with pytest.raises(Exception, match=r"m.jsonl:2: undecodable image .*trunc.jpg"):
        list(loader)


def test_an_unchanged_image_is_decoded_once_per_process(tmp_path, monkeypatch):
    """The preflight's row check and the training set's decode each image
    once; a file changed on disk since (new size or time) is decoded again
    and its new problem found."""
    decoded = []
    real = manifests.image_problem
    monkeypatch.setattr(manifests, "image_problem", lambda p: decoded.append(str(p)) or real(p))
    monkeypatch.setattr(manifests, "_DECODED", {})
    good = _good_image(tmp_path)
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps({"image": good, "caption": "a"}) + "\n"
                 + json.dumps({"image": good, "caption": "b"}) + "\n")
    common.ManifestDataset(p)
    common.ManifestDataset(p)
    assert decoded == [str(tmp_path / good)]
    data = (tmp_path / good).read_bytes()
    (tmp_path / good).write_bytes(data[:len(data) // 2])
    with pytest.raises(DataError, match="undecodable image"):
        common.ManifestDataset(p)
    assert len(decoded) == 2


def test_many_bad_rows_named_up_to_a_limit_then_counted(tmp_path):
    n = manifests.MAX_LISTED + 5
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps({"image": "nope.png", "caption": "a"}) + "\n" for _ in range(n))
                 + json.dumps({"image": _good_image(tmp_path), "caption": "ok"}) + "\n")
    with pytest.raises(DataError) as e:
        common.ManifestDataset(p)
    msg = str(e.value)
    assert f"{n} bad row(s)" in msg and f"m.jsonl:{manifests.MAX_LISTED}:" in msg and "and 5 more" in msg
    assert len(common.ManifestDataset(p, skip_bad=True).skipped) == n


def test_jsonl_lines_end_at_newline_only(tmp_path):
    rows = [{"image": _good_image(tmp_path), "caption": "one\u2028line"},
            {"image": "ok.png", "caption": "next\x85line \u2029 too"}]
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    got = read_manifest(p)
    assert [r["caption"] for r in got] == [r["caption"] for r in rows] and [r["_line"] for r in got] == [1, 2]


def test_json_array_manifest_accepted_or_named(tmp_path):
    good = _good_image(tmp_path)
    p = tmp_path / "m.json"
    p.write_text('[\n  {"image": "%s", "caption": "a"},\n\n  {"image": "%s",\n   "caption": ""}\n]\n' % (good, good))
    assert [r["_line"] for r in read_manifest(p)] == [2, 4]
    with pytest.raises(DataError, match=r"m.json:4: empty caption"):
        common.ManifestDataset(p)
    p.write_text('[\n  {"image": "%s", "caption": "a"},\n  {"image": }\n]\n' % good)
    with pytest.raises(DataError, match=r"m.json:3: bad JSON"):
        read_manifest(p)


def test_non_utf8_rows_are_skippable(tmp_path):
    good = _good_image(tmp_path)
    for name, line, data in (("m.jsonl", 2, b'{"image": "%s", "caption": "ok"}\n{"image": "%s", "caption": "\xff"}\n'),
                             ("m.csv", 3, b"image,caption\n%s,ok\n%s,caf\xe9\n")):
        p = tmp_path / name
        p.write_bytes(data % (good.encode(), good.encode()))
        with pytest.raises(DataError, match=rf"(?s)--skip-bad.*{name}:{line}: not valid UTF-8"):
            common.ManifestDataset(p)
        ds = common.ManifestDataset(p, skip_bad=True)
        assert len(ds) == 1 and ds.skipped == [f"{p}:{line}: not valid UTF-8"]


def test_csv_line_numbers_after_multiline_caption(tmp_path):
    good = _good_image(tmp_path)
    p = tmp_path / "m.csv"
    p.write_text(f'image,caption\n{good},"a caption\nover three\nlines"\n{good},\n{good},fine\n')
    rows = read_manifest(p)
    assert [r["_line"] for r in rows] == [2, 5, 6] and rows[0]["caption"] == "a caption\nover three\nlines"
    with pytest.raises(DataError, match=r"m.csv:5: empty caption"):
        common.ManifestDataset(p)


def _coco_and_sharegpt4v(folder, long_text="A long description. It has two sentences."):
    coco = {"images": [{"id": i, "file_name": f"{i:012d}.jpg"} for i in (3, 1, 2)],
            "annotations": [{"image_id": i, "caption": f"caption {i} {k}"} for i in (1, 2, 3) for k in (0, 1)]}
    records = [{"image": "coco/train2017/000000000009.jpg", "conversations": [{"from": "gpt", "value": "held"}]}]
    records += [{"image": f"coco/train2017/{i:012d}.jpg", "conversations": [{"from": "human", "value": "?"},
                 {"from": "gpt", "value": f"{long_text} ({i})"}]} for i in (1, 2, 3)]
    (folder / "captions.json").write_text(json.dumps(coco))
    (folder / "sharegpt4v.json").write_text(json.dumps(records))
    return folder / "captions.json", folder / "sharegpt4v.json"


def test_write_once_manifest_is_rebuilt_when_its_sources_change(tmp_path, capsys):
    """The training manifest is written once and reused, but only while the
    files it was built from are the same ones (recorded in its sidecar)."""
    coco, sg = _coco_and_sharegpt4v(tmp_path)
    out = tmp_path / "erclip"
    path = erclip_data.coco_sharegpt4v_manifest(coco, sg, out, n_pairs=2, holdout=1)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["coco_id"] for r in rows] == [1, 2] and rows[0]["caption"] == "caption 1 0"
    assert rows[0]["long_caption"].startswith("A long description.")
    assert loading.read_sidecar(path)["sources"]["sharegpt4v"]["bytes"] == sg.stat().st_size
    stamp = path.stat().st_mtime_ns
    assert erclip_data.coco_sharegpt4v_manifest(coco, sg, out, n_pairs=2, holdout=1) == path
    assert path.stat().st_mtime_ns == stamp  # reused, not rewritten
    _coco_and_sharegpt4v(tmp_path, long_text="Another, longer description of the same scene.")
    erclip_data.coco_sharegpt4v_manifest(coco, sg, out, n_pairs=2, holdout=1)
    assert "rebuilding" in capsys.readouterr().err
    assert json.loads(path.read_text().splitlines()[0])["long_caption"].startswith("Another, longer")
    other = tmp_path / "other.json"
    other.write_text(sg.read_text())
    erclip_data.coco_sharegpt4v_manifest(coco, other, out, n_pairs=2, holdout=1)  # another --sharegpt4v path
    assert loading.read_sidecar(path)["sharegpt4v"] == str(other)


def test_a_16_bit_png_is_scaled_not_clipped_to_white(tmp_path):
    """Issue 26.9: convert('RGB') on a mode I;16 image clipped every value above 255 (99.5 % white, 6 distinct
    values); common.to_rgb scales by the 16-bit range, the same in training (ManifestDataset) and evaluation."""
    import numpy as np
    from PIL import Image
    import eval as evaluation
    ramp = (np.arange(64 * 64, dtype=np.uint32).reshape(64, 64) * 16).astype(np.uint16)  # 0 .. 65520
    Image.fromarray(ramp).save(tmp_path / "deep.png")
    with Image.open(tmp_path / "deep.png") as im:
        assert im.mode.startswith("I")  # what PIL makes of a 16-bit grey PNG
        rgb = np.asarray(to_rgb(im))
    assert rgb.shape == (64, 64, 3) and (rgb == 255).mean() < 0.01 and len(np.unique(rgb)) > 200
    assert abs(int(rgb[32, 0, 0]) - round(int(ramp[32, 0]) / 257)) <= 1
    (tmp_path / "m.jsonl").write_text('{"image": "deep.png", "caption": "a ramp"}\n')
    train = np.asarray(common.ManifestDataset(tmp_path / "m.jsonl")[0]["image"])
    ev = evaluation._Images([str(tmp_path / "deep.png")], lambda x: np.asarray(x))[0]
    assert np.array_equal(train, rgb) and np.array_equal(ev, rgb)


def test_control_characters_in_a_message_are_escaped(tmp_path, capsys):
    """Issue 26.10: a manifest path with \\r and ANSI escapes erased the `error:` line and printed a green
    forgery; common.cli writes every message with control characters escaped (newlines kept)."""
    evil = tmp_path / "x\r\x1b[32mall rows OK, training started\x1b[0m\x00.jsonl"

    def main(argv):
        raise DataError(f"manifest not found: {evil}\nsecond line")
    with pytest.raises(SystemExit):
        cli(main, [])
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err and "\x00" not in err
    assert "x\\r\\x1b[32mall rows OK" in err and "\\x00.jsonl" in err and err.startswith("error: manifest not found")
    assert "\nsecond line" in err


def test_open_clips_csv_flags_and_a_folder_named_with_the_accepted_layouts(tmp_path, capsys):
    """Issue 42.2: open_clip's --csv-img-key / --csv-caption-key / --csv-separator were refused ("unrecognized
    arguments" after a 45-line usage); a folder as --train-data was "Is a directory (...)". Now the flags choose
    the columns and separator, and a folder is one message listing the layouts that are read."""
    from PIL import Image
    import m2mix
    from plumbing import flags
    for i in range(4):
        Image.new("RGB", (8, 8), (60 * i, 0, 0)).save(tmp_path / f"{i}.png")
    (tmp_path / "pairs.csv").write_text("path;words;caption\n" + "".join(
        f"{i}.png;a red square number {i};not this one\n" for i in range(4)))
    cfg = flags.parse_config(m2mix.M2MixConfig, ["--csv-img-key", "path", "--csv-caption-key", "words",
                                                 "--csv-separator", ";", "--check-images", "none"])
    rows = common.training_set(cfg, tmp_path / "pairs.csv")
    assert [rows[i]["caption"] for i in range(4)] == [f"a red square number {i}" for i in range(4)]
    (tmp_path / "tabbed.tsv").write_text("filepath\ttitle\n0.png\ta caption\n")
    tab = flags.parse_config(m2mix.M2MixConfig, ["--csv-separator", "\\t", "--check-images", "none"])
    assert common.training_set(tab, tmp_path / "tabbed.tsv")[0]["caption"] == "a caption"  # open_clip's defaults
    wrong = flags.parse_config(m2mix.M2MixConfig, ["--csv-img-key", "nope", "--check-images", "none"])
    with pytest.raises(DataError, match=r"missing column\(s\) \[.nope.\]"):
        common.training_set(wrong, tmp_path / "pairs.csv")
    with pytest.raises(DataError, match=r"no layout read here; training and evaluation data are a manifest"):
        common.training_set(cfg, tmp_path)
