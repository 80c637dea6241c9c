"""--report-to's backends beside metrics.jsonl, in any combination: tensorboard (<out>/tensorboard), wandb and
trackio. Each gets the scalars of every metrics.jsonl record at its step (rank 0): a training record's numbers as
train/<name> (its step is the axis), a validation's as val/<task>/<metric>.

- wandb runs offline, said once, unless it can go online: the user's WANDB_MODE decides when set; otherwise a
  login (WANDB_API_KEY, or a netrc entry for WANDB_BASE_URL's host) and that host reachable within 3 s, else
  offline. Its files go to <out>/wandb (`wandb sync <out>/wandb/offline-run-*` uploads them later).
- trackio logs locally (its own TRACKIO_DIR, by default in the Hugging Face cache; `trackio show`), unless the
  user's TRACKIO_SPACE_ID / TRACKIO_SERVER_URL point it elsewhere; no system metrics, only ours.
- A resumed run (--resume) continues the same run: the wandb id and the trackio run name are kept in the run's
  config.json under report_to_runs (runfolder.write_config carries them over on resume), and passed back as
  wandb.init(id=..., resume="allow") and trackio.init(name=..., resume="allow") (open_clip's main.py does the same
  for trackio). Steps logged after the checkpoint before the interruption are logged again with the same numbers
  (an exact resume): wandb keeps the first of each step; trackio keeps both points.

The packages are optional (not in requirements.txt): check(), called before any model is loaded, ends a run that
asks for a missing one with one message naming the pip command. Imports the standard library, plumbing.base and
plumbing.runfolder; each backend's package only when asked for."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import netrc
import os
import socket
import sys
import uuid
from pathlib import Path
from urllib.parse import urlparse

from plumbing import runfolder
from plumbing.base import UsageError, atomic_write, warn_once


def targets(report_to: str) -> list[str]:
    """--report-to's backends (flags.report_targets has checked them against flags.REPORT_TARGETS)."""
    return [t for t in report_to.split(",") if t]


def installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:  # imported already, without a spec (a stand-in module in tests)
        return sys.modules.get(package) is not None


def check(report_to: str):
    """Before any model is loaded: every backend's package is installed (tensorboard's also imports); otherwise one
    UsageError naming what is missing and the pip command."""
    wanted = targets(report_to)
    missing = [t for t in wanted if not installed(t)]  # each backend's module is its pip package's name
    if missing:
        names = " and ".join(missing)
        raise UsageError(f"--report-to {','.join(wanted)} needs the {names} package{'s' * (len(missing) > 1)}: "
                         f"pip install {' '.join(missing)} (or drop {names} from --report-to)")
    if "tensorboard" in wanted:
        runfolder.needs_tensorboard()


def wandb_offline_reason() -> str | None:
    """Why wandb should run offline, or None: WANDB_MODE set by the user (theirs decides), or a login and the
    server reachable (online)."""
    if os.environ.get("WANDB_MODE"):
        return None
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    host, port = url.hostname or "api.wandb.ai", url.port or (80 if url.scheme == "http" else 443)
    try:
        login = netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        login = False
    if not (os.environ.get("WANDB_API_KEY") or login):
        return f"no wandb login: neither WANDB_API_KEY nor a netrc entry for {host}"
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as e:
        return f"{host}:{port} is not reachable ({type(e).__name__})"
    return None


def record_runs(out: Path, runs: dict):
    """Adds the runs to <out>/config.json (written by runfolder.write_config just before)."""
    path = out / "config.json"
    rec = json.loads(path.read_text()) if path.exists() else {}
    rec[runfolder.REPORT_RUNS] = runs
    atomic_write(path, json.dumps(rec, indent=1))


def project_of(cfg) -> str:
    """The wandb / trackio project: WANDB_PROJECT when set, else the method's name (erclip, m2mix, ...)."""
    module = type(cfg).__module__
    if module == "__main__":
        module = Path(getattr(sys.modules["__main__"], "__file__", None) or "clip-finetune").stem
    return os.environ.get("WANDB_PROJECT") or module.split(".")[-1]


class Reporters:
    """The --report-to backends of one run (rank 0): scalars(values, step) sends the numbers to each,
    close() closes them (wandb and trackio: finish)."""

    def __init__(self, cfg, out: Path):
        check(cfg.report_to)
        self.sinks = []  # (name, log(values, step), close())
        wanted = targets(cfg.report_to)
        runs = runfolder.report_runs(out) if cfg.resume else {}  # a fresh run starts new ones
        config = dataclasses.asdict(cfg)
        try:
            if "tensorboard" in wanted:
                board = runfolder.tensorboard_writer(out)
                self.sinks.append(("tensorboard", lambda values, step: _each(board.add_scalar, values, step),
                                   board.close))
            if "wandb" in wanted:
                import wandb
                runs.setdefault("wandb", uuid.uuid4().hex[:8])
                reason = wandb_offline_reason()
                if reason:
                    warn_once(f"[report] wandb runs offline ({reason}): a run's files go to <out>/wandb, and "
                              f"`wandb sync <out>/wandb/offline-run-*` uploads them later; WANDB_MODE=online or "
                              f"offline decides instead")
                run = wandb.init(project=project_of(cfg), name=out.name, id=runs["wandb"], resume="allow",
                                 dir=str(out), config=config, **({"mode": "offline"} if reason else {}))
                self.sinks.append(("wandb", lambda values, step: run.log(values, step=step), run.finish))
            if "trackio" in wanted:
                import trackio
                runs.setdefault("trackio", f"{out.name}-{uuid.uuid4().hex[:8]}")
                trackio.init(project=project_of(cfg), name=runs["trackio"], config=config,
                             resume="allow" if cfg.resume else "never", embed=False, auto_log_cpu=False,
                             auto_log_gpu=False)  # our scalars only, no system metrics
                self.sinks.append(("trackio", lambda values, step: trackio.log(values, step=step), trackio.finish))
        except BaseException:
            self.close()
            raise
        if runs:
            record_runs(out, runs)

    def scalars(self, values: dict, step: int):
        """The numbers of `values` (not None, not text) at `step`, to every backend."""
        values = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for _, log, _ in self.sinks:
            log(values, step)

    def close(self):
        for _, _, close in self.sinks:
            close()
        self.sinks = []


def _each(add_scalar, values: dict, step: int):
    for k, v in values.items():
        add_scalar(k, v, step)
