"""DNS: dual-sided null-space projection for continual image-text contrastive learning.

Liu et al. "Continual Multimodal Contrastive Learning" (CMCL). NeurIPS 2025. arXiv:2503.14963
"The code": github.com/Xiaohao-Liu/CMCL (cmcl/dns.py, base.py, training.py, eval_util.py).
Implements: problem formulation (dns_scores), Thm. 4 (project_gradient; what a default step runs is
here too: the form of fewest operations, projected_linear in W's backward, deviation 12), multi-step
extension (update_covariance, null_space_projector); each equation once, in a function's docstring.
Code name -> paper symbol: W_img, W_txt (W_<m>) = W^{m} | img, txt = v, t (frozen, normalised,
  (N, D)) | logit_scale = ln s (s = 1/tau; CLIP's, frozen) | Z_img, Z_txt, n = Z-bar_{<t}^{m}, its
  count | P_out = P-tilde (old mapped partners), P_in = P' (old inputs) of Thm. 4 | lambda_min
Deviations (one line each; at length, with the commands and demos, in docs/dns.md)
  1. CLIP (image, text) instead of ImageBind & co. with 7 modalities (CMCL's: --features).
  2. --mode update (ours) keeps Thm. 4 under AdamW; gradient leaks 0.06-0.15 (null_space_leak, demo)
  3. The global gradient norm is clipped BEFORE the projection hook, like the code.
  4. Bias-free maps (the paper's theory); the code's never-projected biases: --bias.
  5. The temperature is CLIP's logit_scale, frozen (a trained one moves every old score).
  6. Output-side threshold = lambda_min (paper); the code's 0: --lambda-min-out 0.
  7. Schedule: shared warm-up + cosine, not the code's linear decay; AdamW betas/eps PyTorch's.
  8. eigh (float64) instead of SVD (same subspace); --lambda-relative (ours): relative threshold.
  9. Features extracted once with the eval transform, cached under --feature-cache.
 10. Evaluation after every task: R@1/R@10, per-task classification, --zero-shot sets; Acc/BWT.
 11. One process: dns.py refuses WORLD_SIZE > 1 (two D x D maps, torchrun brings nothing).
 12. Speed (ours): the same projection in the form of fewest operations: --projection-form.
 13. Output covariance re-mapped with the current maps (ours); the code's: --output-cov per-task.
 14. Loss: CLIP's InfoNCE (ours); code: one-way CE, temp. 1 (--loss code); siglip: b = -10, frozen.
 15. lambda_min default 0.01 (paper); the code's 0.1: --lambda-min 0.1.
 16. Covariance counts per modality (ours); the code: one count over all steps: --covariance code.
 17. Covariances from the step's own pair (ours); the code's columns 0, 1: --covariance code.
 18. Recall: the whole test set, both ways; the code's 5 random 1k subsets: --recall-protocol cmcl.
 19. Class features read as stored, keyed and sorted by class name; features not renormalised.
 20. CMCL setting: CLIP's 1/0.07, frozen, for the clip loss; --loss code: temperature 1.
 21. --demo-cmcl: the lab's synthetic multimodal world, not real features.
 22. No clipping (paper silent); the code's Trainer clips at 1.0: --grad-clip 1 (raw norm, any form)
 23. fp32 on CUDA too, as the code (its TrainingArguments set no fp16/bf16): --precision auto: fp16.
"""
from __future__ import annotations

import dataclasses
import sys
import time

from plumbing.flags import PRECISION, Config, answer_early, arg, parse_config  # torch-free


