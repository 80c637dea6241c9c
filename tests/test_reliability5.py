"""Issue 69 (reliability pass 5): no code runs from a data file (CIFAR's pickles read by a restricted unpickler),
a run never overwrites what it did not write, lab.protocol_data's command line, the baselines' own settings
checked at parse time. docs/reliability.md maps each case to its test."""
import json
import pickle
import shutil

import numpy as np
import pytest

import common
from plumbing.base import DataError, RunError, UnsafeFileError, UsageError
from plumbing.cli import cli
from plumbing.flags import Config
import eval as ev
from plumbing import safepickle
from protocols import mtil


@pytest.fixture(autouse=True)
def _lean(tmp_path):
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)


# ----------------------------------------------------------------------------- 1. code from a data folder
class _Payload:
    """Runs code when unpickled: writes `marker` (what a hostile data file could do)."""
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


CIFAR = {  # task -> (folder under the root, batch file, meta file, labels key, names key)
    "cifar10": ("cifar10/cifar-10-batches-py", "test_batch", "batches.meta", "labels", "label_names"),
    "cifar100": ("cifar100/cifar-100-python", "test", "meta", "fine_labels", "fine_label_names"),
}


def _write_cifar(root, task, protocol=pickle.DEFAULT_PROTOCOL, payload=None, where="meta"):
    """A CIFAR folder in torchvision's layout (4 images); payload: an object put in the meta or batch dict."""
    sub, batch_file, meta_file, labels_key, names_key = CIFAR[task]
    folder = root / sub
    folder.mkdir(parents=True, exist_ok=True)
    n = 10 if task == "cifar10" else 100
    meta = {names_key: [f"class_{k}" for k in range(n)]}
    batch = {"data": np.random.default_rng(0).integers(0, 255, (4, 3072), dtype=np.uint8),
             labels_key: [0, 3, 1, 2], "batch_label": "testing batch 1 of 1"}
    (meta if where == "meta" else batch)["extra"] = payload
    (folder / meta_file).write_bytes(pickle.dumps(meta, protocol=protocol))
    (folder / batch_file).write_bytes(pickle.dumps(batch, protocol=protocol))
    return folder / (meta_file if where == "meta" else batch_file), batch


@pytest.mark.parametrize("where", ["meta", "batch"])
@pytest.mark.parametrize("reader", ["cifar10", "cifar100", "mtil:CIFAR100"])
def test_a_cifar_pickle_that_runs_code_is_refused_naming_the_file(tmp_path, reader, where):
    marker = tmp_path / "ran.txt"
    task = reader if reader.startswith("cifar") else "cifar100"
    bad, _ = _write_cifar(tmp_path / "data", task, payload=_Payload(marker), where=where)
    with pytest.raises(DataError) as e:
        if reader.startswith("mtil:"):
            mtil.read(tmp_path / "data", "CIFAR100", "test")
        else:
            ev.load_classification(reader, tmp_path / "data")
    assert not marker.exists()  # nothing ran
    assert str(bad) in str(e.value) and "builtins.exec" in str(e.value) and "refused" in str(e.value)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_a_cifar_pickle_of_any_protocol_still_reads(tmp_path, protocol):
    """Python 2's protocol (the CIFAR files as distributed: _codecs.encode for bytes), 4 and 5 (_frombuffer)."""
    _, batch = _write_cifar(tmp_path, "cifar100", protocol=protocol)
    got = mtil.read(tmp_path, "CIFAR100", "test")
    assert list(got.labels) == [0, 3, 1, 2]
    assert np.array_equal(np.asarray(got.images[1]).transpose(2, 0, 1).reshape(-1), batch["data"][1])
    _write_cifar(tmp_path, "cifar10", protocol=protocol)
    assert ev.load_classification("cifar10", tmp_path).labels.tolist() == [0, 3, 1, 2]


