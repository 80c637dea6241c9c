"""LoRA's adapters as files (issue 59.2): peft's adapter layout (adapter_model.safetensors + adapter_config.json)
written from the adapters of common.py's LoRA, so peft's PeftModel.from_pretrained loads them onto the untouched
backbone (tests/test_lora.py loads one with peft). The adapters themselves (common.LoRA, add_lora, merge_lora) are
method math and live in common.py; this is their file format only.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from plumbing import flags, folders
from plumbing.base import RunError

DEFAULT_TARGETS = flags.DEFAULT_LORA_TARGETS  # C-CLIP's: attention in / out and the MLP's two weights
ADAPTER_FOLDER = "lora_adapter"  # <out>/lora_adapter: the peft adapter of a --lora run
RECEIPT = "adapter_receipt.json"  # the files the adapter's write put there (plumbing.folders.atomic_folder)


# --- peft's adapter layout ---
# peft wraps an nn.MultiheadAttention whole: its lora_A / lora_B adapt in_proj_weight, and a nested Linear LoRA
# sits on its out_proj (keys ...attn.lora_A.weight and ...attn.base_layer.out_proj.lora_A.weight); an nn.Linear
# gets ...c_fc.lora_A.weight. One side of an attention not adapted here is written with B = 0 (no change).
def _peft_module(name: str) -> tuple[str, str]:
    """(peft target module, peft key prefix) of an adapted weight name."""
    if name.endswith(".in_proj_weight"):
        mod = name.removesuffix(".in_proj_weight")
        return mod, mod
    if name.endswith(".out_proj.weight") and ".attn." in f".{name}":
        mod = name.removesuffix(".out_proj.weight")
        return mod, f"{mod}.base_layer.out_proj"
    mod = name.removesuffix(".weight")
    return mod, mod


def export_peft(model, found: dict, folder, base_model: str = "") -> Path:
    """peft's adapter layout of `found` ({adapted weight's name: its adapter, with .A (r, in), .B (out, r) and .scale
    = alpha / r}: common.adapters(model)) in `folder`: adapter_model.safetensors with
    base_model.model.<module>.lora_{A,B}.weight and adapter_config.json (LoRA, r, lora_alpha, target_modules), so
    PeftModel.from_pretrained(<the backbone as loaded>, folder) builds the adapted model. Every adapter must share
    one rank and scale (peft's config has one)."""
    from safetensors.torch import save_file  # installed with open_clip
    if not found:
        raise ValueError("export_peft: the model has no LoRA adapters")
    ranks = {(m.A.shape[0], m.scale) for m in found.values()}
    if len(ranks) != 1:
        raise ValueError(f"export_peft: adapters of several ranks / scales {sorted(ranks)}; peft's config has one")
    (rank, scale), = ranks
    sd, modules = {}, set()
    for name, m in found.items():
        mod, prefix = _peft_module(name)
        modules.add(mod)
        sd[f"base_model.model.{prefix}.lora_A.weight"] = m.A.detach().cpu().float().contiguous()
        sd[f"base_model.model.{prefix}.lora_B.weight"] = m.B.detach().cpu().float().contiguous()
    for mod in sorted(modules):  # an attention adapted on one side only: the other side at B = 0
        attn = model.get_submodule(mod)
        if not isinstance(attn, nn.MultiheadAttention):
            continue
        for prefix, rows in ((mod, 3 * attn.embed_dim), (f"{mod}.base_layer.out_proj", attn.embed_dim)):
            key = f"base_model.model.{prefix}.lora_"
            if key + "A.weight" not in sd:
                sd[key + "A.weight"] = torch.zeros(rank, attn.embed_dim)
                sd[key + "B.weight"] = torch.zeros(rows, rank)
    config = {"peft_type": "LORA", "task_type": None, "r": rank, "lora_alpha": scale * rank, "lora_dropout": 0.0,
              "target_modules": sorted(modules), "bias": "none", "fan_in_fan_out": False,
              "init_lora_weights": True, "modules_to_save": None, "base_model_name_or_path": base_model}

    def write(tmp: Path):
        save_file(sd, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    # issue 69.2 / 69.6: whole or not at all, the export's permissions, and never over a folder it did not write
    folders.check_target(folder, "the LoRA adapter folder", RECEIPT)
    try:
        return folders.atomic_folder(Path(folder), write, what="LoRA adapter", marker=RECEIPT)
    except folders.FolderInterrupted as e:  # at a run's end: named beside what the run keeps, and how to finish
        from plumbing.cli import interrupted_message
        raise RunError(f"{e}; {interrupted_message(e.signum)[0]}", e.code) from None
