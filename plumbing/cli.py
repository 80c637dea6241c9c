"""Every script's `if __name__ == "__main__":` (cli) and the training loop's signal handling (StopSignals):
an expected failure (bad input or flags, missing data or
weights, a corrupt checkpoint, a full disk, an unwritable --out, an interrupt) becomes one paragraph on stderr
and a non-zero exit code; --debug keeps the traceback. Below common: it imports plumbing.base,
plumbing.runfolder (what an interrupt leaves in the run folder, and the command that finishes the run) and
plumbing.manifests (dist_info)."""
from __future__ import annotations

import errno
import os
import pickle
import signal
import sys
import zipfile
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from plumbing import runfolder
from plumbing import base
from plumbing.base import DataError, Interrupted, RunError, UnsafeFileError, UsageError, printable
from plumbing.manifests import dist_info


def _terminate(signum, frame):
    if os.getpid() == _MAIN_PID:  # DataLoader workers (forked with this handler) leave it to the main process
        raise Interrupted(signum)


_MAIN_PID = os.getpid()


def cli(main: Callable, argv=None):
    """The `if __name__ == "__main__":` of every script: runs main(argv) and turns an expected failure (bad input
    or flags, missing data or weights, a corrupt checkpoint, a full disk, an unwritable --out, an interrupt) into
    one paragraph on stderr and a non-zero exit code. --debug re-raises it with its traceback; anything else is
    a bug and keeps its traceback."""
    global _MAIN_PID
    argv = list(sys.argv[1:] if argv is None else argv)
    runfolder.COMMAND, _MAIN_PID = [sys.argv[0], *argv], os.getpid()
    import threading
    previous = None
    if threading.current_thread() is threading.main_thread():  # SIGTERM outside training: as Ctrl-C, with a message
        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        main(argv)
    except BaseException as e:  # noqa: B036 - KeyboardInterrupt and SystemExit are sorted below
        if isinstance(e, SystemExit) or "--debug" in argv:
            raise
        message, code = expected_error(e)
        if message is None:
            raise
        print(f"error: {printable(message)}", file=sys.stderr)
        sys.exit(code)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def expected_error(e: BaseException) -> tuple[str | None, int]:
    """(one-paragraph message, exit code) of an expected failure; (None, 1) for a bug."""
    if isinstance(e, KeyboardInterrupt):
        return interrupted_message(getattr(e, "signum", signal.SIGINT))
    if isinstance(e, RunError):
        return str(e), e.code
    if isinstance(e, UsageError):
        return str(e), 2
    if isinstance(e, (DataError, FloatingPointError, UnsafeFileError)):
        return str(e), 1
    if isinstance(e, OSError):
        where = f" ({e.filename})" if e.filename else ""
        if e.errno == errno.ENOSPC:
            return (f"no space left on device (ENOSPC){where}: free space on that disk or choose another --out; "
                    f"leftover temporary files are removed at the next start, and if a checkpoint was saved "
                    f"before, --resume latest continues from it"), 1
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            inside_cache = e.filename and str(Path(e.filename).absolute()).startswith(str(base.CACHE_DIR.absolute()))
            advice = (f"the cache folder {base.CACHE_DIR} must be writable: set CLIPFT_CACHE to a writable folder"
                      if inside_cache else "choose a writable location (--out for runs, --data-root for generated "
                      "data) or fix the permissions")
            return f"{e.strerror}{where}: {advice}", 1
        return f"{e.strerror or e}{where}", 1
    if (failed := compile_failure(e)) is not None:
        return compile_message(failed), 1
    if isinstance(e, (EOFError, pickle.UnpicklingError, zipfile.BadZipFile)) or (
            isinstance(e, RuntimeError) and "PytorchStreamReader" in str(e)):
        why = base.shorten(next((ln for ln in str(e).splitlines() if ln.strip() and "weights_only" not in ln), ""))
        return (f"a checkpoint or weights file is truncated or not a torch file ({type(e).__name__}: {why}); "
                f"run with --debug to see which"), 1
    return None, 1


def compile_failure(e: BaseException) -> BaseException | None:
    """The innermost exception of torch.compile's inductor (InvalidCxxCompiler, CppCompileError, ...) or dynamo's
    BackendCompilerFailed in e's chain: --torchcompile's build failed (issue 69.3); None for anything else."""
    found, seen = None, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__module__.startswith("torch._inductor") or type(e).__name__ == "BackendCompilerFailed":
            found = e
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__  # dynamo's wrapper holds the cause
    return found


