"""Experiment plumbing for demos and sweeps: a demo's or a sweep's --out held
for its whole length, a demo run's scratch folder, independent runs in
parallel processes. One folder per sweep run, prefixes of one fixed data
order and per-epoch snapshots are papers/erclip_sweeps.py (the real sweeps use
them too)."""
from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os
from pathlib import Path
from typing import Callable, Sequence

import torch

from plumbing import runfolder
from plumbing.runfolder import drop_weights, remove_run_folder
from plumbing.base import UsageError
from lab.stats import JOB_THREADS, take_flag

# =============================================================================
# Independent runs: in processes of one torch thread each
# =============================================================================
PROCESSES = min(4, os.cpu_count() or 1)  # a demo's --processes default


def _one_thread():
    torch.set_num_threads(JOB_THREADS)
    import lab  # noqa: F401  (registers the tiny backbone and the world in the worker)


@contextlib.contextmanager
def job_pool(processes: int = PROCESSES):
    """The spawned one-thread workers of run_jobs, kept for several calls (a demo's batches of runs: each worker
    imports torch and the project once, ~6 s, not once per batch); None for processes <= 1."""
    if processes <= 1:
        yield None
        return
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=_one_thread) as pool:
        yield pool


def run_jobs(fn: Callable, jobs: Sequence[tuple], processes: int = PROCESSES, done: Callable | None = None,
             pool=None) -> list:
    """[fn(*job) for job in jobs], each in ONE torch thread: in `processes` spawned workers, or here when
    processes is 1. The numbers are the same either way (every job is seeded by its arguments and runs on one
    thread); the workers fill the cores that a tiny model's two-thread matmuls leave idle (a C-CLIP sequence:
    14.3 s on 2 threads, two at once on 1 thread each 19 s, 1.5x the throughput; measured on 2 cores).
    done(i, result) is called in the order the jobs finish (progress lines). fn must be a module-level function."""
    results = [None] * len(jobs)
    if processes <= 1 or len(jobs) <= 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(JOB_THREADS)
        try:
            for i, job in enumerate(jobs):
                results[i] = fn(*job)
                done and done(i, results[i])
        finally:
            torch.set_num_threads(threads)
        return results
    with contextlib.nullcontext(pool) if pool else job_pool(min(processes, len(jobs))) as pool:
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
        raise UsageError(f"--processes {value!r}: give a whole number >= 1 (1: one run at a time)")
    return rest, int(value)

# =============================================================================
# 7. Sweeps: the --out of a demo or a sweep, a demo run's scratch folder
# =============================================================================
def hold_out(out) -> Path:
    """A demo's or a sweep's --out, locked for its whole length (runfolder.lock_out: one writer per folder, a
    stale lock taken over): a second demo or sweep into the same folder stops at once with one message instead
    of deleting the first one's runs under it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runfolder.lock_out(out)
    return out


@contextlib.contextmanager
def scratch_run(folder):
    """A demo run's own folder: emptied first (a rerun starts it afresh),
    its weight files dropped once the block (train, then measure) ends."""
    remove_run_folder(folder)
    yield Path(folder)
    drop_weights(folder)
