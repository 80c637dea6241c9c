"""The bottom layer, standard library only (so that --help answers before torch loads): the errors every
script turns into one message (plumbing.cli), atomic writes, the process count under torchrun or srun, the
cache folder, and messages with control characters escaped. Every other module of the repository may import
it; it imports nothing of the repository."""
from __future__ import annotations

import errno
import functools
import os
import re
import shutil
import sys
from pathlib import Path

CACHE_DIR = Path(os.environ.get("CLIPFT_CACHE", Path.home() / ".cache" / "clipft"))


class UsageError(ValueError):
    """A bad flag or combination of flags (exit code 2, as argparse's)."""


SLURM_TO_TORCH = {"SLURM_PROCID": "RANK", "SLURM_NTASKS": "WORLD_SIZE", "SLURM_LOCALID": "LOCAL_RANK"}


def adopt_slurm(env=os.environ) -> bool:
    """srun without torchrun: Slurm's SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID become torch's RANK /
    WORLD_SIZE / LOCAL_RANK, as open_clip's distributed.py reads them; the job script sets MASTER_ADDR and
    MASTER_PORT (README, "Scale"). torchrun's variables, when present, win. True when Slurm's were adopted."""
    if "WORLD_SIZE" in env or "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) <= 1:
        return False
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise UsageError(f"srun started {env['SLURM_NTASKS']} tasks but {' and '.join(missing)} is not set: export "
                         f"MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1) and MASTER_PORT "
                         f"(a free port, e.g. 29500) in the job script")
    for slurm, torch_name in SLURM_TO_TORCH.items():
        env[torch_name] = env[slurm]
    return True


RENDEZVOUS_SECONDS = float(os.environ.get("CLIPFT_RENDEZVOUS_TIMEOUT", 300))


def rendezvous_watch(env=os.environ):
    """A line saying that this process waits for the others, and a watch that ends the process with one message
    (exit 1) when they have not joined within RENDEZVOUS_SECONDS (CLIPFT_RENDEZVOUS_TIMEOUT): a process started
    alone in an environment that claims more (MASTER_ADDR / MASTER_PORT and Slurm's task count exported, but no
    srun) waited silently before. Returns the watch (threading.Timer): cancel it once the group is up; the watch
    covers the rendezvous only, never the collectives of the run."""
    import threading
    world, where = env.get("WORLD_SIZE", "1"), f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    source = (f"Slurm's SLURM_NTASKS={env['SLURM_NTASKS']}" if env.get("SLURM_NTASKS") == world
              and "SLURM_PROCID" in env else "WORLD_SIZE (torchrun)")
    print(f"[dist] rank {env.get('RANK', '0')} of {world}: waiting for the other processes at {where}",
          file=sys.stderr, flush=True)

    def give_up():
        print(f"error: the other processes did not join at {where} within {RENDEZVOUS_SECONDS:g} s; this process "
              f"expects {world} of them because of {source}. Start every process (srun python ..., or torchrun "
              f"--nproc-per-node N ...), or run one process without those variables; "
              f"CLIPFT_RENDEZVOUS_TIMEOUT sets the wait", file=sys.stderr, flush=True)
        os._exit(1)
    watch = threading.Timer(RENDEZVOUS_SECONDS, give_up)
    watch.daemon = True
    watch.start()
    return watch


def world_size() -> int:
    """The number of processes torchrun (or srun) started; 1 without either."""
    adopt_slurm()
    return int(os.environ.get("WORLD_SIZE", "1"))


