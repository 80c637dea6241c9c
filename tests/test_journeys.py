"""Issue 42: a researcher's six journeys on data of their own, in the six layouts people keep, each as
docs/data.md's "Your own data" gives the commands, on the tiny backbone with data drawn here (the lab's
scenes written out as the user would have them):

1. an open_clip CSV (own column names, tab-separated) -> ERCLIP -> --export -> plain open_clip: same features;
2. JSONL -> m3-Mix -> m2mix.py --collect, which writes what it prints;
3. webdataset shards -> Long-CLIP at ERCLIP's budget;
4. Hugging Face save_to_disk folders -> C-CLIP on three own tasks, interrupted, --resume latest;
5. images with .txt / .json sidecars -> DNS on two own tasks (no lab set evaluated);
6. an ImageFolder -> eval.py zero-shot with CLIP_benchmark's spellings and result files.

Each ends with its results.json in the one schema (plumbing.results), strict JSON."""
import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

import cclip
from plumbing.manifests import read_manifest
import dns
import erclip
import eval as evaluation
import lab
import longclip
import m2mix
from plumbing import datafolders, models, outfolder
from commands import write_shards

datasets = pytest.importorskip("datasets")
FAST = ["--steps", "2", "--warmup", "1", "--batch-size", "8", "--workers", "0", "--device", "cpu",
        "--log-every", "1"]


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    """The lab's drawn scenes (images and captions), as the rows a user has: image path, caption, long caption."""
    root = tmp_path_factory.mktemp("scenes")
    rows = {}
    for split, n in (("train", 24), ("test", 16), ("task-photo", 16), ("task-night", 16), ("task-sketch", 16)):
        man = lab.synthetic_manifest(split, root, n=n)
        rows[split] = [dict(r, image=str(man.parent / r["image"])) for r in read_manifest(man)]
    return rows


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datafolders, "CACHE_DIR", tmp_path / "cache")


def _records(out, method):
    text = (out / "results.json").read_text()
    doc = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in {out}/results.json"))
    assert doc["method"] == method and doc["records"]
    assert all({"task", "metric", "value", "stage"} <= set(r) for r in doc["records"])
    return doc


def _hf_folder(rows, path):
    datasets.Dataset.from_dict({
        "image": [r["image"] for r in rows], "text": [r["caption"] for r in rows],
        "long_caption": [r["long_caption"] for r in rows]}).cast_column("image", datasets.Image()).save_to_disk(
        str(path))
    return path


def _sidecar_folder(rows, path):
    path.mkdir(parents=True)
    for i, r in enumerate(rows):
        shutil.copy(r["image"], path / f"{i:06d}.png")
        (path / f"{i:06d}.txt").write_text(r["caption"] + "\n")
        (path / f"{i:06d}.json").write_text(json.dumps({"long_caption": r["long_caption"]}))
    return path


def test_1_open_clip_csv_to_erclip_to_export_to_plain_open_clip(scenes, tmp_path):
    import open_clip
    csv_path = tmp_path / "mine.csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f, delimiter="\t")
        w.writerow(["path", "short", "long_caption"])
        w.writerows([r["image"], r["caption"], r["long_caption"]] for r in scenes["train"])
    out = tmp_path / "run"
    erclip.main(["--train-data", str(csv_path), "--csv-img-key", "path", "--csv-caption-key", "short",
                 "--csv-separator", "\\t", "--eval-tasks", str(csv_path), "--pretrained", "random",
                 "--export", str(tmp_path / "exported"), "--out", str(out), *FAST])
    doc = _records(out, "erclip")
    assert {r["stage"] for r in doc["records"]} == {"base", "tuned"}
    assert {"i2t_R@1", "i2t_R@10", "t2i_R@5"} <= {r["metric"] for r in doc["records"]}
    ours, _, preprocess, _ = models.load_model("tiny", str(out / "model.pt"), device="cpu")
    plain, _, plain_preprocess = open_clip.create_model_and_transforms(f"local-dir:{tmp_path / 'exported'}")
    image = preprocess(Image.open(scenes["test"][0]["image"]).convert("RGB"))[None]
    with torch.no_grad():
        gap = (ours.eval().encode_image(image) - plain.eval().encode_image(image)).abs().max().item()
    assert gap < 1e-5


def test_2_jsonl_to_m3_mix_to_collect(scenes, tmp_path):
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text("".join(json.dumps({"image": r["image"], "caption": r["caption"]}) + "\n"
                             for r in scenes["train"]))
    out = tmp_path / "m3"
    m2mix.main(["--backbone", "tiny", "--method", "m3", "--train-data", str(jsonl), "--eval-tasks", str(jsonl),
                "--precision", "fp32", "--save-every", "0", "--out", str(out), *FAST])
    assert {r["stage"] for r in _records(out, "m2mix")["records"]} == {"base", "tuned"}
    table = m2mix.main(["--collect", str(out)])
    assert "m3-Mix" in table and (out / "collect.md").read_text().strip() in table


