"""The user's own path (issue 15, items 1, 2, 3, 6, 8): what --train-data /
--tasks auto does, one clear message per expected failure (checked before
any model is loaded), resume that refuses changed settings, one run per
--out, parse-time checks of the numbers, signals and progress lines."""
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import cclip
from plumbing import models, runfolder
import socket
from plumbing import base
import common
from plumbing.base import RunError, UsageError, atomic_write
from plumbing.cli import StopSignals, cli
from plumbing.flags import Config, parse_config
from plumbing.manifests import read_manifest
import dns
import erclip
import lab
import longclip
import m2mix

REPO = Path(__file__).resolve().parents[1]
RUN_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """One small synthetic world for the whole file (generated once)."""
    r = tmp_path_factory.mktemp("data")
    lab.synthetic_manifest("train", r, n=16)
    return r


def _erclip(root, out, *extra):
    return erclip.main(["--data-root", str(root), "--train-data", "synthetic", "--train-pairs", "16",
                        "--batch-size", "8", "--steps", "3", "--warmup", "1", "--lr", "1e-4", "--workers", "0",
                        "--log-every", "1", "--device", "cpu", "--eval-tasks", "none", "--pretrained", "random",
                        "--out", str(out), *extra])


def _cli(capsys, main, argv):
    """common.cli as a script's __main__ runs it: (exit code, stderr)."""
    with pytest.raises(SystemExit) as e:
        cli(main, argv)
    return e.value.code, capsys.readouterr().err


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails loudly: the check under test must come first."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the check")
    monkeypatch.setattr(models, "load_model", refuse)


def _copy_run(src, out):
    """A copy of a run folder that resumes as its own run."""
    import shutil
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "out": str(out)}))
    return out


def _script(*args, cwd):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=RUN_ENV, capture_output=True, text=True,
                          timeout=120)