def atomic_write(path, content) -> Path:
    """Writes `path` so that no reader (another rank, a crash half-way) sees a partial file: a temporary file
    next to it, unique per process, then os.replace (atomic on one file system); creates the parent folder.
    content: str (UTF-8), bytes, or a callable that writes the temporary path it is given, e.g.
    atomic_write(p, lambda tmp: torch.save(obj, tmp)). Returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        if callable(content):
            content(tmp)
        elif isinstance(content, bytes):
            tmp.write_bytes(content)
        else:
            tmp.write_text(content, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException as e:
        full = isinstance(e, (RuntimeError, OSError)) and _disk_full(path.parent) or "(os error 28)" in str(e)
        tmp.unlink(missing_ok=True)  # no stray temporary file after a failure
        if full and getattr(e, "errno", None) != errno.ENOSPC:  # torch.save says only "file write failed",
            # safetensors' save_file a SafetensorError "... No space left on device (os error 28)"
            raise OSError(errno.ENOSPC, "No space left on device", str(path)) from e
        raise
    return path


def _disk_full(folder) -> bool:
    try:
        return shutil.disk_usage(folder).free < 2 ** 20
    except OSError:
        return False


def markdown_table(rows: list[dict], columns, floatfmt="{:.1f}") -> str:
    """rows as a markdown table of `columns` (floats through floatfmt, None as an empty cell)."""
    def fmt(v):
        return floatfmt.format(v) if isinstance(v, float) else ("" if v is None else str(v))
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "\n".join("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows)


class DataError(ValueError):
    pass


@functools.lru_cache(maxsize=None)
def warn_once(message: str):
    """Prints a message once per process (the preflight and train both check a run's data and settings), with
    control characters from manifests escaped."""
    print(printable(message), file=sys.stderr)


class UnsafeFileError(RuntimeError):
    """A file refused by load_weights_only (cli prints its one message)."""


class RunError(RuntimeError):
    """An expected failure around the run: missing weights or training data, an --out that holds or is writing
    another run, a changed setting on --resume, an interrupted run (exit code 1, or 128 + signal)."""
    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def check_finite(name: str, **rows):
    """A NaN or inf embedding compares False with everything, so a rank counting 'at least as good' candidates
    would score it a hit at every k: an error naming the task and the rows instead (a diverged run, a broken
    feature file), before anything is ranked."""
    bad = {k: int((~v.isfinite()).reshape(len(v), -1).any(1).sum()) for k, v in rows.items()}
    if any(bad.values()):
        raise RunError(f"{name}: " + ", ".join(f"{n} of {len(rows[k])} {k} rows" for k, n in bad.items() if n)
                       + " are not finite (NaN or inf): the weights or the features are broken (a diverged run?); "
                         "nothing was scored")


class Interrupted(KeyboardInterrupt):
    """SIGTERM outside training (cli's handler), told apart from Ctrl-C by its signal number."""
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """A message as the terminal should show it: control characters from paths and captions (\\r, ANSI escapes,
    NUL) written as escapes, so they cannot rewrite the line or colour the output; newlines stay."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(text))


def shorten(text: str, width: int = 200) -> str:
    """One line of at most `width` characters for a message that quotes another's (an exception, a list of
    names): newlines joined, a longer text cut at a word and ended with '... (N more characters)' (issue 69.7:
    a bare [:200] cut mid-word with no sign of the cut)."""
    text = " ".join(str(text).split())
    if len(text) <= width:
        return text
    keep = text[:max(width - 30, 10)]
    keep = (keep.rsplit(" ", 1)[0] if " " in keep[len(keep) // 2:] else keep).rstrip(" ,;:")
    return f"{keep} ... ({len(text) - len(keep)} more characters)"


def inside_folder(top, paths, what: str):
    """Every image path inside the data set's folder `top` once links are followed: a link (or a '..' in a list
    file's name) that leads out of it is DataError naming both paths, as a dataset folder's path out of it is
    (issue 69.7; MTIL's sets, ImageNet's shifts). A folder that is itself a link elsewhere is followed first. One
    realpath per folder, one lstat per image."""
    top = os.path.realpath(top)
    real = functools.lru_cache(maxsize=None)(os.path.realpath)
    for p in paths:
        where = os.path.join(real(os.path.dirname(p)), os.path.basename(p))
        if os.path.islink(where):
            where = os.path.realpath(where)
        if os.path.commonpath([top, where]) != top:
            raise DataError(f"{what}: {p} leads to {where}, outside the dataset's folder {top}: refused (an image "
                            f"of the set is read from its folder only; copy the file there)")
