"""GMC + m2-Mix on CMU-MOSEI with missing modalities at test time (m2-Mix Sec. 5.5, Table 4).

Papers: Changdae Oh et al. "Geodesic Multi-Modal Mixup for Robust Fine-Tuning." NeurIPS 2023,
https://arxiv.org/abs/2203.03897, Sec. 5.1 (setup) and 5.5 (Table 4, Fig. 7). Petra Poklukar,
Miguel Vasco, Hang Yin, Francisco S. Melo, Ana Paiva, Danica Kragic. "Geometric Multimodal
Contrastive Representation Learning." ICML 2022, https://arxiv.org/abs/2202.03390.
GMC's code: github.com/miguelsvasco/gmc at 68cef1a, gmc_code/supervised (architectures/models/
gmc.py, gmc_networks.py, baselines/transformer_networks.py, modules/trainers/model_trainer.py).
m2-Mix's code (changdaeoh/multimodal-mixup) has none of it; the unofficial GMC + m2-Mix code
("DMM's"): github.com/teang1995/DMM at feaa2d9, gmc/gmc_code/supervised_mix. At length: docs/gmc.md.

Implements (each loss written out once, in the docstring of the function named)
  GMC's MOSEI model   a GRU per modality -> Linear(steps*30, 60); MulT's joint encoder (5 layers,
                      width 30; padded steps get no position, as GMC's); one shared head + L2
                      norm for all four; a residual classifier: GMC
  GMC's loss          NT-Xent of (z_J, z_m) over the 2B rows, tau 0.3, summed over m: gmc_loss
  Sec. 5.5            1/2 L_clf + 1/2 L_gmc + alpha L_m2; L_m2: the geodesic mix (m2-Mix's Eq. 3,
                      common.geodesic_mix) of two modalities' latents against z_J: m2_gmc_loss
  Table 4             binary accuracy, align, unif for Full, T, V, A, T+V, T+A, V+A; --seeds: mean
                      +- std: evaluate, papers.mosei.table4

Code name -> symbol
  z[m], z_joint   z_m, z_J      the shared head's unit vectors (B, 60); m: 0 text, 1 audio, 2 vision
  tau             tau           the NT-Xent temperature (GMC's 0.3)
  lam             lambda        ~ Beta(beta, beta), the mixing ratio of Eq. (3)
  m2_weight       alpha         the weight of L_m2 in Sec. 5.5's objective

Deviations (one line each; at length in docs/gmc.md)
  G1. L_clf: the paper's cross-entropy on the sign; GMC's code and the unofficial one: L1, --clf l1.
  G2. The objective's 1/2 weights are the paper's; both codes weight 1 and 1: --weights code.
  G3. Pairs mixed: not printed; all three, averaged; the unofficial code's one: --mix-pairs random.
  G4. L_m2's positive: the same sample's z_J; negatives: every other row of [mix; z_J] (Sec. 5.5).
  G5. Constant lr (GMC's ReduceLROnPlateau fires <= once in 40 epochs); clip 0.8. Adam: GMC's.
  G6. Non-finite features -> 0, counted (GMC's: audio's -inf); --nonfinite refuse. Labels: refused.
  G7. Partial observation as GMC's code: the mean of the observed z (not renormalised) is classified
  G8. The loss terms are gathered across ranks (global batch); GMC trains on one GPU.
  G9. The last partial batch is dropped (equal batches on all ranks); GMC's kept: --keep-last-batch.
  G10. DMM's reporting scripts (G3's alpha, Beta) train at batch 128, tau 0.25 / 0.2: see Commands.
  G11. fp32 on CUDA too, as GMC's Lightning Trainer (its default, 32); --precision auto: fp16.

Data: MulT's aligned CMU-MOSEI pickle GMC reads (layout: docs/gmc.md), read by papers/mosei.py.
Commands
  python gmc.py --data data/mosei/mosei_data.pkl --method gmc-m2 --seeds 0,1,2,3,4 --out runs/gmc-m2
  python gmc.py --data data/mosei/mosei_data.pkl --convert   (then --data data/mosei/mosei_data.npz)
  python gmc.py --data ... --clf l1 --weights code --mix-pairs random --keep-last-batch --batch-size
      128 --tau 0.25   (the unofficial code's settings: G1-G3, G9, G10; its 2nd script: --tau 0.2)
  python gmc.py --demo      (lab/demos/gmc.py: a synthetic three-modality sentiment world, 5 seeds)
"""
from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from plumbing import flags
from plumbing.flags import arg

