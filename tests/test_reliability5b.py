"""Issue 69 (reliability pass 5), the cases after tests/test_reliability5.py's: MTIL's list, JSON, .mat and idx
files that are there but not in their format (one message naming the file and line, eval.py's too), a class-named
set with a folder too many, an image linked out of its dataset's folder, `--torchcompile` when the compiler fails,
and the minors of item 7. docs/reliability.md maps each case to its test."""
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

import common
import eval as ev
from lab import protocol_data
from plumbing import mtil

REPO = Path(__file__).resolve().parents[1]
RUN_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def mtil_root(tmp_path_factory):
    return protocol_data.write_mtil(tmp_path_factory.mktemp("mtil"))


def _copy(mtil_root, tmp_path, dataset):
    """The fixture's folder of one dataset under a fresh data root (the module's fixture stays as written)."""
    top = mtil.LAYOUTS[dataset].split("/")[0]
    shutil.copytree(mtil_root / top, tmp_path / "data" / top)
    return tmp_path / "data"


def _append(path, text):
    path.write_text(path.read_text() + text)


def _empty_mat(path):
    from scipy.io import savemat
    savemat(path, {})


# dataset -> (file under the root, how it is spoiled, what the message says, the line it names or None)
SPOILED = {
    "dtd-no-slash": ("DTD", "dtd/dtd/labels/test1.txt", lambda p: _append(p, "banded_0001.jpg\n"),
                     "'banded_0001.jpg' is not '<class>/<image>'", True),
    "aircraft-variant": ("Aircraft", "fgvc-aircraft-2013b/data/images_variant_test.txt",
                         lambda p: _append(p, "1234567 Concorde\n"), "variant 'Concorde' is not in", True),
    "mnist-truncated": ("MNIST", "MNIST/raw/t10k-images-idx3-ubyte", lambda p: p.write_bytes(p.read_bytes()[:200]),
                        "bytes of data, the file holds 184 (cut short)", False),
    "mnist-not-idx": ("MNIST", "MNIST/raw/t10k-labels-idx1-ubyte", lambda p: p.write_bytes(b"PK\x03\x04zip"),
                      "not an idx file", False),
    "pets-label": ("OxfordPet", "oxford-iiit-pet/annotations/test.txt", lambda p: _append(p, "Abyssinian_99 one 1 1\n"),
                   "class id 'one' is not a whole number", True),
    "food-json": ("Food", "food-101/meta/test.json", lambda p: p.write_text('{"apple_pie": ["apple_pie/1",]\n}'),
                  "not valid JSON", True),
    "food-shape": ("Food", "food-101/meta/test.json", lambda p: p.write_text('["apple_pie/1"]'),
                   "not a JSON object", False),
    "flowers-empty-setid": ("Flowers", "flowers-102/setid.mat", _empty_mat, "(it holds no variables)", False),
}


@pytest.mark.parametrize("case", sorted(SPOILED))
def test_a_spoiled_mtil_file_is_one_message_naming_the_file_and_line(case, mtil_root, tmp_path):
    """Issue 69.3: each was a traceback (ValueError, KeyError, JSONDecodeError) from the preflight. Now MissingMTIL
    naming the file (and the line where there is one), listed by mtil.missing beside the other sets, and eval.py's
    load_classification says the same."""
    dataset, rel, spoil, want, has_line = SPOILED[case]
    root = _copy(mtil_root, tmp_path, dataset)
    spoil(root / rel)
    with pytest.raises(mtil.MissingMTIL) as e:
        mtil.read(root, dataset, "test")
    msg = str(e.value)
    assert f"{root / rel}" in msg and want in msg and "\n" not in msg
    if has_line:
        assert f"{root / rel} line " in msg
    (line,) = mtil.missing(root, [dataset])
    assert line.startswith(f"{dataset}: ") and want in line
    with pytest.raises(common.DataError) as e:
        ev.load_classification(f"mtil:{dataset}", root)
    assert f"{root / rel}" in str(e.value) and want in str(e.value)


