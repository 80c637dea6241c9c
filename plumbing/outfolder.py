"""The checks that need no torch (issue 42.4): a training manifest that is not there; the --out folder's: one run
per --out (its .lock), a run already there, a folder that cannot be written. Standard library only, so a script
answers them in well under a second (flags.answer_early), before torch and open_clip load; plumbing.runfolder
takes the lock and starts the run with the same checks and messages."""
from __future__ import annotations

import json
import os
import re
import socket
import tempfile
from pathlib import Path

from plumbing.base import DataError, RunError, UsageError, atomic_write

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


# Files and folders of a training run (what --overwrite deletes); caches such as features/ or data/ stay.
RUN_FILES = ("checkpoints", "metrics.jsonl", "config.json", "results.json", "model.pt", "model.pt.json",
             "continual.json", "boundary.pt", "boundary.pt.json", "base.json", "model.safetensors",
             "model.safetensors.json", "lora_adapter")
TASK_FOLDERS = "task[0-9]*-*"  # a task sequence's per-task run folders (common.run_continual)
EVAL_FILES = ("results.json", "wise-ft-robustness.png", "wise-ft")  # eval.py's; wise-ft/: one file an alpha
RECEIPT = "run_receipt.json"  # issue 69.2: which command of this repository writes the folder
RECEIPT_BY = "this repository's command line (plumbing.outfolder.claim); it replaces only the files it writes"


def receipt(out: Path) -> str | None:
    """The writer ('training', 'eval', ...) that out's receipt names; None when there is none of ours."""
    try:
        got = json.loads((Path(out) / RECEIPT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(got, dict) and got.get("written_by") == RECEIPT_BY and isinstance(got.get("writer"), str)
    return got["writer"] if ok else None


def _results_method(out: Path) -> str | None:
    """The method a results.json of this repository's schema names (a folder written before receipts)."""
    try:
        got = json.loads((out / "results.json").read_text(encoding="utf-8"))
        return got["method"] if str(got.get("schema", "")).startswith("clipft") else None
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        return None


def own_output(out: Path, writer: str) -> bool:
    """Whether `out` is `writer`'s own earlier output: its receipt, or (written before receipts) a run's
    checkpoints / metrics / task record, or a results.json of this repository's schema from eval.py ('eval') or
    from a training run (any other method)."""
    got = receipt(out)
    if got is not None:
        return got == writer
    method = _results_method(out)
    if writer == "eval":
        return method == "eval"
    return writer == "training" and (holds_run(out) or method not in (None, "eval"))


def foreign_files(out: Path, writer: str, writes=RUN_FILES) -> list[str]:
    """The entries of `out` that `writer` would write over (names in `writes`, a training run's task folders)
    though it did not write them: none when out is its own earlier output (own_output)."""
    out = Path(out)
    if not out.is_dir() or own_output(out, writer):
        return []
    tasks = [p.name for p in sorted(out.glob(TASK_FOLDERS)) if p.is_dir()] if writer == "training" else []
    return [n + ("/" if (out / n).is_dir() else "") for n in [*writes, *tasks] if _holds_files(out / n)]


def _holds_files(path: Path) -> bool:
    """Whether `path` is (or is a folder holding) a file other than an interrupted atomic write's `*.tmp<PID>`."""
    if not os.path.lexists(path):
        return False
    files = [p for p in path.rglob("*") if not p.is_dir()] if path.is_dir() and not path.is_symlink() else [path]
    return any(not re.fullmatch(r".+\.tmp\d+", p.name) for p in files)


def not_ours(out: Path, flag: str, writer: str, writes=RUN_FILES) -> UsageError | None:
    """The refusal of a folder holding what `writer` would replace but did not write (issue 69.2: a run replaced
    someone's config.json, model.pt and results.json; eval.py a finished run's results.json); None otherwise."""
    foreign = foreign_files(out, writer, writes)
    if not foreign:
        return None
    whose = receipt(out)
    why = (f"it is the output of {'a training run' if whose == 'training' else whose} ({RECEIPT})" if whose
           else f"no command of this repository wrote them (no {RECEIPT} of ours)")
    overwrite = " (--overwrite neither: it deletes only a run's own files)" if writer == "training" else ""
    return UsageError(f"{flag} {out}: it holds {', '.join(foreign[:8])}"
                      f"{f' and {len(foreign) - 8} more' if len(foreign) > 8 else ''}, which this command writes, "
                      f"and {why}; nothing there is touched{overwrite}: choose a new or empty folder, or move "
                      f"them away")


def claim(out: Path, writer: str, flag: str = "--out", writes=RUN_FILES):
    """Refuses `out` as not_ours does, then writes its receipt naming `writer` (once; atomically), so that a later
    command knows the folder as this writer's own output."""
    if (problem := not_ours(out, flag, writer, writes)) is not None:
        raise problem
    if receipt(out) != writer:
        atomic_write(Path(out) / RECEIPT, json.dumps({"written_by": RECEIPT_BY, "writer": writer}, indent=1))


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


def missing_packages(cfg) -> UsageError | None:
    """The optional packages the command line asks for, found by name (importlib's find_spec: nothing is imported,
    so this answers before torch; issue 72.3: `--report-to wandb` without wandb answered after 29 s): --report-to's
    backends, and datasets for a Hugging Face datasets folder as --train-data. The same message as
    plumbing.reporting.check, which checks them again (tensorboard's import too) before any model."""
    import importlib.util
    wanted = [t for t in str(getattr(cfg, "report_to", "") or "").split(",") if t]
    missing = [t for t in wanted if importlib.util.find_spec(t) is None]
    if missing:
        names = " and ".join(missing)
        return UsageError(f"--report-to {','.join(wanted)} needs the {names} package{'s' * (len(missing) > 1)}: "
                          f"pip install {' '.join(missing)} (or drop {names} from --report-to)")
    data = Path(str(getattr(cfg, "train_data", "") or "."))
    hf = data.is_dir() and ((data / "state.json").is_file() or (data / "dataset_dict.json").is_file())
    if (hf or data.suffix == ".parquet") and importlib.util.find_spec("datasets") is None:
        return UsageError(f"--train-data {data}: a Hugging Face datasets folder or parquet file needs the datasets "
                          f"package: pip install datasets")
    return None


def early_problem(cfg) -> Exception | None:
    """What the run would refuse, found without torch and without writing anything (but write_problem's probe): an
    optional package the flags need (missing_packages); a --train-data file that does not exist (a path, not a
    name such as auto or coco, nor shards), or an imagefolder:DIR that is no folder; then what start_run refuses
    about cfg.out: --resume with --overwrite, a folder that cannot be made or written, a live lock, a run already
    there (without --resume / --overwrite). None when none of them (the run still checks everything itself)."""
    if (problem := missing_packages(cfg)) is not None:
        return problem
    data = str(getattr(cfg, "train_data", "") or "")
    if data.startswith("imagefolder:"):  # class folders (issue 72.2: this was "manifest not found")
        folder = Path(data.partition(":")[2])
        return None if folder.is_dir() else DataError(
            f"--train-data {data}: {folder} is not a folder; class folders are DIR/<class>/<image> "
            f"(docs/protocols.md, 'Fine-tuning on class folders')")
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
    if (problem := not_ours(out, "--out", "training")) is not None:
        return problem
    if not cfg.resume and not cfg.overwrite and holds_run(out):
        return occupied(out)
    return None
