"""The run folder (--out) of every script: one run per folder (a lock naming its process and host), leftovers of
a killed run removed, an old run refused or cleared (--overwrite), and --resume's settings compared with the
run's (--override-resume); a training run's checkpoints (Checkpoints: its start, resumed or fresh, and each
save). common's train and preflight call them; it imports plumbing.base and plumbing.loading only."""
import dataclasses
import pickle
import random
import json
import os
import re
import shutil
import socket
import sys
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np
import open_clip
import torch

from plumbing.base import RunError, UsageError, atomic_write, shorten, warn_once, world_size
from plumbing.loading import _atomic_save, load_weights_only
from plumbing.manifests import content_sha256
from plumbing.outfolder import (BOTH, LOCK, RUN_FILES, TASK_FOLDERS, claim, pid_alive, holds_run, live_holder,
                                lock_state, locked, not_ours, occupied, unwritable)  # torch-free (issue 42.4)
from plumbing.results import from_json, to_json

__all__ = ["LOCK", "RUN_FILES", "RESUME_FREE", "lock_out", "lock_state", "live_holder", "clean_temporary",
           "holds_run", "clear_run", "resume_differences", "start_run", "write_config", "report_runs", "resume_command",
           "needs_tensorboard", "tensorboard_writer", "Checkpoints"]

COMMAND: list[str] | None = None  # the script and its arguments, set by plumbing.cli, for the resume hint
RUN_OUT: Path | None = None  # the --out this process claimed (start_run), for the message after an interrupt
EVALUATING: Path | None = None  # eval.py's --out while it evaluates ('' for none), for that message (issue 72.3)
REPORT_RUNS = "report_to_runs"  # config.json's key for the wandb id and trackio run a resumed run continues
# Settings that may change on --resume without --override-resume: where and how the run is executed or logged,
# never what it computes: device and precision (an fp32 run may go on in fp16, see train), the method files'
# eval-only flags, cclip.py's thread count and stop switch.
RESUME_FREE = {"resume", "stop_at", "workers", "log_every", "save_every", "debug", "device", "precision", "out",
               "cache_dir", "data_root", "find_unused", "overwrite", "override_resume", "demo", "stop_after_tasks",
               "threads", "task_safetensors", "eval_tasks", "eval_base", "eval_zs", "eval_on", "erclip_results",
               "collect", "report_to", "val_every", "val_data", "export", "batch_size_per_gpu", "accum_freq",
               "torchcompile"}  # issue 69.3: the same math and names; a run whose compile failed goes on without


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
            if state == "live":
                raise locked(out, held)
            if state == "stale":
                print(f"[out] taking over the stale lock of PID {held.get('pid')} (no longer running) in {out}",
                      file=sys.stderr)
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        import atexit
        atexit.register(lambda: _unlock(path, me))
        return
    raise RunError(f"could not take the lock {path}")


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
        if m and p.is_file() and not pid_alive(int(m.group(1))):
            p.unlink(missing_ok=True)
            gone.append(p)
    if gone:
        print(f"[out] removed {len(gone)} temporary file(s) left by an interrupted run in {out}", file=sys.stderr)
    return gone


