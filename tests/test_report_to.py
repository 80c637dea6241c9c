"""Issue 59.4: --report-to tensorboard,wandb,trackio in any combination (plumbing/reporting.py). wandb and trackio
are optional packages, not in requirements.txt: these tests run them as stand-in modules put in sys.modules that
record init / log / finish (the same calls plumbing.reporting makes of the real ones); the last test runs the real
packages, offline, where they are installed. Each backend gets metrics.jsonl's scalars, a resumed run continues the
same runs, wandb runs offline without a login or a network (said once), and a missing package is one message
before any model loads."""
import importlib.machinery
import json
import os
import sqlite3
import subprocess
import sys
import types
from pathlib import Path

import pytest

from plumbing.base import UsageError
from plumbing import base, flags, models, reporting
from test_interop import _erclip as interop_erclip  # the tiny ERCLIP run both files use

REPO = Path(__file__).resolve().parents[1]


class StandInRun:
    """What wandb.init / trackio.init return here: the init's arguments, each log(values, step), finish()."""

    def __init__(self, kwargs):
        self.kwargs, self.logged, self.finished = kwargs, [], False

    def log(self, values, step=None):
        self.logged.append((step, dict(values)))

    def finish(self):
        self.finished = True


def stand_in(name: str, runs: list) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # installed, as find_spec sees it
    module.init = lambda **kwargs: runs.append(StandInRun(kwargs)) or runs[-1]
    module.log = lambda values, step=None: runs[-1].log(values, step)  # trackio's module-level calls
    module.finish = lambda: runs[-1].finish()
    return module


@pytest.fixture
def backends(monkeypatch, tmp_path):
    """wandb and trackio as stand-ins; no wandb login (no WANDB_API_KEY, an empty netrc), WANDB_MODE unset: as on
    this machine, which has no network. Returns {name: [StandInRun per init]}."""
    runs = {"wandb": [], "trackio": []}
    for name in runs:
        monkeypatch.setitem(sys.modules, name, stand_in(name, runs[name]))
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    base.warn_once.cache_clear()  # the offline line is said once per process: count it from here
    return runs


def _erclip(tmp_path, out, *extra):
    """test_interop's tiny ERCLIP run, validating every 2 steps (so validation scalars reach the backends too)."""
    return interop_erclip(tmp_path, out, "--val-every", "2", *extra)


def metrics_as_scalars(out: Path) -> list:
    """[(step, {name: value})] of <out>/metrics.jsonl as the backends should get them: a training record's
    numbers as train/<name>, a validation's val/ keys as they are; the step is the axis."""
    found = []
    for rec in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()):
        val = any(k.startswith("val/") for k in rec)
        found.append((rec["step"], {(k if val else f"train/{k}"): v for k, v in rec.items() if k != "step" and
                                    isinstance(v, (int, float)) and not isinstance(v, bool)}))
    return found


def test_report_to_reads_any_combination_once_each(capsys):
    assert flags.parse_config(flags.Config, ["--report-to", "trackio,wandb"]).report_to == "wandb,trackio"
    assert flags.parse_config(flags.Config, ["--report-to", "wandb,tensorboard,trackio,wandb"]).report_to == \
        "tensorboard,wandb,trackio"
    assert flags.parse_config(flags.Config, ["--report-to", "all"]).report_to == "tensorboard,wandb"  # open_clip's
    assert flags.parse_config(flags.Config, []).report_to == ""
    with pytest.raises(SystemExit):
        flags.parse_config(flags.Config, ["--report-to", "wandb,neptune"])
    assert "unknown backend(s) neptune: expected a comma-separated list of tensorboard, wandb, trackio" in \
        capsys.readouterr().err


def test_every_backend_gets_the_scalars_of_metrics_jsonl(tmp_path, backends, capsys):
    pytest.importorskip("tensorboard")  # in requirements.txt: skipped only outside them
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    _erclip(tmp_path, "r", "--report-to", "wandb,trackio,tensorboard")
    out = tmp_path / "r"
    expected = metrics_as_scalars(out)
    assert [s for s, _ in expected] == [1, 2, 2, 3, 4, 4] and "train/loss_pres" in expected[0][1]
    (wandb,), (trackio,) = backends["wandb"], backends["trackio"]
    assert wandb.logged == expected and trackio.logged == expected  # the same numbers, at the same steps
    assert wandb.finished and trackio.finished
    runs = json.loads((out / "config.json").read_text())["report_to_runs"]
    assert wandb.kwargs == dict(project="erclip", name="r", id=runs["wandb"], resume="allow", dir=str(out),
                                config=wandb.kwargs["config"], mode="offline")
    assert wandb.kwargs["config"]["report_to"] == "tensorboard,wandb,trackio" and len(runs["wandb"]) == 8
    assert trackio.kwargs == dict(project="erclip", name=runs["trackio"], config=wandb.kwargs["config"],
                                  resume="never", embed=False, auto_log_cpu=False, auto_log_gpu=False)
    assert runs["trackio"].startswith("r-")
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {k for _, values in expected for k in values}
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (s, pytest.approx(v["train/loss"], rel=1e-6)) for s, v in expected if "train/loss" in v]
    err = capsys.readouterr().err
    assert err.count("[report] wandb runs offline (no wandb login: neither WANDB_API_KEY nor a netrc entry for "
                     "api.wandb.ai)") == 1


