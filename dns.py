"""DNS: dual-sided null-space projection for continual image-text contrastive learning.

Paper: Xiaohao Liu, Xiaobo Xia, See-Kiong Ng, Tat-Seng Chua. "Continual
Multimodal Contrastive Learning" (CMCL). NeurIPS 2025. arXiv:2503.14963,
https://arxiv.org/abs/2503.14963. The comments cite its theorems (Thm. 4:
the dual-sided projection; Thm. 5, 6: the stability and plasticity bounds)
and its problem formulation (the stability condition on alignment scores,
the multi-step extension with running covariances).
Released code ("the code" below): github.com/Xiaohao-Liu/CMCL (cmcl/dns.py,
cmcl/base.py, training.py).

What is implemented, on CLIP
  Frozen open_clip encoders; every task's image and text features are
  extracted once and cached. The trainable part is one linear map per
  modality, W_img and W_txt (D x D, identity at the start, so the start IS
  CLIP), and the score of an image v and a text t (L2-normalised CLIP
  features) is
      score(v, t) = s (W_img v) . (W_txt t)                (problem formulation)
  without renormalising after the map: renormalising would make the score
  non-linear in W, and the projection below would no longer be exact.
  Training is CLIP's symmetric InfoNCE on these scores (common.clip_loss);
  --loss code --bias trains as the code does (deviations 14, 4).

  Stability (problem formulation, Thm. 4): a change dW_img leaves every old
  score unchanged to first order when  P_out dW_img P_in = 0,  where P_in
  projects onto the span of the old image features v and P_out onto the
  span of the old MAPPED partner features W_txt t (and symmetrically for
  W_txt). So each change is replaced by
      dW <- dW - P_out dW P_in                                       (Thm. 4)
  Projectors come from running uncentered covariances accumulated over all
  past tasks without storing data (multi-step extension):
      Z <- Z n/(n + n_t) + X^T X/(n + n_t),   n <- n + n_t
      P = U_k U_k^T, U_k = eigenvectors of Z with |eigenvalue| > lambda_min
  The input side uses Z_img (Z_txt); the output side, by default, the whole
  history re-mapped with the weights at the end of the previous task,
  W_txt Z_txt W_txt^T (W_img Z_img W_img^T): the span the stability
  condition asks for with the current maps. --output-cov per-task
  accumulates each task's mapped features with THAT task's end weights, as
  the code does (deviation 13). Covariances are updated after each task;
  projectors are rebuilt before each task and stay fixed during it.

  Three modes (--mode):
    gradient  the paper and the code (default): project the gradient, then
              AdamW steps. AdamW's per-coordinate scaling, its momentum and
              its decoupled weight decay move the step out of the null space,
              so the guarantee holds exactly only for plain SGD.
    update    ours: let AdamW compute its step, then project the actual
              change of the weights (snapshot before the step, project
              W_after - W_before after it). Every applied change satisfies
              P_out dW P_in = 0 whatever the optimizer does.
    vanilla   no projection (the paper's baseline).
  What remains in update mode is second order: both maps move in the same
  task, and the cross term (dW_txt t)^T (dW_img v) is not constrained. The
  test on synthetic low-rank features bounds the whole change of the old
  score matrix at 1e-4 relative; the demo prints it.

Code name -> paper symbol
  W_img, W_txt        W^{m} (one trainable linear map per modality; W_<m> in CMCL's setting)
  img, txt            v, t: frozen, L2-normalised CLIP features (N, D)
  logit_scale         ln s (s = 1/tau), CLIP's value, frozen
  Z_img, Z_txt, n     running uncentered covariances Z-bar_{<t}^{m}, sample count
  P_out               P-tilde of Thm. 4, the LEFT factor: output side (old mapped partner features)
  P_in                P' of Thm. 4, the RIGHT factor: input side (old features of this modality)
                      (Thm. 4: Delta W = grad - P-tilde grad P'; the paper's global form writes the
                      same projection with other letters, W-bar = W-tilde - P' W-tilde P)
  lambda_min          the truncation threshold lambda_min (input side; --lambda-min-out the output side)
  project_gradient    dW = G - P_out G P_in (Thm. 4)
  score_drift         ||A_{t-1;t} - A_{t-1;t-1}||_F / ||A_{t-1;t-1}||_F (the stability condition)

Deviations (numbered; "the code" = github.com/Xiaohao-Liu/CMCL)
  1. Backbone: CLIP (image, text) instead of ImageBind / LanguageBind /
     UniBind with 7 modalities; so both modalities are active in every task
     and the "zero gradient for inactive modalities" rule never triggers
     (it does in CMCL's own setting, --features, below).
  2. --mode gradient (default) is the paper's and the code's projection;
     --mode update is ours. Reason for offering it: with AdamW the gradient
     projection does not bound the applied step (measured in the demo and
     in the tests).
  3. Clipping order: common.train clips the global gradient norm BEFORE the
     hook, so in gradient mode we clip then project, like the code (the
     Hugging Face Trainer clips before its on_pre_optimizer_step callback;
     the clip sees the unprojected norm). In update mode clipping only
     shapes the optimizer's step; the projection of the final change comes
     after everything and is what keeps the guarantee.
  4. No biases by default: the maps are bias-free, as in the paper's theory.
     The code's maps are nn.Linear with biases (zero at the start) that are
     never projected, another leak of the guarantee (a bias shifts every old
     score): --bias.
  5. The temperature is CLIP's logit_scale, frozen (ours): a trained
     temperature rescales every old score and no projection of W can stop it.
  6. Output-side threshold: the same lambda_min on both sides by default
     (paper). The code's output side uses 0 (get_projector(..., lambda_min=0)),
     which keeps every numerically non-zero direction, i.e. the projection is
     in effect one-sided: --lambda-min-out 0. The code's version pin
     (transformers 4.30.2, whose Trainer has no on_pre_optimizer_step
     callback) never runs the projection hook at all; that is not
     reproduced: the tests check that the hook runs and changes the step.
  7. Schedule: the shared warm-up + cosine (no warm-up by default) instead
     of the code's linear decay. AdamW betas (0.9, 0.999), eps 1e-8 (PyTorch
     defaults; the paper gives no values - our assumption).
  8. Eigen-decomposition (eigh, float64) of the symmetric covariances
     instead of the code's SVD (same subspace; |eigenvalue| = singular value,
     so the thresholds mean the same); lambda_min absolute as in the paper,
     --lambda-relative (ours) makes it a fraction of the largest eigenvalue.
  9. Features are extracted once with the eval transform (no augmentation)
     and cached under --feature-cache; the encoders never run during training.
 10. Evaluation on CLIP data: after every task R@1 and R@10 in both
     directions on every task's test set, per-task classification with class
     prompts through W_txt (the synthetic world's shapes; the paper's
     per-dataset classification), zero-shot accuracy on --zeroshot sets.
     Acc / BWT / R@10 as the paper; BWT = mean_j (R[T][j] - R[j][j]).
 11. One process: the trainable part is two D x D matrices on cached
     features, so torchrun brings nothing; dns.py refuses WORLD_SIZE > 1.
 12. Speed (ours): the same projection in the form of fewest operations
     (projection_flops; --projection-form): dense G - P_out G P_in (4 D^3
     flops), factored G - U_out (U_out^T G U_in) U_in^T
     (project_gradient_factored, ~2 (k_out + k_in) D^2), or from the batch,
     since G = delta^T X: delta^T X - (delta P_out)^T (X P_in)
     (project_gradient_activations, ~2 B D (k_out + k_in) + 2 min(k) D^2 or
     ~2 B D^2; projected_linear makes it the map's backward). All tested
     equal to project_gradient.
 13. Output-side covariance: ours re-maps the whole history with the current
     weights (W_txt Z_txt W_txt^T at the start of each task), the span the
     stability condition needs for the maps as they are now. The code
     accumulates each task's output-side covariance with THAT task's end
     weights (cmcl/dns.py update_covariance), so older tasks keep the span
     of maps that have since moved: --output-cov per-task.
 14. Training loss: ours is CLIP's symmetric InfoNCE at CLIP's (frozen)
     scale. The code's (cmcl/base.py train_loss) is a one-direction
     cross-entropy, the pair's first modality (here the image) as anchor
     over the second, at temperature 1, on maps with biases: --loss code
     (with --bias).
 15. Threshold default: 0.01, the paper's value for ImageBind / UniBind. The
     code's training.py defaults to 0.1 (lambda_min=1e-1): --lambda-min 0.1.

CMCL's own setting (--features DIR; run_cmcl)
  The paper's experiments: frozen binding encoders (ImageBind, LanguageBind,
  UniBind), features cached per sample, one trainable linear map per
  modality (vision, text, audio, depth, tactile, thermal, video), 11 steps
  over 7 datasets, each step one modality pair. The code's training.py step
  list, in its syntax dataset[:i,j] (indices into the dataset's modality
  array, no suffix = 0,1), and the modalities that picks (dataloader.py,
  ModalityType order):
     1 ucf101 (text-video)     2 esc50 (text-audio)     3 nyudv2:0,2 (vision-depth)
     4 clotho (text-audio)     5-7 vggsound_s:0,1 / 0,2 / 1,2 (text-audio, text-video, audio-video)
     8-10 tvl:0,2 / 1,2 / 0,1 (vision-tactile, text-tactile, vision-text)   11 llvip (vision-thermal)
  --tasks cmcl runs it; --tasks 'a~b:0,2~...' any other sequence.
  Learner (DNSLearner, the same one the CLIP path uses with modalities
  (img, txt)): W_m (D x D, identity at the start) per modality; a step on (a, b)
  trains W_a and W_b only: every other map is frozen (requires_grad off, so
  it is not in AdamW at all: AdamW's decoupled weight decay would move a map
  even with a zero gradient; tested). Per modality m, kept from every past
  step m took part in: the input covariance Z[m] of m's own features and,
  per partner c, the covariance of c's raw features; W_m's output side is
  sum_c (n_mc / n_m) W_c Z_mc W_c^T with the current maps (ours, as above;
  --output-cov per-task: the code's accumulation). A map whose modality has
  no past yet is not projected (the code's projectors are zero then). Both
  --mode gradient and --mode update.
  Evaluation after every step on every step's test set (the matrices hold
  future sets too; the summaries use the seen ones): R@1/5/10 (mean of both
  directions, sample i's partner is sample i); accuracy where the dataset
  has classes and the pair includes text (the non-text side against the
  text map of the class features). Acc / R@10 last, BWT and forgetting by
  common.continual_metrics' definitions over the sets that have the metric
  (eval.masked_continual_metrics). The paper's numbers to expect: CMCL_PAPER
  (ImageBind: vanilla 47.32 acc / -5.72 BWT_A, DNS 52.52 / -0.02).
  Feature layouts (eval.read_features, described there): the code's
  features_storage/ h5 files (<dataset>_<split>_<perceptor>.h5, one
  (modalities, d) array per sample id keyed "<id>__<class name>__<class
  index>"; <dataset>_class_<perceptor>.h5), or ours for any encoder
  (<dataset>/meta.json, <dataset>/<split>/<modality>.npy|.pt).

  Differences in this setting (continuing the numbering; "the code" as above)
 16. Covariance counts per modality (ours): Z[m] is the mean over the samples
     of the steps m took part in. The code keeps ONE count n_bar over all
     steps (cmcl/dns.py update_covariance), so a modality's covariance is
     divided by samples it never saw, and the absolute lambda_min cuts a
     different number of directions as the sequence grows.
 17. Which features feed the covariances: ours, the step's own pair. The
     code's post_step stacks the whole (modalities, d) arrays and updates
     the pair's first modality with array column 0 and the second with
     column 1, whatever the step's indices (cmcl/dns.py post_step,
     feature_pairs[:,0] / [:,1]): for nyudv2:0,2, vggsound_s:0,2 and tvl:0,2
     the second modality (depth, video, tactile) receives column 1's
     features (text, audio, text), and for vggsound_s:1,2 and tvl:1,2 both
     sides receive another modality's features.
 18. Recall: on the whole test set (deterministic), mean of both directions.
     The code averages 5 random subsets of 1000 per direction and reports
     each direction (eval_util.py eval); the paper's R@10 presumably their
     mean. Recall is computed for ucf101 too (the code: accuracy only).
 19. Class features: the code's extractor stores, per class, the text
     feature of the first sample of that class (save_classes); we read
     whatever the class h5 holds, keyed and sorted by class name, as the
     code does. A sample's class: the name field of its h5 key (the code's
     perceptors store "<id>__<class name>__<class index>") or a labels
     JSON; the code matches "__"-split key prefixes against its dataset
     JSON. Features are used as stored, not renormalised (as the code:
     its perceptors store the encoder outputs before their final
     normalisation, so each modality keeps its own norm).
 20. Temperature: CLIP's initial 1/0.07, frozen, for the clip loss (ours;
     binding models differ); --loss code is the code's temperature 1.
 21. The demo (--demo-cmcl) runs on lab.synthetic_multimodal(), a world of
     shared latent factors seen through per-modality mixings plus
     modality-specific noise, with the real datasets' names and modality
     lists, not on real features; lr 1e-3 there (the code's LanguageBind
     value), the rest the paper's.

Commands
  one GPU:  python dns.py --backbone ViT-B/16 --data-root data \\
              --tasks flickr30k=f30k_train.jsonl:f30k_test.jsonl,coco=coco_train.jsonl:coco_test.jsonl \\
              --task-classes '' --zeroshot '' --out runs/dns
            (--mode update for ours / --mode vanilla for the baseline)
  the code's settings (deviations 4, 6, 13, 14, 15):
            ... --mode gradient --loss code --bias --output-cov per-task --lambda-min 0.1 --lambda-min-out 0
  torchrun: not needed (deviation 11).
  demo:     python dns.py --demo   (synthetic domains, tiny backbone, CPU, < 3 min)
  CMCL:     python dns.py --features features_storage --tasks cmcl --perceptor imagebind --mode update
            (the code's settings: --mode gradient --loss code --bias --output-cov per-task
             --lambda-min 0.1 --lambda-min-out 0; --lr 1e-3 for languagebind)
  CMCL demo: python dns.py --demo-cmcl   (synthetic multimodal world, CPU)
"""
# =============================================================================
# Imports
# =============================================================================
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
import lab
import eval as evaluation