# ----------------------------------------------------------------------------- 1. --train-data auto
def test_the_researchers_command_without_weights_or_data_prints_one_paragraph(tmp_path):
    r = _script(str(REPO / "erclip.py"), "--backbone", "ViT-B/16", "--epochs", "1", cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "captions_train2017.json" in r.stderr and "Real data" in r.stderr
    assert "--train-data synthetic" in r.stderr and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("cls, name", [(erclip.ERCLIPConfig, "train_data"), (longclip.LongCLIPConfig, "train_data"),
                                       (m2mix.M2MixConfig, "train_data"), (cclip.CClipConfig, "tasks"),
                                       (dns.DNSConfig, "tasks")])
def test_every_script_defaults_to_auto(cls, name):
    assert getattr(parse_config(cls, []), name) == "auto"


def test_auto_picks_the_papers_data_then_synthetic_for_tiny_else_refuses(tmp_path):
    need = tmp_path / "paper.json"
    tiny = Config(train_data="auto", backbone="tiny", data_root=str(tmp_path))
    real = Config(train_data="auto", backbone="ViT-B/16", data_root=str(tmp_path))
    assert common.resolve_auto(tiny, "train_data", "paper", [need], "x").train_data == "synthetic"
    with pytest.raises(RunError, match=f"missing: {need}.*--train-data synthetic"):
        common.resolve_auto(real, "train_data", "paper", [need], "x")
    need.write_text("{}")
    assert common.resolve_auto(real, "train_data", "paper", [need], "x").train_data == "paper"
    assert common.resolve_auto(tiny, "train_data", "paper", [need], "x").train_data == "paper"
    mine = Config(train_data="mine.jsonl", backbone="ViT-B/16")
    assert common.resolve_auto(mine, "train_data", "paper", [need], "x") is mine


@pytest.mark.parametrize("main, extra", [(m2mix.main, []), (cclip.main, []), (dns.main, ["--backbone", "ViT-B/16"])],
                         ids=["m2mix", "cclip", "dns"])
def test_bare_run_with_a_papers_backbone_asks_for_the_data(tmp_path, capsys, main, extra, no_model):
    code, err = _cli(capsys, main, ["--data-root", str(tmp_path), "--out", str(tmp_path / "o"), *extra])
    assert code == 1 and "smoke test" in err and "synthetic" in err and not (tmp_path / "o").exists()


def test_missing_weights_are_one_message(tmp_path, root, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, err = _cli(capsys, erclip.main, ["--backbone", "ViT-B/16", "--train-data", "synthetic", "--data-root",
                                           str(root), "--train-pairs", "16", "--batch-size", "8",
                                           "--eval-tasks", "none", "--out", str(tmp_path / "o")])
    assert code == 1 and err.startswith("error: cannot get the ViT-B-16 weights") and err.count("\n") == 1


# ----------------------------------------------------------------------------- 2. one message, checked first
def test_a_bad_flag_is_one_message_and_exit_2(capsys):
    code, err = _cli(capsys, erclip.main, ["--log-every", "0"])
    assert code == 2 and err.strip().endswith("error: argument --log-every: must be > 0, got 0")


def test_debug_shows_the_traceback(tmp_path, root):
    with pytest.raises(UsageError, match="no CUDA"):
        cli(erclip.main, ["--device", "cuda:7", "--debug", "--data-root", str(root), "--train-pairs", "16",
                                 "--batch-size", "8"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_before_the_model(tmp_path, root, capsys, no_model):
    code, err = _cli(capsys, erclip.main, ["--device", "cuda", "--data-root", str(root), "--train-pairs", "16",
                                           "--batch-size", "8", "--out", str(tmp_path)])
    assert code == 2 and "no CUDA device" in err


def test_fp16_on_cpu_is_still_allowed_with_a_warning(capsys):
    assert common.check_device(Config(device="cpu", precision="fp16")) == "fp16"


def test_unwritable_out_is_found_before_the_model(tmp_path, root, capsys, no_model):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, err = _cli(capsys, erclip.main, ["--data-root", str(root), "--train-data", "synthetic",
                                           "--train-pairs", "16", "--batch-size", "8", "--out", str(blocker / "out")])
    assert code == 2 and f"--out {blocker / 'out'}: cannot be created" in err and "Traceback" not in err


def test_batch_larger_than_the_data_is_found_before_the_model(tmp_path, root, capsys, no_model):
    code, err = _cli(capsys, erclip.main, ["--data-root", str(root), "--train-data", "synthetic", "--train-pairs",
                                           "16", "--batch-size", "64", "--out", str(tmp_path / "o")])
    assert code == 2 and "fewer than one batch" in err


def _bad_row_manifest(tmp_path, root):
    rows = read_manifest(lab.synthetic_manifest("train", root, n=16))
    rows[5]["caption"] = ""
    path = lab.synthetic_manifest("train", root, n=16).with_name("train-16-bad.jsonl")  # images stay relative
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "_line"}) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("main", [cclip.main, dns.main], ids=["cclip", "dns"])
def test_every_tasks_manifest_is_checked_before_the_model(tmp_path, root, capsys, main, no_model):
    good = lab.synthetic_manifest("train", root, n=16)
    bad = _bad_row_manifest(tmp_path, root)
    code, err = _cli(capsys, main, ["--backbone", "tiny", "--tasks", f"a={good},b={bad}", "--batch-size", "8",
                                    "--data-root", str(root), "--out", str(tmp_path / "o")])
    assert code == 1 and f"{bad}:6: empty caption" in err


def test_full_disk_is_named_and_leaves_no_temporary_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(base, "_disk_full", lambda folder: True)

    def torch_save_fails(tmp):  # what torch.save raises on a full disk
        Path(tmp).write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing file")
    with pytest.raises(OSError) as e:
        atomic_write(tmp_path / "last.pt", torch_save_fails)
    assert e.value.errno == errno.ENOSPC and list(tmp_path.iterdir()) == []

    def main(argv):
        raise e.value
    code, err = _cli(capsys, main, [])
    assert code == 1 and "no space left on device (ENOSPC)" in err and "last.pt" in err


def test_a_corrupt_checkpoint_is_one_message_before_the_model(tmp_path, root, stopped, capsys, no_model):
    out = _copy_run(stopped[0], tmp_path / "run")
    ck = out / "checkpoints" / "last.pt"
    ck.write_bytes(ck.read_bytes()[:1000])  # cut, as a killed copy leaves it
    code, err = _cli(capsys, lambda argv: _erclip(root, out, *argv), ["--resume", "latest"])
    assert code == 1 and f"{ck} is not a readable checkpoint" in err


# ----------------------------------------------------------------------------- 3. resume restores the run
@pytest.fixture(scope="module")
def stopped(tmp_path_factory, root):
    """An ERCLIP M+P run (mean fusion) stopped at step 2 of 3."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    summary = _erclip(root, out, "--stop-at", "2")["summary"]
    return out, summary


def test_stop_at_records_the_checkpoint_it_saved(stopped):
    out, summary = stopped
    assert summary["stopped_at"] == 2 and Path(summary["checkpoint"]).is_file()
    assert not (out / "model.pt").exists() and not (out / "results.json").exists()


@pytest.mark.parametrize("flags, field", [(["--lr", "1e-3"], "lr"), (["--lambda-p", "0"], "lambda_p"),
                                          (["--fusion", "rt"], "fusion")])
def test_resume_with_a_changed_setting_is_refused_and_writes_nothing(root, stopped, flags, field):
    out, _ = stopped
    config = (out / "config.json").read_bytes()
    with pytest.raises(RunError, match=f"--{field.replace('_', '-')} .* \\(run\\) -> .* \\(now\\)"):
        _erclip(root, out, "--resume", "latest", *flags)
    assert (out / "config.json").read_bytes() == config and not (out / "model.pt").exists()


def test_override_resume_applies_and_records_the_new_lr(tmp_path, root, stopped):
    out = _copy_run(stopped[0], tmp_path / "run")
    _erclip(root, out, "--resume", "latest", "--lr", "1e-3", "--override-resume", "--workers", "0")
    saved = json.loads((out / "config.json").read_text())
    assert saved["lr"] == 1e-3 and saved["resume_overrides"] == [{"field": "lr", "was": 1e-4, "now": 1e-3}]
    ck = torch.load(out / "checkpoints" / "last.pt", weights_only=False)
    assert ck["step"] == 3 and ck["scheduler"]["base_lrs"] == [1e-3] * len(ck["optimizer"]["param_groups"])
    assert all(g["initial_lr"] == 1e-3 for g in ck["optimizer"]["param_groups"])  # the run's 1e-4 is replaced


def test_resume_accepts_execution_flags(tmp_path, root, stopped):
    out = _copy_run(stopped[0], tmp_path / "run")
    result = _erclip(root, out, "--resume", "latest", "--log-every", "2", "--save-every", "5", "--stop-at", "0")
    assert result["summary"]["steps"] == 3 and (out / "model.pt").exists()


def test_a_new_run_into_an_occupied_out_is_refused_unless_overwrite(tmp_path, root, stopped):
    out = _copy_run(stopped[0], tmp_path / "run")
    with pytest.raises(RunError, match="holds a run already.*--overwrite"):
        _erclip(root, out)
    with pytest.raises(UsageError, match="pass one of them"):
        _erclip(root, out, "--overwrite", "--resume", "latest")
    _erclip(root, out, "--overwrite")
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # the old run's lines are gone


def test_one_run_per_out_and_a_stale_lock_is_taken_over(tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / runfolder.LOCK).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))
    with pytest.raises(RunError, match=f"another run \\(PID {os.getppid()}\\) is writing"):
        runfolder.lock_out(out)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / runfolder.LOCK).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    runfolder.lock_out(out)
    assert json.loads((out / runfolder.LOCK).read_text())["pid"] == os.getpid()
    assert f"stale lock of PID {dead.pid}" in capsys.readouterr().err
    runfolder.lock_out(out)  # this process's own lock: kept


# ----------------------------------------------------------------------------- 6. numbers checked at parse time
@pytest.mark.parametrize("flag, value", [("--epochs", "0"), ("--steps", "-5"), ("--batch-size", "0"), ("--lr", "0"),
                                         ("--lr", "-1e-5"), ("--log-every", "0"), ("--save-every", "-1"),
                                         ("--epochs", "-1")])
def test_non_positive_numbers_are_refused_at_parse_time(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(erclip.ERCLIPConfig, [f"{flag}={value}"])
    assert e.value.code == 2 and f"argument {flag}: must be" in capsys.readouterr().err


# ----------------------------------------------------------------------------- 8. signals, progress, leftovers
class _SignalAtStep(lab.ClipFineTune):
    """Sends a signal to its own process in the middle of step `at` (0-based)."""
    def __init__(self, model, at, signum):
        super().__init__(model)
        self.at, self.signum = at, signum

    def forward(self, batch, ctx=None):
        if ctx.step == self.at:
            os.kill(os.getpid(), self.signum)
        return super().forward(batch, ctx)


def test_sigterm_saves_after_the_step_in_flight_and_prints_the_resume_command(tmp_path, root, tiny_random, capsys,
                                                                             monkeypatch):
    """SIGTERM (a scheduler's kill) in the middle of step 3: the step ends,
    then a checkpoint; SIGINT on the command line is the test after this one's."""
    signum = signal.SIGTERM
    model, pre, _, tok = tiny_random
    monkeypatch.setattr(runfolder, "COMMAND", ["erclip.py", "--out", str(tmp_path), "--overwrite"])
    cfg = Config(steps=8, batch_size=8, lr=1e-5, workers=0, precision="fp32", device="cpu", log_every=1,
                        out=str(tmp_path), save_every=0)
    data = common.ManifestDataset(lab.synthetic_manifest("train", root, n=16), pre)
    with pytest.raises(RunError) as e:
        common.train(cfg, _SignalAtStep(model, 2, signum), data, common.Collate(tok), export=False)
    assert e.value.code == 128 + signum
    assert f"python erclip.py --out {tmp_path} --resume latest" in str(e.value)
    ck = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=False)
    assert ck["step"] == 3  # the step the signal arrived in was finished, then saved
    assert signal.getsignal(signum) is not None and not isinstance(getattr(signal.getsignal(signum), "__self__", None),
                                                                   StopSignals)
    err = capsys.readouterr().err
    assert "step 1/8" in err and "step 3/8" in err  # stderr is no terminal here: progress lines


class _FailAtStep(lab.ClipFineTune):
    def forward(self, batch, ctx=None):
        if ctx.step == 1:
            raise ValueError("broken step")
        return super().forward(batch, ctx)


def test_signal_handlers_go_back_when_training_fails(tmp_path, root, tiny_random):
    """An error inside the loop (here a ValueError at step 2) leaves the
    process's SIGINT / SIGTERM handlers as they were before train."""
    model, pre, _, tok = tiny_random
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    cfg = Config(steps=4, batch_size=8, workers=0, precision="fp32", device="cpu", out=str(tmp_path),
                        save_every=0)
    data = common.ManifestDataset(lab.synthetic_manifest("train", root, n=16), pre)
    with pytest.raises(ValueError, match="broken step"):
        common.train(cfg, _FailAtStep(model), data, common.Collate(tok), export=False)
    assert {s: signal.getsignal(s) for s in before} == before


def test_leftover_temporary_files_are_removed_at_the_next_start(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / "checkpoints" / f"last.pt.tmp{dead.pid}"
    live = tmp_path / f"results.json.tmp{os.getppid()}"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    runfolder.start_run(Config(out=str(tmp_path)), tmp_path)
    assert not stale.exists() and live.exists()


@pytest.mark.slow
def test_ctrl_c_on_the_command_line_with_loader_workers(tmp_path, root):
    """Ctrl-C as a terminal sends it: SIGINT to the whole process group,
    DataLoader workers included. One message, the resume command, exit 130,
    a checkpoint at the last finished step."""
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, str(REPO / "erclip.py"), "--steps", "100", "--batch-size", "8",
                          "--train-pairs", "16", "--workers", "2", "--eval-tasks", "none", "--pretrained", "random",
                          "--data-root", str(root), "--log-every", "1", "--out", str(out)], cwd=tmp_path, env=RUN_ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = out / "metrics.jsonl"
    try:
        for _ in range(600):
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130 and "Traceback" not in err and err.count("saving a checkpoint") == 1
    assert "erclip.py --steps 100" in err and err.rstrip().endswith(f"--out {out} --resume latest")
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert torch.load(out / "checkpoints" / "last.pt", weights_only=False)["step"] == logged[-1] < 100


def test_one_spelling_per_idea_and_the_old_one_still_read_with_one_line(capsys):
    """Issue 42.1: the evaluation tasks, the evaluation before fine-tuning and the zero-shot sets are spelled as in
    the other scripts (--eval-tasks, --eval-base, --zero-shot); m2mix's --eval-on / --eval-zs and dns's --zeroshot
    are still read, each with one line naming the new spelling."""
    import dns
    import m2mix
    from plumbing import flags
    new = flags.parse_config(m2mix.M2MixConfig, ["--eval-tasks", "a,b", "--no-eval-base"])
    assert (new.eval_tasks, new.eval_base) == ("a,b", False) and capsys.readouterr().err == ""
    old = flags.parse_config(m2mix.M2MixConfig, ["--eval-on", "a,b", "--no-eval-zs"])
    assert (old.eval_tasks, old.eval_base) == ("a,b", False)
    err = capsys.readouterr().err
    assert "--eval-on is now spelled --eval-tasks" in err and "--no-eval-zs is now spelled --no-eval-base" in err
    cfg_cls = next(v for k, v in vars(dns).items() if k.endswith("Config") and v is not flags.Config
                   and isinstance(v, type) and issubclass(v, flags.Config))
    assert flags.parse_config(cfg_cls, ["--zero-shot", ""]).zero_shot == ""
    assert flags.parse_config(cfg_cls, ["--zeroshot", ""]).zero_shot == ""
    assert "--zeroshot is now spelled --zero-shot" in capsys.readouterr().err
    for cls in (m2mix.M2MixConfig, cfg_cls):  # the help shows the new spelling
        with pytest.raises(SystemExit):
            flags.parse_config(cls, ["--help"])
    shown = capsys.readouterr().out
    assert "--eval-tasks" in shown and "--eval-base" in shown and "--zero-shot" in shown


def test_a_folder_as_m2mix_training_data_is_not_blamed_on_a_flag_never_passed(tmp_path, capsys):
    """Issue 42.4: the training path is also m2mix's default evaluation task; the message named --eval-on, a flag
    the user never passed."""
    import m2mix
    (tmp_path / "imgs").mkdir()
    with pytest.raises(SystemExit):
        cli(m2mix.main, ["--backbone", "tiny", "--train-data", str(tmp_path / "imgs"), "--out",
                                str(tmp_path / "run"), "--data-root", str(tmp_path)])
    err = capsys.readouterr().err
    assert f"--train-data {tmp_path / 'imgs'}: a folder of no layout read here" in err  # issue 72.4: not an
    assert "--eval-on" not in err and "evaluation task" not in err  # evaluation task's failure


def test_messages_name_the_cause(tmp_path, capsys):
    """Issue 42.4: an unwritable --out names --out (it said "No such file or directory (/proc/x)"); a warm-up as
    long as the run says so (--steps 4 with --warmup 200 trained at lr 1.25e-07 without a word); eval.py's --help
    shows the defaults; a missing benchmark points at docs/data.md (README's 'Evaluation data' does not exist)."""
    import erclip
    import eval as evaluation
    import lab
    with pytest.raises(SystemExit):
        cli(erclip.main, ["--backbone", "tiny", "--train-data", "synthetic", "--out", "/proc/clipft-x",
                                 "--data-root", str(tmp_path / "data")])
    err = capsys.readouterr().err
    assert "--out /proc/clipft-x: cannot be created or written" in err and "Traceback" not in err
    data = lab.synthetic_manifest("train", tmp_path / "data", n=16)
    model, train_tf, _, tok = models.load_model("tiny", "random")
    cfg = Config(steps=4, batch_size=8, workers=0, precision="fp32", out=str(tmp_path / "run"), warmup=200,
                        device="cpu", log_every=1)
    common.train(cfg, lab.ClipFineTune(model), common.ManifestDataset(data, train_tf), common.Collate(tok),
                 export=False)
    assert "--warmup 200 is not shorter than the run (4 steps)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluation.main(["--help"])
    assert "(default:" in capsys.readouterr().out
    with pytest.raises(evaluation.MissingData, match="docs/data.md"):
        evaluation.load_retrieval("flickr30k", str(tmp_path / "nothing"))


@pytest.mark.parametrize("script", ["erclip", "longclip", "m2mix", "cclip", "dns", "gmc"])
def test_an_occupied_or_locked_out_is_answered_before_torch_loads(tmp_path, script):
    """Issue 42.4: an --out holding a run, or locked by a live run, or a --train-data file that is not there was
    reported after torch and open_clip loaded (18.7 s; erclip named a missing paper benchmark first); now
    flags.answer_early answers it (plumbing.outfolder, standard library only) with the run's own message and exit
    code, torch never imported. Every method script, as run from the shell."""
    occupied, busy = tmp_path / "occupied", tmp_path / "busy"
    (occupied / "checkpoints").mkdir(parents=True)
    (occupied / "checkpoints" / "last.pt").write_bytes(b"x")
    busy.mkdir()
    (busy / runfolder.LOCK).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))
    code = ("import runpy, sys; sys.argv = [sys.argv[1] + '.py', *sys.argv[2:]]\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit as e:\n"
            "    print('exit', e.code)\nprint('torch' in sys.modules)")
    for out, flags_, said, exit_code in (
            (occupied, [], "holds a run already", 1), (busy, [], f"another run (PID {os.getppid()}) is writing", 1),
            (occupied, ["--resume", "latest", "--overwrite"], "pass one of them", 2),
            *[(tmp_path / "new", ["--train-data", str(tmp_path / "none.jsonl")], "none.jsonl: manifest not found", 1)]
            * (script not in ("cclip", "dns"))):  # a training manifest that is not there (cclip, dns: --tasks)
        done = subprocess.run([sys.executable, "-c", code, script, "--out", str(out), *flags_], cwd=REPO,
                              capture_output=True, text=True, env=RUN_ENV)
        assert said in done.stderr and done.stderr.startswith("error: "), done.stderr
        assert done.stdout.split() == ["exit", str(exit_code), "False"], done.stdout


@pytest.mark.parametrize("script", ["erclip", "longclip", "m2mix", "cclip", "dns", "gmc"])
def test_every_default_says_where_it_comes_from(script):
    """Issue 42.1: --batch-size 128 / 1024 / 64 and a backbone default per script, with no word of whose. Now the
    help of each method's main settings names its source: the paper's section, the authors' code, ours or the lab's
    (a trailing comment in the config class is shown in brackets: plumbing.flags.default_sources)."""
    import re
    done = subprocess.run([sys.executable, f"{script}.py", "--help"], cwd=REPO, capture_output=True, text=True,
                          env=RUN_ENV)
    text = " ".join(done.stdout.split())
    for flag in ("--backbone", "--batch-size", "--lr", "--epochs"):
        said = re.search(rf" {flag} [A-Z_]+ (.*?) \(default: ", text).group(1)
        assert re.search(r"Sec\.|paper|code|train\.md|GMC|lab's|ours", said), (flag, said)
