"""MTIL (issue 61): every reader of protocols/mtil.py against torchvision's own dataset class on a fixture in the real
layout (lab/protocol_data.py), ZSCL's splits and Transfer / Average / Last against an independent re-implementation
of its results.ipynb, the training manifests, one message for missing data, and `--tasks mtil-order1` end to end in
dns.py and (its first tasks) cclip.py on the fixture."""
import json

import numpy as np
import pytest
import torch
import torchvision

import common
from plumbing.base import DataError, UsageError
import lab  # noqa: F401  the tiny backbone
from lab import protocol_data
from protocols import mtil


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return protocol_data.write_mtil(tmp_path_factory.mktemp("mtil"))


def _pairs(listing):
    return [str(p) for p in listing.images], list(listing.labels)


def _tv_split(paths, labels, split):
    """torch.utils.data.random_split(0.8, Generator().manual_seed(42)) as ZSCL's split_dataset calls it."""
    n = len(paths)
    parts = torch.utils.data.random_split(list(range(n)), [int(0.8 * n), n - int(0.8 * n)],
                                          generator=torch.Generator().manual_seed(42))
    keep = list(parts[0] if split == "train" else parts[1])
    return [paths[i] for i in keep], [labels[i] for i in keep]


@pytest.mark.parametrize("split", ["train", "test"])
def test_the_file_readers_list_what_torchvision_lists(root, split, monkeypatch):
    """Same image files, same labels, same order as torchvision's classes on the same folders (ZSCL builds every
    dataset from them: collections.py); class names as ZSCL's process_labels spells them."""
    tv = torchvision.datasets
    monkeypatch.setattr(tv.Flowers102, "_check_integrity", lambda self: True)  # md5s of the real .mat files
    cases = {
        "Aircraft": tv.FGVCAircraft(root, split=split),
        "DTD": tv.DTD(root, split=split),
        "Flowers": tv.Flowers102(root, split=split),
        "Food": tv.Food101(root, split=split),
        "OxfordPet": tv.OxfordIIITPet(root, split="trainval" if split == "train" else "test"),
        "StanfordCars": tv.StanfordCars(root, split=split),
    }
    for name, ds in cases.items():
        ours = mtil.read(root, name, split)
        files = getattr(ds, "_image_files", None) or getattr(ds, "_images", None) or [p for p, _ in ds._samples]
        labels = getattr(ds, "_labels", None) or [k for _, k in ds._samples]
        assert _pairs(ours) == ([str(p) for p in files], list(labels)), name
        if name not in mtil.DATA["classnames"]:
            assert ours.classnames == [c.replace("_", " ") for c in ds.classes], name
        assert ours.templates == mtil.DATA["templates"][name] and len(ours.images) > 0


@pytest.mark.parametrize("split", ["train", "test"])
def test_the_randomly_split_sets_match_torchvision_and_random_split(root, split):
    """Caltech101, EuroSAT: torchvision's whole dataset, then random_split(0.8, seed 42); SUN397 the same files and
    labels (its order is the file system's in torchvision, sorted here: protocols/mtil.py deviation 1)."""
    cal = torchvision.datasets.Caltech101(root)
    paths = [str(root / "caltech101" / "101_ObjectCategories" / cal.categories[y] / f"image_{i:04d}.jpg")
             for i, y in zip(cal.index, cal.y)]
    assert _pairs(mtil.read(root, "Caltech101", split)) == _tv_split(paths, list(cal.y), split)
    euro = torchvision.datasets.EuroSAT(root)
    assert _pairs(mtil.read(root, "EuroSAT", split)) == _tv_split([p for p, _ in euro.samples],
                                                                  [k for _, k in euro.samples], split)
    sun = torchvision.datasets.SUN397(root)
    ours = [mtil.read(root, "SUN397", s) for s in ("train", "test")]
    assert not set(ours[0].images) & set(ours[1].images) and len(ours[0].images) == int(0.8 * len(sun))
    assert sorted(p for o in ours for p in zip(*_pairs(o))) == sorted(zip(map(str, sun._image_files), sun._labels))
    assert ours[0].classnames == [c.replace("_", " ") for c in sun.classes]
    assert list(mtil.random_split_indices(10)) == [list(p) for p in torch.utils.data.random_split(
        list(range(10)), [8, 2], generator=torch.Generator().manual_seed(42))]


def test_the_array_readers_give_torchvisions_images_and_labels(root, monkeypatch):
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *a, **k: True)  # the real files' md5s
    for split in ("train", "test"):
        mn = torchvision.datasets.MNIST(root, train=split == "train")
        ours = mtil.read(root, "MNIST", split)
        assert ours.labels == mn.targets.tolist() and ours.classnames == mn.classes
        assert np.array_equal(np.asarray(ours.images[1].convert("L")), mn.data[1].numpy())
        cif = torchvision.datasets.CIFAR100(root / "cifar100", train=split == "train")
        ours = mtil.read(root, "CIFAR100", split)
        assert ours.labels == list(cif.targets) and ours.classnames == [c.replace("_", " ") for c in cif.classes]
        assert np.array_equal(np.asarray(ours.images[2]), cif.data[2])