# =============================================================================
# Config
# =============================================================================
@dataclass(frozen=True)
class DNSConfig(common.Config):
    mode: str = common.arg("gradient", "gradient: project the gradient (paper, the code) | update: project the "
                           "optimizer's actual step (ours, deviation 2) | vanilla: no projection",
                           choices=("gradient", "update", "vanilla"))
    lambda_min: float = common.arg(0.01, "keep covariance eigen-directions with |eigenvalue| > this "
                                   "(paper: 0.01 ImageBind/UniBind, 1e-4 LanguageBind; the code: 0.1, deviation 15)")
    lambda_min_out: float = common.arg(-1.0, "output-side threshold (< 0: --lambda-min, the paper; the code: 0, "
                                       "deviation 6)")
    lambda_relative: bool = common.arg(False, "ours: lambda_min is a fraction of the largest eigenvalue")
    output_cov: str = common.arg("current", "output-side covariance: current: the history re-mapped with the "
                                 "current maps (ours) | per-task: each task mapped with its end weights (the code, "
                                 "deviation 13)", choices=("current", "per-task"))
    loss: str = common.arg("clip", "clip: symmetric InfoNCE at CLIP's scale (ours) | code: one-direction CE at "
                           "temperature 1 (the code, deviation 14)", choices=("clip", "code"))
    bias: bool = common.arg(False, "biases on both maps, never projected (the code, deviation 4)")
    tasks: str = common.arg("auto", "task sequence 'name=train.jsonl[:test.jsonl],...', 'synthetic', or 'auto' "
                            "(synthetic with --backbone tiny; the paper's data has no layout here)")
    zeroshot: str = common.arg("synthetic-shape,synthetic-color", "eval.py classification sets measured after "
                               "every task, class prompts through W_txt ('' = none)")
    task_classes: str = common.arg("shape", "ours: synthetic label set for per-task classification of each task's "
                                   "test set ('' = off, e.g. for real data)")
    feature_cache: str = common.arg("", "ours: folder of cached frozen features ('' = <out>/features)")
    demo: bool = common.arg(False, "run the synthetic demo: vanilla / gradient / update on the tiny backbone")
    features: str = common.arg("", "CMCL setting: folder of cached features (the code's features_storage/ h5 "
                               "files, or our layout); --tasks is then 'cmcl' (the code's 11 steps, also its default "
                               "here) or 'dataset[:i,j]~...'")
    perceptor: str = common.arg("imagebind", "CMCL setting: the encoder in the h5 names "
                                "(<dataset>_<split>_<perceptor>.h5: imagebind, languagebind, unibind)")
    demo_cmcl: bool = common.arg(False, "run the CMCL-setting demo: the 11 steps on a synthetic multimodal world")
    lr: float = common.arg(1e-4, "AdamW learning rate (paper, implementation details)")
    wd: float = common.arg(1e-3, "AdamW weight decay (paper)")
    batch_size: int = common.arg(64, "batch size (paper)")
    epochs: int = common.arg(5, "epochs per task (released code)")
    beta2: float = common.arg(0.999, "AdamW beta2 (PyTorch default; not in the paper)")
    eps: float = common.arg(1e-8, "AdamW eps (PyTorch default; not in the paper)")
    workers: int = common.arg(0, "ours: features live in memory, no loader workers")
    save_every: int = common.arg(0, "steps between checkpoints (0: one at the end of each task)")
    projection_form: str = common.arg("auto", "ours (speed, deviation 12): auto: per map the form of fewest "
                                      "operations | dense | factored; all compute the same projection",
                                      choices=("auto", "dense", "factored"))


# =============================================================================
# Losses and projections (pure functions of tensors)
# =============================================================================
def dns_scores(img, txt, W_img, W_txt, b_img=None, b_txt=None):
    """Alignment scores without the temperature (problem formulation):
        A[i, j] = (W_img v_i + b_img) . (W_txt t_j + b_txt)
    img (N, D), txt (M, D): frozen normalised features; W_img, W_txt (D, D),
    mapped = x W^T (+ b, only with --bias). No renormalisation after the
    map. Returns (N, M)."""
    mapped_img, mapped_txt = img @ W_img.t(), txt @ W_txt.t()
    if b_img is not None:  # deviation 4: the code's biases
        mapped_img, mapped_txt = mapped_img + b_img, mapped_txt + b_txt
    # score(v, t) = (W_txt t)^T (W_img v)
    return mapped_img @ mapped_txt.t()


