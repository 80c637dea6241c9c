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
from plumbing.base import DataError, RunError
import eval as ev
from lab import protocol_data
from protocols import mtil
from plumbing.flags import DEFAULT_LORA_TARGETS, Config, parse_config

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
    with pytest.raises(DataError) as e:
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
    with pytest.raises(DataError) as e:
        mtil.read(root, "EuroSAT", "test")
    msg = str(e.value)
    assert f"{classes} holds 11 class folders, ZSCL's EuroSAT has 10 classes" in msg and "AAA_notes" in msg
    shutil.rmtree(extra)
    shutil.rmtree(classes / "Class9")
    with pytest.raises(DataError, match="holds 9 class folders"):
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
    with pytest.raises(DataError) as e:
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
        parse_config(maps.MapsConfig, ["--help"])
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


# ----------------------------------------------------------------------------- 7. minors: --override-resume
def _train(tiny_random, data, out, **kw):
    import lab
    from plumbing import models
    model = models.load_model("tiny", "random")[0]
    models.pair_bias(model, kw.get("loss", "clip"))  # --loss siglip's logit_bias, as the methods' main() add it
    cfg = Config(**{**dict(steps=4, batch_size=8, lr=1e-3, warmup=1, workers=0, precision="fp32", out=str(out),
                                  save_every=0, log_every=1, device="cpu", seed=0), **kw})
    return common.train(cfg, lab.ClipFineTune(model), common.ManifestDataset(data, tiny_random[1]),
                        common.Collate(tiny_random[3]), export=False)


@pytest.mark.parametrize("first, then, says", [
    ({}, {"lora": 4}, "--lora 0 -> 4 since the checkpoint"),
    ({"lora": 4}, {"lora": 4, "lora_targets": "attn.in_proj_weight"},
     f"--lora-targets {DEFAULT_LORA_TARGETS} -> attn.in_proj_weight since the checkpoint"),
    ({}, {"loss": "siglip"}, "--loss clip -> siglip since the checkpoint"),
])
def test_override_resume_after_a_changed_model_setting_names_it(tiny_random, tmp_path, first, then, says):
    """Issue 69.7: a changed --lora / --lora-targets / --loss under --override-resume read "another model's
    weights ... resume with the run's --backbone". Now the message names the setting that changed, both values,
    and how to go on; torch's line comes shortened at a word (plumbing.base.shorten), not cut by [:200]."""
    import lab
    data = lab.synthetic_manifest("train", tmp_path / "data", n=16)
    out = tmp_path / "run"
    _train(tiny_random, data, out, stop_at=2, **first)
    with pytest.raises(RunError) as e:
        _train(tiny_random, data, out, resume="latest", override_resume=True, **then)
    msg = str(e.value)
    assert "holds another model's weights" in msg and says in msg and "--backbone" not in msg, msg
    assert "resume with the run's value" in msg and "--overwrite" in msg


def test_shorten_cuts_at_a_word_and_says_so():
    from plumbing.base import shorten
    assert shorten("a  b\nc") == "a b c"
    text = "Missing key(s) in state_dict: " + ", ".join(f'"visual.transformer.resblocks.{k}.attn"' for k in range(40))
    short = shorten(text)
    assert len(short) <= 200 and short.endswith(" more characters)") and '"visual.transformer.resblocks.' in short
    kept = short.split(" ... (")[0]
    assert text.startswith(kept) and text[len(kept)] in ", "  # cut at a word
    assert int(short.split(" ... (")[1].split()[0]) == len(text) - len(kept)


def test_siglip_with_label_smoothing_is_refused_when_asked_and_noted_when_a_default(capsys):
    """Issue 69.7: --loss siglip ignored --label-smoothing silently (erclip's default 0.1). Asked for, the pair is
    refused at parse time; erclip's default is one line saying it is not applied; --loss clip says nothing."""
    import erclip
    from plumbing import base
    base.warn_once.cache_clear()
    with pytest.raises(SystemExit) as e:
        parse_config(erclip.ERCLIPConfig, ["--loss", "siglip", "--label-smoothing=0.2"])
    assert e.value.code == 2 and "--label-smoothing 0.2 with --loss siglip" in capsys.readouterr().err
    assert parse_config(erclip.ERCLIPConfig, ["--loss", "siglip", "--label-smoothing", "0"]).loss == "siglip"
    assert capsys.readouterr().err == ""
    parse_config(erclip.ERCLIPConfig, ["--loss", "siglip"])
    parse_config(erclip.ERCLIPConfig, ["--loss", "siglip"])  # answer_early and main() both parse
    err = capsys.readouterr().err
    assert err.count("default --label-smoothing 0.1 (of CLIP's loss) is not applied") == 1
    parse_config(erclip.ERCLIPConfig, [])
    assert "label smoothing" not in capsys.readouterr().err


