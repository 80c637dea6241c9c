"""The run folder (--out) of every script: one run per folder (a lock naming its process and host), leftovers of
a killed run removed, an old run refused or cleared (--overwrite), and --resume's settings compared with the
run's (--override-resume). common re-exports these names (common.start_run, ...); train and preflight call them."""
import dataclasses
import json
import os
import re
import shutil
import socket
import sys
import zipfile
from pathlib import Path

import common
from common import RunError, UsageError, atomic_write, checkpoint_config, latest_checkpoint, world_size

__all__ = ["LOCK", "RUN_FILES", "RESUME_FREE", "lock_out", "lock_state", "live_holder", "clean_temporary",
           "holds_run", "clear_run", "resume_differences", "start_run", "write_config", "resume_command"]

LOCK = ".lock"
# Files and folders of a run (what --overwrite deletes); caches such as features/ or data/ stay.
RUN_FILES = ("checkpoints", "metrics.jsonl", "config.json", "results.json", "model.pt", "model.pt.json",
             "continual.json", "boundary.pt", "boundary.pt.json", "base.json")
# Settings that may change on --resume without --override-resume: where and how the run is executed or logged,
# never what it computes: device and precision (an fp32 run may go on in fp16, see train), the method files'
# eval-only flags, cclip.py's thread count and stop switch.
RESUME_FREE = {"resume", "stop_at", "workers", "log_every", "save_every", "debug", "device", "precision", "out",
               "cache_dir", "data_root", "find_unused", "overwrite", "override_resume", "demo", "stop_after_tasks",
               "threads", "eval_tasks", "eval_base", "eval_zs", "eval_on", "erclip_results", "collect",
               "report_to", "val_every", "val_data", "export", "batch_size_per_gpu", "accum_freq"}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def lock_out(out: Path):
    """One run per --out: <out>/.lock holds the writer's PID and host. A lock of this process is kept
    (re-entrant); one of a live process refuses; one of a dead process on this host is taken over with a
    message. Released when the process exits."""
    path, me = out / LOCK, {"pid": os.getpid(), "host": socket.gethostname()}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            state, held = lock_state(out)
            if state == "mine":
                return
            pid = held.get("pid")
            if state == "live" and held.get("host") not in (None, me["host"]):
                raise RunError(f"{out} is locked by PID {pid} on {held['host']} ({path}); if that run is gone, "
                               f"delete {path}")
            if state == "live":
                raise RunError(f"another run (PID {pid}) is writing to {out}; wait for it, stop it, or choose "
                               f"another --out")
            if state == "stale":
                print(f"[out] taking over the stale lock of PID {pid} (no longer running) in {out}", file=sys.stderr)
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        import atexit
        atexit.register(lambda: _unlock(path, me))
        return
    raise RunError(f"could not take the lock {path}")


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
    alive = held.get("host") not in (None, socket.gethostname()) or isinstance(pid, int) and _pid_alive(pid)
    return ("live" if alive else "stale"), held


def live_holder(folder: Path) -> dict | None:
    """{pid, host} of the live process other than this one whose lock is on `folder`; None when the folder is
    free, its lock stale or this process's own."""
    state, held = lock_state(folder)
    return held if state == "live" else None


def _unlock(path: Path, me: dict):
    try:
        if json.loads(path.read_text()) == me:
            path.unlink()
    except (OSError, ValueError):
        pass


def clean_temporary(out: Path) -> list[Path]:
    """Deletes the `*.tmp<PID>` files under --out that atomic_write left when its process was killed (or the
    disk filled), of processes no longer alive."""
    gone = []
    for p in out.rglob("*.tmp*"):
        m = re.fullmatch(r".+\.tmp(\d+)", p.name)
        if m and p.is_file() and not _pid_alive(int(m.group(1))):
            p.unlink(missing_ok=True)
            gone.append(p)
    if gone:
        print(f"[out] removed {len(gone)} temporary file(s) left by an interrupted run in {out}", file=sys.stderr)
    return gone


