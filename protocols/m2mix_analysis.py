"""m2-Mix's analyses of embeddings (Oh et al., NeurIPS 2023, arXiv:2203.03897; "the m2-Mix code":
github.com/changdaeoh/multimodal-mixup): Sec. 3's align / unif and the code's (E3, E4 of eval.py), Tab. 2 / Fig. 6's
ECE of retrieval, Tab. 5's SIMAT score (Couairon et al., arXiv:2112.03162; E5) - pure functions of features. eval.py's
evaluate runs them (--analyses geometry,ece; the task 'simat', whose reader eval.simat stays there); gmc.py's
Table 4 uses geometry."""
from __future__ import annotations

import math

import torch

from plumbing import base, published, towers
from plumbing.published import m2mix_table1  # noqa: F401  (torch-free; tests and callers read it here)


def _sphere_d2(a, b, chunk: int):
    """Row chunks of `a`, each (its row indices, the squared distances on the unit sphere from those rows to every
    row of `b`: (c, N)), so that the geometry below holds O(chunk x N) at a time."""
    for s in range(0, len(a), chunk):
        yield torch.arange(s, min(s + chunk, len(a))), (2 - 2 * a[s:s + chunk] @ b.t()).clamp(min=0)


def _off_diagonal(rows, d2):
    """d2 (a chunk of _sphere_d2 over paired rows) with each row's own pair at +inf (excluded from a min, exp 0)."""
    d2[rows - rows[0], rows] = float("inf")
    return d2


@torch.no_grad()
def geometry(img, txt, chunk: int = 1024) -> dict:
    """Embedding geometry of N paired, L2-normalised features img, txt (N, D), in row chunks (memory O(chunk x N)).
    m2-Mix (Oh et al. 2023, Sec. 3, Fig. 2; both greater-is-better; E3, E4):
      align = -mean_i [ ||v_i - t_i||^2 - min_{k != i} ||v_i - t_k||^2 ]
      unif  = -log mean_{i,j} exp(-2 ||v_i - t_j||^2)     over all image-text pairs
    Wang & Isola (2020), plain versions (lower is better):
      wi_align     = mean_i ||v_i - t_i||^2
      wi_unif_img  = log mean_{i != j} exp(-2 ||v_i - v_j||^2)   (same for texts: wi_unif_txt)
    gap = ||mean_i v_i - mean_i t_i|| (the modality gap)."""
    img, txt = img.float(), txt.float()
    n = len(img)
    if n < 2 or txt.shape != img.shape:
        raise ValueError(f"geometry needs N >= 2 paired rows, got {tuple(img.shape)} and {tuple(txt.shape)}")
    pos = (img - txt).square().sum(1)  # (N,)
    hardest, lse = torch.empty(n), []
    for rows, d2 in _sphere_d2(img, txt, chunk):  # image i to text k
        lse.append(torch.logsumexp(-2 * d2.flatten(), 0))
        hardest[rows] = _off_diagonal(rows, d2).min(1).values  # k != i
    out = {"align": -(pos - hardest).mean().item(),
           "unif": -(torch.logsumexp(torch.stack(lse), 0) - math.log(n * n)).item(),
           "wi_align": pos.mean().item()}
    for name, x in (("img", img), ("txt", txt)):  # i != j: exp(-inf) = 0
        lse = [torch.logsumexp(-2 * _off_diagonal(rows, d2).flatten(), 0) for rows, d2 in _sphere_d2(x, x, chunk)]
        out[f"wi_unif_{name}"] = (torch.logsumexp(torch.stack(lse), 0) - math.log(n * (n - 1))).item()
    out["gap"] = (img.mean(0) - txt.mean(0)).norm().item()
    return out


