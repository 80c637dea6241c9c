"""C-CLIP's benchmark built by vlcl.py (issue 29) from fixtures in each source's own layout: Karpathy's split
files, COCO 2017's annotations, and Hugging Face datasets saved with save_to_disk under their real column names.
Both --source settings, reproducible splits, a changed source named, missing sources in one message, and
cclip.py --tasks vlcl training on the result."""
import json

import pytest
from PIL import Image

import cclip
import common
from plumbing.cli import cli
from plumbing.flags import Config
import datasets
from commands import vlcl


def _png(path, i):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (12, 12), ((37 * i) % 256, (91 * i) % 256, (53 * i) % 256)).save(path)
    return path


def _images(n, seed):
    return [Image.new("RGB", (12, 12), ((37 * i + seed) % 256, (11 * i) % 256, 200)) for i in range(n)]


def _karpathy(root, name, splits):
    images = []
    for i, split in enumerate(splits):
        sub = "" if name == "flickr30k" else ("train2014" if split in ("train", "restval") else "val2014")
        fname = f"{name}_{i:04d}.png"
        _png(root / name / ("images" if name == "flickr30k" else sub) / fname, i)
        images.append({"filename": fname, "filepath": sub, "split": split, "imgid": i,
                       "sentences": [{"raw": f"{name} picture {i}, caption {k}."} for k in range(6)]})
    (root / name / f"dataset_{name}.json").write_text(json.dumps({"images": images}))


def _coco2017(root):
    for split, n in (("train2017", 8), ("val2017", 4)):
        ims, anns = [], []
        for i in range(n):
            _png(root / "coco" / split / f"{i:012d}.jpg".replace(".jpg", ".png"), i + 50)
            ims.append({"id": i, "file_name": f"{i:012d}.png"})
            anns += [{"image_id": i, "id": 10 * i + k, "caption": f"coco 2017 image {i} caption {k}"} for k in range(6)]
        (root / "coco" / "annotations").mkdir(parents=True, exist_ok=True)
        ann = {"images": ims, "annotations": anns}
        (root / "coco" / "annotations" / f"captions_{split}.json").write_text(json.dumps(ann))


def _hf(folder, splits: dict, image_col="image", caption_col="text", captions=None, extra=None):
    """A DatasetDict saved to disk: splits {name: n}; captions(i) -> a caption (or a list)."""
    parts = {}
    for split, n in splits.items():
        cols = {image_col: _images(n, len(split)),
                caption_col: [captions(i) if captions else f"{folder.name} {split} {i}" for i in range(n)]}
        feats = {image_col: datasets.Image(),
                 caption_col: datasets.Sequence(datasets.Value("string")) if captions and isinstance(captions(0), list)
                 else datasets.Value("string")}
        for k, fn in (extra or {}).items():
            cols[k], feats[k] = [fn(i) for i in range(n)], datasets.Value("string")
        parts[split] = datasets.Dataset.from_dict(cols, features=datasets.Features(feats))
    datasets.DatasetDict(parts).save_to_disk(str(folder))
    return folder


def _hub_layout(saved, folder):
    """A dataset repository as huggingface-cli download leaves it: data/<split>-00000-of-00001.parquet."""
    for split, ds in datasets.load_from_disk(str(saved)).items():
        (folder / "data").mkdir(parents=True, exist_ok=True)
        ds.to_parquet(str(folder / "data" / f"{split}-00000-of-00001.parquet"))
    return folder


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """data/ with Flickr30K and COCO (Karpathy, COCO 2017) and every Hugging Face task in its own folder, for
    both settings: {setting: [--task-path arguments]}."""
    tmp = tmp_path_factory.mktemp("vlcl")
    data, hf = tmp / "data", tmp / "hf"
    _karpathy(data, "flickr30k", ["train"] * 8 + ["val"] * 2 + ["test"] * 3)
    _karpathy(data, "coco", ["train"] * 6 + ["restval"] * 2 + ["val"] * 2 + ["test"] * 3)
    _coco2017(data)
    common_tasks = {
        "pets": _hf(hf / "pets", {"train": 10, "test": 4}, caption_col="caption_enriched"),
        "lexica": _hf(hf / "lexica", {"train": 10, "test": 4}, caption_col="prompt"),
        "kream": _hub_layout(_hf(hf / "kream-disk", {"train": 16}), hf / "kream"),  # a downloaded repository
        "sketch": _hf(hf / "sketch", {"train": 12}),
        "havg": _hf(hf / "havg", {"train": 6, "validation": 5}, caption_col="en_text"),
    }
    research = {**common_tasks,
                "simpsons": _hf(hf / "simpsons-bigdata", {"train": 12}, image_col="jpg", caption_col="caption.txt"),
                "wikiart": _hf(hf / "wikiart-recaption", {"train": 12},
                               captions=lambda i: [f"wikiart painting {i} a", f"wikiart painting {i} b"])}
    koyo = {**common_tasks,
            "simpsons": _hf(hf / "simpsons-norod", {"train": 12}),
            "wikiart": _hf(hf / "wikiart-fusing", {"train": 12}, caption_col="title"),
            "flickr30k": _hf(hf / "flickr-nlphuji", {"test": 14}, caption_col="caption",
                             captions=lambda i: [f"nlphuji flickr {i} caption {k}" for k in range(5)],
                             extra={"split": lambda i: "train" if i < 9 else "val" if i < 11 else "test"})}
    parquet = tmp / "wikiart_blip_captions.parquet"
    datasets.Dataset.from_dict({"image_idx": list(range(12)), "caption": [f"blip wikiart {i}" for i in range(12)]}
                               ).to_parquet(str(parquet))
    args = {"research": [f"{k}={v}" for k, v in research.items()],
            "koyoimai": [f"{k}={v}" for k, v in koyo.items()] + [f"wikiart-captions={parquet}"]}
    return data, args