def code_loss(img, txt):
    """The code's training loss (cmcl/base.py Base.train_loss; deviation 14):
    one direction, temperature 1, on the mapped features,
        L = CE(A B^T, arange(B)) = -1/B sum_i log exp(a_i.b_i) / sum_j exp(a_i.b_j)
    img (B, D): mapped features of the pair's first modality (the anchors),
    txt (B, D): mapped features of the second; neither normalised."""
    logits = img.float() @ txt.float().t()  # (B, B), temperature 1
    # deviation 14: rows only (image -> text), no symmetric term
    return F.cross_entropy(logits, torch.arange(len(img), device=img.device))


def null_space_projector(Z, lambda_min: float, relative: bool = False):
    """P = U_k U_k^T over the eigenvectors of the symmetric Z (D, D) whose
    |eigenvalue| exceeds lambda_min (absolute; with relative=True a fraction
    of the largest eigenvalue). For the positive semi-definite covariances
    |eigenvalue| is the singular value the code's SVD thresholds
    (cmcl/base.py get_projector), so lambda_min = 0 keeps, as there, every
    numerically non-zero direction, rounding noise of either sign included.
    P projects onto the span of the old features; I - P onto the null space
    an update may use. Returns (D, D), Z's dtype."""
    # multi-step extension: truncated eigendecomposition of the running covariance
    evals, U = torch.linalg.eigh(0.5 * (Z + Z.t()).double())
    threshold = lambda_min * float(evals.abs().max()) if relative else lambda_min
    U_k = U[:, evals.abs() > threshold]  # (D, k)
    return (U_k @ U_k.t()).to(Z.dtype)


def project_gradient(G, P_out, P_in):
    """Dual-sided null-space projection (Thm. 4):
        dW = G - P_out G P_in
    G (D_out, D_in): a gradient or an update of W (mapped = x W^T);
    P_out (D_out, D_out): span of the old mapped partner features;
    P_in (D_in, D_in): span of the old input features. Then P_out dW P_in = 0."""
    # Thm. 4: dW = G - P_out G P_in
    return G - P_out @ G @ P_in


def project_gradient_factored(G, U_out, U_in):
    """project_gradient with P = U U^T given by orthonormal bases (D, k):
        dW = G - U_out (U_out^T G U_in) U_in^T
    The same result at (k_out + k_in) D^2 operations instead of 2 D^3, the
    saving when the old subspaces are small (tests check the equality)."""
    # Thm. 4, with P_out = U_out U_out^T and P_in = U_in U_in^T
    return G - U_out @ ((U_out.t() @ G) @ U_in) @ U_in.t()


def project_gradient_activations(delta, X, U_out, U_in, order: str = "auto"):
    """project_gradient for the gradient of a linear map over a batch, taken
    from the batch itself: mapped = X W^T gives G = delta^T X, and with
    P = U U^T (symmetric)
        dW = delta^T X - (delta P_out)^T (X P_in)
           = delta^T X - U_out ((delta U_out)^T (X U_in)) U_in^T.
    delta (B, D_out): gradient of the loss w.r.t. the map's output;
    X (B, D_in): the map's input; U_out (D_out, k_out), U_in (D_in, k_in):
    orthonormal bases. order: 'basis' (through the (k_out, k_in) core; the
    saving when B is not small), 'batch' (project the B rows on both sides,
    then one product [delta, -delta P_out]^T [X, X P_in]; the saving when B
    is small), 'auto': the cheaper by projection_flops. Equal to
    project_gradient(delta^T X, P_out, P_in) (tests check it)."""
    if order == "auto":
        d_out, d_in, k_out, k_in = U_out.shape[0], U_in.shape[0], U_out.shape[1], U_in.shape[1]
        order = min(("basis", "batch"), key=lambda o: _activation_flops(o, len(X), d_out, d_in, k_out, k_in))
    if order == "basis":
        core = (delta @ U_out).t() @ (X @ U_in)  # (k_out, k_in)
        # U_out core U_in^T, the cheaper association: the D_out D_in term goes with the smaller rank
        correction = U_out @ (core @ U_in.t()) if U_out.shape[1] <= U_in.shape[1] else (U_out @ core) @ U_in.t()
        return delta.t() @ X - correction
    if order != "batch":
        raise ValueError(f"order is 'auto', 'basis' or 'batch', not {order!r}")
    # Thm. 4 on the batch: delta^T X - (delta P_out)^T (X P_in), both in ONE (2B)-row product
    delta_old = (delta @ U_out) @ U_out.t()  # (B, D_out) delta P_out
    X_old = (X @ U_in) @ U_in.t()  # (B, D_in) X P_in
    return torch.cat([delta, -delta_old]).t() @ torch.cat([X, X_old])


def _activation_flops(order: str, batch: int, d_out: int, d_in: int, k_out: int, k_in: int) -> int:
    """Floating-point operations (2 per multiply-add, as
    torch.utils.flop_counter counts them) of project_gradient_activations
    beyond the plain gradient delta^T X (2 B D_out D_in)."""
    if order == "basis":  # U_out (core U_in^T) when k_out <= k_in, else (U_out core) U_in^T
        last = 2 * k_in * (k_out * d_in if k_out <= k_in else k_out * d_out) + 2 * d_out * d_in * min(k_out, k_in)
        return 2 * batch * (d_out * k_out + d_in * k_in + k_out * k_in) + last
    return 4 * batch * (d_out * k_out + d_in * k_in) + 2 * batch * d_out * d_in


def projection_flops(form: str, d_out: int, d_in: int, k_out: int, k_in: int, batch: int = 0) -> int:
    """Floating-point operations of one projection of a (D_out, D_in) map's
    gradient with old subspaces of ranks k_out, k_in (2 per multiply-add;
    element-wise subtractions not counted):
        dense        G - P_out G P_in                      2 D_out D_in (D_out + D_in)
        factored     G - U_out (U_out^T G U_in) U_in^T     ~2 D_out D_in (k_out + k_in)
        activations  from the batch (size `batch`), beyond delta^T X: the cheaper
                     order of project_gradient_activations, ~2 B D (k_out + k_in) + 2 D^2 min(k)
                     or ~2 B D^2"""
    if form == "dense":
        return 2 * d_out * d_out * d_in + 2 * d_out * d_in * d_in
    if form == "factored":
        return 2 * k_out * d_out * d_in + 2 * k_out * d_in * k_in + 2 * d_out * k_out * k_in + 2 * d_out * k_in * d_in
    if form == "activations":
        return min(_activation_flops(o, batch, d_out, d_in, k_out, k_in) for o in ("basis", "batch"))
    raise ValueError(f"unknown projection form {form!r}")


def cheapest_projection_form(d_out: int, d_in: int, k_out: int, k_in: int, batch: int = 0) -> str:
    """The form of least projection_flops: 'dense' or 'factored' for a
    gradient at hand; 'activations' too when batch > 0 (the map's forward
    can hand its batch to projected_linear)."""
    forms = ("dense", "factored", "activations") if batch > 0 else ("dense", "factored")
    return min(forms, key=lambda f: projection_flops(f, d_out, d_in, k_out, k_in, batch))


class ProjectedLinear(torch.autograd.Function):
    """mapped = x W^T whose backward returns W's gradient already projected
    (Thm. 4, from the batch: project_gradient_activations):
        grad_W = delta^T x - U_out ((delta U_out)^T (x U_in)) U_in^T
    and x's gradient unchanged (delta W). x (..., D_in), W (D_out, D_in),
    U_out (D_out, k_out), U_in (D_in, k_in) orthonormal, not trained."""

    @staticmethod
    def forward(ctx, x, W, U_out, U_in):
        ctx.save_for_backward(x, W, U_out, U_in)
        return x @ W.t()

    @staticmethod
    def backward(ctx, grad_out):
        x, W, U_out, U_in = ctx.saved_tensors
        grad_x = grad_W = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_out @ W.to(grad_out.dtype)).to(x.dtype)
        if ctx.needs_input_grad[1]:  # the projection in float32 at least (as the hooks do)
            dtype = torch.promote_types(W.dtype, torch.float32)
            delta, X = grad_out.reshape(-1, W.shape[0]).to(dtype), x.reshape(-1, W.shape[1]).to(dtype)
            grad_W = project_gradient_activations(delta, X, U_out.to(dtype), U_in.to(dtype)).to(W.dtype)
        return grad_x, grad_W, None, None


def projected_linear(x, W, U_out, U_in):
    """x W^T, W's gradient projected in the backward (ProjectedLinear)."""
    return ProjectedLinear.apply(x, W, U_out, U_in)


def projector_basis(P):
    """An orthonormal basis (D, k) of the range of a projector P = U_k U_k^T."""
    evals, U = torch.linalg.eigh(0.5 * (P + P.t()).double())
    return U[:, evals > 0.5].to(P.dtype)


def update_covariance(Z, n: int, X):
    """Running uncentered covariance over all tasks so far (multi-step extension):
        Z <- Z n/(n + n_t) + X^T X/(n + n_t),  n <- n + n_t
    Z (D, D), X (n_t, D) the new task's features. Returns (Z, n)."""
    X = X.to(Z.dtype)
    n_t = len(X)
    # running mean of x x^T: old mass n, new mass n_t
    return Z * (n / (n + n_t)) + X.t() @ X / (n + n_t), n + n_t