SUBSETS = {"Full": (0, 1, 2), "T": (0,), "V": (2,), "A": (1,), "T+V": (0, 2), "T+A": (0, 1),
           "V+A": (2, 1)}


@dataclass(frozen=True)
class GMCConfig(flags.Config):
    data: str = arg("data/mosei/mosei_data.pkl", "the aligned MOSEI pickle (or --convert's .npz)")
    method: str = arg("gmc-m2", "gmc: GMC | gmc-m2: + m2-Mix (Sec. 5.5)", choices=("gmc", "gmc-m2"))
    epochs: int = arg(40, "epochs (GMC's)")
    batch_size: int = arg(24, "batch size (GMC's; DMM's reporting scripts: 128, G10)")
    lr: float = arg(1e-3, "lr (GMC's Adam)")
    wd: float = arg(0.0, "weight decay (GMC: none)")
    warmup: int = arg(0, "warm-up steps (GMC: none)")
    grad_clip: float = arg(0.8, "gradient norm clipping (GMC's)")
    beta2: float = arg(0.999, "Adam beta2 (GMC's code: torch's default; G5)")
    eps: float = arg(1e-8, "Adam eps (GMC's code: torch's default; G5)")
    keep_last_batch: bool = arg(False, "each epoch ends with its partial batch, as GMC's (G9)")
    precision: str = arg("fp32", "fp32: GMC's code's (G11); auto: fp16 on CUDA", **flags.PRECISION)
    out: str = arg("runs/gmc", "output folder")
    tau: float = arg(0.3, "NT-Xent temperature, both terms (GMC's; DMM's scripts 0.25 / 0.2: G10)")
    m2_weight: float = arg(0.2, "alpha, the weight of L_m2 (G3: DMM's reporting scripts')")
    beta: float = arg(2.0, "lam ~ Beta(beta, beta) (G3: DMM's reporting scripts')")
    mix_pairs: str = arg("all", "all: every modality pair | random: one per batch (G3)",
                         choices=("all", "random"))
    clf: str = arg("ce", "ce: the paper's cross-entropy on the sign | l1: GMC's regression (G1)",
                   choices=("ce", "l1"))
    weights: str = arg("paper", "paper: 1/2 L_clf + 1/2 L_gmc | code: 1 and 1 (G2)",
                       choices=("paper", "code"))
    layers: int = arg(5, "layers of each cross-modal and memory transformer (GMC's 5)")
    nonfinite: str = arg("zero", "zero: non-finite features -> 0, counted | refuse (G6)",
                         choices=("zero", "refuse"))
    seeds: str = arg("", "comma-separated seeds, one run each: Table 4's mean +- std (paper: 5)")
    convert: bool = arg(False, "write the pickle's arrays to a .npz beside it and exit")
    demo: bool = arg(False, "run the lab's demo (lab/demos/gmc.py) and exit")


if __name__ == "__main__":  # --help and flag errors are answered here, before torch loads
    flags.answer_early(GMCConfig)

import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from plumbing import base, manifests
from plumbing.results import document, staged
from papers import mosei
from protocols import m2mix_analysis


# --- Losses ---
def nt_xent(a, b, tau: float):
    """Per anchor of the 2B rows x = [a; b] (GMC's code):
        -log exp(a_i.b_i / tau) / sum_{k != anchor} exp(x.x_k / tau);
    the positive of a_i is b_i and of b_i is a_i, every other row a negative.
    a, b: (B, D) unit rows -> (2B,)."""
    x = torch.cat([a, b]).float()
    sim = (x @ x.t() / tau).fill_diagonal_(float("-inf"))  # (2B, 2B), self-similarity left out
    pos = (a.float() * b.float()).sum(-1) / tau
    return torch.logsumexp(sim, 1) - torch.cat([pos, pos])


@common.float32
def gmc_loss(z_joint, zs, tau: float):
    """GMC: L_gmc = mean over the 2B anchors of sum_m NT-Xent(z_J, z_m), m = text, audio, vision
    (GMC's code, super_gmc_loss; equation not numbered here: GMC's paper text is not in this
    repository's sources)."""
    # GMC's contrastive loss: summed over m, averaged over the 2B anchors
    return torch.stack([nt_xent(z_joint, z, tau) for z in zs]).sum(0).mean()


@common.float32
def m2_gmc_loss(z_joint, zs, tau: float, lam: float, pairs):
    """Sec. 5.5: L_m2 = mean over `pairs` (a, b) of mean_anchors NT-Xent(mix_lam(z_a, z_b), z_J)
    (Eq. 3's mix; the mixture as positive of its own joint and negatives of every other row,
    G3-G4)."""
    # Sec. 5.5 with Eq. (3)'s geodesic mix, averaged over the pairs
    return torch.stack([nt_xent(common.geodesic_mix(lam, zs[a], zs[b]), z_joint, tau).mean()
                        for a, b in pairs]).mean()


