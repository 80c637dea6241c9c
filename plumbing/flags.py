"""The command line every script shares, without torch: the settings dataclass (Config) each method extends,
its argparse builder with the range checks, and answer_early(), which lets a script answer --help and flag errors
before torch and open_clip are imported (they take 2-5 s; the parser needs neither). common.py re-exports all of
it; this module imports nothing of the project and nothing outside the standard library."""
from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import inspect
import io
import math
import os
import sys
import textwrap
import types
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from plumbing import base, outfolder
from plumbing.base import world_size




class HelpWithDefaults(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help with the description as written and every option's default (eval.py's)."""


def arg(default, help: str, **kw):
    """A dataclass field that carries its argparse help text; rule="> 0" (any of checked's) checks its value at
    parse time, as the shared settings' lists below do."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


# open_clip's --precision names: the same autocast as ours, or weight casts this repository does not do
PRECISION_ALIASES = {"amp": "fp16", "amp_bf16": "bf16", "amp_bfloat16": "bf16"}
PRECISION_REFUSED = ("pure_fp16", "pure_bf16")


def precision_name(text: str) -> str:
    """--precision: ours, or open_clip's name for the same thing; open_clip's pure_* (weights cast, no fp32 master
    copy) are refused with what we call the nearest setting."""
    if text in PRECISION_REFUSED:
        raise argparse.ArgumentTypeError(
            f"{text} (open_clip: the weights themselves in {text[5:]}) is not done here; --precision {text[5:]} is "
            f"autocast over fp32 weights{' with grad scaling' if text == 'pure_fp16' else ''} (open_clip's "
            f"amp{'_bf16' if text == 'pure_bf16' else ''}); m2mix.py --fp16-weights stores fp16 weights as its code")
    return PRECISION_ALIASES.get(text, text)


PRECISION = dict(choices=("auto", "fp16", "bf16", "fp32"), type=precision_name)  # --precision's parsing (arg(**))


REPORT_TARGETS = ("tensorboard", "wandb", "trackio")  # --report-to's backends, in the order they are listed


def report_targets(text: str) -> str:
    """--report-to: comma-separated backends, each once, in REPORT_TARGETS' order ('' none; open_clip's 'all':
    tensorboard and wandb)."""
    said = [u for t in text.split(",") for u in (("tensorboard", "wandb") if t.strip() == "all" else (t.strip(),)) if u]
    unknown = [t for t in said if t not in REPORT_TARGETS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {', '.join(unknown)}: expected a comma-separated "
                                         f"list of {', '.join(REPORT_TARGETS)} (or all)")
    return ",".join(t for t in REPORT_TARGETS if t in said)


# C-CLIP's (its research code's) LoRA targets: attention in / out and the MLP's two weights (plumbing/lora.py's)
DEFAULT_LORA_TARGETS = "attn.in_proj_weight,attn.out_proj.weight,mlp.c_fc.weight,mlp.c_proj.weight"


@dataclass(frozen=True)
class Config:
    """Settings shared by every method; method files subclass it with their paper's defaults (and locations)."""
    # model
    backbone: str = arg("tiny", "OpenAI name (ViT-B/16), open_clip name (ViT-B-16) or 'tiny' (the lab's, the "
                            "default where no paper fixes one; m2mix.py and cclip.py default to their papers')")
    pretrained: str = arg("", "weights: '' = default (openai, or 'synthetic' for tiny), an open_clip tag, "
                              "or a checkpoint path")
    cache_dir: str = arg("", "where open_clip looks for / stores downloaded weights")
    # data
    data_root: str = arg("data", "root of every benchmark folder (see README)")
    train_data: str = arg("auto", "auto: the paper's training data under --data-root (the synthetic world with "
                          "--backbone tiny when it is absent) | a manifest (JSONL/CSV) | synthetic")
    skip_bad: bool = arg(False, "skip and count bad rows/images instead of stopping")
    csv_img_key: str = arg("", "open_clip's: the manifest's image column ('': the first of image, filepath, "
                           "image_path, file_name, img)")
    csv_caption_key: str = arg("", "open_clip's: the caption column ('': the first of caption, title, text, "
                               "captions)")
    csv_separator: str = arg("", "open_clip's: a CSV's separator ('': detected among , TAB ; |)")
    check_images: str = arg("full", "the row check's decoding before training: full (every image; split across the "
                            "processes, remembered on disk) | sample (1,000 of them) | none; with sample / none an "
                            "image failing during training is replaced by the next row and counted",
                            choices=("full", "sample", "none"))
    train_num_samples: int = arg(0, "tar shards as --train-data: samples per epoch (open_clip's; 0: every sample "
                                 "once, from the shards' sizes.json or counted)")
    workers: int = arg(2, "DataLoader workers")
    # optimisation
    epochs: int = arg(1, "epochs over the training set")
    steps: int = arg(0, "stop after this many steps (0: epochs decide); cclip.py, dns.py: per task")
    batch_size: int = arg(64, "GLOBAL batch size, split across the processes (open_clip's --batch-size is per GPU: "
                          "see --batch-size-per-gpu)")
    batch_size_per_gpu: int = arg(0, "per-process micro-batch, as open_clip's --batch-size: --batch-size becomes it x "
                                  "the number of processes x --accum-freq (0: off)")
    accum_freq: int = arg(1, "split each process's batch into this many micro-batches: the same gradient "
                          "(exact, every method's in-batch terms included) in less memory, as open_clip's")
    lr: float = arg(1e-5, "peak learning rate")
    lr_image: float = arg(0.0, "ours: the image tower's peak lr (0: --lr; a rate the method sets for a parameter "
                          "stays)")
    lr_text: float = arg(0.0, "ours: the text tower's peak lr (0: --lr; a rate the method sets for a parameter stays)")
    image_layer_decay: float = arg(1.0, "open_clip's: layer-wise lr decay in the image tower, in (0, 1]: block i of n "
                                   "at lr x decay ** (n - i), the embeddings x decay ** (n + 1), the projection x 1 "
                                   "(open_clip ViTs, the tiny backbone; 1: off)", aliases=("--visual-layer-decay",))
    text_layer_decay: float = arg(1.0, "open_clip's: layer-wise lr decay in the text tower, in (0, 1], as "
                                  "--image-layer-decay (1: off)")
    wd: float = arg(0.1, "AdamW weight decay (not on gains, biases, embeddings, logit_scale)")
    decay_all: bool = arg(False, "decay every parameter (the m2-Mix, C-CLIP and Long-CLIP codes' single AdamW group)")
    beta1: float = arg(0.9, "AdamW beta1")
    beta2: float = arg(0.98, "AdamW beta2")
    eps: float = arg(1e-6, "AdamW eps")
    warmup: int = arg(0, "linear warm-up steps; negative = that percentage of all steps")
    grad_clip: float = arg(0.0, "clip the global gradient norm (0: off)", aliases=("--grad-clip-norm",))
    precision: str = arg("auto", "auto (fp16 on CUDA, fp32 on CPU) | fp16 | bf16 | fp32; fp16 and bf16 are autocast "
                         "over fp32 weights (fp16 with grad scaling): open_clip's amp and amp_bf16, accepted as such "
                         "(open_clip's fp16 / bf16 cast the weights; ours do not)", **PRECISION)
    lock_image: bool = arg(False, "freeze the image tower (open_clip's lock_image_tower), but its last groups")
    lock_image_unlocked_groups: int = arg(0, "with --lock-image: groups left trainable from the top, as open_clip "
                                          "counts them (1: the projection; 2: + the last block and ln_post; ...)")
    lock_text: bool = arg(False, "freeze the text tower (open_clip's lock_text_tower), but its last groups")
    lock_text_unlocked_layers: int = arg(0, "with --lock-text: groups left trainable from the top, as open_clip "
                                         "counts them (1: the projection; 2: + the last block and ln_final; ...)")
    grad_checkpointing: bool = arg(False, "trade compute for memory in both towers")
    label_smoothing: float = arg(0.0, "label smoothing of the contrastive cross-entropies")
    loss: str = arg("clip", "the pair loss of every CLIP term: clip (softmax InfoNCE) | siglip (SigLIP's sigmoid "
                    "loss as open_clip's SigLipLoss, with the model's logit_bias; a CLIP backbone gets one at "
                    "SigLIP's init, b = -10, logit scale ln 10; no label smoothing)", choices=("clip", "siglip"))
    siglip_init: str = arg("paper", "--loss siglip on a backbone without a logit_bias starts at: paper (SigLIP's "
                           "s = 10, b = -10) | open_clip (open_clip's fine-tuning route: the checkpoint's logit "
                           "scale kept, b = 0)", choices=("paper", "open_clip"))
    lora: int = arg(0, "LoRA rank r: adapters on --lora-targets, every other weight frozen; merged into model.pt / "
                    "--export (a plain open_clip model) and written as a peft adapter in <out>/lora_adapter (0: off)")
    lora_alpha: float = arg(32.0, "LoRA scale: DeltaW = lora_alpha / r * B A (C-CLIP's research code's 32)")
    lora_dropout: float = arg(0.0, "dropout on the adapters' input features (cclip.py's deviation 3)")
    lora_targets: str = arg(DEFAULT_LORA_TARGETS, "weight-name suffixes --lora adapts, in both towers")
    torchcompile: bool = arg(False, "open_clip's --torchcompile: torch.compile the towers (nn.Module.compile, in "
                             "place: checkpoints keep their names); first steps slower while it compiles")
    # bookkeeping
    out: str = arg("runs/default", "output folder (config, metrics.jsonl, checkpoints, results)")
    seed: int = arg(0, "seed of everything random")
    device: str = arg("auto", "auto | cpu | cuda | cuda:N")
    log_every: int = arg(10, "steps between metrics.jsonl lines")
    report_to: str = arg("", "also send metrics.jsonl's scalars to these, comma-separated: tensorboard "
                         "(<out>/tensorboard), wandb (offline without a login or network; <out>/wandb), trackio "
                         "(local); 'all': tensorboard,wandb as open_clip's; a resumed run continues the same run "
                         "(pip install tensorboard / wandb / trackio)", type=report_targets)
    val_every: int = arg(0, "evaluate the validation set every N steps (rank 0; metrics.jsonl and results.json "
                         "record it; 0: off)")
    val_data: str = arg("", "--val-every's sets, comma-separated: eval.py tasks or manifests, each logged as val/<its "
                        "name>/<metric> ('': the run's first evaluation task)")
    export: str = arg("", "also write the trained model to this folder in open_clip's hub layout (safetensors; "
                      "python -m commands.export --format transformers converts it further)")
    save_every: int = arg(200, "steps between checkpoints (always one at the end)")
    resume: str = arg("", "'latest' or a checkpoint path to continue from")
    stop_at: int = arg(0, "ours: leave after this many steps as if interrupted (tests resume)")
    find_unused: bool = arg(False, "DDP find_unused_parameters")
    overwrite: bool = arg(False, "ours: start afresh in an --out that holds a run (its run files are deleted)")
    override_resume: bool = arg(False, "ours: let --resume continue with changed settings (recorded in config.json)")
    debug: bool = arg(False, "ours: show the Python traceback of an expected failure")


@dataclass(frozen=True)
class TowerConfig(Config):
    """--backbone bert-resnet50's settings (m2-Mix Sec. 5.4, m2mix.py's deviations T1-T7; plumbing/towers.py): the
    towers' weights, what the paper leaves open; and the released code's data handling (--augment, for CLIP too).
    m2mix.py's config extends it."""
    text_weights: str = arg("", "the text tower's save_pretrained folder (default: "
                                "bert-base-uncased in the HF cache)")
    image_weights: str = arg("", "the image trunk's state_dict "
                                 "(default: torchvision's ResNet-50 file / timm's copy)")
    random_init: bool = arg(False, "random weights (--pretrained random): smoke runs only")
    tower_dim: int = arg(0, "bert-resnet50: the shared embedding's size; 0: the spec's "
                            "(the code's 256)")
    text_pool: str = arg("cls", "bert-resnet50: cls (the code: CLS of the last hidden state) "
                                "| mean", choices=("cls", "mean"))
    head_lr: float = arg(0.0, "bert-resnet50: lr of the two projection heads; 0: --lr "
                              "(the code: one lr)")
    augment: str = arg("crop", "training images: crop (open_clip's random resized crop, scale 0.9-1) | none "
                               "(the code: CLIP's resize + centre crop; m2mix.py dev. 21)", choices=("crop", "none"))
    caption_cleaning: str = arg("open_clip", "bert-resnet50: open_clip (ftfy, HTML entities unescaped before BERT) "
                                "| none (the code's raw captions; T7)", choices=("open_clip", "none"))


# Checked by argparse, so a bad value stops before anything runs: "positive" fields must be > 0, "counts" and the
# rates, decays, clip and loss weights >= 0 (steps 0: the epochs decide; save_every 0: one checkpoint at the end;
# stop_at 0: off), betas and label smoothing in [0, 1), the layer decays in (0, 1]; every number finite.
POSITIVE = ("epochs", "batch_size", "lr", "log_every", "accum_freq")
COUNTS = ("steps", "train_num_samples", "save_every", "stop_at", "workers", "batch_size_per_gpu", "val_every",
          "lock_image_unlocked_groups", "lock_text_unlocked_layers", "wd", "grad_clip", "lambda_p", "alpha",
          "fusion_lr", "lr_image", "lr_text", "ckc_weight", "m2_weight", "uni_weight", "vl_weight", "merge_alpha",
          "lora", "lora_alpha")
UNIT = ("beta1", "beta2", "label_smoothing", "lora_dropout")
DECAYS = ("image_layer_decay", "text_layer_decay")  # in (0, 1], as open_clip's (1: off)


def checked(typ, rule: str):
    """An argparse type: typ(text), finite, and "> 0", ">= 0", "in [0, 1)", "in (0, 1]" or "in [0, 1]"; else
    argparse's one-line error."""
    def check(text):
        v = typ(text)
        ok = (v > 0 if rule == "> 0" else 0 <= v < 1 if rule == "in [0, 1)" else 0 < v <= 1 if rule == "in (0, 1]"
              else 0 <= v <= 1 if rule == "in [0, 1]" else v >= 0)
        if not math.isfinite(v) or not ok:
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return v
    check.__name__ = typ.__name__
    return check


CSV_COLUMNS = {"csv_img_key": "", "csv_caption_key": "", "csv_separator": ""}  # this run's (parse_config sets
# them): every manifest it reads, for training and evaluation alike, as open_clip's flags apply to both

# Issue 42.1, one spelling per idea in every script, and issue 56.5, one name from flag to field: a field's flag
# is its name (--eval-tasks is eval_tasks); a flag a script once spelled otherwise is still read, with one line
# naming the new one: arg(..., old=("--eval-on",)) (m2mix.py's --eval-on / --eval-zs, dns.py's --zeroshot).


def default_sources(cls) -> dict:
    """{field: its trailing comment} in the config classes' source (erclip.py's `lr = arg(5e-6, ...)  # Sec. 4`):
    where a default comes from, which --help shows beside it (issue 42.1). Empty when the source is not at hand."""
    found = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        try:
            source = textwrap.dedent(inspect.getsource(klass))
            body = ast.parse(source).body[0].body
            tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
        except (OSError, TypeError, SyntaxError, tokenize.TokenError):
            continue
        comments = {tok.start[0]: tok.string.lstrip("#").strip() for tok in tokens if tok.type == tokenize.COMMENT}
        for node in body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                said = [c for n in range(node.lineno, node.end_lineno + 1) if (c := comments.get(n))
                        and not c.startswith("noqa")]
                found[node.target.id] = "; ".join(said)
    return {k: v for k, v in found.items() if v}


def parse_config(cls, argv=None, **overrides):
    """argparse built from the dataclass fields; returns a frozen cfg. --batch-size-per-gpu sets --batch-size."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=(sys.modules[cls.__module__].__doc__ or "").split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    sources = default_sources(cls) if any(a in ("-h", "--help") for a in argv) else {}
    for f in dataclasses.fields(cls):
        default = overrides.get(f.name, f.default if f.default is not dataclasses.MISSING else f.default_factory())
        name, old = "--" + f.name.replace("_", "-"), tuple(f.metadata.get("old", ()))
        help_ = f.metadata.get("help", "")
        if (source := sources.get(f.name)) and source not in help_:
            help_ += f" [{source}]"  # the default's source, as the file says it
        help_ = help_.replace("%", "%%")  # argparse formats help strings with %
        said = [a.split("=")[0] for a in argv if a.split("=")[0] in {*old, *(f"--no-{o[2:]}" for o in old)}]
        for a in said:
            base.warn_once(f"note: {a} is now spelled {name if not a.startswith('--no-') else '--no-' + name[2:]} "
                           f"(one name per idea across the scripts); {a} still works")
        if f.type in ("bool", bool):
            p.add_argument(name, *old, action=argparse.BooleanOptionalAction, default=default, help=help_,
                           dest=f.name)
        else:
            typ = {"int": int, "float": float, "str": str}.get(
                f.type if isinstance(f.type, str) else f.type.__name__, str)
            if rule := f.metadata.get("rule"):  # a script's own setting: arg(..., rule="> 0") (issue 69.5)
                typ = checked(typ, rule)
            elif f.name in POSITIVE + COUNTS + UNIT + DECAYS:
                typ = checked(typ, "> 0" if f.name in POSITIVE else "in [0, 1)" if f.name in UNIT else
                              "in (0, 1]" if f.name in DECAYS else ">= 0")
            p.add_argument(name, *f.metadata.get("aliases", ()), *old, type=f.metadata.get("type", typ),
                           default=default, help=help_, choices=f.metadata.get("choices"), dest=f.name)
    values = vars(p.parse_args(argv))
    if values.get("batch_size_per_gpu"):  # open_clip's meaning of a batch size, made global here
        if any(a.split("=")[0] == "--batch-size" for a in argv):
            p.error("pass --batch-size (global) or --batch-size-per-gpu, not both")
        values["batch_size"] = values["batch_size_per_gpu"] * world_size() * values.get("accum_freq", 1)
    if values.get("siglip_init", "paper") != "paper" and values.get("loss") != "siglip":
        p.error(f"--siglip-init {values['siglip_init']} sets where --loss siglip's scale and bias start; add "
                f"--loss siglip, or drop --siglip-init")
    if values.get("loss") == "siglip" and values.get("label_smoothing"):  # issue 69.7: it was ignored silently
        if any(a.split("=")[0] == "--label-smoothing" for a in argv):
            p.error(f"--label-smoothing {values['label_smoothing']:g} with --loss siglip: SigLIP's sigmoid loss has "
                    f"no label smoothing (common.siglip_loss); drop --label-smoothing, or train --loss clip")
        base.warn_once(f"note: --loss siglip has no label smoothing; this command's default --label-smoothing "
                       f"{values['label_smoothing']:g} (of CLIP's loss) is not applied")
    if values.get("lora"):  # issue 69.3: found after the model loaded (a ValueError) or after training (peft's export)
        if values.get("lock_image") and values.get("lock_text"):
            p.error("--lora with --lock-image and --lock-text: both towers are locked, so no weight is left to "
                    "adapt; drop one of the locks (LoRA then adapts the other tower only)")
        bad = [t for t in values.get("lora_targets", "x.weight").split(",") if not t.strip().endswith("weight")]
        if bad:
            p.error(f"--lora-targets {values['lora_targets']!r}: {', '.join(repr(t) for t in bad)} is not a weight "
                    f"name's suffix; each target ends in 'weight' (a Linear's weight or attention's in_proj_weight), "
                    f"e.g. {DEFAULT_LORA_TARGETS}")
    CSV_COLUMNS.update({k: values.get(k, "") for k in CSV_COLUMNS})
    return cls(**values)


# a command the lab parses (its own flags: --seeds, --processes, ...)
LAB_FLAGS = ("--demo", "--demo-cmcl", "--demo-unimodal")


def answer_early(cls, defaults: Callable[[list], dict] | None = None, argv=None, commands: dict | None = None):
    """A script's `if __name__ == "__main__":` before its heavy imports: parse_config(cls, argv, **defaults(argv))
    exits with the help text or argparse's one-line error, so both come in well under a second; a valid command
    line returns, and main() parses it again with torch loaded. A lab command (--demo) is left to the lab.
    commands: {field: fn(cfg)} answered here too when the field is set (m2mix.py --collect), then exit 0."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not any(a.split("=")[0] in LAB_FLAGS for a in argv):
        cfg = parse_config(cls, argv, **(defaults(argv) if defaults else {}))
        for name, fn in (commands or {}).items():
            if getattr(cfg, name):
                fn(cfg)
                sys.exit(0)
        if os.environ.get("RANK", "0") == "0" and (problem := outfolder.early_problem(cfg)) is not None:
            print(f"error: {base.printable(str(problem))}", file=sys.stderr)  # as plumbing.cli, before torch loads
            sys.exit(2 if isinstance(problem, base.UsageError) else getattr(problem, "code", 1))


def answer_head_early(script, argv, prog: str):
    """`python -m lab eval|export ARGS`: the lab's package imports torch before its __main__ runs, so the command's
    --help and a bad flag are answered here first (issue 55.3: 6 s for --help). The statements above the script's
    `if __name__ == "__main__":` are its light head (this project's rule: the command line needs no torch); they
    run alone, and its command_line() parses argv: the help or argparse's one-line error exit here, a valid
    command line returns and the real run parses it again."""
    parser = light_head(script)["command_line"]()
    parser.prog = prog
    parser.parse_args(argv)


def light_head(script) -> dict:
    """The names a script defines above its first `if __name__ == "__main__":` (its light head: no torch), run
    alone: answer_head_early's command_line(), dns.py's DNSConfig for baselines.maps (issue 69.7)."""
    tree = ast.parse(Path(script).read_text(encoding="utf-8"), str(script))
    head = []
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            break
        head.append(node)
    module = types.ModuleType(f"_light_head_{Path(script).stem}")  # a module, so that a dataclass there resolves
    module.__file__ = str(script)                                    # its string annotations (dns.py's config)
    sys.modules[module.__name__] = module
    exec(compile(ast.Module(head, type_ignores=[]), str(script), "exec"), module.__dict__)
    return module.__dict__


def numbers(text: str) -> list[float]:
    """A flag of comma-separated finite numbers (eval.py --alphas)."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 0,0.5,1, got {text!r}")
    return values


def pair(text: str) -> tuple[float, float]:
    """A flag of two comma-separated finite numbers (eval.py --er-line SLOPE,INTERCEPT)."""
    values = numbers(text)
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"expected two numbers SLOPE,INTERCEPT such as 0.83,-0.05, got {text!r}")
    return values[0], values[1]


def add_fields(parser: argparse.ArgumentParser, cls, names):
    """Config fields as a hand-made parser's flags (eval.py), with the same names, defaults and help."""
    for f in (f for f in dataclasses.fields(cls) if f.name in names):
        parser.add_argument("--" + f.name.replace("_", "-"), default=f.default, help=f.metadata.get("help", ""))


# CLIP_benchmark's (LAION-AI/CLIP_benchmark, clip_benchmark/cli.py) spellings of eval.py's flags: read too, with
# one line naming ours. Its --output is a file-name template; ours is a folder (--format clip_benchmark names the
# files in it as CLIP_benchmark does).
CLIP_BENCHMARK = {"--model": "--backbone", "--dataset": "--tasks", "--dataset_root": "--data-root",
                  "--batch_size": "--batch-size", "--num_workers": "--workers", "--output": "--out"}


def note_spellings(argv, spellings: dict, whose: str):
    """One line per other spelling given: which flag of ours it is."""
    for a in dict.fromkeys(a.split("=")[0] for a in argv if a.split("=")[0] in spellings):
        base.warn_once(f"note: {a} is {whose} spelling of {spellings[a]} here; both work")
