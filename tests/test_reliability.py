"""Issue 26 (reliability pass 2), the cases not held elsewhere: resume checks
against the checkpoint's own record (settings and training data), sweeps and
demos that hold their --out, the tiny weights' cache repairing itself, one
message naming the file for each expected failure, signals during the final
evaluation, and a fast --help. docs/reliability.md maps each case to its test."""
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plumbing import models, runfolder, trainlog
from papers import erclip_sweeps
import socket
from plumbing import base, cli
import common
import open_clip
from plumbing.base import DataError, RunError, UnsafeFileError, UsageError
from plumbing.flags import Config
from plumbing.manifests import read_manifest
import lab

REPO = Path(__file__).resolve().parents[1]
RUN_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(autouse=True)
def _lean(tmp_path):
    """Each test's folder goes when it ends: checkpoints of the tiny model are ~90 MB each, and the suite must fit
    a small temporary disk."""
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)


def _cli(capsys, main, argv):
    """common.cli as a script's __main__ runs it: (exit code, stderr)."""
    with pytest.raises(SystemExit) as e:
        cli.cli(main, argv)
    return e.value.code, capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return models.load_model("tiny", "random")


def _cfg(out, **kw):
    return Config(**{**dict(steps=4, batch_size=8, lr=1e-3, warmup=1, workers=0, precision="fp32",
                                   out=str(out), save_every=0, log_every=1, device="cpu", seed=0), **kw})


def _train(tiny, data, out, **kw):
    model = models.load_model("tiny", "random")[0]
    return common.train(_cfg(out, **kw), lab.ClipFineTune(model), common.ManifestDataset(data, tiny[1]),
                        common.Collate(tiny[3]), export=False)


# ----------------------------------------------------------------------------- 3-4. resume trusts the checkpoint
@pytest.fixture
def stopped(tmp_path, tiny):
    data = lab.synthetic_manifest("train", tmp_path / "data", n=16)
    out = tmp_path / "run"
    _train(tiny, data, out, stop_at=2)
    return data, out


def test_resume_compares_with_the_checkpoint_not_the_editable_config_json(stopped, tiny):
    data, out = stopped
    saved = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**saved, "lr": 1e-2}))  # edited to match the new flag
    with pytest.raises(RunError, match=r"--lr 0.001 \(run\) -> 0.01 \(now\)"):
        _train(tiny, data, out, lr=1e-2, resume="latest")
    (out / "config.json").unlink()  # deleted: the checkpoint still knows
    with pytest.raises(RunError, match=r"--lr 0.001 \(run\) -> 0.01 \(now\)"):
        _train(tiny, data, out, lr=1e-2, resume="latest")
    assert _train(tiny, data, out, resume="latest")["steps"] == 4  # unchanged settings continue


def test_a_changed_manifest_is_refused_on_resume_and_recorded_when_overridden(stopped, tiny, tmp_path):
    data, out = stopped
    grown = lab.synthetic_manifest("train", tmp_path / "data32", n=32)
    rows = [json.loads(line) for line in Path(grown).read_text().splitlines()]
    Path(data).write_text("".join(json.dumps({**r, "image": str(Path(grown).parent / r["image"])}) + "\n"
                                  for r in rows))  # 16 rows grew to 32 between stop and resume
    with pytest.raises(RunError, match="training data changed.*16 rows.*32 rows.*--override-resume"):
        _train(tiny, data, out, resume="latest")
    summary = _train(tiny, data, out, resume="latest", override_resume=True)
    assert summary["data_changed_on_resume"]["was"]["rows"] == 16
    assert summary["data_changed_on_resume"]["now"]["rows"] == 32 and summary["data"]["rows"] == 32


# ----------------------------------------------------------------------------- 5. one writer per sweep / demo
def _held_by_another_live_process(folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / runfolder.LOCK).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))


def test_a_sweep_never_deletes_a_run_folder_a_live_process_is_training_in(tmp_path):
    run = tmp_path / "sweep-epochs" / "M-seed0"
    _held_by_another_live_process(run)
    (run / "checkpoints").mkdir()
    with pytest.raises(RunError, match="another live process .* not deleting it"):
        erclip_sweeps.sweep_run(tmp_path / "sweep-epochs", "M-seed0", lambda folder: {})
    with pytest.raises(RunError, match="not deleting it"):
        with lab.scratch_run(run):
            pass
    assert (run / "checkpoints").is_dir()  # the live run's files are untouched
    (run / runfolder.LOCK).write_text(json.dumps({"pid": 2 ** 22 + 7, "host": socket.gethostname()}))
    stale_cleared = erclip_sweeps.sweep_run(tmp_path / "sweep-epochs", "M-seed0", lambda folder: {"x": 1})
    assert stale_cleared["x"] == 1


