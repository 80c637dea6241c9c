"""Export a fine-tuned model to the layouts other code loads: open_clip's hub folder, or a Hugging Face
transformers CLIPModel folder (OpenAI-architecture ViTs).

  python -m commands.export --backbone ViT-B/16 --pretrained runs/erclip/model.pt --out exported/erclip-b16
  python -m commands.export --backbone ViT-B/16 --pretrained runs/erclip/model.pt --out exported/hf \
      --format transformers
  (training runs do the first with --export DIR; every model.pt save_model writes has a model.safetensors twin)

open_clip (open_clip_model.safetensors + open_clip_config.json): the config records the weights' QuickGELU and
text window, the two things plain open_clip gets wrong from a bare state_dict (GELU for OpenAI-initialised
weights, a stretched Long-CLIP window interpolated back to 77), so
    model, preprocess = open_clip.create_model_from_pretrained("local-dir:exported/erclip-b16")
    tokenizer = open_clip.get_tokenizer("local-dir:exported/erclip-b16")
gives our loader's features. transformers: the same weights as a CLIPModel, with the text window as
max_position_embeddings (248 for Long-CLIP), hidden_act quick_gelu for OpenAI weights, EOT pooling at token 49407,
the BPE as CLIPTokenizer files and open_clip's preprocessing as a CLIPImageProcessor; the export checks that both
models give the same features (max |difference| <= 1e-4) before it writes anything.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path


EPILOG = """Examples:
  python -m commands.export --backbone ViT-B/16 --pretrained runs/erclip/model.pt --out exported/erclip-b16
  python -m commands.export --backbone ViT-B/16 --pretrained runs/erclip/model.pt --out exported/hf \\
      --format transformers
  python -m lab export --backbone tiny --pretrained runs/x/model.pt --out exported/tiny