@dataclasses.dataclass(frozen=True)
class DNSConfig(Config):
    mode: str = arg("gradient", "project the gradient (paper, code) | update: the optimizer's step "
                    "(ours, dev. 2) | vanilla: none", choices=("gradient", "update", "vanilla"))
    lambda_min: float = arg(0.01, "keep covariance eigen-directions of |eigenvalue| > this (paper: "
                            "0.01 ImageBind/UniBind, 1e-4 LanguageBind; code: 0.1, dev. 15)")
    lambda_min_out: float = arg(-1.0, "output side's (< 0: --lambda-min, paper; code: 0, dev. 6)")
    lambda_relative: bool = arg(False, "ours: lambda_min is a fraction of the largest eigenvalue")
    output_cov: str = arg("current", "output-side covariance: current: the history re-mapped with "
                          "the current maps (ours) | per-task: each task with its end weights (the "
                          "code, deviation 13)", choices=("current", "per-task"))
    covariance: str = arg("ours", "ours: per-modality counts, the step's pair | code: one count "
                          "over all steps, columns 0, 1 (dev. 16-17)", choices=("ours", "code"))
    loss: str = arg("clip", "clip: InfoNCE at CLIP's scale (ours) | code: one-way CE, temperature "
                    "1 | siglip: b frozen (dev. 14)", choices=("clip", "code", "siglip"))
    siglip_init: str = arg("paper", "paper only: b = -10, frozen (dev. 14)", choices=("paper",))
    bias: bool = arg(False, "biases on both maps, never projected (the code, deviation 4)")
    tasks: str = arg("auto", "sequence 'name=train.jsonl[:test.jsonl],...', 'synthetic', "
                     "mtil-order1/2 (MTIL), 'auto' (tiny: synthetic; the paper's data: no layout)")
    zero_shot: str = arg("auto", "eval.py classification sets after every task, class prompts "
                         "through W_txt ('' = none; auto: synthetic-shape,synthetic-color in the "
                         "lab, else none)", old=("--zeroshot",))
    task_classes: str = arg("auto", "ours: the lab's label set for per-task classification of each "
                            "task's test set ('' = off; auto: shape in the lab, else off)")
    feature_cache: str = arg("", "ours: folder of cached frozen features ('' = <out>/features)")
    demo: bool = arg(False, "run the synthetic demo: vanilla / gradient / update (tiny backbone)")
    features: str = arg("", "CMCL setting: folder of cached features (the code's features_storage/ "
                        "h5 files, or ours); --tasks: 'cmcl' (the code's 11 steps, default here) "
                        "or 'dataset[:i,j]~...'")
    perceptor: str = arg("imagebind", "CMCL setting: the encoder in the h5 names "
                         "(<dataset>_<split>_<perceptor>.h5: imagebind, languagebind, unibind)")
    demo_cmcl: bool = arg(False, "run the CMCL-setting demo: the 11 steps on a synthetic world")
    recall_protocol: str = arg("full", "full | cmcl: 5 random 1k-subsets (dev. 18)",
                               choices=("full", "cmcl"))
    lr: float = arg(1e-4, "AdamW learning rate (paper, implementation details)")
    wd: float = arg(1e-3, "AdamW weight decay (paper)")
    batch_size: int = arg(64, "batch size (paper)")
    epochs: int = arg(5, "epochs per task (released code)")
    beta2: float = arg(0.999, "AdamW beta2 (PyTorch default; not in the paper)")
    eps: float = arg(1e-8, "AdamW eps (PyTorch default; not in the paper)")
    workers: int = arg(0, "ours: features live in memory, no loader workers")
    save_every: int = arg(0, "steps between checkpoints (0: one at the end of each task)")
    precision: str = arg("fp32", "fp32: the code's (dev. 23); auto: fp16 on CUDA", **PRECISION)
    projection_form: str = arg("auto", "ours (speed, deviation 12): auto: per map the form of "
                               "fewest operations | dense | factored; all compute the same "
                               "projection", choices=("auto", "dense", "factored"))


if __name__ == "__main__":  # --help and flag errors are answered here, before torch loads (2-5 s)
    answer_early(DNSConfig)

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from plumbing import base, cli, models
from papers import cmcl


# --- Losses and projections (pure functions of tensors) ---
def dns_scores(img, txt, W_img, W_txt, b_img=None, b_txt=None):
    """Alignment scores without the temperature (problem formulation):
        A[i, j] = (W_img v_i + b_img) . (W_txt t_j + b_txt)
    img (N, D), txt (M, D): frozen normalised features; W (D, D), b only with --bias; no
    renormalisation. (N, M)."""
    mapped_img, mapped_txt = img @ W_img.t(), txt @ W_txt.t()
    if b_img is not None:  # deviation 4: the code's biases
        mapped_img, mapped_txt = mapped_img + b_img, mapped_txt + b_txt
    # problem formulation: A = (W_img v) . (W_txt t)
    return mapped_img @ mapped_txt.t()


@common.float32
def code_loss(img, txt):
    """The code's training loss (cmcl/base.py Base.train_loss; deviation 14): one way, temp. 1,
        L = CE(A B^T, arange(B)) = -1/B sum_i log exp(a_i.b_i) / sum_j exp(a_i.b_j)
    img (B, D), txt (B, D): mapped features of the pair's first (the anchors) and second side."""
    # deviation 14: rows only (image -> text), no symmetric term; temperature 1; logits (B, B)
    return F.cross_entropy(img @ txt.t(), torch.arange(len(img), device=img.device))


def null_space_projector(Z, lambda_min: float, relative: bool = False):
    """P = U_k U_k^T over the eigenvectors of the symmetric Z (D, D) whose |eigenvalue| exceeds
    lambda_min (absolute; relative=True: a fraction of the largest). |eigenvalue| of a PSD
    covariance is the singular value the code's SVD thresholds (cmcl/base.py get_projector;
    deviation 8): lambda_min = 0 keeps, as there, every numerically non-zero direction. P: onto the
    span of the old features (I - P: the null space). (D, D), Z's dtype."""
    # multi-step extension: truncated eigendecomposition of the running covariance
    evals, U = torch.linalg.eigh(0.5 * (Z + Z.t()).double())
    threshold = lambda_min * float(evals.abs().max()) if relative else lambda_min
    U_k = U[:, evals.abs() > threshold]  # (D, k)
    return (U_k @ U_k.t()).to(Z.dtype)