def test_a_second_sweep_or_demo_into_the_same_out_stops_at_once(tmp_path, capsys):
    import erclip
    out = tmp_path / "demo"
    _held_by_another_live_process(out / "sweep-epochs")
    code, err = _cli(capsys, erclip.main, ["--demo", "--sweep", "epochs", "--out", str(out)])
    assert code == 1 and f"another run (PID {os.getppid()}) is writing to {out / 'sweep-epochs'}" in err
    _held_by_another_live_process(out)
    code, err = _cli(capsys, erclip.main, ["--demo", "--out", str(out)])
    assert code == 1 and f"another run (PID {os.getppid()}) is writing to {out}" in err


# ----------------------------------------------------------------------------- 2, 6. the tiny weights' cache
def test_a_broken_tiny_weights_cache_is_rebuilt_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(base, "CACHE_DIR", tmp_path)
    path = lab.pretrain_tiny()  # expanded from the shipped file
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])  # cut short, as a full disk or a killed copy leaves it
    assert lab.pretrain_tiny() == path and path.read_bytes() == good
    assert f"{path} (or its .json sidecar) is truncated or broken: rebuilding it" in capsys.readouterr().err
    Path(f"{path}.json").write_text('{"model": ')  # the sidecar cut short
    assert lab.pretrain_tiny() == path and json.loads(Path(f"{path}.json").read_text())["model"]
    (tmp_path / "configs").mkdir(exist_ok=True)
    (tmp_path / "configs" / f"{models.TINY_NAME}.json").write_text("{")  # open_clip's config cut short
    monkeypatch.setattr(open_clip, "list_models", lambda: [])
    models.register_tiny(lab.TINY_CFG)  # written again, no traceback
    assert json.loads((tmp_path / "configs" / f"{models.TINY_NAME}.json").read_text()) == lab.TINY_CFG


def test_a_broken_model_sidecar_is_one_message_naming_it(tmp_path, capsys):
    model = models.load_model("tiny", "random")[0]
    path = models.save_model(model, tmp_path / "model.pt", "tiny")
    Path(f"{path}.json").write_text('{"model": "clip')
    code, err = _cli(capsys, lambda argv: models.load_model("tiny", str(path)), [])
    assert code == 2 and f"{path}.json, the sidecar of {path}" in err and "Traceback" not in err  # UsageError


def test_an_interrupted_pretraining_continues_by_itself_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    from lab import tiny
    monkeypatch.setattr(base, "CACHE_DIR", tmp_path)
    recipe = dict(tiny.TINY_PRETRAIN, n=64, epochs=2, batch=16)
    real_step = common.train_step

    def interrupted_at_step_3(net, batch, ctx, *a, **k):
        if ctx.step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, honoured after the step in flight
        return real_step(net, batch, ctx, *a, **k)
    monkeypatch.setattr(common, "train_step", interrupted_at_step_3)
    work = tiny._work_dir("test")
    with pytest.raises(RunError, match="pretraining was stopped by signal 2; its checkpoint is kept"):
        tiny._pretrain_tiny(recipe, work)
    assert torch.load(work / "checkpoints" / "last.pt", weights_only=True)["step"] == 4
    monkeypatch.setattr(common, "train_step", real_step)
    tiny._pretrain_tiny(recipe, work)  # the next run: no "holds a run already", no hand-deleting
    assert "continuing the interrupted pretraining" in capsys.readouterr().err
    assert not work.exists() and work.parent.name == ".work"  # working state out of view, gone on success
    (work / "checkpoints").mkdir(parents=True)
    (work / "checkpoints" / "last.pt").write_bytes(b"PK\x03\x04cut")  # killed while writing: starts again
    (work / "metrics.jsonl").write_text('{"step": 1}\n')
    tiny._pretrain_tiny(recipe, work)
    assert not work.exists()


def test_a_process_waiting_for_the_tiny_weights_says_for_whom(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(base, "CACHE_DIR", tmp_path)
    path = tmp_path / f"tiny-synthetic-{lab.tiny.recipe_key()}.pt"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); f.truncate(0); "
        "f.write('PID 4242 on elsewhere'); f.flush(); print('held', flush=True); time.sleep(3)"),
        f"{path}.lock"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    assert lab.pretrain_tiny() == path  # waits about 3 s, then expands the shipped file itself
    holder.wait()
    assert f"[lab] waiting for PID 4242 on elsewhere, which is writing {path}" in capsys.readouterr().err