def clear_run(out: Path):
    """Deletes a run's files in `out` (RUN_FILES, its lora_adapter/ included, a task sequence's per-task folders),
    keeping caches, the lock and whatever else is there (start_run has checked that the folder is the run's own)."""
    for p in [out / n for n in RUN_FILES] + [p for p in out.glob(TASK_FOLDERS) if p.is_dir()]:
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def _resume_checkpoint(cfg, out: Path) -> Path:
    ck = latest_checkpoint(out) if cfg.resume == "latest" else Path(cfg.resume)
    if ck is None:
        if holds_run(out):  # issue 55.3: the advice `occupied` gives too, not "start without --resume"
            raise RunError(f"--resume latest: no checkpoint in {out / 'checkpoints'}: the run there stopped before "
                           f"its first save; start it afresh with --overwrite (deletes its run files), or choose "
                           f"another --out")
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
    removes leftover temporary files; refuses a folder holding run files that no run of ours wrote (its receipt,
    outfolder.claim, written then); then a new run into an --out holding one is refused unless --overwrite
    (which clears it), and --resume compares the settings with the run's config.json and refuses differences
    unless --override-resume. Returns the overrides [{field, was, now}] (empty without --override-resume)."""
    global RUN_OUT, EVALUATING
    EVALUATING = None  # a training run (its evaluations are training's): the interrupt message is the run's
    if cfg.resume and cfg.overwrite:
        raise UsageError(BOTH)
    if (problem := not_ours(out, "--out", "training")) is not None:  # before anything is written there
        raise problem
    try:  # the flag named: an OSError alone says "No such file or directory (/proc/x)"
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise unwritable(out, f"{e.strerror}{f': {e.filename}' if e.filename else ''}") from None
    lock_out(out)
    if RUN_OUT is None or not out.absolute().is_relative_to(RUN_OUT.absolute()):  # a task: inside
        RUN_OUT = out
    clean_temporary(out)
    claim(out, "training")  # issue 69.2: never over files another command or person put there; its receipt
    if not cfg.resume:
        if holds_run(out):
            if not cfg.overwrite:
                raise occupied(out)
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
        warn_once(f"[out] --override-resume: continuing with {changed}")  # preflight's and train's start_run
    return list(before or []) + now


def write_config(cfg, out: Path, overrides: list[dict] = ()):
    """<out>/config.json: the resolved settings, plus every --override-resume change so far; a resumed run keeps
    the wandb / trackio runs it logs to (REPORT_RUNS, plumbing.reporting)."""
    rec = dataclasses.asdict(cfg)
    if overrides:
        rec["resume_overrides"] = list(overrides)
    if cfg.resume and (runs := report_runs(out)):
        rec[REPORT_RUNS] = runs
    atomic_write(out / "config.json", json.dumps(rec, indent=1))


def report_runs(out: Path) -> dict:
    """The wandb / trackio runs <out>/config.json records ({} when none)."""
    try:
        return dict(json.loads((out / "config.json").read_text()).get(REPORT_RUNS) or {})
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def resume_command(without: tuple = (), then: tuple = ("--resume", "latest")) -> str:
    """The command that continues this run: the script's own arguments without --resume / --overwrite /
    --stop-at (and the switches `without`: --torchcompile after a failed compile), plus `then` (--resume latest)."""
    import shlex
    if COMMAND is None:
        return f"the same command{' without ' + ' '.join(without) if without else ''} with {' '.join(then)}"
    drop_with_value = {"--resume", "--stop-at", "--stop-after-tasks"}
    args, skip = [], False  # skip: a is the value of the flag before it
    for a in COMMAND[1:]:
        if (not skip and a not in ("--overwrite", "--override-resume", *without)
                and a.split("=")[0] not in drop_with_value):
            args.append(a)
        skip = not skip and a in drop_with_value
    launcher = ("python" if world_size() == 1 else "srun python" if "SLURM_PROCID" in os.environ
                else "torchrun --nproc_per_node N")
    return shlex.join([*launcher.split(), COMMAND[0], *args, *then])


def _rng_state():
    """The generators' states as tensors, ints and tuples, which torch.load(weights_only=True) accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    s = {"torch": torch.get_rng_state(), "python": random.getstate(),
         "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def _set_rng_state(s):
    torch.set_rng_state(s["torch"])
    kind, keys, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def checkpoint_state(net):
    skip = tuple(getattr(net, "no_checkpoint", ()))
    return {k: v for k, v in net.state_dict().items() if not (skip and k.startswith(skip))}


def load_checkpoint_state(net, sd):
    skip = tuple(getattr(net, "no_checkpoint", ()))
    missing, unexpected = net.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (skip and k.startswith(skip))]
    if missing or unexpected:
        raise RunError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def _truncate_metrics(path: Path, step: int):
    """On resume: drops the metrics.jsonl records after the checkpoint's step (and a line cut short by a kill),
    so that each step appears once when the resumed run logs them again."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().split("\n"):
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    atomic_write(path, "".join(keep))


def latest_checkpoint(out) -> Path | None:
    p = Path(out) / "checkpoints" / "last.pt"
    return p if p.exists() else None


def data_fingerprint(train_set) -> dict:
    """What a run trains on, stored in its checkpoints: the row count and, for a manifest, the file and its
    content's sha256 (a resume on changed data is refused: the schedule and the shuffle depend on it)."""
    if hasattr(train_set, "fingerprint"):  # shards.ShardSet
        return train_set.fingerprint()
    fp, path = {"rows": len(train_set)}, getattr(train_set, "path", None)
    if path is not None and Path(path).exists():  # a manifest file, or a data folder (its rows)
        fp.update(manifest=str(path), sha256=content_sha256(path))
    return fp


