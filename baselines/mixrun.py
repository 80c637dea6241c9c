"""What i-Mix and Un-Mix share as m2-Mix's baselines (its Table 1 / Table 3 rows; baselines/imix.py,
baselines/unmix.py): m2mix.py's data, schedule and evaluation settings (the same defaults, so a baseline's row is
trained and measured as FT's and m3-Mix's are), the image mix in the input space, and the run: the ZS evaluation,
common.train, the evaluation after it, a results.json that `python m2mix.py --collect RUN,RUN,...` puts into
Table 1 / 3 beside ZS, FT, m2-Mix and m3-Mix. No loss lives here; each baseline's is in its own file.

How m2-Mix ran them (Oh et al., NeurIPS 2023, Sec. 2 and Tables 1 / 3): i-Mix and Un-Mix "interpolate the
images with ratio lambda, and they adopt contrastive loss with new pseudo labels according to the mixing ratio";
nothing else is said and the m2-Mix code (changdaeoh/multimodal-mixup) has neither. So: CLIP's images are the
mixed queries, its texts the keys (the other modality plays the second view), and the mix is the authors' own
(pixels, partners in the batch), at m2mix.py's optimiser, schedule, data and evaluation."""
from __future__ import annotations

import torch

import common
from plumbing.manifests import dist_info
from plumbing.runfolder import kept_result
from baselines import settings
import eval as evaluation
from plumbing import models, results, towers
from protocols import m2mix_analysis
from papers import m2mix_data
from plumbing.base import UsageError


MixBaselineConfig = settings.MixBaselineConfig  # torch-free there: the baselines answer --help first


def mix_inputs(x, lam, partner):
    """The authors' input mixup (i-Mix's code `mixup`, Un-Mix's global mixture): row i of
        x_mix = lam_i x_i + (1 - lam_i) x_partner(i)
    x: (B, ...) images; lam: (B,) or a float; partner: (B,) long, the index mixed into each row."""
    lam = torch.as_tensor(lam, dtype=x.dtype, device=x.device)
    lam = lam.view(-1, *[1] * (x.dim() - 1)) if lam.dim() else lam  # (B, 1, 1, 1)
    return lam * x + (1 - lam) * x[partner]


class MixBaseline(common.Method):
    """A baseline's training wrapper on CLIP (common.Method): the model kept in eval() mode as m2mix.M2Mix keeps
    it; subclasses draw their mix in features() from ctx.generator (seeded by step: the same on resume)."""
    label = ""  # Table 1's row name

    def __init__(self, model, cfg):
        super().__init__()
        self.model, self.cfg = model, cfg

    def train(self, mode: bool = True):
        super().train(mode)
        if mode and self.cfg.eval_mode:  # m2-Mix Sec. 5.1: eval() mode while training, for every row
            self.model.eval()
        return self

    def encode(self, images, texts):
        return (self.model.encode_image(images, normalize=True),  # (b, D)
                common.encode_text(self.model, texts))  # (b, D)


def evaluate_model(model, preprocess, tokenizer, cfg, label: str) -> list[dict]:
    """m2mix.py's evaluation (eval.evaluate on the run's protocols with the geometry and ECE analyses; SIMAT)."""
    records = []
    for name, task in m2mix_data.eval_tasks(cfg).items():
        for r in evaluation.evaluate(model, preprocess, tokenizer, [task], cfg.data_root, model_name=label,
                                     analyses=("geometry", "ece")):
            records.append(dict(r, task=name))
    if cfg.simat:
        records += evaluation.evaluate(model, preprocess, tokenizer, ["simat"], cfg.data_root, model_name=label,
                                       simat_protocol=cfg.simat_protocol)
    return records


def finetune(cfg, make_net, method: str, show: bool = True, world=None) -> dict:
    """Loads the backbone, evaluates it (ZS), fine-tunes make_net(model, cfg) on common.train, evaluates it
    (its row: make_net's label); writes results.json (method: 'imix' | 'unmix', read by m2mix.py --collect).
    The mix pairs rows of one process's batch, so one process and --accum-freq 1 (said before anything loads)."""
    device = common.init_distributed(cfg.device)
    if cfg.accum_freq > 1 or dist_info()[1] > 1:
        raise UsageError(f"{method}: the image mix pairs the rows of one batch; --accum-freq {cfg.accum_freq} or "
                         f"several processes would mix inside parts of it: run one process, --accum-freq 1")
    if cfg.random_init or cfg.pretrained == "random":
        torch.manual_seed(cfg.seed)
    model, train_tf, eval_tf, tokenizer = models.load_model(
        cfg.backbone, "random" if cfg.random_init else cfg.pretrained, device=device, cache_dir=cfg.cache_dir,
        world=world, **towers.tower_settings(cfg))
    manifest = m2mix_data.train_manifest(cfg, world)
    records = []
    if cfg.eval_base:  # kept in <out>/base.json: a resumed run reads it back
        records += results.staged(kept_result(
            cfg, "base", lambda: evaluate_model(model, eval_tf, tokenizer, cfg, "ZS")), "base")
    dataset = common.training_set(cfg, manifest, eval_tf if cfg.augment == "none" else train_tf)
    net = make_net(model, cfg)
    heads = ("model.visual.head.", "model.text.proj.")  # the towers' projections (m2mix.py's T4)
    lr_of = (lambda n: cfg.head_lr if n.startswith(heads) else None) if cfg.head_lr else None
    summary = common.train(cfg, net, dataset, common.Collate(tokenizer), lr_of=lr_of,
                           validate=evaluation.validator(
                               cfg, eval_tf, list(m2mix_data.eval_tasks(cfg).values())))
    if "stopped_at" in summary:
        return {"summary": summary}
    records += results.staged(evaluate_model(model, eval_tf, tokenizer, cfg, net.label), "tuned")
    doc = results.document(method, records, summary=summary)
    common.write_results(cfg.out, doc, cfg)
    if show:
        print(m2mix_analysis.table(records, cfg.backbone))
    return doc


def run(cfg, make_net, method: str, world=None):
    """A baseline's main() after parsing: the paper's data resolved, the tasks, --out and device checked before
    any model loads (m2mix.main's order), then finetune. world: the lab's (lab.WORLD) for the tiny backbone and
    the synthetic world, which the baseline's main() takes from the lab when its command names it (issue 69.7)."""
    settings.refuse_unbuilt(cfg, method)
    if cfg.backbone in ("tiny", "lab-towers") or "synthetic" in cfg.train_data:
        models.lab_world(world, f"{method}: --backbone {cfg.backbone} / --train-data {cfg.train_data}")
    karpathy = f"{cfg.data_root}/flickr30k/dataset_flickr30k.json"
    cfg = common.resolve_auto(cfg, "train_data", "flickr30k", [karpathy],
                              "Flickr30K and Karpathy's split file, m2-Mix Sec. 5.1")
    if cfg.accum_freq > 1:  # before anything loads (finetune says it again for a caller that skips run)
        raise UsageError(f"{method}: the image mix pairs the rows of one batch: --accum-freq 1")
    flag = "--eval-tasks" if cfg.eval_tasks else "--train-data (evaluated as the default task)"
    evaluation.check_tasks(list(m2mix_data.eval_tasks(cfg).values()), cfg.data_root, flag)
    common.preflight(cfg, [m2mix_data.train_manifest(cfg, world)])
    return finetune(cfg, make_net, method, world=world)
