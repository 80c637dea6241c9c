"""Issue 41.2: an export is written whole or not at all. A SIGKILL at any point of writing a folder leaves the
previous folder or the new one (never model B's weights beside model A's config); an interrupt or a full disk
is one message saying nothing changed; files get the process's umask (safetensors writes 0600); --export is
checked before training, and an export failing after training keeps the run's results."""
import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import common
from plumbing import base, models
import lab

REPO = Path(__file__).resolve().parents[1]

# A child process writes `target` twice with base.atomic_folder (model "old", then model "new", two files
# each) and SIGKILLs itself at STAGE of the second write.
_CHILD = r"""
import os, shutil, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from plumbing import base
target, stage = Path(sys.argv[2]), sys.argv[3]
def kill():
    os.kill(os.getpid(), signal.SIGKILL)
def model(tag, die_after=None):
    def write(tmp):
        (tmp / "open_clip_model.safetensors").write_text(tag)
        if die_after == "weights":
            kill()
        (tmp / "open_clip_config.json").write_text(tag)
        if die_after == "config":
            kill()
    return write
base.atomic_folder(target, model("old"))
real_exchange, real_replace, real_rmtree = base._exchange, os.replace, shutil.rmtree
if stage == "exchange":
    base._exchange = lambda a, b: real_exchange(a, b) and kill()
if stage in ("aside", "aside-moved"):
    base._exchange = lambda a, b: False
    calls = []
    def replace(a, b):
        calls.append(a)
        if stage == "aside" and len(calls) == 1:
            kill()
        real_replace(a, b)
        if stage == "aside-moved" and len(calls) == 1:
            kill()
    os.replace = replace
if stage == "cleanup":
    shutil.rmtree = lambda p, **kw: kill() if ".old-" in str(p) else real_rmtree(p, **kw)
base.atomic_folder(target, model("new", die_after={"weights": "weights", "config": "config"}.get(stage)))
"""


def _contents(folder: Path) -> set:
    return {f.read_text() for f in folder.iterdir()} if folder.is_dir() else set()


@pytest.mark.parametrize("stage", ["weights", "config", "exchange", "aside", "aside-moved", "cleanup"])
def test_a_kill_at_any_point_leaves_the_old_folder_or_the_new_one(tmp_path, stage):
    """Both files of one model, never one of each: after the kill (a reader would see old or new, except in the
    fallback without renameat2 between its two renames, when the folder is missing) and after recovery."""
    target = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-c", _CHILD, str(REPO), str(target), stage])
    assert done.returncode == -signal.SIGKILL
    now = _contents(target)
    assert now in ({"old"}, {"new"}) or (stage == "aside-moved" and not target.exists())
    base.recover_folder(target)
    assert _contents(target) in ({"old"}, {"new"})
    assert not base.folder_leftovers(target)
    want = {"new"} if stage in ("exchange", "cleanup") else {"old"}
    assert _contents(target) == want


def test_an_interrupt_or_a_full_disk_keeps_the_previous_folder_and_says_so(tmp_path):
    target = tmp_path / "exported"
    base.atomic_folder(target, lambda t: (t / "open_clip_config.json").write_text("old"))

    def interrupted(tmp):
        (tmp / "open_clip_config.json").write_text("new")
        raise KeyboardInterrupt

    def full(tmp):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "x"))

    with pytest.raises(base.RunError, match="interrupted while writing .*the previous folder there is unchanged"):
        base.atomic_folder(target, interrupted)
    with pytest.raises(base.RunError, match="no space left on device .*the previous folder there is unchanged"):
        base.atomic_folder(target, full)
    with pytest.raises(base.RunError, match="no folder was made"):
        base.atomic_folder(tmp_path / "fresh", full)
    assert _contents(target) == {"old"} and not base.folder_leftovers(target)
    assert not (tmp_path / "fresh").exists()


def test_exported_files_follow_the_umask(tmp_path):
    """safetensors' save_file creates 0600 files; the export's files get the process's umask like the rest."""
    models.register_tiny()
    model = models.load_model("tiny", "random")[0]
    old = os.umask(0o022)
    try:
        folder = models.export_open_clip(model, tmp_path / "hub", "tiny")
    finally:
        os.umask(old)
    modes = {f.name: f.stat().st_mode & 0o777 for f in folder.iterdir()}
    assert modes == {"open_clip_model.safetensors": 0o644, "open_clip_config.json": 0o644}
    assert folder.stat().st_mode & 0o777 == 0o755


