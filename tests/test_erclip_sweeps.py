"""ERCLIP's sweeps (erclip.py --sweep: papers/erclip_sweeps.py, lab/demos/erclip_sweeps.py): per-run folders and
resume by skipping finished runs, pool prefixes, per-epoch checkpoints that
leave the run unchanged, every demo sweep's results file on a shrunken
world, and the real-setting sweeps on a manifest the lab writes."""
import json
import os
from pathlib import Path

import pytest
import torch

from plumbing import models, published, runfolder
from papers import erclip_sweeps as sweeps  # the real sweeps (lab.demos.erclip_sweeps: the lab's)
import socket
import common
from plumbing.base import RunError
from plumbing.cli import cli
from plumbing.flags import parse_config
from plumbing.manifests import read_manifest
import erclip
import lab
from lab.demos import erclip as erclip_demo
from lab.demos import erclip_sweeps


# ---------------------------------------------------------------------------- generic helpers (papers/erclip_sweeps.py)
def test_sweep_run_skips_finished_runs_and_restarts_unfinished_ones(tmp_path):
    calls = []

    def fn(folder):
        calls.append(folder.name)
        (folder / "trained.txt").write_text("x")
        return {"value": len(calls)}

    first = sweeps.sweep_run(tmp_path, "a-seed0", fn)
    assert first == {"run": "a-seed0", "value": 1} and (tmp_path / "a-seed0" / "run.json").exists()
    assert sweeps.sweep_run(tmp_path, "a-seed0", fn) == first and calls == ["a-seed0"]  # finished: skipped
    stale = tmp_path / "b-seed0"  # a run that crashed: folder without run.json
    stale.mkdir()
    (stale / "half-written.pt").write_text("partial")
    assert sweeps.sweep_run(tmp_path, "b-seed0", fn)["value"] == 2
    assert not (stale / "half-written.pt").exists() and calls == ["a-seed0", "b-seed0"]


def test_prefix_manifest_is_a_prefix_of_one_order_with_absolute_images(tmp_path):
    src = lab.synthetic_manifest("train", tmp_path / "data", n=12)
    rows = read_manifest(src)
    five = sweeps.prefix_manifest(src, 5, tmp_path / "elsewhere" / "p5.jsonl")
    ten = sweeps.prefix_manifest(src, 10, tmp_path / "elsewhere" / "p10.jsonl")
    got5, got10 = read_manifest(five), read_manifest(ten)
    assert [r["caption"] for r in got5] == [r["caption"] for r in got10[:5]] == [r["caption"] for r in rows[:5]]
    ds = common.ManifestDataset(ten, need_long=True)  # images resolve from the new folder
    assert len(ds) == 10 and ds.image_file(ds.rows[3]).resolve() == (src.parent / rows[3]["image"]).resolve()
    assert len(read_manifest(sweeps.prefix_manifest(src, 50, tmp_path / "all.jsonl"))) == 12


def _train(tmp_path, name, hooks=None, **kw):
    cfg = erclip.ERCLIPConfig(backbone="tiny", pretrained="random", workers=0, precision="fp32", device="cpu",
                              train_data="synthetic", data_root=str(tmp_path / "data"), train_pairs=8, batch_size=4,
                              epochs=3, warmup=1, lr=1e-4, save_every=0, log_every=1, out=str(tmp_path / name), **kw)
    torch.manual_seed(0)
    model, train_tf, _, tok = models.load_model("tiny", "random")
    torch.manual_seed(0)
    return erclip.train_erclip(cfg, model, train_tf, tok, hooks=hooks, world=lab.WORLD)


