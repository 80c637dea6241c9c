"""ImageNet's five distribution shifts (issue 61): the readers on a fixture in the releases' layouts
(lab/protocol_data.py), WiSE-FT's logit masks and ObjectNet's projection against an independent re-implementation
of its code (max abs diff), one message for missing data, and `eval.py --tasks imagenet-shifts --wise-ft` writing
the curve and the effective-robustness figure."""
import json
import shlex

import numpy as np
import pytest
import torch
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

from plumbing.base import DataError
import eval as evaluation
import lab  # noqa: F401  the tiny backbone, registered
from lab import __main__ as lab_main
from lab import protocol_data
from plumbing import models
from protocols import imagenet_shifts, wise_ft


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return protocol_data.write_imagenet_shifts(tmp_path_factory.mktemp("shifts"))


def test_the_readers_label_each_layout_as_wise_ft_does(root):
    """v2: the folder's number; -r / -a / sketch: the sorted folder index, into their class subsets; ObjectNet: its
    113 classes in sorted-folder order (folders outside the map left out), the head over ImageNet's 1,000."""
    v2 = imagenet_shifts.read("imagenet-v2", root, IMAGENET_CLASSNAMES)
    assert sorted(set(v2["labels"].tolist())) == [1, 6, 11, 13] and v2["classnames"] == list(IMAGENET_CLASSNAMES)
    for name in ("imagenet-r", "imagenet-a"):
        s = imagenet_shifts.read(name, root, IMAGENET_CLASSNAMES)
        sub = imagenet_shifts.SUBSETS[name]
        assert len(sub) == 200 and sub == sorted(sub) and len(s["classnames"]) == 200
        truth = [sub.index(k) for k in (1, 6, 11, 13) if k in sub]  # the fixture's images, per ImageNet class
        assert sorted(set(s["labels"].tolist())) == truth
        assert [s["classnames"][k] for k in truth] == [IMAGENET_CLASSNAMES[sub[k]] for k in truth]
    sk = imagenet_shifts.read("imagenet-sketch", root, IMAGENET_CLASSNAMES)
    assert sorted(set(sk["labels"].tolist())) == [1, 6, 11, 13]
    on = imagenet_shifts.read("objectnet", root, IMAGENET_CLASSNAMES)
    assert len(on["groups"]) == 113 and len(on["classnames"]) == 1000 and len(on["images"]) == len(on["labels"])
    assert sum(map(len, on["groups"])) == 125 and "not_in_imagenet" not in str(on["images"].paths)
    assert on["images"][0].size == (28, 28)  # WiSE-FT's 2-pixel crop of the 32 x 32 fixture image
    folders = [f for f, _, _ in imagenet_shifts.OBJECTNET]
    assert folders == sorted(folders)


def _wise_ft_project(logits, groups):
    """WiSE-FT's ObjectNetBase.project_logits, written again from reading it: a numpy loop over its
    rev_class_idx_map (class k -> its ImageNet indices), logits_projected[:, k] = max over them."""
    logits = logits.numpy()
    out = np.zeros((logits.shape[0], len(groups)))
    for k, v in enumerate(groups):
        out[:, k] = np.max(logits[:, v], axis=1).squeeze()
    return torch.tensor(out)


def test_masks_and_objectnets_projection_match_wise_ft():
    """ImageNet-R / -A: WiSE-FT's logits[:, mask] give the same scores as a head over the 200 class names alone
    (so the reader keeps those); ObjectNet: project_logits equals WiSE-FT's loop, and the accuracy follows it."""
    g = torch.Generator().manual_seed(0)
    img, W = torch.randn(64, 16, generator=g), torch.randn(16, 1000, generator=g)
    logits = img @ W
    for name, sub in imagenet_shifts.SUBSETS.items():
        mask = torch.tensor([i in sub for i in range(1000)])
        assert torch.equal(logits[:, mask], img @ W[:, sub]), name  # the same rows, the same order
    groups = [ids for _, _, ids in imagenet_shifts.OBJECTNET]
    ours, theirs = imagenet_shifts.project_logits(logits, groups), _wise_ft_project(logits, groups)
    diff = (ours.double() - theirs).abs().max().item()
    assert diff < 1e-6, diff
    labels = torch.randint(0, 113, (64,), generator=g)
    acc = imagenet_shifts.grouped_accuracy(img, W, labels, groups, ks=(1,))["top1"]
    assert acc == pytest.approx(100.0 * (theirs.argmax(1) == labels).double().mean().item())