def project_gradient(G, P_out, P_in):
    """Dual-sided null-space projection (Thm. 4):  dW = G - P_out G P_in
    G (D_out, D_in): a gradient or an update of W (mapped = x W^T); P_out (D_out, D_out): span of
    the old mapped partner features; P_in (D_in, D_in): span of the old input features. Then
    P_out dW P_in = 0."""
    # Thm. 4
    return G - P_out @ G @ P_in


def project_gradient_factored(G, U_out, U_in):
    """project_gradient with P = U U^T given by orthonormal bases U (D, k):
        dW = G - U_out (U_out^T G U_in) U_in^T
    The same result at (k_out + k_in) D^2 operations instead of 2 D^3 (tests check the equality)."""
    # Thm. 4, with P_out = U_out U_out^T and P_in = U_in U_in^T
    return G - U_out @ ((U_out.t() @ G) @ U_in) @ U_in.t()


def projector_basis(P):
    """An orthonormal basis (D, k) of the range of a projector P = U_k U_k^T."""
    evals, U = torch.linalg.eigh(0.5 * (P + P.t()).double())
    return U[:, evals > 0.5].to(P.dtype)


# Thm. 4 as a default step runs it (deviation 12, ours: speed): per map the form of fewest
# operations; in gradient mode from the batch, in the map's backward (ProjectedLinear).
def _activation_flops(order: str, batch: int, d_out: int, d_in: int, k_out: int, k_in: int) -> int:
    """Flops (2 per multiply-add, as torch.utils.flop_counter) of project_gradient_activations
    beyond delta^T X."""
    if order == "basis":  # U_out (core U_in^T) when k_out <= k_in, else (U_out core) U_in^T
        last = (2 * k_in * (k_out * d_in if k_out <= k_in else k_out * d_out)
                + 2 * d_out * d_in * min(k_out, k_in))
        return 2 * batch * (d_out * k_out + d_in * k_in + k_out * k_in) + last
    return 4 * batch * (d_out * k_out + d_in * k_in) + 2 * batch * d_out * d_in


def projection_flops(form: str, d_out: int, d_in: int, k_out: int, k_in: int,
                     batch: int = 0) -> int:
    """Flops of one projection of a (D_out, D_in) map's gradient, old ranks k_out, k_in (2 per
    multiply-add; element-wise subtractions not counted):
        dense        G - P_out G P_in                      2 D_out D_in (D_out + D_in)
        factored     G - U_out (U_out^T G U_in) U_in^T     ~2 D_out D_in (k_out + k_in)
        activations  from the batch (size `batch`), beyond delta^T X, the cheaper order of
            project_gradient_activations: ~2 B D (k_out + k_in) + 2 D^2 min(k) or ~2 B D^2"""
    if form == "dense":
        return 2 * d_out * d_out * d_in + 2 * d_out * d_in * d_in
    if form == "factored":
        return (2 * k_out * d_out * d_in + 2 * k_out * d_in * k_in + 2 * d_out * k_out * k_in
                + 2 * d_out * k_in * d_in)
    if form == "activations":
        return min(_activation_flops(o, batch, d_out, d_in, k_out, k_in)
                   for o in ("basis", "batch"))
    raise ValueError(f"unknown projection form {form!r}")


def cheapest_projection_form(d_out: int, d_in: int, k_out: int, k_in: int, batch: int = 0) -> str:
    """The form of least projection_flops: dense, factored, with batch > 0 activations."""
    forms = ("dense", "factored", "activations") if batch > 0 else ("dense", "factored")
    return min(forms, key=lambda f: projection_flops(f, d_out, d_in, k_out, k_in, batch))


def project_gradient_activations(delta, X, U_out, U_in, order: str = "auto"):
    """project_gradient from the batch itself: mapped = X W^T gives G = delta^T X; with P = U U^T
        dW = delta^T X - (delta P_out)^T (X P_in)
           = delta^T X - U_out ((delta U_out)^T (X U_in)) U_in^T
    delta (B, D_out): gradient of the loss w.r.t. the map's output; X (B, D_in): the map's input;
    U_out (D_out, k_out), U_in (D_in, k_in): orthonormal bases. order: 'basis' (through the
    (k_out, k_in) core; large B), 'batch' (one product [delta, -delta P_out]^T [X, X P_in]; small
    B), 'auto': the cheaper by projection_flops. Equals project_gradient(delta^T X, P_out, P_in)."""
    if order == "auto":
        d_out, d_in, k_out, k_in = U_out.shape[0], U_in.shape[0], U_out.shape[1], U_in.shape[1]
        order = min(("basis", "batch"),
                    key=lambda o: _activation_flops(o, len(X), d_out, d_in, k_out, k_in))
    if order == "basis":  # Thm. 4 through the (k_out, k_in) core
        core = (delta @ U_out).t() @ (X @ U_in)  # (k_out, k_in)
        # U_out core U_in^T, the cheaper association: the D_out D_in term goes with the smaller rank
        correction = (U_out @ (core @ U_in.t()) if U_out.shape[1] <= U_in.shape[1] else
                      (U_out @ core) @ U_in.t())
        return delta.t() @ X - correction
    if order != "batch":
        raise ValueError(f"order is 'auto', 'basis' or 'batch', not {order!r}")
    # Thm. 4 on the batch, both terms in ONE (2B)-row product
    delta_old = (delta @ U_out) @ U_out.t()  # (B, D_out) delta P_out
    X_old = (X @ U_in) @ U_in.t()  # (B, D_in) X P_in
    return torch.cat([delta, -delta_old]).t() @ torch.cat([X, X_old])


