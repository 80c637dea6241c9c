"""webdataset shards (issue 28.2, shards.py): the converter, each process reading its own shards, training on
them, and exact resume by shard and offset."""
import io
import json
import signal
import tarfile
from pathlib import Path

import pytest
import torch
from PIL import Image

from commands import write_shards
import common
from plumbing.base import DataError, RunError, UsageError
from plumbing.flags import Config
from plumbing.manifests import read_manifest
from plumbing import models
import lab
from plumbing import shards
from _processes import spawn_two  # tests/_processes.py: two gloo processes, forked


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The lab's 24 training pairs (with long captions) as shards of 5 samples: 00000..00004.tar."""
    tmp = tmp_path_factory.mktemp("shards")
    manifest = lab.synthetic_manifest("train", tmp / "data", n=24)
    return manifest, write_shards.write_shards(manifest, tmp / "shards", per_shard=5)


def _cfg(out, **kw):
    return Config(**{"steps": 6, "batch_size": 4, "lr": 1e-3, "warmup": 1, "workers": 0, "precision": "fp32",
                            "out": str(out), "save_every": 0, "log_every": 1, "device": "cpu", "seed": 0, **kw})


def _train(cfg, pattern):
    torch.manual_seed(0)
    model, train_tf, _, tok = models.load_model("tiny", "random")
    summary = common.train(cfg, lab.ClipFineTune(model), common.training_set(cfg, pattern, train_tf),
                           common.Collate(tok), export=False)
    return model, summary


def test_the_converter_writes_every_row_with_its_captions_and_sizes(sharded):
    manifest, pattern = sharded
    assert pattern.endswith("{00000..00004}.tar")
    paths = shards.expand(pattern)
    assert json.loads((paths[0].parent / "sizes.json").read_text()) == {p.name: n for p, n in
                                                                      zip(paths, [5, 5, 5, 5, 4])}
    rows = read_manifest(manifest)
    got = [s for p in paths for s in shards.samples_of(p)]
    assert [json.loads(s["json"])["long_caption"] for s in got] == [r["long_caption"] for r in rows]
    assert [s["txt"].decode() for s in got] == [r["caption"] for r in rows]
    first = Path(manifest).parent / rows[0]["image"]
    assert got[0][first.suffix.lstrip(".")] == first.read_bytes()  # the image file's bytes, as they are


def test_sizes_are_counted_when_there_is_no_sizes_json(sharded, tmp_path):
    paths = shards.expand(sharded[1])
    for p in paths:
        (tmp_path / p.name).write_bytes(p.read_bytes())
    assert shards.shard_sizes([tmp_path / p.name for p in paths]) == [5, 5, 5, 5, 4]


def test_each_process_reads_its_own_shards_and_together_all(sharded):
    data = shards.ShardSet(sharded[1])
    for epoch in (0, 1):
        parts = []
        for rank in (0, 1):
            st = shards.ShardStream(data, 2, None, seed=3, rank=rank, world=2, steps_per_epoch=5)
            st.set_epoch(epoch)
            parts.append(st.my_shards(0, 1))
        assert not set(parts[0]) & set(parts[1]) and sorted(parts[0] + parts[1]) == list(range(5))
    with pytest.raises(UsageError, match="5 shard"):
        shards.ShardSet(sharded[1], readers=6)  # 3 processes x 2 workers


@pytest.mark.parametrize("workers", [0, 2])
def test_a_run_on_shards_resumes_exactly(sharded, tmp_path, workers):
    """6 steps of batch 4, an epoch of 12 samples (--train-num-samples; 3 steps), stopped after step 5 (epoch 1,
    its 8 first samples used: one whole shard skipped by its size, then 3 samples of the next) and resumed: the
    weights equal the uninterrupted run's bit for bit."""
    pattern = sharded[1]
    kw = {"workers": workers, "train_num_samples": 12}
    one, summary = _train(_cfg(tmp_path / "one", **kw), pattern)
    assert summary["steps"] == 6 and summary["data"]["rows"] == 12
    _train(_cfg(tmp_path / "two", stop_at=5, **kw), pattern)
    two, _ = _train(_cfg(tmp_path / "two", resume="latest", **kw), pattern)
    for (n, a), b in zip(one.state_dict().items(), two.state_dict().values()):
        assert torch.equal(a, b), n