def test_epoch_snapshots_save_every_epoch_and_leave_the_run_unchanged(tmp_path):
    plain, summary = _train(tmp_path, "plain", fusion="rt")
    on_disk = sweeps.EpochSnapshots(tmp_path / "disk", "tiny", steps_per_epoch=2)
    (tmp_path / "disk").mkdir()
    snapped, _ = _train(tmp_path, "disk", hooks=on_disk, fusion="rt")
    assert summary["steps"] == 6 and [p.name for p in on_disk.snapshots] == ["epoch1.pt", "epoch2.pt", "epoch3.pt"]
    final = plain.state_dict()
    assert all(torch.equal(v, snapped.state_dict()[k]) for k, v in final.items())  # the same run
    last, first = torch.load(on_disk.snapshots[-1]), torch.load(on_disk.snapshots[0])
    assert all(torch.equal(final[k], last[k]) for k in last)
    assert not torch.equal(first["visual.conv1.weight"], last["visual.conv1.weight"])
    model, _, _, _ = models.load_model("tiny", str(on_disk.snapshots[0]))  # loadable as a checkpoint
    assert torch.equal(model.state_dict()["visual.conv1.weight"], first["visual.conv1.weight"])
    in_memory = sweeps.EpochSnapshots(None, "tiny", steps_per_epoch=2)
    _train(tmp_path, "memory", hooks=in_memory, fusion="rt")
    assert len(in_memory.snapshots) == 3 and not list((tmp_path / "memory").glob("epoch*"))
    for saved, kept in zip(on_disk.snapshots, in_memory.snapshots):
        assert all(torch.equal(v, kept[k]) for k, v in torch.load(saved).items())


# ----------------------------------------------------------------------------- the lab (--demo --sweep)
SWEEP_ROWS = {  # on the shrunken grids below
    "epochs": [f"{v} epoch {k}" for v in ("M", "M+P", "RT+P", "RT+P own lr") for k in (1, 2)],
    "lambda-p": ["lambda_p=0", "lambda_p=0.5", "lambda_p=2"],
    "data-size": ["N=16", "N=40", "N=400"],
    "ablations": list(sweeps.VARIANTS),
}


@pytest.mark.slow
@pytest.mark.parametrize("name,n_claims", [("epochs", 11), ("lambda-p", 7), ("data-size", 4), ("ablations", 5)])
def test_demo_sweep_results_file(tmp_path, monkeypatch, shrink_world, check_demo_results, name, n_claims):
    """Each demo sweep's plumbing on a shrunken world and shrunken grids (one
    step per run; 2 epochs of 8 pairs for the epochs sweep): every seed
    of every row, the claims, the figure, one folder per run with its record
    and no weights, and a second start that trains nothing."""
    shrink_world({"train": 48, "test": 16, "zs-test": 24}.get)
    monkeypatch.setattr(sweeps, "EPOCHS", 2)
    monkeypatch.setattr(erclip_sweeps, "DEMO_EPOCH_POOL", 8)
    monkeypatch.setattr(sweeps, "LAMBDAS", (0.0, 0.5, 2.0))
    monkeypatch.setattr(erclip_sweeps, "DEMO_DATA_SIZES", (16, 40, 400))
    out = tmp_path / "demo"
    argv = ["--demo", "--seeds", "0,1", "--processes", "1", "--sweep", name,
            "--steps", "0" if name == "epochs" else "1", "--warmup", "1", "--batch-size",
            "8", "--data-root", str(tmp_path / "data"), "--out", str(out)]
    erclip.main(argv)
    root = out / f"sweep-{name}"
    checks = [r for r in SWEEP_ROWS[name] if name == "epochs" and r.rsplit(" epoch", 1)[0] in erclip_demo.CHECK_ONLY]
    saved = check_demo_results(root, f"erclip-sweep-{name}.png", SWEEP_ROWS[name], min_claims=n_claims, checks=checks)
    assert list(saved["per_seed"]) == SWEEP_ROWS[name] and len(saved["claims"]) == n_claims
    assert saved["sweep"] == name and saved["definition"] == erclip_sweeps.DEMO_SWEEP_NOTES[name]
    assert saved["config"]["sweep"] == name and saved["machine"]["cores"] >= 1
    runs = sorted(p.name for p in root.iterdir() if p.is_dir())
    n_runs = len(SWEEP_ROWS[name]) // (2 if name == "epochs" else 1)
    n_checks = len(checks) // 2  # the construction check's run: the first seed only
    assert len(runs) == 1 + (n_runs - n_checks) * len(lab.seeds()) + n_checks and "CLIP" in runs
    for run in runs:
        assert (root / run / "run.json").exists() and not list((root / run).glob("*.pt"))
        assert not (root / run / "checkpoints").exists()
    records = [json.loads((root / run / "run.json").read_text()) for run in runs if run != "CLIP"]
    if name == "epochs":  # 2 epochs of 8 pairs at batch 8: 1 step each, a snapshot measured after each
        assert all(r["summary"]["steps"] == 2 and len(r["measures"]) == 2 for r in records)
    if name == "data-size":  # prefixes of the 48-scene pool (a size above it keeps all 48)
        assert sorted(r["summary"]["train_pairs"] for r in records if r["seed"] == 0) == [16, 40, 48]
    if name == "ablations":
        alpha = {r["name"]: json.loads((root / r["run"] / "config.json").read_text())["alpha"] for r in records}
        assert alpha["L_short only"] == 0.0 and alpha["M"] == 1.0
    text = erclip_sweeps.sweep_markdown(root / "results.json")  # the README block, from the file alone
    assert f"--sweep {name}" in text and "| CLIP |" in text and saved["claims"][0]["claim"] in text
    assert " s (a shared machine); from" in erclip_sweeps.sweep_markdown(root / "results.json", "a shared machine")

    def no_training(*a, **k):
        raise AssertionError("a finished run was trained again")
    monkeypatch.setattr(erclip, "train_erclip", no_training)
    again = erclip.main(argv)  # every run finished: all skipped, the same numbers
    assert again["per_seed"] == saved["per_seed"]


