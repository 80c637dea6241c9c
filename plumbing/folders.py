"""Folders written whole or not at all: what --export and `python -m commands.export` write (open_clip's hub
layout, a transformers CLIPModel folder). Standard library only; below plumbing.models and commands.export.

atomic_folder(path, write) fills a hidden sibling `.NAME.new-PID`, gives its files the process's umask
(safetensors' save_file makes 0600 files), fsyncs the files and folders, then puts it in `path`'s place: in one
step with Linux's renameat2(RENAME_EXCHANGE), else by renaming the old folder aside (`.NAME.old-PID`) first.
SIGINT / SIGTERM wait during that step, so a signal finds nothing changed or the new folder complete.
A SIGKILL at any point leaves the old folder or the new one at `path` (in the fallback, the old one beside it
for an instant, put back by recover); the leftovers of a killed export are put right by the next export or
check_target, never loaded as a model (plumbing.models refuses their names).

A folder is replaced only when this project wrote it: atomic_folder(..., marker=NAME) adds the file NAME listing
every file it wrote (a folder's receipt), and check_target refuses a folder without that receipt or holding
anything it does not list (a run folder's checkpoints/ and results.json, a downloaded model's README.md)."""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
from pathlib import Path

from plumbing.base import RunError, UsageError
from plumbing.outfolder import pid_alive, write_problem

LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>new|old)-(?P<pid>\d+)$")  # .NAME.new-PID / .NAME.old-PID
STOPS = (signal.SIGINT, signal.SIGTERM)


class FolderInterrupted(RunError):
    """SIGINT / SIGTERM while atomic_folder wrote a folder; in_place: the new folder was complete at its path
    (the signal came as it was put there), else nothing changed there. Exit code 128 + signal."""
    def __init__(self, message: str, signum: int, in_place: bool):
        super().__init__(message, 128 + signum)
        self.signum, self.in_place = signum, in_place


def process_umask() -> int:
    """The process's umask, read without setting it where Linux shows it (/proc/self/status); else set and put
    back (two os.umask calls)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def follow_umask(path, folder: bool = False):
    """Gives a file (or folder) the mode a plain open() (or mkdir) would under the process's umask: safetensors'
    save_file creates 0600 files, unreadable to a group that shares the model."""
    os.chmod(path, (0o777 if folder else 0o666) & ~process_umask())


def leftovers(path) -> list[Path]:
    """What killed writes of atomic_folder(path) left beside it: `.NAME.new-PID` (a new folder, whole or not)
    and `.NAME.old-PID` (the previous folder, moved aside or swapped out)."""
    path = Path(path)
    if not path.name or not path.parent.is_dir():
        return []
    return sorted(p for p in path.parent.glob(f".{glob_escape(path.name)}.*-*")
                  if (m := LEFTOVER.match(p.name)) and m["name"] == path.name)


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def is_leftover(path) -> bool:
    """Whether `path` is named as atomic_folder's temporary or set-aside copy (never a model to load)."""
    return LEFTOVER.match(Path(path).name) is not None


def _writer_alive(left: Path) -> bool:
    """Whether the process that named a leftover still runs (an export in progress: not ours to touch)."""
    pid = int(LEFTOVER.match(left.name)["pid"])
    if pid == os.getpid():
        return False  # this process writes one folder at a time: a leftover of ours is from an earlier call
    return pid_alive(pid)


def _remove(path: Path):
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def recover(path) -> list[str]:
    """Puts killed atomic_folder(path) writes right: a set-aside copy goes back when `path` is missing (the kill
    fell between moving the old folder out and the new one in), every other leftover is removed; those of a
    process still running (another export into the same folder) are left alone. Another process recovering at
    the same time (the ranks of one run) is no error. Returns what it did."""
    path, done = Path(path), []
    for left in sorted(leftovers(path), key=lambda p: ".old-" in p.name):  # new ones first, then the old
        if _writer_alive(left):
            continue
        if ".old-" in left.name and not os.path.lexists(path):
            try:
                os.replace(left, path)
                done.append(f"{left.name} put back as {path.name}")
                continue
            except FileNotFoundError:  # another process put it back first
                continue
            except OSError as e:  # path appeared meanwhile (ENOTEMPTY / EEXIST): the leftover goes
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
        _remove(left)
        done.append(f"{left.name} removed")
    return done


