"""Issue 72.4-72.5: messages that blame the right thing and settings that answer before they cost anything:
m2mix.py's --train-data folder of no layout, optional packages before torch, a warm-up as long as the run scaled
before any step, validation tags by name and several --val-data sets, --grad-checkpointing doing what the docs
say, ERCLIP's refusals (long captions, no data). docs/reliability.md maps each case to its test."""
import json
import os
import subprocess
import sys
from pathlib import Path

import open_clip
import pytest
import torch

import common
from plumbing.base import DataError, RunError
from plumbing.flags import parse_config
import erclip
import lab
import m2mix
from plumbing import outfolder, results

ROOT = Path(__file__).resolve().parents[1]


def _erclip(tmp_path, out, *extra, data=None):
    root = tmp_path / "data"
    lab.synthetic_manifest("train", root, n=16)
    return erclip.main(["--data-root", str(root), "--train-data", data or "synthetic", "--train-pairs", "16",
                        "--batch-size", "8", "--steps", "2", "--warmup", "0", "--lr", "1e-3", "--workers", "0",
                        "--log-every", "1", "--device", "cpu", "--eval-tasks", "none", "--pretrained", "random",
                        "--out", str(tmp_path / out), *extra])


def _sidecar_folder(tmp_path, suffix=".txt"):
    """Four of the synthetic world's images with a caption sidecar each (NAME.txt: the short caption only)."""
    rows = [json.loads(x) for x in lab.synthetic_manifest("test", tmp_path / "data", n=8).read_text().splitlines()]
    folder = tmp_path / "mine-test"
    folder.mkdir()
    manifest_dir = lab.synthetic_manifest("test", tmp_path / "data", n=8).parent
    for i, r in enumerate(rows):
        (folder / f"{i}.png").write_bytes((manifest_dir / r["image"]).read_bytes())
        (folder / f"{i}{suffix}").write_text(r["caption"])
    return folder


# ----------------------------------------------------------------------------- 72.4 wrong blame
def test_m2mix_blames_train_data_for_a_folder_of_no_layout(tmp_path):
    """It said "evaluation task '<DIR>' cannot be loaded" though no evaluation task was passed."""
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.png").write_bytes(b"")
    with pytest.raises(DataError) as e:
        m2mix.main(["--backbone", "tiny", "--train-data", str(tmp_path / "flat"), "--out", str(tmp_path / "o")])
    msg = str(e.value)
    assert msg.startswith(f"--train-data {tmp_path / 'flat'}: a folder of no layout read here")
    assert "evaluation task" not in msg and "DIR/<class>/<image>" in msg and "sidecars" in msg


