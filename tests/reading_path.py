"""The reading path of one default training step (a tool, not a test): the functions a reader opens to follow one
step of a method, found by running it.

The method's main() runs on the lab's tiny backbone and synthetic world with its default settings but one step
(--steps 1), a batch of 8 and the CPU; one common.train call is traced with sys.settrace: the first, or with
--tasks (cclip.py, dns.py) the second task's, where the method's continual part runs (C-CLIP's old model, DNS's
projection). Listed: common.train itself, then every distinct function defined in the method file, common.py or
plumbing/ that runs in train's process while train is inside its training loop (the outermost loop of its body:
the batch, the step, the log, the save and the end checks), called from it directly or not, in the order of first
call, each with its source span (inspect.getsourcelines), and the total line count. What train calls before the
loop (the set-up) or after it (the end of the run) sits behind its named calls and is not listed; with the default
--workers 2 the dataset and the collate function run in the DataLoader's worker processes, which are not traced
(--workers 0 runs them in train's process and lists them too). A function nested in a listed one (train's save) is
counted with its parent; lambdas, comprehensions and generator expressions are never listed on their own.

    python tests/reading_path.py erclip.py cclip.py dns.py              # the listings, printed
    python tests/reading_path.py --write docs/reading.md                # the page, written (its three methods)
    python tests/reading_path.py --check docs/reading.md                # exit 1 when the page is not today's
    python tests/reading_path.py --workers 0 erclip.py                  # the data pipeline included
    python tests/reading_path.py --update erclip.py                     # the update path (issue 73.2)

docs/reading.md is this program's output (issue 73.5): tests/test_layout.py runs --check, so the page's line
numbers cannot drift from the code.

The run's data and run folders, and a cache (CLIPFT_CACHE, unless set), live in a temporary folder."""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = Path(tempfile.mkdtemp(prefix="reading-path-"))
os.environ.setdefault("CLIPFT_CACHE", str(WORK / "cache"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(ROOT))

SEQUENCES = ("cclip", "dns")  # --tasks: the second task's train call is traced


def argv_of(method: str, work: Path, extra=(), run: str = "run") -> list[str]:
    """One default step: the method's defaults, on the tiny backbone and the lab's synthetic world, one step, a
    batch the tiny sets hold, on the CPU."""
    argv = ["--backbone", "tiny", "--steps", "1", "--batch-size", "8", "--device", "cpu",
            "--data-root", str(work / "data"), "--out", str(work / f"{run}-{method}"), *extra]
    if method == "erclip":
        return [*argv, "--train-pairs", "16"]
    if method in SEQUENCES:
        return [*argv, "--tasks", "synthetic"]
    return argv


class Traced(BaseException):
    """Raised after the traced common.train call: the rest of main() is not the step's."""


def loop_lines(func) -> range:
    """The lines of the outermost loop (while / for) of func's body."""
    import ast
    import inspect
    lines, start = inspect.getsourcelines(func)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    loop = next(n for n in ast.walk(tree.body[0]) if isinstance(n, (ast.While, ast.For)))
    return range(start + loop.lineno - 1, start + loop.end_lineno)


# Issue 73.2: the functions that set a default step's numbers, called by common.train: the precision, the model's
# set-up (what trains: --lock-*, --lora), AdamW's groups, rates and settings with the schedule, and the step itself
# (the features, the losses, backward, clipping, the optimizer and scheduler steps, the logit-scale clamp).
UPDATE_ROOTS = ("resolve_precision", "prepare_model", "optimizer_and_schedule", "train_step")


def reading_path(method_file: str, extra=(), update: bool = False) -> list[tuple[str, str, int, int]]:
    """[(file, function, first line, last line)] of common.train and the functions that ran inside its training
    loop in the method's traced common.train call, in the order of first call, nested functions folded into their
    parents. update=True: instead, the functions under UPDATE_ROOTS (the roots included) that train calls, set-up
    and loop alike: the update path."""
    import importlib
    import inspect
    import torch
    import common
    torch.set_num_threads(1)
    name = Path(method_file).stem
    method = importlib.import_module(name)
    files = {str(ROOT / f"{name}.py"), str(ROOT / "common.py")}
    folders = tuple(str(ROOT / f) + os.sep for f in ("plumbing", "protocols", "papers"))
    real_train = common.train
    loop = loop_lines(real_train)
    seen: dict = {} if update else {real_train.__code__: None}  # code object -> None, in the order of first call
    roots = {getattr(common, r).__code__ for r in UPDATE_ROOTS}
    calls = []

    def under_root(frame) -> bool:  # called, at any depth, from one of UPDATE_ROOTS called by train
        while frame is not None and frame.f_code is not real_train.__code__:
            if frame.f_code in roots:
                return True
            frame = frame.f_back
        return False

    def in_loop(frame) -> bool:  # called, at any depth, from train while train runs a line of its loop
        while frame is not None and frame.f_code is not real_train.__code__:
            frame = frame.f_back
        return frame is not None and frame.f_lineno in loop

    def tracer(frame, event, arg):
        code = frame.f_code
        if event == "call" and code not in seen and (code.co_filename in files or code.co_filename.startswith(
                folders)) and (under_root(frame) if update else in_loop(frame.f_back)):
            seen[code] = None
        return None  # no line events: calls only

    def traced_train(*args, **kwargs):
        calls.append(1)
        if len(calls) < (2 if name in SEQUENCES else 1):
            return real_train(*args, **kwargs)
        sys.settrace(tracer)
        try:
            real_train(*args, **kwargs)
        finally:
            sys.settrace(None)
        raise Traced

    common.train = traced_train
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the method's own output: stdout is the listing's
            method.main(argv_of(name, WORK, extra, "update" if update else "run"))
    except Traced:
        pass
    finally:
        common.train = real_train
    if len(seen) <= 1:
        raise SystemExit(f"{method_file}: the traced common.train call never ran")
    spans = []
    for code in seen:
        if code.co_name.startswith("<"):  # <lambda>, <listcomp>, <genexpr>: read with the function holding them
            continue
        lines, start = inspect.getsourcelines(code)
        spans.append((code.co_filename, code.co_qualname, start, start + len(lines) - 1))
    return [s for s in spans if not any(o is not s and o[0] == s[0] and o[2] <= s[2] and s[3] <= o[3]
                                         for o in spans)]


PAGE_METHODS = ("erclip.py", "cclip.py", "dns.py")
PAGE_HEAD = """# The reading path of one default step

<!-- Written by `python tests/reading_path.py --write docs/reading.md`; tests/test_layout.py checks that it is
today's. Do not edit by hand. -->

The functions a reader opens to follow one default training step of a method: common.train (the loop), then
everything defined in the method file, common.py or plumbing/ that runs in train's process while train is inside
its training loop (the batch, train_step with the method's features and losses, the log, the save and stop
checks), in the order of first call, each as `file:function (first-last, lines)`, with the total. The set-up
before the loop (the lock, resume, the loader, the optimizer) and the end of the run after it sit behind named
calls in train and are not on the path. Found by running it, not by hand: tests/reading_path.py runs each method's
main() on the lab's tiny backbone and synthetic world with its default settings but one step (`--steps 1
--batch-size 8 --device cpu`) and traces one common.train call with sys.settrace: the first, or for a task
sequence (cclip.py, dns.py) the second task's, where the continual part runs (C-CLIP's old model and CKC, DNS's
projection). With the default `--workers 2` the dataset and the collate function run in the DataLoader's worker
processes and are not listed; dns.py's default is `--workers 0` (its features live in memory), so its batch path
is; `python tests/reading_path.py --workers 0 erclip.py cclip.py` lists them for the others.

Under each, "the update" (`python tests/reading_path.py --update erclip.py`): the functions that set the step's
numbers, wherever train calls them, set-up included: common.resolve_precision, common.prepare_model (what trains),
common.optimizer_and_schedule (AdamW's groups, per-parameter rates and layer decay in plumbing/param_rates.py, the
one module common.make_optimizer names at its call; AdamW's betas and eps, the schedule) and common.train_step (the
features, the losses, backward, clipping, the optimizer and scheduler steps, the logit-scale clamp), with what they
call in the method file, common.py, plumbing/, protocols/ or papers/. The shared defaults they read (--lr, --wd,
--beta1 / --beta2 / --eps, --warmup, --precision) are plumbing/flags.py's Config, each method's own in its Config.
"""


def listing(method_file: str, extra=(), update: bool = False) -> str:
    path = reading_path(method_file, extra, update)
    total = sum(end - start + 1 for _, _, start, end in path)
    files = sorted({Path(file).relative_to(ROOT).as_posix() for file, *_ in path})
    rows = [f"- {Path(file).relative_to(ROOT).as_posix()}:{func} ({start}-{end}, {end - start + 1} lines)"
            for file, func, start, end in path]
    if update:
        return (f"### {Path(method_file).name}, the update: {len(path)} functions, {total} lines in {len(files)} "
                f"files ({', '.join(files)})\n\n" + "\n".join(rows) + "\n")
    return f"## {Path(method_file).name}: {len(path)} functions, {total} lines\n\n" + "\n".join(rows) + "\n"


def page() -> str:
    return PAGE_HEAD + "".join(f"\n{listing(m)}\n{listing(m, update=True)}" for m in PAGE_METHODS)


def main(argv):
    if argv[:1] in (["--write"], ["--check"]):
        target, text = ROOT / argv[1], page()
        if argv[0] == "--write":
            target.write_text(text)
            return 0
        if target.read_text() != text:
            print(f"{argv[1]} is not today's reading path: run python tests/reading_path.py --write {argv[1]}",
                  file=sys.stderr)
            return 1
        return 0
    extra, update = [], argv[:1] == ["--update"]
    argv = argv[1:] if update else argv
    if argv[:1] == ["--workers"]:
        extra, argv = argv[:2], argv[2:]
    for method_file in argv or ["erclip.py"]:
        print(listing(method_file, extra, update), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