# ----------------------------------------------------------------------------- 7, 11, 12. one message each
@pytest.fixture
def no_model(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the check")
    monkeypatch.setattr(models, "load_model", refuse)


def test_a_tampered_checkpoint_is_one_message_not_a_traceback(stopped, tiny, capsys):
    data, out = stopped
    ck = out / "checkpoints" / "last.pt"
    torch.save({"step": 2, "payload": argparse_namespace()}, ck)  # a Python object: refused, never run
    code, err = _cli(capsys, lambda argv: _train(tiny, data, out, resume="latest"), [])
    assert code == 1 and f"{ck}: refused to load" in err and "Traceback" not in err


def argparse_namespace():
    import argparse
    return argparse.Namespace(x=1)


def test_a_broken_config_json_of_a_task_sequence_is_one_message(tmp_path):
    out = tmp_path / "seq"
    out.mkdir()
    (out / "config.json").write_text('{"lr": ')
    (out / "continual.json").write_text("{}")
    with pytest.raises(RunError, match="config.json is not readable JSON"):
        runfolder.start_run(_cfg(out, resume="latest"), out, continual=True)


def test_another_models_checkpoint_under_override_resume_is_one_message(stopped, tiny):
    data, out = stopped
    model = models.load_model("tiny", "random")[0]
    model.text_projection = torch.nn.Parameter(torch.zeros(model.text_projection.shape[0], 3))  # another width
    with pytest.raises(RunError, match="holds another model's weights .*never the model"):
        common.train(_cfg(out, resume="latest", override_resume=True), lab.ClipFineTune(model),
                     common.ManifestDataset(data, tiny[1]), common.Collate(tiny[3]), export=False)


@pytest.mark.parametrize("argv, says", [
    (["--device", "meta"], "--device meta: expected auto, cpu, cuda or cuda:N"),
    (["--tasks", "nosuch"], "unknown retrieval task 'nosuch'"),
    (["--batch-size", "0"], "argument --batch-size/--batch_size: must be > 0, got 0"),  # CLIP_benchmark: 42.1
    (["--alphas", "a,b", "--wise-ft", "x.pt"], "argument --alphas: expected comma-separated numbers"),
    (["--continual", "pretrained,a.pt,b.pt", "--tasks", "synthetic-shape"], "need 2 checkpoints for 1 task(s)"),
])
def test_eval_py_bad_input_is_one_message_before_any_model(argv, says, capsys, no_model, tmp_path):
    import eval as evaluation
    code, err = _cli(capsys, evaluation.main, [*argv, "--out", str(tmp_path / "e"), "--synthetic-n", "8",
                                               "--data-root", str(tmp_path / "data")])
    assert code == 2 and says in err and "Traceback" not in err


@pytest.mark.slow
def test_python_m_lab_eval_finds_the_labs_synthetic_sets_and_eval_py_names_it(tmp_path):
    """eval.py never imports the lab; `python -m lab eval` loads it (its sets register in the module `eval`)
    and runs eval's main; plain `python eval.py` on a lab set says to use it, in one message."""
    argv = ["--tasks", "synthetic-shape", "--synthetic-n", "8", "--pretrained", "random", "--data-root",
            str(tmp_path / "data"), "--out", str(tmp_path / "e")]
    r = subprocess.run([sys.executable, "-m", "lab", "eval", *argv], cwd=REPO, env=RUN_ENV, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "e" / "results.json").read_text())["records"]
    r = subprocess.run([sys.executable, str(REPO / "eval.py"), *argv], cwd=tmp_path, env=RUN_ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "python -m lab eval" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_m2mix_eval_on_none_trains_without_evaluating_and_a_bad_name_fails_first(tmp_path, capsys, monkeypatch):
    import m2mix
    root = tmp_path / "data"
    lab.synthetic_manifest("train", root, n=16)
    argv = ["--backbone", "tiny", "--data-root", str(root), "--train-data", "synthetic", "--batch-size", "8",
            "--steps", "1", "--workers", "0", "--device", "cpu", "--pretrained", "random", "--no-eval-base", "--out"]
    assert m2mix.main(argv + [str(tmp_path / "a"), "--eval-tasks", "none"])["records"] == []
    trained = []
    monkeypatch.setattr(common, "train", lambda *a, **k: trained.append(1))
    code, err = _cli(capsys, m2mix.main, argv + [str(tmp_path / "b"), "--eval-tasks", "nosuch"])
    assert code == 2 and "--eval-tasks: unknown retrieval task 'nosuch'" in err and not trained


def test_an_epochs_sweep_with_steps_is_refused_up_front(tmp_path, capsys, no_model):
    import erclip
    data = tmp_path / "data"
    train = lab.synthetic_manifest("train", data, n=16)
    code, err = _cli(capsys, erclip.main, ["--sweep", "epochs", "--backbone", "tiny", "--train-data", str(train),
                                           "--steps", "1", "--out", str(tmp_path / "runs"), "--device", "cpu"])
    assert code == 2 and "--steps 1 would cut every run short" in err and not (tmp_path / "runs").exists()


def _features(tmp_path, **arrays):
    """A dataset in our layout: toy/test/<modality>.npy, samples.json, meta.json."""
    import numpy as np
    folder = tmp_path / "toy" / "test"
    folder.mkdir(parents=True)
    arrays = {"vision": np.ones((4, 3), "float32"), "text": np.ones((4, 3), "float32"), **arrays}
    for name, a in arrays.items():
        if isinstance(a, bytes):
            (folder / name).write_bytes(a)
        else:
            np.save(folder / f"{name}.npy", a, allow_pickle=True)
    (folder / "samples.json").write_text(json.dumps({"ids": list(range(4))}))
    (tmp_path / "toy" / "meta.json").write_text(json.dumps({"modalities": ["vision", "text"]}))
    return folder


@pytest.mark.parametrize("case, says", [
    ("width", r"text \(4, 5\)"), ("rows", r"text \(3, 3\)"), ("pickled", "vision.npy: not a readable feature array"),
    ("strings", "vision.npy: not a readable feature array"), ("nan", "1 of 4 samples hold NaN or inf features"),
    ("cut", "vision.npy: not a readable feature array"), ("pt-pickled", "vision.pt: refused to load"),
])
def test_bad_feature_arrays_are_one_message_naming_the_file(tmp_path, case, says):
    import numpy as np

    from papers import cmcl
    make = {"width": dict(text=np.ones((4, 5), "float32")), "rows": dict(text=np.ones((3, 3), "float32")),
            "pickled": dict(vision=np.array([{"a": 1}] * 4, dtype=object)),
            "strings": dict(vision=np.array([["a"] * 3] * 4)),
            "nan": dict(vision=np.array([[np.nan, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]], "float32"))}.get(case, {})
    folder = _features(tmp_path, **make)
    if case == "cut":
        (folder / "vision.npy").write_bytes((folder / "vision.npy").read_bytes()[:70])
    if case == "pt-pickled":
        (folder / "vision.npy").unlink()
        torch.save({"x": argparse_namespace()}, folder / "vision.pt")
    with pytest.raises((DataError, UnsafeFileError), match=says) as e:
        cmcl.read_features(tmp_path, "toy", "test")
    assert "weights_only=False" not in str(e.value)


def test_cmcl_labels_may_be_class_names_and_a_bad_one_is_named(tmp_path):
    """Issue 42.5: samples.json's labels as class names (what a user's own data holds) read as the indices
    they name; an unknown name or an index out of range is one DataError naming samples.json."""
    import numpy as np

    from papers import cmcl
    folder = _features(tmp_path)
    np.save(tmp_path / "toy" / "classes.npy", np.eye(3, dtype="float32"))
    (tmp_path / "toy" / "meta.json").write_text(json.dumps({"modalities": ["vision", "text"],
                                                            "classes": ["cat", "dog", "owl"]}))
    for labels, want in ((["dog", "owl", "cat", "dog"], [1, 2, 0, 1]), ([1, 2, 0, 1], [1, 2, 0, 1])):
        (folder / "samples.json").write_text(json.dumps({"ids": list(range(4)), "labels": labels}))
        assert cmcl.read_features(tmp_path, "toy", "test")["labels"].tolist() == want
    for labels, says in ((["dog", "emu", "cat", "dog"], "label 1 is 'emu'"), ([1, 3, 0, 1], "label 1 is 3"),
                         ([1, None, 0, 1], "label 1 is None")):
        (folder / "samples.json").write_text(json.dumps({"ids": list(range(4)), "labels": labels}))
        with pytest.raises(DataError, match=f"samples.json: {says}, neither a class name"):
            cmcl.read_features(tmp_path, "toy", "test")


@pytest.mark.parametrize("case, says", [("empty-file", "not a readable HDF5 file"), ("no-keys", "holds no arrays"),
                                        ("group", "key 'a' holds a group"), ("bytes", "key 'a' holds .* data"),
                                        ("widths", "arrays of different shapes")])
def test_bad_h5_feature_files_are_one_message_naming_the_file(tmp_path, case, says):
    import h5py
    import numpy as np

    from papers import cmcl
    path = tmp_path / "ucf101_test_imagebind.h5"
    if case == "empty-file":
        path.write_bytes(b"")
    else:
        with h5py.File(path, "w") as f:
            if case == "group":
                f.create_group("a")
            elif case == "bytes":
                f.create_dataset("a", data=np.array([b"xy", b"z"]))
            elif case == "widths":
                f.create_dataset("a", data=np.ones((2, 4)))
                f.create_dataset("b", data=np.ones((2, 5)))
    with pytest.raises(DataError, match=f"{path}: .*{says}"):
        cmcl._h5_rows(path)


def test_resume_advice_is_true(tmp_path, stopped, tiny):
    data, out = stopped
    with pytest.raises(RunError, match=f"--resume {out}: a folder, not a checkpoint; pass --resume latest "
                                              f"--out {out}"):
        _train(tiny, data, tmp_path / "other", resume=str(out))
    with pytest.raises(RunError, match="nofile.pt: no such file") as e:
        _train(tiny, data, tmp_path / "other2", resume=str(tmp_path / "nofile.pt"))
    assert "other2/checkpoints" not in str(e.value)  # a folder the user never gave


def test_an_unwritable_cache_is_blamed_on_the_cache_not_on_out(capsys):
    import errno

    def main(argv):
        raise PermissionError(errno.EACCES, "Permission denied", str(base.CACHE_DIR / "configs" / "x.json"))
    code, err = _cli(capsys, main, [])
    assert code == 1 and "set CLIPFT_CACHE to a writable folder" in err and "--out" not in err


def test_a_nan_before_any_checkpoint_names_no_checkpoint_folder(tmp_path, tiny):
    class NanAtOnce(lab.ClipFineTune):
        def forward(self, batch, ctx=None):
            return {"loss": torch.tensor(float("nan"), requires_grad=True)}
    data = lab.synthetic_manifest("train", tmp_path / "data", n=16)
    with pytest.raises(FloatingPointError, match=r"non-finite loss at step 1: .*no checkpoint was written"):
        common.train(_cfg(tmp_path / "run"), NanAtOnce(models.load_model("tiny", "random")[0]),
                     common.ManifestDataset(data, tiny[1]), common.Collate(tiny[3]), export=False)


@pytest.mark.parametrize("caption, says", [(5, "caption is not text (int 5)"), ({"a": 1}, "caption is not text (dict"),
                                           (None, "no caption")])
def test_a_caption_that_is_not_text_is_said_so(tmp_path, caption, says):
    good = lab.synthetic_manifest("train", tmp_path / "data", n=4)
    rows = read_manifest(good)
    bad = Path(good).parent / "bad.jsonl"
    bad.write_text("".join(json.dumps({"image": r["image"], "caption": caption if i == 1 else r["caption"]}) + "\n"
                           for i, r in enumerate(rows)))
    with pytest.raises(DataError, match=re.escape(f"bad.jsonl:2: {says}")):
        common.ManifestDataset(bad)


def test_a_folder_or_a_pipe_where_an_image_belongs_is_not_called_missing(tmp_path):
    good = lab.synthetic_manifest("train", tmp_path / "data", n=4)
    rows = read_manifest(good)
    (Path(good).parent / "dir.png").mkdir()
    os.mkfifo(Path(good).parent / "fifo.png")
    bad = Path(good).parent / "bad.jsonl"
    bad.write_text("".join(json.dumps({**r, "image": ["dir.png", "fifo.png"][i] if i < 2 else r["image"]}) + "\n"
                           for i, r in enumerate(rows)))
    with pytest.raises(DataError, match=r"(?s)bad.jsonl:1: not a regular file.*bad.jsonl:2: not a regular"):
        common.ManifestDataset(bad)


def test_override_and_skip_messages_are_printed_once(stopped, tiny, capsys, tmp_path):
    data, out = stopped
    cfg = _cfg(out, resume="latest", override_resume=True, lr=2e-3)
    runfolder.start_run(cfg, out)  # the preflight's call, then train's
    _train(tiny, data, out, resume="latest", override_resume=True, lr=2e-3)
    assert capsys.readouterr().err.count("--override-resume: continuing with lr=0.002") == 1


# ----------------------------------------------------------------------------- 13. signals outside the steps
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_final_evaluation_keeps_the_run_and_says_how_to_finish(tmp_path, capsys, monkeypatch,
                                                                                  request, signum):
    import erclip
    import eval as evaluation
    root = tmp_path / "data"
    lab.synthetic_manifest("train", root, n=16)
    test = lab.synthetic_manifest("test", root, n=12)
    out = tmp_path / "run"
    argv = ["--data-root", str(root), "--train-data", "synthetic", "--train-pairs", "16", "--batch-size", "8",
            "--steps", "2", "--warmup", "1", "--lr", "1e-4", "--workers", "0", "--device", "cpu", "--eval-tasks",
            str(test), "--pretrained", "random", "--out", str(out)]
    real, calls = evaluation.evaluate, []
    # the handlers a shell gives a script (Python's Ctrl-C handler), whatever an earlier test left in this worker:
    # one fresh-clone run of the suite saw this SIGINT case print the final tables, not interrupted
    for s, handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        previous = signal.signal(s, handler)
        request.addfinalizer(lambda s=s, previous=previous: signal.signal(s, previous))

    def evaluate(*a, **k):
        calls.append(k.get("weights"))
        if len(calls) == 2:  # the evaluation after training
            os.kill(os.getpid(), signum)
        return real(*a, **k)
    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    code, err = _cli(capsys, erclip.main, argv)
    assert code == 128 + signum and f"interrupted (signal {signum}) outside the training steps" in err
    assert f"kept in {out}: checkpoints/last.pt, model.pt, base.json" in err and "--resume latest" in err
    assert not (out / "results.json").exists()
    calls.clear()
    result = erclip.main(argv + ["--resume", "latest"])  # the command the message gives
    assert calls == [str(out / "model.pt")]  # training not repeated, the base evaluation read back
    saved = json.loads((out / "results.json").read_text())["records"]
    assert result["base"] and [r for r in saved if r["stage"] == "base"] == [dict(r, stage="base")
                                                                             for r in result["base"]]


def test_an_interrupt_before_anything_is_saved_says_so(tmp_path, capsys):
    def main(argv):
        runfolder.start_run(_cfg(tmp_path / "fresh"), tmp_path / "fresh")
        raise KeyboardInterrupt
    code, err = _cli(capsys, main, [])
    assert code == 130 and "before training saved anything" in err and "nothing to resume" in err


# ----------------------------------------------------------------------------- 15. --help before torch loads
SCRIPTS = ("erclip", "longclip", "m2mix", "cclip", "dns", "gmc", "eval", "commands.export", "commands.write_shards",
           "commands.vlcl")
_PROBE = """
import runpy, sys, time
name, sys.argv = sys.argv[1], [sys.argv[1] + ".py", *sys.argv[2:]]
t0, code = time.time(), 0
try:  # python erclip.py ... / python -m commands.export ...
    runpy.run_module(name, run_name="__main__", alter_sys=True) if "." in name else runpy.run_path(sys.argv[0],
                                                                                                  run_name="__main__")
except SystemExit as e:
    code = e.code
print("\\nPROBE", code, "torch" in sys.modules, "open_clip" in sys.modules, round(time.time() - t0, 3))
"""


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["--lr", "x"], 2)])
def test_help_and_flag_errors_answer_without_importing_torch(script, argv, code):
    r = subprocess.run([sys.executable, "-c", _PROBE, script, *argv], cwd=REPO, env=RUN_ENV, capture_output=True,
                       text=True, timeout=120)
    probe = r.stdout.strip().splitlines()[-1].split()
    assert probe[:4] == ["PROBE", str(code), "False", "False"], (r.stdout[-500:], r.stderr[-1500:])
    assert ("usage:" in r.stdout) if code == 0 else (": error: " in r.stderr and "Traceback" not in r.stderr)