def resumed_data_check(cfg, ck: Path, state: dict, data: dict) -> dict | None:
    """Refuses a resume whose training data differ from the checkpoint's (rows or manifest content) unless
    --override-resume; returns {was, now} when the override accepts a change (train's summary records it)."""
    old = state.get("data")
    if not old:
        return None
    same = all(old.get(k) == data.get(k) for k in ("rows", "sha256"))
    # shards: the same names, sizes and counts, written since (fingerprints without "modified" are not compared)
    modified = same and bool(old.get("modified") and data.get("modified")) and old["modified"] != data["modified"]
    if same and not modified:
        return None
    def shown(d):
        return f"{d['rows']} rows" + (f", sha256 {d['sha256'][:12]}" if d.get("sha256") else "")
    if not cfg.override_resume and modified:
        raise RunError(f"--resume: shards of {old.get('manifest')} were modified since {ck} was saved (same "
                       f"names, byte sizes and sample counts, other modification times): edited in place, or "
                       f"copied without keeping the times? Restore them, start afresh with --overwrite, or, if "
                       f"they were only copied, pass --override-resume (recorded in results.json)")
    if not cfg.override_resume:
        raise RunError(f"--resume: the training data changed since {ck} was saved ({old.get('manifest', 'the set')}: "
                       f"{shown(old)} then, {shown(data)} now); the step count, the schedule and the shuffle depend "
                       f"on them. Restore the data to continue the run, start afresh with --overwrite, or pass "
                       f"--override-resume to go on with the new data (recorded in results.json)")
    warn_once("[out] --override-resume: continuing on shards modified since the checkpoint" if modified else
              f"[out] --override-resume: continuing on changed training data ({shown(old)} -> {shown(data)})")
    return {"was": old, "now": data}