def score_drift(img, txt, maps_before, maps_after):
    """Relative change of an old task's score matrix (the stability condition):
        ||A_after - A_before||_F / ||A_before||_F
    img (N, D), txt (M, D); maps_* = (W_img, W_txt) or (W_img, W_txt, b_img,
    b_txt) with --bias. Computed in float64."""
    before = dns_scores(img.double(), txt.double(), *(w.double().cpu() for w in maps_before))
    after = dns_scores(img.double(), txt.double(), *(w.double().cpu() for w in maps_after))
    return float((after - before).norm() / before.norm().clamp(min=1e-30))


# =============================================================================
# Model wrapper
# =============================================================================
CLIP_MODALITIES = ("img", "txt")  # the CLIP path's two maps: parameters W_img, W_txt (b_img, b_txt)


class ModalityMaps(nn.Module):
    """The trainable part: one map W_<m> (D, D) per modality m, identity at
    the start (with --bias the code's b_<m> (D,) at zero), and CLIP's frozen
    logit_scale as a buffer (common.train reads .logit_scale). set_pair(a, b)
    makes W_a, W_b (and b_a, b_b) the only trainable parameters; map_image /
    map_text map with the pair's first / second modality. The CLIP path uses
    modalities ("img", "txt"): W_img, W_txt."""
    def __init__(self, dim: int, logit_scale: float, bias: bool = False, modalities=CLIP_MODALITIES):
        super().__init__()
        bad = [m for m in modalities if not m.isidentifier()]
        if bad or len(set(modalities)) != len(modalities) or len(modalities) < 2:
            raise ValueError(f"modality names must be >= 2 distinct identifiers, got {list(modalities)}")
        self.modalities = tuple(modalities)
        for m in self.modalities:
            self.register_parameter(f"W_{m}", nn.Parameter(torch.eye(dim)))  # (D_out, D_in)
        for m in self.modalities if bias else ():
            self.register_parameter(f"b_{m}", nn.Parameter(torch.zeros(dim)))  # deviation 4: never projected
        self.register_buffer("logit_scale", torch.tensor(float(logit_scale)))  # ln s, frozen (deviation 5)
        self.set_pair(*self.modalities[:2])

    def set_pair(self, a: str, b: str):
        """Only the pair's maps train; every other map is frozen (no gradient,
        not in the optimizer, so not even weight decay touches it)."""
        self.pair = (a, b)
        for name, p in self.named_parameters():
            p.requires_grad_(name[2:] in (a, b))

    def map(self, m: str, x, hooks=None):  # (N, D) -> (N, D)
        """x W_m^T (+ b_m). hooks: the task's NullSpaceProjection, whose
        linear() may compute the product so that W_m's gradient arrives
        already projected (the activation form, deviation 12)."""
        W, b = getattr(self, f"W_{m}"), getattr(self, f"b_{m}", None)
        y = hooks.linear(f"W_{m}", x, W) if hooks is not None and f"W_{m}" in hooks.projectors else x @ W.t()
        return y + (b if b is not None else 0)

    def map_image(self, x, hooks=None):
        return self.map(self.pair[0], x, hooks)

    def map_text(self, x, hooks=None):
        return self.map(self.pair[1], x, hooks)

    def snapshot(self) -> tuple:
        """Every map as plain CPU tensors, in parameter order (W_<m> for every
        m, then b_<m> with --bias): for the CLIP path (W_img, W_txt) or
        (W_img, W_txt, b_img, b_txt), score_drift's maps."""
        return tuple(p.detach().cpu().clone() for p in self.parameters())

    def pair_maps(self, snapshot: tuple, a: str, b: str) -> tuple:
        """(W_a, W_b) or (W_a, W_b, b_a, b_b) out of a snapshot (score_drift's maps)."""
        named = dict(zip((n for n, _ in self.named_parameters()), snapshot))
        return tuple(named[f"{p}_{m}"] for p in ("W", "b") for m in (a, b) if f"{p}_{m}" in named)


DualMaps = ModalityMaps  # the CLIP path's name: DualMaps(dim, logit_scale, bias) has W_img, W_txt


class DNSNet(nn.Module):
    """Wrapper for common.train: forward(batch, ctx) -> {"loss_clip": ...}
    (or {"loss_code": ...} with loss="code") on cached feature pairs
    batch["img"], batch["txt"] (B, D) of the maps' current pair."""
    def __init__(self, dim: int, logit_scale: float, label_smoothing: float = 0.0, loss: str = "clip",
                 bias: bool = False, modalities=CLIP_MODALITIES):
        super().__init__()
        if loss not in ("clip", "code"):
            raise ValueError(f"loss is 'clip' or 'code', not {loss!r}")
        self.model = ModalityMaps(dim, logit_scale, bias, modalities)
        self.label_smoothing, self.loss = label_smoothing, loss
        self.hooks = None  # the current task's NullSpaceProjection (DNSLearner.learn sets it)

    def forward(self, batch, ctx=None):
        img = self.model.map_image(batch["img"], self.hooks)  # (B, D), not renormalised
        txt = self.model.map_text(batch["txt"], self.hooks)
        img, txt = common.gather(img, txt)
        if self.loss == "code":  # deviation 14: one direction, temperature 1
            return {"loss_code": code_loss(img, txt)}
        return {"loss_clip": common.clip_loss(img, txt, self.model.logit_scale.exp(), self.label_smoothing)}


class FeaturePairs(torch.utils.data.Dataset):
    """Cached (image feature, text feature) training pairs."""
    def __init__(self, img, txt):
        self.img, self.txt = img, txt

    def __len__(self):
        return len(self.txt)

    def __getitem__(self, i):
        return {"img": self.img[i], "txt": self.txt[i], "index": i}


# =============================================================================
# Training
# =============================================================================
def mapped_covariance(maps: ModalityMaps, partners: dict, weights: dict) -> torch.Tensor:
    """sum_c w_c W_c Z_c W_c^T over old partner modalities c (partners =
    {c: Z_c (D, D)}, weights = {c: w_c}): the covariance of the old partner
    features mapped with the maps as they are NOW, the output side the
    stability condition asks for (ours, deviation 13). float64, CPU."""
    out = 0
    for c, Z_c in partners.items():
        W_c = getattr(maps, f"W_{c}").detach().cpu().double()
        out = out + weights[c] * (W_c @ Z_c @ W_c.t())
    return out


def pair_projectors(maps: ModalityMaps, Z_in: dict, Z_out: dict, lambda_min: float, relative: bool = False,
                    lambda_min_out: float | None = None) -> dict:
    """{param name: (P_out, P_in)} for every name in Z_in: P_in from the input
    covariance Z_in[name], P_out from the output-side covariance Z_out[name]
    (D, D each). lambda_min_out: the output side's threshold (None or < 0:
    lambda_min; the code: 0, deviation 6). float32, on the maps' device."""
    lam_out = lambda_min if lambda_min_out is None or lambda_min_out < 0 else lambda_min_out
    device = maps.logit_scale.device
    return {k: (null_space_projector(Z_out[k], lam_out, relative).float().to(device),
                null_space_projector(Z_in[k], lambda_min, relative).float().to(device)) for k in Z_in}


def build_projectors(maps: ModalityMaps, Z_img, Z_txt, lambda_min: float, relative: bool = False,
                     lambda_min_out: float | None = None, Z_out: dict | None = None):
    """The CLIP path's pair_projectors: W_img's output side is the span of the
    old mapped texts W_txt t, by default the covariance W_txt Z_txt W_txt^T
    with the CURRENT maps (the end of the previous task), and vice versa;
    Z_out = {"W_img": ..., "W_txt": ...} gives the output-side covariances
    instead (the code's per-task accumulation, deviation 13)."""
    Z_out = Z_out or {"W_img": mapped_covariance(maps, {"txt": Z_txt}, {"txt": 1.0}),
                      "W_txt": mapped_covariance(maps, {"img": Z_img}, {"img": 1.0})}
    return pair_projectors(maps, {"W_img": Z_img, "W_txt": Z_txt}, Z_out, lambda_min, relative, lambda_min_out)


