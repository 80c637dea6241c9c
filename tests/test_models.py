"""load_model: names, weights, the QuickGELU guard, failing fast without weights, the tiny backbone."""
import time

import open_clip
import pytest

from plumbing.base import UsageError
from plumbing import models


def test_openai_and_open_clip_names_resolve():
    assert models.resolve_backbone("ViT-B/16") == "ViT-B-16"
    assert models.resolve_backbone("ViT-L/14") == "ViT-L-14"
    assert models.resolve_backbone("RN50") == "RN50"
    assert models.resolve_backbone("ViT-B-32") == "ViT-B-32"
    assert models.resolve_backbone("tiny") == models.TINY_NAME
    with pytest.raises(ValueError, match="unknown backbone"):
        models.resolve_backbone("ViT-Q/99")


def test_missing_weights_fail_fast_with_instructions(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "_hub_reachable", lambda timeout=3.0: False)
    t0 = time.time()
    with pytest.raises(RuntimeError, match=r"cannot get the ViT-B-16 weights 'openai'.*--pretrained /path/to/file.pt"):
        models.load_model("ViT-B/16", cache_dir=str(tmp_path))
    assert time.time() - t0 < 10


def test_unknown_tag_or_path_is_an_error():
    with pytest.raises(ValueError, match="neither a file nor an open_clip tag"):
        models.load_model("ViT-B/32", "no-such-tag-or-file")


def test_quick_gelu_guard(monkeypatch, tmp_path):
    import torch
    # OpenAI's weights were trained with QuickGELU: asking for plain GELU with them is refused
    with pytest.raises(ValueError, match="quick_gelu=True"):
        models.load_model("ViT-B/32", "openai", quick_gelu=False)
    # a raw local file under an OpenAI spelling gets QuickGELU; the sidecar decides for our own files
    seen = {}
    real = open_clip.create_model_and_transforms

    def spy(name, pretrained=None, force_quick_gelu=False, **kw):
        seen["qg"] = force_quick_gelu
        raise RuntimeError("stop before building a large model")

    monkeypatch.setattr(open_clip, "create_model_and_transforms", spy)
    f = tmp_path / "ViT-B-32.pt"
    torch.save({"logit_scale": torch.zeros(())}, f)  # a state_dict (an empty file is refused before open_clip)
    with pytest.raises(RuntimeError, match="stop"):
        models.load_model("ViT-B/32", str(f))
    assert seen["qg"] is True
    (tmp_path / "ViT-B-32.pt.json").write_text('{"model": "ViT-B-32", "quick_gelu": false}')
    with pytest.raises(RuntimeError, match="stop"):
        models.load_model("ViT-B/32", str(f))
    assert seen["qg"] is False
    monkeypatch.setattr(open_clip, "create_model_and_transforms", real)


def test_sidecar_of_another_model_is_refused(tmp_path):
    f = tmp_path / "m.pt"
    f.write_bytes(b"")
    (tmp_path / "m.pt.json").write_text('{"model": "ViT-B-16"}')
    with pytest.raises(ValueError, match="holds a ViT-B-16 model"):
        models.load_model("ViT-B/32", str(f))


def test_the_cached_tokenizer_gives_the_wrapped_tokenizers_tokens():
    """models.get_tokenizer remembers texts (captions recur every epoch and evaluation); the tokens are the
    wrapped open_clip tokenizer's, per window, across a refill of the bounded cache and through pickling
    (DataLoader workers)."""
    import pickle
    import torch
    import lab  # noqa: F401  the tiny backbone's config
    tok = models.get_tokenizer("tiny")
    raw = tok.tokenizer
    texts = ["a red circle.", "two blue stars at the top left.", "a red circle.", "x " * 40]
    assert torch.equal(tok(texts), raw(texts)) and torch.equal(tok(texts), raw(texts))  # cold, then cached
    assert torch.equal(tok(texts, 8), raw(texts, context_length=8)) and tok("a red circle.").shape == (1, 24)
    small = models.CachedTokenizer(raw, size=2)
    assert torch.equal(small(texts), raw(texts)) and len(small.rows) <= 3  # cleared, then refilled
    again = pickle.loads(pickle.dumps(tok))
    assert torch.equal(again(texts), raw(texts)) and again.context_length == raw.context_length


