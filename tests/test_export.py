"""Issue 41.2: an export is written whole or not at all (plumbing.folders). A SIGKILL at any point of writing a
folder leaves the previous folder or the new one (never model B's weights beside model A's config), loadable; an
interrupt says what was and was not written; a full disk is one message; files get the process's umask
(safetensors writes 0600); --export is checked before training, and an export failing after training keeps the
run's results and names the command. Issue 42.6: the exported folder is accepted back as --pretrained."""
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import common
from plumbing.flags import Config
import erclip
from plumbing import base, cli, folders, models
from commands import export
import lab

REPO = Path(__file__).resolve().parents[1]
IMAGE = torch.randn(2, 3, lab.IMAGE_SIZE, lab.IMAGE_SIZE, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def two_exports(tmp_path_factory):
    """Two exports of different tiny models, A and B: {name: (folder, image features)}."""
    root, out = tmp_path_factory.mktemp("exports"), {}
    for seed, name in ((0, "A"), (1, "B")):
        torch.manual_seed(seed)
        model = models.load_model("tiny", "random")[0].eval()
        with torch.no_grad():
            out[name] = (models.export_open_clip(model, root / name, "tiny"), model.encode_image(IMAGE))
    return out


def _digest(folder: Path) -> dict:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in folder.iterdir()} if folder.is_dir() else {}


def _which(folder: Path, exports) -> str | None:
    """'A' or 'B' when `folder` holds exactly that export's files (byte for byte), else None (mixed, missing)."""
    return next((name for name, (src, _) in exports.items() if _digest(folder) == _digest(src)), None)


# A child process (the standard library and plumbing.folders only: no torch) writes export A into `target`, then
# export B over it, and SIGKILLs itself at STAGE of the second write (models.EXPORT_RECEIPT spelled out).
_CHILD = r"""
import os, shutil, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from plumbing import folders
target, a, b, stage = Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
def kill():
    os.kill(os.getpid(), signal.SIGKILL)
def copy(src, die_after=()):
    def write(tmp):
        for name in ("open_clip_model.safetensors", "open_clip_config.json"):
            shutil.copyfile(src / name, tmp / name)
            if name in die_after:
                kill()
    return write
folders.atomic_folder(target, copy(a), marker="export_receipt.json")
real_exchange, real_replace, real_remove = folders._exchange, os.replace, folders._remove
if stage == "exchange":
    folders._exchange = lambda x, y: real_exchange(x, y) and kill()
if stage in ("aside", "aside-moved"):
    folders._exchange = lambda x, y: False
    calls = []
    def replace(x, y):
        calls.append(x)
        if stage == "aside" and len(calls) == 1:
            kill()
        real_replace(x, y)
        if stage == "aside-moved" and len(calls) == 1:
            kill()
    os.replace = replace
if stage == "cleanup":
    folders._remove = lambda p: kill() if ".old-" in str(p) else real_remove(p)
folders.atomic_folder(target, copy(b, {"weights": ["open_clip_model.safetensors"],
                                       "config": ["open_clip_config.json"]}.get(stage, ())),
                      marker="export_receipt.json")
"""


@pytest.mark.parametrize("stage", ["weights", "config", "exchange", "aside", "aside-moved", "cleanup"])
def test_a_kill_at_any_point_leaves_the_old_folder_or_the_new_one(tmp_path, two_exports, stage):
    """Both files of one model, never one of each, after the kill (a reader finds A or B; only in the fallback
    without renameat2, between its two renames, is the folder missing) and after recovery, when the folder loads
    as that model (the same features)."""
    target = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-c", _CHILD, str(REPO), str(target), str(two_exports["A"][0]),
                           str(two_exports["B"][0]), stage])
    assert done.returncode == -signal.SIGKILL
    assert _which(target, two_exports) in ("A", "B") or (stage == "aside-moved" and not target.exists())
    folders.recover(target)
    want = "B" if stage in ("exchange", "cleanup") else "A"
    assert _which(target, two_exports) == want and not folders.leftovers(target)
    with torch.no_grad():
        assert torch.equal(models.load_model("tiny", str(target))[0].eval().encode_image(IMAGE), two_exports[want][1])


