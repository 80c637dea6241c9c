"""Issue 42.2: the folders researchers keep, read as training and evaluation data (plumbing.datafolders): a
Hugging Face `save_to_disk` folder, parquet files, images with .txt / .json sidecars; every other folder one
message listing the layouts read. Before, each was `error: Is a directory (...)`."""
import json
import subprocess
import sys

import pytest
from PIL import Image

import common
from plumbing.base import DataError, UsageError
import eval as evaluation
from plumbing import datafolders, flags

datasets = pytest.importorskip("datasets")  # in requirements.txt; the test names what it needs


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datafolders, "CACHE_DIR", tmp_path / "cache")
    return tmp_path / "cache" / "folder-data"


def _images(n):
    return [Image.new("RGB", (8, 8), (40 * i, 255 - 40 * i, 0)) for i in range(n)]


def _hf(n=4):
    return datasets.Dataset.from_dict({
        "image": _images(n), "text": [f"a square number {i}" for i in range(n)],
        "long_caption": [f"a square number {i}, drawn small. It has a colour." for i in range(n)],
    }).cast_column("image", datasets.Image())


def test_a_save_to_disk_folder_trains_with_its_columns_converted_once(tmp_path, cache, capsys):
    _hf().save_to_disk(str(tmp_path / "hf"))
    ds = common.ManifestDataset(tmp_path / "hf", need_long=True)
    assert "a Hugging Face dataset; its rows and images are written once into" in capsys.readouterr().err
    assert len(ds) == 4 and ds[2]["caption"] == "a square number 2" and ds[2]["long_caption"].startswith("a square")
    assert ds[1]["image"].getpixel((0, 0)) == (40, 215, 0)  # the stored bytes, as they were
    [converted] = list(cache.iterdir())
    stamp = (converted / "rows.jsonl").stat().st_mtime_ns
    common.ManifestDataset(tmp_path / "hf")  # read again: not converted again
    assert "written once" not in capsys.readouterr().err
    assert (converted / "rows.jsonl").stat().st_mtime_ns == stamp and len(list(cache.iterdir())) == 1
    _hf(3).save_to_disk(str(tmp_path / "hf2"))  # another dataset: its own conversion
    assert len(common.ManifestDataset(tmp_path / "hf2")) == 3 and len(list(cache.iterdir())) == 2


def test_parquet_files_a_folder_of_them_or_one(tmp_path, cache):
    _hf().to_parquet(str(tmp_path / "pq" / "data" / "train-00000-of-00001.parquet"))
    for path in (tmp_path / "pq", tmp_path / "pq" / "data" / "train-00000-of-00001.parquet"):
        ds = common.ManifestDataset(path)
        assert len(ds) == 4 and ds[3]["caption"] == "a square number 3" and ds[3]["image"].size == (8, 8)


def test_images_with_txt_and_json_sidecars(tmp_path):
    folder = tmp_path / "shards" / "00000"
    folder.mkdir(parents=True)
    for i, im in enumerate(_images(3)):
        im.save(folder / f"{i:06d}.jpg")
        (folder / f"{i:06d}.txt").write_text(f"caption {i}\n")
        (folder / f"{i:06d}.json").write_text(json.dumps({"long_caption": f"a long caption {i}", "id": i}))
    ds = common.ManifestDataset(tmp_path / "shards", need_long=True, extra=("id",))
    assert [ds[i]["caption"] for i in range(3)] == ["caption 0", "caption 1", "caption 2"]
    assert ds[1]["long_caption"] == "a long caption 1" and ds[2]["id"] == 2
    (folder / "000001.json").write_text("[1]")
    with pytest.raises(DataError, match=r"000001.json: a sidecar must be a JSON object"):
        common.ManifestDataset(tmp_path / "shards")


def test_other_folders_are_one_message_naming_what_is_read(tmp_path, cache):
    datasets.DatasetDict({"train": _hf(), "test": _hf(2)}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"DatasetDict \(splits train, test\): name one split, e\.g\. \S+"):
        common.ManifestDataset(tmp_path / "dict")
    assert len(common.ManifestDataset(tmp_path / "dict" / "train")) == 4
    (tmp_path / "pets" / "cat").mkdir(parents=True)
    _images(1)[0].save(tmp_path / "pets" / "cat" / "a.png")
    with pytest.raises(DataError, match=r"an ImageFolder .*evaluate it as imagefolder:.*pets"):
        common.ManifestDataset(tmp_path / "pets")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no layout read here; .*Hugging Face datasets folder.*sidecars"):
        common.ManifestDataset(tmp_path / "empty")


