"""What no method reader opens. Below common (common imports them): base (errors, atomic writes, world
size; standard library only), flags (the settings parser; standard library only), loading (weights-only
loads, sidecars, foreign checkpoints), manifests (manifest reading, the row check), training_sets (ERCLIP's
COCO + ShareGPT4V set), runfolder (the --out lock, resume), towers (uni-modal towers), shards (webdataset
reading) and cli (one message per expected failure, signals). Above common and eval: export, vlcl (C-CLIP's
benchmark builder), write_shards, mosei (GMC's MOSEI reader), sweeps (ERCLIP's sweeps on real data and the
folder plumbing of every sweep: one folder per run, data prefixes, per-epoch snapshots), longclip_data
(Long-CLIP's training manifests, its short caption, an erclip.py results file read back) and cclip_tasks
(C-CLIP's task list, evaluation sets and per-task learning rates). tests/test_layout.py holds the order.

The method files (erclip.py, longclip.py, m2mix.py, cclip.py, dns.py, gmc.py) sit on common.py and eval.py;
this package is their plumbing. Its commands run from the repository's root:

    python -m plumbing.export --pretrained runs/x/model.pt --out DIR [--format transformers]
    python -m plumbing.write_shards MANIFEST OUT_DIR [--per-shard 1000]
    python -m plumbing.vlcl [--source research|koyoimai]
"""