@pytest.mark.slow
def test_the_export_command_killed_as_each_file_appears_leaves_a_loadable_old_or_new_folder(tmp_path, two_exports):
    """The real command (python -m lab export) over export A, SIGKILLed as soon as each file of the new export
    appears in its temporary folder: the folder is A or the new export, byte for byte, and loads."""
    torch.manual_seed(1)
    run_model = models.save_model(models.load_model("tiny", "random")[0], tmp_path / "run" / "model.pt", "tiny")
    new = models.export_open_clip(models.load_model("tiny", str(run_model))[0], tmp_path / "new", "tiny")
    target = tmp_path / "exported"
    for wait_for in ("open_clip_model.safetensors", "open_clip_config.json"):
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(two_exports["A"][0], target)
        child = subprocess.Popen([sys.executable, "-m", "lab", "export", "--backbone", "tiny", "--pretrained",
                                  str(run_model), "--out", str(target)], cwd=REPO, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while child.poll() is None and time.time() < deadline:
            if any((p / wait_for).exists() for p in folders.leftovers(target)):
                break
            time.sleep(0.005)
        child.kill()
        child.wait()
        assert _which(target, {"A": two_exports["A"], "new": (new, None)}) in ("A", "new")
        models.load_model("tiny", str(target))
        folders.recover(target)
        assert _which(target, {"A": two_exports["A"], "new": (new, None)}) in ("A", "new")
        assert not folders.leftovers(target)


def test_an_interrupt_says_what_was_written_and_that_the_previous_folder_is_unchanged(tmp_path):
    """Ctrl-C or SIGTERM while writing: what had been written (removed), the previous folder unchanged, exit 128 +
    signal (SIGTERM's 143, not Ctrl-C's 130)."""
    target = tmp_path / "exported"
    folders.atomic_folder(target, lambda t: (t / "open_clip_config.json").write_text("old"))

    def interrupted(signum):
        def write(tmp):
            (tmp / "open_clip_model.safetensors").write_text("new")
            raise base.Interrupted(signum) if signum != signal.SIGINT else KeyboardInterrupt
        return write
    for signum in (signal.SIGINT, signal.SIGTERM):
        with pytest.raises(folders.FolderInterrupted) as e:
            folders.atomic_folder(target, interrupted(signum))
        assert e.value.code == 128 + signum and not e.value.in_place
        assert f"interrupted (signal {signum}) while writing the export {target}" in str(e.value)
        assert "open_clip_model.safetensors had been written to a temporary folder and were removed" in str(e.value)
        assert f"the previous folder at {target} is unchanged" in str(e.value)
    assert _contents(target) == {"old"} and not folders.leftovers(target)


def test_a_signal_as_the_folder_is_put_in_place_waits_until_it_is_complete(tmp_path, monkeypatch, request):
    """A SIGINT between the renames is held back, then raised: the new folder is complete there and the message
    says so (before, a KeyboardInterrupt could fall between moving the old folder aside and the new one in)."""
    target = tmp_path / "exported"
    folders.atomic_folder(target, lambda t: (t / "open_clip_config.json").write_text("old"))
    monkeypatch.setattr(folders, "_exchange", lambda a, b: False)  # the two-rename fallback
    real = os.replace
    # the handler a script starts with (Python's Ctrl-C), whatever this worker's earlier tests left
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))

    def replace(a, b):
        # raise_signal is raise(3): the signal goes to this thread and its C handler has run when it returns,
        # and Python runs the handler installed now before the next line, so it lands between the renames
        # every time. (os.kill(getpid()) before, with a 10 ms sleep, was flaky, issue 68.5: a signal sent to
        # the process may be taken by any of its threads - an xdist worker's I/O thread, torch's pool - and
        # under load that thread ran its handler only after the renames, with the process's handler back.)
        signal.raise_signal(signal.SIGINT)
        real(a, b)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(folders.FolderInterrupted, match="as the export .* was put in place: it is complete there") \
            as e:
        folders.atomic_folder(target, lambda t: (t / "open_clip_config.json").write_text("new"))
    assert e.value.in_place and e.value.code == 130
    assert _contents(target) == {"new"}