def test_a_resumed_run_continues_the_same_runs(tmp_path, backends, capsys):
    _erclip(tmp_path, "r", "--report-to", "wandb,trackio", "--stop-at", "2")
    _erclip(tmp_path, "r", "--report-to", "wandb,trackio", "--resume", "latest")
    first, again = backends["wandb"]
    assert again.kwargs["id"] == first.kwargs["id"] and again.kwargs["resume"] == first.kwargs["resume"] == "allow"
    (t_first, t_again) = backends["trackio"]
    assert t_again.kwargs["name"] == t_first.kwargs["name"]
    assert (t_first.kwargs["resume"], t_again.kwargs["resume"]) == ("never", "allow")  # trackio: by its name
    assert json.loads((tmp_path / "r" / "config.json").read_text())["report_to_runs"] == {
        "wandb": first.kwargs["id"], "trackio": t_first.kwargs["name"]}
    expected = metrics_as_scalars(tmp_path / "r")  # the whole run's, both parts
    assert first.logged + again.logged == expected == t_first.logged + t_again.logged
    assert [s for s, _ in again.logged] == [3, 4, 4]
    assert capsys.readouterr().err.count("[report] wandb runs offline") == 1  # said once in the process
    _erclip(tmp_path, "r", "--report-to", "wandb,trackio", "--overwrite")  # a new run: new ones
    assert backends["wandb"][-1].kwargs["id"] != first.kwargs["id"]
    assert backends["trackio"][-1].kwargs["name"] != t_first.kwargs["name"]


def test_wandb_goes_online_only_with_a_login_and_its_server_reachable(tmp_path, backends, monkeypatch):
    import socket
    assert reporting.wandb_offline_reason().startswith("no wandb login")
    monkeypatch.setenv("WANDB_MODE", "online")  # the user's choice decides, either way
    assert reporting.wandb_offline_reason() is None
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password secret\n")

    def unreachable(address, timeout):
        assert address == ("api.wandb.ai", 443) and timeout <= 3
        raise OSError("no route")
    monkeypatch.setattr(socket, "create_connection", unreachable)
    assert reporting.wandb_offline_reason() == "api.wandb.ai:443 is not reachable (OSError)"
    monkeypatch.setattr(socket, "create_connection", lambda address, timeout: types.SimpleNamespace(close=lambda: 0))
    assert reporting.wandb_offline_reason() is None
    _erclip(tmp_path, "r", "--report-to", "wandb", "--steps", "2")
    assert "mode" not in backends["wandb"][-1].kwargs  # online: wandb's own default


def test_a_missing_package_is_one_message_before_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an absent package looks like to find_spec
    monkeypatch.setitem(sys.modules, "trackio", None)

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the flags' packages were checked")
    monkeypatch.setattr(models, "load_model", no_model)
    with pytest.raises(UsageError) as e:
        _erclip(tmp_path, "r", "--report-to", "tensorboard,wandb,trackio")
    assert str(e.value) == ("--report-to tensorboard,wandb,trackio needs the wandb and trackio packages: pip install "
                            "wandb trackio (or drop wandb and trackio from --report-to)")
    with pytest.raises(UsageError, match=r"needs the trackio package: pip install trackio \("):
        _erclip(tmp_path, "r", "--report-to", "trackio")
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.skipif(not (reporting.installed("wandb") and reporting.installed("trackio")),
                    reason="wandb and trackio are optional (pip install wandb trackio)")
def test_the_real_wandb_and_trackio_offline_and_resumed(tmp_path):
    """The real packages, offline in a process of their own (trackio reads TRACKIO_DIR at import): a run stopped at
    step 2 and resumed writes two offline wandb runs of one id in <out>/wandb, and one trackio run holding every
    step of metrics.jsonl."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "TRACKIO_"))}
    env.update(HOME=str(tmp_path / "home"), TRACKIO_DIR=str(tmp_path / "trackio"), NETRC=str(tmp_path / "none"),
               PYTHONPATH=str(REPO))
    code = ("import sys, lab, erclip\nroot = sys.argv[1]\nlab.synthetic_manifest('train', root, n=16)\n"
            "erclip.main(['--data-root', root, '--train-data', 'synthetic', '--train-pairs', '16', '--batch-size', "
            "'8', '--steps', '4', '--warmup', '1', '--workers', '0', '--log-every', '1', '--device', 'cpu', "
            "'--eval-tasks', 'none', '--pretrained', 'random', '--report-to', 'wandb,trackio', '--out', sys.argv[2], "
            "*sys.argv[3:]])\n")
    for extra in (["--stop-at", "2"], ["--resume", "latest"]):
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "data"), str(tmp_path / "r"), *extra],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    runs = json.loads((tmp_path / "r" / "config.json").read_text())["report_to_runs"]
    offline = sorted((tmp_path / "r" / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(p.name.endswith(f"-{runs['wandb']}") for p in offline)
    db = sqlite3.connect(tmp_path / "trackio" / "erclip.db")
    rows = db.execute("select run_name, step, metrics from metrics order by id").fetchall()
    assert {r[0] for r in rows} == {runs["trackio"]}
    expected = metrics_as_scalars(tmp_path / "r")
    assert [(step, json.loads(m)) for _, step, m in rows] == expected