class ProjectedLinear(torch.autograd.Function):
    """mapped = x W^T whose backward returns W's gradient already projected (Thm. 4, in the form
    of project_gradient_activations), grad_x = delta W (unchanged).
    x (..., D_in), W (D_out, D_in); U_out (D_out, k_out), U_in (D_in, k_in): orthonormal, frozen.
    batches: a list (or None) the backward appends its (delta, X) to: W's raw gradient
    delta^T X, for --grad-clip's norm (clip_grad_norm_unprojected)."""
    @staticmethod
    def forward(ctx, x, W, U_out, U_in, batches=None):
        ctx.save_for_backward(x, W, U_out, U_in)
        ctx.batches = batches
        return x @ W.t()

    @staticmethod
    def backward(ctx, grad_out):
        x, W, U_out, U_in = ctx.saved_tensors
        grad_x = grad_W = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_out @ W.to(grad_out.dtype)).to(x.dtype)
        if ctx.needs_input_grad[1]:  # the projection in float32 at least (as the hooks do)
            dtype = torch.promote_types(W.dtype, torch.float32)
            delta = grad_out.reshape(-1, W.shape[0]).to(dtype)
            X = x.reshape(-1, W.shape[1]).to(dtype)
            # Thm. 4: dW = G - P_out G P_in, G = delta^T X, in W's backward
            grad_W = project_gradient_activations(delta, X, U_out.to(dtype), U_in.to(dtype))
            grad_W = grad_W.to(W.dtype)
            if ctx.batches is not None:
                ctx.batches.append((delta, X))
        return grad_x, grad_W, None, None, None


def projected_linear(x, W, U_out, U_in, batches=None):
    """x W^T, W's gradient projected in the backward (ProjectedLinear; batches: its (delta, X))."""
    return ProjectedLinear.apply(x, W, U_out, U_in, batches)


def product_norm(A, B):
    """||A^T B||_F for A (N, m), B (N, n), through the (N, N) Gram matrices when N (m + n) < m n:
        ||A^T B||_F^2 = sum_ij (A A^T)_ij (B B^T)_ij"""
    if len(A) * (A.shape[1] + B.shape[1]) < A.shape[1] * B.shape[1]:
        return ((A @ A.t()) * (B @ B.t())).sum().clamp(min=0).sqrt()
    return torch.linalg.matrix_norm(A.t() @ B)


def clip_grad_norm_unprojected(hooks, params, max_norm: float, scaler):
    """NullSpaceProjection's --grad-clip (deviation 22; docs/dns.md): the total norm is the
    UNPROJECTED gradient's at every form. A map projected in its backward (projected_in_backward:
    {name: (W, [(delta, X), ...])}) counts with its raw gradient sum_i delta_i^T X_i, unscaled as
    .grad is; all gradients are then scaled by the clip factor (clip-then-project: projection is
    linear). Without such maps: torch's clip_grad_norm_. Returns the norm."""
    inside = {id(W): batches for W, batches in hooks.projected_in_backward.values() if batches}
    if not any(id(p) in inside for p in params):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    one = next(iter(inside.values()))[0][0].new_ones((), dtype=torch.float32)  # scale(one) = scale
    inv = scaler.scale(one).double().reciprocal().float() if scaler.is_enabled() else 1.0
    raw = {}
    for i, batches in inside.items():
        delta, X = (torch.cat(t) for t in zip(*batches))  # the step's rows, all backward passes
        raw[i] = product_norm(delta * inv, X)
    total = torch.nn.utils.get_total_norm([raw.get(id(p), p.grad) for p in params
                                           if p.grad is not None])
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def update_covariance(Z, n: int, X):
    """Running uncentered covariance over all tasks so far (multi-step extension):
        Z <- Z n/(n + n_t) + X^T X/(n + n_t),  n <- n + n_t
    Z (D, D), X (n_t, D). Returns (Z, n)."""
    X = X.to(Z.dtype)
    n_t = len(X)
    # multi-step extension: old mass n, new mass n_t
    return Z * (n / (n + n_t)) + X.t() @ X / (n + n_t), n + n_t


def score_drift(img, txt, maps_before, maps_after):
    """Relative change of an old task's score matrix (the stability condition):
        ||A_after - A_before||_F / ||A_before||_F
    img (N, D), txt (M, D); maps_* = (W_img, W_txt) (+ b_img, b_txt with --bias). In float64."""
    before = dns_scores(img.double(), txt.double(), *(w.double().cpu() for w in maps_before))
    after = dns_scores(img.double(), txt.double(), *(w.double().cpu() for w in maps_after))
    return float((after - before).norm() / before.norm().clamp(min=1e-30))


