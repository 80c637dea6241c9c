"""The machinery below common.py that every run needs and no method reader needs to open. It never imports
common, eval, a method file, protocols/, papers/, commands/ or the lab (tests/test_layout.py checks every import,
function-local ones included).

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
                                                        formats; uni-modal towers (m2-Mix Sec. 5.4's backbones,
                                                        here because load_model and save_model build and record
                                                        them for every entry, eval.py's included)
  lora                                                  peft's adapter folder (lora_adapter/) of a --lora run
"""
