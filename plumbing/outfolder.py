"""The checks that need no torch (issue 42.4): a training manifest that is not there; the --out folder's: one run
per --out (its .lock), a run already there, a folder that cannot be written. Standard library only, so a script
answers them in well under a second (flags.answer_early), before torch and open_clip load; plumbing.runfolder
takes the lock and starts the run with the same checks and messages."""
from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path

from plumbing.base import DataError, RunError, UsageError

LOCK = ".lock"
BOTH = "--resume continues the run in --out and --overwrite deletes it: pass one of them"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def lock_state(folder: Path) -> tuple[str, dict]:
    """(state, the lock's content) of `folder`'s lock: 'free' (none), 'mine' (this process's), 'live' (a live
    process on this host, or any on another host: it cannot be checked from here) or 'stale' (its process is gone,
    or the file is unreadable)."""
    try:
        held = json.loads((Path(folder) / LOCK).read_text() or "{}")
    except FileNotFoundError:
        return "free", {}
    except (OSError, ValueError):
        held = {}
    if held == {"pid": os.getpid(), "host": socket.gethostname()}:
        return "mine", held
    pid = held.get("pid")
    alive = held.get("host") not in (None, socket.gethostname()) or isinstance(pid, int) and pid_alive(pid)
    return ("live" if alive else "stale"), held


def live_holder(folder: Path) -> dict | None:
    """{pid, host} of the live process other than this one whose lock is on `folder`; None when the folder is
    free, its lock stale or this process's own."""
    state, held = lock_state(folder)
    return held if state == "live" else None


def locked(out: Path, held: dict) -> RunError:
    """The refusal of an --out that a live process holds."""
    pid, path = held.get("pid"), out / LOCK
    if held.get("host") not in (None, socket.gethostname()):
        return RunError(f"{out} is locked by PID {pid} on {held['host']} ({path}); if that run is gone, "
                        f"delete {path}")
    return RunError(f"another run (PID {pid}) is writing to {out}; wait for it, stop it, or choose another --out")


def resumable(out: Path) -> bool:
    """Whether `out` holds something --resume latest continues: a checkpoint, or a task sequence's record."""
    return (out / "checkpoints" / "last.pt").exists() or (out / "continual.json").exists()


def holds_run(out: Path) -> bool:
    """Whether `out` holds a run: something to resume, or a log of steps taken (killed before its first save)."""
    return resumable(out) or (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size > 0


def occupied(out: Path) -> RunError:
    if not resumable(out):  # issue 55.3: stopped before its first save; --resume latest would find nothing
        return RunError(f"{out} holds a run that stopped before its first checkpoint (metrics.jsonl, no "
                        f"checkpoints/last.pt): nothing to resume; start it afresh with --overwrite (deletes its "
                        f"run files), or choose another --out")
    return RunError(f"{out} holds a run already (checkpoints / metrics.jsonl); continue it with --resume latest, "
                    f"start it afresh with --overwrite (deletes its run files), or choose another --out")


def unwritable(out: Path, why: str) -> UsageError:
    return UsageError(f"--out {out}: cannot be created or written ({why}); choose a writable folder")


def write_problem(start) -> tuple[Path, str] | None:
    """(the nearest existing folder at or above `start`, why nothing can be made in it) or None when something
    can: it is a file, or a probe folder cannot be made there (tried and removed at once: os.access says yes to
    root on a read-only file system). --out's early check and folders.check_target (an export's parent) ask it."""
    ancestor = Path(os.path.realpath(start))
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return ancestor, "a file, not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=ancestor))
    except OSError as e:
        return ancestor, e.strerror or str(e)
    return None


MANIFEST_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".parquet")


def early_problem(cfg) -> Exception | None:
    """What the run would refuse, found without torch and without writing anything (but write_problem's probe): a
    --train-data file that
    does not exist (a path, not a name such as auto or coco, nor shards); then what start_run refuses about
    cfg.out: --resume with --overwrite, a folder that cannot be made or written, a live lock, a run already there
    (without --resume / --overwrite). None when none of them (the run still checks everything itself)."""
    data = str(getattr(cfg, "train_data", "") or "")
    if (data.endswith(MANIFEST_SUFFIXES) or os.sep in data) and not data.endswith(".tar") and "{" not in data \
            and not Path(data).exists():
        return DataError(f"--train-data {data}: manifest not found")
    if cfg.resume and cfg.overwrite:
        return UsageError(BOTH)
    out = Path(cfg.out)
    if (problem := write_problem(out)) is not None:
        return unwritable(out, f"{problem[1]}: {problem[0]}")
    if (held := live_holder(out)) is not None:
        return locked(out, held)
    if not cfg.resume and not cfg.overwrite and holds_run(out):
        return occupied(out)
    return None