def holds_run(out: Path) -> bool:
    return any((out / name).exists() for name in ("checkpoints/last.pt", "continual.json")) or (
        (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size > 0)


def clear_run(out: Path):
    """Deletes a run's files in `out` (RUN_FILES, a task sequence's per-task folders), keeping caches and lock."""
    for p in [out / n for n in RUN_FILES] + [p for p in out.glob("task[0-9]*-*") if p.is_dir()]:
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def _resume_checkpoint(cfg, out: Path) -> Path:
    ck = latest_checkpoint(out) if cfg.resume == "latest" else Path(cfg.resume)
    if ck is None:
        raise RunError(f"--resume latest: no checkpoint in {out / 'checkpoints'}; start without --resume (or "
                       f"point --out at the run to continue)")
    if ck.is_dir():
        inside = latest_checkpoint(ck)
        raise RunError(f"--resume {ck}: a folder, not a checkpoint; " + (
            f"pass --resume latest --out {ck} (or --resume {inside})" if inside else
            "it holds no checkpoints/last.pt"))
    if not ck.exists():
        raise RunError(f"--resume {ck}: no such file; pass a checkpoint (<run>/checkpoints/last.pt) or latest")
    if not zipfile.is_zipfile(ck):  # torch.save writes a zip; a cut or empty file has no central directory
        raise RunError(f"{ck} is not a readable checkpoint (truncated, empty or not written by torch.save); "
                       f"delete it and resume from an older copy, or start afresh with --overwrite")
    return ck


def resume_differences(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """(field, old value, new value) of every setting outside RESUME_FREE that differs; fields unknown to the
    old run are not compared."""
    return [(k, old[k], v) for k, v in new.items() if k not in RESUME_FREE and k in old and old[k] != v]


def start_run(cfg, out: Path, continual: bool = False) -> list[dict]:
    """Claims --out for this run (rank 0): creates it (a clear error if it cannot be written), takes the lock,
    removes leftover temporary files; then a new run into an --out holding one is refused unless --overwrite
    (which clears it), and --resume compares the settings with the run's config.json and refuses differences
    unless --override-resume. Returns the overrides [{field, was, now}] (empty without --override-resume)."""
    if cfg.resume and cfg.overwrite:
        raise UsageError("--resume continues the run in --out and --overwrite deletes it: pass one of them")
    out.mkdir(parents=True, exist_ok=True)
    probe = out / f".write-test{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()
    lock_out(out)
    if common._RUN_OUT is None or not out.absolute().is_relative_to(common._RUN_OUT.absolute()):  # a task: inside
        common._RUN_OUT = out
    clean_temporary(out)
    if not cfg.resume:
        if holds_run(out):
            if not cfg.overwrite:
                raise RunError(f"{out} holds a run already (checkpoints / metrics.jsonl); continue it with "
                               f"--resume latest, start it afresh with --overwrite (deletes its run files), or "
                               f"choose another --out")
            print(f"[out] --overwrite: deleting the old run's files in {out}", file=sys.stderr)
            clear_run(out)
        return []
    old, before, saved = None, None, out / "config.json"
    if not continual:  # the checkpoint's own record of its settings; config.json is a copy for people
        ck = _resume_checkpoint(cfg, out)
        run_dir, saved = ck.parent.parent, ck.parent.parent / "config.json"
        old, before = checkpoint_config(ck)
    else:
        run_dir = out
        if not saved.exists():
            raise RunError(f"--resume {cfg.resume}: {out} holds no run to continue (no config.json); start "
                           f"without --resume")
    if old is None:  # a task sequence (its in-flight task's checkpoint is checked by train), or an old checkpoint
        if not saved.exists():
            print(f"[out] {saved} not found: the settings of the resumed run cannot be compared", file=sys.stderr)
            return []
        try:
            old = json.loads(saved.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise RunError(f"{saved} is not readable JSON ({e}); it records the run's settings: restore it, or "
                           f"start afresh with --overwrite") from None
        before = old.get("resume_overrides", [])
    diffs = resume_differences(old, dataclasses.asdict(cfg))
    if diffs and not cfg.override_resume:
        lines = "; ".join(f"--{k.replace('_', '-')} {a!r} (run) -> {b!r} (now)" for k, a, b in diffs)
        raise RunError(f"--resume would continue {run_dir} with changed settings: {lines}. Drop the changed flags "
                       f"to continue the run as it was, or pass --override-resume to continue with the new values "
                       f"(recorded in config.json under resume_overrides)")
    now = [{"field": k, "was": a, "now": b} for k, a, b in diffs]
    if now:
        changed = ", ".join(f"{d['field']}={d['now']!r}" for d in now)
        common._warn_once(f"[out] --override-resume: continuing with {changed}")  # preflight's and train's start_run
    return list(before or []) + now


def write_config(cfg, out: Path, overrides: list[dict] = ()):
    """<out>/config.json: the resolved settings, plus every --override-resume change so far."""
    rec = dataclasses.asdict(cfg)
    if overrides:
        rec["resume_overrides"] = list(overrides)
    atomic_write(out / "config.json", json.dumps(rec, indent=1))


def resume_command() -> str:
    """The command that continues this run: the script's own arguments without --resume / --overwrite /
    --stop-at, plus --resume latest."""
    import shlex
    if common._COMMAND is None:
        return "the same command with --resume latest"
    drop_with_value = {"--resume", "--stop-at", "--stop-after-tasks"}
    args, skip = [], False  # skip: a is the value of the flag before it
    for a in common._COMMAND[1:]:
        if not skip and a not in ("--overwrite", "--override-resume") and a.split("=")[0] not in drop_with_value:
            args.append(a)
        skip = not skip and a in drop_with_value
    launcher = ("python" if world_size() == 1 else "srun python" if "SLURM_PROCID" in os.environ
                else "torchrun --nproc_per_node N")
    return shlex.join([*launcher.split(), common._COMMAND[0], *args, "--resume", "latest"])