class NullSpaceProjection:
    """common.train hooks. gradient mode: project W.grad after unscaling and
    clipping, before the optimizer step. update mode: remember W before the
    step, and after it replace W by W_before + project(W_after - W_before),
    so AdamW's scaling, momentum and weight decay are projected too.

    projectors: {param name: (P_out, P_in)}. form (ours, speed; every form is
    the same projection, tested equal to project_gradient): 'dense'
    (project_gradient), 'factored' (project_gradient_factored), 'auto': per
    map the one of fewer operations (projection_flops), and in gradient mode
    the activation form when a map's forward goes through linear() and it is
    cheaper still."""
    def __init__(self, mode: str, projectors: dict, form: str = "auto"):
        if mode not in ("gradient", "update"):
            raise ValueError(f"unknown projection mode {mode!r}")
        if form not in ("auto", "dense", "factored"):
            raise ValueError(f"projection form is 'auto', 'dense' or 'factored', not {form!r}")
        self.mode, self.projectors, self.form, self.before = mode, projectors, form, {}
        self.seconds, self.steps = 0.0, 0
        self._bases = {name: (projector_basis(P_out), projector_basis(P_in))
                       for name, (P_out, P_in) in projectors.items()}
        self.forms = {name: form if form != "auto" else cheapest_projection_form(
                          P_out.shape[0], P_in.shape[0], *self.rank(name)) for name, (P_out, P_in) in projectors.items()}
        self.projected_in_backward = set()  # maps whose gradient projected_linear already projected
        self.project = {}
        for name, (P_out, P_in) in projectors.items():
            if self.forms[name] == "factored":
                self.project[name] = lambda G, U=self._bases[name]: project_gradient_factored(G, *U)
            else:
                self.project[name] = lambda G, P_out=P_out, P_in=P_in: project_gradient(G, P_out, P_in)

    def bases(self, name: str) -> tuple:
        """(U_out (D_out, k_out), U_in (D_in, k_in)): orthonormal bases of the
        old subspaces of map `name`, what projected_linear takes."""
        return self._bases[name]

    def rank(self, name: str) -> tuple:
        """(k_out, k_in) of map `name`."""
        return tuple(U.shape[1] for U in self._bases[name])

    def linear(self, name: str, x, W):
        """What map `name`'s forward computes, x (B, D_in) -> x W^T (B, D_out):
        through projected_linear (W's gradient arrives projected, and the
        hook leaves it alone) when in gradient mode with form 'auto' the
        activation form costs fewer operations at this batch size; plain
        x @ W.t() otherwise. Caveat: with --grad-clip the clip then sees the
        projected gradient norm (the dense/factored hooks clip first,
        deviation 3); the direction of the step is the same."""
        if self.mode != "gradient" or self.form != "auto" or not (torch.is_grad_enabled() and W.requires_grad):
            return x @ W.t()
        if cheapest_projection_form(*W.shape, *self.rank(name), batch=x.numel() // W.shape[1]) != "activations":
            return x @ W.t()
        self.projected_in_backward.add(name)
        return projected_linear(x, W, *self._bases[name])

    @torch.no_grad()
    def before_optimizer_step(self, net):
        t0 = time.perf_counter()
        for name in self.projectors:
            p = getattr(net.model, name)
            if name in self.projected_in_backward:  # projected_linear's backward did it
                continue
            if self.mode == "gradient" and p.grad is not None:
                p.grad.copy_(self.project[name](p.grad.float()))
            elif self.mode == "update":
                self.before[name] = p.detach().clone()
        self.projected_in_backward.clear()
        self.seconds += time.perf_counter() - t0
        self.steps += 1

    @torch.no_grad()
    def after_optimizer_step(self, net):
        if self.mode != "update":
            return
        t0 = time.perf_counter()
        for name in self.projectors:
            p, start = getattr(net.model, name), self.before.pop(name)
            p.copy_(start + self.project[name](p - start))
        self.seconds += time.perf_counter() - t0


class DNSLearner:
    """The method's state over a sequence of modality-pair steps (on CLIP:
    image-text tasks with modalities ("img", "txt")). Per modality m: the
    running input covariance Z[m] of m's own features over every past step m
    took part in (n[m] samples); per partner c of m, the running covariance
    Zp[m][c] of c's raw features in those steps (n_pair[m][c] samples), so
    W_m's output side is  sum_c (n_pair[m][c] / n[m]) W_c Zp[m][c] W_c^T  with
    the current maps (on CLIP: W_txt Z_txt W_txt^T for W_img); Zo[m]: the
    code's per-task output side (deviation 13); the maps after each step (for
    the drift measure). A step trains only its pair's maps; a map whose
    modality has no past yet is not projected (as the code, whose projectors
    are zero then)."""
    def __init__(self, dim: int, logit_scale: float, label_smoothing: float = 0.0, loss: str = "clip",
                 bias: bool = False, modalities=CLIP_MODALITIES):
        self.net = DNSNet(dim, logit_scale, label_smoothing, loss, bias, modalities)
        self.dim = dim
        self.Z = {m: self._zeros() for m in modalities}
        self.Zo = {m: self._zeros() for m in modalities}
        self.Zp = {m: {} for m in modalities}
        self.n = {m: 0 for m in modalities}
        self.n_pair = {m: {} for m in modalities}
        self.history, self.summaries = [], []

    def __getattr__(self, name):  # the CLIP path's names: Z_img = Z["img"], Zo_txt = Zo["txt"], ...
        kind, _, m = name.partition("_")
        if kind in ("Z", "Zo") and m in self.__dict__.get(kind, {}):
            return self.__dict__[kind][m]
        raise AttributeError(name)

    def _zeros(self):
        return torch.zeros(self.dim, self.dim, dtype=torch.float64)

    def projectors(self, cfg: DNSConfig, a: str, b: str) -> dict:
        """{"W_m": (P_out, P_in)} for the pair's modalities that have a past."""
        past = [m for m in (a, b) if self.n[m] > 0]
        if cfg.output_cov == "per-task":
            Z_out = {f"W_{m}": self.Zo[m] for m in past}
        else:  # ours: every past partner's features through its map as it is now
            Z_out = {f"W_{m}": mapped_covariance(self.net.model, self.Zp[m],
                                                 {c: k / self.n[m] for c, k in self.n_pair[m].items()}) for m in past}
        return pair_projectors(self.net.model, {f"W_{m}": self.Z[m] for m in past}, Z_out, cfg.lambda_min,
                               cfg.lambda_relative, cfg.lambda_min_out)

    def learn(self, cfg: DNSConfig, x_a, x_b, out, resume: bool = False, pair: tuple | None = None) -> dict:
        """Trains W_a, W_b on one step's pairs x_a, x_b (N, D) (pair = (a, b);
        default the first two modalities, on CLIP image and text), then adds
        the step to the covariances of a and b (after the step, as the paper)."""
        model, hooks, t0 = self.net.model, None, time.perf_counter()
        a, b = pair or model.modalities[:2]
        model.set_pair(a, b)
        if cfg.mode != "vanilla":
            P = self.projectors(cfg, a, b)
            hooks = NullSpaceProjection(cfg.mode, P, cfg.projection_form) if P else None
        build_seconds = time.perf_counter() - t0
        task_cfg = dataclasses.replace(cfg, out=str(out), resume="latest" if resume else "")
        self.net.hooks = hooks
        try:
            summary = common.train(task_cfg, self.net, FeaturePairs(x_a, x_b), common.Collate(None),
                                   hooks=hooks, export=False)
        finally:
            self.net.hooks = None
        if "stopped_at" in summary:
            raise SystemExit(f"stopped at step {summary['stopped_at']} (--stop-at); continue with --resume latest")
        W_a, W_b = (getattr(model, f"W_{m}").detach().cpu().double() for m in (a, b))
        n_a, n_b = self.n[a], self.n[b]
        self.Z[a], self.n[a] = update_covariance(self.Z[a], n_a, x_a)
        self.Z[b], self.n[b] = update_covariance(self.Z[b], n_b, x_b)
        for m, c, x_c in ((a, b, x_b), (b, a, x_a)):  # each side's partner features, raw
            self.Zp[m][c], self.n_pair[m][c] = update_covariance(
                self.Zp[m].get(c, self._zeros()), self.n_pair[m].get(c, 0), x_c)
        # deviation 13 (the code): the partner's features mapped with this step's end weights
        self.Zo[a], _ = update_covariance(self.Zo[a], n_a, x_b.cpu().double() @ W_b.t())
        self.Zo[b], _ = update_covariance(self.Zo[b], n_b, x_a.cpu().double() @ W_a.t())
        self.history.append(model.snapshot())
        summary = {k: v for k, v in summary.items() if k != "final_losses"} | {
            "pair": [a, b], "final_loss": sum(summary["final_losses"].values()),
            "projector_build_seconds": build_seconds, "projection_seconds": hooks.seconds if hooks else 0.0,
            "old_rank": {f"{k}_{side}": round(float(P.trace()))  # rank of each projector = its trace
                         for k, pair in (hooks.projectors if hooks else {}).items()
                         for side, P in zip(("out", "in"), pair)}}
        self.summaries.append(summary)
        return summary

    def state_dict(self):
        return {"maps": self.net.model.state_dict(), "Z": self.Z, "Zo": self.Zo, "Zp": self.Zp, "n": self.n,
                "n_pair": self.n_pair, "history": self.history, "summaries": self.summaries}

    def load_state_dict(self, s):
        self.net.model.load_state_dict(s["maps"])
        self.Z, self.Zo, self.Zp, self.n, self.n_pair = s["Z"], s["Zo"], s["Zp"], s["n"], s["n_pair"]
        self.history, self.summaries = list(s["history"]), list(s["summaries"])


low_rank_tasks = lab.low_rank_tasks  # the guarantee check's features (and the tests')


def guarantee_check(mode: str, out, seed: int = 0, **overrides) -> dict:
    """The stability guarantee, measured: learn task 1, then task 2 in
    `mode`, on low_rank_tasks(); returns the relative change of task 1's
    score matrix (score_drift) and task 2's contrastive loss before and
    after learning it (the projection must still let task 2 be learned)."""
    tasks = low_rank_tasks(seed=seed)
    settings = dict(mode=mode, device="cpu", precision="fp32", out=str(out), log_every=10_000, seed=seed)
    cfg = DNSConfig(**(settings | overrides))
    learner = DNSLearner(tasks[0][0].shape[1], math.log(1 / 0.07))  # CLIP's initial temperature
    for i, (img, txt) in enumerate(tasks):
        learner.learn(cfg, img, txt, Path(out) / f"task{i + 1}")
    W1, W2 = learner.history
    img2, txt2 = tasks[1]

    def task2_loss(W):
        return float(common.clip_loss(img2 @ W[0].t(), txt2 @ W[1].t(), learner.net.model.logit_scale.exp()))
    return {"mode": mode, "drift": score_drift(*tasks[0], W1, W2),
            "task2 loss before": task2_loss(W1), "task2 loss after": task2_loss(W2)}


# --- features --------------------------------------------------------------
def cached(cache_dir, key: dict, compute):
    """compute() once per key; stored as <cache_dir>/<sha1(key)>.pt. Values
    are tensors in plain containers, read back with weights_only=True (a
    tampered cache file is refused, not run)."""
    path = Path(cache_dir) / (hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20] + ".pt")
    if path.exists():
        return common.load_weights_only(path)
    value = compute()
    common.atomic_write(path, lambda tmp: torch.save(value, tmp))
    return value


