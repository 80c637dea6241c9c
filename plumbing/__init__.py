"""What no method reader opens: the settings parser, the run folder, webdataset shards, uni-modal towers,
export to open_clip's hub layout and transformers, and C-CLIP's benchmark builder.

The method files (erclip.py, longclip.py, m2mix.py, cclip.py, dns.py, gmc.py) sit on common.py and eval.py;
this package is their plumbing. Its commands run from the repository's root:

    python -m plumbing.export --pretrained runs/x/model.pt --out DIR [--format transformers]
    python -m plumbing.write_shards MANIFEST OUT_DIR [--per-shard 1000]
    python -m plumbing.vlcl [--source research|koyoimai]
"""
