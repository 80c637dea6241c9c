"""C-CLIP: Multimodal Continual Learning for Vision-Language Model.

Wenzhuo Liu, Fei Zhu, Longhui Wei, Qi Tian. ICLR 2025. https://proceedings.iclr.cc/paper_files/
paper/2025/file/72fb9ab442fc60b7ae5d53bf6b478273-Paper-Conference.pdf
The paper numbers no equations: comments cite its sections (3.3 metrics, 4.1 LoRA, 4.2 CKC, 5).

Implements (each equation written out once, in the docstring of the function named)
  Sec. 4.1    LoRA integration (fresh adapters per task, merged at alpha): integrate, a_mix_share;
              the LoRA module: common.LoRA, add_lora, merge_lora (--lora R: rank R)
  Sec. 4.2    contrastive knowledge consolidation (CKC) toward the old model: projector, ckc_loss;
              L = L_CLIP + L_CKC, one task's step: CClip.losses
  Sec. 3      VLCL protocol (R[i][j], BWT, forgetting, unseen R@1, zero-shot PD): run (as dns.py)
  Sec. 5.2.1  ablations by --method: full | lora | ckc | cclip (LoRA + CKC)

Code name -> paper symbol
  model / teacher                f_theta, g_phi (new model) / f_{theta^{t-1}}, g_{phi^{t-1}} (old)
  common.LoRA.A (r, in), .B (out, r) A, B (.scale = lora_alpha / r); merge_alpha: alpha (Sec. 4.1)
  projector, logit_scale         h_psi (Sec. 4.2), s = 1 / tau
  p_img, p_txt / z_img, z_txt    h_psi(f_theta(v)), h_psi(g_phi(c)) / f_{theta^{t-1}}(v), g_..(c)
  R[i][j] (continual.json)       R@1 on task j after tasks 1..i (row 0: before training)

Deviations (no official code: "research code" = the first author's SmallPigPeppa/clip-lightning,
clip_openai/; "KoyoImai" = the reimplementation KoyoImai/C-CLIP; at length in docs/cclip.md)
  1. alpha = 0.5 merge every task (Sec. 4.1); research: full, a_mix, averages: --merge-schedule.
  2. LoRA on the attention too: parametrizations of in_proj, out_proj, c_fc, c_proj: --lora-targets.
  3. LoRA dropout masks A's input columns, one mask per step; default 0 (others 0.1).
  4. Only adapters and h_psi train (Sec. 4.1); --train-rest also the rest (research code).
  5. h_psi on unnormalised embeddings, per modality; CKC's temperature the current logit_scale.
  6. Features are gathered over ranks before both losses (the research code does not).
  7. Warm-up 12 % of the steps (Sec. 5: 5 of 40 epochs); wd 0.2, beta2 0.99 (research: 0.1, 0.999).
  8. Towers at the per-encoder lrs (Sec. 5.2.3), h_psi at --lr; logit_scale per method.
  9. Zero-shot PD on ImageNet, CIFAR-100 (2 of Sec. 3.2's 6); more: --zero-shot imagefolder:<path>.
 10. L_CKC as printed, the SUM of both directions; the research code's mean: --ckc-directions.
 11. Image and text rows stacked along the batch (2N x 2N), as printed; KoyoImai: the features.
 12. A fresh (seeded) h_psi per task (research code; paper silent); KoyoImai keeps one.
 13. Per-step cosine to 0 after --warmup; the research code's per-epoch one: --schedule research.
 14. No decay on gains, biases, embeddings, logit_scale; the research code decays all: --decay-all.
 15. Every task trains augmented; research: 4 fractional-split tasks unaugmented: --train-transform.
 16. --loss siglip (ours): L_CLIP SigLIP's, from s = 10, b = -10 (--siglip-init); L_CKC keeps its
     softmax (an InfoNCE toward the old model's features: it needs the normaliser) at logit_scale.
Commands: README.md (the 8 tasks, DDP, --resume, --demo); docs/cclip.md (own tasks, research's)"""
from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

from plumbing import flags  # torch-free: the settings and their parser (--help before torch loads)
from plumbing.flags import arg
from papers.cclip_settings import ProtocolConfig  # torch-free too


