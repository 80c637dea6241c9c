"""Issue 41.4: GMC's MOSEI reader (papers/mosei.py). Every pickle protocol of plain numpy arrays reads (protocol
5's _frombuffer, protocols <= 2's bytes() of an empty array) while anything else stays refused; what a file declares
is checked against its size before memory is asked for (pickle, --convert, .npz); malformed content and
non-finite labels are one message each. The crafted files are built here, in tmp_path."""
import codecs
import contextlib
import pickle
import re
import resource
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from plumbing.base import DataError
from plumbing import cli
from papers import mosei

ROOT = Path(__file__).resolve().parents[1]


def layout(n=4, steps=5, **over):
    """A valid GMC layout with float64 arrays (MulT's pickle holds float64), `over` replacing train's keys."""
    rng = np.random.default_rng(0)
    out = {s: {"text": rng.normal(size=(n, steps, 3)), "audio": rng.normal(size=(n, steps, 2)),
               "vision": rng.normal(size=(n, steps, 2)), "labels": rng.normal(size=(n, 1, 1)),
               "id": np.array([f"{s}-{i}" for i in range(n)], dtype=object)} for s in ("train", "valid", "test")}
    out["train"].update(over)
    return out


def write(path, obj, protocol=2):
    path.write_bytes(pickle.dumps(obj, protocol=protocol))
    return path


class Reduce:
    """Pickles as f(*args) (f named by the pickle as a global) without calling f here."""
    def __init__(self, f, args, state=None):
        self.f, self.args, self.state = f, args, state

    def __reduce__(self):
        return (self.f, self.args) if self.state is None else (self.f, self.args, self.state)


@contextlib.contextmanager
def address_space(extra_mib):
    """The process may map at most `extra_mib` MiB more than now (RLIMIT_AS): an allocation of what a crafted file
    declares fails with MemoryError instead of taking the machine's memory. Restored after."""
    size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = size + (extra_mib << 20)
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# ----------------------------------------------------------------------------- every protocol, nothing else
@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_every_pickle_protocol_of_plain_arrays_reads_empty_ones_too(tmp_path, protocol):
    """Protocol 5 pickles arrays through numpy._core.numeric._frombuffer, protocols <= 2 an empty array's data as
    bytes(): both were refused as "not a numpy array"."""
    data = layout()
    data["valid"] = {k: v[:0] for k, v in data["valid"].items()}  # an empty split
    data["test"]["fortran"] = np.asfortranarray(np.arange(12.0).reshape(3, 4))
    got = mosei.read_arrays(write(tmp_path / "m.pkl", data, protocol))
    assert got.keys() == data.keys() and all(got[s].keys() == data[s].keys() for s in data)
    assert all(np.array_equal(got[s][k], data[s][k]) and type(got[s][k]) is np.ndarray for s in data for k in data[s])
    splits, _ = mosei.load_splits(tmp_path / "m.pkl")
    assert splits["valid"]["text"].shape == (0, 5, 3) and splits["train"]["label"].shape == (4,)


@pytest.mark.parametrize("payload,why", [
    (Reduce(bytes, (10**12,)), r"bytes\(1000000000000,\)"),
    (Reduce(codecs.encode, ("ab", "hex_codec")), r"_codecs.encode\(str, 'hex_codec'\)"),
    (Reduce(np._core.numeric._frombuffer, ([1.0, 2.0], np.dtype("f8"), (2,), "C")), "_frombuffer of list"),
    (Reduce(np._core.multiarray._reconstruct, (np.dtype, (0,), b"b")), "_reconstruct of <class 'numpy.dtype'>"),
    (Reduce(np._core.multiarray._reconstruct, (np.ndarray, (0,), b"b"), (1, (4,), np.dtype("f8"), False, b"x")),
     r"declaring \(4,\) float64 \(32 bytes\) holds 1 bytes"),
    (Reduce(np._core.multiarray._reconstruct, (np.ndarray, (0,), b"b"), (1, (2,), np.dtype("f8"), False, [1, 2])),
     "an array whose data is list"),
])
def test_anything_but_numpys_own_calls_stays_refused_with_a_true_message(tmp_path, payload, why):
    with pytest.raises(DataError, match=why + ".*refused"):
        mosei.read_arrays(write(tmp_path / "evil.pkl", {"train": {"text": payload}}))


