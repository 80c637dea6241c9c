"""Issue 72.3 and 69.3: WiSE-FT's curve kept alpha by alpha (a stop keeps the finished alphas, --resume skips them
and refuses other settings), its progress line, effective robustness against a declared line, and one message for
each checkpoint --wise-ft cannot interpolate (another backbone's, a LoRA run's checkpoints/last.pt, lying
safetensors headers; a SigLIP run's logit_bias is left out with one line). docs/reliability.md maps each case."""
import json
import math
import struct

import pytest
import torch

from plumbing.base import UsageError
import erclip
import eval as ev
import lab
from plumbing import cli, models, runfolder
from protocols import wise_ft

TASK = ["--backbone", "tiny", "--tasks", "synthetic-short", "--synthetic-n", "16", "--device", "cpu",
        "--cache-dir", ""]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """TASK's default --data-root ('data') resolves inside the test's folder, not the checkout."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three two-step ERCLIP runs on the tiny backbone: plain, --loss siglip (a logit_bias), --lora 2."""
    tmp = tmp_path_factory.mktemp("runs")
    root = tmp / "data"
    lab.synthetic_manifest("train", root, n=16)
    base = ["--data-root", str(root), "--train-data", "synthetic", "--train-pairs", "16", "--batch-size", "8",
            "--steps", "2", "--warmup", "0", "--lr", "1e-2", "--workers", "0", "--device", "cpu",
            "--eval-tasks", "none"]
    for name, extra in (("plain", []), ("siglip", ["--loss", "siglip"]), ("lora", ["--lora", "2"])):
        erclip.main([*base, *extra, "--out", str(tmp / name)])
    return tmp


def _cli(capsys, argv):
    """eval.py through the command line's wrapper: (exit code or 0, stderr)."""
    try:
        cli.cli(lambda args: ev.main(args, world=lab.WORLD), argv)
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


# ----------------------------------------------------------------------------- kept alpha by alpha
def test_a_stopped_curve_keeps_its_finished_alphas_and_resume_skips_them(runs, tmp_path, capsys, monkeypatch):
    """A stop during the second alpha: exit 130, alpha-0.json on disk and the message naming it with the command
    that goes on (--resume); that command evaluates only the two alphas left, and its curve equals a run never
    stopped, number for number."""
    out, argv = tmp_path / "w", [*TASK, "--wise-ft", str(runs / "plain" / "model.pt"), "--alphas", "0,0.5,1"]
    real, calls = ev.evaluate, []

    def stopping(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kw)
    monkeypatch.setattr(ev, "evaluate", stopping)
    code, err = _cli(capsys, [*argv, "--out", str(out)])
    assert code == 130 and err.count("error:") == 1 and "Traceback" not in err
    assert "before training saved anything" not in err
    assert f"kept in {out / 'wise-ft'}: alpha-0.json" in err and err.rstrip().endswith("--resume"), err
    assert sorted(p.name for p in (out / "wise-ft").iterdir()) == ["alpha-0.json"]
    kept = json.loads((out / "wise-ft" / "alpha-0.json").read_text())
    calls.clear()
    monkeypatch.setattr(ev, "evaluate", lambda *a, **k: calls.append(1) or real(*a, **k))
    resumed = ev.main([*argv, "--out", str(out), "--resume"], world=lab.WORLD)
    assert len(calls) == 2  # alpha 0 kept, 0.5 and 1 evaluated
    assert [r for r in resumed if r["alpha"] == 0] == [dict(r, stage="alpha 0", alpha=0.0) for r in kept["records"]]
    fresh = ev.main([*argv, "--out", str(tmp_path / "fresh")], world=lab.WORLD)
    strip = [{k: v for k, v in r.items() if k != "seconds"} for r in resumed]
    assert strip == [{k: v for k, v in r.items() if k != "seconds"} for r in fresh]
    assert sorted(p.name for p in (out / "wise-ft").iterdir()) == ["alpha-0.5.json", "alpha-0.json", "alpha-1.json"]


