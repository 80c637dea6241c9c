"""Commands above eval.py, run from the repository's root:

    python -m commands.export --pretrained runs/x/model.pt --out DIR [--format transformers]
    python -m commands.write_shards MANIFEST OUT_DIR [--per-shard 1000]
    python -m commands.vlcl [--source research|koyoimai]     C-CLIP's VLCL benchmark builder
"""