Loading the result: open_clip.create_model_from_pretrained("local-dir:OUT") for the open_clip layout,
transformers.CLIPModel.from_pretrained("OUT") for the transformers one, and --pretrained OUT (or
local-dir:OUT) in every script of this repository. docs/interop.md has the details."""


def command_line() -> argparse.ArgumentParser:
    prog = sys.argv[0] if sys.argv[0].startswith("python -m") else "python -m commands.export"  # lab's: its own
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False, epilog=EPILOG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default="tiny",
                   help="The architecture the model was trained as: an OpenAI name (ViT-B/16), an open_clip name "
                        "(ViT-B-16), or 'tiny' (the lab's, through python -m lab export). Default: tiny.")
    p.add_argument("--pretrained", required=True,
                   help="The model to export: a model.pt or model.safetensors that a run wrote (its .json sidecar "
                        "beside it), or a folder that --export wrote. Required.")
    p.add_argument("--out", required=True,
                   help="The folder to write, whole or not at all: a new path, an empty folder, or a previous "
                        "export, which is replaced only once the new one is complete. Required.")
    p.add_argument("--format", default="open_clip", choices=("open_clip", "transformers"),
                   help="The layout to write: open_clip's hub layout (loaded with local-dir:OUT), or a "
                        "transformers CLIPModel folder (OpenAI-architecture ViTs only). Default: open_clip.")
    return p


if __name__ == "__main__":
    command_line().parse_args()  # --help and bad flags answer here, before torch loads

import torch  # noqa: E402

from plumbing.base import RunError, UsageError
from plumbing.cli import cli
from plumbing import folders, models  # noqa: E402

BOS, EOS = 49406, 49407  # OpenAI's BPE: <start_of_text>, <end_of_text> (open_clip pools at the EOT token)


def _block_keys(src: str, dst: str, sd: dict) -> dict:
    """One open_clip residual block (ln_1, attn with a fused in_proj, ln_2, mlp.c_fc / c_proj) as transformers'
    CLIPEncoderLayer (layer_norm1, self_attn.q/k/v/out_proj, layer_norm2, mlp.fc1 / fc2)."""
    out = {}
    for kind in ("weight", "bias"):
        q, k, v = sd[f"{src}.attn.in_proj_{kind}"].chunk(3)
        out.update({f"{dst}.self_attn.q_proj.{kind}": q, f"{dst}.self_attn.k_proj.{kind}": k,
                    f"{dst}.self_attn.v_proj.{kind}": v})
        for a, b in (("attn.out_proj", "self_attn.out_proj"), ("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"),
                     ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
            out[f"{dst}.{b}.{kind}"] = sd[f"{src}.{a}.{kind}"]
    return out


def transformers_state(model) -> tuple[dict, dict]:
    """(CLIPConfig kwargs, state_dict) of an open_clip CLIP of the OpenAI architecture (ViT image tower with a
    class token, the built-in text transformer); anything else is refused by the feature check in to_transformers."""
    sd = {k: v.detach().cpu().float() for k, v in model.state_dict().items()}
    visual, text = model.visual, models.text_tower(model)
    width_t, width_v = sd["token_embedding.weight"].shape[1], sd["visual.conv1.weight"].shape[0]
    act = "quick_gelu" if getattr(model, "quick_gelu", False) else "gelu"
    config = dict(projection_dim=sd["text_projection"].shape[1], logit_scale_init_value=float(sd["logit_scale"]),
                  text_config=dict(vocab_size=sd["token_embedding.weight"].shape[0], hidden_size=width_t,
                                   intermediate_size=sd["transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
                                   num_hidden_layers=len(model.transformer.resblocks),
                                   num_attention_heads=model.transformer.resblocks[0].attn.num_heads,
                                   max_position_embeddings=int(text.context_length), hidden_act=act,
                                   layer_norm_eps=1e-5, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS,
                                   projection_dim=sd["text_projection"].shape[1]),
                  vision_config=dict(hidden_size=width_v, intermediate_size=sd[
                      "visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
                                     num_hidden_layers=len(visual.transformer.resblocks),
                                     num_attention_heads=visual.transformer.resblocks[0].attn.num_heads,
                                     image_size=visual.image_size[0] if isinstance(visual.image_size, tuple)
                                     else visual.image_size, patch_size=sd["visual.conv1.weight"].shape[-1],
                                     hidden_act=act, layer_norm_eps=1e-5,
                                     projection_dim=sd["text_projection"].shape[1]))
    hf = {"text_model.embeddings.token_embedding.weight": sd["token_embedding.weight"],
          "text_model.embeddings.position_embedding.weight": sd["positional_embedding"],
          "text_model.final_layer_norm.weight": sd["ln_final.weight"],
          "text_model.final_layer_norm.bias": sd["ln_final.bias"],
          "text_projection.weight": sd["text_projection"].t().contiguous(),
          "vision_model.embeddings.class_embedding": sd["visual.class_embedding"],
          "vision_model.embeddings.patch_embedding.weight": sd["visual.conv1.weight"],
          "vision_model.embeddings.position_embedding.weight": sd["visual.positional_embedding"],
          "vision_model.pre_layrnorm.weight": sd["visual.ln_pre.weight"],  # transformers' spelling
          "vision_model.pre_layrnorm.bias": sd["visual.ln_pre.bias"],
          "vision_model.post_layernorm.weight": sd["visual.ln_post.weight"],
          "vision_model.post_layernorm.bias": sd["visual.ln_post.bias"],
          "visual_projection.weight": sd["visual.proj"].t().contiguous(), "logit_scale": sd["logit_scale"]}
    for i in range(config["text_config"]["num_hidden_layers"]):
        hf.update(_block_keys(f"transformer.resblocks.{i}", f"text_model.encoder.layers.{i}", sd))
    for i in range(config["vision_config"]["num_hidden_layers"]):
        hf.update(_block_keys(f"visual.transformer.resblocks.{i}", f"vision_model.encoder.layers.{i}", sd))
    return config, hf


def _tokenizer_files(folder: Path, context_length: int):
    """open_clip's BPE (SimpleTokenizer) as CLIPTokenizer files: vocab.json (its special tokens under
    transformers' names) and merges.txt in rank order."""
    import open_clip
    from transformers import CLIPTokenizer
    bpe = open_clip.tokenizer.SimpleTokenizer()
    names = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "vocab.json").write_text(json.dumps({names.get(k, k): v for k, v in bpe.encoder.items()}))
        merges = sorted(bpe.bpe_ranks, key=bpe.bpe_ranks.get)
        (Path(tmp) / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
        CLIPTokenizer(str(Path(tmp) / "vocab.json"), str(Path(tmp) / "merges.txt"),
                      model_max_length=context_length).save_pretrained(str(folder))


def hf_features(out) -> torch.Tensor:
    """CLIPModel.get_image_features / get_text_features: a tensor, or (transformers 5) an output whose
    pooler_output holds the projected features."""
    return out if torch.is_tensor(out) else out.pooler_output


def to_transformers(model, folder, check_tokens=None) -> Path:
    """A transformers CLIPModel folder (config.json, model.safetensors, the tokenizer and image processor files)
    holding `model`'s weights, written only after both models' image and text features agree to 1e-4 on a
    random image batch and check_tokens (default: a tokenised caption)."""
    try:
        from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel
    except ImportError:
        raise UsageError("--format transformers needs the transformers package: pip install transformers") \
            from None
    folder = Path(folder)
    config, sd = transformers_state(model)
    hf = CLIPModel(CLIPConfig(**config)).eval()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise RunError(f"export to transformers: this model is not of the OpenAI CLIP layout (missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]})")
    size = config["vision_config"]["image_size"]
    image = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    import open_clip
    tokens = check_tokens if check_tokens is not None else open_clip.tokenize(
        ["a photo of a red circle.", "two dogs"], context_length=config["text_config"]["max_position_embeddings"])
    model = model.float().eval()
    with torch.no_grad():
        gap = max((model.encode_image(image) - hf_features(hf.get_image_features(pixel_values=image))).abs().max(),
                  (model.encode_text(tokens) - hf_features(hf.get_text_features(input_ids=tokens))).abs().max()).item()
    if not gap <= 1e-4:
        raise RunError(f"export to transformers: the converted model's features differ from ours by {gap:.2g}"
                              f" (> 1e-4): this architecture is not the OpenAI layout the converter handles")
    pp = getattr(model.visual, "preprocess_cfg", {})

    def write(tmp: Path):  # whole or not at all (folders.atomic_folder), as the open_clip layout
        hf.save_pretrained(str(tmp))
        _tokenizer_files(tmp, config["text_config"]["max_position_embeddings"])
        CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                           image_mean=list(pp.get("mean", (0.48145466, 0.4578275, 0.40821073))),
                           image_std=list(pp.get("std", (0.26862954, 0.26130258, 0.27577711)))
                           ).save_pretrained(str(tmp))
    models.check_export(folder, "--out")
    return folders.atomic_folder(folder, write, marker=models.EXPORT_RECEIPT)


def main(argv=None, world=None):
    a = command_line().parse_args(argv)
    if models.wants_lab(a) and not models.tiny_known():  # the lab sits above: python -m lab export loads it
        raise UsageError("--backbone tiny is the lab's: run this command as python -m lab export ARGS")
    models.check_export(a.out, "--out")  # before the model is read
    try:
        model = models.load_model(a.backbone, a.pretrained, world=world)[0]
        if a.format == "open_clip":
            models.export_open_clip(model, a.out, a.backbone)
        else:
            to_transformers(model, a.out)
    except KeyboardInterrupt as e:  # before the writing began (folders.atomic_folder names what it wrote)
        signum = getattr(e, "signum", signal.SIGINT)
        raise RunError(f"interrupted (signal {signum}) while reading {a.pretrained} and preparing the "
                              f"export, before anything was written to {a.out}: nothing there changed; run the "
                              f"command again to export", 128 + signum) from None
    print(f"[export] {a.pretrained} -> {a.out} ({a.format})", file=sys.stderr)
    return Path(a.out)


if __name__ == "__main__":
    cli(main)