def test_resume_refuses_alphas_of_other_settings_before_any_model(runs, tmp_path, monkeypatch):
    out, argv = tmp_path / "w", [*TASK, "--wise-ft", str(runs / "plain" / "model.pt"), "--alphas", "0,1"]
    ev.main([*argv, "--out", str(out)], world=lab.WORLD)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(UsageError) as e:
        ev.main([*argv, "--out", str(out), "--resume", "--text-mode", "sentence-mean"], world=lab.WORLD)
    msg = str(e.value)
    assert "--resume:" in msg and "differing: text_mode" in msg and "was truncate, now sentence-mean" in msg
    assert "rerun without --resume" in msg and "choose another --out" in msg
    with pytest.raises(UsageError, match="--resume belongs to a WiSE-FT curve: add --wise-ft"):
        ev.main([*TASK, "--out", str(out), "--resume"], world=lab.WORLD)


def test_the_progress_line_counts_alphas_and_estimates_the_time_left(runs, tmp_path, capsys):
    ev.main([*TASK, "--wise-ft", str(runs / "plain" / "model.pt"), "--alphas", "0,0.5,1", "--out",
             str(tmp_path / "w")], world=lab.WORLD)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[wise-ft] alpha")]
    assert lines[0].startswith("[wise-ft] alpha 0 (1/3): evaluating; elapsed 0m0")
    assert lines[0].endswith("time left known after the first alpha")
    assert lines[1].startswith("[wise-ft] alpha 0.5 (2/3): evaluating; elapsed ") and lines[1].endswith(" left")
    assert "about " in lines[2] and lines[2].startswith("[wise-ft] alpha 1 (3/3)")


# ----------------------------------------------------------------------------- effective robustness
def test_effective_robustness_by_hand():
    """Taori et al.'s rho = shift avg - beta(ImageNet), beta a line in logit space. Default (ours): slope 1
    through alpha 0 (50 %, 40 %): intercept logit(0.4) - logit(0.5) = ln(2/3); at ImageNet 80 %: logit = ln 4 +
    ln(2/3) = ln(8/3), beta = 8/11 = 72.73 %, so rho(alpha 1) = 50 - 72.73 = -22.73. A given line (1, 0) is
    y = x: rho = shift avg - ImageNet."""
    points = [{"alpha": 0.0, "imagenet": 50.0, "avg shifts": 40.0}, {"alpha": 1.0, "imagenet": 80.0,
                                                                    "avg shifts": 50.0}]
    line = wise_ft.er_line(points)
    assert line["slope"] == 1.0 and line["intercept"] == pytest.approx(math.log(2 / 3))
    assert line["source"].startswith("ours: slope 1 in logit space through the alpha 0")
    er = [p["effective robustness"] for p in wise_ft.effective_robustness(points, line)]
    assert er[0] == pytest.approx(0, abs=1e-9) and er[1] == pytest.approx(50 - 800 / 11)
    given = wise_ft.er_line(points, (1.0, 0.0))
    assert given["source"] == "--er-line (given)"
    assert [p["effective robustness"] for p in wise_ft.effective_robustness(points, given)] == pytest.approx(
        [-10.0, -30.0])
    assert wise_ft.er_line(points[1:]) == {}  # no alpha 0, no line given: no number claimed


# ----------------------------------------------------------------------------- 69.3: what --wise-ft cannot take
def _lie(src, dst, how):
    """A copy of the safetensors file `src` whose header lies: its length, a tensor's offsets or its shape."""
    raw = src.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    key = next(k for k in header if k != "__metadata__")
    if how == "length":
        dst.write_bytes(struct.pack("<Q", 10 ** 12) + raw[8:])
        return dst
    header[key] = dict(header[key], **({"data_offsets": [0, 10 ** 9]} if how == "offsets" else
                                       {"shape": [9999, 9999]}))
    text = json.dumps(header).encode()
    dst.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return dst


def _refused_before_the_model(monkeypatch, tmp_path, wise, *extra):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(UsageError) as e:
        ev.main([*TASK, "--wise-ft", str(wise), "--out", str(tmp_path / "w"), *extra], world=lab.WORLD)
    return str(e.value)


