"""Issue 27, the way in and out: exported models load in plain open_clip and
in transformers with our features, the README's loading snippet runs,
CLIP_benchmark's result files, open_clip's flag spellings, tower locking,
tensorboard and validation during training that leaves the run unchanged."""
import json
import re
import shutil
from pathlib import Path

import open_clip
import pytest
import torch

import common
from plumbing.base import UsageError
from plumbing.cli import cli
from plumbing.flags import Config
import eval as evaluation
from plumbing import models
from commands import export
from plumbing import flags
import lab

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _lean(tmp_path):
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)


def _inputs(model, n=3):
    image = torch.randn(n, 3, lab.IMAGE_SIZE, lab.IMAGE_SIZE, generator=torch.Generator().manual_seed(1))
    return image, ["a red circle on the left", "Two BLUE squares.", "a small green triangle at the top"][:n]


def _gap(a, b, image, tokens_a, tokens_b=None):
    with torch.no_grad():
        return max((a.encode_image(image) - b.encode_image(image)).abs().max().item(),
                   (a.encode_text(tokens_a)
                    - b.encode_text(tokens_a if tokens_b is None else tokens_b)).abs().max().item())


@pytest.fixture
def trained(tmp_path):
    """A tiny model with QuickGELU (as OpenAI-initialised runs) and a stretched text window (as Long-CLIP's),
    saved as a run saves it: the two settings a bare state_dict loses."""
    models.register_tiny(lab.TINY_CFG)
    torch.manual_seed(0)
    model = open_clip.create_model_and_transforms(models.TINY_NAME, pretrained=None, force_quick_gelu=True,
                                                  force_context_length=40)[0].eval()
    model.quick_gelu = True
    return model, models.save_model(model, tmp_path / "run" / "model.pt", "tiny")


def test_the_exported_hub_folder_loads_in_plain_open_clip_with_our_features(trained, tmp_path):
    model, path = trained
    ours, _, _, tok = models.load_model("tiny", str(path))
    folder = models.export_open_clip(model, tmp_path / "hub", "tiny")
    theirs, _ = open_clip.create_model_from_pretrained(f"local-dir:{folder}")
    image, captions = _inputs(model)
    assert open_clip.get_tokenizer(f"local-dir:{folder}").context_length == 40
    assert _gap(ours.eval(), theirs.eval(), image, tok(captions)) <= 1e-5
    bare = open_clip.create_model_and_transforms(models.TINY_NAME, pretrained=str(path))[0].eval()  # the traps
    assert bare.context_length == 24 and _gap(ours, bare, image, tok(captions), tok(captions)[:, :24]) > 1e-3
    safe = open_clip.create_model_and_transforms(models.TINY_NAME, pretrained=str(path.with_suffix(".safetensors")),
                                                 force_quick_gelu=True, force_context_length=40)[0].eval()
    assert _gap(ours, safe, image, tok(captions)) <= 1e-5  # model.safetensors, the sidecar's two settings


def test_the_readmes_loading_snippet_runs_and_gives_our_features(trained, tmp_path, monkeypatch):
    model, path = trained
    text = (REPO / "README.md").read_text()
    snippet = re.search(r"<!-- loading-snippet.*?-->\n```python\n(.*?)```", text, re.S).group(1)
    models.export_open_clip(model, tmp_path / "exported" / "erclip-b16", "tiny")
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(snippet, scope)  # the README's own code, on the tiny model
    ours, _, _, tok = models.load_model("tiny", str(path))
    with torch.no_grad():
        want = ours.eval().encode_text(tok(["a red circle on the left"]), normalize=True)
    assert (scope["text"] - want).abs().max().item() <= 1e-5