@pytest.mark.parametrize("command", ["eval", "export"])
@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["--lr", "x"], 2)])
def test_python_m_lab_commands_answer_help_and_flag_errors_without_importing_torch(command, argv, code):
    """Issue 55.3: `python -m lab export --help` and `python -m lab eval --help` took 6 s: the lab's package
    imports torch before its __main__ runs. -X importtime lists every module the process imported."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "lab", command, *argv], cwd=REPO, env=RUN_ENV,
                       capture_output=True, text=True, timeout=120)
    imported = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    assert r.returncode == code and "open_clip" not in imported and "torch" not in imported, r.stderr[-1500:]
    said = r.stdout if code == 0 else r.stderr
    assert (f"usage: python -m lab {command}" if code == 0 else f"python -m lab {command}: error:") in said


def test_an_image_over_pils_bomb_limit_is_our_one_line_not_pils_warning(tmp_path):
    """Issue 55.3: an 11000x11000 PNG printed PIL's raw DecompressionBombWarning (from the row check's threads,
    again in training). Now one line of ours names the file and its size. The limit is lowered so that the lab's
    32x32 images cross it (PIL warns above the limit, refuses above twice it); a plain process, as a run is."""
    src = lab.synthetic_manifest("train", tmp_path / "data", n=2)
    script = ("import sys; from PIL import Image; import common; Image.MAX_IMAGE_PIXELS = 600; "
              "ds = common.ManifestDataset(sys.argv[1]); ds[0]; ds[1]")
    r = subprocess.run([sys.executable, "-c", script, str(src)], cwd=REPO, env=RUN_ENV, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "DecompressionBombWarning" not in r.stderr, r.stderr[-1500:]
    assert r.stderr.count("32x32 pixels, over PIL's decompression-bomb limit (600)") == 2, r.stderr  # once a file


def test_eval_py_command_line_names_match_its_loaders():
    import eval as evaluation
    from plumbing import published
    from protocols import m2mix_analysis
    assert evaluation.RETRIEVAL_NAMES == tuple(evaluation.REAL_RETRIEVAL_TASKS)
    assert evaluation.PAPERS == tuple(published.PUBLISHED)
    assert evaluation.SIMAT_PROTOCOL_NAMES == tuple(m2mix_analysis.SIMAT_PROTOCOLS)
    assert set(evaluation.BENCHMARKS) >= set(evaluation.RETRIEVAL_NAMES) | {"cifar10", "cifar100", "imagenet", "simat"}


def test_simat_refuses_non_finite_embeddings():
    from protocols import m2mix_analysis
    img = torch.nn.functional.normalize(torch.randn(6, 4), dim=-1)
    img[2, 0] = float("nan")
    words = torch.nn.functional.normalize(torch.randn(2, 4), dim=-1)
    with pytest.raises(RunError, match="simat: 1 of 6 images rows are not finite"):
        m2mix_analysis.simat_score(img, torch.tensor([0, 1]), words, words, [0, 1], torch.ones(6, 2), [1.0, 1.0])


def test_warnings_and_progress_lines_escape_control_characters(tmp_path, capsys):
    good = lab.synthetic_manifest("train", tmp_path / "data", n=4)
    rows = read_manifest(good)
    bad = Path(good).parent / "bad.jsonl"
    bad.write_text("".join(json.dumps({**r, "image": "gone\x1b[32m.png" if i == 0 else r["image"]}) + "\n"
                           for i, r in enumerate(rows)))
    common.ManifestDataset(bad, skip_bad=True)
    err = capsys.readouterr().err
    assert "gone\\x1b[32m.png" in err and "\x1b" not in err
    line = trainlog.progress_line(Path("runs/a\rb"), {"step": 1, "epoch": 0, "loss": 1.0, "lr": 1e-5,
                                                   "sec_per_step": 0.1}, 2)
    assert "\r" not in line and "a\\rb" in line


def test_a_tensorboard_that_does_not_import_is_one_message_before_the_model(tmp_path, monkeypatch):
    """Issue 41 (elsewhere): the package present but its import broken was a traceback after the model was
    built; now the preflight tries the import and names it, before any model is loaded."""
    import erclip
    from plumbing import models
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # what a broken install raises: ImportError
    built = []
    monkeypatch.setattr(models, "load_model", lambda *a, **k: built.append(a) or pytest.fail("model loaded"))
    root = tmp_path / "data"
    lab.synthetic_manifest("train", root, n=16)
    with pytest.raises(UsageError, match=r"torch.utils.tensorboard does not import \(ModuleNotFoundError"):
        erclip.main(["--data-root", str(root), "--train-data", "synthetic", "--train-pairs", "16", "--batch-size",
                     "8", "--steps", "2", "--workers", "0", "--device", "cpu", "--eval-tasks", "none",
                     "--pretrained", "random", "--report-to", "tensorboard", "--out", str(tmp_path / "tb")])
    assert not built


def test_a_validation_sets_missing_image_is_named_once(tmp_path, capsys):
    """Issue 41 (elsewhere): --val-every's set with a missing image was reported by the row check and again at
    every validation (four times in a 4-step run at --val-every 2); now once."""
    import erclip
    root = tmp_path / "data"
    lab.synthetic_manifest("train", root, n=16)
    val = Path(lab.synthetic_manifest("test", root, n=12))
    rows = [json.loads(line) for line in val.read_text().splitlines()]
    rows[3]["image"] = "missing.png"
    (val.parent / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    erclip.main(["--data-root", str(root), "--train-data", "synthetic", "--train-pairs", "16", "--batch-size", "8",
                 "--steps", "4", "--warmup", "1", "--workers", "0", "--device", "cpu", "--eval-tasks", "none",
                 "--pretrained", "random", "--val-data", str(val.parent / "val.jsonl"), "--val-every", "2",
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert err.count("missing.png") == 1, err


# ----------------------------------------------------------------------------- issue 55.3: the minor items
def test_m2mix_random_initial_weights_are_seeded(tmp_path, monkeypatch):
    """`m2mix.py --pretrained random` was not seeded (same --seed, step-1 loss 2.9284 vs 2.9660); now its random
    initial weights are a function of --seed, as erclip's, longclip's and cclip's."""
    import m2mix
    from papers import m2mix_data
    weights = []
    monkeypatch.setattr(common, "train", lambda cfg, net, *a, **k: weights.append(
        {n: p.detach().clone() for n, p in net.named_parameters()}) or {"stopped_at": 0})
    monkeypatch.setattr(m2mix_data, "train_manifest",
                        lambda cfg, world=None: lab.synthetic_manifest("train", cfg.data_root, 8))
    for seed, out in ((3, "a"), (3, "b"), (4, "c")):
        torch.manual_seed(100 + len(weights))  # whatever the global RNG holds before
        m2mix.finetune(m2mix.M2MixConfig(backbone="tiny", pretrained="random", seed=seed, eval_base=False,
                                         device="cpu", data_root=str(tmp_path), out=str(tmp_path / out)))
    assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])
    assert not all(torch.equal(weights[0][n], weights[2][n]) for n in weights[0])


