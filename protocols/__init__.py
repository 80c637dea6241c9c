"""The benchmarks' protocols the papers share, each a peer's fixed procedure and its facts, above plumbing/ and below
common.py: the methods, eval.py and the continual drivers run them; they never import common, eval, a method file,
papers/, commands/ or the lab (tests/test_layout.py).

  mtil             ZSCL's MTIL (ICCV 2023): the 11 datasets, splits, orders, Transfer / Average / Last (facts in
                   mtil.json)
  class_folders    ImageNet-style class folders as training data (class prompts from MTIL's templates)
  imagenet_shifts  WiSE-FT's five ImageNet shifts and ObjectNet, their class subsets (facts in imagenet_shifts.json)
  wise_ft          WiSE-FT's interpolation along alpha, kept alpha by alpha, effective robustness and its figure
  m2mix_analysis   m2-Mix's analyses of features eval.py runs: geometry (align / unif, Sec. 3), ECE (Tab. 2),
                   SIMAT's score (Tab. 5)
  clip_benchmark   CLIP_benchmark's result files of eval.py's records
"""