def test_the_preflight_of_a_spoiled_mtil_set_is_one_message_exit_1_no_traceback(mtil_root, tmp_path):
    """The same through the command line: `dns.py --tasks mtil-order1:4` (DTD is task 4) stops before any model
    loads with one message naming the file and line."""
    root = _copy(mtil_root, tmp_path, "DTD")
    for d in ("Aircraft", "Caltech101", "CIFAR100"):
        _copy(mtil_root, tmp_path, d)
    _append(root / "dtd/dtd/labels/train1.txt", "no_slash_here.jpg\n")
    r = subprocess.run([sys.executable, "dns.py", "--backbone", "tiny", "--tasks", "mtil-order1:4", "--data-root",
                        str(root), "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=300,
                       cwd=REPO, env=RUN_ENV)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{root / 'dtd/dtd/labels/train1.txt'} line " in r.stderr and "'no_slash_here.jpg'" in r.stderr
    assert not (tmp_path / "run" / "model.pt").exists()


def test_a_huge_mnist_file_is_refused_from_its_header_unread(mtil_root, tmp_path):
    """Issue 69.7: a 1 GiB file (sparse: no disk) behind a 12-image header was read whole before its shape was
    refused. Now the header and the file's size are compared first: the message, and well under 1 MiB read."""
    root = _copy(mtil_root, tmp_path, "MNIST")
    path = root / "MNIST/raw/t10k-images-idx3-ubyte"
    with path.open("r+b") as f:
        f.truncate(1 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(mtil.MissingMTIL) as e:
            mtil.read(root, "MNIST", "test")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(path) in str(e.value) and "(more than that)" in str(e.value)
    assert peak < 1 << 20, peak


def test_a_class_named_set_with_a_folder_too_many_names_it(mtil_root, tmp_path):
    """Issue 69.7: an extra folder in EuroSAT's 2750/ read 'label 10 but 10 class names' (and one sorting first
    shifted every class silently); a folder too few gave wrong classes without a word. Now one message naming the
    folder, the counts and the class folders it holds."""
    root = _copy(mtil_root, tmp_path, "EuroSAT")
    classes = root / "eurosat" / "2750"
    extra = classes / "AAA_notes"
    extra.mkdir()
    shutil.copy(next((classes / "Class0").iterdir()), extra / "x.jpg")
    with pytest.raises(common.DataError) as e:
        mtil.read(root, "EuroSAT", "test")
    msg = str(e.value)
    assert f"{classes} holds 11 class folders, ZSCL's EuroSAT has 10 classes" in msg and "AAA_notes" in msg
    shutil.rmtree(extra)
    shutil.rmtree(classes / "Class9")
    with pytest.raises(common.DataError, match="holds 9 class folders"):
        mtil.read(root, "EuroSAT", "test")


@pytest.mark.parametrize("how", ["link", "dotdot"])
def test_an_image_that_leads_out_of_its_dataset_folder_is_refused(mtil_root, tmp_path, how):
    """Issue 69.7: a symlinked image outside the data root was read silently. Now an image whose real path
    (links followed, a list file's '..' resolved) is outside the dataset's folder is one message naming it; a
    dataset folder that is itself a link elsewhere still reads."""
    root = _copy(mtil_root, tmp_path, "DTD")
    outside = tmp_path / "secret.jpg"
    listed = root / "dtd/dtd/labels/test1.txt"
    first = root / "dtd/dtd/images" / listed.read_text().splitlines()[0]
    shutil.copy(first, outside)
    if how == "link":
        first.unlink()
        first.symlink_to(outside)
    else:
        _append(listed, "class_0/../../../../../secret.jpg\n")
    with pytest.raises(common.DataError) as e:
        mtil.read(root, "DTD", "test")
    assert f"leads to {outside}, outside the dataset's folder" in str(e.value)
    moved = tmp_path / "elsewhere"
    shutil.copytree(mtil_root / "dtd", moved)
    linked = tmp_path / "linked_root"
    linked.mkdir()
    (linked / "dtd").symlink_to(moved)
    assert len(mtil.read(linked, "DTD", "test").labels) > 0


# ----------------------------------------------------------------------------- 7. minors: --help first, the lab
EARLY = {"baselines.imix": "imix.py", "baselines.unmix": "unmix.py", "baselines.maps": "maps.py",
         "lab.calibrate": "python -m lab.calibrate"}


@pytest.mark.parametrize("module", sorted(EARLY))
@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["--lr", "x"], 2)])
def test_these_commands_answer_help_and_bad_flags_before_torch_loads(module, argv, code):
    """Issue 69.7: they answered only after importing torch (40 s under load). Now their settings are torch-free
    (baselines/settings.py's MixBaselineConfig, maps' MapsSettings over dns.py's light head, calibrate's NAMES):
    -X importtime lists neither torch nor open_clip."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", module, *argv], capture_output=True, text=True,
                       timeout=120, cwd=REPO, env=RUN_ENV)
    imported = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    assert r.returncode == code and "torch" not in imported and "open_clip" not in imported, r.stderr[-1500:]
    said = r.stdout if code == 0 else r.stderr
    assert (f"usage: {EARLY[module]}" if code == 0 else f"{EARLY[module]}: error:") in said, said[-800:]
    assert "Traceback" not in r.stderr


def test_the_early_parsers_are_the_real_ones():
    """What answers first is what the run parses: maps' flags as the real MapsConfig (dns.py's and its own) lists
    them, in order, with the same defaults; calibrate's NAMES are its CALIBRATIONS."""
    import contextlib
    import io
    import re

    from baselines import maps
    from lab import calibrate
    r = subprocess.run([sys.executable, "-m", "baselines.maps", "--help"], capture_output=True, text=True,
                       timeout=120, cwd=REPO, env=RUN_ENV)
    real = io.StringIO()
    with contextlib.redirect_stdout(real), pytest.raises(SystemExit):
        common.parse_config(maps.MapsConfig, ["--help"])
    options = [re.sub(r"\s+", " ", text[text.index("options:"):]) for text in (r.stdout, real.getvalue())]
    assert options[0] == options[1] and "--ewc-lambda EWC_LAMBDA" in options[0] and "--lambda-min" in options[0]
    assert calibrate.NAMES == tuple(calibrate.CALIBRATIONS)


def test_the_mix_baselines_run_on_the_tiny_world(tmp_path, monkeypatch):
    """Issue 69.7: `python -m baselines.imix|unmix --backbone tiny` refused with "run the method's command with
    it", the command that was run. Now their main() takes the lab's world as the method files' do (the whole run
    measured by hand: 78 s, a ZS and an i-Mix row on synthetic-short); here the world handed on is checked."""
    import lab
    from baselines import imix, mixrun, unmix
    seen = []
    monkeypatch.setattr(mixrun, "run", lambda cfg, net, method, world=None: seen.append((method, world)))
    imix.main(["--backbone", "tiny", "--out", str(tmp_path / "i")])
    unmix.main(["--backbone", "tiny", "--out", str(tmp_path / "u")])
    assert seen == [("imix", lab.WORLD), ("unmix", lab.WORLD)]
