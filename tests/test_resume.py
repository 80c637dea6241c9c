"""The training loop on the user's path: resume exact with DataLoader
workers, torchrun's global batches equal one process's, checkpoints and
caches that cannot run code when loaded, bad rows listed, and the
non-finite guard without a host sync per step."""
import json
import os
import socket
import sys

import pytest
import torch

import common
from plumbing.base import UnsafeFileError
from plumbing.flags import Config
from plumbing import models
import lab
from _processes import spawn_two  # tests/_processes.py: two gloo processes, forked


def _cfg(tmp_path, **kw):
    base = dict(epochs=1, steps=6, batch_size=8, lr=1e-3, wd=0.1, warmup=2, workers=0, precision="fp32",
                out=str(tmp_path / "run"), save_every=0, log_every=1, device="cpu", seed=0)
    base.update(kw)
    return Config(**base)


def _tiny(seed=0):
    """The tiny backbone with random weights and open_clip's TRAIN transform (random crop)."""
    torch.manual_seed(seed)
    model, train_tf, _, tok = models.load_model("tiny", "random")
    return model, train_tf, tok


def _data(tmp_path, transform, n=32):
    return common.ManifestDataset(lab.synthetic_manifest("test", tmp_path / "data", n=n), transform)


def _train(tmp_path, data, tok, name, seed=0, **kw):
    model = _tiny(seed)[0]
    summary = common.train(_cfg(tmp_path, out=str(tmp_path / name), **kw), lab.ClipFineTune(model), data,
                           common.Collate(tok), export=False)
    return model, summary


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_random_crops_do_not_depend_on_workers_or_resume(tmp_path):
    """Stop at step 3 of 7 (4 steps per epoch) with 2 workers, resume, compare
    with an uninterrupted run; the worker count does not change the run."""
    _, train_tf, tok = _tiny()
    data = _data(tmp_path, train_tf)
    straight, _ = _train(tmp_path, data, tok, "a", steps=7, workers=2)
    common.train(_cfg(tmp_path, steps=7, out=str(tmp_path / "b"), stop_at=3, workers=2),
                 lab.ClipFineTune(_tiny()[0]), data, common.Collate(tok))
    torch.manual_seed(123)  # the resumed process starts from another RNG state
    resumed, _ = _train(tmp_path, data, tok, "b", seed=99, steps=7, workers=2, resume="latest")
    assert _max_diff(straight, resumed) < 1e-7
    no_workers, _ = _train(tmp_path, data, tok, "c", steps=7, workers=0)
    assert _max_diff(straight, no_workers) < 1e-7
    # the crops are random, and a function of (seed, epoch, index) only
    a, b = common.SeededSamples(data, seed=0), common.SeededSamples(data, seed=1)
    assert any(not torch.equal(a[(0, i)]["image"], b[(0, i)]["image"]) for i in range(8))
    assert any(not torch.equal(a[(0, i)]["image"], a[(1, i)]["image"]) for i in range(8))
    assert all(torch.equal(a[(2, i)]["image"], a[(2, i)]["image"]) for i in range(8))