def test_a_cifar_file_of_another_shape_is_one_message_naming_it(tmp_path):
    folder = tmp_path / CIFAR["cifar10"][0]
    _write_cifar(tmp_path, "cifar10")
    (folder / "test_batch").write_bytes(pickle.dumps({"data": np.zeros((4, 10), np.uint8), "labels": [0] * 4}))
    with pytest.raises(DataError, match=r"test_batch: no 'data' array of \(N, 3072\)"):
        ev.load_classification("cifar10", tmp_path)
    (folder / "test_batch").write_bytes(pickle.dumps({"data": np.zeros((4, 3072), np.uint8), "labels": [0, 9, 10, 1]}))
    with pytest.raises(DataError, match=r"test_batch: 'labels' is not 4 class indices below 10"):
        ev.load_classification("cifar10", tmp_path)
    (folder / "batches.meta").write_bytes(b"\x80\x04\x95")  # cut short
    with pytest.raises(DataError, match=r"batches.meta: not a readable pickle"):
        ev.load_classification("cifar10", tmp_path)


class _Reduce:
    """Pickles as fn(*args)."""
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def test_the_restricted_reader_refuses_one_buffer_declared_many_times(tmp_path):
    """Protocol 5 arrays are views of a buffer in the file: one 1 MiB buffer viewed by 200 arrays declares 200 MiB
    from a 1 MiB file; refused by the budget (2x the file + 64 MiB) before the CIFAR reader copies them."""
    buf = bytearray(1 << 20)
    views = [_Reduce(np._core.numeric._frombuffer, (buf, np.dtype("u1"), (1 << 20,), "C")) for _ in range(200)]
    path = tmp_path / "test"
    path.write_bytes(pickle.dumps({"data": views}, protocol=5))
    assert path.stat().st_size < 2 << 20
    with pytest.raises(DataError, match=r"test: its arrays declare 0.07 GiB from a file of 1.0 MiB"):
        safepickle.load(path)


def _cli(capsys, main, argv):
    """common.cli as a script's __main__ runs it: (exit code, stderr)."""
    with pytest.raises(SystemExit) as e:
        cli(main, argv)
    return e.value.code, capsys.readouterr().err


def test_python_m_lab_eval_on_a_hostile_mtil_cifar_is_one_message_and_runs_nothing(tmp_path, capsys):
    import lab  # noqa: F401  the tiny backbone
    marker = tmp_path / "ran.txt"
    bad, _ = _write_cifar(tmp_path / "data", "cifar100", payload=_Payload(marker))
    code, err = _cli(capsys, ev.main, ["--backbone", "tiny", "--tasks", "mtil:CIFAR100", "--device", "cpu",
                                       "--data-root", str(tmp_path / "data"), "--out", str(tmp_path / "out")])
    assert code == 1 and not marker.exists() and "Traceback" not in err
    assert err.count("error:") == 1 and f"{bad}: the pickle asks for builtins.exec" in err


def test_simats_oscar_matrix_is_read_weights_only(tmp_path):
    """The one torch.load of a data file (SIMAT's oscar_similarity_matrix.pt) goes through load_weights_only."""
    import torch
    db = tmp_path / "simat/simat_db"
    (db / "images/A dog on grass").mkdir(parents=True)
    (db / "images/A dog on grass/11.jpg").write_bytes(b"")
    (db / "triplets.csv").write_text("region_id,subj,rel,obj\n11,dog,on,grass\n")
    (db / "transfos.csv").write_text("region_id,value,target,target_ids,norm2,is_test\n11,dog,cat,0,4,True\n")
    marker = tmp_path / "ran.txt"
    torch.save({"m": torch.eye(1), "x": _Payload(marker)}, db / "oscar_similarity_matrix.pt")
    with pytest.raises(UnsafeFileError, match=r"oscar_similarity_matrix.pt: refused to load"):
        ev.simat(None, None, None, tmp_path)
    assert not marker.exists()


# ----------------------------------------------------------------------------- 2. never over what it did not write
FAST = ["--steps", "2", "--warmup", "0", "--batch-size", "8", "--workers", "0", "--device", "cpu", "--lr", "1e-2",
        "--save-every", "0", "--log-every", "1", "--train-pairs", "16", "--train-data", "synthetic",
        "--eval-tasks", "none"]