def _prepare(data, paths, *extra):
    argv = ["--data-root", str(data), "--hf-cache", str(data / "no-cache")]
    for p in paths:
        argv += ["--task-path", p]
    vlcl.main(argv + list(extra))
    return json.loads((data / "vlcl" / "prepare.json").read_text())


def _rows(data, task, part):
    return [json.loads(line) for line in (data / "vlcl" / task / f"{part}.jsonl").read_text().splitlines()]


def test_research_setting_writes_nine_manifests_with_its_rules(sources, tmp_path):
    data, args = sources
    rec = _prepare(data, args["research"])
    assert rec["settings"] == {"source": "research", "seed": 6, "train_captions": "draw", "split_counts": "ours"}
    assert set(rec["tasks"]) == {*vlcl.TASKS, "havg"} and "train" not in rec["tasks"]["havg"]
    f = rec["tasks"]["flickr30k"]
    assert (f["train"]["images"], f["test"]["images"], f["test"]["rows"]) == (10, 3, 15)  # train+val; 5 captions
    assert len(_rows(data, "flickr30k", "train")[0]["captions"]) == 6  # one row per image, drawn from (V3)
    c = rec["tasks"]["coco"]
    assert (c["train"]["images"], c["test"]["images"]) == (8, 3)  # train + restval / test
    assert (rec["tasks"]["pets"]["train"]["rows"], rec["tasks"]["pets"]["test"]["rows"]) == (10, 4)
    assert (rec["tasks"]["kream"]["train"]["rows"], rec["tasks"]["kream"]["test"]["rows"]) == (8, 8)  # 50 / 50
    assert (rec["tasks"]["sketch"]["train"]["rows"], rec["tasks"]["sketch"]["test"]["rows"]) == (10, 2)  # 0.8
    assert rec["tasks"]["havg"]["test"]["rows"] == 5  # the validation split
    sim = _rows(data, "simpsons", "train")
    assert all((data / "vlcl" / "simpsons" / r["image"]).is_file() for r in sim)
    assert rec["tasks"]["simpsons"]["source"]["columns"] == ["jpg", "caption.txt"]
    # the same sources give the same rows (a seeded split); train and test never share an image
    again = _prepare(data, args["research"])
    assert {t: e.get("train", {}).get("sha256") for t, e in again["tasks"].items()} == \
           {t: e.get("train", {}).get("sha256") for t, e in rec["tasks"].items()}
    for task in ("simpsons", "wikiart", "kream", "sketch"):
        assert not {r["image"] for r in _rows(data, task, "train")} & {r["image"] for r in _rows(data, task, "test")}


def test_koyoimai_setting_reproduces_its_splits_and_sources(sources):
    data, args = sources
    rec = _prepare(data, args["koyoimai"], "--source", "koyoimai", "--train-captions", "rows")
    assert rec["settings"]["seed"] == 42
    f = rec["tasks"]["flickr30k"]
    assert (f["train"]["images"], f["train"]["rows"], f["test"]["images"]) == (9, 45, 3)  # its split column
    assert rec["tasks"]["coco"]["train"]["images"] == 8 and rec["tasks"]["coco"]["test"]["rows"] == 20  # 2017, 5
    assert {r["caption"] for r in _rows(data, "wikiart", "train")} <= {f"blip wikiart {i}" for i in range(12)}
    # datasets' train_test_split(test_size=0.2, seed=42), as KoyoImai calls it, picks the same rows
    ds = datasets.load_from_disk(next(a.split("=")[1] for a in args["koyoimai"] if a.startswith("sketch=")))["train"]
    expect = ds.add_column("_row", list(range(len(ds)))).train_test_split(test_size=0.2, seed=42)["test"]["_row"]
    assert sorted(r["source_row"] for r in _rows(data, "sketch", "test")) == sorted(expect)