def _contents(folder: Path) -> set:
    """The texts of a folder's files, its export receipt left out."""
    return {f.read_text() for f in folder.iterdir() if f.name != models.EXPORT_RECEIPT} if folder.is_dir() else set()


def _safetensors_full(*args, **kwargs):
    """What safetensors' save_file raises on a full disk (measured on a 1 MiB tmpfs): not an OSError."""
    from safetensors import SafetensorError
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def test_a_full_disk_is_one_message_for_the_export_and_the_runs_safetensors(tmp_path, monkeypatch, capsys):
    """ENOSPC from safetensors (a SafetensorError, not an OSError) or an OSError: one message, the previous
    export unchanged, no traceback; the run's model.safetensors twin: the ENOSPC message every full disk gets."""
    torch.manual_seed(0)
    model = models.load_model("tiny", "random")[0]
    run_model = models.save_model(model, tmp_path / "run" / "model.pt", "tiny")
    target = tmp_path / "exported"
    folders.atomic_folder(target, lambda t: (t / "open_clip_config.json").write_text("old"),
                          marker=models.EXPORT_RECEIPT)
    import safetensors.torch
    monkeypatch.setattr(safetensors.torch, "save_file", _safetensors_full)
    with pytest.raises(SystemExit) as e:
        cli.cli(export.main, ["--pretrained", str(run_model), "--out", str(target)])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert f"no space left on device (or over quota) while writing the export {target}" in err
    assert f"the previous folder at {target} is unchanged" in err
    assert _contents(target) == {"old"} and not folders.leftovers(target)
    with pytest.raises(base.RunError, match="nothing was made at"):
        folders.atomic_folder(tmp_path / "fresh", lambda t: _safetensors_full())
    with pytest.raises(base.RunError, match="no space left"):  # quota, as an OSError
        folders.atomic_folder(tmp_path / "fresh", lambda t: (_ for _ in ()).throw(OSError(errno.EDQUOT, "quota")))
    assert not (tmp_path / "fresh").exists()
    with pytest.raises(OSError) as e:
        models.save_model(model, tmp_path / "run2" / "model.pt", "tiny")
    assert e.value.errno == errno.ENOSPC and "no space left" in cli.expected_error(e.value)[0]


def test_the_export_command_interrupted_names_the_export_not_training(tmp_path, monkeypatch, capsys):
    """SIGTERM while `python -m commands.export` reads the model said "interrupted before training saved anything
    in --out; nothing to resume"; now it names the export and that nothing was written, exit 143. While it writes:
    which files had been written (and removed), the previous export unchanged."""
    torch.manual_seed(0)
    run_model = models.save_model(models.load_model("tiny", "random")[0], tmp_path / "run" / "model.pt", "tiny")
    target = tmp_path / "exported"
    argv = ["--pretrained", str(run_model), "--out", str(target)]

    def term(*args, **kwargs):
        raise base.Interrupted(signal.SIGTERM)
    real_load = models.load_model
    monkeypatch.setattr(models, "load_model", term)
    with pytest.raises(SystemExit) as e:
        cli.cli(export.main, argv)
    err = capsys.readouterr().err
    assert e.value.code == 143 and "training" not in err
    assert f"interrupted (signal 15) while reading {run_model}" in err
    assert f"before anything was written to {target}: nothing there changed" in err
    monkeypatch.setattr(models, "load_model", real_load)
    cli.cli(export.main, argv)
    before = _digest(target)
    real_save = models.safetensors_save

    def save_then_term(sd, path):
        real_save(sd, path)
        term()
    monkeypatch.setattr(models, "safetensors_save", save_then_term)
    with pytest.raises(SystemExit) as e:
        cli.cli(export.main, argv)
    err = capsys.readouterr().err
    assert e.value.code == 143 and "training" not in err
    assert "open_clip_model.safetensors had been written to a temporary folder and were removed" in err
    assert f"the previous folder at {target} is unchanged" in err
    assert _digest(target) == before and not folders.leftovers(target)