def checkpoint_config(ck: Path) -> tuple[dict | None, list[dict]]:
    """(settings, --override-resume changes so far) stored in a training checkpoint; (None, []) for one saved
    before checkpoints carried them. Read through mmap: the tensors are not loaded."""
    try:
        state = torch.load(ck, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        load_weights_only(ck)  # raises UnsafeFileError, naming the file
        raise
    return state.get("config"), state.get("resume_overrides", [])


def optimizer_settings(opt) -> list[dict]:
    """Each AdamW group's peak lr, decay, betas and eps, as the current flags set them."""
    return [{k: g[k] for k in ("initial_lr", "weight_decay", "betas", "eps")} for g in opt.param_groups]


def apply_optimizer_settings(opt, sched, settings: list[dict]):
    """--override-resume: a loaded optimizer / scheduler state carries the old run's rates and decay; put the new
    flags' values back, at the schedule's current point."""
    for g, s, f in zip(opt.param_groups, settings, sched.lr_lambdas):
        g.update(s)
        g["lr"] = s["initial_lr"] * f(sched.last_epoch)
    sched.base_lrs = [s["initial_lr"] for s in settings]
    sched._last_lr = [g["lr"] for g in opt.param_groups]


def kept_result(cfg, name: str, compute: Callable[[], object]):
    """compute()'s JSON result kept in <out>/<name>.json with the settings it was computed under (execution flags
    aside), e.g. the evaluation before training: a resumed run, or one interrupted during its final evaluation,
    reads it back instead of recomputing it; any other setting recomputes it."""
    path = Path(cfg.out) / f"{name}.json"
    key = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RESUME_FREE or k.startswith("eval")}
    try:
        saved = from_json(path.read_text(), restore=True)
        if saved["settings"] == key:
            return saved["value"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    value = compute()
    atomic_write(path, to_json({"settings": key, "value": value}, indent=None))  # strict JSON
    return value


# the settings that decide which parameters a model has (a checkpoint of another holds other tensors)
MODEL_SETTINGS = ("backbone", "pretrained", "lora", "lora_targets", "loss", "text_weights", "image_weights")


def model_changes(saved: dict | None, cfg) -> str:
    """'--lora 0 -> 4, --loss clip -> siglip': MODEL_SETTINGS the checkpoint's config holds with other values
    than cfg ('' when none, or a checkpoint without its config): issue 69.7, the message named --backbone only."""
    now = dataclasses.asdict(cfg)
    def shown(v):
        return repr(v) if v in ("", None) else str(v)
    return ", ".join(f"--{k.replace('_', '-')} {shown(saved[k])} -> {shown(now[k])}" for k in MODEL_SETTINGS
                     if saved and k in saved and k in now and saved[k] != now[k])


def resume_training(cfg, out: Path, net, opt, sched, scaler, data: dict, rank: int):
    """--resume in common.train: the checkpoint's weights, optimizer, schedule, grad scaler and RNG put back;
    metrics.jsonl cut to its step (rank 0). Returns (step, fp16 steps skipped so far, the data change that
    --override-resume accepted or None)."""
    ck = _resume_checkpoint(cfg, out)  # on rank 0 start_run has checked it already
    state = load_weights_only(ck)
    data_change = resumed_data_check(cfg, ck, state, data)  # the config is checked in start_run
    try:
        load_checkpoint_state(net, state["net"])
    except RuntimeError as e:  # another backbone's checkpoint, or --lora / --loss changed: --override-resume's
        changed = model_changes(state.get("config"), cfg)
        raise RunError(f"{ck} holds another model's weights ({shorten(str(e).strip().splitlines()[-1])}); "
                       f"--override-resume can change settings, never the model: "
                       + (f"{changed} since the checkpoint, which changes the model's parameters: resume with the "
                          f"run's value{'s' * (', ' in changed)}" if changed else "resume with the run's --backbone")
                       + ", or start afresh with --overwrite") from None
    try:
        opt.load_state_dict(state["optimizer"])
    except ValueError as e:  # torch: another number of groups, or of parameters in a group
        raise RunError(f"{ck}: its AdamW state does not fit the groups these settings make ({e}); --override-resume "
                       f"can change a rate or a decay, not how the parameters split into groups (--lr-image / "
                       f"--lr-text, --image-layer-decay / --text-layer-decay, --decay-all, a method's own rate "
                       f"switched on or off): resume with the run's values of those, or start afresh with "
                       f"--overwrite") from None
    sched.load_state_dict(state["scheduler"])
    if scaler.is_enabled() and not state["scaler"]:  # an fp32/bf16 run continued in fp16
        print(f"{ck} has no grad-scaler state (saved without fp16); starting at the default scale", file=sys.stderr)
    else:
        scaler.load_state_dict(state["scaler"])  # scale and growth tracker: a no-op without fp16
    _set_rng_state(state["rng"])
    step = state["step"]
    if rank == 0:
        _truncate_metrics(out / "metrics.jsonl", step)
        print(f"resumed from {ck} at step {step}", file=sys.stderr)
    return step, state.get("skipped_steps", 0), data_change


class Checkpoints:
    """A training run's checkpoints (common.train): where it starts (a fresh run, or --resume's checkpoint put
    back), <out>/checkpoints/<tag>.pt with everything an exact resume needs, and what the error after a non-finite
    loss says of them."""

    def __init__(self, cfg, out: Path, net, opt, sched, scaler, data: dict, overrides: list[dict],
                 method_state: Callable[[], dict] | None = None):
        self.cfg, self.out, self.net, self.opt, self.sched, self.scaler = cfg, out, net, opt, sched, scaler
        self.data, self.overrides, self.method_state = data, overrides, method_state

    def start(self, rank: int) -> tuple[int, int, dict | None]:
        """The run's starting point: --resume's weights, optimizer, schedule, scaler, RNG and step put back
        (resume_training), --override-resume's optimizer settings applied at the schedule's point, config.json
        written (rank 0). Returns (step, fp16 steps skipped so far, the data change --override-resume accepted)."""
        new_settings = optimizer_settings(self.opt)
        step, skipped, data_change = 0, 0, None
        if self.cfg.resume:
            step, skipped, data_change = resume_training(self.cfg, self.out, self.net, self.opt, self.sched,
                                                         self.scaler, self.data, rank)
        if self.overrides:
            apply_optimizer_settings(self.opt, self.sched, new_settings)
        if rank == 0:
            write_config(self.cfg, self.out, self.overrides)
        return step, skipped, data_change

    def save(self, step: int, skipped: int, tag: str = "last"):
        """<out>/checkpoints/<tag>.pt at `step` (rank 0), written atomically; never with a non-finite weight (a
        good checkpoint is not overwritten by a broken state)."""
        bad = [n for n, p in self.net.named_parameters() if not torch.isfinite(p).all()]
        if bad:
            raise FloatingPointError(f"non-finite weights at step {step} ({bad[:3]}); checkpoint not written")
        _atomic_save({"net": checkpoint_state(self.net), "optimizer": self.opt.state_dict(),
                      "scheduler": self.sched.state_dict(), "scaler": self.scaler.state_dict(), "rng": _rng_state(),
                      "step": step, "skipped_steps": skipped,
                      "method": self.method_state() if self.method_state else None,
                      "config": dataclasses.asdict(self.cfg), "resume_overrides": self.overrides, "data": self.data},
                     self.out / "checkpoints" / f"{tag}.pt")

    def kept(self) -> str:
        """What the non-finite loss message says of the checkpoints: only what is on disk."""
        ck = self.out / "checkpoints" / "last.pt"
        return (f"; the last good checkpoint, {ck}, is kept (--resume latest continues from it)" if ck.exists()
                else "; no checkpoint was written before it")


def machine_info() -> dict:
    """What a result was measured on (results files record it)."""
    import platform
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__, "open_clip": open_clip.__version__, "python": platform.python_version()}


