"""Experiment plumbing for demos and sweeps: a demo run's scratch folder, one
folder per sweep run (resume by skipping finished runs), prefixes of one
fixed data order, per-epoch snapshots."""
from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path
from typing import Callable

import common

# =============================================================================
# 7. Sweeps: one folder per run, resume by skipping finished runs, curves
# =============================================================================
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
    shutil.rmtree(folder, ignore_errors=True)
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
    for p in list(folder.rglob("*.pt")) + list(folder.rglob("*.pt.json")):
        p.unlink(missing_ok=True)


@contextlib.contextmanager
def scratch_run(folder):
    """A demo run's own folder: emptied first (a rerun starts it afresh),
    its weight files dropped once the block (train, then measure) ends."""
    shutil.rmtree(folder, ignore_errors=True)
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
        if self.step % self.steps_per_epoch or common.dist_info()[0] != 0:
            return
        if self.folder is None:
            self.snapshots.append({k: v.detach().clone() for k, v in net.model.state_dict().items()})
        else:
            path = Path(self.folder) / f"epoch{self.step // self.steps_per_epoch}.pt"
            self.snapshots.append(common.save_model(net.model, path, self.backbone, source=f"step {self.step}"))


