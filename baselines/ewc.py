"""EWC: Elastic Weight Consolidation, as a continual-CLIP baseline (issue 60).

James Kirkpatrick, Razvan Pascanu, Neil Rabinowitz, Joel Veness, Guillaume Desjardins, Andrei A. Rusu, Kieran Milan,
John Quan, Tiago Ramalho, Agnieszka Grabska-Barwinska, Demis Hassabis, Claudia Clopath, Dharshan Kumaran, Raia
Hadsell. "Overcoming catastrophic forgetting in neural networks", PNAS 114(13), 2017.
https://arxiv.org/abs/1612.00796. No code was released with it (C-CLIP's table runs its own).

Implements
  Eq. (3)    L(theta) = L_B(theta) + sum_i lambda/2 F_i (theta_i - theta*_A,i)^2                 ewc_penalty
             the task loss L_B is CLIP's contrastive loss on task t                               EWC.losses
  Fisher     F = diag E[(d log p / d theta)^2] at theta*_A, the end of the previous task, from its data
             (the empirical Fisher of its loss: the mean over batches of the squared gradient)   empirical_fisher
  3 tasks+   "the sum of two quadratic penalties is itself a quadratic penalty" (after Eq. 3):
                 sum_t F_t (theta - theta*_t)^2 = F (theta - theta*)^2 + const,
                 F = sum_t F_t, theta* = sum_t F_t theta*_t / F                                 consolidate
             so one (F, theta*) pair is kept, whatever the number of tasks (--ewc-gamma 1, the default)
  online     --ewc-gamma < 1: online EWC, J. Schwarz, J. Luketina, W. M. Czarnecki, A. Grabska-Barwinska,
             Y. W. Teh, R. Pascanu, R. Hadsell, "Progress & Compress: A scalable framework for continual
             learning", ICML 2018, https://arxiv.org/abs/1805.06370 (its online-EWC penalty, the one its compress
             phase adds): F*_t = gamma F*_{t-1} + F_t, and task t+1's penalty is
                 1/2 ||theta - theta*_t||^2 over gamma F*_t, i.e. lambda/2 sum_i gamma F*_t,i (theta_i - theta*_t,i)^2
             anchored at the LAST task's weights theta*_t. The same as GMvandeVen/continual-learning at 0fa419e
             (models/cl/continual_learner.py: estimate_fisher, ewc_loss), gamma on the penalty too   consolidate

Code name -> paper symbol
  fisher / anchor        the penalty's F (sum_t F_t; online: gamma F*_t) / theta* (the F-weighted mean of the
                         theta*_t; online: theta*_t, the last); weighted = W = F theta*, what resume keeps
  ewc_lambda             lambda (Eq. 3; the paper tunes it per experiment, no value for CLIP)
  ewc_gamma              gamma (Schwarz et al.'s online EWC; 1: Kirkpatrick et al.'s sum over tasks)

Deviations
  1. The Fisher's gradients are those of a BATCH's contrastive loss: one caption's loss depends on the whole
     batch, so the per-example log-likelihood of Eq. (3)'s Fisher has no counterpart; its scale is 1/B of a
     per-example Fisher's, which lambda absorbs. --fisher-batches batches (0: one pass over the task's data) of
     --fisher-batch-size (0: --batch-size), the evaluation transform, fp32, the gradient of the task's L_CLIP.
  2. The penalty is the consolidated one (exact in its gradient; its value differs from the sum of the per-task
     penalties by a constant, so metrics.jsonl's loss_ewc is not that sum).
  3. Every trainable weight is penalised, the logit scale included.
  4. Training protocol C-CLIP's (baselines/sequence.py): the CLIP loss on captions, its epochs, lrs, batch.
  5. gamma = 1 is Kirkpatrick et al.'s sum of per-task penalties; gamma < 1 Schwarz et al.'s online EWC. The two
     differ even as gamma -> 1 (the online anchor is the last theta*, not the F-weighted mean of all of them).
     Before issue 74, gamma < 1 decayed the per-task sum (the F-weighted mean of the theta*_t): no published
     form, dropped.
  6. lambda is Eq. (3)'s: lambda/2 sum F (theta - theta*)^2. avalanche's EWCPlugin (avalanche-lib 0.6.0,
     avalanche/training/plugins/ewc.py, before_backward) adds ewc_lambda * sum F (theta - theta*)^2, with no
     1/2 and, in its online mode, no gamma on the penalty: its ewc_lambda a is --ewc-lambda 2a here (online:
     2a / gamma). Its Fisher (compute_importances) is the same mean over batches of squared batch gradients.
  7. The Fisher pass shuffles (seeded) and drops the last partial batch; avalanche's keeps it, unshuffled, as
     one batch of the mean. Kept: by deviation 1 a batch's F scales as 1/B, so a smaller last batch would be
     a term of another scale. With --fisher-batches 0 the pass covers len(data) // B batches.
Commands: python -m baselines.ewc --tasks vlcl | --tasks synthetic --backbone tiny (the lab); the flags of
baselines/sequence.py (cclip.py's) and the ones below. Notes: docs/baselines.md."""
from __future__ import annotations