# ----------------------------------------------------------------------------- 72.5 packages before torch
def test_report_to_wandb_without_wandb_answers_before_torch_loads(tmp_path):
    """A `torch` that cannot be imported on the path: the answer comes from the command line alone."""
    import importlib.util
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    fake = tmp_path / "no-torch"
    fake.mkdir()
    (fake / "torch.py").write_text("raise ImportError('torch was imported')\n")
    env = {**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{ROOT}"}
    r = subprocess.run([sys.executable, str(ROOT / "erclip.py"), "--report-to", "wandb", "--out",
                        str(tmp_path / "o")], capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert r.returncode == 2 and "torch was imported" not in r.stderr, r.stderr
    assert r.stderr.strip() == ("error: --report-to wandb needs the wandb package: pip install wandb (or drop wandb "
                                "from --report-to)")
    assert not (tmp_path / "o").exists()


def test_a_hugging_face_folder_without_datasets_answers_before_torch(tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "datasets" else real(n, *a))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "state.json").write_text("{}")
    cfg = parse_config(m2mix.M2MixConfig, ["--train-data", str(tmp_path / "hf"), "--out", str(tmp_path)])
    assert str(outfolder.early_problem(cfg)) == (f"--train-data {tmp_path / 'hf'}: a Hugging Face datasets folder "
                                                 f"or parquet file needs the datasets package: pip install datasets")


# ----------------------------------------------------------------------------- 72.5 warm-up
def test_a_warm_up_as_long_as_the_run_is_scaled_before_any_step(capsys):
    """ERCLIP's default --warmup 200 on an 8-step run left the lr at 2e-7 (a warning, a wasted run): now the
    warm-up is 10 % of the run (round(0.8) = 1 step, whose multiplier is (0 + 1) / 1), said in one line, and the
    lr is --lr at the first step, then the cosine (the unscaled warm-up would end at 8 / 200 x --lr)."""
    cfg = erclip.ERCLIPConfig(lr=1e-3)
    assert cfg.warmup == 200
    net = torch.nn.Linear(2, 2)
    _, sched = common.optimizer_and_schedule(cfg, net, torch.device("cpu"), None, None, 8, 8)
    err = capsys.readouterr().err
    assert "--warmup 200 is not shorter than the run (8 steps): scaled to 1 (10 % of the run" in err
    lrs = []
    for _ in range(8):
        lrs.append(sched.get_last_lr()[0])
        sched.optimizer.step()
        sched.step()
    assert lrs[0] == pytest.approx(1e-3) and lrs == sorted(lrs, reverse=True) and lrs[-1] > 0
    _, sched = common.optimizer_and_schedule(erclip.ERCLIPConfig(lr=1e-3, warmup=4), net, torch.device("cpu"),
                                             None, None, 8, 8)  # shorter than the run: as given, no line
    assert "scaled" not in capsys.readouterr().err


# ----------------------------------------------------------------------------- 72.5 validation sets
def test_task_tags_are_names_never_absolute_paths(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "a").mkdir()
    tags = results.task_tags([str(tmp_path / "a"), "synthetic-short", str(tmp_path / "x" / "test.jsonl"),
                              f"imagefolder:{tmp_path / 'b'}", str(tmp_path / "b" / "a"), "mtil:CIFAR100",
                              f"{tmp_path / 'x' / 'test.jsonl'}#long_caption"])
    assert list(tags.values()) == ["a", "synthetic-short", "test", "b", "a-2", "mtil:CIFAR100", "test#long_caption"]


def test_several_val_data_sets_each_tagged_by_its_name(tmp_path):
    """--val-data a manifest, a sidecar folder and an eval.py task: each set's metrics under val/<its name>/,
    none under an absolute path (it read val//<absolute path>/i2t_R@1)."""
    folder = _sidecar_folder(tmp_path)
    manifest = lab.synthetic_manifest("test", tmp_path / "data", n=8)
    _erclip(tmp_path, "v", "--val-every", "1", "--val-data", f"{manifest},{folder},synthetic-short")
    lines = [json.loads(x) for x in (tmp_path / "v" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in lines if any(k.startswith("val/") for k in r)]
    keys = set().union(*val)
    assert len(val) == 2
    for tag in (manifest.stem, "mine-test", "synthetic-short"):
        assert f"val/{tag}/i2t_R@1" in keys and f"val/{tag}/t2i_R@1" in keys, tag
    assert not [k for k in keys if "//" in k or str(tmp_path) in k]


# ----------------------------------------------------------------------------- 72.5 --grad-checkpointing
def test_grad_checkpointing_checkpoints_both_towers_and_trains_the_same(tmp_path, monkeypatch):
    """docs/training.md: the towers' blocks run under torch.utils.checkpoint (recomputed in the backward), the
    weights after two steps equal those of the run without it."""
    real, calls = open_clip.transformer.checkpoint, []
    monkeypatch.setattr(open_clip.transformer, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    _erclip(tmp_path, "plain")
    assert not calls
    _erclip(tmp_path, "ckpt", "--grad-checkpointing")
    assert len(calls) >= 2 * 2 * 2  # both towers' blocks (the tiny model: 2 + 2 or more), two steps
    a = torch.load(tmp_path / "plain" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "ckpt" / "model.pt", weights_only=True)
    assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) < 1e-5


# ----------------------------------------------------------------------------- 72.5 ERCLIP's refusals
def test_erclip_refusing_a_folder_without_long_captions_says_how_a_sidecar_supplies_one(tmp_path):
    folder = _sidecar_folder(tmp_path)
    with pytest.raises(DataError) as e:
        _erclip(tmp_path, "o", data=str(folder))
    msg = str(e.value)
    assert "missing column(s) ['long_caption']" in msg
    assert 'NAME.json beside NAME.jpg: {"caption": "...", "long_caption": "..."}' in msg and "NAME.txt" in msg
    with pytest.raises(DataError) as e:
        _erclip(tmp_path, "o2", data=f"imagefolder:{folder}")
    assert "class folders train on class-prompt captions with m2mix.py" in str(e.value)
    assert "long_caption" in str(e.value)


def test_erclip_without_its_data_names_the_files_the_images_and_the_gpu_check(tmp_path):
    with pytest.raises(RunError) as e:
        erclip.main(["--backbone", "ViT-B/16", "--epochs", "1", "--data-root", str(tmp_path), "--out",
                     str(tmp_path / "o")])
    msg = str(e.value)
    assert "captions_train2017.json" in msg and "share-captioner_coco_lcs_sam_1246k_1107.json" in msg
    assert "COCO's train2017 images, which go in coco/train2017/" in msg
    assert "python benchmarks/gpu_check.py" in msg and (ROOT / "benchmarks" / "gpu_check.py").is_file()