def test_an_epoch_reads_every_sample_once_when_the_workers_shards_are_even(sharded):
    """4 shards of 5 read by 0 or 2 workers (2 shards each): 4 batches of 5, every sample once. Uneven shards
    per worker: see shards.py's docstring."""
    data = shards.ShardSet(sharded[1].replace("00004", "00003"), need_long=True)
    captions = {}
    for workers in (0, 2):
        loader = data.loader(5, lambda items: [it["long_caption"] for it in items], 0, 0, 1, workers, 4)
        captions[workers] = [c for batch in loader for c in batch]
    assert len(captions[0]) == 20 and len(set(captions[0])) == 20
    assert sorted(captions[0]) == sorted(captions[2])


def test_a_bad_sample_is_replaced_and_counted(sharded, tmp_path):
    paths = shards.expand(sharded[1])
    bad = tmp_path / "00000.tar"
    with tarfile.open(paths[0]) as src, tarfile.open(bad, "w") as dst:
        for m in src:
            data = src.extractfile(m).read()
            if m.name.startswith("000000002.") and not m.name.endswith((".txt", ".json")):
                data = data[:40]  # cut short: opens, does not decode
            m.size = len(data)
            dst.addfile(m, io.BytesIO(data))
    _, summary = _train(_cfg(tmp_path / "run", steps=2, batch_size=4), str(bad))
    assert summary["undecodable_images"]["count"] == 1
    assert "000000002" in summary["undecodable_images"]["first"][0]


def test_a_resume_on_other_shards_is_refused(sharded, tmp_path):
    pattern = sharded[1]
    _train(_cfg(tmp_path / "run", stop_at=2), pattern)
    fewer = pattern.replace("00004", "00003")
    with pytest.raises(RunError, match="training data changed"):
        _train(_cfg(tmp_path / "run", resume="latest"), fewer)


def test_missing_shards_are_one_message(tmp_path):
    with pytest.raises(DataError, match="2 of 2 shard"):
        shards.expand(str(tmp_path / "{0..1}.tar"))


