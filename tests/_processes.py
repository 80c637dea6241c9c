"""Two-process tests (gloo DDP on CPU) without paying Python's start-up twice per test.

torch.multiprocessing.spawn starts each child as a fresh interpreter that imports torch, open_clip and the
project again: 4-8 CPU-seconds per child on 2 cores, most of a two-process test's time. spawn_two forks the
children from a forkserver that imported those once (one server per pytest worker; a forked child of a process
that has run no torch op is as clean as a spawned one) and hands each child the parent's environment as it is
at the call, so a child sees what a spawned one would (monkeypatched variables included).
"""
import multiprocessing
import os

import torch.multiprocessing as mp

PRELOAD = ["torch", "open_clip", "common", "eval"]


def _child(rank, env, fn, args):
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)


def spawn_two(fn, *args):
    """mp.spawn(fn, args=args, nprocs=2, join=True), from the forkserver."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call in this worker
    mp.start_processes(_child, args=(dict(os.environ), fn, args), nprocs=2, join=True, start_method="forkserver")