def test_exported_files_and_the_runs_safetensors_follow_the_umask(tmp_path):
    """safetensors' save_file creates 0600 files; the export's files and the run's model.safetensors twin get the
    process's umask like every other file (here 027: the group reads)."""
    model = models.load_model("tiny", "random")[0]
    old = os.umask(0o027)
    try:
        folder = models.export_open_clip(model, tmp_path / "hub", "tiny")
        models.save_model(model, tmp_path / "run" / "model.pt", "tiny")
    finally:
        os.umask(old)
    modes = {f.name: f.stat().st_mode & 0o777 for f in folder.iterdir()}
    assert modes == {"open_clip_model.safetensors": 0o640, "open_clip_config.json": 0o640,
                     models.EXPORT_RECEIPT: 0o640}
    assert folder.stat().st_mode & 0o777 == 0o750
    assert {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "run").iterdir()} == {
        n: 0o640 for n in ("model.pt", "model.pt.json", "model.safetensors", "model.safetensors.json")}


def _unwritable(tmp_path) -> Path | None:
    """A folder this process cannot create folders in (root ignores modes: a read-only /sys), or None."""
    if os.geteuid() != 0:
        (tmp_path / "locked").mkdir(mode=0o555)
        return tmp_path / "locked"
    try:
        os.rmdir(tempfile.mkdtemp(dir="/sys"))
    except OSError:
        return Path("/sys")
    return None


def test_the_export_folder_is_checked_before_anything_runs(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "thesis.tex").write_text("x")
    folders.atomic_folder(tmp_path / "previous", lambda t: (t / "open_clip_config.json").write_text("{}"),
                          marker=models.EXPORT_RECEIPT)
    with pytest.raises(base.UsageError, match="a file is there"):
        models.check_export(tmp_path / "file")
    with pytest.raises(base.UsageError, match="not a folder this repository exported .*: thesis.tex"):
        models.check_export(tmp_path / "notes")
    with pytest.raises(base.UsageError, match=f"{tmp_path / 'file'} is a file, not a folder"):
        models.check_export(tmp_path / "file" / "exported")  # under a file
    with pytest.raises(base.UsageError, match="the name of an interrupted write's temporary copy"):
        models.check_export(tmp_path / ".previous.new-123")
    locked = _unwritable(tmp_path)
    if locked is not None:
        with pytest.raises(base.UsageError, match=f"cannot write in {locked}"):
            models.check_export(locked / "exported")
    for fine in ("previous", "new/deeper"):
        models.check_export(tmp_path / fine)
    (tmp_path / "empty").mkdir()
    models.check_export(tmp_path / "empty")
    models.check_export(tmp_path / "run" / "exported", out=tmp_path / "run")  # inside --out: fine
    data = lab.synthetic_manifest("train", tmp_path / "data", n=16)
    for export_to, out in (("notes", "run"), ("run", "run"), ("runs", "runs/x")):  # --out the export or in it
        cfg = Config(steps=2, batch_size=8, workers=0, precision="fp32", out=str(tmp_path / out),
                            device="cpu", export=str(tmp_path / export_to))
        with pytest.raises(base.UsageError, match=f"--export .*{export_to}"):
            common.preflight(cfg, [data])
        assert not (tmp_path / out).exists()  # refused before the run folder was made


def _run_folder(folder: Path) -> dict:
    """A run folder as a method run leaves it (config.json among its files, as every run folder has): {name:
    bytes}."""
    files = {"config.json": b"{}", "results.json": b"{}", "metrics.jsonl": b"{}\n", "model.pt": b"weights",
             "checkpoints/step-2.pt": b"state"}
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return files


def _unchanged(folder: Path, files: dict) -> bool:
    return all((folder / name).read_bytes() == data for name, data in files.items()) and \
        sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == sorted(files)