def _ddp_worker(rank, world, port, tmp, pattern):
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    model, summary = _train(_cfg(Path(tmp) / "ddp", steps=4, batch_size=4), pattern)
    if rank == 0:
        torch.save({"steps": summary["steps"], "world": summary["world_size"]}, Path(tmp) / "ddp.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_processes_train_on_their_own_shards_in_step(sharded, tmp_path):
    """2 gloo processes, each on its own shards (2 or 3 of 5), make the same number of steps: no rank waits for
    a batch the other never makes (DDP would hang)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn_two(_ddp_worker, 2, port, str(tmp_path), sharded[1])
    assert torch.load(tmp_path / "ddp.pt") == {"steps": 4, "world": 2}


def _tar(path, members):
    """A tar of (member name, bytes), in that order."""
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _png():
    b = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(b, "PNG")
    return b.getvalue()


def _first_batch(pattern, workers=0, batch=2, start=0):
    """The first batch of a ShardSet's loader (from batch `start` of epoch 0: a resume), or what it raises;
    SIGALRM after 60 s (a stream that loops) raises a BaseException, which no `except Exception` on the way (PIL's
    decoding, the DataLoader's) swallows."""
    class Late(BaseException):
        pass

    def late(*_):
        raise Late("the shard stream made no batch in 60 s")
    previous = signal.signal(signal.SIGALRM, late)
    signal.alarm(60)
    try:
        loader = shards.ShardSet(pattern).loader(batch, list, 0, 0, 1, workers, 4)
        loader.dataset.set_epoch(0, start)
        return next(iter(loader))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("workers", [0, 2])
def test_shards_where_no_sample_decodes_stop_with_one_message(tmp_path, workers):
    """Issue 41.1: every image undecodable. The stream looped for ever (no step, every failure kept); now one
    pass over the reader's shards without a usable sample is one message with the counts, from the main
    process (no worker traceback)."""
    for i in range(2):
        _tar(tmp_path / f"{i}.tar", [m for k in range(3) for m in ((f"{i}{k:05d}.jpg", b"not an image"),
                                                                     (f"{i}{k:05d}.txt", b"a caption"))])
    with pytest.raises(DataError) as e:
        _first_batch(str(tmp_path / "{0..1}.tar"), workers)
    msg = str(e.value)
    assert "no usable sample" in msg and "Traceback" not in msg, msg
    tried = 6 if workers == 0 else 3  # two workers: one shard each
    assert f"{tried} tried, {tried} failed: {tried} undecodable image (UnidentifiedImageError)" in msg, msg


def test_a_sizes_json_that_claims_samples_of_an_empty_shard_is_named(tmp_path):
    """Issue 41.1: sizes.json says 4, the tar holds none: the stream read the shard again and again for ever."""
    _tar(tmp_path / "0.tar", [])
    (tmp_path / "sizes.json").write_text(json.dumps({"0.tar": 4}))
    with pytest.raises(DataError, match=r"sizes.json says 0.tar holds 4 samples, its tar members hold 0"):
        _first_batch(str(tmp_path / "0.tar"))


def _samples(keys, image=None):
    """(member name, bytes) of samples <key>.png + <key>.txt (the caption: the key)."""
    return [m for k in keys for m in ((f"{k}.png", image or _png()), (f"{k}.txt", k.encode()))]


def test_members_under_dot_slash_and_keys_with_several_dots_are_counted_and_read(tmp_path):
    """Issue 41.1: `tar -cf x.tar -C dir .` names members ./000001.png: counted as ONE sample (the name up to its
    first dot, ''); a folder with a dot (v1.2/) too; a key with several dots (webdataset: `a.b.png` is key `a`,
    extension `b.png`) was read as "no image member". Counted by webdataset's rule, read by the extension's end."""
    folder = tmp_path / "dir"
    folder.mkdir()
    for k in ("000001", "000002", "000003"):
        (folder / f"{k}.png").write_bytes(_png())
        (folder / f"{k}.txt").write_text(f"caption {k}")
    with tarfile.open(tmp_path / "0.tar", "w") as tar:
        tar.add(folder, arcname=".")  # ".", "./000001.png", ...: what `tar -C dir .` writes
    _tar(tmp_path / "1.tar", _samples(["v1.2/a", "v1.2/b"]))
    _tar(tmp_path / "2.tar", _samples(["x.1", "y.2", "z.3", "w.4"]))
    paths = [tmp_path / f"{i}.tar" for i in range(3)]
    read = [sum(1 for _ in shards.samples_of(p)) for p in paths]
    assert shards.shard_sizes(paths) == read == [3, 2, 4]
    batch = _first_batch(str(tmp_path / "2.tar"), batch=4)
    assert sorted(it["caption"] for it in batch) == ["w.4", "x.1", "y.2", "z.3"]


def test_a_sizes_json_that_disagrees_with_the_members_is_named(tmp_path):
    """Issue 41.1: sizes.json is trusted to start (it saves reading every header), checked against the members
    each time a shard is read to its end, and for the shards a resume skips whole: a wrong size would shift every
    batch after a resume, so the run stops with one message naming the file (the members do not win silently)."""
    _tar(tmp_path / "0.tar", _samples(["a", "b", "c"]))
    (tmp_path / "sizes.json").write_text(json.dumps({"0.tar": 5}))
    with pytest.raises(DataError, match=r"sizes.json says 0.tar holds 5 samples, its tar members hold 3"):
        _first_batch(str(tmp_path / "0.tar"), batch=4)  # 4 > 3: read to its end before the batch is full
    (tmp_path / "sizes.json").write_text(json.dumps({"0.tar": 2}))
    with pytest.raises(DataError, match=r"says 0.tar holds 2 samples, its tar members hold 3"):
        _first_batch(str(tmp_path / "0.tar"), start=1)  # a resume after a batch of 2: skips the shard whole


def _cut_after(path, member):
    """The tar cut short right after a member's data (its padding included), as a copy cut at that block."""
    with tarfile.open(path) as tar:
        m = tar.getmember(member)
    end = m.offset_data + -(-m.size // 512) * 512
    path.write_bytes(path.read_bytes()[:end])


@pytest.mark.parametrize("where", ["after an image", "inside a caption", "gzipped", "gzipped, sizes.json"])
def test_a_truncated_shard_is_named_truncated(tmp_path, where):
    """Issue 41.1: a shard cut at a member's end read as a shorter shard whose last sample had no caption ("no
    caption", replaced for ever); cut mid-member, a tarfile traceback. Both: one message naming it truncated (a
    gzipped one when its headers are counted, or as it is read)."""
    shard = _tar(tmp_path / "0.tar", _samples(["a", "b", "c"]))
    if where == "after an image":
        _cut_after(shard, "b.png")
    elif where == "inside a caption":
        shard.write_bytes(shard.read_bytes()[:_member_offset(shard, "b.txt") + 3])
    else:
        import gzip
        zipped = gzip.compress(shard.read_bytes())
        shard.write_bytes(zipped[:len(zipped) // 2])
        if where == "gzipped, sizes.json":
            (tmp_path / "sizes.json").write_text(json.dumps({"0.tar": 3}))
    with pytest.raises(DataError, match=r"0.tar: truncated"):
        _first_batch(str(shard), batch=3)


def _member_offset(path, member):
    with tarfile.open(path) as tar:
        return tar.getmember(member).offset_data


@pytest.mark.parametrize("case", ["not a tar", "0 bytes", "{not json", '"eight"', "a list", "a count of eight"])
def test_a_bad_shard_or_sizes_json_is_one_message_naming_the_file(tmp_path, case):
    """Issue 41.1: a non-tar file, a 0-byte shard without sizes.json, a sizes.json that is not JSON, not an object
    or not counts: tracebacks (tarfile.ReadError, JSONDecodeError, AttributeError, int('eight')) before."""
    shard = _tar(tmp_path / "0.tar", _samples(["a", "b"]))
    named = shard
    if case == "not a tar":
        shard.write_text("a caption, not a tar file\n" * 40)
    elif case == "0 bytes":
        shard.write_bytes(b"")
    else:
        named = tmp_path / "sizes.json"
        named.write_text({"{not json": "{not json", '"eight"': '"eight"', "a list": "[2]",
                          "a count of eight": '{"0.tar": "eight"}'}[case])
    with pytest.raises(DataError) as e:
        _first_batch(str(shard))
    assert str(e.value).count(str(named)) >= 1 and "Traceback" not in str(e.value), str(e.value)


def test_the_converter_writes_only_image_members_the_reader_reads(tmp_path):
    """Issue 41.1: a .gif / .bmp row was written as a `.gif` / `.bmp` member, which the reader skips ("no image
    member"); now re-encoded as PNG (lossless: the reader's pixels are the file's), .jpg / .png bytes as they are."""
    from plumbing.loading import to_rgb
    import numpy as np
    rng = np.random.default_rng(0)
    rows = []
    for i, (ext, mode) in enumerate([("gif", "P"), ("bmp", "RGB"), ("png", "RGB"), ("tiff", "CMYK")]):
        im = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).convert(mode)
        im.save(tmp_path / f"{i}.{ext}")
        rows.append({"image": f"{i}.{ext}", "caption": f"picture {i}"})
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pattern = write_shards.write_shards(tmp_path / "m.jsonl", tmp_path / "shards")
    got = list(shards.samples_of(shards.expand(pattern)[0]))
    assert [sorted(set(s) & {"jpg", "jpeg", "png", "webp", "gif", "bmp", "tiff"}) for s in got] == [["png"]] * 4
    assert got[2]["png"] == (tmp_path / "2.png").read_bytes()
    for s, r in zip(got, rows):
        with Image.open(io.BytesIO(s["png"])) as a, Image.open(tmp_path / r["image"]) as b:
            assert np.array_equal(np.asarray(to_rgb(a)), np.asarray(to_rgb(b))), r["image"]
    batch = _first_batch(pattern, batch=4)
    assert sorted(it["caption"] for it in batch) == [f"picture {i}" for i in range(4)]


def test_a_resume_after_a_shard_was_edited_in_place_is_refused(sharded, tmp_path):
    """Issue 41.1: the fingerprint was (path, byte size, count), and tar pads every shard to 10,240-byte records,
    so a shard whose captions and images moved (same size) resumed as unchanged; its modification time is now part
    of it. --override-resume goes on, recorded."""
    import shutil
    src = shards.expand(sharded[1])
    for p in [*src, src[0].parent / "sizes.json"]:
        shutil.copy2(p, tmp_path / p.name)
    pattern = str(tmp_path / "{00000..00004}.tar")
    _train(_cfg(tmp_path / "run", stop_at=2), pattern)
    first = tmp_path / "00000.tar"
    samples, size = list(shards.samples_of(first)), first.stat().st_size
    with tarfile.open(first) as tar:  # a caption's bytes rewritten in place: same members, same byte size
        m = next(m for m in tar if m.name.endswith(".txt"))
    data = bytearray(first.read_bytes())
    data[m.offset_data:m.offset_data + 1] = b"X" if data[m.offset_data:m.offset_data + 1] != b"X" else b"Y"
    first.write_bytes(bytes(data))
    assert first.stat().st_size == size and list(shards.samples_of(first)) != samples
    with pytest.raises(RunError, match="were modified since"):
        _train(_cfg(tmp_path / "run", resume="latest"), pattern)
    _, summary = _train(_cfg(tmp_path / "run", resume="latest", override_resume=True), pattern)
    assert summary["steps"] == 6