def test_metrics_have_each_step_once_after_resume(tmp_path):
    _, train_tf, tok = _tiny()
    data = _data(tmp_path, train_tf)
    common.train(_cfg(tmp_path, steps=6, stop_at=3), lab.ClipFineTune(_tiny()[0]), data, common.Collate(tok))
    metrics = tmp_path / "run" / "metrics.jsonl"
    with open(metrics, "a") as f:  # what a kill after the checkpoint leaves: later steps, a line cut short
        f.write("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (4, 5)) + '{"step": 6, "lo')
    common.train(_cfg(tmp_path, steps=6, resume="latest"), lab.ClipFineTune(_tiny()[0]), data,
                 common.Collate(tok), export=False)
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_sampler_shards_each_global_batch_by_rank():
    one = common.ResumableSampler(37, 8, seed=5)
    ranks = [common.ResumableSampler(37, 4, seed=5, rank=r, world=2) for r in range(2)]
    for s in (one, *ranks):
        s.set_epoch(2)
    full, parts = list(one), [list(s) for s in ranks]
    assert len(full) == 32 and all(len(p) == 16 for p in parts)
    for b in range(4):  # global batch b = rank 0's local batch b, then rank 1's
        assert full[8 * b:8 * b + 8] == parts[0][4 * b:4 * b + 4] + parts[1][4 * b:4 * b + 4]
    ranks[1].set_epoch(2, skip_batches=3)
    assert list(ranks[1]) == parts[1][12:]


def _train_worker(rank, world, port, tmp):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    tmp = type(tmp)(tmp)
    _, train_tf, tok = _tiny()
    model, _ = _train(tmp, _data(tmp, train_tf), tok, "ddp", steps=5)
    if rank == 0:
        torch.save(model.state_dict(), tmp / "ddp_weights.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
    """common.train under 2 gloo processes (global batch 8 = 2 x 4) reaches
    the weights of one process with batch 8 on the same data order."""
    _, train_tf, tok = _tiny()
    data = _data(tmp_path, train_tf)  # written once, before the processes read it
    one, _ = _train(tmp_path, data, tok, "one", steps=5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn_two(_train_worker, 2, port, tmp_path)
    two = torch.load(tmp_path / "ddp_weights.pt", weights_only=True)
    start = _tiny()[0].state_dict()
    moved = sum((v - start[k]).square().sum() for k, v in one.state_dict().items()).sqrt()
    diff = sum((two[k] - v).square().sum() for k, v in one.state_dict().items()).sqrt()
    print(f"2 processes vs 1: |diff| / |update| = {diff / moved:.2e}")
    # float reduction order only (AdamW amplifies it where a gradient is ~0); other batches give ~1
    assert diff < 0.01 * moved


class _Payload:
    """Runs code when unpickled (what a tampered file could do)."""
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_checkpoint_loads_weights_only_and_tampered_one_is_refused(tmp_path):
    _, train_tf, tok = _tiny()
    data = _data(tmp_path, train_tf)
    common.train(_cfg(tmp_path, steps=4, stop_at=2), lab.ClipFineTune(_tiny()[0]), data, common.Collate(tok))
    ck = tmp_path / "run" / "checkpoints" / "last.pt"
    state = torch.load(ck, weights_only=True)  # RNG states included
    assert state["step"] == 2 and set(state["rng"]) >= {"torch", "numpy", "python"}
    marker = tmp_path / "payload-ran"
    torch.save({**state, "method": _Payload(marker)}, ck)
    with pytest.raises(UnsafeFileError, match=r"last.pt: refused to load"):
        common.train(_cfg(tmp_path, steps=4, resume="latest"), lab.ClipFineTune(_tiny()[0]), data,
                     common.Collate(tok))
    assert not marker.exists()


def test_skipped_rows_are_all_in_the_summary(tmp_path):
    _, train_tf, tok = _tiny()
    man = lab.synthetic_manifest("test", tmp_path / "data", n=24)
    rows = [json.loads(line) for line in man.read_text().splitlines()]
    for i in (3, 10, 17):
        rows[i]["image"] = "absent.png"
    bad = man.parent / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = common.ManifestDataset(bad, train_tf, skip_bad=True)
    _, summary = _train(tmp_path, data, tok, "run", steps=1)
    assert [r.split(": ")[0] for r in summary["bad_rows"]] == [f"{bad}:{i + 1}" for i in (3, 10, 17)]


class _NanAtStep3(lab.ClipFineTune):
    """A loss term that is NaN at step 3 only (the weights it breaks keep later losses NaN)."""
    def forward(self, batch, ctx=None):
        return {**super().forward(batch, ctx), "loss_bad": torch.tensor(float("nan") if ctx.step == 3 else 0.0)}


def test_nan_at_step_k_is_named_and_never_saved(tmp_path):
    """The NaN at step 3 is read at the next check (a save at step 6 or the
    log at step 5), which names step 3; the checkpoint of step 3 is kept."""
    _, train_tf, tok = _tiny()
    with pytest.raises(FloatingPointError,
                       match=r"non-finite loss at step 4: .*loss_bad.*last good checkpoint, .*last.pt, is kept"):
        common.train(_cfg(tmp_path, steps=10, log_every=5, save_every=3), _NanAtStep3(_tiny()[0]),
                     _data(tmp_path, train_tf), common.Collate(tok))
    ck = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert ck["step"] == 3
    assert all(torch.isfinite(v).all() for v in ck["net"].values() if v.is_floating_point())


def test_no_host_read_per_step(tmp_path, monkeypatch):
    """Between log steps the loop reads nothing back from the device: the
    number of tensor-to-Python reads made in common.py does not grow with
    the step count (today's per-step `if not isfinite(loss)` and float() of
    each term would add 2 a step)."""
    _, train_tf, tok = _tiny()
    data = _data(tmp_path, train_tf)
    reads = {"n": 0}
    for name in ("__bool__", "__float__", "item"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original):
            reads["n"] += sys._getframe(1).f_code.co_filename == common.__file__  # the loop's reads, not torch's
            return _original(self, *a)
        monkeypatch.setattr(torch.Tensor, name, counted)
    counts = []
    for steps in (2, 6):
        reads["n"] = 0
        _train(tmp_path, data, tok, f"s{steps}", steps=steps, log_every=100)
        counts.append(reads["n"])
    assert counts[1] == counts[0], counts


def test_caches_load_weights_only_and_tampered_ones_are_refused(tmp_path):
    import eval as ev
    from protocols import wise_ft
    value = {"img": torch.randn(3, 4), "labels": None, "t2i": torch.arange(3)}
    key = {"backbone": "tiny", "manifest": "m.jsonl"}
    assert ev.cached(tmp_path, key, lambda: value) is value
    again = ev.cached(tmp_path, key, lambda: pytest.fail("recomputed"))
    assert torch.equal(again["img"], value["img"]) and again["labels"] is None
    marker = tmp_path / "payload-ran"
    for file in tmp_path.glob("*.pt"):
        torch.save({"img": _Payload(marker)}, file)
    with pytest.raises(UnsafeFileError, match="refused to load"):
        ev.cached(tmp_path, key, lambda: value)
    torch.save(_Payload(marker), tmp_path / "weights.pt")  # eval's --weights path (WiSE-FT, evaluation)
    with pytest.raises(UnsafeFileError, match="weights.pt: refused"):
        wise_ft.load_state_dict(tmp_path / "weights.pt")
    assert not marker.exists()