def clf_loss(pred, y, kind: str):
    """G1: ce = binary cross-entropy of the logit against y > 0 (the paper's 'cross-entropy');
    l1 = |pred - y| (GMC)."""
    pred, y = pred.float().squeeze(-1), y.float()
    return (F.binary_cross_entropy_with_logits(pred, (y > 0).float()) if kind == "ce"
            else F.l1_loss(pred, y))


# --- GMC's model for MOSEI ---
# (gmc_networks.py: AffectGRUEncoder, AffectJointProcessor, AffectEncoder)
def sinusoid(n: int, d: int, device) -> torch.Tensor:
    """(n, 1, d) sinusoidal positions 1..n (fairseq's, which MulT uses)."""
    half = d // 2
    freq = torch.exp(torch.arange(half, device=device) * -(math.log(10000) / (half - 1)))
    ang = torch.arange(1, n + 1, device=device)[:, None] * freq[None]
    pe = torch.cat([ang.sin(), ang.cos()], 1)
    return F.pad(pe, (0, d - pe.shape[1]))[:, None]


class CrossModalLayer(nn.Module):
    """MulT's layer, pre-LayerNorm: x += Attn(LN(x), LN(k), LN(v)) under a causal mask, ONE LN
    for all three (GMC's layer_norms[0]); x += FFN(LN'(x)). Xavier weights, zero biases."""
    def __init__(self, d: int, heads: int, attn_dropout: float, dropout: float = 0.1):
        super().__init__()
        self.ln_a, self.ln_f = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=attn_dropout)  # in_proj: xavier
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)
        for lin in (self.attn.out_proj, self.ffn[0], self.ffn[3]):
            nn.init.xavier_uniform_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, x, k, v, mask):
        q, k, v = self.ln_a(x), self.ln_a(k), self.ln_a(v)
        x = x + self.drop(self.attn(q, k, v, attn_mask=mask, need_weights=False)[0])
        return x + self.drop(self.ffn(self.ln_f(x)))