import dataclasses

from baselines.settings import SequenceConfig
from plumbing import flags
from plumbing.flags import arg


@dataclasses.dataclass(frozen=True)
class EWCConfig(SequenceConfig):
    ewc_lambda: float = arg(1e4, "lambda of Eq. (3) (ours: the paper tunes it; deviation 1 makes F small)",
                            rule=">= 0")
    ewc_gamma: float = arg(1.0, "gamma (1: the paper's sum over tasks; < 1: Schwarz et al.'s online EWC, "
                           "anchored at the last task's weights; deviation 5)", rule="in (0, 1]")
    fisher_batches: int = arg(0, "batches of the task's data for F (0: one pass over it)", rule=">= 0")
    fisher_batch_size: int = arg(0, "batch of F's gradients (0: --batch-size)", rule=">= 0")
    out: str = arg("runs/ewc", "output: continual.json, results.json, per-task folders, model.pt")


if __name__ == "__main__":  # --help and flag errors are answered here, before the imports below
    flags.answer_early(EWCConfig)

import torch
import torch.nn.functional as F

import common
from plumbing.base import UsageError
from plumbing.cli import cli
from baselines import sequence


# --- Losses ---
def ewc_penalty(params: list, fisher: list, anchor: list, lam: float):
    """Eq. (3)'s penalty: sum_i lambda/2 F_i (theta_i - theta*_i)^2.
    params, fisher, anchor: tensors of the same shapes, in the same order (theta, F, theta*)."""
    # Eq. (3): lambda/2 sum_i F_i (theta_i - theta*_A,i)^2
    return 0.5 * lam * sum((f * (p.float() - a) ** 2).sum() for p, f, a in zip(params, fisher, anchor))


def empirical_fisher(gradients) -> list:
    """F = mean over batches of the squared gradient (the diagonal of the empirical Fisher, deviation 1).
    gradients: an iterable (a generator: nothing is kept) of per-batch lists of per-parameter gradients
    (no gradient mode is switched here: the generator may run autograd)."""
    total, n = None, 0
    for grads in gradients:
        squares = [g.detach().float() ** 2 for g in grads]
        total = squares if total is None else [t + q for t, q in zip(total, squares)]
        n += 1
    if not n:
        raise ValueError("empirical_fisher: no batch")
    # the Fisher after Eq. (3): F_i = E[(dL / d theta_i)^2] over the previous task's data
    return [t / n for t in total]


@torch.no_grad()
def consolidate(fisher: list | None, weighted: list | None, new_fisher: list, theta: list, gamma: float = 1.0):
    """One more task in the single quadratic penalty. Returns (F, W): the penalty's F and W = F theta*, so that
    theta* = W / F (anchor); None: no task yet. new_fisher: F_t; theta: theta*_t, the weights the task ended on.
      gamma = 1 (after Eq. 3): F <- F + F_t, W <- W + F_t theta*_t: theta* is the F-weighted mean of the theta*_t.
      gamma < 1 (online EWC): F holds gamma F*_{t-1}, so gamma F*_t = gamma (gamma F*_{t-1} + F_t) = gamma (F + F_t);
        W <- F theta*_t: theta* is the last task's weights."""
    theta = [t.float() for t in theta]
    if gamma == 1.0:
        if fisher is None:
            return [f.clone() for f in new_fisher], [f * t for f, t in zip(new_fisher, theta)]
        return ([f + n for f, n in zip(fisher, new_fisher)],
                [w + n * t for w, n, t in zip(weighted, new_fisher, theta)])
    # online EWC: F*_t = gamma F*_{t-1} + F_t; the penalty's F is gamma F*_t, its anchor theta*_t
    fisher = [gamma * (f + n) for f, n in zip(fisher or [torch.zeros_like(n) for n in new_fisher], new_fisher)]
    return fisher, [f * t for f, t in zip(fisher, theta)]


def consolidate_named(fisher: dict | None, weighted: dict | None, new: dict, theta: dict, gamma: float = 1.0):
    """consolidate over {name: tensor}: the weights named in `new` (F_t) at theta (their theta*_t) join (F, W);
    weights that did not train in this task keep their entries, undecayed (CMCL's steps train one pair of maps; a
    frozen map's theta is still its theta*). Returns (F, W) as dicts."""
    fisher, weighted = fisher or {}, weighted or {}
    old = ([fisher.get(n, torch.zeros_like(f)) for n, f in new.items()],
           [weighted.get(n, torch.zeros_like(f)) for n, f in new.items()]) if fisher else (None, None)
    f, w = consolidate(*old, list(new.values()), [theta[n] for n in new], gamma)
    return fisher | dict(zip(new, f)), weighted | dict(zip(new, w))