RECEIPT_BY = "written by this repository's export (plumbing.folders.atomic_folder)"


def receipt(folder: Path, marker: str) -> dict:
    """The receipt atomic_folder wrote in `folder` as `marker` ({'written_by', 'files'}), or {} when there is
    none or it is not ours."""
    try:
        got = json.loads((folder / marker).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    ok = isinstance(got, dict) and got.get("written_by") == RECEIPT_BY and isinstance(got.get("files"), list)
    return got if ok else {}


def foreign_entries(folder: Path, marker: str) -> list[str]:
    """What in `folder` its receipt does not list (top-level names, a folder's with '/'): every entry when it
    has no receipt of ours. Empty: atomic_folder may replace it."""
    got = receipt(folder, marker)
    listed = {marker, *got["files"]} if got else set()
    out = []
    for entry in sorted(folder.iterdir()):
        deep = entry.is_dir() and not entry.is_symlink()
        files = [p for p in entry.rglob("*") if not p.is_dir()] if deep else [entry]
        if not files or any(p.relative_to(folder).as_posix() not in listed for p in files):
            out.append(entry.name + ("/" if deep else ""))
    return out


def check_target(folder, flag: str, marker: str):
    """A folder atomic_folder may replace, checked before anything expensive: not a leftover's name, not a
    file, new or empty or one that atomic_folder wrote with this `marker` and nothing added since (it is
    replaced whole, so any other folder is refused, naming what it holds), under a folder this process can
    create folders in (tried: a hidden probe folder made and removed). A killed write's leftovers are put right
    first. One UsageError otherwise."""
    folder = Path(folder)
    if is_leftover(folder):
        raise UsageError(f"{flag} {folder}: that is the name of an interrupted write's temporary copy; give the "
                         f"folder itself ({folder.parent / LEFTOVER.match(folder.name)['name']})")
    recover(folder)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{flag} {folder}: a file is there; give a folder path")
    foreign = foreign_entries(folder, marker) if folder.is_dir() else []
    if foreign:
        names = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
        why = ("it holds what an export does not write" if receipt(folder, marker)
               else f"it is not a folder this repository exported (no {marker} of ours)")
        raise UsageError(f"{flag} {folder}: {why}: {names}. An export replaces its folder whole, so nothing "
                         f"there is touched: give a new or empty folder, or a previous export")
    problem = write_problem(Path(os.path.realpath(folder)).parent)
    if problem is not None and not problem[0].is_dir():
        raise UsageError(f"{flag} {folder}: {problem[0]} is a file, not a folder; choose another path")
    if problem is not None:
        raise UsageError(f"{flag} {folder}: cannot write in {problem[0]} ({problem[1]}); choose a writable folder")


def disk_full(e: BaseException, where) -> bool:
    """Whether an error means a full disk or quota: OSError ENOSPC / EDQUOT, the Rust message safetensors
    raises (SafetensorError "... No space left on device (os error 28)"), or a vaguer error with < 1 MiB
    free at `where`."""
    if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        return True
    if any(s in str(e) for s in ("No space left on device", "(os error 28)", "Disk quota exceeded",
                                 "(os error 122)")):
        return True
    try:
        return isinstance(e, (OSError, RuntimeError)) and shutil.disk_usage(where).free < 2 ** 20
    except OSError:
        return False


def _fsync(path, folder: bool = False):
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if folder else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swaps two paths in one step (Linux renameat2 with RENAME_EXCHANGE); False where that is not available."""
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        swap = libc.renameat2
    except (OSError, AttributeError):
        return False
    if swap(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0:  # AT_FDCWD, RENAME_EXCHANGE
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # a file system or kernel without it
        return False
    raise OSError(err, os.strerror(err), str(a))


def _signum(e: KeyboardInterrupt) -> int:
    return getattr(e, "signum", signal.SIGINT)  # plumbing.base.Interrupted carries SIGTERM's


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _size(folder: Path) -> str:
    return f"{sum(p.stat().st_size for p in folder.rglob('*') if p.is_file()) / 2 ** 20:.1f} MiB"


def atomic_folder(path, write, what: str = "export", marker: str | None = None) -> Path:
    """Writes the folder `path` whole or not at all: write(tmp) fills `tmp` (a hidden sibling); see the module
    docstring. With `marker`, the file of that name lists what write() wrote (check_target's receipt). A
    symlink at `path` keeps pointing at it: its target is replaced. Failures, each one message:
    SIGINT / SIGTERM while writing (FolderInterrupted: what had been written, removed, and that `path` is
    unchanged) or as it is put in place (FolderInterrupted, in_place: it is complete there); a full disk or
    quota (RunError: how much had been written, `path` unchanged). Returns `path`."""
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    recover(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{path} is a file, not a folder: choose another path for the {what}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.new-{os.getpid()}")
    _remove(tmp)
    kept = f"the previous folder at {path} is unchanged" if path.exists() else f"nothing was made at {path}"
    try:
        tmp.mkdir()
        write(tmp)
        if marker is not None:
            (tmp / marker).write_text(json.dumps({"written_by": RECEIPT_BY, "files": _files(tmp)}, indent=1))
        for root, dirs, files in os.walk(tmp):
            for f in files:
                follow_umask(os.path.join(root, f))
                _fsync(os.path.join(root, f))
            for d in [*dirs, "."]:
                follow_umask(os.path.join(root, d), folder=True)
                _fsync(os.path.join(root, d), folder=True)
    except KeyboardInterrupt as e:
        had = _files(tmp) if tmp.is_dir() else []
        _remove(tmp)
        done = (f"{', '.join(had)} had been written to a temporary folder and were removed" if had
                else "no file of it had been written")
        raise FolderInterrupted(f"interrupted (signal {_signum(e)}) while writing the {what} {path}: {done}; "
                                f"{kept}", _signum(e), in_place=False) from None
    except Exception as e:
        written = _size(tmp) if tmp.is_dir() else "nothing"
        _remove(tmp)
        if disk_full(e, path.parent):
            raise RunError(f"no space left on device (or over quota) while writing the {what} {path}, after "
                           f"{written} of it: the partial copy was removed and {kept}; free space there (or "
                           f"choose another folder) and run the command again") from None
        raise
    _put_in_place(tmp, path, what)
    return path


def _put_in_place(tmp: Path, path: Path, what: str):
    """The complete `tmp` takes `path`'s place, the parent folder fsynced, the previous folder removed last.
    SIGINT / SIGTERM are held back meanwhile (recorded by a handler of ours, not blocked: torch's threads would
    take a blocked signal and Python would run the handler between two renames anyway) and raised again after,
    where they become a FolderInterrupted with in_place."""
    import threading
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    caught, previous = [], {}
    if threading.current_thread() is threading.main_thread():
        for s in STOPS:
            previous[s] = signal.signal(s, lambda signum, frame: caught.append(signum))
    try:
        try:
            if not path.exists():
                os.replace(tmp, path)
            elif _exchange(tmp, path):
                os.replace(tmp, old)  # tmp now names the previous folder
            else:
                os.replace(path, old)
                os.replace(tmp, path)
            _fsync(path.parent, folder=True)
        finally:
            for s, handler in previous.items():
                signal.signal(s, signal.SIG_DFL if handler is None else handler)
            for s in dict.fromkeys(caught):  # as if it came now: the handler the process had decides
                signal.raise_signal(s)
        _remove(old)
    except KeyboardInterrupt as e:
        raise FolderInterrupted(f"interrupted (signal {_signum(e)}) as the {what} {path} was put in place: it is "
                                f"complete there ({', '.join(_files(path))})", _signum(e), in_place=True) from None