def _erclip(tmp_path, out, *extra):
    import erclip
    import lab
    root = tmp_path / "data"
    if not root.exists():
        lab.synthetic_manifest("train", root, n=16)
    return erclip.main(["--data-root", str(root), "--out", str(out), *FAST, *extra])


def _someones(folder):
    """A folder of someone else's: what a run writes (config.json, model.pt, results.json) and what it does not."""
    (folder / "notes").mkdir(parents=True)
    for name, content in {"config.json": b'{"theirs": 1}', "model.pt": b"their weights", "README.md": b"# mine",
                          "results.json": b'{"their": "numbers"}', "notes/a.txt": b"keep"}.items():
        (folder / name).write_bytes(content)
    return _snapshot(folder)


def _snapshot(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("extra", [[], ["--overwrite"]], ids=["plain", "overwrite"])
def test_a_run_into_someones_folder_is_refused_and_the_folder_left_byte_for_byte(tmp_path, capsys, extra):
    from plumbing import outfolder
    victim = tmp_path / "victim"
    before = _someones(victim)
    code, err = _cli(capsys, lambda argv: _erclip(tmp_path, victim, *argv), extra)
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err
    assert f"--out {victim}: it holds config.json, results.json, model.pt, which this command writes" in err
    assert "no command of this repository wrote them" in err and "README" not in err
    assert _snapshot(victim) == before and not (victim / outfolder.RECEIPT).exists()
    cfg = type("C", (), dict(train_data="synthetic", resume="", overwrite=bool(extra), out=str(victim)))
    assert "it holds config.json" in str(outfolder.early_problem(cfg))  # answered before torch loads too


def test_overwrite_leaves_what_a_run_does_not_write_and_clears_the_runs_own_lora_adapter(tmp_path):
    out = tmp_path / "run"
    (out / "notes").mkdir(parents=True)
    (out / "README.md").write_text("# my run notes")
    (out / "notes" / "a.txt").write_text("keep")
    before = _snapshot(out)
    _erclip(tmp_path, out, "--lora", "2")  # nothing a run writes was there: it runs beside them
    assert (out / "lora_adapter" / "adapter_config.json").exists()
    assert {k: v for k, v in _snapshot(out).items() if k in before} == before
    with pytest.raises(RunError, match="holds a run already"):
        _erclip(tmp_path, out)
    _erclip(tmp_path, out, "--overwrite")  # its own run: cleared, the stale adapter with it
    assert not (out / "lora_adapter").exists() and (out / "model.pt").exists()
    assert {k: v for k, v in _snapshot(out).items() if k in before} == before


def test_a_resume_of_our_own_run_still_continues(tmp_path):
    out = tmp_path / "run"
    _erclip(tmp_path, out, "--stop-at", "1")
    assert (out / "checkpoints" / "last.pt").exists() and not (out / "model.pt").exists()
    _erclip(tmp_path, out, "--resume", "latest")
    assert (out / "model.pt").exists()
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def _eval(tmp_path, out):
    import lab  # noqa: F401  the synthetic sets and the tiny backbone
    return ev.main(["--backbone", "tiny", "--tasks", "synthetic-shape", "--synthetic-n", "8", "--pretrained",
                    "random", "--device", "cpu", "--data-root", str(tmp_path / "data"), "--out", str(out)])


def test_eval_never_replaces_a_runs_results_but_its_own(tmp_path, capsys):
    from plumbing import outfolder
    run = tmp_path / "run"
    _erclip(tmp_path, run)
    before = _snapshot(run)
    code, err = _cli(capsys, lambda argv: _eval(tmp_path, run), [])
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err
    assert f"--out {run}: it holds results.json, which this command writes, and it is the output of a training " \
           f"run ({outfolder.RECEIPT})" in err
    assert _snapshot(run) == before
    someones = tmp_path / "theirs"
    theirs = _someones(someones)
    with pytest.raises(UsageError, match="no command of this repository wrote them"):
        _eval(tmp_path, someones)
    assert _snapshot(someones) == theirs
    _eval(tmp_path, tmp_path / "e")
    first = json.loads((tmp_path / "e" / "results.json").read_text())
    _eval(tmp_path, tmp_path / "e")  # its own earlier output: replaced
    assert json.loads((tmp_path / "e" / "results.json").read_text())["seconds"] != first["seconds"]


def test_the_lora_adapter_is_written_whole_with_the_exports_permissions_and_never_over_anothers(tmp_path,
                                                                                              monkeypatch):
    import os
    from plumbing import base, lora
    out = tmp_path / "run"
    from types import SimpleNamespace

    def killed(*a, **k):  # SIGTERM after the safetensors, before adapter_config.json
        raise base.Interrupted(15)
    monkeypatch.setattr(lora, "json", SimpleNamespace(dumps=killed))
    with pytest.raises(RunError) as e:
        _erclip(tmp_path, out, "--lora", "2")
    assert e.value.code == 143 and not (out / "lora_adapter").exists() and not list(out.glob(".lora_adapter*"))
    assert f"while writing the LoRA adapter {out / 'lora_adapter'}" in str(e.value)
    assert "checkpoints/last.pt" in str(e.value) and "--resume latest" in str(e.value)
    monkeypatch.setattr(lora, "json", json)
    old = os.umask(0o022)
    try:
        _erclip(tmp_path, out, "--lora", "2", "--resume", "latest")  # no training step repeated; the adapter
    finally:
        os.umask(old)
    files = {p.name: p.stat().st_mode & 0o777 for p in (out / "lora_adapter").iterdir()}
    assert files == {"adapter_model.safetensors": 0o644, "adapter_config.json": 0o644, lora.EXTRAS: 0o644,
                     "README.md": 0o644, lora.RECEIPT: 0o644}  # safetensors' own save_file makes 0600
    (out / "lora_adapter" / "notes.txt").write_text("someone's")  # a file the adapter's write did not put there
    with pytest.raises(UsageError, match="the LoRA adapter folder .*lora_adapter: it holds what an export"):
        lora.export_peft(*_adapted(), out / "lora_adapter")
    assert (out / "lora_adapter" / "notes.txt").read_text() == "someone's"


def _adapted():
    from plumbing import models
    model = models.load_model("tiny", "random")[0]
    common.add_lora(model, 2, 4.0, 0.0, ["attn.in_proj_weight"])
    return model, common.adapters(model)


# ----------------------------------------------------------------------------- 3/4. lab.protocol_data's command line
def test_protocol_data_has_a_command_line_and_writes_only_where_it_may(tmp_path, capsys, monkeypatch):
    import subprocess
    import sys
    from pathlib import Path
    from lab import protocol_data
    from plumbing import outfolder
    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "lab.protocol_data", "--help"], cwd=tmp_path, capture_output=True,
                       text=True, env={**__import__("os").environ, "PYTHONPATH": str(repo)}, timeout=60)
    assert r.returncode == 0 and "usage: python -m lab.protocol_data [-h] [DIR]" in r.stdout
    assert list(tmp_path.iterdir()) == []  # no folder named --help
    assert _cli(capsys, protocol_data.main, ["--bogus"])[0] == 2 and list(tmp_path.iterdir()) == []
    (tmp_path / "a-file").write_text("x")
    code, err = _cli(capsys, protocol_data.main, [str(tmp_path / "a-file")])
    assert code == 2 and "a-file: a file is there" in err and (tmp_path / "a-file").read_text() == "x"
    fresh = tmp_path / "fixture"
    protocol_data.main([str(fresh)])
    assert sorted(p.name for p in fresh.iterdir()) == sorted([*protocol_data.WRITES, outfolder.RECEIPT])
    protocol_data.main([str(fresh)])  # its own earlier output
    root = tmp_path / "root"
    (root / "cifar100").mkdir(parents=True)
    (root / "cifar100" / "mine.txt").write_text("keep")
    code, err = _cli(capsys, protocol_data.main, [str(root)])
    assert code == 2 and f"DIR {root}: it holds cifar100/, which this command writes" in err
    assert sorted(p.name for p in root.rglob("*")) == ["cifar100", "mine.txt"]