@torch.no_grad()
def released_code_geometry(img, txt, chunk: int = 1024) -> dict:
    """The m2-Mix code's align / unif (E3, E4; github.com/changdaeoh/multimodal-mixup main.py do_valid, loss.py
    rel_lalign_torch, lunif) of paired, L2-normalised img, txt (N, D), in row chunks (O(chunk x N)); lower is better:
      align_code = mean_i [ ||t_i - v_i||^2 - min_{k != i} ||t_i - v_k||^2 ]     anchored on the texts
      unif_code  = log mean_{a<b} exp(-2 ||x_a - x_b||^2),  x = [v; v] (2N rows, the images twice)
                 = log( (2 S - N) / (N (2N - 1)) ),  S = sum_{i,j} exp(-2 ||v_i - v_j||^2)"""
    img, txt = img.float(), txt.float()
    n = len(img)
    if n < 2 or txt.shape != img.shape:
        raise ValueError(f"released_code_geometry needs N >= 2 paired rows, got {tuple(img.shape)}, {tuple(txt.shape)}")
    pos = (txt - img).square().sum(1)  # (N,)
    hardest = torch.empty(n)
    for rows, d2 in _sphere_d2(txt, img, chunk):  # text i to image k
        hardest[rows] = _off_diagonal(rows, d2).min(1).values  # k != i
    lse = [torch.logsumexp(-2 * dv.flatten(), 0) for _, dv in _sphere_d2(img, img, chunk)]  # diagonal 0 kept
    log_s = torch.logsumexp(torch.stack(lse), 0).double()  # log S
    # sum over the pairs a < b of [v; v]: 2 S - N; their number: N (2N - 1)
    unif = torch.log(2 * torch.exp(log_s) - n) - math.log(n * (2 * n - 1))
    return {"align_code": (pos - hardest).mean().item(), "unif_code": unif.item()}


@torch.no_grad()
def _confidence_correct(img, txt, text_to_image, scale, direction, chunk=1024):
    """Per query: max softmax(scale * sim) over all candidates, and whether the argmax (first on ties) is gold."""
    img, txt = img.float(), txt.float()
    t2i = torch.as_tensor(text_to_image).long()
    conf, correct = [], []
    queries, cands = (img, txt) if direction == "i2t" else (txt, img)
    for s in range(0, len(queries), chunk):
        logits = scale * queries[s:s + chunk] @ cands.t()  # (c, K)
        conf.append(torch.softmax(logits, 1).max(1).values)
        top = logits.argmax(1)
        correct.append(t2i[top] == torch.arange(s, s + len(top)) if direction == "i2t" else top == t2i[s:s + len(top)])
    return torch.cat(conf), torch.cat(correct).float()


def ece(img, txt, text_to_image, scale, bins: int = 15, direction: str = "i2t") -> float:
    """ECE of retrieval R@1 (%; m2-Mix Tab. 2, Flickr30k I2T/T2I; no released code: Guo et al. 2017's definition):
      each query (an image for i2t, a text for t2i) is a classification over all candidates with
      p = softmax(scale * sim); confidence = max p, correct = the argmax is a gold match; equal-width bins on
      [0, 1]; ECE = sum_b |B_b| / N * |acc_b - conf_b|.
    img (N, D), txt (M, D) normalised; text_to_image (M,); scale = 1 / tau."""
    if direction not in ("i2t", "t2i"):
        raise ValueError("direction is 'i2t' or 't2i'")
    conf, correct = _confidence_correct(img, txt, text_to_image, float(scale), direction)
    b = (conf * bins).long().clamp(max=bins - 1)  # bin index; conf = 1 goes in the last bin
    count = torch.bincount(b, minlength=bins).double()
    gap = torch.bincount(b, weights=(correct - conf).double(), minlength=bins)  # sum (acc - conf) per bin
    return 100.0 * (gap.abs().sum() / count.sum()).item()


ECE_TAUS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.2, 0.5, 1.0)


def ece_curve(img, txt, text_to_image, taus=ECE_TAUS, bins: int = 15, direction: str = "i2t") -> dict:
    """m2-Mix's "tau-robustness" (Fig. 6, bottom): ECE (percent) as a function of the temperature tau (scale =
    1 / tau). Returns {tau: ece}. Its minimum is temperature scaling fitted on the test set itself (an oracle)."""
    return {float(t): ece(img, txt, text_to_image, 1.0 / t, bins, direction) for t in taus}