def test_another_backbones_checkpoint_is_one_message_before_the_model(runs, tmp_path, monkeypatch):
    sd = torch.load(runs / "plain" / "model.pt", weights_only=True)
    models.save_model(models.load_model("tiny", "random")[0], tmp_path / "tiny.pt", "tiny", twin=False)
    meta = json.loads((tmp_path / "tiny.pt.json").read_text())
    torch.save(sd, tmp_path / "b16.pt")
    (tmp_path / "b16.pt.json").write_text(json.dumps({**meta, "model": "ViT-B-16", "backbone": "ViT-B/16"}))
    msg = _refused_before_the_model(monkeypatch, tmp_path, tmp_path / "b16.pt")
    assert msg.startswith(f"--wise-ft {tmp_path / 'b16.pt'}: fine-tuned from backbone ViT-B/16 (its sidecar")
    assert "but --backbone is tiny" in msg and "pass --backbone ViT-B/16" in msg


def test_another_architecture_without_a_sidecar_is_one_message(runs, tmp_path, monkeypatch):
    sd = torch.load(runs / "plain" / "model.pt", weights_only=True)
    wide = {k: torch.zeros(*[2 * s for s in v.shape]) if k.startswith("visual.") and v.dim() else v
            for k, v in sd.items()}
    torch.save(wide, tmp_path / "wide.pt")
    with pytest.raises(UsageError) as e:
        ev.main([*TASK, "--wise-ft", str(tmp_path / "wide.pt"), "--out", str(tmp_path / "w")], world=lab.WORLD)
    msg = str(e.value)
    assert msg.startswith(f"--wise-ft {tmp_path / 'wide.pt'}: not weights of --backbone's architecture")
    assert "tensors of another shape (e.g. visual." in msg and "pass the --backbone it was trained with" in msg
    assert not (tmp_path / "w" / "wise-ft").exists()


def test_a_lora_runs_training_checkpoint_is_one_message_naming_its_model_pt(runs, tmp_path, monkeypatch):
    last = runs / "lora" / "checkpoints" / "last.pt"
    msg = _refused_before_the_model(monkeypatch, tmp_path, last)
    assert msg.startswith(f"--wise-ft {last}: a LoRA run's training checkpoint")
    assert f"that run's {runs / 'lora' / 'model.pt'} holds them merged: pass it" in msg
    msg = _refused_before_the_model(monkeypatch, tmp_path, runs / "plain" / "model.pt", "--wise-base", str(last))
    assert msg.startswith(f"--wise-base {last}: a LoRA run's training checkpoint")


@pytest.mark.parametrize("how", ["length", "offsets", "shape"])
def test_a_lying_safetensors_header_is_one_message_before_the_model(runs, tmp_path, monkeypatch, how):
    bad = _lie(runs / "plain" / "model.safetensors", tmp_path / f"{how}.safetensors", how)
    msg = _refused_before_the_model(monkeypatch, tmp_path, bad)
    assert msg.startswith(f"--wise-ft {bad}: not a readable model file (") and "pass another --wise-ft" in msg


def test_a_siglip_runs_logit_bias_is_left_out_with_one_line(runs, tmp_path, capsys):
    """The SigLIP run's bias is a constant on every logit: its curve equals that of the same weights without it."""
    got = ev.main([*TASK, "--wise-ft", str(runs / "siglip" / "model.pt"), "--alphas", "0.5", "--out",
                   str(tmp_path / "a")], world=lab.WORLD)
    err = capsys.readouterr().err
    assert err.count("SigLIP's logit_bias left out (the model has none)") == 1
    sd = torch.load(runs / "siglip" / "model.pt", weights_only=True)
    assert "logit_bias" in sd
    torch.save({k: v for k, v in sd.items() if k != "logit_bias"}, tmp_path / "nobias.pt")
    want = ev.main([*TASK, "--wise-ft", str(tmp_path / "nobias.pt"), "--alphas", "0.5", "--out",
                    str(tmp_path / "b")], world=lab.WORLD)
    assert [r["value"] for r in got] == [r["value"] for r in want]


def test_the_interrupt_message_of_an_evaluation_never_blames_training(tmp_path):
    """Issue 72.3: an eval run stopped before anything is kept says so, and nothing about training."""
    runfolder.EVALUATING = tmp_path
    msg, code = cli.interrupted_message(2)
    assert code == 130 and "during the evaluation" in msg and "training" not in msg