def null_space_leak(dW, P_out, P_in) -> float:
    """Thm. 4's condition, measured: leak = ||P_out dW P_in||_F / ||dW||_F (0: it holds; dW = 0: 0)
    dW (D_out, D_in): W after a task - W before; P_out, P_in: the task's projectors. float64."""
    dW, P_out, P_in = (x.detach().double().cpu() for x in (dW, P_out, P_in))
    return float((P_out @ dW @ P_in).norm() / dW.norm().clamp(min=1e-300))


# --- Model wrapper ---
CLIP_MODALITIES = ("img", "txt")  # the CLIP path's two maps: parameters W_img, W_txt (b_img, b_txt)


class ModalityMaps(nn.Module):
    """The trainable part: one map W_<m> (D, D) per modality m, identity at the start (--bias: the
    code's b_<m> (D,), zero), and CLIP's frozen logit_scale as a buffer (common.train reads it).
    set_pair(a, b): W_a, W_b (b_a, b_b) train; map_image / map_text map with the pair's first /
    second. CLIP: modalities ("img", "txt"), W_img, W_txt."""
    def __init__(self, dim: int, logit_scale: float, bias: bool = False,
                 modalities=CLIP_MODALITIES):
        super().__init__()
        bad = [m for m in modalities if not m.isidentifier()]
        if bad or len(set(modalities)) != len(modalities) or len(modalities) < 2:
            raise ValueError(f"modality names must be >= 2 distinct identifiers, got "
                             f"{list(modalities)}")
        self.modalities = tuple(modalities)
        for m in self.modalities:
            self.register_parameter(f"W_{m}", nn.Parameter(torch.eye(dim)))  # (D_out, D_in)
        for m in self.modalities if bias else ():  # deviation 4: never projected
            self.register_parameter(f"b_{m}", nn.Parameter(torch.zeros(dim)))
        # ln s, frozen (deviation 5)
        self.register_buffer("logit_scale", torch.tensor(float(logit_scale)))
        self.set_pair(*self.modalities[:2])

    def set_pair(self, a: str, b: str):
        """Only the pair's maps train; the others are frozen (not in the optimizer: no decay)."""
        self.pair = (a, b)
        for name, p in self.named_parameters():
            p.requires_grad_(name[2:] in (a, b))

    def map(self, m: str, x, hooks=None):  # (N, D) -> (N, D)
        """x W_m^T (+ b_m); hooks.linear() may compute it, W_m's gradient projected (dev. 12)."""
        W, b = getattr(self, f"W_{m}"), getattr(self, f"b_{m}", None)
        projected = hooks is not None and f"W_{m}" in hooks.projectors
        y = hooks.linear(f"W_{m}", x, W) if projected else x @ W.t()
        return y + (b if b is not None else 0)

    def map_image(self, x, hooks=None):
        return self.map(self.pair[0], x, hooks)

    def map_text(self, x, hooks=None):
        return self.map(self.pair[1], x, hooks)

    def snapshot(self) -> tuple:
        """Every map as CPU tensors in parameter order (W_<m>, then b_<m> with --bias): the maps
        score_drift takes."""
        return tuple(p.detach().cpu().clone() for p in self.parameters())

    def pair_maps(self, snapshot: tuple, a: str, b: str) -> tuple:
        """(W_a, W_b) or (W_a, W_b, b_a, b_b) out of a snapshot (score_drift's maps)."""
        named = dict(zip((n for n, _ in self.named_parameters()), snapshot))
        return tuple(named[f"{p}_{m}"] for p in ("W", "b") for m in (a, b) if f"{p}_{m}" in named)


class DNSNet(common.Method):
    """common.train's wrapper (common.Method): losses -> {"loss_clip"} ({"loss_code"} with
    loss="code"), batch (B, D)."""
    def __init__(self, dim: int, logit_scale: float, label_smoothing: float = 0.0,
                 loss: str = "clip", bias: bool = False, modalities=CLIP_MODALITIES):
        super().__init__()
        if loss not in ("clip", "code", "siglip"):
            raise ValueError(f"loss is 'clip', 'code' or 'siglip', not {loss!r}")
        self.model = ModalityMaps(dim, logit_scale, bias, modalities)
        self.label_smoothing, self.loss = label_smoothing, loss
        self.hooks = None  # the current task's NullSpaceProjection (DNSLearner.learn sets it)

    def features(self, batch, ctx=None):
        return {"img": self.model.map_image(batch["img"], self.hooks),  # (b, D), not renormalised
                "txt": self.model.map_text(batch["txt"], self.hooks)}

    def losses(self, f, ctx=None):
        img, txt = common.gather(f["img"], f["txt"])
        if self.loss == "code":  # deviation 14: one direction, temperature 1
            return {"loss_code": code_loss(img, txt)}
        scale = self.model.logit_scale.exp()
        bias = models.SIGLIP_INIT[1] if self.loss == "siglip" else None  # deviation 14
        return {"loss_clip": common.contrastive_loss(img, txt, scale, bias, self.label_smoothing)}