def test_batch_size_1_is_warned(tmp_path, capsys):
    """`--batch-size 1` trained at loss 0.0000 without a word; now one warning before training."""
    data = lab.synthetic_manifest("train", tmp_path / "data", n=4)
    cfg = Config(batch_size=1, workers=0, precision="fp32", out=str(tmp_path / "run"), device="cpu")
    common.preflight(cfg, [data])
    assert "--batch-size 1: a contrastive loss over one pair is 0" in capsys.readouterr().err


def test_messages_promise_only_what_exists_and_the_mosei_reader_is_not_a_command():
    """The disk-full message promised a checkpoint to resume from that may not exist; `python -m
    plumbing.mosei` ran nothing and exited 0 on any flag after 6 s of imports: now it says what it is, exit 1,
    before torch loads."""
    import errno
    from plumbing import cli
    message, code = cli.expected_error(OSError(errno.ENOSPC, "No space left on device", "runs/x/metrics.jsonl"))
    assert code == 1 and "if a checkpoint was saved before, --resume latest continues from it" in message
    for argv in (["--help"], ["--nonsense"]):
        r = subprocess.run([sys.executable, "-X", "importtime", "-m", "papers.mosei", *argv], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "gmc.py's MOSEI reader, not a command" in r.stderr
        assert "torch" not in {line.split("|")[-1].strip() for line in r.stderr.splitlines() if "|" in line}


def test_a_run_killed_before_its_first_checkpoint_gets_one_path_that_works(tmp_path):
    """After a SIGKILL before the first checkpoint (metrics.jsonl written, no checkpoints/last.pt), `--resume
    latest` said "start without --resume" and a start without it said "continue it with --resume latest": a loop
    only --overwrite broke. Both messages now name --overwrite, and it works; a run with a checkpoint is still
    told to continue with --resume latest."""
    data = lab.synthetic_manifest("train", tmp_path / "data", n=16)
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    cfg = Config(steps=1, batch_size=8, workers=0, precision="fp32", out=str(out), device="cpu")
    for resume in ("", "latest"):
        with pytest.raises(RunError) as e:
            common.preflight(dataclasses.replace(cfg, resume=resume), [data])
        assert "stopped before its first" in str(e.value) and "--overwrite" in str(e.value)
        assert "continue it with --resume latest" not in str(e.value) and "without --resume" not in str(e.value)
    common.preflight(dataclasses.replace(cfg, overwrite=True), [data])
    (out / "checkpoints").mkdir(exist_ok=True)
    (out / "checkpoints" / "last.pt").write_bytes(b"x")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    with pytest.raises(RunError, match="continue it with --resume latest"):
        common.preflight(cfg, [data])


def test_special_files_are_refused_as_manifests(tmp_path):
    """`--train-data /dev/zero` was read until the process was killed, and `--train-data <(cat x.jsonl)` read the
    pipe twice ("no rows"); a manifest must be a regular file (or a data folder), one message otherwise."""
    fifo = tmp_path / "rows.fifo"
    os.mkfifo(fifo)
    for path in (Path("/dev/zero"), fifo):
        with pytest.raises(DataError, match="not a regular file .*write it to a file first"):
            read_manifest(path)


def test_a_signal_after_the_loop_says_whether_training_is_repeated(tmp_path, monkeypatch):
    """A SIGTERM in the final phase (after the last step, before model.pt) said "finished training is not
    repeated", and the resume redid the steps after the last checkpoint (36-40). Now that is said only when
    model.pt is there; otherwise the message says training goes on from its last checkpoint."""
    from plumbing import cli
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "last.pt").write_bytes(b"x")
    (out / "metrics.jsonl").write_text('{"step": 35}\n')
    monkeypatch.setattr(runfolder, "RUN_OUT", out)
    message, code = cli.interrupted_message(signal.SIGTERM)
    assert code == 143 and "training goes on from its last checkpoint" in message and "not repeated" not in message
    (out / "model.pt").write_bytes(b"x")
    message, _ = cli.interrupted_message(signal.SIGTERM)
    assert "finished training is not repeated, the evaluation is" in message