def test_the_transformers_export_gives_our_features_and_tokens(trained, tmp_path):
    transformers = pytest.importorskip("transformers")  # in requirements.txt: skipped only outside them
    model, path = trained
    ours, _, _, tok = models.load_model("tiny", str(path))
    folder = export.main(["--backbone", "tiny", "--pretrained", str(path), "--out", str(tmp_path / "hf"),
                          "--format", "transformers"])
    hf = transformers.CLIPModel.from_pretrained(str(folder)).eval()
    config = json.loads((folder / "config.json").read_text())
    assert (config["text_config"]["max_position_embeddings"] == 40
            and config["text_config"]["hidden_act"] == "quick_gelu")
    image, captions = _inputs(model)
    ids = transformers.CLIPTokenizer.from_pretrained(str(folder))(captions, padding="max_length", max_length=40,
                                                                   truncation=True, return_tensors="pt").input_ids
    mine = tok(captions)
    assert all(torch.equal(a[: int(m.argmax()) + 1], m[: int(m.argmax()) + 1]) for a, m in zip(ids, mine))
    with torch.no_grad():
        assert (ours.encode_image(image)
                - export.hf_features(hf.get_image_features(pixel_values=image))).abs().max() <= 1e-5
        assert (ours.encode_text(mine) - export.hf_features(hf.get_text_features(input_ids=ids))).abs().max() <= 1e-5


def test_a_training_run_exports_when_asked(tmp_path):
    data = lab.synthetic_manifest("train", tmp_path / "data", n=16)
    model, train_tf, _, tok = models.load_model("tiny", "random")
    cfg = Config(steps=2, batch_size=8, workers=0, precision="fp32", out=str(tmp_path / "run"), log_every=1,
                        device="cpu", export=str(tmp_path / "hub"))
    summary = common.train(cfg, lab.ClipFineTune(model), common.ManifestDataset(data, train_tf), common.Collate(tok))
    assert summary["export"] == str(tmp_path / "hub") and (tmp_path / "hub" / "open_clip_model.safetensors").is_file()
    assert ((tmp_path / "run" / "model.safetensors").is_file()
            and (tmp_path / "run" / "model.safetensors.json").is_file())


# ----------------------------------------------------------------------------- CLIP_benchmark's files
def test_clip_benchmark_files_map_directions_and_use_fractions():
    records = [{"task": "coco-karpathy", "metric": m, "value": v, "text_mode": "truncate"}
               for m, v in (("i2t_R@1", 50.0), ("t2i_R@1", 30.0), ("i2t_R@5", 80.0), ("t2i_R@5", 60.0))]
    records += [{"task": "cifar10", "metric": m, "value": v, "text_mode": "prompt-ensemble"}
                for m, v in (("top1", 90.0), ("top5", 99.0), ("mean_per_class_recall", 89.0))]
    files = evaluation.clip_benchmark_files(records, "ViT-B-16", "openai")
    ret = files["mscoco_captions_openai_ViT-B-16_en_zeroshot_retrieval.json"]
    assert set(ret) == {"dataset", "model", "pretrained", "task", "metrics", "language"}
    assert ret["metrics"] == {"image_retrieval_recall@1": 0.3, "image_retrieval_recall@5": 0.6,  # text -> image
                              "text_retrieval_recall@1": 0.5, "text_retrieval_recall@5": 0.8}  # image -> text
    cls = files["cifar10_openai_ViT-B-16_en_zeroshot_classification.json"]
    assert cls["metrics"] == pytest.approx({"acc1": 0.9, "acc5": 0.99, "mean_per_class_recall": 0.89})


def test_mean_per_class_recall_is_balanced_accuracy():
    img = torch.eye(3)[[0, 0, 0, 1, 2]]  # class 0 has three images, all right; class 1 one, wrong; class 2 right
    clf = torch.eye(3)[:, [0, 2, 2]]  # class 1's text is class 2's: its image scores a tie, counted against it
    labels = torch.tensor([0, 0, 0, 1, 2])
    assert evaluation.mean_per_class_recall(img, clf, labels) == pytest.approx(100 * (1 + 0 + 0) / 3)


def test_eval_py_writes_clip_benchmark_files(tmp_path):
    test = lab.synthetic_manifest("test", tmp_path / "data", n=12)
    evaluation.main(["--pretrained", "random", "--tasks", str(test), "--data-root", str(tmp_path / "data"),
                     "--out", str(tmp_path / "e"), "--format", "clip_benchmark", "--device", "cpu"])
    (name,) = [p.name for p in (tmp_path / "e").glob("*_zeroshot_retrieval.json")]
    saved = json.loads((tmp_path / "e" / name).read_text())
    assert saved["dataset"] == Path(test).stem and 0 <= saved["metrics"]["image_retrieval_recall@5"] <= 1