def feature_pairs(img, txt) -> torch.utils.data.StackDataset:
    """Cached (image, text) training pairs: item i = {"img": img[i], "txt": txt[i], "index": i}."""
    return torch.utils.data.StackDataset(img=img, txt=txt, index=range(len(txt)))


# --- Training ---
def mapped_covariance(maps: ModalityMaps, partners: dict, weights: dict) -> torch.Tensor:
    """sum_c w_c W_c Z_c W_c^T over old partners c (partners = {c: Z_c (D, D)}, weights = {c: w_c}),
    with the maps as they are NOW: the output side the stability condition asks for (ours,
    deviation 13). float64, CPU."""
    W = {c: getattr(maps, f"W_{c}").detach().cpu().double() for c in partners}  # W_c (D, D)
    return sum(weights[c] * (W[c] @ Z_c @ W[c].t()) for c, Z_c in partners.items())


def pair_projectors(maps: ModalityMaps, Z_in: dict, Z_out: dict, lambda_min: float,
                    relative: bool = False, lambda_min_out: float | None = None) -> dict:
    """{param name: (P_out, P_in)} for each name in Z_in, from Z_out[name] and Z_in[name] (D, D).
    lambda_min_out: the output side's threshold (None or < 0: lambda_min; the code: 0, deviation 6).
    float32, on the maps' device."""
    lam_out = lambda_min if lambda_min_out is None or lambda_min_out < 0 else lambda_min_out
    device = maps.logit_scale.device
    return {k: (null_space_projector(Z_out[k], lam_out, relative).float().to(device),
                null_space_projector(Z_in[k], lambda_min, relative).float().to(device))
            for k in Z_in}


def build_projectors(maps: ModalityMaps, Z_img, Z_txt, lambda_min: float, relative: bool = False,
                     lambda_min_out: float | None = None, Z_out: dict | None = None):
    """The CLIP path's pair_projectors: W_img's output side is the span of the old mapped texts, by
    default W_txt Z_txt W_txt^T with the CURRENT maps (the end of the previous task), and vice
    versa; Z_out = {"W_img": ..., "W_txt": ...} gives the output-side covariances instead (the
    code's per-task accumulation, deviation 13)."""
    Z_out = Z_out or {"W_img": mapped_covariance(maps, {"txt": Z_txt}, {"txt": 1.0}),
                      "W_txt": mapped_covariance(maps, {"img": Z_img}, {"img": 1.0})}
    return pair_projectors(maps, {"W_img": Z_img, "W_txt": Z_txt}, Z_out, lambda_min, relative,
                           lambda_min_out)