# ----------------------------------------------------------------------------- 5. the baselines' own settings
BASELINE_KNOBS = [  # (module, flag, values refused): negative, nan / inf, 0 where it means nothing, a probability > 1
    ("ewc", "--ewc-lambda", ["-1", "nan", "inf"]), ("ewc", "--ewc-gamma", ["0", "-0.5", "1.5", "nan"]),
    ("ewc", "--fisher-batches", ["-1"]), ("lwf", "--lwf-weight", ["-1", "nan"]), ("lwf", "--lwf-tau", ["0", "-inf"]),
    ("zscl", "--zscl-tau", ["0", "-2", "nan"]), ("zscl", "--we-every", ["-1"]), ("zscl", "--image-weight", ["-1"]),
    ("zscl", "--text-weight", ["inf"]), ("zscl", "--ref-batch", ["-3"]),
    ("unmix", "--beta", ["0", "-1", "nan"]), ("unmix", "--unmix-prob", ["-0.1", "1.5", "nan"]),
    ("unmix", "--mix-weight", ["-1"]), ("imix", "--alpha", ["0", "-1", "inf"]), ("imix", "--tau", ["-0.2"]),
    ("maps", "--ewc-lambda", ["nan"]), ("maps", "--ewc-gamma", ["0"]), ("maps", "--lwf-weight", ["-1"]),
    ("maps", "--zscl-tau", ["0"]), ("maps", "--we-every", ["-1"]), ("maps", "--image-weight", ["-1"]),
]


