"""A three-modality sentiment world in CMU-MOSEI's aligned layout (gmc.py's
fixture and demo): per clip a shared sentiment s and one private factor per
modality; text sees s clearly, audio and vision faintly, each sees its own
factor, and the label mixes all of them, so every missing modality costs
accuracy (most of all the text). The file is the pickle GMC reads, with -inf
in some audio values as the real one has.

  label   y = clip(round(3 (1.2 s + 0.6 u_text + 0.5 u_audio + 0.5 u_vision)) / 3, -3, 3)  (thirds, as MOSEI's)
  x_m     a_m s P_m + u_m Q_m + q R_m + noise_m e    (steps, dim_m): fixed random patterns P, Q, R per modality,
          q a shared factor with no bearing on y (what alignment can latch onto besides sentiment)
"""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from plumbing.base import atomic_write

DIMS = {"text": 16, "audio": 8, "vision": 6}  # GMC's real ones: 300, 74, 35 over 50 steps
SIGNAL = {"text": 1.0, "audio": 0.45, "vision": 0.4}  # how clearly each modality shows the shared sentiment
NOISE = {"text": 0.6, "audio": 1.0, "vision": 1.0}
PRIVATE = {"text": 0.6, "audio": 0.5, "vision": 0.5}  # each private factor's weight in the label
SIZES = {"train": 1500, "valid": 300, "test": 600}


def sentiment_world(out, steps: int = 8, sizes: dict | None = None, seed: int = 0, neg_inf: float = 1e-3) -> Path:
    """Writes (once) out/mosei_synthetic.pkl: {'train'|'valid'|'test': {'text', 'audio', 'vision': float32
    (N, steps, dim), 'labels': (N, 1, 1), 'id': (N,) str}}; returns its path."""
    sizes = sizes or SIZES
    path = Path(out) / f"mosei_synthetic-{steps}-{'-'.join(str(sizes[k]) for k in SIZES)}-{seed}.pkl"
    if path.exists():
        return path
    rng = np.random.default_rng(seed)
    patterns = {m: rng.standard_normal((3, steps, d)) / np.sqrt(d) for m, d in DIMS.items()}  # P, Q, R
    data = {}
    for split, n in sizes.items():
        s, q = rng.standard_normal(n), rng.standard_normal(n)
        u = {m: rng.standard_normal(n) for m in DIMS}
        y = 1.2 * s + sum(PRIVATE[m] * u[m] for m in DIMS)
        d = {"labels": np.clip(np.round(3 * y) / 3, -3, 3).astype(np.float32).reshape(n, 1, 1),
             "id": np.array([f"{split}-{i:05d}" for i in range(n)])}
        for m, (p, pq, pr) in patterns.items():
            x = (SIGNAL[m] * s[:, None, None] * p + u[m][:, None, None] * pq + q[:, None, None] * pr
                 + NOISE[m] * rng.standard_normal((n, steps, DIMS[m])))
            if m == "audio":  # the real file's -inf entries (COVAREP's log features of silence)
                x[rng.random(x.shape) < neg_inf] = -np.inf
            d[m] = x.astype(np.float32)
        data[split] = d
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: pickle.dump(data, open(tmp, "wb"), protocol=4))
    return path