def load_features(cfg: DNSConfig, tasks, device) -> dict:
    """Every feature the run needs, extracted once and cached: per task the
    train pairs and the test set, the per-task class prompts, the zero-shot sets."""
    if cfg.pretrained == "random":  # tests: random weights made a function of the seed, so caching them is sound
        torch.manual_seed(cfg.seed)
    model, _, preprocess, tok = common.load_model(cfg.backbone, cfg.pretrained, device=device, cache_dir=cfg.cache_dir)
    model.eval()
    weights = cfg.pretrained if cfg.pretrained != "random" else f"random-seed{cfg.seed}"
    weights = weights or "default"
    if cfg.backbone == "tiny" and cfg.pretrained in ("", "synthetic"):
        weights = str(lab.pretrain_tiny())
    elif os.path.isfile(weights):
        weights += f"@{os.path.getsize(weights)}-{os.path.getmtime(weights)}"
    base = {"backbone": cfg.backbone, "weights": weights}
    cache = cfg.feature_cache or str(Path(cfg.out) / "features")

    def of_manifest(path, column):
        key = base | {"manifest": str(Path(path).resolve()), "column": column,
                      "sha1": hashlib.sha1(Path(path).read_bytes()).hexdigest()}
        return cached(cache, key, lambda: evaluation.manifest_features(model, preprocess, tok, path, column, device))

    column, task_clf = "", None
    if cfg.task_classes:
        classnames, templates, column = lab.label_sets()[cfg.task_classes]
        task_clf = cached(cache, base | {"classes": classnames, "templates": templates},
                          lambda: common.zero_shot_classifier(model, tok, classnames, templates, device=device).cpu())
    feats = {"tasks": [{"train": of_manifest(t.train, ""), "test": of_manifest(t.test, column)} for t in tasks],
             "task_clf": task_clf, "zeroshot": {},
             "logit_scale": float(model.logit_scale.detach())}
    for name in filter(None, cfg.zeroshot.split(",")):
        def zero_shot_set(name=name):
            cs = evaluation.load_classification(name, cfg.data_root)
            return {"img": evaluation.image_features(model, preprocess, cs.image_paths, device=device),
                    "clf": common.zero_shot_classifier(model, tok, cs.classnames, cs.templates, device=device).cpu(),
                    "labels": cs.labels}
        feats["zeroshot"][name] = cached(cache, base | {"zeroshot": name, "root": str(Path(cfg.data_root).resolve())},
                                         zero_shot_set)
    del model
    return feats


@torch.no_grad()
def evaluate_maps(maps: ModalityMaps, tests, task_clf=None, zeroshot=None) -> dict:
    """run_continual's evaluate(): per task R@1 / R@10 both directions (and
    their mean R@10), per-task classification 'acc' when every test set has
    labels; scalars: zero-shot top-1 per set. Everything through the maps
    (biases included with --bias); class-prompt features (D, C) through the
    text map."""
    W_img, W_txt, *biases = (w.float() for w in maps.snapshot())
    b_img, b_txt = biases if biases else (0.0, 0.0)

    def map_img(x):  # (N, D) -> (N, D)
        return x @ W_img.t() + b_img

    def map_txt(x):
        return x @ W_txt.t() + b_txt
    with_acc = task_clf is not None and all(f["labels"] is not None for f in tests)
    per_task = {}
    for f in tests:
        img, txt = map_img(f["img"]), map_txt(f["txt"])
        r = common.retrieval_metrics(img, txt, f["t2i"], ks=(1, 10))
        r["R@10"] = 0.5 * (r["i2t_R@10"] + r["t2i_R@10"])
        if with_acc:
            r["acc"] = common.zero_shot_accuracy(img, map_txt(task_clf.t()).t(), f["labels"], ks=(1,))["top1"]
        for k, v in r.items():
            per_task.setdefault(k, []).append(v)
    scalars = {f"{name}_top1": common.zero_shot_accuracy(map_img(z["img"]), map_txt(z["clf"].t()).t(),
                                                          z["labels"], ks=(1,))["top1"]
               for name, z in (zeroshot or {}).items()}
    return {"per_task": per_task, "scalars": scalars}