def test_the_cached_tokenizer_survives_a_refill_by_a_call_that_mixes_cached_and_new_texts():
    """Issue 61: a call whose new texts overflow the cache while others of it were cached (ImageNet's 80,000 prompts,
    then a shift's prompts with the same class names) cleared the cached ones too and raised KeyError."""
    import torch
    import lab  # noqa: F401  the tiny backbone's config
    raw = models.get_tokenizer("tiny").tokenizer
    small = models.CachedTokenizer(raw, size=3)
    small(["a.", "b."])
    mixed = ["a.", "c.", "d.", "b."]  # two cached, two new: 2 + 2 > 3
    assert torch.equal(small(mixed), raw(mixed))


def test_open_clips_tokenizer_is_built_once_per_backbone_and_window():
    """get_tokenizer reuses open_clip's tokenizer of a (backbone, window, config) and gives its tokens: a fresh
    open_clip.get_tokenizer, a new window, and a changed config are not confused with the first."""
    import open_clip
    import torch
    import lab  # noqa: F401  the tiny backbone's config
    texts = ["a red circle.", "two blue stars at the top left and a ring below them."]
    first, second = models.get_tokenizer("tiny"), models.get_tokenizer("tiny")
    assert first is second  # one text memo per process and backbone (tokens depend on the text alone): issue 39.4
    assert torch.equal(first(texts), open_clip.get_tokenizer(models.TINY_NAME)(texts))
    short = models.get_tokenizer("tiny", 8)
    assert short.tokenizer is not first.tokenizer
    assert torch.equal(short(texts), open_clip.get_tokenizer(models.TINY_NAME, context_length=8)(texts))
    assert models._open_clip_tokenizer(models.TINY_NAME, None, "{}") is not first.tokenizer  # another config


