"""Tests of towers.py and m2mix.py --backbone bert-resnet50 (m2-Mix Sec. 5.4), offline: a tiny BERT with a
WordPiece vocabulary written here, timm ResNets at random init, a fixture Hugging Face / torchvision cache;
the whole path (forward, every loss, steps, save, load, evaluate, resume, Table 3) on the lab's data."""
import dataclasses
import json
from pathlib import Path

import pytest
import timm
import torch

import common
from plumbing.base import RunError, UsageError
from plumbing.flags import parse_config
import eval as evaluation
import lab
import m2mix
from plumbing import models, towers
from protocols import m2mix_analysis
from _processes import spawn_two  # tests/_processes.py: two gloo processes, forked

torch.set_num_threads(1)
WORDS = ("a an the of at on next to with picture photo large small circle square triangle diamond cross ring bar "
         "star red green blue yellow top bottom left right . ,").split()


def write_bert(folder: Path, seed: int = 0) -> Path:
    """A 2-layer, 32-wide BERT and a whole-word WordPiece vocabulary, saved as save_pretrained writes them."""
    from transformers import BertConfig, BertModel, BertTokenizer
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    BertTokenizer(str(folder / "vocab.txt"), do_lower_case=True).save_pretrained(folder)
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=256)
    BertModel(cfg).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return write_bert(tmp_path_factory.mktemp("bert") / "bert")


@pytest.fixture(scope="module")
def small_towers(bert, tmp_path_factory):
    """A spec of the lab's small ResNet (random init, saved as a file) and the fixture BERT: the whole path, fast."""
    trunk = tmp_path_factory.mktemp("trunk") / "trunk.pth"
    torch.manual_seed(0)
    torch.save(timm.create_model("lab_resnet", num_classes=0).state_dict(), trunk)
    towers.SPECS["test-towers"] = dataclasses.replace(lab.towers.SPEC, text_dirs=(bert,), image_files=(trunk,))
    yield "test-towers"
    towers.SPECS.pop("test-towers")


def test_the_model_is_open_clips_custom_text_clip_with_the_codes_heads(small_towers):
    model, _, preprocess, tok = models.load_model(small_towers)
    assert type(model).__name__ == "CustomTextCLIP" and common.embed_dim(model) == 256
    assert model.visual.head.proj.bias is not None and model.text.proj.bias is None  # deviation T1
    assert abs(model.logit_scale.exp().item() - 100) < 1e-3  # the code's 1/0.01, learned from there (T2)
    assert tuple(preprocess.transforms[-1].mean) == towers.IMAGENET_MEAN  # the ResNet's own normalisation (T3)
    tokens = tok(["a large red circle at the top left .", "a star"])
    assert tokens.shape == (2, 32) and tokens[0, 0] == 2 and (tokens[1, 4:] == 0).all()  # [CLS] ... [PAD]


def test_trimmed_padding_gives_the_untrimmed_features(small_towers):
    model, _, _, tok = models.load_model(small_towers)
    model.eval()
    tokens = tok(["a large red circle at the top left next to a small blue star .", "a ring"])
    with torch.no_grad():
        assert torch.allclose(common.encode_text(model, tokens), model.encode_text(tokens, normalize=True), atol=1e-6)


def test_heads_are_drawn_from_the_seed(small_towers):
    a, b, c = (models.load_model(small_towers, seed=s)[0] for s in (3, 3, 4))
    assert torch.equal(a.text.proj.weight, b.text.proj.weight)
    assert not torch.equal(a.text.proj.weight, c.text.proj.weight)
    assert torch.equal(a.visual.trunk.conv1.weight, c.visual.trunk.conv1.weight)  # the trunk comes from the file