class NullSpaceProjection:
    """common.train hooks. gradient mode: project W.grad after unscaling and clipping, before the
    optimizer step. update mode: set W = W_before + project(W_after - W_before) after the step, so
    AdamW's scaling, momentum and weight decay are projected too. projectors: {param name: (P_out,
    P_in)}. form (deviation 12, all tested equal): 'dense', 'factored', 'auto': per map the fewer
    projection_flops, in gradient mode the activations too (linear())."""
    clip_grad_norm_ = clip_grad_norm_unprojected  # --grad-clip: the raw norm decides (dev. 22)

    def __init__(self, mode: str, projectors: dict, form: str = "auto"):
        if mode not in ("gradient", "update"):
            raise ValueError(f"unknown projection mode {mode!r}")
        if form not in ("auto", "dense", "factored"):
            raise ValueError(f"projection form is 'auto', 'dense' or 'factored', not {form!r}")
        self.mode, self.projectors, self.form, self.before = mode, projectors, form, {}
        self.seconds, self.steps = 0.0, 0
        self._bases = {name: tuple(projector_basis(P) for P in pair)
                       for name, pair in projectors.items()}
        self.forms = {name: form if form != "auto" else cheapest_projection_form(
                          len(P_out), len(P_in), *self.rank(name))
                      for name, (P_out, P_in) in projectors.items()}
        self.projected_in_backward = {}  # name -> (W, its backward's [(delta, X)]): projected there
        self.project = {name: (lambda G, U=self._bases[name]: project_gradient_factored(G, *U))
                        if self.forms[name] == "factored" else
                        (lambda G, P=P: project_gradient(G, *P))
                        for name, P in projectors.items()}

    def bases(self, name: str) -> tuple:
        """(U_out (D_out, k_out), U_in (D_in, k_in)): orthonormal bases of `name`'s old spans."""
        return self._bases[name]

    def rank(self, name: str) -> tuple:
        """(k_out, k_in) of map `name`."""
        return tuple(U.shape[1] for U in self._bases[name])

    def linear(self, name: str, x, W):
        """x (B, D_in) -> x W^T (B, D_out) through projected_linear (the hook then leaves W's
        gradient alone) when in gradient mode with form 'auto' the activation form is cheapest at
        this batch size; else x @ W.t(). The batches are kept for --grad-clip's raw norm (deviation
        22) until before_optimizer_step."""
        trains = torch.is_grad_enabled() and W.requires_grad
        if self.mode != "gradient" or self.form != "auto" or not trains:
            return x @ W.t()
        batch = x.numel() // W.shape[1]
        if cheapest_projection_form(*W.shape, *self.rank(name), batch=batch) != "activations":
            return x @ W.t()
        batches = self.projected_in_backward.setdefault(name, (W, []))[1]
        return projected_linear(x, W, *self._bases[name], batches)

    @torch.no_grad()
    def before_optimizer_step(self, net):
        t0 = time.perf_counter()
        for name in [n for n in self.projectors if n not in self.projected_in_backward]:
            p = getattr(net.model, name)
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
    """The method's state over modality-pair steps (CLIP: image-text tasks, modalities ("img",
    "txt")). Per modality m: the running input covariance Z[m] of m's features over the past steps
    m took part in (n[m] samples); per partner c, Zp[m][c] of c's raw features there (n_pair[m][c]
    samples), so W_m's output side, with the current maps (CLIP: W_txt Z_txt W_txt^T for W_img), is
        sum_c (n_pair[m][c] / n[m]) W_c Zp[m][c] W_c^T
    Zo[m]: the code's per-task output side (deviation 13); history: the maps after each step. A step
    trains only its pair's maps; a map whose modality has no past is not projected (the code's
    projectors are zero then)."""
    hooks = None  # common.train's hooks in vanilla mode (baselines/maps.py: ZSCL's WE)

    def __init__(self, dim: int, logit_scale: float, label_smoothing: float = 0.0,
                 loss: str = "clip", bias: bool = False, modalities=CLIP_MODALITIES):
        self.net, self.dim = DNSNet(dim, logit_scale, label_smoothing, loss, bias, modalities), dim
        self.Z = {m: self._zeros() for m in modalities}
        self.Zo = {m: self._zeros() for m in modalities}
        self.Zp, self.n_pair = {m: {} for m in modalities}, {m: {} for m in modalities}
        self.n, self.n_bar = {m: 0 for m in modalities}, 0  # n_bar: --covariance code's one count
        self.history, self.summaries = [], []

    def _zeros(self):
        return torch.zeros(self.dim, self.dim, dtype=torch.float64)

    def projectors(self, cfg: DNSConfig, a: str, b: str) -> dict:
        """{"W_m": (P_out, P_in)} for the pair's modalities that have a past."""
        past = [m for m in (a, b) if self.n[m] > 0]
        if cfg.output_cov == "per-task":
            Z_out = {f"W_{m}": self.Zo[m] for m in past}
        else:  # ours: every past partner's features through its map as it is now
            weights = {m: {c: k / self.n[m] for c, k in self.n_pair[m].items()} for m in past}
            Z_out = {f"W_{m}": mapped_covariance(self.net.model, self.Zp[m], weights[m])
                     for m in past}
        return pair_projectors(self.net.model, {f"W_{m}": self.Z[m] for m in past}, Z_out,
                               cfg.lambda_min, cfg.lambda_relative, cfg.lambda_min_out)

    def code_covariance(self, a, b, W_a, W_b, x0, x1):
        """--covariance code: Z[a] from the stored column 0, Z[b] from column 1, both weighted by
        ONE count over all steps and modalities (n_bar), the output sides W_a Z0 W_a^T -> Zo[b],
        W_b Z1 W_b^T -> Zo[a]."""
        n_new = self.n_bar + len(x0)
        C0, C1 = (x.cpu().double().t() @ x.cpu().double() / n_new for x in (x0, x1))
        keep, Z, Zo = self.n_bar / n_new, self.Z, self.Zo
        Z[a], Zo[b] = Z[a] * keep + C0, Zo[b] * keep + W_a @ C0 @ W_a.t()
        Z[b], Zo[a] = Z[b] * keep + C1, Zo[a] * keep + W_b @ C1 @ W_b.t()
        self.n_bar = n_new

    def learn(self, cfg: DNSConfig, x_a, x_b, out, resume: bool = False,
              pair: tuple | None = None, cov_x: tuple | None = None) -> dict:
        """Trains W_a, W_b on one step's pairs x_a, x_b (N, D) (pair = (a, b), default the first two
        modalities), then adds the step to the covariances of a and b (after the step, as the paper;
        cov_x: the stored columns 0 and 1 that --covariance code reads instead). Its summary's
        null_space_leak: each map's over the step, and the max (vanilla: DNS's projectors)."""
        model, hooks, t0 = self.net.model, None, time.perf_counter()
        a, b = pair or model.modalities[:2]
        model.set_pair(a, b)
        P = self.projectors(cfg, a, b)  # vanilla too: the leak's reference, what DNS would keep
        if cfg.mode != "vanilla" and P:
            hooks = NullSpaceProjection(cfg.mode, P, cfg.projection_form)
        build_seconds = time.perf_counter() - t0 if cfg.mode != "vanilla" else 0.0
        start = {k: getattr(model, k).detach().clone() for k in P}  # W at the task's start
        task_cfg = dataclasses.replace(cfg, out=str(out), resume="latest" if resume else "")
        self.net.hooks = hooks
        try:
            summary = common.train(task_cfg, self.net, feature_pairs(x_a, x_b),
                                   common.Collate(None), hooks=hooks or self.hooks, export=False)
        finally:
            self.net.hooks = None
        if "stopped_at" in summary:
            raise SystemExit(f"stopped at step {summary['stopped_at']} (--stop-at); continue with "
                             f"--resume latest")
        leak = {k: null_space_leak(getattr(model, k) - start[k], *P[k]) for k in P}
        W_a, W_b = (getattr(model, f"W_{m}").detach().cpu().double() for m in (a, b))
        n_a, n_b = self.n[a], self.n[b]
        if cfg.covariance == "code":  # deviations 16-17: the code's update_covariance, one n_bar
            self.code_covariance(a, b, W_a, W_b, *(cov_x or (x_a, x_b)))
        else:
            self.Z[a], _ = update_covariance(self.Z[a], n_a, x_a)
            self.Z[b], _ = update_covariance(self.Z[b], n_b, x_b)
            # deviation 13 (the code): the partner's features mapped with this step's end weights
            self.Zo[a], _ = update_covariance(self.Zo[a], n_a, x_b.cpu().double() @ W_b.t())
            self.Zo[b], _ = update_covariance(self.Zo[b], n_b, x_a.cpu().double() @ W_a.t())
        self.n[a], self.n[b] = n_a + len(x_a), n_b + len(x_b)
        for m, c, x_c in ((a, b, x_b), (b, a, x_a)):  # each side's partner features, raw
            self.Zp[m][c], self.n_pair[m][c] = update_covariance(
                self.Zp[m].get(c, self._zeros()), self.n_pair[m].get(c, 0), x_c)
        self.history.append(model.snapshot())
        summary = {k: v for k, v in summary.items() if k != "final_losses"} | {
            "pair": [a, b], "final_loss": sum(summary["final_losses"].values()),
            "projector_build_seconds": build_seconds,
            "projection_seconds": hooks.seconds if hooks else 0.0,
            "old_rank": {f"{k}_{side}": round(float(P.trace()))  # a projector's rank: its trace
                         for k, pair in (hooks.projectors if hooks else {}).items()
                         for side, P in zip(("out", "in"), pair)},
            "null_space_leak": {"max": max(leak.values()), **leak} if leak else {
                "max": None, "why": "no old features on either map yet: nothing to protect"}}
        self.summaries.append(summary)
        return summary

    def state_dict(self):
        return {"maps": self.net.model.state_dict(), "Z": self.Z, "Zo": self.Zo, "Zp": self.Zp,
                "n": self.n, "n_pair": self.n_pair, "n_bar": self.n_bar, "history": self.history,
                "summaries": self.summaries}

    def load_state_dict(self, s):
        self.net.model.load_state_dict(s["maps"])
        self.Z, self.Zo, self.Zp, self.n = s["Z"], s["Zo"], s["Zp"], s["n"]
        self.n_pair, self.n_bar = s["n_pair"], s.get("n_bar", 0)
        self.history, self.summaries = list(s["history"]), list(s["summaries"])