@pytest.mark.parametrize("name", ["objectnet", "imagenet-v2"])
def test_an_imagenet_shift_with_absent_class_folders_says_which_and_how_many(tmp_path, capsys, name):
    """Issue 69.7: ObjectNet's mapped folders and ImageNet-V2's index folders that were absent were skipped
    without a word (an accuracy over part of the set, reported as the set's). Now one line names them and their
    count, and the protocol string that goes into results.json says it; the whole layout says nothing."""
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

    from plumbing import base
    from protocols import imagenet_shifts
    root = protocol_data.write_imagenet_shifts(tmp_path / "data")
    base.warn_once.cache_clear()
    whole = imagenet_shifts.read(name, root, IMAGENET_CLASSNAMES)
    assert "absent" not in whole["protocol"] and "absent" not in capsys.readouterr().err
    folder = root / imagenet_shifts.FOLDERS[name]
    gone = ([f for f, _, _ in imagenet_shifts.OBJECTNET][-3:] if name == "objectnet" else ["997", "998", "999"])
    for g in gone:
        shutil.rmtree(folder / g)
    total = 113 if name == "objectnet" else 1000
    got = imagenet_shifts.read(name, root, IMAGENET_CLASSNAMES)
    err = capsys.readouterr().err
    assert f"[{name}] 3 of the {total} class folders it reads are absent under {folder}, skipped: " in err
    assert all(g in err for g in gone) and err.count("\n") == 1
    assert f"3 of its {total} class folders absent" in got["protocol"]


# ----------------------------------------------------------------------------- 3. --torchcompile's build fails
def _compile_argv(tmp_path, evaluate: bool):
    import lab
    root = tmp_path / "data"
    lab.synthetic_manifest("train", root, n=16)
    return ["--data-root", str(root), "--train-data", "synthetic", "--train-pairs", "16", "--batch-size", "8",
            "--steps", "2", "--warmup", "0", "--lr", "1e-3", "--workers", "0", "--device", "cpu", "--eval-tasks",
            "synthetic-short" if evaluate else "none", "--no-eval-base", "--save-every", "0", "--torchcompile",
            "--out", str(tmp_path / "run")]


def _cli(argv, capsys):
    import erclip
    from plumbing import cli
    with pytest.raises(SystemExit) as e:
        cli.cli(erclip.main, argv)
    return e.value.code, capsys.readouterr().err


@pytest.fixture
def _dynamo_reset():
    import torch
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_compiler_that_fails_at_the_first_step_is_one_message_naming_torchcompile(tmp_path, capsys,
                                                                                   _dynamo_reset):
    """Issue 69.3: --torchcompile with no working C++ compiler ended in inductor's traceback. Inductor itself runs
    here, its compiler set to /bin/false (it fails at once, no build): one message naming --torchcompile, that
    nothing was saved, and the command without it; exit 1."""
    import torch._inductor.config as inductor_config
    with inductor_config.patch({"cpp.cxx": (None, "/bin/false")}):
        code, err = _cli(_compile_argv(tmp_path, evaluate=False), capsys)
    assert code == 1 and "Traceback" not in err, err[-2000:]
    said = err[err.index("error: "):]
    assert said.startswith("error: --torchcompile: torch.compile could not build the model (InvalidCxxCompiler: ")
    assert "nothing saved in" in said and "Run without --torchcompile" in said
    assert "--torchcompile" not in said.splitlines()[-1] and "--resume" not in said.splitlines()[-1]


def test_a_compile_that_fails_after_the_last_checkpoint_names_what_is_kept_and_goes_on_without_it(
        tmp_path, capsys, monkeypatch, _dynamo_reset):
    """The build fails when the evaluation after training compiles its own graphs (grad off): after the last
    checkpoint and model.pt. The message names --torchcompile, what is kept and the resume command without it,
    and that command finishes the run (--torchcompile is not a resume setting: the same math and names)."""
    import shlex

    import erclip
    from torch._dynamo.backends.registry import lookup_backend
    from torch._inductor.exc import InvalidCxxCompiler

    from plumbing import models

    def backend(gm, example_inputs):  # aot_eager while training; the C++ compiler "fails" for the evaluation's
        if not torch.is_grad_enabled():
            raise InvalidCxxCompiler()
        return lookup_backend("aot_eager")(gm, example_inputs)
    import torch
    monkeypatch.setattr(models, "COMPILE_BACKEND", backend)
    code, err = _cli(_compile_argv(tmp_path, evaluate=True), capsys)
    assert code == 1 and "Traceback" not in err, err[-2000:]
    said = err[err.index("error: "):]
    assert said.startswith("error: --torchcompile: torch.compile could not build the model (InvalidCxxCompiler")
    assert f"kept in {tmp_path / 'run'}: checkpoints/last.pt, model.pt (finished training is not repeated" in said
    command = shlex.split(said.splitlines()[-1])
    assert command[-2:] == ["--resume", "latest"] and "--torchcompile" not in command
    erclip.main(command[2:])
    assert (tmp_path / "run" / "results.json").exists()


def test_an_imagenet_shift_image_linked_out_of_its_folder_is_refused(tmp_path):
    """Issue 69.7, as MTIL's: ImageNet-Sketch's image that is a link out of sketch/ is one message naming it."""
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

    from protocols import imagenet_shifts
    root = protocol_data.write_imagenet_shifts(tmp_path / "data")
    first = sorted((root / "sketch").rglob("*.JPEG"))[0]
    outside = tmp_path / "secret.JPEG"
    shutil.move(first, outside)
    first.symlink_to(outside)
    with pytest.raises(DataError) as e:
        imagenet_shifts.read("imagenet-sketch", root, IMAGENET_CLASSNAMES)
    said = f"imagenet-sketch: {first} leads to {outside}, outside the dataset's folder {root / 'sketch'}"
    assert said in str(e.value)