@dataclasses.dataclass(frozen=True)
class CClipConfig(ProtocolConfig):  # + the protocol: papers/cclip_settings.py
    method: str = arg("cclip", "Sec. 5.2.1 ablation", choices=("full", "lora", "ckc", "cclip"))
    lora_rank: int = arg(16, "LoRA rank r (Sec. 5)")
    merge_alpha: float = arg(0.5, "integration coefficient alpha (Sec. 4.1)")
    merge_schedule: str = arg("alpha", "Sec. 4.1 | dev. 1", choices=("alpha", "research", "a_mix"))
    train_rest: bool = arg(False, "also train the non-adapted weights (research code, deviation 4)")
    proj_hidden: int = arg(2048, "projector hidden width (research code; KoyoImai: 2d)")
    ckc_weight: float = arg(1.0, "weight of L_CKC (Sec. 4.2: L = L_CLIP + L_CKC)")
    ckc_directions: str = arg("sum", "sum: as printed | mean (dev. 10)", choices=("sum", "mean"))
    lr: float = arg(1e-5, "lr outside the towers: projector, logit_scale (Sec. 5)")
    schedule: str = arg("paper", "per step | per epoch (dev. 13)", choices=("paper", "research"))
    projector_lr: str = arg("lr", "h_psi at --lr | image (research code)", choices=("lr", "image"))
    out: str = arg("runs/cclip", "output: continual.json, results.json, per-task folders, model.pt")
    demo: bool = arg(False, "run the synthetic demo: all four methods, tiny backbone, CPU")


if __name__ == "__main__":  # --help and flag errors are answered here, before the imports below
    flags.answer_early(CClipConfig)

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
import eval as evaluation
from plumbing import loading, manifests, models, results, runfolder
from plumbing.base import markdown_table
from protocols import wise_ft
from papers import cclip_tasks, zscl_mtil


# --- Losses ---
@common.float32
def ckc_loss(p_img, p_txt, z_img, z_txt, logit_scale, directions: str = "sum"):
    """Contrastive knowledge consolidation L_CKC, Sec. 4.2.

    p_img, p_txt: (N, D) projected new-model embeddings h(f(v)), h(g(c));
    z_img, z_txt: (N, D) old-model embeddings f_old(v), g_old(c) (targets);
    logit_scale: s = 1 / tau. None of them need be normalised.
        p = normalise([p_img; p_txt]),  z = normalise([z_img; z_txt])      (2N, D)
        a_i = exp(s p_i.z_i) / sum_{j=1}^{2N} exp(s p_i.z_j)      new -> old
        b_i = exp(s z_i.p_i) / sum_{j=1}^{2N} exp(s z_i.p_j)      old -> new
        L_CKC = -1/(2N) sum_{i=1}^{2N} (log a_i + log b_i)
              = CE(s p z^T, arange(2N)) + CE(s z p^T, arange(2N))
    directions="sum" is that printed form; "mean" halves it (the research code's average of the
    two directions, deviation 10), which equals common.clip_loss(p, z, s). Row i's positive is the
    old embedding of the same image (text); the other 2N - 1 old embeddings, of both modalities,
    are its negatives."""
    if directions not in ("sum", "mean"):
        raise ValueError(f"directions is 'sum' or 'mean', not {directions!r}")
    p = F.normalize(torch.cat([p_img, p_txt]).float(), dim=-1)  # (2N, D): image rows, then text
    z = F.normalize(torch.cat([z_img, z_txt]).float(), dim=-1)  # (2N, D)
    logits = logit_scale * p @ z.t()  # (2N, 2N): s p_i . z_j
    labels = torch.arange(len(p), device=p.device)  # the positive of row i is column i
    # Sec. 4.2: -1/(2N) sum_i log a_i (rows: new -> old), -1/(2N) sum_i log b_i (cols: old -> new)
    new_to_old, old_to_new = F.cross_entropy(logits, labels), F.cross_entropy(logits.t(), labels)
    # Sec. 4.2: L_CKC = the two summed (as printed); "mean": their average (deviation 10)
    total = new_to_old + old_to_new
    return total if directions == "sum" else 0.5 * total


