"""What common.train shows and writes while it runs, and what it reports at the end: the progress bar (a progress
line per log step when stderr is no terminal), <out>/metrics.jsonl (rank 0: a record per log step, one per
validation), the same scalars to --report-to's backends (tensorboard, wandb, trackio: plumbing.reporting), and the
images replaced during training, counted over every process. Below common: it imports plumbing.base,
plumbing.results, plumbing.manifests (Tally) and plumbing.reporting."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

from plumbing import reporting
from plumbing.base import printable
from plumbing.manifests import Tally
from plumbing.results import to_json


class TrainLog:
    """train's log: the bar on every rank (shown on rank 0 in a terminal), metrics.jsonl and --report-to's backends
    on rank 0 (train and validation write nothing elsewhere). close() closes the files and the backends' runs; the
    bar is closed by train."""

    def __init__(self, cfg, out: Path, total: int, step: int, rank: int):
        from tqdm.auto import tqdm
        self.out, self.total, self.log_every = out, total, cfg.log_every
        self.bar = tqdm(total=total, initial=step, disable=rank != 0 or not sys.stderr.isatty(), desc=out.name)
        self.metrics = open(out / "metrics.jsonl", "a") if rank == 0 else None
        self.report = reporting.Reporters(cfg, out) if rank == 0 and cfg.report_to else None
        self.t_log = time.time()

    def train(self, step: int, epoch: int, lr: float, loss, last: dict, logit_scale, scaler, n_skipped):
        """A log step's record (rank 0; the host reads the step's numbers here): metrics.jsonl, the backends'
        train/ scalars, the progress line or the bar's loss. fp16: the grad scale and the skipped steps too."""
        if self.metrics is None:
            return
        dt = (time.time() - self.t_log) / self.log_every
        self.t_log = time.time()
        rec = {"step": step, "epoch": epoch, "lr": lr, "loss": float(loss.detach()),
               **{k: float(v) for k, v in last.items()},
               "logit_scale": float(logit_scale.detach().exp()) if logit_scale is not None else None,
               "sec_per_step": dt}
        if scaler.is_enabled():
            rec.update(grad_scale=scaler.get_scale(), skipped_steps=int(n_skipped))
        self._write(rec)
        if self.report:  # every number of the record but its step, the axis
            self.report.scalars({f"train/{k}": v for k, v in rec.items() if k != "step"}, step)
        if self.bar.disable:  # no terminal (cluster logs, nohup): a line instead of the bar
            print(progress_line(self.out, rec, self.total), file=sys.stderr)
        self.bar.set_postfix(loss=f"{rec['loss']:.4f}")

    def validation(self, step: int, scores: dict):
        """--val-every's scores at `step` (rank 0): metrics.jsonl's val/ record, the backends' val/ scalars."""
        val = {"step": step, **{f"val/{k}": v for k, v in scores.items()}}
        self._write(val)
        if self.report:
            self.report.scalars({k: v for k, v in val.items() if k != "step"}, step)

    def _write(self, rec: dict):
        self.metrics.write(to_json(rec, indent=None) + "\n")
        self.metrics.flush()

    def close(self):
        if self.metrics:
            self.metrics.close()
        if self.report:
            self.report.close()


def progress_line(out: Path, rec: dict, total: int) -> str:
    """What train prints at log steps when stderr is not a terminal (cluster logs, nohup): tqdm's bar is off."""
    return (f"[{printable(out.name)}] step {rec['step']}/{total} epoch {rec['epoch']} loss {rec['loss']:.4f} "
            f"lr {rec['lr']:.3g} {rec['sec_per_step']:.3f}s/step")


def undecodable_images(failed: Tally, world: int) -> dict:
    """The summary's count of images replaced by the next row during training (--check-images sample / none),
    every rank's counted together, and the first few named; said on stderr when there are any."""
    if world > 1:
        shares = [None] * world
        dist.all_gather_object(shares, failed)
        failed = Tally().merge(shares)
    if failed.count:
        print(f"[data] {failed.count} undecodable image(s) replaced by the next row during training, e.g. "
              f"{printable(failed.first[0])}", file=sys.stderr)
    return {"count": failed.count, "first": failed.first}


def validations(out: Path) -> list[dict]:
    """Every validation of the run in <out>/metrics.jsonl, resumed parts included (the summary's 'validation')."""
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if any(k.startswith("val/") for k in r)]