def needs_tensorboard():
    """--report-to tensorboard, checked before any model is loaded: the package is there and imports (a broken
    install used to be a traceback once the model was built); one UsageError otherwise."""
    import importlib.util
    if importlib.util.find_spec("tensorboard") is None:
        raise UsageError("--report-to tensorboard needs the tensorboard package: pip install tensorboard")
    try:
        import torch.utils.tensorboard  # noqa: F401
    except Exception as e:  # noqa: BLE001  any failure of a broken install
        why = shorten((str(e).strip().splitlines() or [type(e).__name__])[0])
        raise UsageError(f"--report-to tensorboard: torch.utils.tensorboard does not import ({type(e).__name__}: "
                         f"{why}); repair the install (pip install --force-reinstall tensorboard) or drop the "
                         f"flag") from None


def tensorboard_writer(out: Path):
    """--report-to tensorboard: a SummaryWriter in <out>/tensorboard (the tensorboard package is imported only then)."""
    needs_tensorboard()
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter(str(out / "tensorboard"))


def remove_run_folder(folder) -> None:
    """Deletes a run folder unless another live process holds its lock (a run it is training)."""
    folder = Path(folder)
    holder = live_holder(folder)
    if holder:
        raise RunError(f"{folder} is being written by another live process (PID {holder.get('pid')} on "
                       f"{holder.get('host')}): not deleting it; wait for that run or choose another --out")
    shutil.rmtree(folder, ignore_errors=True)


def drop_weights(folder) -> None:
    """Deletes every weight file a finished lab run left under folder (the
    training checkpoints, model.pt and the task boundaries, with their .json
    cards); metrics, configs and results stay. The lab keeps numbers, not
    models: a demo's 60 tiny runs would otherwise fill gigabytes."""
    folder = Path(folder)
    for ck in list(folder.rglob("checkpoints")):
        shutil.rmtree(ck, ignore_errors=True)
    for pattern in ("*.pt", "*.pt.json", "*.safetensors", "*.safetensors.json"):
        for p in list(folder.rglob(pattern)):
            p.unlink(missing_ok=True)