@pytest.mark.parametrize("method", ["ft", "m2", "m3"])
def test_every_method_trains_saves_loads_and_evaluates(small_towers, method, tmp_path):
    data = tmp_path / "data"
    manifest = lab.synthetic_manifest("train", data, n=24)
    out = tmp_path / method
    res = m2mix.main(["--backbone", small_towers, "--train-data", str(manifest), "--data-root", str(data),
                      "--eval-tasks", "synthetic-short", "--out", str(out), "--steps", "3", "--batch-size", "8",
                      "--precision", "fp32", "--device", "cpu", "--workers", "0", "--log-every", "1",
                      "--save-every", "0", "--method", method, "--head-lr", "1e-3"])
    log = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    want = {"ft": {"loss_clip"}, "m2": {"loss_clip", "loss_m2"},
            "m3": {"loss_clip", "loss_m2", "loss_uni", "loss_vl"}}[method]
    assert want <= set(log[-1]) and all(torch.isfinite(torch.tensor(r["loss"])) for r in log)
    name = m2mix.METHOD_NAMES[method]
    assert {("ZS", "t2i_R@10"), (name, "i2t_R@1")} <= {(r["model"], r["metric"]) for r in res["records"]}
    meta = json.loads((out / "model.pt.json").read_text())
    assert meta["towers"]["text_dir"] == "model-text" and (out / "model-text" / "config.json").exists()
    loaded, _, preprocess, tok = models.load_model(small_towers, str(out / "model.pt"))  # the file alone
    again = evaluation.evaluate(loaded, preprocess, tok, ["synthetic-short"], str(data), model_name=name)
    first = {r["metric"]: r["value"] for r in res["records"] if r["model"] == name}
    assert {r["metric"]: r["value"] for r in again}["i2t_R@1"] == pytest.approx(first["i2t_R@1"], abs=1e-6)
    assert "### synthetic-short" in m2mix.main(["--collect", str(out)])


def test_head_lr_puts_the_projections_in_their_own_group(small_towers):
    model = models.load_model(small_towers)[0]
    net = m2mix.M2Mix(model, m2mix.M2MixConfig(backbone=small_towers))
    groups = common.param_groups(net, 1e-5, 0.2, lambda n: 1e-3 if n.startswith(("model.visual.head.",
                                                                                    "model.text.proj.")) else 1e-5)
    heads = {n for g in groups if g["lr"] == 1e-3 for n in g["names"]}
    assert heads == {"model.visual.head.proj.weight", "model.visual.head.proj.bias", "model.text.proj.weight"}


def test_resume_is_exact_on_the_towers(small_towers, tmp_path):
    data = tmp_path / "data"
    manifest = lab.synthetic_manifest("train", data, n=32)
    base = ["--backbone", small_towers, "--train-data", str(manifest), "--data-root", str(data), "--eval-tasks", "none",
            "--no-eval-base", "--batch-size", "8", "--precision", "fp32", "--device", "cpu", "--workers", "0",
            "--method", "m3", "--steps", "4", "--lr", "1e-3"]
    m2mix.main(base + ["--out", str(tmp_path / "straight"), "--save-every", "0"])
    cut = m2mix.main(base + ["--out", str(tmp_path / "cut"), "--save-every", "2", "--stop-at", "2"])
    assert cut["summary"]["stopped_at"] == 2  # as if interrupted after step 2, its checkpoint kept
    m2mix.main(base + ["--out", str(tmp_path / "cut"), "--save-every", "2", "--resume", "latest"])
    a = torch.load(tmp_path / "straight" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "cut" / "model.pt", weights_only=True)
    assert all(torch.allclose(a[k].float(), b[k].float(), atol=1e-6) for k in a)


# ----------------------------------------------------------------------------- bert-resnet50 and its weights
def hf_cache(root: Path, repo: str, files_from: Path) -> Path:
    """The Hugging Face cache's layout for one repo: refs/main -> snapshots/<commit>/<files>."""
    commit = "0" * 40
    snap = root / f"models--{repo.replace('/', '--')}" / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in files_from.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (root / f"models--{repo.replace('/', '--')}" / "refs").mkdir()
    (root / f"models--{repo.replace('/', '--')}" / "refs" / "main").write_text(commit)
    return root