def test_zscl_class_names_and_templates_are_its_own():
    """The names ZSCL fixes (Caltech101 101, EuroSAT 10, Flowers 102) and a template of each kind."""
    names, templates = mtil.DATA["classnames"], mtil.DATA["templates"]
    assert {k: len(v) for k, v in names.items()} == {"Caltech101": 101, "EuroSAT": 10, "Flowers": 102}
    assert names["Caltech101"][:2] == ["off-center face", "centered face"] and names["EuroSAT"][0] == "annual crop land"
    assert templates["MNIST"] == ['a photo of the number: "{}".'] and len(templates["CIFAR100"]) == 18
    assert templates["Aircraft"][0] == "a photo of a {}, a type of aircraft." and len(templates["Caltech101"]) == 34
    assert mtil.ORDERS["order2"] == ["StanfordCars", "Food", "MNIST", "OxfordPet", "Flowers", "SUN397", "Aircraft",
                                     "Caltech101", "DTD", "EuroSAT", "CIFAR100"]
    assert sorted(mtil.ORDERS["order1"]) == sorted(mtil.ORDERS["order2"]) and len(mtil.DATASETS) == 11


def _zscl_statistics(arr):
    """ZSCL's results.ipynb statistics() (correct=False, order=1), written again from reading it: arr (T, T), row i =
    after task i+1, no pretrained row. Returns (transfer mean, avg mean, last mean, per-task lists)."""
    T = arr.shape[0]
    avg = arr.mean(axis=0)
    last = arr[-1, :]
    transfer = np.array([np.mean([arr[j, i] for j in range(i)]) for i in range(1, T)])
    return transfer.mean(), avg.mean(), last.mean(), transfer, avg, last


def test_transfer_average_last_are_zscls():
    """By hand on 3 tasks, then against the notebook's computation on a random 11-task matrix (max abs diff)."""
    R = [[10, 20, 30], [50, 21, 33], [40, 60, 36], [35, 55, 70]]  # row 0 = pretrained: in none of the three
    m = mtil.transfer_average_last(R)
    assert m["transfer"] == [None, 21.0, (33 + 36) / 2] and m["Transfer"] == pytest.approx((21 + 34.5) / 2)
    assert m["average"] == pytest.approx([125 / 3, 136 / 3, 139 / 3]) and m["last"] == [35, 55, 70]
    assert m["Last"] == pytest.approx(160 / 3) and m["zero_shot"] == [10, 20, 30]
    rng = np.random.default_rng(0)
    R = rng.uniform(0, 100, (12, 11))
    m = mtil.transfer_average_last(R)
    t, a, last, tt, aa, ll = _zscl_statistics(R[1:])
    diff = max(abs(m["Transfer"] - t), abs(m["Average"] - a), abs(m["Last"] - last),
               np.abs(np.array(m["transfer"][1:]) - tt).max(), np.abs(np.array(m["average"]) - aa).max(),
               np.abs(np.array(m["last"]) - ll).max())
    assert diff < 1e-12, diff


def test_a_training_manifest_captions_each_image_with_its_first_template(root, tmp_path):
    """Files as they are; CIFAR's and MNIST's arrays written once as PNGs (a second call reuses them)."""
    for name in ("DTD", "MNIST"):
        listing = mtil.read(root, name, "train")
        path = mtil.training_manifest(listing, tmp_path)
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert [r["label"] for r in rows] == listing.labels
        assert rows[0]["caption"] == listing.templates[0].format(listing.classnames[listing.labels[0]])
        assert all((tmp_path / r["image"]).is_file() for r in rows)
        stamp = path.stat().st_mtime_ns
        assert mtil.training_manifest(listing, tmp_path) == path and path.stat().st_mtime_ns == stamp
    assert rows[0]["caption"] == 'a photo of the number: "0 - zero".'
    ds = common.ManifestDataset(path)  # what the methods train on reads it
    assert len(ds) == len(rows) and ds[0]["caption"] == rows[0]["caption"]


def test_missing_mtil_data_is_one_message_naming_every_dataset(tmp_path):
    (tmp_path / "dtd").mkdir()
    with pytest.raises(DataError) as e:
        common.parse_tasks("mtil-order1", tmp_path)
    msg = str(e.value)
    assert msg.count("\n  ") == 11 and "docs/data.md" in msg and "fgvc-aircraft-2013b/data/variants.txt" in msg
    with pytest.raises(UsageError):
        common.parse_tasks("mtil-order1:12", tmp_path)


