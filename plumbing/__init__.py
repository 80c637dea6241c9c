"""What no method reader opens. Below common (common imports them): base (errors, atomic writes, world
size; standard library only), flags (the settings parser, the uni-modal towers' settings; standard library
only), published (the papers' numbers, ERCLIP's table layout; standard library only), loading (weights-only
loads, sidecars, foreign checkpoints), manifests (manifest reading, the row check, dist_info: rank and
world), training_sets (ERCLIP's COCO + ShareGPT4V set), runfolder (the --out lock, resume), towers
(uni-modal towers), shards (webdataset reading), cli (one message per expected failure, signals), trainlog
(the training loop's bar, metrics.jsonl and tensorboard, its end-of-run counts) and models (the backbone names,
load_model, the tokenizer cache, save_model, open_clip's hub layout; the lab's LAB_HOOKS).
Above common, below eval (eval imports the first and last): m2mix_analysis (m2-Mix's geometry, ECE, SIMAT
score and tables), train_manifests (the Karpathy / COCO training manifests, m2mix.py's choice of them) and
wise_ft (WiSE-FT's weight interpolation). Above common and eval: export, vlcl (C-CLIP's benchmark
builder), cclip_tasks (C-CLIP's task list, evaluation sets, per-task learning rates, research schedule),
write_shards, mosei (GMC's MOSEI reader), cmcl (DNS's plumbing: frozen CLIP features and the maps'
evaluation; CMCL's feature readers, step plan and tables; the drivers; the projection's activation form and
operation counts), sweeps (ERCLIP's sweeps on real data and the folder plumbing of every sweep: one folder
per run, data prefixes, per-epoch snapshots) and longclip_data (Long-CLIP's training manifests, its short
caption, an erclip.py results file read back). tests/test_layout.py holds the order.

The method files (erclip.py, longclip.py, m2mix.py, cclip.py, dns.py, gmc.py) sit on common.py and eval.py;
this package is their plumbing. Its commands run from the repository's root:

    python -m plumbing.export --pretrained runs/x/model.pt --out DIR [--format transformers]
    python -m plumbing.write_shards MANIFEST OUT_DIR [--per-shard 1000]
    python -m plumbing.vlcl [--source research|koyoimai]
"""