def test_missing_sources_are_one_message_listing_each(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli(vlcl.main, ["--data-root", str(tmp_path), "--hf-cache", str(tmp_path / "cache")])
    err = capsys.readouterr().err
    assert "9 of 9 C-CLIP source(s) missing" in err and "Traceback" not in err
    for task in (*vlcl.TASKS, "havg"):
        assert f"  {task}: " in err
    assert "huggingface-cli download --repo-type dataset visual-layer/oxford-iiit-pet-vl-enriched" in err
    assert not (tmp_path / "vlcl").exists()  # nothing written


def test_a_changed_source_is_named(sources, capsys):
    data, args = sources
    _prepare(data, args["research"])
    capsys.readouterr()
    folder = next(a.split("=")[1] for a in args["research"] if a.startswith("lexica="))
    ds = datasets.load_from_disk(folder)
    changed = datasets.DatasetDict({"train": ds["train"].select(range(9)), "test": ds["test"]})
    changed.save_to_disk(folder + "-changed")
    _prepare(data, [a if not a.startswith("lexica=") else f"lexica={folder}-changed" for a in args["research"]])
    assert "lexica: its source changed" in capsys.readouterr().err


def test_cclip_trains_on_the_prepared_tasks(sources, tmp_path):
    data, args = sources
    _prepare(data, args["research"])
    out = tmp_path / "run"
    cclip.main(["--tasks", "vlcl", "--data-root", str(data), "--backbone", "tiny", "--pretrained", "random",
                "--zero-shot", "", "--steps", "2", "--batch-size", "4", "--workers", "0", "--device", "cpu",
                "--precision", "fp32", "--proj-hidden", "16", "--save-every", "0", "--out", str(out)])
    rec = json.loads((out / "continual.json").read_text())
    assert len(rec["rows"]) == len(vlcl.TASKS) + 1  # the zero-shot row, then one per task


def test_a_training_row_with_several_captions_draws_one_per_sample_the_same_on_resume(tmp_path):
    _png(tmp_path / "a.png", 1)
    manifest = tmp_path / "train.jsonl"
    manifest.write_text(json.dumps({"image": "a.png", "captions": [f"caption {k}" for k in range(5)]}) + "\n")
    ds = common.SeededSamples(common.training_set(Config(check_images="none"), manifest), seed=0)
    draws = [ds[(epoch, 0)]["caption"] for epoch in range(12)]
    assert draws == [ds[(epoch, 0)]["caption"] for epoch in range(12)]  # a function of (seed, epoch, row)
    assert len(set(draws)) > 1 and set(draws) <= {f"caption {k}" for k in range(5)}
    assert common.ManifestDataset(manifest)[0]["caption"] == "caption 0"  # evaluation's reading: the first


def test_the_research_codes_split_counts_and_caption_choices_behind_their_switches():
    """Issue 40.5: the research code's fractional split takes int(N f) / int(N (1 - f)) rows (N 151, f 0.8: 120 / 30,
    a row unused; ours 121 / 30), and its base_hf.py versions with all eight tasks train on a list's first caption
    or its longest: --split-counts research, --train-captions first | longest (V1, V3)."""
    from commands import vlcl
    ours = vlcl.split_rows(151, 0.8, 6, "research")
    code = vlcl.split_rows(151, 0.8, 6, "research", counts="research")
    assert [len(p) for p in ours] == [121, 30] and [len(p) for p in code] == [120, 30]
    assert code[0] == ours[0][:120] and len(set(code[0]) | set(code[1])) == 150  # the same order, one row unused
    caps = ["a dog.", "a brown dog on the grass.", "dog"]
    assert [r["caption"] for r in vlcl._rows("x.jpg", caps, "train", "first", 0)] == ["a dog."]
    assert [r["caption"] for r in vlcl._rows("x.jpg", caps, "train", "longest", 0)] == ["a brown dog on the grass."]
    assert vlcl._rows("x.jpg", caps, "train", "draw", 0)[0]["captions"] == caps
    a = vlcl.command_line(["--split-counts", "research", "--train-captions", "longest"])
    assert (a.split_counts, a.train_captions) == ("research", "longest")


# ----------------------------------------------------------------------------- issue 41.5
def _fresh(sources, tmp_path):
    """The module's sources with a data root of this test's own (the Hugging Face tasks stay --task-path)."""
    import shutil
    data, args = sources
    shutil.copytree(data, tmp_path / "data", ignore=shutil.ignore_patterns("vlcl"))
    return tmp_path / "data", list(args["research"])


def _swap(args, task, folder):
    return [a if not a.startswith(f"{task}=") else f"{task}={folder}" for a in args]


def test_a_changed_or_cut_image_is_written_again_not_kept(sources, tmp_path):
    """A rebuild after the source's images changed pairs the new captions with the NEW images (they were written
    once by row number and kept); an image cut by a kill half-way is rewritten, not kept."""
    data, args = _fresh(sources, tmp_path)
    _prepare(data, args)
    row = _rows(data, "lexica", "train")[0]
    image = data / "vlcl" / "lexica" / row["image"]
    before = image.read_bytes()
    image.write_bytes(before[: len(before) // 2])  # what a SIGKILL mid-write left
    _prepare(data, args)
    assert image.read_bytes() == before
    recoloured = {"train": datasets.Dataset.from_dict(
        {"image": [Image.new("RGB", (12, 12), (0, 0, 9 * i)) for i in range(10)],
         "prompt": [f"new lexica {i}" for i in range(10)]},
        features=datasets.Features({"image": datasets.Image(), "prompt": datasets.Value("string")}))}
    folder = tmp_path / "lexica-new"
    old = datasets.load_from_disk(next(a.split("=")[1] for a in args if a.startswith("lexica=")))
    datasets.DatasetDict({**recoloured, "test": old["test"]}).save_to_disk(str(folder))
    _prepare(data, _swap(args, "lexica", folder))
    with Image.open(data / "vlcl" / "lexica" / row["image"]) as im:
        assert im.getpixel((0, 0)) == (0, 0, 9 * row["source_row"])  # the new source's image for that row
    again = next(r for r in _rows(data, "lexica", "train") if r["image"] == row["image"])
    assert again["captions"] == [f"new lexica {row['source_row']}"]


def test_a_source_that_yields_no_rows_leaves_no_old_manifest_and_no_ready_line(sources, tmp_path, capsys):
    data, args = _fresh(sources, tmp_path)
    _prepare(data, args)
    capsys.readouterr()
    empty = tmp_path / "lexica-empty"
    _hf(empty, {"train": 4, "test": 2}, caption_col="prompt", captions=lambda i: "  ")
    with pytest.raises(SystemExit) as ended:
        cli(vlcl.main, ["--data-root", str(data), "--hf-cache", str(data / "no-cache"),
                               *[x for a in _swap(args, "lexica", empty) for x in ("--task-path", a)]])
    out = capsys.readouterr()
    assert ended.value.code == 1 and "python cclip.py" not in out.out
    assert "lexica: no train / test rows (6 dropped for an empty caption)" in out.err and "Traceback" not in out.err
    assert not any((data / "vlcl" / "lexica" / f"{p}.jsonl").exists() for p in ("train", "test"))
    rec = json.loads((data / "vlcl" / "prepare.json").read_text())
    assert "train" not in rec["tasks"]["lexica"]


@pytest.mark.parametrize("case", ["caption column renamed", "image column of strings", "no test split"])
def test_a_malformed_source_is_one_message_before_anything_is_written(sources, tmp_path, capsys, case):
    data, args = _fresh(sources, tmp_path)
    bad = tmp_path / "pets-bad"
    if case == "caption column renamed":
        _hf(bad, {"train": 4, "test": 2}, caption_col="description")
    elif case == "no test split":
        _hf(bad, {"train": 4}, caption_col="caption_enriched")
    else:
        datasets.DatasetDict({s: datasets.Dataset.from_dict({"image": [f"img{i}.jpg" for i in range(3)],
                                                             "caption_enriched": ["a", "b", "c"]})
                              for s in ("train", "test")}).save_to_disk(str(bad))
    with pytest.raises(SystemExit):
        cli(vlcl.main, ["--data-root", str(data), "--hf-cache", str(data / "no-cache"),
                               *[x for a in _swap(args, "pets", bad) for x in ("--task-path", a)]])
    err = capsys.readouterr().err
    assert "1 of 9 C-CLIP source(s) missing or unreadable" in err and "Traceback" not in err
    assert {"caption column renamed": "no column 'caption_enriched' (its columns: image, description)",
            "no test split": "has no split 'test' (it holds train)",
            "image column of strings": "column 'image' holds str values, not images"}[case] in err
    assert not (data / "vlcl").exists()  # nothing written, no other task's images either