@pytest.mark.parametrize("case", ["truncated", "garbage", "no scipy"])
def test_an_unreadable_mat_file_or_no_scipy_is_one_message_naming_the_file(case, root, tmp_path, monkeypatch):
    """Issue 68.1: Flowers' and StanfordCars' .mat files through scipy; a file scipy cannot read (MatReadError,
    ValueError) or scipy missing (ModuleNotFoundError) is MissingMTIL naming the file, and mtil.missing lists it
    beside the other datasets rather than ending in a traceback."""
    import shutil
    import sys
    copy = tmp_path / "mtil"
    shutil.copytree(root / "flowers-102", copy / "flowers-102")
    setid = copy / "flowers-102" / "setid.mat"
    if case == "no scipy":
        monkeypatch.setitem(sys.modules, "scipy.io", None)  # `from scipy.io import ...` -> ModuleNotFoundError
    else:
        setid.write_bytes(setid.read_bytes()[:40] if case == "truncated" else b"not a MATLAB file" * 20)
    with pytest.raises(mtil.MissingMTIL) as e:
        mtil.read(copy, "Flowers", "train")
    want = "needs scipy" if case == "no scipy" else "is not a readable MATLAB .mat file"
    assert want in str(e.value) and str(copy / "flowers-102") in str(e.value) and "\n" not in str(e.value)
    (line,) = mtil.missing(copy, ["Flowers"])
    assert line.startswith("Flowers: ") and want in line


def _matrix_checks(out, names):
    res = json.loads((out / "results.json").read_text())["continual"]
    assert res["tasks"] == names
    R = res["matrices"]["top1"]
    assert len(R) == len(names) + 1 and all(0 <= v <= 100 for row in R for v in row)
    want = mtil.transfer_average_last(R)  # key by key: pytest.approx takes no nested dict (pytest >= 9.2)
    assert res["mtil"].keys() == want.keys()
    for k, v in want.items():
        assert res["mtil"][k] == pytest.approx(v), k
    return res


def test_dns_runs_mtil_order1_end_to_end_and_prints_the_matrix(root, tmp_path, capsys, monkeypatch):
    import dns
    monkeypatch.setenv("CLIPFT_CACHE", str(tmp_path / "cache"))
    dns.main(["--backbone", "tiny", "--pretrained", "random", "--tasks", "mtil-order1", "--data-root", str(root),
              "--batch-size", "4", "--epochs", "1", "--lr", "1e-2", "--device", "cpu", "--out", str(tmp_path / "d")])
    printed = capsys.readouterr().out
    assert "| Transfer |" in printed and "| Average |" in printed and "| Last |" in printed
    res = _matrix_checks(tmp_path / "d", mtil.ORDERS["order1"])
    assert res["matrices"]["top1"][0] != res["matrices"]["top1"][-1]  # the maps learned something


def test_cclip_runs_the_first_mtil_tasks_end_to_end(root, tmp_path, capsys, monkeypatch):
    """The first 3 tasks of Order II (mtil-order2:3) to fit the suite's time; the full 11 of Order I: the run
    docs/protocols.md times."""
    import cclip
    monkeypatch.setenv("CLIPFT_CACHE", str(tmp_path / "cache"))
    res = cclip.main(["--backbone", "tiny", "--tasks", "mtil-order2:3", "--data-root", str(root), "--method", "full",
                      "--steps", "3", "--batch-size", "4", "--lr", "1e-3", "--workers", "0", "--device", "cpu",
                      "--precision", "fp32", "--save-every", "0", "--out", str(tmp_path / "c")])
    printed = capsys.readouterr().out
    assert "| Transfer |" in printed and "top-1 (%)" in printed and "mean of I2T and T2I" not in printed
    out = _matrix_checks(tmp_path / "c", mtil.ORDERS["order2"][:3])
    assert res["rows"][0]["Last"] == pytest.approx(out["mtil"]["Last"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zscl", "lwf", "ewc"])
def test_each_continual_baseline_reports_mtil_transfer_average_last(name, root, tmp_path, capsys, monkeypatch):
    """Issue 68.6: the baselines on `--tasks mtil-order1:N` score MTIL's classification sets by top-1 (a raw
    KeyError on retrieval R@1 before), print ZSCL's Transfer / Average / Last and record them in results.json."""
    import importlib
    monkeypatch.setenv("CLIPFT_CACHE", str(tmp_path / "cache"))
    baseline = importlib.import_module(f"baselines.{name}")
    extra = ["--we-every", "2"] if name == "zscl" else []
    res = baseline.main(["--backbone", "tiny", "--tasks", "mtil-order1:2", "--data-root", str(root), "--steps", "2",
                         "--batch-size", "4", "--lr", "1e-3", "--workers", "0", "--device", "cpu", "--precision",
                         "fp32", "--save-every", "0", "--out", str(tmp_path / name), *extra])
    printed = capsys.readouterr().out
    assert "top-1 (%)" in printed and "mean of I2T and T2I" not in printed
    assert "| Transfer |" in printed and "| Average |" in printed and "| Last |" in printed
    out = _matrix_checks(tmp_path / name, mtil.ORDERS["order1"][:2])
    assert res["rows"][0]["Last"] == pytest.approx(out["mtil"]["Last"])