# =============================================================================
# Main
# =============================================================================
def run(cfg: DNSConfig, show: bool = True) -> dict:
    """One continual run (one mode) through common.run_continual."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("dns.py trains two D x D maps on cached features: run it as one process (deviation 11)")
    device = common.init_distributed(cfg.device)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    tasks = common.parse_tasks(cfg.tasks, cfg.data_root)
    feats = load_features(cfg, tasks, device)
    learner = DNSLearner(feats["tasks"][0]["train"]["img"].shape[1], feats["logit_scale"], cfg.label_smoothing,
                         cfg.loss, cfg.bias)

    def pairs(f):  # unique-image features -> one (image, text) pair per caption
        return f["img"][f["t2i"]], f["txt"]

    def learn_task(i, task, task_out, resume):
        return learner.learn(cfg, *pairs(feats["tasks"][i]["train"]), task_out, resume)

    def save_state(path):
        common.atomic_write(path, lambda tmp: torch.save(learner.state_dict(), tmp))

    summary = common.run_continual(
        out, tasks, learn_task,
        lambda: evaluate_maps(learner.net.model, [f["test"] for f in feats["tasks"]], feats["task_clf"],
                              feats["zeroshot"]),
        save_state, lambda path: learner.load_state_dict(common.load_weights_only(path)),
        resume=bool(cfg.resume))
    # stability, measured: each old task's scores right after it vs at the end
    drift = {"train": [], "test": []}
    for j in range(len(tasks) - 1):
        f = feats["tasks"][j]
        drift["train"].append(score_drift(*pairs(f["train"]), learner.history[j], learner.history[-1]))
        drift["test"].append(score_drift(f["test"]["img"], f["test"]["txt"], learner.history[j], learner.history[-1]))
    steps = sum(s["steps"] for s in learner.summaries)
    timing = {"sec_per_step": sum(s["train_seconds"] for s in learner.summaries) / max(1, steps),
              "projection_ms_per_step": 1e3 * sum(s["projection_seconds"] for s in learner.summaries)
              / max(1, sum(s["steps"] for s in learner.summaries if s["old_rank"])),  # over projected steps
              "projector_build_seconds": sum(s["projector_build_seconds"] for s in learner.summaries)}
    results = {"config": dataclasses.asdict(cfg), "continual": summary, "drift": drift, "timing": timing,
               "tasks": learner.summaries}
    common.write_results(out, results)
    if show:
        print(results_table([(cfg.mode, results)]))
    return results


def results_row(name: str, results: dict) -> dict:
    m, drift = results["continual"]["metrics"], results["drift"]
    row = {"method": name, "R@10": m["R@10"]["last"], "BWT_R@10": m["R@10"]["bwt"],
           "drift old (train)": (sum(drift["train"]) / len(drift["train"])) if drift["train"] else 0.0,
           "drift old (test)": (sum(drift["test"]) / len(drift["test"])) if drift["test"] else 0.0,
           "proj ms/step": results["timing"]["projection_ms_per_step"],
           "ms/step": 1e3 * results["timing"]["sec_per_step"]}
    if "acc" in m:
        row |= {"Acc": m["acc"]["last"], "Acc avg": m["acc"]["avg"], "BWT_A": m["acc"]["bwt"]}
    scalars = results["continual"]["scalars"]
    for k in scalars[-1]:  # zero-shot top-1: CLIP (identity maps) -> after the last task
        row[f"ZS {k.removeprefix('synthetic-').removesuffix('_top1')}"] = f"{scalars[0][k]:.1f} -> {scalars[-1][k]:.1f}"
    return row


def results_table(named_results) -> str:
    rows = [results_row(n, r) for n, r in named_results]
    for r in rows:  # drifts are small: scientific notation
        r.update({c: f"{r[c]:.1e}" for c in ("drift old (train)", "drift old (test)")})
    cols = list(dict.fromkeys(c for r in rows for c in r))
    first = ["method", "Acc", "Acc avg", "BWT_A", "R@10", "BWT_R@10"]
    cols = [c for c in first if c in cols] + [c for c in cols if c not in first]
    return common.markdown_table(rows, cols, floatfmt="{:.2f}")


# =============================================================================
# Demo (the lab: 4 task domains, tiny backbone's frozen features, seeds lab.SEEDS)
# =============================================================================
# Demo settings: the optimiser is the paper's / the code's (AdamW lr 1e-4, wd
# 1e-3, batch 64, 5 epochs per task); everything else is ours, not the
# paper's: CLIP's tiny backbone instead of ImageBind, the lab's four domains
# (600 pairs each) instead of its 7 datasets. Nothing was tuned.
DEMO_MODES = {"vanilla": "vanilla", "gradient": "DNS-gradient", "update": "DNS-update"}
DEMO_COLS = ["Acc", "BWT_A", "R@10", "BWT_R@10", "drift %"]


def demo_row(results: dict) -> dict:
    """One seed of one mode (both demos): final Acc / R@10, their BWT, the measured drift
    of the old tasks' test score matrices (mean over old tasks, % relative),
    and the R@10 matrix."""
    m, drift = results["continual"]["metrics"], results["drift"]["test"]
    return {"Acc": m["acc"]["last"], "BWT_A": m["acc"]["bwt"], "R@10": m["R@10"]["last"],
            "BWT_R@10": m["R@10"]["bwt"], "drift %": 100 * sum(drift) / max(1, len(drift)),
            "R": results["continual"]["matrices"]["R@10"]}


def demo_claims(runs: dict, paper_r10=("higher (no number in our sources)",) * 2,
                drift: str = "old-score") -> list[dict]:
    """The paper's claims as paired per-seed differences, in both modes;
    directions fixed before the seeds ran. Paper: ImageBind, vanilla 47.32 acc
    / -5.72 BWT, DNS 52.52 / -0.02 (its main table); paper_r10: what it says
    of BWT of R@10 and final R@10 (CMCL's setting: -3.34 -> -1.07, 38.56 ->
    40.89, so +2.27, +2.33)."""
    def d(a, b, key):  # per seed, a - b
        return lab.paired(runs, a, b, key)
    claims = []
    for mode in ("DNS-gradient", "DNS-update"):
        ours = " (our mode)" if mode == "DNS-update" else ""
        claims += [
            lab.claim(f"{mode} raises BWT of Acc over vanilla{ours}", "+5.70", d(mode, "vanilla", "BWT_A"), "+"),
            lab.claim(f"{mode} raises final Acc over vanilla{ours}", "+5.20", d(mode, "vanilla", "Acc"), "+"),
            lab.claim(f"{mode} raises BWT of R@10 over vanilla{ours}", paper_r10[0],
                      d(mode, "vanilla", "BWT_R@10"), "+"),
            lab.claim(f"{mode} raises final R@10 over vanilla{ours}", paper_r10[1], d(mode, "vanilla", "R@10"), "+"),
            lab.claim(f"{mode} cuts {drift} drift vs vanilla (% rel.){ours}", "to 0 (Thm. 4, exact under SGD)",
                      d(mode, "vanilla", "drift %"), "-"),
        ]
    claims.append(lab.claim("update mode drifts less than gradient mode (ours)", "- (ours)",
                            d("DNS-update", "DNS-gradient", "drift %"), "-"))
    return claims


def demo_seeds(run_one, cfg: DNSConfig, out: Path, **settings) -> tuple:
    """Every mode of DEMO_MODES once per seed in lab.SEEDS (same seed, same
    data order across modes) through run_one (run or run_cmcl). Returns the
    per-seed rows {name: [demo_row + seed]}, the identity maps' row (row 0
    of the matrices: the frozen features themselves, the same in every run;
    Acc over the sets that have it) and the last run's results."""
    runs, base = {name: [] for name in DEMO_MODES.values()}, None
    for seed in lab.SEEDS:
        for mode, name in DEMO_MODES.items():
            results = run_one(dataclasses.replace(cfg, mode=mode, seed=seed, out=str(out / f"{mode}-seed{seed}"),
                                                  **settings), show=False)
            runs[name].append({**demo_row(results), "seed": seed})
            if base is None:
                R0, A0 = (results["continual"]["matrices"][k][0] for k in ("R@10", "acc"))
                acc0 = [v for v in A0 if v == v]  # NaN: a set without classes (CMCL's setting)
                base = {"Acc": sum(acc0) / len(acc0), "BWT_A": 0.0, "R@10": sum(R0) / len(R0), "BWT_R@10": 0.0,
                        "drift %": 0.0}
    return runs, base, results


def run_demo(cfg: DNSConfig) -> dict:
    """vanilla, DNS-gradient (the paper's) and DNS-update (ours) on the four
    domains, once per seed in lab.SEEDS (same seed, same data order across
    modes; frozen features extracted once), plus the guarantee check on
    low-rank features."""
    t0 = time.time()
    out = Path(cfg.out if cfg.out != "runs/default" else "runs/dns-demo")
    shared = dict(demo=False, feature_cache=cfg.feature_cache or str(out / "features"))
    runs, base, _ = demo_seeds(run, cfg, out, **shared)
    checks = [guarantee_check(mode, out / "guarantee" / mode) for mode in DEMO_MODES]
    tasks = [t.name for t in common.parse_tasks(cfg.tasks, cfg.data_root)]
    head = (f"DNS demo: lab world, tiny backbone's frozen features, tasks {' -> '.join(tasks)}, seeds "
            f"{list(lab.SEEDS)}, lr {cfg.lr:g}, {cfg.epochs} epochs/task, lambda_min {cfg.lambda_min:g} (optimiser: the "
            f"paper's; backbone and world: ours). Acc = per-task shape classification %, R@10 % = mean of I2T, "
            f"T2I; BWT = mean over old tasks of final - right after; drift = relative change of an old task's test "
            f"score matrix from right after it to the end (%). CLIP = identity maps. Guarantee on low-rank features "
            f"(drift): " + ", ".join(f"{c['mode']} {c['drift']:.1e}" for c in checks) + ". Mean ± std over seeds.")
    claims = demo_claims(runs)
    lab.report_demo(out, head, base, runs, claims, DEMO_COLS, t0, lambda o: lab.matrix_figure(
        {k: [r["R"] for r in v] for k, v in runs.items()}, tasks, o / "dns-demo.png",
        f"python dns.py --demo; R[i][j] = R@10 on task j's test split after tasks 1..i; seeds {list(lab.SEEDS)}",
        unit="R@10 (%)", row_first="CLIP (identity)"), config=dataclasses.asdict(cfg), guarantee=checks)
    return {"base": base, "per_seed": runs, "claims": claims}


# =============================================================================
# CMCL's own setting: M modalities, modality-pair steps, features from files
# =============================================================================
# The datasets' modalities and evaluations (eval.CMCL_DATASETS) and the feature
# readers (eval.read_features) live in eval.py. The code's training.py step
# list (datasets_name): "name:i,j" picks modalities i and j of the dataset's
# array, no suffix = 0,1.
CMCL_STEPS = ("ucf101~esc50~nyudv2:0,2~clotho~vggsound_s:0,1~vggsound_s:0,2~vggsound_s:1,2~"
              "tvl:0,2~tvl:1,2~tvl:0,1~llvip")
# The paper's main table (ImageBind / LanguageBind / UniBind, 11 steps): final
# classification accuracy and R@10 (%), their BWT.
CMCL_PAPER = {"ImageBind vanilla": (47.32, -5.72, 38.56, -3.34), "ImageBind Co2L": (50.13, -3.74, 38.66, -1.77),
              "ImageBind DNS": (52.52, -0.02, 40.89, -1.07), "LanguageBind vanilla": (51.86, -15.71, 36.02, -10.19),
              "LanguageBind CILA": (59.30, -2.63, 40.48, -1.09), "LanguageBind DNS": (64.07, -0.09, 42.44, -3.00),
              "UniBind C-FLAT": (51.25, -4.36, 40.51, -1.48), "UniBind DNS": (52.86, 0.31, 41.44, -1.19)}
ABBREV = {"vision": "V", "text": "T", "audio": "A", "thermal": "TH", "depth": "D", "imu": "IM", "video": "VI",
          "tactile": "TA", "point": "P"}  # the code's ModalityTypeAbb


@dataclass(frozen=True)
class Step:
    """One step of the sequence: a dataset and the two modalities it pairs
    (indices into the dataset's modality list, and their names)."""
    dataset: str
    pair: tuple          # (i, j) indices
    modalities: tuple    # (name_i, name_j)

    @property
    def name(self) -> str:  # the code's naming: ucf101(T-VI)
        return f"{self.dataset}({'-'.join(ABBREV.get(m, m) for m in self.modalities)})"


def parse_steps(spec: str, modalities_of) -> list[Step]:
    """'cmcl' (the code's 11 steps) or 'dataset[:i,j]~dataset[:i,j]~...'
    (the code's datasets_name syntax). modalities_of(dataset) -> its tuple of
    modality names."""
    steps = []
    for part in filter(None, (p.strip() for p in (CMCL_STEPS if spec == "cmcl" else spec).split("~"))):
        name, _, idx = part.partition(":")
        mods = modalities_of(name)
        try:
            pair = tuple(int(i) for i in idx.split(",")) if idx else (0, 1)
        except ValueError:
            raise common.DataError(f"step {part!r}: expected dataset[:i,j] with integer modality indices") from None
        if len(pair) != 2 or pair[0] == pair[1] or not all(0 <= i < len(mods) for i in pair):
            raise common.DataError(f"step {part!r}: {name} has modalities {list(mods)}; give two distinct "
                                   f"indices in 0..{len(mods) - 1}")
        steps.append(Step(name, pair, (mods[pair[0]], mods[pair[1]])))
    if not steps:
        raise common.DataError(f"--tasks {spec!r}: no steps")
    return steps