def test_the_export_folder_is_checked_before_anything_runs(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "thesis.tex").write_text("x")
    (tmp_path / "previous").mkdir()
    (tmp_path / "previous" / "open_clip_config.json").write_text("{}")
    with pytest.raises(base.UsageError, match="a file is there"):
        models.check_export(tmp_path / "file")
    with pytest.raises(base.UsageError, match="holds other files"):
        models.check_export(tmp_path / "notes")
    for fine in ("previous", "new/deeper"):
        models.check_export(tmp_path / fine)
    (tmp_path / "empty").mkdir()
    models.check_export(tmp_path / "empty")
    data = lab.synthetic_manifest("train", tmp_path / "data", n=16)
    cfg = common.Config(steps=2, batch_size=8, workers=0, precision="fp32", out=str(tmp_path / "run"), device="cpu",
                        export=str(tmp_path / "notes"))
    with pytest.raises(base.UsageError, match="--export .*notes"):
        common.preflight(cfg, [data])
    assert not (tmp_path / "run").exists()  # refused before the run folder was made


def test_an_export_failing_after_training_keeps_the_results_and_names_the_command(tmp_path, monkeypatch, capsys):
    data = lab.synthetic_manifest("train", tmp_path / "data", n=16)
    model, train_tf, _, tok = models.load_model("tiny", "random")
    cfg = common.Config(steps=2, batch_size=8, workers=0, precision="fp32", out=str(tmp_path / "run"), log_every=1,
                        device="cpu", export=str(tmp_path / "hub"))

    def full(*a, **kw):
        raise base.RunError("no space left on device while writing hub")
    monkeypatch.setattr(models, "export_open_clip", full)
    summary = common.train(cfg, lab.ClipFineTune(model), common.ManifestDataset(data, train_tf), common.Collate(tok))
    assert "no space left" in summary["export_failed"]
    assert summary["export_command"] == (f"python -m plumbing.export --backbone tiny --pretrained "
                                         f"{tmp_path / 'run' / 'model.pt'} --out {tmp_path / 'hub'}")
    assert (tmp_path / "run" / "model.pt").is_file()
    assert "export it later with python -m plumbing.export" in capsys.readouterr().err
    json.dumps(summary)  # the summary goes into results.json as it is
    assert torch.load(tmp_path / "run" / "model.pt", weights_only=True)


def test_an_exported_folder_is_accepted_back_as_pretrained(tmp_path):
    """Issue 42.6: `--pretrained exported/x` or `local-dir:exported/x` was "neither a file nor an open_clip tag";
    now open_clip builds the model from the folder's own config: the same features, the same tokens."""
    model, _, _, tok = models.load_model("tiny", "random")
    folder = models.export_open_clip(model, tmp_path / "exported" / "x", "tiny")
    image = torch.randn(2, 3, lab.IMAGE_SIZE, lab.IMAGE_SIZE, generator=torch.Generator().manual_seed(0))
    for ref in (str(folder), f"local-dir:{folder}"):
        again, _, _, tok2 = models.load_model("tiny", ref)
        assert torch.equal(tok(["a red circle"]), tok2(["a red circle"]))
        with torch.no_grad():
            assert torch.equal(model.encode_image(image), again.encode_image(image))
            assert torch.equal(model.encode_text(tok(["a red circle"])), again.encode_text(tok2(["a red circle"])))
    (tmp_path / "other").mkdir()
    with pytest.raises(base.UsageError, match="not open_clip's hub layout"):
        models.load_model("tiny", str(tmp_path / "other"))


def test_export_help_is_whole_sentences():
    """Issue 42.4: `python -m plumbing.export --help` stopped mid-sentence ("... or a Hugging Face")."""
    from plumbing import export
    text = export.command_line().format_help()
    assert "transformers CLIPModel folder (OpenAI-architecture ViTs)." in " ".join(text.split())