# ----------------------------------------------------------------------------- open_clip's flag spellings
def test_open_clip_precision_and_clip_names_are_accepted(capsys):
    cfg = flags.parse_config(flags.Config, ["--precision", "amp", "--grad-clip-norm", "1.5"])
    assert cfg.precision == "fp16" and cfg.grad_clip == 1.5
    assert flags.parse_config(flags.Config, ["--precision", "amp_bf16"]).precision == "bf16"
    with pytest.raises(SystemExit):
        flags.parse_config(flags.Config, ["--precision", "pure_fp16"])
    assert "--precision fp16 is autocast over fp32 weights with grad scaling" in capsys.readouterr().err


def test_batch_size_per_gpu_is_made_global(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert flags.parse_config(flags.Config, ["--batch-size-per-gpu", "16"]).batch_size == 64
    with pytest.raises(SystemExit):
        flags.parse_config(flags.Config, ["--batch-size-per-gpu", "16", "--batch-size", "8"])
    assert "not both" in capsys.readouterr().err


@pytest.mark.parametrize("flag, frozen, trained_prefix", [
    (["--lock-text"], "transformer.", "visual."), (["--lock-image"], "visual.", "transformer."),
    (["--lock-text", "--lock-text-unlocked-layers", "2"], "transformer.resblocks.0.", "transformer.resblocks.3.")])
def test_locked_towers_do_not_move_and_leave_adamw(tmp_path, flag, frozen, trained_prefix):
    data = lab.synthetic_manifest("train", tmp_path / "data", n=16)
    torch.manual_seed(0)
    model, train_tf, _, tok = models.load_model("tiny", "random")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = flags.parse_config(flags.Config, flag + ["--steps", "2", "--batch-size", "8", "--lr", "1e-3", "--workers",
                                                   "0", "--precision", "fp32", "--out", str(tmp_path / "r"),
                                                   "--device", "cpu", "--save-every", "0"])
    common.train(cfg, lab.ClipFineTune(model), common.ManifestDataset(data, train_tf), common.Collate(tok),
                 export=False)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith(frozen))
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith(trained_prefix))
    state = torch.load(tmp_path / "r" / "checkpoints" / "last.pt", weights_only=True)["optimizer"]
    n_trainable = sum(p.requires_grad for p in model.parameters())
    assert sum(len(g["params"]) for g in state["param_groups"]) == n_trainable < len(list(model.parameters()))


def test_locking_a_dns_run_is_one_message():
    class Maps(torch.nn.Module):  # DNS's net: maps over frozen features, no CLIP tower
        model = torch.nn.Linear(2, 2)
    with pytest.raises(UsageError, match="nothing to lock"):
        common.lock_towers(Config(lock_text=True), Maps().model)


# ----------------------------------------------------------------------------- logging and validation
def _erclip(tmp_path, out, *extra):
    import erclip
    root = tmp_path / "data"
    lab.synthetic_manifest("train", root, n=16)
    val = lab.synthetic_manifest("test", root, n=12)
    return erclip.main(["--data-root", str(root), "--train-data", "synthetic", "--train-pairs", "16",
                        "--batch-size", "8", "--steps", "4", "--warmup", "1", "--lr", "1e-4", "--workers", "0",
                        "--log-every", "1", "--device", "cpu", "--eval-tasks", "none", "--pretrained", "random",
                        "--val-data", str(val), "--out", str(tmp_path / out), *extra])


