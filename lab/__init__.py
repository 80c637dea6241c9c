"""The lab: a synthetic world and a tiny CLIP that are a miniature of the
papers' regimes, the seeds and paired statistics every demo uses, the claims
tables and the figures; each method's demo and ERCLIP's sweeps live in
lab/demos/.

Nobody without a GPU, pretrained weights and the datasets can run the papers'
experiments. The lab is the evidence they CAN run: a procedural world whose
causal structure mirrors the settings of the four papers, a CLIP small enough
to pretrain on two CPU cores, and demos that report paired statistics over
seeds fixed in advance, so that a claim either shows, shows the other way, or
is honestly not resolved at this size.

  lab/world.py    the world: vocabulary, scenes, captions, pixels, splits, the
                  continual domains, a multimodal feature world (CMCL)
  lab/tiny.py     the tiny CLIP: config, pretraining (ClipFineTune), the
                  shipped weights (lab/weights/), measurements on the world
  lab/towers.py   two towers pre-trained apart (m2-Mix Sec. 5.4): a small
                  ResNet classifier and a tiny BERT, their shipped weights
  lab/stats.py    SEEDS, --seeds, paired differences, verdicts, claims, the demo report,
                  machine_info (what a result ran on)
  lab/calibrate.py  each demo's settings, chosen once on 'val' with a pilot seed
  lab/figures.py  matplotlib figures (Agg)
  lab/runs.py     a demo's --out held, scratch run folders, runs in parallel processes
                  (one folder per sweep run, data prefixes, snapshots: papers/erclip_sweeps.py)
  lab/report.py   the docs' demo sections, printed from a results file
  lab/registry.py the claims registry (lab/claims/<demo>.json): margins from the
                  papers' effects, gates with their se, its fingerprint in results
  lab/demos/      one module per method's demo; erclip_sweeps.py
  lab/__main__.py python -m lab eval|export: those commands on the lab

The import graph runs one way: the lab imports common, eval and the method
files; none of them imports the lab. Importing the lab registers the tiny
backbone with open_clip (open_clip.add_model_config) and the synthetic-*
evaluation sets with eval.py (eval.register_synthetic); the rest of its world
(the tiny backbone's weights, the synthetic manifests and task sequences, the
label sets) is WORLD, a plumbing.models.LabWorld handed on as `world=`: a
method file's main() takes it from the lab when its command names the lab
(--backbone tiny, --train-data synthetic), and `python -m lab eval|export
ARGS` (lab/__main__.py) passes it to eval.py and the export.
"""
import sys
from pathlib import Path

from plumbing import flags

COMMANDS = {"eval": "eval.py", "export": "commands/export.py"}  # python -m lab NAME: the script it runs
if sys.argv[:1] == ["-m"] and sys.orig_argv[sys.orig_argv.index("-m") + 1:][:2] in (["lab", c] for c in COMMANDS):
    # `python -m lab eval|export --help` (or a bad flag): answered before the imports below load torch
    flags.answer_head_early(Path(__file__).parent.parent / COMMANDS[sys.argv[1]], sys.argv[2:],
                            f"python -m lab {sys.argv[1]}")

if sys.argv[:1] == ["-m"] and sys.orig_argv[sys.orig_argv.index("-m") + 1:][:1] == ["lab.calibrate"]:
    flags.answer_head_early(Path(__file__).parent / "calibrate.py", sys.argv[1:], "python -m lab.calibrate")

if sys.argv[:1] == ["-m"] and sys.orig_argv[sys.orig_argv.index("-m") + 1:][:1] == ["lab.protocol_data"]:
    from lab.protocol_data import command_line  # numpy and PIL: --help and a bad flag answered before torch
    command_line().parse_args(sys.argv[1:])
    del sys.modules["lab.protocol_data"]  # runpy runs it as __main__ next

import common  # noqa: E402  (the lab's world and the demos need torch)
from plumbing import models  # noqa: E402
import eval as evaluation
from lab.figures import bar_panels, curves_figure, matrix_figure, pyplot, save_figure
from lab.runs import PROCESSES, hold_out, job_pool, run_jobs, scratch_run, take_processes_flag
from lab.stats import (EFFECT_SHARE, EQUAL_SHARE, FIELD_MARGIN, SEEDS, claim, claims_table, diagnosed, effect_margin,
                       machine_info, mean_over_seeds, mean_std_table, paired, paired_stats, report_demo, run_seeds,
                       seeds, take_seeds_flag, verdict)
import lab.towers  # noqa: F401  registers the 'lab-towers' backbone (towers.SPECS)
from lab.tiny import (TINY_CFG, TINY_PRETRAIN, ClipFineTune, domain_report, pretrain_tiny, retrieval_report,
                      zero_shot_report)
from lab.world import (AS_DRAWN, BACKGROUND_TEMPLATES, BACKGROUNDS, COLOR_TEMPLATES, COLORS, FINETUNE, IMAGE_SIZE,
                       NUMBERS, POSITIONS, PRETRAIN, SHAPE_TEMPLATES, SHAPES, SIZES, SPLITS, TASK_DOMAINS, UNSEEN,
                       ZS_DOMAIN, Domain, LongCaptions, classification_tasks, conflict_manifest, conflict_names,
                       finetune_classes, label_sets, long_caption_manifest, long_register, long_task_manifests,
                       low_rank_tasks, render, retrieval_tasks, scene, scene_label_sets, scene_labelled_tasks,
                       scene_labels_manifest, summary_first, synthetic_manifest, world_fingerprint,
                       synthetic_multimodal, task_manifests, world_split)

models.register_tiny(TINY_CFG)  # the tiny backbone, known to open_clip (open_clip.add_model_config)
WORLD = models.LabWorld(  # the synthetic world, handed as `world=` to what the lab runs (models.LabWorld)
    tiny_weights=pretrain_tiny, synthetic_manifest=synthetic_manifest, task_manifests=task_manifests,
    long_task_manifests=long_task_manifests, label_sets=lambda: label_sets() | scene_label_sets())
evaluation.register_synthetic(retrieval_tasks(), classification_tasks())


def long_world(captions: LongCaptions) -> models.LabWorld:
    """WORLD with the fine-tuning pool's long captions (--train-data synthetic, the 'val' / 'test' splits) written as
    `captions` says (issue 71.2: world.LongCaptions; the knobs: python -m lab.calibrate long-world, long-world-2);
    AS_DRAWN: WORLD itself."""
    import dataclasses
    return WORLD if captions == AS_DRAWN else dataclasses.replace(WORLD, synthetic_manifest=captions.synthetic_manifest)


def conflict_world(conflict: float) -> models.LabWorld:
    """WORLD with its continual tasks (--tasks synthetic, synthetic-long) renamed at strength `conflict` (issue 71:
    world.conflict_manifest; the strength: python -m lab.calibrate continual-world); 0: WORLD itself. No demo
    uses it yet: a demo switches by handing this as `world=` where it hands WORLD."""
    import dataclasses
    import functools
    return dataclasses.replace(WORLD, task_manifests=functools.partial(task_manifests, conflict=conflict),
                               long_task_manifests=functools.partial(long_task_manifests, conflict=conflict)) \
        if conflict else WORLD
