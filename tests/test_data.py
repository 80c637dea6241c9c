"""The manifest dataset: reading, validation and clear errors (the world itself: test_lab.py)."""
import hashlib
import json

import pytest
import torch
from PIL import Image

import common
import lab


def _digest(path):
    return hashlib.sha1(path.read_bytes()).hexdigest()


def test_manifest_dataset_reads_jsonl_and_csv(tmp_path):
    man = lab.synthetic_manifest("test", tmp_path, n=6)
    ds = common.ManifestDataset(man, need_long=True, extra=("shape",))
    item = ds[0]
    assert isinstance(item["image"], Image.Image) and item["caption"] and item["long_caption"]
    rows = [json.loads(l) for l in man.read_text().splitlines()]
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
    with pytest.raises(common.DataError, match=r"missing column\(s\) \['caption'\]; available: \['image', 'text_long'\]"):
        common.ManifestDataset(p)
    p = _one_row_manifest(tmp_path, image="ok.png", caption="a")
    with pytest.raises(common.DataError, match="long_caption"):
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
    with pytest.raises(common.DataError, match=rf"m.jsonl:3: .*{ {'missing': 'not found', 'corrupt': 'undecodable', 'empty': 'empty caption'}[problem] }"):
        common.ManifestDataset(p)
    ds = common.ManifestDataset(p, skip_bad=True)
    assert len(ds) == 2 and len(ds.skipped) == 1 and "m.jsonl:3" in ds.skipped[0]


def test_undecodable_bytes_and_bad_json(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_bytes(b'{"image": "a.png", "caption": "ok"}\n{"image": "b.png", "caption": "\xff\xfe"}\n')
    with pytest.raises(common.DataError, match="m.jsonl:2: not valid UTF-8"):
        common.read_manifest(p)
    p.write_text('{"image": "a.png", "caption": "ok"}\n{"image": \n')
    with pytest.raises(common.DataError, match="m.jsonl:2: bad JSON"):
        common.read_manifest(p)
    with pytest.raises(common.DataError, match="manifest not found"):
        common.read_manifest(tmp_path / "absent.jsonl")


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
