"""Experiment plumbing for demos and sweeps: a demo run's scratch folder, one
folder per sweep run (resume by skipping finished runs), prefixes of one
fixed data order, per-epoch snapshots, independent runs in parallel
processes."""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch

from plumbing import manifests, runfolder
import common
from lab.stats import take_flag

# =============================================================================
# Independent runs: in processes of one torch thread each
# =============================================================================
PROCESSES = min(4, os.cpu_count() or 1)  # a demo's --processes default


def _one_thread():
    torch.set_num_threads(1)
    import lab  # noqa: F401  (registers the tiny backbone and the world in the worker)


def run_jobs(fn: Callable, jobs: Sequence[tuple], processes: int = PROCESSES, done: Callable | None = None) -> list:
    """[fn(*job) for job in jobs], each in ONE torch thread: in `processes` spawned workers, or here when
    processes is 1. The numbers are the same either way (every job is seeded by its arguments and runs on one
    thread); the workers fill the cores that a tiny model's two-thread matmuls leave idle (a C-CLIP sequence:
    14.3 s on 2 threads, two at once on 1 thread each 19 s, 1.5x the throughput; measured on 2 cores).
    done(i, result) is called in the order the jobs finish (progress lines). fn must be a module-level function."""
    results = [None] * len(jobs)
    if processes <= 1 or len(jobs) <= 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for i, job in enumerate(jobs):
                results[i] = fn(*job)
                done and done(i, results[i])
        finally:
            torch.set_num_threads(threads)
        return results
    with concurrent.futures.ProcessPoolExecutor(min(processes, len(jobs)), mp_context=multiprocessing.get_context(
            "spawn"), initializer=_one_thread) as pool:
        futures = {pool.submit(fn, *job): i for i, job in enumerate(jobs)}
        try:
            for f in concurrent.futures.as_completed(futures):
                results[futures[f]] = f.result()
                done and done(futures[f], results[futures[f]])
        except BaseException:  # one job failed (or Ctrl-C): the queued ones never start
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return results


def take_processes_flag(argv: Sequence[str]) -> tuple[list[str], int]:
    """Takes `--processes N` (or --processes=N) off a demo's command line: how many jobs run at once
    (run_jobs; default PROCESSES). Returns (the other arguments, N)."""
    rest, value = take_flag(argv, "--processes")
    if value is None:
        return rest, PROCESSES
    if not value.isdigit() or int(value) < 1:
        raise common.UsageError(f"--processes {value!r}: give a whole number >= 1 (1: one run at a time)")
    return rest, int(value)

# =============================================================================
# 7. Sweeps: one folder per run, resume by skipping finished runs, curves
# =============================================================================
def hold_out(out) -> Path:
    """A demo's or a sweep's --out, locked for its whole length (runfolder.lock_out: one writer per folder, a
    stale lock taken over): a second demo or sweep into the same folder stops at once with one message instead
    of deleting the first one's runs under it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runfolder.lock_out(out)
    return out


def remove_run_folder(folder) -> None:
    """Deletes a run folder unless another live process holds its lock (a run it is training)."""
    folder = Path(folder)
    holder = runfolder.live_holder(folder)
    if holder:
        raise common.RunError(f"{folder} is being written by another live process (PID {holder.get('pid')} on "
                              f"{holder.get('host')}): not deleting it; wait for that run or choose another --out")
    shutil.rmtree(folder, ignore_errors=True)


def sweep_run(out, name: str, fn: Callable[[Path], dict]) -> dict:
    """One run of a sweep, in its own folder out/name. A finished run (its
    run.json exists) is read back and skipped, so a sweep that stopped part
    way resumes at the first unfinished run; an unfinished folder is cleared
    and its run starts afresh (runs are never continued from a half state).
    fn(folder) trains and measures; its dict is written to folder/run.json."""
    folder = Path(out) / name
    done = folder / "run.json"
    if done.exists():
        print(f"[sweep] {name}: finished earlier, skipped ({done})", file=sys.stderr)
        return json.loads(done.read_text())
    remove_run_folder(folder)
    folder.mkdir(parents=True)
    record = {"run": name, **fn(folder)}
    common.atomic_write(done, json.dumps(record, indent=1, default=float))
    return record


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


@contextlib.contextmanager
def scratch_run(folder):
    """A demo run's own folder: emptied first (a rerun starts it afresh),
    its weight files dropped once the block (train, then measure) ends."""
    remove_run_folder(folder)
    yield Path(folder)
    drop_weights(folder)


def prefix_manifest(src, n: int, dst) -> Path:
    """The first n rows of a manifest (all of them when it has fewer), image
    paths made absolute so that the copy can live anywhere: a data-size sweep
    trains on prefixes of ONE fixed order."""
    src = Path(src)
    rows = common.read_manifest(src)
    key = next((k for k in common.IMAGE_KEYS if rows and k in rows[0]), None)
    lines = []
    for r in rows[:n]:
        r = {k: v for k, v in r.items() if k != "_line"}
        if key is not None:
            r[key] = str((src.parent / str(r[key])).resolve())
        lines.append(json.dumps(r))
    if len(rows) < n:
        print(f"[sweep] {src} has {len(rows)} rows, fewer than {n}: all of them are used", file=sys.stderr)
    return common.atomic_write(dst, "\n".join(lines) + "\n")


class EpochSnapshots:
    """Hooks for common.train that keep the model's weights after the last
    step of every epoch: saved (common.save_model) to folder/epoch<k>.pt, or
    with folder=None kept in memory (the lab's small models). One run thus
    gives the per-epoch checkpoints a training-length sweep evaluates
    afterwards. Reads the weights only (no gradient, no random number), so
    the run is the one it would be without the hooks. The copy is taken
    before train_step's logit-scale clamp, a no-op unless the temperature is
    trained past ln 100. snapshots: one path or state_dict per epoch."""

    def __init__(self, folder, backbone: str, steps_per_epoch: int):
        self.folder, self.backbone, self.steps_per_epoch = folder, backbone, max(1, steps_per_epoch)
        self.step, self.snapshots = 0, []

    def before_optimizer_step(self, net):
        pass

    def after_optimizer_step(self, net):
        self.step += 1
        if self.step % self.steps_per_epoch or manifests.dist_info()[0] != 0:
            return
        if self.folder is None:
            self.snapshots.append({k: v.detach().clone() for k, v in net.model.state_dict().items()})
        else:
            path = Path(self.folder) / f"epoch{self.step // self.steps_per_epoch}.pt"
            self.snapshots.append(common.save_model(net.model, path, self.backbone, source=f"step {self.step}"))