def test_missing_shifts_are_one_message_naming_each(tmp_path):
    """eval.py's pre-check names every set of --tasks imagenet-shifts that cannot be loaded, in one message."""
    (tmp_path / "imagenet-r").mkdir()
    with pytest.raises(DataError) as e:
        evaluation.check_tasks(evaluation._expand("imagenet-shifts"), tmp_path, "--tasks")
    msg = str(e.value)
    assert msg.count("cannot be loaded") == 6 and msg.count("docs/data.md") == 6
    for s, layout in (("imagenet", "imagenet/val"), ("imagenet-v2", "imagenetv2-matched-frequency-format-val"),
                      ("imagenet-r", "holds 0 class folders, expected 200"), ("imagenet-a", "imagenet-a/<wnid>"),
                      ("imagenet-sketch", "sketch/<wnid>"), ("objectnet", "objectnet-1.0/images")):
        assert f"evaluation task {s!r}" in msg and layout in msg, s


@pytest.mark.slow
def test_eval_writes_the_wise_ft_curve_and_the_effective_robustness_figure(root, tmp_path, monkeypatch):
    """--tasks imagenet-shifts --wise-ft: per alpha ImageNet, each shift and their average; the figure; alpha 0 is
    the zero-shot model's own evaluation. One of the 80 templates, to fit the suite's time on CPU (1,000 classes)."""
    monkeypatch.setattr(evaluation, "imagenet_templates", lambda: ["a photo of a {}."])
    model = models.load_model("tiny", "", world=lab.WORLD)[0]
    g = torch.Generator().manual_seed(1)
    tuned = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
             for k, v in model.state_dict().items()}
    model.load_state_dict(tuned)
    models.save_model(model, tmp_path / "tuned.pt", "tiny", twin=False)
    out, captions = tmp_path / "w", []
    figure = wise_ft.robustness_figure
    monkeypatch.setattr(wise_ft, "robustness_figure", lambda *a, **k: captions.append(a[2]) or figure(*a, **k))
    argv = ["--backbone", "tiny", "--tasks", "imagenet-shifts", "--data-root", str(root), "--wise-ft",
            str(tmp_path / "tuned.pt"), "--alphas", "0,1", "--out", str(out), "--cache-dir", ""]
    monkeypatch.setattr("sys.argv", ["python -m lab", "eval", *argv])
    lab_main.main()  # as `python -m lab eval ...` runs it: the command named in results.json and the caption
    res = json.loads((out / "results.json").read_text())
    assert res["command"] == captions[0] == "python -m lab eval " + shlex.join(argv)
    points = res["robustness"]
    assert [p["alpha"] for p in points] == [0, 1]
    for p in points:
        assert p["avg shifts"] == pytest.approx(sum(p[s] for s in imagenet_shifts.SHIFTS) / 5)
    line = res["er_line"]  # issue 72.3: effective robustness against the declared line (ours: through alpha 0)
    assert line["slope"] == 1 and line["source"].startswith("ours: slope 1 in logit space through the alpha 0")
    assert points[0]["effective robustness"] == pytest.approx(0, abs=1e-6)
    assert points[1]["effective robustness"] == pytest.approx(max(points[1]["avg shifts"], 0.01) - wise_ft.line_at(
        line, points[1]["imagenet"]))
    assert sorted(p.name for p in (out / "wise-ft").iterdir()) == ["alpha-0.json", "alpha-1.json"]
    png = (out / "wise-ft-robustness.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    plain = evaluation.main(["--backbone", "tiny", "--tasks", "imagenet-shifts", "--data-root", str(root),
                             "--out", str(tmp_path / "plain"), "--cache-dir", ""], world=lab.WORLD)
    top1 = {r["task"]: r["value"] for r in plain if r["metric"] == "top1"}
    assert points[0]["imagenet"] == pytest.approx(top1["imagenet"])
    assert points[0]["avg shifts"] == pytest.approx(imagenet_shifts.shift_average(top1))
    assert wise_ft.robustness_points([{"alpha": 0.0, "records": plain[:1]}]) == []  # without the shifts: no curve