# --- Main ---
def run(cfg: DNSConfig, show: bool = True, world=None) -> dict:
    """One continual run (one mode) on CLIP features of the --tasks manifests (papers.cmcl)."""
    return cmcl.run_clip(cfg, DNSLearner, score_drift, show, world)


def run_cmcl(cfg: DNSConfig, show: bool = True) -> dict:
    """DNS in CMCL's setting: its step sequence from cached features (--features; papers.cmcl)."""
    return cmcl.run_steps(cfg, DNSLearner, score_drift, show)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    features = any(a.split("=")[0] == "--features" for a in argv)
    if "--demo-cmcl" in argv or ("--demo" in argv and not features):
        from lab.demos import dns as demo  # the lab: world, tiny backbone, seeds (--seeds), claims
        return demo.main(argv)
    cfg = parse_config(DNSConfig, argv)
    world = None
    if models.wants_lab(cfg):  # --backbone tiny / --tasks synthetic: the lab's world, handed on
        from lab import WORLD as world
    if cfg.export or cfg.lock_image or cfg.lock_text or cfg.lora or cfg.torchcompile:
        raise base.UsageError("--export / --lock-* / --lora / --torchcompile: dns.py trains maps "
                              "over frozen features (Thm. 4); it writes no CLIP model")
    if cfg.features:
        common.preflight(cfg, continual=True)
        return run_cmcl(cfg)
    cfg = cmcl.resolve(cfg)
    train = [t.train for t in common.parse_tasks(cfg.tasks, cfg.data_root, world)]
    common.preflight(cfg, train, continual=True)
    return run(cfg, world=world)


if __name__ == "__main__":
    cli.cli(main)  # one message per expected failure, signals