def test_an_export_never_replaces_a_folder_it_did_not_write(tmp_path, tiny_random, capsys):
    """Issue 55.1: any folder holding a config.json counted as a previous export and was replaced whole: `python
    -m lab export --out runs/victim` and `erclip.py --export runs/victim2` removed another run's checkpoints,
    metrics and model, and a transformers model folder lost its weights and README. Now an export replaces only
    a folder holding its own receipt and nothing it does not list; every other folder is one message naming what
    it holds, before anything is read or trained, and is left byte for byte."""
    run_model = models.save_model(tiny_random[0], tmp_path / "good" / "model.pt", "tiny")
    victim = tmp_path / "runs" / "victim"
    kept = _run_folder(victim)
    with pytest.raises(SystemExit) as e:
        cli.cli(export.main, ["--pretrained", str(run_model), "--out", str(victim)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert f"--out {victim}: it is not a folder this repository exported" in err
    assert "checkpoints/, config.json, metrics.jsonl, model.pt, results.json" in err
    assert _unchanged(victim, kept)

    victim2 = tmp_path / "runs" / "victim2"  # a method run's --export: refused before its run folder is made
    kept2 = _run_folder(victim2)
    with pytest.raises(SystemExit) as e:
        cli.cli(erclip.main, ["--backbone", "tiny", "--steps", "1", "--batch-size", "8", "--workers", "0",
                              "--out", str(tmp_path / "run"), "--eval-tasks", "", "--export", str(victim2),
                              "--device", "cpu", "--data-root", str(tmp_path / "data"), "--train-pairs", "16"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--export {victim2}: it is not a folder this repository exported" in err
    assert _unchanged(victim2, kept2) and not (tmp_path / "run" / "model.pt").exists()

    hf = tmp_path / "hf-model"  # a downloaded transformers model
    hf_files = {"config.json": b"{}", "pytorch_model.bin": b"weights", "README.md": b"# card"}
    for name, data in hf_files.items():
        hf.mkdir(exist_ok=True)
        (hf / name).write_bytes(data)
    with pytest.raises(base.UsageError, match="README.md, config.json, pytorch_model.bin"):
        models.check_export(hf, "--out")
    assert _unchanged(hf, hf_files)

    ours = models.export_open_clip(tiny_random[0], tmp_path / "exported", "tiny")  # a previous export: replaced
    (ours / "notes.txt").write_text("mine")  # ... but not once a user has added a file to it
    with pytest.raises(base.UsageError, match="it holds what an export does not write: notes.txt"):
        models.check_export(ours)
    (ours / "notes.txt").unlink()
    (ours / models.EXPORT_RECEIPT).write_text('{"written_by": "someone else", "files": []}')
    with pytest.raises(base.UsageError, match="not a folder this repository exported"):
        models.check_export(ours)


def test_an_export_replaces_its_own_previous_export(tmp_path, two_exports):
    """The receipt lists exactly what the export wrote, and an export over a previous one (copied, as a user
    moves it) goes through: the folder holds the new model's files."""
    (tmp_path / "exported").mkdir()
    shutil.copytree(two_exports["A"][0], tmp_path / "exported" / "x")
    receipt = json.loads((tmp_path / "exported" / "x" / models.EXPORT_RECEIPT).read_text())
    assert receipt["files"] == ["open_clip_config.json", "open_clip_model.safetensors"]
    model = models.load_model("tiny", str(two_exports["B"][0]))[0]
    models.export_open_clip(model, tmp_path / "exported" / "x", "tiny")
    assert _which(tmp_path / "exported" / "x", two_exports) == "B"


def test_an_export_failing_after_training_keeps_the_results_names_the_command_and_exits_1(tmp_path, monkeypatch,
                                                                                        capsys):
    """A method run whose export fails after training: the run goes on, results.json is written, then one message
    with the command that exports the saved model and exit 1 (it exited 0 with the export missing)."""
    def full(*a, **kw):
        raise base.RunError("no space left on device while writing hub")
    monkeypatch.setattr(models, "export_open_clip", full)
    out, hub = tmp_path / "run", tmp_path / "hub"
    with pytest.raises(SystemExit) as e:
        cli.cli(erclip.main, ["--backbone", "tiny", "--steps", "1", "--batch-size", "8", "--workers", "0",
                              "--out", str(out), "--eval-tasks", "", "--export", str(hub), "--device", "cpu",
                              "--data-root", str(tmp_path / "data"), "--train-pairs", "16"])
    err = capsys.readouterr().err
    command = f"python -m commands.export --backbone tiny --pretrained {out / 'model.pt'} --out {hub}"
    assert e.value.code == 1 and f"export the saved model later with: {command}" in err
    assert f"error: the run finished and its results are in {out / 'results.json'}, but its --export failed: " \
           f"no space left" in err and err.rstrip().endswith(command)
    summary = json.loads((out / "results.json").read_text())["summary"]
    assert summary["export_command"] == command and "no space left" in summary["export_failed"]


def test_an_interrupt_during_a_runs_export_stops_the_run_and_names_what_is_saved(tmp_path, monkeypatch):
    """SIGTERM while a run exports: the run stops (it went on to evaluate as if the export had merely failed),
    saying that training finished and its model is saved, with the commands that finish the run or export it."""
    data = lab.synthetic_manifest("train", tmp_path / "data", n=16)
    model, train_tf, _, tok = models.load_model("tiny", "random")
    cfg = Config(steps=2, batch_size=8, workers=0, precision="fp32", out=str(tmp_path / "run"), log_every=1,
                        device="cpu", export=str(tmp_path / "hub"))

    real_fsync = folders._fsync

    def fsync_then_term(path, folder=False):  # SIGTERM once the export's weights are written
        real_fsync(path, folder)
        if str(path).endswith("open_clip_model.safetensors"):
            raise base.Interrupted(signal.SIGTERM)
    monkeypatch.setattr(folders, "_fsync", fsync_then_term)
    with pytest.raises(base.RunError) as e:
        common.train(cfg, lab.ClipFineTune(model), common.ManifestDataset(data, train_tf), common.Collate(tok))
    message = str(e.value)
    assert e.value.code == 143 and f"while writing the export {tmp_path / 'hub'}" in message
    assert f"Training had finished and its model is saved as {tmp_path / 'run' / 'model.pt'}" in message
    assert "--resume latest" in message and "python -m commands.export --backbone tiny" in message
    assert not (tmp_path / "hub").exists() and not folders.leftovers(tmp_path / "hub")
    assert (tmp_path / "run" / "model.pt").is_file() and not (tmp_path / "run" / "results.json").exists()


def test_an_exported_folder_is_accepted_back_as_pretrained(tmp_path, tiny_random):
    """Issue 42.6: `--pretrained exported/x` or `local-dir:exported/x` was "neither a file nor an open_clip tag";
    now open_clip builds the model from the folder's own config: the same features, the same tokens."""
    model, _, _, tok = tiny_random
    folder = models.export_open_clip(model, tmp_path / "exported" / "x", "tiny")
    for ref in (str(folder), f"local-dir:{folder}"):
        again, _, _, tok2 = models.load_model("tiny", ref)
        assert torch.equal(tok(["a red circle"]), tok2(["a red circle"]))
        with torch.no_grad():
            assert torch.equal(model.encode_image(IMAGE), again.encode_image(IMAGE))
            assert torch.equal(model.encode_text(tok(["a red circle"])), again.encode_text(tok2(["a red circle"])))
    (tmp_path / "other").mkdir()
    with pytest.raises(base.UsageError, match="not open_clip's hub layout"):
        models.load_model("tiny", str(tmp_path / "other"))


def test_a_method_run_starts_from_an_exported_folder(tmp_path, tiny_random):
    """An exported tiny model back into erclip.py as --pretrained local-dir:DIR (DIR alone goes the same way:
    the test above): at --lr 1e-30 (0 is refused; only the zero-initialised biases move, by ~1e-32) the run's
    saved model has the export's embeddings (another model would differ by ~1), its sidecar the backbone."""
    model, _, _, tok = tiny_random
    folder = models.export_open_clip(model, tmp_path / "exported", "tiny")
    out = tmp_path / "run"
    erclip.main(["--backbone", "tiny", "--pretrained", f"local-dir:{folder}", "--steps", "1", "--batch-size", "8",
                 "--workers", "0", "--lr", "1e-30", "--out", str(out), "--eval-tasks", "", "--device", "cpu",
                 "--data-root", str(tmp_path / "data"), "--train-pairs", "16"])
    again, _, _, tok2 = models.load_model("tiny", str(out / "model.pt"))
    with torch.no_grad():
        pairs = [(model.eval().encode_image(IMAGE), again.eval().encode_image(IMAGE)),
                 (model.encode_text(tok(["a red circle"])), again.encode_text(tok2(["a red circle"])))]
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in pairs)
    assert json.loads((out / "model.pt.json").read_text())["model"] == models.TINY_NAME


def test_an_export_of_another_architecture_is_refused_under_another_backbone(tmp_path, tiny_random):
    """`--backbone ViT-B/32 --pretrained exported/tiny` trained the tiny model and saved it as ViT-B-32 (a
    sidecar and an export that then fail to load); now one message naming the backbone it holds."""
    folder = models.export_open_clip(tiny_random[0], tmp_path / "exported", "tiny")
    with pytest.raises(base.UsageError, match=f"holds a {models.TINY_NAME} model, not ViT-B-32 .*--backbone tiny"):
        models.load_model("ViT-B/32", str(folder))


def test_an_interrupted_exports_leftovers_are_never_loaded(tmp_path, tiny_random):
    """A killed export's temporary or set-aside copy is refused by name, and a folder missing because a kill fell
    between the fallback's two renames is named with its leftover (it said "neither a file nor an open_clip tag")."""
    folder = models.export_open_clip(tiny_random[0], tmp_path / "x", "tiny")
    aside = folder.with_name(".x.old-999999999")
    os.replace(folder, aside)
    with pytest.raises(base.UsageError, match=r"no such folder; an export into it was interrupted and left "
                                              r"\.x\.old-999999999"):
        models.load_model("tiny", str(folder))
    with pytest.raises(base.UsageError, match="the temporary or set-aside copy of an interrupted export"):
        models.load_model("tiny", str(aside))


def test_recovery_leaves_the_folders_of_a_running_export_alone(tmp_path):
    """Another export into the same folder still running (its PID alive): its temporary and set-aside folders are
    not removed or moved (they were, and the other export then failed between its renames); a dead one's are."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    target = tmp_path / "x"
    for pid in (os.getppid(), dead.pid):
        for kind in ("new", "old"):
            (tmp_path / f".x.{kind}-{pid}").mkdir()
            (tmp_path / f".x.{kind}-{pid}" / "open_clip_config.json").write_text(f"{kind} {pid}")
    done = folders.recover(target)
    assert done == [f".x.new-{dead.pid} removed", f".x.old-{dead.pid} put back as x"]
    assert _contents(target) == {f"old {dead.pid}"}
    assert [p.name for p in folders.leftovers(target)] == [f".x.new-{os.getppid()}", f".x.old-{os.getppid()}"]


def test_an_export_into_a_symlink_replaces_its_target(tmp_path):
    """The link stays a link to the new folder (it was swapped out and left behind as a leftover for ever)."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "open_clip_config.json").write_text("old")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    folders.atomic_folder(tmp_path / "link", lambda t: (t / "open_clip_config.json").write_text("new"))
    assert (tmp_path / "link").is_symlink() and _contents(tmp_path / "real") == {"new"}
    assert not folders.leftovers(tmp_path / "link") and not folders.leftovers(tmp_path / "real")


def test_export_help_is_whole_sentences():
    """Issue 42.4: `python -m commands.export --help` stopped mid-sentence, and its options were fragments with
    "(default: None)" on the required ones; now every line of help is a sentence."""
    parser = export.command_line()
    text = " ".join(parser.format_help().split())
    assert "transformers CLIPModel folder (OpenAI-architecture ViTs)." in text and "(default: None)" not in text
    helps = [a.help for a in parser._actions if a.help and a.dest != "help"]
    assert len(helps) == 4 and all(h[0].isupper() and h.endswith(".") for h in helps), helps
    assert 'open_clip.create_model_from_pretrained("local-dir:OUT")' in text