def run_args(tmp_path, *extra):
    manifest = lab.synthetic_manifest("train", tmp_path / "data", n=4)
    return ["--backbone", "bert-resnet50", "--train-data", str(manifest), "--data-root", str(tmp_path / "data"),
            "--eval-tasks", "none", "--no-eval-base", "--out", str(tmp_path / "run"), "--steps", "1",
            "--batch-size", "2", "--precision", "fp32", "--device", "cpu", "--workers", "0", "--save-every", "0",
            *extra]


def test_bert_resnet50_stops_with_one_message_naming_what_is_missing(tmp_path, bert, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(RunError, match=r"text tower .*bert-base-uncased.*--text-weights"):
        m2mix.main(run_args(tmp_path, "--cache-dir", str(tmp_path / "empty")))
    cache = hf_cache(tmp_path / "hf", "google-bert/bert-base-uncased", bert)
    with pytest.raises(RunError, match=r"image trunk.*resnet50-0676ba61\.pth.*--image-weights") as e:
        m2mix.main(run_args(tmp_path, "--cache-dir", str(cache)))
    assert "timm/resnet50.tv_in1k" in str(e.value) and not (tmp_path / "run" / "metrics.jsonl").exists()
    with pytest.raises(RunError, match="--text-weights"):
        m2mix.main(run_args(tmp_path, "--text-weights", str(tmp_path / "nowhere")))
    with pytest.raises(UsageError, match="--export is not for towers"):
        m2mix.main(run_args(tmp_path, "--export", str(tmp_path / "hub")))


def test_bert_resnet50_trains_from_a_fixture_cache_and_a_torchvision_file(tmp_path, bert, monkeypatch):
    cache = hf_cache(tmp_path / "hf", "google-bert/bert-base-uncased", bert)
    sd = timm.create_model("resnet50").state_dict()  # torchvision's keys are timm's: conv1, bn1, layer1.., fc
    (tmp_path / "torch" / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(sd, tmp_path / "torch" / "hub" / "checkpoints" / "resnet50-0676ba61.pth")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    flickr = tmp_path / "data" / "flickr30k"
    (flickr / "images").mkdir(parents=True)
    images = []
    for i, split in enumerate(("train",) * 4 + ("test",) * 3):
        PIL_image(i).save(flickr / "images" / f"{i}.jpg")
        images.append({"filename": f"{i}.jpg", "split": split,
                       "sentences": [{"raw": f"a {WORDS[10 + i]} at the {WORDS[25 + k % 4]} ."} for k in range(5)]})
    (flickr / "dataset_flickr30k.json").write_text(json.dumps({"images": images}))
    # the command: python m2mix.py --backbone bert-resnet50 --train-data flickr30k (weights in the caches)
    res = m2mix.main(["--backbone", "bert-resnet50", "--train-data", "flickr30k", "--data-root", str(tmp_path / "data"),
                      "--cache-dir", str(cache), "--out", str(tmp_path / "run"), "--steps", "1", "--batch-size", "2",
                      "--precision", "fp32", "--device", "cpu", "--workers", "0", "--save-every", "0"])
    assert res["summary"]["steps"] == 1
    assert {("ZS", "flickr30k-1cap"), ("m3-Mix", "flickr30k")} <= {(r["model"], r["task"]) for r in res["records"]}
    model = models.load_model("bert-resnet50", str(tmp_path / "run" / "model.pt"))[0]
    assert model.visual.trunk.fc.__class__.__name__ == "Identity" and common.embed_dim(model) == 256


def PIL_image(i: int):
    from PIL import Image
    return Image.new("RGB", (40, 30), (30 * i % 255, 90, 200 - 20 * i))


def test_a_trunk_file_of_another_network_is_refused_by_name(tmp_path, bert):
    torch.save(timm.create_model("resnet18").state_dict(), tmp_path / "r18.pth")
    with pytest.raises(RunError, match=r"is not a resnet50 trunk: missing \['.*other shapes \['layer1"):
        models.load_model("bert-resnet50", text_weights=str(bert), image_weights=str(tmp_path / "r18.pth"))


def test_random_init_needs_no_image_file_but_says_so(tmp_path, bert, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    res = m2mix.main(run_args(tmp_path, "--text-weights", str(bert), "--random-init", "--method", "ft"))
    assert res["summary"]["steps"] == 1


def test_table3_puts_the_papers_numbers_and_simat_beside_ours():
    recs = [{"task": "flickr30k-1cap", "model": "m3-Mix", "metric": m, "value": 20.0}
            for m in ("i2t_R@1", "i2t_R@10")] + [{"task": "simat", "model": "m3-Mix", "metric": "simat", "value": 9.0}]
    out = m2mix_analysis.table(recs, "bert-resnet50")
    row = next(x for x in out.splitlines() if x.startswith("| m3-Mix"))
    assert "20.0 (19.5)" in row and "20.0 (63.8)" in row and "9.0 (16.2)" in row
    assert "| Un-Mix" in out and "- (15.8)" in out  # a baseline we do not run: the paper's number only
    assert m2mix.method_name(m2mix.M2MixConfig(method="ft", base_tau=0.05)) == "FT(tau=0.05)"
    assert m2mix.method_name(m2mix.M2MixConfig(method="ft", base_tau=0.01)) == "FT"


def _ddp_worker(rank, world, port, spec, args):
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    towers.SPECS["test-towers"] = spec
    m2mix.main(args)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_processes_train_the_towers_like_one(small_towers, tmp_path):
    """m3-Mix on the towers under 2 gloo processes (global batch 8 = 2 x 4, features gathered) reaches the weights
    of one process with batch 8 on the same data order: the same code path as CLIP's."""
    import socket
    data = tmp_path / "data"
    manifest = lab.synthetic_manifest("train", data, n=32)
    args = ["--backbone", small_towers, "--train-data", str(manifest), "--data-root", str(data), "--eval-tasks", "none",
            "--no-eval-base", "--batch-size", "8", "--precision", "fp32", "--device", "cpu", "--workers", "0",
            "--method", "m3", "--steps", "3", "--lr", "1e-3", "--save-every", "0"]
    m2mix.main(args + ["--out", str(tmp_path / "one")])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn_two(_ddp_worker, 2, port, towers.SPECS[small_towers], args + ["--out", str(tmp_path / "two")])
    one, two = (torch.load(tmp_path / d / "model.pt", weights_only=True) for d in ("one", "two"))
    start = models.load_model(small_towers)[0].state_dict()
    moved = sum((v.float() - start[k].float()).square().sum() for k, v in one.items()).sqrt()
    diff = sum((two[k].float() - v.float()).square().sum() for k, v in one.items()).sqrt()
    assert diff < 0.01 * moved, (diff, moved)


# ----------------------------------------------------------------------------- the lab's towers and demo
def test_the_shipped_lab_towers_are_the_recipes_and_load_as_lab_towers():
    lab.towers.check_shipped()
    model = models.load_model("lab-towers", seed=0)[0]
    from safetensors.torch import load_file
    shipped = load_file(str(lab.towers.shipped_dir() / "image.safetensors"))
    assert all(torch.equal(model.visual.trunk.state_dict()[k], v) for k, v in shipped.items())
    assert model.text.config.hidden_size == lab.towers.TEXT_CFG["hidden_size"]


def test_each_tower_pretrains_on_its_own_modality_and_loads(tmp_path, monkeypatch):
    """The recipe's two trainings on a few scenes (the shipped ones ran it at full size): the trunk learns the
    four attributes from pixels, the BERT masked words from captions; towers.py joins the results."""
    p = dict(lab.towers.RECIPE, n=64, image_epochs=1, text_epochs=1, batch=32)
    scenes = lab.world_split(lab.PRETRAIN, p["n"], seed=100)
    trunk = lab.towers.pretrain_image(scenes, p)
    torch.save(trunk.state_dict(), tmp_path / "trunk.pth")
    lab.towers.pretrain_text([s["caption"] for s in scenes], tmp_path / "text", p)
    assert (tmp_path / "text" / "vocab.txt").read_text().split("\n")[:5] == lab.towers.SPECIALS
    monkeypatch.setitem(towers.SPECS, "fresh", dataclasses.replace(lab.towers.SPEC, text_dirs=(tmp_path / "text",),
                                                                 image_files=(tmp_path / "trunk.pth",)))
    model, _, _, tok = models.load_model("fresh")
    assert torch.equal(model.visual.trunk.conv1.weight, trunk.conv1.weight)
    assert (tok([scenes[0]["caption"]]) == 1).sum() == 0  # every word of the world is in the vocabulary: no [UNK]


def test_unimodal_demo_writes_claims_results_and_figure(tmp_path, shrink_world, check_demo_results):
    shrink_world({"train": 64, "test": 40}.get)
    out = tmp_path / "demo"
    m2mix.main(["--demo-unimodal", "--seeds", "0,1,2", "--steps", "2", "--warmup", "1", "--batch-size", "16",
                "--data-root", str(tmp_path / "data"), "--out", str(out)])
    saved = check_demo_results(out, "m2mix-unimodal-demo.png", ("ZS", "FT", "m2-Mix", "m3-Mix"), min_claims=8)
    assert saved["claims"][0]["direction"] == "range" and saved["claims"][0]["interval"] == [-1.0, 1.0]


def test_the_committed_unimodal_demo_is_the_one_its_docs_print():
    from lab import report
    path = Path(m2mix.__file__).parent / "docs" / "m2mix-unimodal-demo-results.json"
    saved = json.loads(path.read_text())
    assert saved["seeds"] == list(lab.SEEDS) and saved["config"]["steps"] == 200
    text = (Path(m2mix.__file__).parent / "docs" / "m2mix.md").read_text()
    assert lab.claims_table(saved["claims"]) in text
    readme = (Path(m2mix.__file__).parent / "README.md").read_text()  # issue 70: the fresh seeds' verdict beside
    assert report.claims_lines(path, path.with_name("m2mix-unimodal-demo-fresh-results.json")) in readme


def _plant_remote_code(folder: Path, marker: Path, drop_model_type: bool):
    """A model folder whose config.json asks transformers to run the folder's own Python (issue 41.0): the
    payload would create `marker`."""
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                    "from transformers import BertConfig as EvilConfig, BertModel as EvilModel\n")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"}
    if drop_model_type:
        cfg.pop("model_type")
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("drop_model_type", [True, False])
def test_a_text_folder_that_asks_to_run_its_code_is_refused_through_text_weights(tmp_path, drop_model_type):
    folder, marker = write_bert(tmp_path / "bert"), tmp_path / "marker"
    _plant_remote_code(folder, marker, drop_model_type)
    with pytest.raises(RunError, match=r"config\.json asks to run Python code from its folder.*refused"):
        m2mix.main(run_args(tmp_path, "--text-weights", str(folder), "--random-init", "--method", "ft"))
    assert not marker.exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_saved_run_whose_text_folder_asks_to_run_code_is_refused(small_towers, tmp_path):
    model = models.load_model(small_towers)[0]
    models.save_model(model, tmp_path / "run" / "model.pt", small_towers)
    marker = tmp_path / "marker"
    models.load_model(small_towers, str(tmp_path / "run" / "model.pt"))  # the untouched folder loads
    _plant_remote_code(tmp_path / "run" / "model-text", marker, drop_model_type=True)
    with pytest.raises(RunError, match=r"model-text/config\.json asks to run Python code"):
        models.load_model(small_towers, str(tmp_path / "run" / "model.pt"))
    (tmp_path / "run" / "model-text" / "config.json").write_text('{"model_type": "evil-net"}')
    with pytest.raises(RunError, match=r"model_type 'evil-net' is not one transformers ships"):
        models.load_model(small_towers, str(tmp_path / "run" / "model.pt"))
    tok = tmp_path / "run" / "model-text" / "tokenizer_config.json"
    (tmp_path / "run" / "model-text" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    tok.write_text(json.dumps({**json.loads(tok.read_text()), "auto_map": {"AutoTokenizer": ["evil.T", None]}}))
    with pytest.raises(RunError, match=r"tokenizer_config\.json asks to run Python code"):
        models.load_model(small_towers, str(tmp_path / "run" / "model.pt"))
    assert not marker.exists()


def test_a_saved_towers_model_loads_without_open_clips_random_init_warning(small_towers, tmp_path, caplog):
    """Issue 41.6: a saved towers model is built by open_clip without weights and loaded from its file right after;
    open_clip's "Model initialized randomly" is dropped there, and kept for --random-init."""
    import logging
    model = models.load_model(small_towers)[0]
    models.save_model(model, tmp_path / "model.pt", small_towers)
    with caplog.at_level(logging.INFO):
        again = models.load_model(small_towers, str(tmp_path / "model.pt"))[0]
        assert not [r for r in caplog.records if "initialized randomly" in r.getMessage()]
        models.load_model(small_towers, "random")
    assert [r for r in caplog.records if "initialized randomly" in r.getMessage()]
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())


def test_the_unimodal_demo_takes_the_labs_own_flags():
    """`python m2mix.py --demo-unimodal --seeds 10,11` reaches the lab (the early flag check left it to argparse,
    which refused --seeds); a method flag error is still answered early."""
    from plumbing import flags
    import m2mix
    flags.answer_early(m2mix.M2MixConfig, argv=["--demo-unimodal", "--seeds", "10,11,12"])  # no exit
    with pytest.raises(SystemExit):
        flags.answer_early(m2mix.M2MixConfig, argv=["--seeds", "10,11,12"])


def test_caption_cleaning_none_hands_bert_the_captions_as_given(small_towers):
    """Issue 40.4, T7: open_clip's HFTokenizer runs ftfy and unescapes HTML entities before BERT ('&amp;' becomes
    '&'); the released code hands the raw caption to BertTokenizer: --caption-cleaning none."""
    cfg = parse_config(m2mix.M2MixConfig, ["--backbone", small_towers, "--caption-cleaning", "none"])
    assert towers.tower_settings(cfg)["clean"] == "none"
    cleaned = models.load_model(small_towers)[3]
    raw = models.load_model(small_towers, **towers.tower_settings(cfg))[3]
    assert torch.equal(cleaned(["a red &amp; blue star"]), cleaned(["a red & blue star"]))
    assert not torch.equal(raw(["a red &amp; blue star"]), raw(["a red & blue star"]))
    assert torch.equal(raw(["a red & blue star"]), cleaned(["a red & blue star"]))  # nothing else changes


@pytest.mark.parametrize("augment", ["crop", "none"])
def test_augment_none_trains_on_the_evaluation_transform(augment, monkeypatch, tmp_path):
    """Issue 40.4, m2mix.py deviation 21: the released code feeds clip.load's preprocess (resize + centre crop) to
    its training set; ours open_clip's random resized crop unless --augment none."""
    class Seen(Exception):
        pass

    real = common.training_set

    def stop(cfg, manifest, transform=None, **kw):
        if transform is None:  # the preflight's row check
            return real(cfg, manifest, **kw)
        raise Seen(transform)

    monkeypatch.setattr(common, "training_set", stop)
    with pytest.raises(Seen) as seen:
        m2mix.main(["--backbone", "tiny", "--train-data", "synthetic", "--data-root", str(tmp_path / "data"),
                    "--out", str(tmp_path / "run"), "--eval-tasks", "none", "--no-eval-base", "--augment", augment,
                    "--device", "cpu", "--precision", "fp32", "--workers", "0"])
    shown = str(seen.value.args[0])
    assert ("RandomResizedCrop" in shown) == (augment == "crop") and ("CenterCrop" in shown) == (augment == "none")