def test_folders_are_evaluation_tasks_too(tmp_path, cache):
    _hf().save_to_disk(str(tmp_path / "hf"))
    rs = evaluation.load_retrieval(str(tmp_path / "hf"))
    assert len(rs.image_paths) == 4 and rs.texts[1] == "a square number 1"
    assert evaluation.load_retrieval(str(tmp_path / "hf") + "#long_caption").texts[0].startswith("a square number 0,")


def test_eval_reads_open_clips_csv_flags_and_clip_benchmarks_spellings(tmp_path, capsys):
    """eval.py refused --csv-img-key (a manifest task's columns) and CLIP_benchmark's --model / --dataset /
    --output; now both are read, CLIP_benchmark's with one line naming ours."""
    for i, im in enumerate(_images(4)):
        im.save(tmp_path / f"{i}.png")
    (tmp_path / "pairs.csv").write_text("path;words\n" + "".join(f"{i}.png;square {i}\n" for i in range(4)))
    a = evaluation.command_line().parse_args(["--model", "ViT-B/16", "--dataset", "x", "--output", "o",
                                              "--dataset_root", "r", "--batch_size", "8", "--num_workers", "1"])
    assert (a.backbone, a.tasks, a.out, a.data_root, a.batch_size, a.workers) == ("ViT-B/16", "x", "o", "r", 8, 1)
    with pytest.raises(UsageError, match=r"--out / --output r.json: a folder here"):
        evaluation.main(["--output", "r.json", "--tasks", str(tmp_path / "pairs.csv")])
    assert "note: --output is CLIP_benchmark's spelling of --out here" in capsys.readouterr().err
    flags.CSV_COLUMNS.update(csv_img_key="path", csv_caption_key="words", csv_separator=";")
    rs = evaluation.load_retrieval(str(tmp_path / "pairs.csv"))
    assert rs.texts == [f"square {i}" for i in range(4)]


def test_a_changed_folder_is_seen_by_a_resume_and_the_feature_cache(tmp_path):
    """The resume check and DNS's feature cache hashed a manifest file's bytes; a folder's rows now (a folder
    gave IsADirectoryError in DNS, and no content check on resume)."""
    from plumbing import manifests, runfolder
    for i, im in enumerate(_images(2)):
        im.save(tmp_path / f"{i}.png")
        (tmp_path / f"{i}.txt").write_text(f"caption {i}")
    before = runfolder.data_fingerprint(common.ManifestDataset(tmp_path))
    (tmp_path / "1.txt").write_text("another caption")
    after = runfolder.data_fingerprint(common.ManifestDataset(tmp_path))
    assert before["rows"] == after["rows"] == 2 and before["sha256"] != after["sha256"]
    assert manifests.content_sha256(tmp_path) == after["sha256"]


def test_an_interrupted_conversion_leaves_nothing_used_and_is_cleared(tmp_path, cache):
    """A conversion killed half-way leaves its hidden folder: never read (the finished one appears in one rename),
    and removed by the next conversion once its process is gone."""
    _hf().save_to_disk(str(tmp_path / "hf"))
    name = datafolders._fingerprint(tmp_path / "hf", "hf-disk")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = cache / f".{name}.new-{int(dead.stdout)}"
    (left / "images").mkdir(parents=True)
    (left / "rows.jsonl").write_text('{"image": "images/x.png", "text": "half"}\n')
    assert len(common.ManifestDataset(tmp_path / "hf")) == 4 and not left.exists()
    assert [p.name for p in cache.iterdir()] == [name]