def first_caption_pairs(text_to_image) -> torch.Tensor:
    """Index of each image's first text: turns a many-caption set into the 1:1 pairs that geometry() needs."""
    t2i = torch.as_tensor(text_to_image).long()
    first = torch.full((int(t2i.max()) + 1,), -1, dtype=torch.long)
    return first.scatter_reduce_(0, t2i, torch.arange(len(t2i)), reduce="amin", include_self=False)


def analyze_retrieval(img, txt, text_to_image, scale, taus=ECE_TAUS, bins=15) -> dict:
    """Geometry (on each image's first caption) and ECE of both directions at the model's scale, plus the
    ECE-temperature sweep summarised by its minimum and the tau reaching it."""
    pairs = first_caption_pairs(text_to_image)
    out = geometry(img, txt[pairs])
    out.update(released_code_geometry(img, txt[pairs]))  # E3, E4: the m2-Mix code's definitions
    out["ece_scale"] = float(scale)  # the model's own 1 / tau, at which ece_i2t / ece_t2i are taken
    for d in ("i2t", "t2i"):
        out[f"ece_{d}"] = ece(img, txt, text_to_image, scale, bins, d)
        curve = ece_curve(img, txt, text_to_image, taus, bins, d)
        best = min(curve, key=curve.get)
        out[f"ece_{d}_min"], out[f"ece_{d}_best_tau"] = curve[best], best
        out.update({f"ece_{d}@tau={t:g}": v for t, v in curve.items()})
    return out


SIMAT_LAMBDAS = tuple(x / 2 for x in range(1, 15))  # ours: 0.5, 1, ..., 7 (14 values)
SIMAT_LAMBDAS_CODE = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0, 7.0)  # the m2-Mix code (no 6.5)
# name -> (split of transfos.csv, lambdas), E5; "code": the m2-Mix code's SIMAT_eval(domain='dev')
SIMAT_PROTOCOLS = {"ours": ("test", SIMAT_LAMBDAS), "code": ("dev", SIMAT_LAMBDAS_CODE)}


@torch.no_grad()
def simat_score(img, source, value_emb, target_emb, target_ids, oscar, weights, lambdas=SIMAT_LAMBDAS) -> dict:
    """SIMAT (Couairon et al. 2022; m2-Mix Tab. 5). For each transformation query q:
    x_q = v_source(q) + lam (t_target(q) - t_value(q)); retrieve the image with the highest cosine to x_q that is
    not the source; the query succeeds when OSCAR's similarity of that image and the target caption exceeds 0.5.
    Score = 100 * weighted mean of successes. Returns {lam: score}.
      img (N, D) normalised database; source (Q,) image index of each query; value_emb, target_emb (Q, D)
      normalised word embeddings; target_ids (Q,) column of `oscar` (N, C); weights (Q,) 1/sqrt(norm2).
    A non-finite embedding is an error (argmax over NaN picks an arbitrary image: never a score)."""
    base.check_finite("simat", images=img, words=torch.cat([value_emb, target_emb]))
    img = img.float()
    delta = (target_emb - value_emb).float()
    w = torch.as_tensor(weights, dtype=torch.float64)
    w = w / w.sum()
    out = {}
    for lam in lambdas:
        x = img[source] + lam * delta  # (Q, D)
        sim = x @ img.t()  # (Q, N)
        sim[torch.arange(len(x)), source] = -float("inf")  # never the source itself
        hit = oscar[sim.argmax(1), torch.as_tensor(target_ids)] > 0.5
        out[float(lam)] = 100.0 * (w * hit.double()).sum().item()
    return out


# ---- m2-Mix's tables (m2mix.py prints them; the papers' numbers: plumbing/published.py) ----
def table(records, backbone: str) -> str:
    """Table 1 for CLIP; Table 3 with Table 5's SIMAT column for the uni-modal towers."""
    if towers.known(backbone):
        return m2mix_table1(records, published.M2MIX_TABLE3, published.M2MIX_TABLE3_METRICS)
    return m2mix_table1(records)
