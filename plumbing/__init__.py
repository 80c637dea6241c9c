"""The machinery below common.py that no method reader needs to open. It never imports common, eval, a method
file, papers/, commands/ or the lab (tests/test_layout.py checks every import, function-local ones included).

  base, flags, published, results, outfolder, folders   standard library only: errors, the settings parser, the
                                                        papers' numbers, the results schema, the --out checks,
                                                        folders written whole (--help answers before torch loads)
  loading, manifests, datafolders, shards               files as data: weights-only loads, manifests and the row
                                                        check, Hugging Face / sidecar folders, webdataset shards
  runfolder, cli, trainlog, reporting                   the run folder, its lock, resume and checkpoints; one
                                                        message per expected failure, signals; the training
                                                        log (bar, metrics.jsonl) and --report-to's backends
                                                        (tensorboard, wandb, trackio)
  param_rates                                           AdamW's per-parameter rates: --lr-image / --lr-text,
                                                        open_clip's layer-wise lr decay
  models, towers                                        backbone names, load_model, save_model, the export
                                                        formats; uni-modal towers
  train_manifests, wise_ft, m2mix_analysis              what eval.py and the methods read: Karpathy / COCO
                                                        training manifests, WiSE-FT's interpolation and its
                                                        effective-robustness figure, m2-Mix's analyses of
                                                        features (geometry, ECE, SIMAT's score)
  mtil, imagenet_shifts                                 the peers' protocols (docs/protocols.md): ZSCL's MTIL
                                                        datasets, splits, orders and Transfer / Average / Last;
                                                        WiSE-FT's five ImageNet shifts; their facts in
                                                        mtil.json / imagenet_shifts.json
  clip_benchmark                                        CLIP_benchmark's result files of eval.py's records
"""