@torch.no_grad()
def anchor(fisher: list, weighted: list, theta: list) -> list:
    """theta* = W / F where F > 0 (elsewhere theta itself: that weight carries no penalty)."""
    return [torch.where(f > 0, w / f.clamp_min(torch.finfo(f.dtype).tiny), t.float())
            for f, w, t in zip(fisher, weighted, theta)]


# --- Model wrapper ---
class EWC(common.Method):
    """Task t's step: L_CLIP on the batch plus Eq. (3)'s penalty toward (F, theta*) of the tasks before it
    (none on task 1). F and theta* are not parameters or buffers: they come from the task boundary."""

    def __init__(self, model, fisher=None, anchor=None, lam: float = 0.0, label_smoothing: float = 0.0):
        super().__init__()
        self.model, self.fisher, self.anchor, self.lam = model, fisher, anchor, lam
        self.label_smoothing = label_smoothing

    def losses(self, f, ctx=None):
        img, txt = common.gather(F.normalize(f["img"], dim=-1), F.normalize(f["txt"], dim=-1))
        losses = {"loss_clip": common.clip_loss(img, txt, self.model.logit_scale.exp(), self.label_smoothing)}
        if self.fisher is not None:
            params = dict(self.model.named_parameters())
            theta = [params[n] for n in self.fisher]
            # Eq. (3): L = L_B + sum_i lambda/2 F_i (theta_i - theta*_i)^2
            losses["loss_ewc"] = ewc_penalty(theta, list(self.fisher.values()), self.anchor, self.lam)
        return losses

    def features(self, batch, ctx=None):
        return {"img": self.model.encode_image(batch["image"]),  # (b, D) unnormalised
                "txt": common.encode_text(self.model, batch["text"], normalize=False)}


def trainable(model) -> dict:
    """name -> parameter, of those that train (the Fisher's and the penalty's weights, matched by name)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


class EWCBaseline(sequence.Baseline):
    """EWC between tasks: after task t, its Fisher at theta*_t joins the consolidated (F, W) (the boundary's
    state, so a resumed sequence has it)."""

    name = "ewc"

    def __init__(self, cfg):
        self.cfg, self.fisher, self.weighted = cfg, None, None

    def net(self, model, i, cfg):
        if self.fisher is None:
            return EWC(model, None, None, cfg.ewc_lambda, cfg.label_smoothing), None
        params = dict(model.named_parameters())
        target = anchor(list(self.fisher.values()), list(self.weighted.values()),
                        [params[n] for n in self.fisher])
        return EWC(model, self.fisher, target, cfg.ewc_lambda, cfg.label_smoothing), None

    def end_task(self, model, net, i, dataset, collate, cfg) -> dict:
        theta = trainable(model)  # the weights that trained in this task (--lock-* leaves some out)
        new = dict(zip(theta, task_fisher(model, list(theta.values()), dataset, collate, cfg, cfg.seed + i)))
        self.fisher, self.weighted = consolidate_named(self.fisher, self.weighted, new, theta, cfg.ewc_gamma)
        return {"fisher_mean": float(sum(f.sum() for f in new.values()) / sum(f.numel() for f in new.values()))}

    def state(self) -> dict:
        if self.fisher is None:
            return {}
        return {**{f"fisher.{n}": f for n, f in self.fisher.items()},
                **{f"weighted.{n}": w for n, w in self.weighted.items()}}

    def load_state(self, state: dict):
        names = [k.removeprefix("fisher.") for k in state if k.startswith("fisher.")]
        self.fisher = {n: state[f"fisher.{n}"] for n in names} or None
        self.weighted = {n: state[f"weighted.{n}"] for n in names} or None


def task_fisher(model, params: list, dataset, collate, cfg, seed: int) -> list:
    """F of the task just learned (deviation 1): the squared gradients of L_CLIP at theta*_t, averaged over
    --fisher-batches seeded batches of its training set (eval mode, fp32, no update)."""
    batch_size = cfg.fisher_batch_size or cfg.batch_size
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True,
                                         collate_fn=common.CountFailures(collate), num_workers=cfg.workers,
                                         generator=torch.Generator().manual_seed(seed))
    device = next(model.parameters()).device
    if len(dataset) < batch_size:
        raise UsageError(f"EWC: the task's training set ({len(dataset)}) is smaller than one Fisher batch "
                                f"({batch_size}); lower --fisher-batch-size")

    def gradients():
        for b, batch in enumerate(loader):
            if cfg.fisher_batches and b >= cfg.fisher_batches:
                return
            img = F.normalize(model.encode_image(batch["image"].to(device)), dim=-1)
            txt = F.normalize(common.encode_text(model, batch["text"].to(device), normalize=False), dim=-1)
            loss = common.clip_loss(img, txt, model.logit_scale.exp(), cfg.label_smoothing)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            yield [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]

    was_training = model.training
    model.eval()
    try:
        return empirical_fisher(gradients())
    finally:
        model.train(was_training)


# --- Main ---
def main(argv=None):
    return sequence.main(EWCConfig, lambda cfg, world: EWCBaseline(cfg), argv)


if __name__ == "__main__":
    cli(main)