def test_3_webdataset_shards_to_long_clip(scenes, tmp_path):
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps({"image": r["image"], "caption": r["caption"],
                                         "long_caption": r["long_caption"]}) + "\n" for r in scenes["train"]))
    pattern = write_shards.write_shards(jsonl, tmp_path / "shards", per_shard=10)
    out = tmp_path / "long"
    longclip.main(["--train-data", pattern, "--eval-tasks", str(jsonl), "--pretrained", "random", "--pca-dim",
                   "4", "--out", str(out), *FAST])
    assert {r["stage"] for r in _records(out, "longclip")["records"]} == {"base", "tuned"}


def test_4_hugging_face_folders_to_c_clip_interrupted_and_resumed(scenes, tmp_path):
    tasks = ",".join(f"{d}={_hf_folder(scenes[f'task-{d}'], tmp_path / d)}:"
                     f"{_hf_folder(scenes['test'], tmp_path / f'{d}-test')}" for d in ("photo", "night", "sketch"))
    argv = ["--backbone", "tiny", "--pretrained", "random", "--tasks", tasks, "--unseen", "", "--zero-shot", "",
            "--precision", "fp32", "--proj-hidden", "32", "--save-every", "0", "--out", str(tmp_path / "cc"), *FAST]
    assert "interrupted" in cclip.main(argv + ["--stop-after-tasks", "1"])
    cclip.main(argv + ["--resume", "latest"])
    doc = _records(tmp_path / "cc", "cclip")
    assert doc["continual"]["tasks"] == ["photo", "night", "sketch"]
    assert {r["stage"] for r in doc["records"]} == {"base", "task 1", "task 2", "task 3"}


def test_5_sidecar_folders_to_dns(scenes, tmp_path):
    spec = ",".join(f"{d}={_sidecar_folder(scenes[f'task-{d}'], tmp_path / d)}" for d in ("photo", "night"))
    out = tmp_path / "dns"
    dns.main(["--tasks", spec, "--batch-size", "8", "--epochs", "1", "--pretrained", "random", "--device", "cpu",
              "--feature-cache", str(tmp_path / "features"), "--out", str(out)])
    doc = _records(out, "dns")
    assert {r["task"] for r in doc["records"]} == {"photo", "night"}  # only the user's tasks, no lab set


def test_6_image_folder_to_eval_with_clip_benchmarks_spellings(scenes, tmp_path):
    folder = tmp_path / "pets"
    for r in scenes["test"]:
        (folder / f"colour{r['color']}").mkdir(parents=True, exist_ok=True)
        shutil.copy(r["image"], folder / f"colour{r['color']}" / Path(r["image"]).name)
    out = tmp_path / "ev"
    evaluation.main(["--model", "tiny", "--dataset", f"imagefolder:{folder}", "--output", str(out),
                     "--format", "clip_benchmark", "--cache-dir", str(tmp_path / "classifiers")], world=lab.WORLD)
    doc = _records(out, "eval")
    assert {(r["metric"], r["stage"]) for r in doc["records"]} >= {("top1", "eval")}
    [name] = [p.name for p in out.glob("*.json") if p.name not in ("results.json", outfolder.RECEIPT)]
    assert ":" not in name and json.loads((out / name).read_text())["task"] == "zeroshot_classification"


def test_the_docs_name_every_key_read_and_their_commands_parse():
    """docs/data.md names every column read, open_clip's CSV flags and each folder layout (nothing in README or
    docs named the accepted keys), and each journey's command there parses with its script's flags."""
    import shlex

    from plumbing import flags, manifests
    text = (Path(__file__).resolve().parents[1] / "docs" / "data.md").read_text()
    for key in (*manifests.IMAGE_KEYS, *manifests.CAPTION_KEYS, "long_caption", "--csv-img-key", "--csv-caption-key",
                "--csv-separator"):
        assert f"`{key}`" in text, key
    for word in ("save_to_disk", "parquet", "NAME.txt", "NAME.json", "imagefolder:DIR", "DatasetDict"):
        assert word in text, word
    block = text.split("## Your own data: six journeys")[1].split("```bash\n")[1].split("```")[0]
    commands = [shlex.split(c) for c in block.replace("\\\n", " ").splitlines() if c.startswith("python ")]
    configs = {"erclip.py": erclip.ERCLIPConfig, "m2mix.py": m2mix.M2MixConfig, "cclip.py": cclip.CClipConfig,
               "longclip.py": longclip.LongCLIPConfig, "dns.py": dns.DNSConfig}
    assert len(commands) == 7
    for _, script, *argv in commands:
        if script == "eval.py":
            evaluation.command_line().parse_args(argv)
        else:
            flags.parse_config(configs[script], argv)