# --- Model wrapper: LoRA by weight parametrization, projector, the C-CLIP step ---
def projector(dim: int, hidden: int = 2048):
    """h_psi (Sec. 4.2; layout of the research code's DistillPredictor):
    Linear(d, 2048) - BatchNorm - ReLU - Linear(2048, d)."""
    return nn.Sequential(nn.Linear(dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
                         nn.Linear(hidden, dim))


class CClip(common.Method):
    """One task's training step: L_CLIP on the (adapted) model, plus L_CKC when a projector and the
    old model are given; features / losses as common.Method (forward: the named, already-weighted
    loss terms)."""

    no_checkpoint = ("teacher.",)  # the old model is rebuilt from the task boundary

    def __init__(self, model, teacher=None, projector=None, ckc_weight: float = 1.0,
                 label_smoothing: float = 0.0, ckc_directions: str = "sum", loss: str = "clip"):
        super().__init__()
        self.model, self.teacher, self.projector = model, teacher, projector
        self.ckc_weight, self.label_smoothing = ckc_weight, label_smoothing
        self.ckc_directions, self.loss = ckc_directions, loss
        models.pair_bias(model, loss)  # --loss siglip: the model's logit_bias (deviation 16)
        if teacher is not None:
            teacher.requires_grad_(False).eval()

    def features(self, batch, ctx=None):
        f = {"img": self.model.encode_image(batch["image"]),  # (b, D) f_theta(v), unnormalised
             "txt": common.encode_text(self.model, batch["text"], normalize=False)}  # g_phi(c)
        if self.projector is not None and not getattr(ctx, "replay", False):
            with torch.no_grad():
                f["z_img"] = self.teacher.encode_image(batch["image"])  # (b, D) f_{theta^{t-1}}(v)
                f["z_txt"] = common.encode_text(self.teacher, batch["text"],
                                                normalize=False)  # (b, D) g_{phi^{t-1}}(c)
        return f

    def losses(self, f, ctx=None):
        img, txt = common.gather(F.normalize(f["img"], dim=-1), F.normalize(f["txt"], dim=-1))
        scale = self.model.logit_scale.exp()
        bias = self.model.logit_bias if self.loss == "siglip" else None  # deviation 16
        losses = {"loss_clip": common.contrastive_loss(img, txt, scale, bias, self.label_smoothing)}
        if self.projector is not None:
            p_img, p_txt = self.projector(f["img"]), self.projector(f["txt"])  # (b, D), deviation 5
            p_img, p_txt, z_img, z_txt = common.gather(p_img, p_txt, f["z_img"], f["z_txt"])
            # Sec. 4.2: L = L_CLIP + L_CKC
            losses["loss_ckc"] = self.ckc_weight * ckc_loss(p_img, p_txt, z_img, z_txt, scale,
                                                            self.ckc_directions)
        return losses


# --- Sec. 4.1: LoRA integration, the merge schedule (the LoRA module itself: common.LoRA) ---
def integrate(model, alpha: float):
    """Sec. 4.1, after each task: the task's fresh adapters folded into the backbone,
      theta_t = theta_{t-1} + alpha * DeltaW,   DeltaW = B A * lora_alpha / r   (common.LoRA.delta)
    alpha = --merge-alpha, 0.5 after every task; the research code's alpha 1, then a_mix's share
    (a_mix_share; deviation 1). The result is a plain open_clip model: the next task's old model."""
    return common.merge_lora(model, alpha)


def a_mix_share(i: int) -> float:
    """--merge-schedule research / a_mix (deviation 1): after task i + 1 (i > 0) the new model's
    share of the interpolation with the previous task's model: 1/2 after task 2, 1/3 later."""
    return 1 / (1 + min(i, 2))


# --- Training: one task, evaluation after each task, the sequence ---
class Interrupted(Exception):
    """Raised when --stop-at / --stop-after-tasks end a run early (tests of resume)."""


def make_lr_of(cfg, lr_image, lr_text):
    """Per-encoder learning rates (Sec. 5.2.3): image tower, text tower, rest."""
    def lr_of(name):
        if name.startswith("model.visual."):
            return lr_image
        if name.startswith("projector."):
            return lr_image if cfg.projector_lr == "image" else cfg.lr
        if name in ("model.logit_scale", "model.logit_bias"):
            return cfg.lr
        return lr_text  # token/positional embedding, text transformer, ln_final, text_projection
    return lr_of


def run(cfg: CClipConfig, first_row: dict | None = None, world=None) -> dict:
    """The continual sequence for one method; returns the summary (first_row: row 0, when the
    caller has it; world: the lab's)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = common.init_distributed(cfg.device)
    rank = manifests.dist_info()[0]
    tasks = cclip_tasks.resolve_tasks(cfg, world)
    unseen, zero_shot = cclip_tasks.resolve_eval_sets(cfg)
    if cfg.tasks == "vlcl" and cfg.zero_shot == "auto":
        print("[cclip] zero-shot: imagenet, cifar100; add Flowers, DTD, Food101, Cars with "
              "--zero-shot imagenet,cifar100,imagefolder:<path>,...", file=sys.stderr)
    torch.manual_seed(cfg.seed)  # random-init backbones are reproducible too (resume tests)
    model, train_tf, eval_tf, tokenizer = models.load_model(
        cfg.backbone, cfg.pretrained, device=device, cache_dir=cfg.cache_dir, world=world)
    models.pair_bias(model, cfg.loss, cfg.siglip_init)  # --loss siglip's logit_bias (deviation 16)
    use_lora, use_ckc = cfg.method in ("lora", "cclip"), cfg.method in ("ckc", "cclip")
    out = Path(cfg.out)

    def learn_task(i, task, task_out, resume):
        if cfg.stop_after_tasks and i >= cfg.stop_after_tasks:
            raise Interrupted(f"stopped before task {i + 1} (--stop-after-tasks)")
        torch.manual_seed(cfg.seed + i)  # fresh adapters / projector, the same on resume
        research = cfg.merge_schedule in ("research", "a_mix")  # deviation 1
        averaged = cfg.merge_schedule == "research" and i + 1 >= cclip_tasks.AVERAGE_FROM_TASK
        if averaged:  # from task 5: start (and distil) from the average of the tasks' own results
            model.load_state_dict(cclip_tasks.average_of_task_results(out, tasks, i))
        teacher = copy.deepcopy(model) if use_ckc else None  # the model at the end of task i-1
        previous = copy.deepcopy(model.state_dict()) if research else None
        if use_lora:
            keep = ("logit_bias",) if cfg.loss == "siglip" else ()  # deviation 16
            common.add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout,
                            cfg.lora_targets.split(","), keep)
            if cfg.train_rest:  # deviation 4: everything but the adapted (frozen) originals trains
                for name, p in model.named_parameters():
                    p.requires_grad_(not name.endswith(".original"))
        # deviation 12: a fresh projector for every task, dropped at its end
        head = projector(model.visual.output_dim, cfg.proj_hidden) if use_ckc else None
        net = CClip(model, teacher, head, cfg.ckc_weight, cfg.label_smoothing, cfg.ckc_directions,
                    cfg.loss)
        lr_image, lr_text = cclip_tasks.task_lrs(cfg, task.name)
        task_cfg = dataclasses.replace(cfg, out=str(task_out), resume="latest" if resume else "",
                                       train_data=task.train)
        dataset = common.training_set(
            cfg, task.train, cclip_tasks.train_transform(cfg, task.name, train_tf, eval_tf))
        schedule = (cclip_tasks.epoch_warmup_cosine(  # deviation 13
            len(dataset) // cfg.batch_size, min(5, cfg.epochs - 1), cfg.epochs, 0.01 * lr_image,
            0.01 * lr_image) if cfg.schedule == "research" else None)
        summary = common.train(task_cfg, net, dataset, common.Collate(tokenizer),
                               lr_of=make_lr_of(cfg, lr_image, lr_text), export=False,
                               schedule=schedule)
        if "stopped_at" in summary:
            raise Interrupted(f"stopped in task {i + 1} at step {summary['stopped_at']} "
                              f"(--stop-at)")
        if use_lora:  # Sec. 4.1; research: alpha 1, then a_mix (dev. 1)
            integrate(model, 1.0 if research else cfg.merge_alpha)
        if cfg.merge_schedule == "research" and rank == 0:  # the task's own result (averaged later)
            models.save_model(model, Path(task_out) / cclip_tasks.OWN_RESULT, cfg.backbone,
                              twin=False)
        if research and i > 0 and not averaged:  # a_mix.py (from task 5: the average instead)
            model.load_state_dict(wise_ft.interpolate_weights(previous, model.state_dict(),
                                                              a_mix_share(i)))
        model.requires_grad_(True)
        if rank == 0:
            models.save_model(model, Path(task_out) / "model.pt", cfg.backbone,
                              source=f"cclip task {i + 1}", twin=cfg.task_safetensors)
        return {**summary, "lr_image": lr_image, "lr_text": lr_text}

    def evaluate():  # a row of the matrices (Sec. 3.3): R@1 per task both ways, 'R@1' their mean
        names, extra = [t.test for t in tasks], ([unseen] if unseen else []) + list(zero_shot)
        records = evaluation.evaluate(model, eval_tf, tokenizer, [*names, *extra], cfg.data_root,
                                      device=device, synthetic_n=cfg.eval_n or None)
        return cclip_tasks.continual_row(records, names, extra)  # (MTIL's test sets: top-1)

    def save_state(path):  # the merged weights = the old model of the next task
        if rank == 0:
            models.save_model(model, path, cfg.backbone, source="cclip task boundary", twin=False)

    if rank == 0 and not (out / "config.json").exists():  # main's preflight wrote it (+ resume)
        out.mkdir(parents=True, exist_ok=True)
        runfolder.write_config(cfg, out)
    summary = common.run_continual(
        out, tasks, learn_task, evaluate, save_state,
        lambda path: model.load_state_dict(loading.load_weights_only(path, map_location=device)),
        resume=bool(cfg.resume), log=lambda m: print(f"[cclip] {m}", file=sys.stderr),
        first_row=first_row)
    if rank == 0:
        models.save_model(model, out / "model.pt", cfg.backbone, source=f"cclip {cfg.method}")
        if cfg.export:  # the merged model, in open_clip's hub layout (results kept if it fails)
            summary.update(models.export_after_training(model, cfg.export, cfg.backbone,
                                                        out / "model.pt"))
        common.write_results(out, results.of_sequence("cclip", summary, tasks), cfg)
    return summary


# --- Main ---
def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--demo" in argv:  # the lab: world, tiny backbone, seeds, claims (lab/demos/cclip.py)
        from lab.demos import cclip as demo
        return demo.main(argv)
    cfg = flags.parse_config(CClipConfig, argv)
    if cfg.lora:  # the shared --lora R is C-CLIP's own LoRA (Sec. 4.1) at rank R
        method = {"full": "lora", "ckc": "cclip"}.get(cfg.method, cfg.method)
        cfg = dataclasses.replace(cfg, lora_rank=cfg.lora, lora=0, method=method)
    world = None
    if models.wants_lab(cfg):  # --backbone tiny / --tasks synthetic: the lab's world, handed on
        from lab import WORLD as world
    cfg, tasks = cclip_tasks.checked_tasks(cfg, world)  # --tasks auto, rows, --out: no model yet
    try:
        summary = run(cfg, world=world)
    except Interrupted as e:
        print(f"[cclip] {e}; continue with --resume latest", file=sys.stderr)
        return {"interrupted": str(e)}
    print(results.sequence_table(summary, tasks))  # the user's numbers first (issue 42.3)
    print(f"\n{cclip_tasks.matrix_heading(cfg.method, [t.test for t in tasks])}\n")
    print(evaluation.continual_tables(summary, [t.name for t in tasks]))
    if "mtil" in summary:  # ZSCL's Transfer / Average / Last (papers/zscl_mtil.py)
        return zscl_mtil.report(cfg.method, summary, tasks, cfg.backbone)
    row = {"method": cfg.method,
           **evaluation.continual_headline(summary, *cclip_tasks.resolve_eval_sets(cfg))}
    table = markdown_table([row], list(row))  # method, then the headline's columns in order
    print(f"\n## C-CLIP (Sec. 5.2.1 shape)\n\n{table}")
    return {"rows": [row], "table": table, "summary": summary}


if __name__ == "__main__":
    from plumbing.cli import cli  # one message per expected failure, signals
    cli(main)