def test_long_clip_and_m2_mix_checkpoint_layouts_load(tiny_random, tmp_path, capsys):
    """Issue 25.12: Long-CLIP's released layout (positions < 20 in positional_embedding, the rest in
    positional_embedding_res, model_longclip.py's mask1 / mask2) and m2-Mix's {'model_state_dict': ...} (with a
    key of its own model) load through --pretrained, written here by hand in those layouts (no network)."""
    import torch
    sd = {k: v.clone() for k, v in tiny_random[0].state_dict().items() if k != "attn_mask"}
    g = torch.Generator().manual_seed(0)
    width = sd["positional_embedding"].shape[1]
    pe, res = torch.randn(40, width, generator=g), torch.randn(40, width, generator=g)
    torch.save({**sd, "positional_embedding": pe.half(), "positional_embedding_res": res.half()}, tmp_path / "lc.pt")
    model, _, _, tok = models.load_model("tiny", str(tmp_path / "lc.pt"), cache_dir=str(tmp_path / "cache"))
    assert torch.equal(model.positional_embedding, torch.cat([pe[:20], res[20:]]).half().float())
    assert tok("a red circle").shape == (1, 40) and model.encode_text(tok("a red circle")).shape[0] == 1
    assert "Long-CLIP" in capsys.readouterr().err
    extra = torch.randn(width, 8)
    torch.save({"model_state_dict": {**sd, "text_projection_mix": extra}}, tmp_path / "m2.pt")
    model, _, _, _ = models.load_model("tiny", str(tmp_path / "m2.pt"), cache_dir=str(tmp_path / "cache"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())
    assert "dropped ['text_projection_mix']" in capsys.readouterr().err
    converted = next((tmp_path / "cache" / "converted").glob("m2-*.pt"))
    converted.write_bytes(converted.read_bytes()[:500])  # the cached copy cut short (issue 26.6): converted again
    model, _, _, _ = models.load_model("tiny", str(tmp_path / "m2.pt"), cache_dir=str(tmp_path / "cache"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())
    assert "the converted copy is truncated: converting again" in capsys.readouterr().err


def _foreign_file(tiny_random, path, layout):
    """The tiny model's weights written by hand in Long-CLIP's or m2-Mix's layout."""
    import torch
    sd = {k: v.clone() for k, v in tiny_random[0].state_dict().items() if k != "attn_mask"}
    if layout == "longclip":
        pe = sd["positional_embedding"]
        torch.save({**sd, "positional_embedding_res": pe + 1}, path)
    else:
        torch.save({"model_state_dict": sd}, path)
    return str(path)


@pytest.mark.parametrize("layout", ["longclip", "m2mix"])
@pytest.mark.parametrize("spelling", ["open_clip", "openai", "tiny"])
def test_a_foreign_checkpoint_gets_quick_gelu_whatever_the_backbones_spelling(tiny_random, tmp_path, monkeypatch,
                                                                              layout, spelling):
    """Issue 40.1: Long-CLIP's and m2-Mix's checkpoints are OpenAI-initialised (trained with QuickGELU). The choice
    was made from the backbone's spelling before the file was recognised, so `--backbone ViT-B-16 --pretrained
    longclip-B.pt` built GELU silently and only `ViT-B/16` was right. Here the tiny model under an open_clip
    name, an OpenAI-style name (registered for the test) and the 'tiny' alias; the activations are QuickGELU."""
    import torch
    from open_clip.transformer import QuickGELU
    monkeypatch.setitem(models.OPENAI_NAMES, "clipft/tiny", models.TINY_NAME)
    backbone = {"open_clip": models.TINY_NAME, "openai": "clipft/tiny", "tiny": "tiny"}[spelling]
    f = _foreign_file(tiny_random, tmp_path / f"{layout}.pt", layout)
    model = models.load_model(backbone, f, cache_dir=str(tmp_path / "cache"))[0]
    acts = [m for m in model.modules() if isinstance(m, (QuickGELU, torch.nn.GELU))]
    assert model.quick_gelu is True and acts and all(isinstance(m, QuickGELU) for m in acts)
    # a plain GELU asked for with such weights is refused (as for an open_clip tag), one message
    with pytest.raises(ValueError, match=r"trained with quick_gelu=True \(an OpenAI-initialised layout\); refusing"):
        models.load_model(backbone, f, cache_dir=str(tmp_path / "cache"), quick_gelu=False)


def test_our_sidecars_quick_gelu_wins_and_a_contradicting_choice_is_refused(tiny_random, tmp_path):
    """Issue 40.1: the sidecar records what the weights were trained with: it decides whatever the spelling, and an
    explicit quick_gelu against it is refused instead of silently building the other activation."""
    from open_clip.transformer import QuickGELU
    model = tiny_random[0]
    model.quick_gelu = True
    f = models.save_model(model, tmp_path / "m.pt", "tiny")
    again = models.load_model("tiny", str(f))[0]
    assert again.quick_gelu is True and any(isinstance(m, QuickGELU) for m in again.modules())
    assert models.load_model("tiny", str(f), quick_gelu=True)[0].quick_gelu is True
    with pytest.raises(ValueError, match=r"trained with quick_gelu=True \(its sidecar\); refusing False"):
        models.load_model("tiny", str(f), quick_gelu=False)


# ------------------------------------------------------------------ issue 41.3: malformed model files and sidecars
def _saved(tiny_random, folder):
    """The tiny model saved as the runs save it: model.pt and model.safetensors, each with its sidecar."""
    f = models.save_model(tiny_random[0], folder / "model.pt", "tiny")
    assert f.with_suffix(".safetensors").exists() and (folder / "model.safetensors.json").exists()
    return f


def _state(tiny_random, **change):
    sd = {k: v.clone() for k, v in tiny_random[0].state_dict().items()}
    return {**sd, **change}


def test_a_cut_model_file_is_one_message_naming_it(tiny_random, tmp_path):
    """(a) a model.safetensors cut short raised safetensors' SafetensorError (a .pt: torch's zip error)."""
    f = _saved(tiny_random, tmp_path)
    for path in (f.with_suffix(".safetensors"), f):
        whole = path.read_bytes()
        path.write_bytes(whole[: len(whole) // 2])
        with pytest.raises(UsageError, match=rf"{path}: not a readable model file \(.+\); copy it again"):
            models.load_model("tiny", str(path))
    with pytest.raises(UsageError, match=r"model.pt: not a readable model file \(cut short: a zip archive"):
        models.load_model("tiny", str(f))


def test_weights_of_another_shape_are_one_message_naming_the_tensor(tiny_random, tmp_path):
    """(b) tensors of another architecture raised torch's "Error(s) in loading state_dict" RuntimeError."""
    import torch
    f = _saved(tiny_random, tmp_path)
    width = tiny_random[0].text_projection.shape[0]
    safe = f.with_suffix(".safetensors")
    models.safetensors_save(_state(tiny_random, text_projection=torch.zeros(width, 7)), safe)
    with pytest.raises(UsageError, match=rf"model.safetensors does not fit the {models.TINY_NAME} "
                                                rf"architecture: text_projection is \[{width}, 7\] in the file, "
                                                rf"\[{width}, {width}\] in {models.TINY_NAME}; pass the backbone"):
        models.load_model("tiny", str(safe))


def test_a_bare_file_builds_its_own_window_and_another_width_is_refused(tiny_random, tmp_path, capsys):
    """(c) a .pt without its sidecar whose positional embedding has other rows than the config's window was
    squeezed into it by open_clip's interpolation (silently); another width raised its AssertionError."""
    import torch
    rows, width = tiny_random[0].positional_embedding.shape
    pe = torch.randn(rows + 16, width, generator=torch.Generator().manual_seed(0))
    torch.save(_state(tiny_random, positional_embedding=pe), tmp_path / "bare.pt")
    model, _, _, tok = models.load_model("tiny", str(tmp_path / "bare.pt"))
    assert torch.equal(model.positional_embedding, pe) and tok("a red circle").shape == (1, rows + 16)
    assert f"the weights' text window is {rows + 16} positions" in capsys.readouterr().err
    torch.save(_state(tiny_random, positional_embedding=torch.zeros(rows, width + 8)), tmp_path / "wide.pt")
    with pytest.raises(UsageError, match=rf"wide.pt: its text positional embedding is {width + 8} wide"):
        models.load_model("tiny", str(tmp_path / "wide.pt"))


@pytest.mark.parametrize("text, what", [("[1, 2]", "holds an array"), ("5", "holds a number"),
                                        ('"tiny"', "holds a string"), ("null", "holds null")])
def test_a_sidecar_that_is_not_an_object_is_one_message_naming_it(tiny_random, tmp_path, text, what):
    """(d) a sidecar holding a list raised AttributeError ('list' object has no attribute 'get'), a number
    TypeError."""
    f = _saved(tiny_random, tmp_path)
    (tmp_path / "model.pt.json").write_text(text)
    with pytest.raises(UsageError, match=rf"{f}.json, the sidecar of {f} .*, {what}, not an object"):
        models.load_model("tiny", str(f))


@pytest.mark.parametrize("key, value", [("context_length", "abc"), ("context_length", 0), ("context_length", 2.5),
                                        ("quick_gelu", "false"), ("model", 3)])
def test_a_sidecar_field_of_the_wrong_type_is_one_message_naming_it(tiny_random, tmp_path, key, value):
    """(e) "context_length": "abc" raised a TypeError inside open_clip; "quick_gelu": "false" was read as True."""
    import json
    f = _saved(tiny_random, tmp_path)
    meta = json.loads((tmp_path / "model.pt.json").read_text())
    (tmp_path / "model.pt.json").write_text(json.dumps({**meta, key: value}))
    with pytest.raises(UsageError, match=rf"sidecar of {f}: {key} is {json.dumps(value)}, not "):
        models.load_model("tiny", str(f))


def test_a_sidecar_window_other_than_the_weights_is_refused_not_interpolated(tiny_random, tmp_path):
    """(f) a sidecar saying context_length 77 beside weights of 24 positions was obeyed: the table was stretched to
    77 rows by interpolation, silently. Both files of a run (model.pt, model.safetensors) are checked."""
    import json
    f = _saved(tiny_random, tmp_path)
    rows = tiny_random[0].positional_embedding.shape[0]
    for path in (f, f.with_suffix(".safetensors")):
        side = path.with_name(path.name + ".json")
        side.write_text(json.dumps({**json.loads(side.read_text()), "context_length": rows + 53}))
        with pytest.raises(UsageError, match=rf"{path}: its sidecar {path}.json says context_length "
                                                    rf"{rows + 53}, but the weights' positional embedding has {rows} "
                                                    rf"positions; refusing to interpolate"):
            models.load_model("tiny", str(path))


def test_open_clips_random_init_warning_only_where_no_weights_follow(tmp_path, monkeypatch, caplog):
    """Issue 41.6: the first run expanded the shipped tiny weights after open_clip had warned "No pretrained
    weights loaded ... Model initialized randomly"; the warning is dropped there, and kept for a random model."""
    import logging
    import lab
    from plumbing import base
    monkeypatch.setattr(base, "CACHE_DIR", tmp_path)
    with caplog.at_level(logging.INFO):
        lab.pretrain_tiny()  # the first run: expanded from lab/weights/
        assert list(tmp_path.glob("tiny-synthetic-*.pt"))
        assert not [r for r in caplog.records if "initialized randomly" in r.getMessage()]
        models.load_model("tiny", "random")  # no weights follow: open_clip's warning stands
    assert [r for r in caplog.records if "initialized randomly" in r.getMessage()]
    assert not logging.getLogger().filters