def test_val_every_logs_and_records_and_leaves_the_weights_identical(tmp_path):
    _erclip(tmp_path, "plain")
    result = _erclip(tmp_path, "val", "--val-every", "2")
    lines = [json.loads(x) for x in (tmp_path / "val" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in lines if any(k.startswith("val/") for k in r)]
    key = f"val/{Path(lab.synthetic_manifest('test', tmp_path / 'data', n=12)).stem}/t2i_R@1"  # the manifest's name
    assert [r["step"] for r in val] == [2, 4] and all(key in r for r in val)
    assert result["summary"]["validation"] == val
    assert json.loads((tmp_path / "val" / "results.json").read_text())["summary"]["validation"] == val
    a = torch.load(tmp_path / "plain" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "val" / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)  # no effect on the training's randomness or modes


def test_report_to_tensorboard_writes_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")  # in requirements.txt: skipped only outside them
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    _erclip(tmp_path, "tb", "--report-to", "tensorboard", "--val-every", "4")
    events = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    key = f"val/{Path(lab.synthetic_manifest('test', tmp_path / 'data', n=12)).stem}/t2i_R@1"
    assert "train/loss" in tags and key in tags and len(events.Scalars("train/loss")) == 4


def test_report_to_tensorboard_without_the_package_is_one_message(tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(UsageError, match="pip install tensorboard"):
        _erclip(tmp_path, "tb", "--report-to", "tensorboard")


def test_val_every_in_m2mix_and_longclip_and_refused_for_a_task_sequence(tmp_path):
    import longclip
    import m2mix
    root = tmp_path / "data"
    lab.synthetic_manifest("train", root, n=16)
    val = str(lab.synthetic_manifest("test", root, n=12))
    common_argv = ["--backbone", "tiny", "--data-root", str(root), "--train-data", "synthetic", "--batch-size", "8",
                   "--steps", "2", "--workers", "0", "--device", "cpu", "--pretrained", "random", "--val-every", "1",
                   "--val-data", val]
    m2 = m2mix.main(common_argv + ["--no-eval-base", "--eval-tasks", "none", "--out", str(tmp_path / "m2")])
    assert [r["step"] for r in m2["summary"]["validation"]] == [1, 2]
    lc = longclip.main(common_argv + ["--train-pairs", "16", "--pca-dim", "4", "--eval-tasks", "none",
                                      "--out", str(tmp_path / "lc")])
    assert [r["step"] for r in lc["summary"]["validation"]] == [1, 2]  # through the stretched window
    with pytest.raises(UsageError, match="a task sequence has no validation set"):
        common.preflight(Config(val_every=1, out=str(tmp_path / "seq")), continual=True)


def test_cclip_exports_its_merged_model_and_dns_refuses_export(tmp_path, capsys):
    import cclip
    import dns
    from test_cclip import _argv  # its small two-task synthetic sequence
    cclip.main(_argv(tmp_path / "data", tmp_path / "cc", "--export", str(tmp_path / "hub")))
    theirs, _ = open_clip.create_model_from_pretrained(f"local-dir:{tmp_path / 'hub'}")
    ours = torch.load(tmp_path / "cc" / "model.pt", weights_only=True)
    assert all(torch.equal(v, ours[k]) for k, v in theirs.state_dict().items() if k in ours)
    with pytest.raises(SystemExit) as e:
        cli(dns.main, ["--export", str(tmp_path / "x"), "--out", str(tmp_path / "d")])
    assert e.value.code == 2 and "writes no CLIP model" in capsys.readouterr().err


def test_clip_benchmark_file_names_are_safe_and_unique_per_task_path():
    """Issue 42.3: a name held ':' (imagefolder:_tmp_...json) and two test sets named test.jsonl in different
    folders wrote one file; CLIP_benchmark's own datasets keep their names."""
    records = [{"task": t, "metric": "top1", "value": 50.0, "text_mode": "prompt-ensemble"}
               for t in ("imagefolder:/data/a b/pets", "cifar10")]
    records += [{"task": t, "metric": m, "value": 10.0, "text_mode": "truncate"}
                for t in ("/data/one/test.jsonl", "/data/two/test.jsonl") for m in ("i2t_R@1", "t2i_R@1")]
    names = list(evaluation.clip_benchmark_files(records, "ViT-B-16", "openai"))
    assert len(names) == 4 and "cifar10_openai_ViT-B-16_en_zeroshot_classification.json" in names
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names)
    assert len({n for n in names if n.startswith("test-")}) == 2