# ----------------------------------------------------------------------------- the real setting on fixtures
def _real_argv(tmp_path, name, *extra):
    data = tmp_path / "data"
    train = lab.synthetic_manifest("train", data, n=16)  # stands in for the COCO x ShareGPT4V manifest
    evalset = lab.synthetic_manifest("test", data, n=12)  # a retrieval task given by its manifest
    return ["--sweep", name, "--backbone", "tiny", "--train-data", str(train), "--eval-tasks", str(evalset),
            "--data-root", str(data), "--batch-size", "8", "--warmup", "1", "--lr", "1e-4", "--workers", "0",
            "--device", "cpu", "--precision", "fp32", "--save-every", "0", "--out", str(tmp_path / "runs"), *extra]


@pytest.mark.slow
def test_real_epochs_sweep_on_a_manifest_fixture(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweeps, "EPOCHS", 3)
    argv = _real_argv(tmp_path, "epochs")
    result = erclip.main(argv)
    root = tmp_path / "runs" / "sweep-epochs"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["CLIP", "M+P-seed0", "M-seed0", "RT+P-seed0"]
    saved = json.loads((root / "results.json").read_text())
    assert set(saved) >= {"sweep", "base", "runs", "tables", "config", "machine"} and saved["sweep"] == "epochs"
    for run in saved["runs"]:  # 16 pairs / 8 = 2 steps an epoch, 3 epochs, the checkpoint of each evaluated
        assert run["summary"]["steps"] == 6 and len(run["measures"]) == 3
        assert [m[0]["weights"].rsplit("/", 1)[1] for m in run["measures"]] == ["epoch1.pt", "epoch2.pt", "epoch3.pt"]
        assert (root / run["run"] / "epoch3.pt").exists()  # the real setting keeps its checkpoints
    out = capsys.readouterr().out
    assert "Fig. 3 (Sec. 4.3)" in out and "| M+P | 3 |" in out and "| paper (Sec. 4.3) | -0.4 to -1.2" in out
    assert result["tables"] == saved["tables"]
    monkeypatch.setattr(erclip, "train_erclip", lambda *a, **k: pytest.fail("a finished run was trained again"))
    assert erclip.main(argv)["runs"] == saved["runs"]