def compile_message(e: BaseException) -> str:
    """--torchcompile failed to build (a missing or failing C++ compiler): what failed, what the run kept, and the
    command that goes on without it (the same training, uncompiled; --torchcompile is not a resume setting)."""
    why = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    out = runfolder.RUN_OUT
    kept = [n for n in ("checkpoints/last.pt", "model.pt") if out is not None and (out / n).exists()]
    if kept:
        kept = (f"; kept in {out}: {', '.join(kept)} (" + ("finished training is not repeated, the evaluation is)"
                if "model.pt" in kept else "training goes on from its last checkpoint)"))
        command = runfolder.resume_command(without=("--torchcompile",))
    else:
        kept = f"; nothing saved in {out} to resume from" if out is not None else ""
        again = ("--overwrite",) if out is not None and runfolder.holds_run(out) else ()
        command = runfolder.resume_command(without=("--torchcompile",), then=again)
    return (f"--torchcompile: torch.compile could not build the model ({type(e).__name__}: {base.shorten(why)}); "
            f"inductor needs a working C++ compiler (set CXX to one, e.g. g++){kept}. Run without --torchcompile "
            f"(the same training, uncompiled):\n  {command}")


def interrupted_message(signum: int) -> tuple[str, int]:
    """What an interrupt outside the training loop (the evaluations before or after it, a second Ctrl-C) leaves:
    the files of the run on disk, named, and the command that finishes it; exit code 128 + signal."""
    if runfolder.EVALUATING is not None:  # eval.py: no training here (issue 72.3)
        return evaluation_interrupted(signum, runfolder.EVALUATING)
    out = runfolder.RUN_OUT
    kept = [n for n in ("checkpoints/last.pt", "model.pt", "base.json", "continual.json")
            if out is not None and (out / n).exists()] + (
        [p.relative_to(out).as_posix() for p in sorted(out.glob("task[0-9]*-*/checkpoints/last.pt"))] if out else [])
    if not kept or not runfolder.holds_run(out):
        return f"interrupted (signal {signum}) before training saved anything in {out or '--out'}; nothing to resume", \
            128 + signum
    # issue 55.3: "not repeated" only when training finished (model.pt); else it goes on from its last checkpoint
    how = ("finished training is not repeated, the evaluation is" if "model.pt" in kept else
           "training goes on from its last checkpoint, then the evaluation")
    return (f"interrupted (signal {signum}) outside the training steps; kept in {out}: {', '.join(kept)}. Finish the "
            f"run with ({how}):\n  {runfolder.resume_command()}"), 128 + signum


def evaluation_interrupted(signum: int, out: Path) -> tuple[str, int]:
    """What an interrupted eval.py keeps: a WiSE-FT curve's finished alphas (<out>/wise-ft/alpha-*.json, written as
    each finished) and the command that goes on from them; otherwise that results.json is written only at the end."""
    import shlex
    kept = sorted(p.name for p in (out / "wise-ft").glob("alpha-*.json")) if str(out) not in ("", ".") else []
    if not kept:
        return (f"interrupted (signal {signum}) during the evaluation, before it wrote results.json (written when "
                f"every task is done); nothing to keep: run the command again"), 128 + signum
    args = [a for a in (runfolder.COMMAND or ["eval.py"])[1:] if a != "--resume"]
    head = (runfolder.COMMAND or ["eval.py"])[0]
    command = f"{head if head.startswith('python') else 'python ' + head} {shlex.join(args)} --resume"
    return (f"interrupted (signal {signum}) during the WiSE-FT curve; kept in {out / 'wise-ft'}: {', '.join(kept)} "
            f"(each alpha's numbers as it finished). Go on from them (finished alphas are not evaluated again):\n  "
            f"{command}"), 128 + signum


class StopSignals:
    """SIGINT / SIGTERM during training become a request that train honours after the step in flight (never
    mid-step): a checkpoint at that step, the resume command, exit code 128 + signal. A second signal interrupts
    at once. DataLoader workers (forked with the handler) ignore both. Every rank listens; with several
    processes the ranks agree (one all-reduce) at log steps only, so all stop at the same step."""
    def __init__(self):
        self.signum, self.previous = None, {}

    def install(self):
        import threading
        self.pid = os.getpid()
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self.previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if os.getpid() != self.pid:  # a DataLoader worker (forked with the handler): the main process decides
            return
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\n[train] signal {signum}: saving a checkpoint after the current step", file=sys.stderr)

    def restore(self):
        for s, h in self.previous.items():
            signal.signal(s, h)
        self.previous = {}

    def requested(self, step: int, log_every: int, device) -> bool:
        if dist_info()[1] == 1:  # one process, or torch.distributed not initialised
            return self.signum is not None
        if step % log_every:
            return False
        flag = torch.tensor([self.signum or 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.signum = int(flag) or None
        return self.signum is not None

    def stop(self, out: Path, step: int):  # train's finally restores the handlers
        ck = out / "checkpoints" / "last.pt"
        raise RunError(f"stopped by signal {self.signum} at step {step}; checkpoint {ck} saved. Continue with:\n  "
                       f"{runfolder.resume_command()}", code=128 + self.signum)
