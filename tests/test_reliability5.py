"""Issue 69 (reliability pass 5): no code runs from a data file (CIFAR's pickles read by a restricted unpickler),
a run never overwrites what it did not write, lab.protocol_data's command line, the baselines' own settings
checked at parse time. docs/reliability.md maps each case to its test."""
import pickle
import shutil

import numpy as np
import pytest

import common
import eval as ev
from plumbing import mtil, safepickle


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
    with pytest.raises(common.DataError) as e:
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
    with pytest.raises(common.DataError, match=r"test_batch: no 'data' array of \(N, 3072\)"):
        ev.load_classification("cifar10", tmp_path)
    (folder / "test_batch").write_bytes(pickle.dumps({"data": np.zeros((4, 3072), np.uint8), "labels": [0, 9, 10, 1]}))
    with pytest.raises(common.DataError, match=r"test_batch: 'labels' is not 4 class indices below 10"):
        ev.load_classification("cifar10", tmp_path)
    (folder / "batches.meta").write_bytes(b"\x80\x04\x95")  # cut short
    with pytest.raises(common.DataError, match=r"batches.meta: not a readable pickle"):
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
    with pytest.raises(common.DataError, match=r"test: its arrays declare 0.07 GiB from a file of 1.0 MiB"):
        safepickle.load(path)


def _cli(capsys, main, argv):
    """common.cli as a script's __main__ runs it: (exit code, stderr)."""
    with pytest.raises(SystemExit) as e:
        common.cli(main, argv)
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
    with pytest.raises(common.UnsafeFileError, match=r"oscar_similarity_matrix.pt: refused to load"):
        ev.simat(None, None, None, tmp_path)
    assert not marker.exists()