def test_real_sweep_runs_the_preflight_before_any_model_is_loaded(tmp_path, monkeypatch, capsys):
    """Issue 23 item 5: a sweep checks the manifest's rows, the --out lock and
    --resume like a single run, and fails with one message before a model is
    loaded or evaluated."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the preflight")
    monkeypatch.setattr(models, "load_model", refuse)
    argv = _real_argv(tmp_path, "ablations")
    small = argv[argv.index("--train-data") + 1]
    few = tmp_path / "few.jsonl"  # 4 usable rows, fewer than one batch of 8
    few.write_text("".join(json.dumps(dict(r, image=str((Path(small).parent / r["image"]).resolve()))) + "\n"
                           for r in read_manifest(small)[:4]))
    bad = argv[:argv.index("--train-data") + 1] + [str(few)] + argv[argv.index("--train-data") + 2:]
    with pytest.raises(SystemExit) as e:
        cli(erclip.main, bad)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "4 usable rows, fewer than one batch" in err and "Traceback" not in err
    out = tmp_path / "runs"  # another live process holds --out
    out.mkdir()
    (out / runfolder.LOCK).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))
    with pytest.raises(RunError, match="is writing to"):
        erclip.main(argv)
    (out / runfolder.LOCK).unlink()
    with pytest.raises(RunError, match="start without --resume"):  # nothing to resume in --out
        erclip.main(argv + ["--resume", "latest"])
    assert not (out / "sweep-ablations").exists()

def test_real_data_size_sweep_trains_on_prefixes(tmp_path, capsys):
    cfg = parse_config(erclip.ERCLIPConfig, _real_argv(tmp_path, "data-size", "--steps", "1"))
    result = sweeps.run_sweep(erclip.sweep_method(lab.WORLD), cfg, sizes=(8, 12, 1000))
    assert [r["summary"]["train_pairs"] for r in result["runs"]] == [8, 12, 16]
    firsts = [read_manifest(tmp_path / "runs" / "sweep-data-size" / r["run"] / "pairs.jsonl")[0]["caption"]
              for r in result["runs"]]
    assert len(set(firsts)) == 1  # one order, three prefixes
    out = capsys.readouterr().out
    assert "Data size (Sec. 4.4)" in out and "| paper long | paper COCO | paper IN |" in out
    assert "| 1000 | 16 |" in out and "| 56.30 | 40.80 | 63.50 |" in out


def _records(value):
    recs = [{"task": t, "metric": m, "value": value}
            for t in published.ERCLIP_LONG_SETS + ("coco",) for m in ("i2t_R@1", "t2i_R@1")]
    return recs + [{"task": t, "metric": "top1", "value": value + 10} for t in ("cifar10", "cifar100", "imagenet")]


def test_real_sweep_tables_put_the_papers_numbers_beside_ours():
    base = _records(40.0)
    lam = [{"run": f"lambda_p={x:g}-seed0", "overrides": {"lambda_p": x}, "measures": [_records(50.0 + x)]}
           for x in sweeps.LAMBDAS]
    text = sweeps.sweep_tables("lambda-p", base, lam, "B/32")
    assert "| 0 | 50.00 | 50.00 | 50.00 | 50.00 | 60.00 | 60.00 | 60.00 | 50.00 | 50.00 | 58.20 |" in text
    assert "| 2 | 52.00 |" in text and text.rstrip().endswith("| 60.80 |") and "58.2 -> 60.8" in text
    abl = [{"run": f"{v}-seed0", "overrides": dict(sweeps.VARIANTS[v]), "measures": [_records(50.0)]}
           for v in sweeps.VARIANTS]
    text = sweeps.sweep_tables("ablations", base, abl, "B/16", erclip.paper_tables)
    assert "| paper RT+P | B/16 | yes | 65.46 |" in text and "| RT (ours) | B/16 | no | 50.00 |" in text
    assert "| L_short only (ours) | B/16 | no |" in text and "not run" in text