def test_an_object_array_declaring_more_items_than_it_holds_is_refused_not_a_crash(tmp_path):
    """numpy trusts an object array's declared shape: 5 items declared, 1 held crashed the interpreter
    (segmentation fault, in a subprocess here so that the old code's crash fails this test only)."""
    bad = Reduce(np._core.multiarray._reconstruct, (np.ndarray, (0,), b"b"), (1, (5,), np.dtype(object), False, [1]))
    path = write(tmp_path / "crash.pkl", {"train": {"id": bad}})
    run = subprocess.run([sys.executable, "-c", f"from papers import mosei; mosei.read_arrays({str(path)!r})"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "an object array declaring (5,) holds 1 items: refused" in run.stderr


# ----------------------------------------------------------------------------- memory checked before it is asked for
def test_convert_of_one_string_referenced_4096_times_is_refused_before_allocating(tmp_path):
    """A 1 MB pickle: one 1 MiB string referenced 4,096 times in an object array. --convert's astype(str) asked numpy
    for 16 GiB (4,096 x 2^20 characters x 4 bytes); now the size is checked first."""
    ids = np.empty(4096, dtype=object)
    ids[:] = ["x" * (1 << 20)] * 4096
    path = write(tmp_path / "m.pkl", layout(id=ids), protocol=4)
    assert path.stat().st_size < 2 << 20
    start = time.perf_counter()
    with address_space(1024), pytest.raises(DataError, match="train/id as a numpy string array would take "
                                                                    "16.00 GiB.*refused before allocating"):
        mosei.convert(path)
    assert time.perf_counter() - start < 30 and not path.with_suffix(".npz").exists()


def test_a_pickle_whose_arrays_share_one_buffer_is_refused_by_its_declared_total(tmp_path):
    """Protocol 5 arrays are views of the buffers in the file: one 1 MiB buffer viewed by 4,096 arrays declares
    4 GiB (what load_splits' copies and --convert's writes would take) from a 1 MB file."""
    buf = bytearray(1 << 20)
    views = {f"k{i}": Reduce(np._core.numeric._frombuffer, (buf, np.dtype("f8"), (1 << 17,), "C"))
             for i in range(4096)}
    path = write(tmp_path / "m.pkl", {"train": views}, protocol=5)
    assert path.stat().st_size < 2 << 20
    with pytest.raises(DataError, match=r"the pickle's arrays would take [\d.]+ GiB.*refused before allocating"):
        mosei.read_arrays(path)


def _bomb(path, mib):
    """An .npz whose one entry is `mib` MiB of deflated zeros (written in chunks: nothing that size in memory)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z, \
            z.open("train/text.npy", "w", force_zip64=True) as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False,
                                                 "shape": (mib << 18, 1, 1)})
        chunk = bytes(16 << 20)
        for _ in range(mib // 16):
            f.write(chunk)
    return path


def test_a_deflated_npz_bomb_is_refused_before_its_arrays_are_read(tmp_path):
    """512 MiB of zeros deflated into well under 1 MB: np.load materialised it before the row check refused it
    (2.9 GB of RSS for the probe's 2 GiB one); now its header's size against the file's is refused first."""
    path = _bomb(tmp_path / "bomb.npz", 512)
    assert path.stat().st_size < 1 << 20
    with address_space(256), pytest.raises(DataError, match="the .npz's arrays would take 0.50 GiB"
                                                                   ".*refused before allocating"):
        mosei.load_splits(path)


def test_an_npz_entry_declaring_more_than_it_holds_is_refused(tmp_path):
    """A header declaring 10^9 float64 over 16 bytes of data: np.load asked for 8 GB (a MemoryError traceback)."""
    path = tmp_path / "lie.npz"
    with zipfile.ZipFile(path, "w") as z, z.open("train/text.npy", "w") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f8", "fortran_order": False, "shape": (10**9,)})
        f.write(bytes(16))
    with address_space(256), pytest.raises(DataError, match=r"train/text.npy' declares \(1000000000,\) "
                                                                   r"float64 \(8000000000 bytes\) but holds 16"):
        mosei.load_splits(path)


# ----------------------------------------------------------------------------- malformed content: one message each
@pytest.mark.parametrize("values,why", [
    (np.array([["a"] * 3] * 5, dtype=object), "holds <U1 values; want numbers"),
    (np.array([[{}] * 3] * 5, dtype=object), "train/text is an object array of dict"),
    (np.array([[10**400] * 3] * 5, dtype=object), "train/text holds an integer beyond float64's range"),
])
def test_object_arrays_of_strings_dicts_or_huge_ints_are_one_message(tmp_path, values, why):
    path = write(tmp_path / "m.pkl", layout(text=np.stack([values] * 4)))
    with pytest.raises(DataError, match=why):
        mosei.load_splits(path)


def test_convert_refuses_an_object_array_it_cannot_write_as_strings_or_numbers(tmp_path):
    """astype(str) wrote a dict's repr into the .npz as if it were data."""
    path = write(tmp_path / "m.pkl", layout(id=np.array([{"a": 1}] * 4, dtype=object)))
    with pytest.raises(DataError, match="train/id is an object array of dict"):
        mosei.convert(path)
    assert not path.with_suffix(".npz").exists()


@pytest.mark.parametrize("top,why", [
    (3, "the file holds int, not a dict of splits"),
    ([layout()["train"]], "the file holds list, not a dict of splits"),
    ({**layout(), "train": np.zeros(3)}, "split 'train' is ndarray, not a dict of arrays"),
    ({**layout(), "train": {**layout()["train"], "text": [1, 2]}}, "train/'text' is list, not a numpy array"),
])
def test_a_top_level_or_split_of_another_type_is_named_as_such(tmp_path, top, why):
    """An int top level was a TypeError traceback; a list or a `train` that is not a dict said "no 'train' split
    (found [..., 'train', ...])"."""
    with pytest.raises(DataError, match=re.escape(why)):
        mosei.load_splits(write(tmp_path / "m.pkl", top))


def test_an_npz_with_a_pickled_entry_is_refused_with_one_message(tmp_path):
    path = tmp_path / "m.npz"
    np.savez(path, **{"train/text": np.array([{}], dtype=object)})  # savez pickles object arrays
    with pytest.raises(DataError, match="train/text.npy' holds pickled objects"):
        mosei.load_splits(path)


def test_a_truncated_npz_is_named_as_a_truncated_npz_not_a_checkpoint(tmp_path):
    data = layout()
    full = tmp_path / "m.npz"
    np.savez(full, **{f"{s}/{k}": v.astype(str) if v.dtype == object else v for s, d in data.items()
                      for k, v in d.items()})
    assert mosei.load_splits(full)[0]["test"]["text"].shape == (4, 5, 3)
    cut = tmp_path / "cut.npz"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    with pytest.raises(DataError, match="cut.npz: not a readable .npz: truncated or corrupted") as e:
        mosei.load_splits(cut)
    assert "checkpoint" not in cli.expected_error(e.value)[0]


@pytest.mark.parametrize("labels", [np.array([0.5, np.nan, 1.0, -1.0]),
                                    np.array([0.5, None, 1.0, None], dtype=object)])
def test_non_finite_labels_are_refused_not_set_to_neutral(tmp_path, labels):
    """NaN / None labels were set to 0 (neutral sentiment) under G6's rule for features; features keep that rule."""
    audio = np.full((4, 5, 2), -np.inf)
    path = write(tmp_path / "m.pkl", layout(labels=labels.reshape(4, 1, 1), audio=audio))
    with pytest.raises(DataError, match=r"train/labels has \d non-finite values \(NaN, inf or None\) in "
                                               r"rows \[1(, 3)?\]"):
        mosei.load_splits(path)
    ok = write(tmp_path / "ok.pkl", layout(audio=audio))
    splits, fixed = mosei.load_splits(ok)
    assert fixed == {"train/audio": audio.size} and float(splits["train"]["audio"].abs().sum()) == 0
