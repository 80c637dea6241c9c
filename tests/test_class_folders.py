"""Issue 72.2: class folders as training data. `--train-data imagefolder:DIR` (or a DIR in that layout) trains on
class-prompt captions (OpenAI's 80 ImageNet templates, one drawn per image per epoch), end to end on the generated
ImageNet stand-in: a class-folder fine-tune of the tiny model, then `eval.py --tasks imagenet-shifts --wise-ft`
over its model.pt, as docs/protocols.md walks it."""
import json

import pytest
import torch
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES

from plumbing.base import DataError
from plumbing.flags import parse_config
import eval as evaluation
import lab
import m2mix
from lab import protocol_data
from plumbing import models, outfolder
from protocols import class_folders

TRAIN = ["--backbone", "tiny", "--method", "ft", "--steps", "4", "--batch-size", "4", "--warmup", "0", "--lr",
         "1e-3", "--workers", "0", "--device", "cpu"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return protocol_data.write_imagenet_shifts(tmp_path_factory.mktemp("stand-in"))


def test_the_manifest_holds_every_template_of_each_images_class(root, tmp_path):
    """One row per image: label = its sorted-folder index, captions = the 80 templates filled with OpenAI's name of
    that ImageNet class (1,000 wnid folders); a classnames.txt names them otherwise."""
    manifest = class_folders.training_manifest(f"imagefolder:{root / 'imagenet' / 'train'}", cache=tmp_path)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert sorted({r["label"] for r in rows}) == [1, 6, 11, 13] and len(rows) == 8
    for r in rows:
        name = IMAGENET_CLASSNAMES[r["label"]]
        assert r["captions"] == [t(name) for t in OPENAI_IMAGENET_TEMPLATES] and len(r["captions"]) == 80
        assert f"/n{r['label']:08d}/" in r["image"]
    own = tmp_path / "own"
    for c in ("cat_big", "dog"):
        (own / c).mkdir(parents=True)
        (own / c / "0.png").write_bytes((root / "imagenet" / "train" / "n00000001" / "n00000001_0.JPEG").read_bytes())
    assert class_folders.class_names(own, ["cat_big", "dog"])[0] == ["cat big", "dog"]
    (own / "classnames.txt").write_text("tabby cat\nhound\n")
    rows = [json.loads(line) for line in class_folders.training_manifest(own, cache=tmp_path).read_text().splitlines()]
    assert [r["captions"][0] for r in rows] == ["a bad photo of a tabby cat.", "a bad photo of a hound."]


@pytest.mark.slow
def test_a_class_folder_fine_tune_then_the_wise_ft_curve_over_the_shifts(root, tmp_path, monkeypatch, capsys):
    """End to end: m2mix.py --method ft (plain CLIP fine-tuning) on imagenet/train as class folders, then the
    WiSE-FT curve over ImageNet and its five shifts from its model.pt (one template, to fit the suite's time)."""
    out = tmp_path / "ft"
    m2mix.main([*TRAIN, "--train-data", f"imagefolder:{root / 'imagenet' / 'train'}", "--out", str(out)])
    err = capsys.readouterr().err
    assert "class folders (1000 classes, names: ImageNet's wnids" in err and "80 ImageNet templates" in err
    tuned = torch.load(out / "model.pt", weights_only=True)
    start = models.load_model("tiny", "", world=lab.WORLD)[0].state_dict()
    assert max((tuned[k].float() - start[k].float()).abs().max().item() for k in start) > 1e-4  # it trained
    monkeypatch.setattr(evaluation, "imagenet_templates", lambda: ["a photo of a {}."])
    evaluation.main(["--backbone", "tiny", "--tasks", "imagenet-shifts", "--data-root", str(root), "--wise-ft",
                     str(out / "model.pt"), "--alphas", "0,0.5,1", "--out", str(tmp_path / "w"), "--cache-dir", ""],
                    world=lab.WORLD)
    res = json.loads((tmp_path / "w" / "results.json").read_text())
    assert [p["alpha"] for p in res["robustness"]] == [0, 0.5, 1]
    assert all("effective robustness" in p for p in res["robustness"]) and res["er_line"]["slope"] == 1
    assert (tmp_path / "w" / "wise-ft-robustness.png").stat().st_size > 5000
    # the same folder named without the prefix: the same manifest, the same seeded template draws, the same model
    again = tmp_path / "ft2"
    m2mix.main([*TRAIN, "--train-data", str(root / "imagenet" / "train"), "--out", str(again)])
    second = torch.load(again / "model.pt", weights_only=True)
    assert all(torch.equal(second[k], tuned[k]) for k in tuned)


def test_a_missing_class_folder_is_blamed_on_train_data_before_torch(tmp_path):
    """It answered "manifest not found" (wrong blame): now the folder, the layout and where the docs walk it."""
    cfg = parse_config(m2mix.M2MixConfig, ["--train-data", f"imagefolder:{tmp_path / 'nope'}", "--out",
                                                  str(tmp_path / "o")])
    problem = outfolder.early_problem(cfg)
    assert "manifest" not in str(problem)
    assert str(problem) == (f"--train-data imagefolder:{tmp_path / 'nope'}: {tmp_path / 'nope'} is not a folder; "
                            f"class folders are DIR/<class>/<image> (docs/protocols.md, 'Fine-tuning on class "
                            f"folders')")
    (tmp_path / "empty" / "a").mkdir(parents=True)
    with pytest.raises(DataError, match=r"--train-data imagefolder:.*: no images in class folders under"):
        class_folders.training_manifest(f"imagefolder:{tmp_path / 'empty'}", cache=tmp_path)