class CrossModalTransformer(nn.Module):
    """x attends to y (y None: to itself); inputs scaled by sqrt(d) plus positions, embed dropout
    0.25, final LN."""
    def __init__(self, d: int, layers: int, heads: int = 5, attn_dropout: float = 0.1):
        super().__init__()
        self.d, self.drop = d, nn.Dropout(0.25)
        self.layers = nn.ModuleList(CrossModalLayer(d, heads, attn_dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def embed(self, x):  # GMC's fairseq positions: none where channel 0 is 0 (a padded step)
        pos = sinusoid(len(x), self.d, x.device) * (x[..., :1] != 0)
        return self.drop(math.sqrt(self.d) * x + pos)

    def forward(self, x, y=None):  # (T, B, d); keys and values embedded apart: two dropout masks
        kv = None if y is None else (self.embed(y), self.embed(y))
        x = self.embed(x)
        mask = torch.ones(len(x), len(x if y is None else y), dtype=torch.bool,
                          device=x.device).triu(1)
        for layer in self.layers:
            x = layer(x, *(kv or (x, x)), mask)
        return self.ln(x)


class JointEncoder(nn.Module):
    """MulT for three modalities: each target attends to the other two (6 cross-modal
    transformers), a memory transformer per target over both, the last step of each (3 x 60 =
    180), a residual MLP, Linear(180, 60). Attention dropout 0.1 where the keys are text and in
    the memories, 0 otherwise (MulT's attn_dropout_a/_v)."""
    def __init__(self, dims, latent: int = 60, d: int = 30, layers: int = 5):
        super().__init__()
        self.proj = nn.ModuleList(nn.Conv1d(k, d, 1, bias=False) for k in dims)
        self.cross = nn.ModuleDict({
            f"{m}{n}": CrossModalTransformer(d, layers, attn_dropout=0.1 if n == 0 else 0.0)
            for m in range(3) for n in range(3) if m != n})
        self.memory = nn.ModuleList(CrossModalTransformer(2 * d, layers) for _ in range(3))
        self.mlp = nn.Sequential(nn.Linear(6 * d, 6 * d), nn.ReLU(), nn.Linear(6 * d, 6 * d))
        self.out = nn.Linear(6 * d, latent)

    def forward(self, xs):
        xs = [F.dropout(xs[0], 0.25, self.training), *xs[1:]]  # MulT: dropout on the text input
        h = [p(x.transpose(1, 2)).permute(2, 0, 1) for p, x in zip(self.proj, xs)]  # (T, B, d)
        last = [self.memory[m](torch.cat([self.cross[f"{m}{n}"](h[m], h[n])
                                          for n in range(3) if n != m], -1))[-1]
                for m in range(3)]
        z = torch.cat(last, -1)  # (B, 6d)
        return self.out(self.mlp(z) + z)


class GMC(nn.Module):
    """The four processors (GRU per modality, the joint encoder), the shared head and the
    classifier."""
    def __init__(self, dims, steps: int, latent: int = 60, layers: int = 5):
        super().__init__()
        self.grus = nn.ModuleList(nn.GRU(k, 30) for k in dims)
        self.flat = nn.ModuleList(nn.Linear(steps * 30, latent) for _ in dims)
        self.joint = JointEncoder(dims, latent, layers=layers)
        self.head = nn.Linear(latent, latent)  # shared by all four, then L2-normalised
        self.clf = nn.Sequential(nn.Linear(latent, latent), nn.ReLU(), nn.Linear(latent, latent))
        self.pred = nn.Linear(latent, 1)

    def latents(self, xs, joint: bool = True):
        """[z_text, z_audio, z_vision] (None where xs has None) and z_J (when joint), unit rows
        (B, 60)."""
        zs = [None if x is None
              else F.normalize(self.head(f(g(x.transpose(0, 1))[0].transpose(0, 1).flatten(1))),
                               dim=-1)
              for x, g, f in zip(xs, self.grus, self.flat)]
        return zs, F.normalize(self.head(self.joint(xs)), dim=-1) if joint else None

    def classify(self, z):
        return self.pred(self.clf(z) + z)  # (B, 1): a logit (--clf ce) or the score (l1)

    def observe(self, xs, observed):
        """G7: z_J with every modality, else the mean of the observed modalities' z (not
        renormalised)."""
        if len(observed) == 3:
            return self.latents(xs)[1]
        zs, _ = self.latents([x if m in observed else None for m, x in enumerate(xs)], joint=False)
        return torch.stack([zs[m] for m in observed]).mean(0)


class GMCNet(common.Method):
    """common.train's wrapper: features = the four latents and the joint's prediction; losses as
    Sec. 5.5."""
    def __init__(self, model: GMC, cfg: GMCConfig):
        super().__init__()
        self.model, self.cfg = model, cfg

    def features(self, batch, ctx=None):
        zs, z_joint = self.model.latents([batch[k] for k in mosei.MODALITIES])
        return {"z_t": zs[0], "z_a": zs[1], "z_v": zs[2], "z_j": z_joint,
                "pred": self.model.classify(z_joint), "y": batch["label"]}

    def losses(self, f, ctx):
        cfg = self.cfg
        z_t, z_a, z_v, z_j, pred, y = common.gather(f["z_t"], f["z_a"], f["z_v"], f["z_j"],
                                                    f["pred"], f["y"])
        half = 0.5 if cfg.weights == "paper" else 1.0  # G2
        # Sec. 5.5: 1/2 L_clf + 1/2 L_gmc + alpha L_m2
        out = {"loss_clf": half * clf_loss(pred, y, cfg.clf),
               "loss_gmc": half * gmc_loss(z_j, [z_t, z_a, z_v], cfg.tau)}
        if cfg.method == "gmc-m2":
            pairs = [(0, 1), (0, 2), (1, 2)]
            if cfg.mix_pairs == "random":  # G3: one pair per batch, from the step's generator
                pairs = [pairs[int(torch.randint(3, (1,), generator=ctx.generator))]]
            lam = common.sample_lam(cfg.beta, ctx.generator)
            out["loss_m2"] = cfg.m2_weight * m2_gmc_loss(z_j, [z_t, z_a, z_v], cfg.tau, lam, pairs)
        return out


# --- Evaluation: Table 4 ---
@torch.no_grad()
def evaluate(model: GMC, split: dict, batch: int = 256) -> dict:
    """Per observed subset: acc (GMC's: sign of the prediction vs y > 0, zero labels left out, %),
    align and unif (m2mix_analysis.geometry of normalise(partial z) against z_J; Full: unif
    of z_J with itself; G7)."""
    model.eval()
    param = next(model.parameters())  # its device and dtype (float32 latents fed back as such)
    xs = [split[k].to(param.device, param.dtype) for k in mosei.MODALITIES]
    y = split["label"]
    chunks = range(0, len(y), batch)
    z_joint = torch.cat([model.observe([x[i:i + batch] for x in xs], (0, 1, 2))
                         for i in chunks]).float().cpu()
    out, keep = {}, y != 0
    for name, observed in SUBSETS.items():
        z = z_joint if name == "Full" else torch.cat([model.observe([x[i:i + batch] for x in xs],
                                                                    observed)
                                                      for i in chunks]).float().cpu()
        pred = model.classify(z.to(param.device, param.dtype)).squeeze(-1).float().cpu()
        out[f"{name} acc"] = 100 * ((pred[keep] > 0) == (y[keep] > 0)).float().mean().item()
        g = m2mix_analysis.geometry(F.normalize(z, dim=-1), z_joint)
        out[f"{name} unif"] = (m2mix_analysis.geometry(z_joint, z_joint)["unif"] if name == "Full"
                               else g["unif"])
        if name != "Full":
            out[f"{name} align"] = g["align"]
    return out


# --- Training, the command line ---
METHOD_NAMES = {"gmc": "GMC", "gmc-m2": "GMC+m2-Mix"}


def run(cfg: GMCConfig, splits: dict) -> dict:
    """One seed: trains on 'train' (common.train: AMP, checkpoints, resume, metrics.jsonl, DDP),
    evaluates 'test'."""
    torch.manual_seed(cfg.seed)  # the model's initial weights
    dims = [splits["train"][k].shape[2] for k in mosei.MODALITIES]
    model = GMC(dims, splits["train"]["text"].shape[1], layers=cfg.layers)
    constant = lambda opt, steps_per_epoch, total: lambda step: 1.0  # noqa: E731  G5
    summary = common.train(cfg, GMCNet(model, cfg), mosei.Split(splits["train"]),
                           common.Collate(None), export=False, schedule=constant,
                           keep_last=cfg.keep_last_batch)  # G9
    if "stopped_at" in summary or manifests.dist_info()[0] != 0:
        return {"summary": summary}
    test = evaluate(model, splits["test"])  # Table 4's cells of this seed, as records (one schema)
    cells = [{"task": f"{cfg.data}:test", "metric": k, "value": v} for k, v in test.items()]
    records = staged(cells, "tuned", seed=cfg.seed)
    base.atomic_write(Path(cfg.out) / "model.pt", lambda tmp: torch.save(model.state_dict(), tmp))
    common.write_results(cfg.out, document("gmc", records, summary=summary), cfg)
    return {"config": dataclasses.asdict(cfg), "summary": summary, "test": test, "records": records}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--demo" in argv:
        from lab.demos import gmc as demo
        return demo.main(argv)
    cfg = flags.parse_config(GMCConfig, argv)
    if cfg.lora or cfg.loss != "clip":
        raise base.UsageError("--lora / --loss siglip: GMC trains its encoders from scratch "
                                "(no weights to adapt) with NT-Xent, not a CLIP pair loss")
    if cfg.convert:
        print(f"wrote {mosei.convert(cfg.data)}")
        return None
    try:
        seeds = [int(s) for s in cfg.seeds.split(",") if s.strip()] if cfg.seeds else [cfg.seed]
    except ValueError:
        raise base.UsageError(f"--seeds {cfg.seeds!r}: comma-separated integers, e.g. "
                                f"0,1,2,3,4") from None
    if cfg.layers < 0 or cfg.tau <= 0 or len(set(seeds)) != len(seeds):
        raise base.UsageError(f"--layers {cfg.layers} (>= 0), --tau {cfg.tau:g} (> 0) and "
                                f"--seeds {seeds} (each once): one of them is off")
    splits, fixed = mosei.load_splits(cfg.data, cfg.nonfinite)  # flags first, then the data
    if fixed:
        print(f"[gmc] non-finite feature values set to 0 (G6): {fixed}", file=sys.stderr)
    results = {}
    for seed in seeds:
        out = Path(cfg.out) / f"seed{seed}" if cfg.seeds else Path(cfg.out)
        results[seed] = run(dataclasses.replace(cfg, seed=seed, out=str(out)), splits)
    if any("test" not in r for r in results.values()):
        return results
    table = mosei.table4({METHOD_NAMES[cfg.method]: [r["test"] for r in results.values()]}, SUBSETS)
    if cfg.seeds:
        common.write_results(cfg.out, document(
            "gmc", [x for r in results.values() for x in r["records"]], seeds=seeds, table=table,
            nonfinite=fixed), cfg)
    print(table)
    return {"results": results, "table": table, "nonfinite": fixed}


if __name__ == "__main__":
    from plumbing.cli import cli  # one message per expected failure, signals
    cli(main)