@pytest.mark.parametrize("module,flag,values", BASELINE_KNOBS, ids=[f"{m}{f}" for m, f, _ in BASELINE_KNOBS])
def test_the_baselines_own_settings_are_checked_at_parse_time(module, flag, values, capsys):
    import importlib
    from plumbing import flags
    cls = {"ewc": "EWCConfig", "lwf": "LwFConfig", "zscl": "ZSCLConfig", "unmix": "UnMixConfig",
           "imix": "IMixConfig", "maps": "MapsConfig"}[module]
    config = getattr(importlib.import_module(f"baselines.{module}"), cls)
    for value in values:
        with pytest.raises(SystemExit) as e:
            flags.parse_config(config, [f"{flag}={value}"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"argument {flag}: must be" in err and f"got {value}" in err, (value, err)
    assert flags.parse_config(config, [])  # the defaults pass


# ----------------------------------------------------------------------------- 3. tracebacks owed one message
@pytest.mark.parametrize("argv,said", [
    (["--lock-image", "--lock-text"], "both towers are locked, so no weight is left to adapt"),
    (["--lora-targets", "nonexistent"], "'nonexistent' is not a weight name's suffix"),
    (["--lora-targets", "proj"], "'proj' is not a weight name's suffix"),
    (["--lora-targets="], "'' is not a weight name's suffix"),
])
def test_lora_settings_that_cannot_work_stop_at_parse_time(argv, said, capsys):
    """Found after the model loaded (22 s, a ValueError) or, for proj / "", in peft's export after training."""
    from plumbing import flags
    with pytest.raises(SystemExit) as e:
        flags.parse_config(Config, ["--lora", "2", *argv])
    assert e.value.code == 2 and said in capsys.readouterr().err
    flags.parse_config(Config, argv)  # without --lora they mean nothing and stay accepted


def test_lora_targets_that_match_no_weight_are_one_message(tmp_path, capsys):
    code, err = _cli(capsys, lambda argv: _erclip(tmp_path, tmp_path / "r", *argv),
                     ["--lora", "2", "--lora-targets", "nonexistent.weight"])
    assert code == 2 and err.count("error:") == 1 and "no plain 2-D parameter ends in any of" in err