def test_own_data_text_goes_through_the_row_check(tmp_path, cache):
    """Issue 55.2: a .txt sidecar that is not UTF-8 was a UnicodeEncodeError traceback (--skip-bad did not help),
    a non-UTF-8 .json sidecar refused the folder as "not a JSON object"; now each is the row check's one message
    naming the file, or skipped and counted with --skip-bad."""
    folder = tmp_path / "pairs"
    folder.mkdir()
    for i, im in enumerate(_images(3)):
        im.save(folder / f"{i:06d}.jpg")
        (folder / f"{i:06d}.txt").write_text(f"caption {i}\n")
    (folder / "000001.txt").write_bytes("une légende\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"pairs:2: .*000001.txt: not valid UTF-8 \(byte 5\)"):
        common.ManifestDataset(folder)
    ds = common.ManifestDataset(folder, skip_bad=True)
    assert len(ds) == 2 and len(ds.skipped) == 1 and [ds[i]["caption"] for i in range(2)] == ["caption 0",
                                                                                                "caption 2"]
    (folder / "000001.txt").write_text("caption 1\n")
    (folder / "000002.json").write_bytes(b'{"long_caption": "\xe9t\xe9"}')
    with pytest.raises(DataError, match=r"000002.json: not valid UTF-8"):
        common.ManifestDataset(folder)


def test_a_caption_holding_a_line_separator_survives_the_conversion_cache(tmp_path, cache):
    """Issue 55.2: a Hugging Face caption holding U+2028 (or \\x85) was written into the conversion cache as is and
    read back with splitlines(), which splits there too: a traceback on every rerun, the broken conversion cached.
    The cache is ASCII JSON now, read at "\\n" only; the caption comes back whole."""
    captions = ["first\u2028line", "next\x85line", "plain"]
    datasets.Dataset.from_dict({"image": _images(3), "text": captions}).cast_column(
        "image", datasets.Image()).save_to_disk(str(tmp_path / "hf"))
    for _ in range(2):  # converted, then read from the cache
        ds = common.ManifestDataset(tmp_path / "hf")
        assert [ds[i]["caption"] for i in range(3)] == captions


def test_malformed_hugging_face_metadata_is_one_message_naming_the_file(tmp_path, cache):
    """Issue 55.2: dataset_dict.json or state.json holding [] was an AttributeError, state.json that is not JSON a
    JSONDecodeError; now one message naming the file."""
    datasets.DatasetDict({"train": _hf(2)}).save_to_disk(str(tmp_path / "dict"))
    (tmp_path / "dict" / "dataset_dict.json").write_text("[]")
    with pytest.raises(DataError, match=r"dataset_dict.json: not Hugging Face's metadata: a JSON object "
                                               r"expected, found list"):
        common.ManifestDataset(tmp_path / "dict")
    _hf(2).save_to_disk(str(tmp_path / "hf"))
    for text, said in (("[]", "found list"), ("{not json", "not JSON"),
                       ('{"_data_files": [1]}', "_data_files: a list")):
        (tmp_path / "hf" / "state.json").write_text(text)
        with pytest.raises(DataError, match=f"state.json: not Hugging Face's metadata.*{said}"):
            common.ManifestDataset(tmp_path / "hf")


def test_an_image_path_outside_the_dataset_folder_is_never_read(tmp_path, cache):
    """Issue 55.3: a Hugging Face image feature {bytes: None, path: "/etc/passwd"} was copied into the cache
    (mode 0644) before the row check refused it; now a path outside the dataset folder is not read: the row is
    the row check's one message, or skipped with --skip-bad, and nothing of it is in the cache."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the cache")
    png = io.BytesIO()
    _images(1)[0].save(png, format="PNG")
    images = [{"bytes": png.getvalue(), "path": None}, {"bytes": None, "path": str(secret)},
              {"bytes": None, "path": "../secret.txt"}]
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"image": images, "text": ["ok", "absolute", "relative"]}),
                   str(tmp_path / "pq" / "train.parquet"))
    with pytest.raises(DataError, match=r"pq:2: its image path .*secret.txt is outside the dataset folder"):
        common.ManifestDataset(tmp_path / "pq")
    ds = common.ManifestDataset(tmp_path / "pq", skip_bad=True)
    assert len(ds) == 1 and len(ds.skipped) == 2 and ds[0]["caption"] == "ok"
    copied = [p.read_bytes() for p in cache.rglob("*") if p.is_file()]
    assert not any(b"not for the cache" in data for data in copied)