# --- evaluation --------------------------------------------------------------
@torch.no_grad()
def evaluate_step(model: ModalityMaps, step: Step, test: dict, ks=(1, 5, 10)) -> dict:
    """One step's test set through the current maps: R@k (%, mean of both
    directions, sample i's partner is sample i) for every test set; 'acc'
    (top-1 %, the non-text modality against the text map of the class
    features) where the dataset has classes and the pair includes text (the
    code's eval_util.eval); NaN where a metric does not apply."""
    a, b = step.modalities
    i, j = step.pair
    x_a, x_b = model.map(a, test["x"][:, i].float()), model.map(b, test["x"][:, j].float())
    r = common.retrieval_metrics(x_a, x_b, torch.arange(len(x_b)), ks=ks)
    row = {f"R@{k}": 0.5 * (r[f"i2t_R@{k}"] + r[f"t2i_R@{k}"]) for k in ks}
    row["acc"] = float("nan")
    if test["labels"] is not None and "text" in (a, b):
        query = x_b if a == "text" else x_a
        classifier = model.map("text", test["class_x"].float()).t()  # (D, C)
        row["acc"] = common.zero_shot_accuracy(query, classifier, test["labels"], ks=(1,))["top1"]
    return row


def run_cmcl(cfg: DNSConfig, show: bool = True) -> dict:
    """DNS on CMCL's step sequence from cached features (--features)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("dns.py trains D x D maps on cached features: run it as one process (deviation 11)")
    root = Path(cfg.features)
    if not root.is_dir():
        raise common.DataError(f"--features {root}: no such folder")
    spec = "cmcl" if cfg.tasks in ("auto", "synthetic") else cfg.tasks  # --tasks left at its default: the code's steps
    steps = parse_steps(spec, lambda d: evaluation.dataset_info(root, d, cfg.perceptor)["modalities"])
    device = common.init_distributed(cfg.device)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {(d, s): evaluation.read_features(root, d, s, cfg.perceptor)
            for d in dict.fromkeys(st.dataset for st in steps) for s in ("train", "test")}
    dims = {v["x"].shape[2] for v in data.values()}
    if len(dims) != 1:
        raise common.DataError(f"features of different widths {sorted(dims)} under {root}")
    modalities = list(dict.fromkeys(m for st in steps for m in st.modalities))
    learner = DNSLearner(dims.pop(), math.log(1 / 0.07), cfg.label_smoothing, cfg.loss, cfg.bias, modalities)
    tasks = [common.Task(st.name, str(root / st.dataset), str(root / st.dataset)) for st in steps]
    if len({t.name for t in tasks}) != len(tasks):
        raise common.DataError("every step must pair a different dataset / modality pair")

    def learn_task(k, task, task_out, resume):
        st, x = steps[k], data[(steps[k].dataset, "train")]["x"]
        return learner.learn(cfg, x[:, st.pair[0]], x[:, st.pair[1]], task_out, resume, pair=st.modalities)

    def evaluate():
        rows = [evaluate_step(learner.net.model, st, data[(st.dataset, "test")]) for st in steps]
        return {"per_task": {k: [r[k] for r in rows] for k in rows[0]}, "scalars": {}}

    summary = common.run_continual(
        out, tasks, learn_task, evaluate,
        lambda path: common.atomic_write(path, lambda tmp: torch.save(learner.state_dict(), tmp)),
        lambda path: learner.load_state_dict(common.load_weights_only(path)), resume=bool(cfg.resume))
    if "stopped_at" in summary:
        return summary
    summary["metrics"] = {k: evaluation.masked_continual_metrics(R) for k, R in summary["matrices"].items()}
    drift = []  # each old step's test scores: right after it vs at the end
    for k, st in enumerate(steps[:-1]):
        x = data[(st.dataset, "test")]["x"]
        before, after = (learner.net.model.pair_maps(h, *st.modalities) for h in (learner.history[k],
                                                                                   learner.history[-1]))
        drift.append(score_drift(x[:, st.pair[0]], x[:, st.pair[1]], before, after))
    results = {"config": dataclasses.asdict(cfg), "steps": [st.name for st in steps], "continual": summary,
               "drift": {"test": drift}, "tasks": learner.summaries}
    common.write_results(out, results)
    if show:
        print(cmcl_table([(cfg.mode, results)]))
    return results


def cmcl_table(named_results) -> str:
    rows = [{"method": n} | demo_row(r) for n, r in named_results]
    return common.markdown_table(rows, ["method", "Acc", "BWT_A", "R@10", "BWT_R@10", "drift %"], floatfmt="{:.2f}")


# --- demo on the synthetic multimodal world ------------------------------------
# Settings fixed before the first run (nothing tuned): the code's 11 steps on
# lab.synthetic_multimodal() with the real datasets' names and modalities (d = 24,
# 256 train / 128 test samples per dataset), the paper's AdamW (wd 1e-3, batch
# 64) at lr 1e-3 (the code's LanguageBind value: at 1e-4 the 20 steps a task
# gets here barely move the maps), 5 epochs per step (the code), lambda_min
# 0.01 (the paper), CLIP's loss at scale 1/0.07 (ours).
CMCL_DEMO = dict(dim=24, n_train=256, n_test=128)
CMCL_DEMO_MODES = DEMO_MODES


def cmcl_demo_figure(runs: dict, base: dict, path, caption: str) -> Path:
    """One panel per column of the demo's table (lab.bar_panels), the paper's
    ImageBind vanilla / DNS numbers beside ours where it has one."""
    paper = {"Acc": (47.32, 52.52), "BWT_A": (-5.72, -0.02), "R@10": (38.56, 40.89), "BWT_R@10": (-3.34, -1.07)}
    units = {"Acc": "final Acc (%)", "BWT_A": "BWT of Acc (points)", "R@10": "final R@10 (%)",
             "BWT_R@10": "BWT of R@10 (points)", "drift %": "old-pair score drift (% rel.)"}
    return lab.bar_panels(runs, base, units, path, caption, paper, ("paper vanilla", "paper DNS"))


def run_cmcl_demo(cfg: DNSConfig) -> dict:
    """vanilla / DNS-gradient / DNS-update over the code's 11 steps on the
    synthetic multimodal world (CMCL's h5 layout), once per seed in lab.SEEDS
    (same world, same data order across modes)."""
    t0 = time.time()
    out = Path(cfg.out if cfg.out != "runs/default" else "runs/dns-cmcl-demo")
    features = lab.synthetic_multimodal(out / "features", "cmcl", cfg.perceptor, **CMCL_DEMO)
    settings = dict(demo_cmcl=False, features=str(features), tasks="cmcl", lr=1e-3, device="cpu",
                    precision="fp32", log_every=10_000)
    runs, base, results = demo_seeds(run_cmcl, cfg, out, **settings)
    steps = results["steps"]
    head = (f"DNS in CMCL's setting, demo: synthetic multimodal world (d {CMCL_DEMO['dim']}, "
            f"{CMCL_DEMO['n_train']} train / {CMCL_DEMO['n_test']} test per dataset), the code's 11 steps "
            f"{' -> '.join(steps)}, seeds {list(lab.SEEDS)}, lr 1e-3, {cfg.epochs} epochs/step, lambda_min "
            f"{cfg.lambda_min:g}. Acc = classification % on the datasets with classes and a text side; R@10 % = "
            f"mean of both directions, every step's test set; BWT = mean over old steps of final - right after; "
            f"drift = relative change of an old step's test score matrix (%). Identity = the frozen features. "
            f"Mean ± std over seeds.")
    claims = demo_claims(runs, ("+2.27", "+2.33"), "old-pair score")
    lab.report_demo(out, head, base, runs, claims, DEMO_COLS, t0, lambda o: cmcl_demo_figure(
        runs, base, o / "dns-cmcl-demo.png",
        f"python dns.py --demo-cmcl: the code's 11 steps on a synthetic multimodal world (not real features), "
        f"mean ± std over seeds {list(lab.SEEDS)}; hatched: the paper's ImageBind numbers (real data)"),
        config=dataclasses.asdict(cfg), world=CMCL_DEMO)
    return {"base": base, "per_seed": runs, "claims": claims}


def main(argv=None):
    cfg = common.parse_config(DNSConfig, argv)
    if cfg.demo_cmcl:
        return run_cmcl_demo(cfg)
    if cfg.features:
        common.preflight(cfg, continual=True)
        return run_cmcl(cfg)
    cfg = common.resolve_auto(cfg, "tasks", None, [], "ImageBind's seven datasets")
    if cfg.demo:
        return run_demo(cfg)
    common.preflight(cfg, [t.train for t in common.parse_tasks(cfg.tasks, cfg.data_root)], continual=True)
    return run(cfg)


if __name__ == "__main__":
    common.cli(main)
