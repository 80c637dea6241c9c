"""The lab's figures (matplotlib, Agg: no display needed)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from plumbing.base import atomic_write

# =============================================================================
# 6. Figures (matplotlib, Agg: no display needed)
# =============================================================================
def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path) -> Path:
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=130, bbox_inches="tight", format="png"))
    pyplot().close(fig)
    return Path(path)


def matrix_figure(matrices: dict, tasks: Sequence[str], path, caption: str, unit: str = "R@1 (%)",
                  row_first: str = "CLIP") -> Path:
    """Continual demos (C-CLIP, DNS): the R[i][j] matrix of each method as a
    heat-map, side by side, on one colour scale. matrices: method -> list of
    per-seed matrices (rows: before training, after task 1..T; columns: the
    tasks); cells show the mean over seeds and, below it, the std."""
    plt = pyplot()
    means = {k: np.mean(np.asarray(v, dtype=float), 0) for k, v in matrices.items()}
    stds = {k: np.std(np.asarray(v, dtype=float), 0, ddof=1) if len(v) > 1 else np.zeros_like(means[k])
            for k, v in matrices.items()}
    lo, hi = min(m.min() for m in means.values()), max(m.max() for m in means.values())
    fig, axes = plt.subplots(1, len(means), figsize=(3.3 * len(means) + 1, 3.6), squeeze=False)
    rows = [row_first] + [f"after {t}" for t in tasks]
    for ax, (name, m) in zip(axes[0], means.items()):
        im = ax.imshow(m, vmin=lo, vmax=hi, cmap="viridis", aspect="auto")
        for i in range(m.shape[0]):
            for j in range(m.shape[1]):
                ax.text(j, i, f"{m[i, j]:.1f}\n±{stds[name][i, j]:.1f}", ha="center", va="center", fontsize=6.5,
                        color="white" if m[i, j] < (lo + hi) / 2 else "black")
        ax.set_xticks(range(len(tasks)), [f"test {t}" for t in tasks], rotation=30, fontsize=7)
        ax.set_yticks(range(len(rows)), rows if ax is axes[0][0] else [""] * len(rows), fontsize=7)
        ax.set_title(f"{name} ({len(matrices[name])} seeds)", fontsize=9)
    fig.colorbar(im, ax=list(axes[0]), label=f"{unit}, mean over seeds", shrink=0.85)
    fig.suptitle(caption, fontsize=8)
    return save_figure(fig, path)


def bar_panels(runs: dict, base: dict, units: dict, path, caption: str, paper: dict | None = None,
               paper_names: Sequence[str] = ()) -> Path:
    """One panel per column (units = {column: axis label}): bars = mean over
    seeds with ± std error bars, first `base` ("identity", one value), then
    each run of runs = {name: [per-seed dicts]}; beside them, hatched, the
    paper's values paper[column] (named paper_names) where it has them."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(units), figsize=(3.0 * len(units), 3.4))
    for ax, (col, unit) in zip(axes, units.items()):
        names = ["identity", *runs]
        vals = [np.array([base[col]])] + [np.array([r[col] for r in v], dtype=float) for v in runs.values()]
        colors = ["0.6", "tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown", "tab:olive"]
        ax.bar(range(len(names)), [v.mean() for v in vals], yerr=[v.std(ddof=1) if len(v) > 1 else 0 for v in vals],
               color=[colors[i % len(colors)] for i in range(len(names))], capsize=3)
        if col in (paper or {}):
            ax.bar([len(names), len(names) + 1], paper[col], color="none", edgecolor=["tab:red", "tab:blue"],
                   hatch="//")
            names += list(paper_names)
        ax.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=7)
        ax.set_ylabel(unit, fontsize=8)
        ax.axhline(0, color="k", lw=0.5)
    fig.suptitle(caption, fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)




def curves_figure(panels: Sequence[dict], path, caption: str, xlabel: str, log_x: bool = False) -> Path:
    """A sweep's figure: one panel per measure. panel: title, ylabel, series
    {name: (xs, per_seed)} with per_seed (n_seeds, len(xs)) drawn as the mean
    over seeds with a +-1 std band and every seed as a dot; optional paper
    {label: (xs, ys)} drawn as black squares joined by a dashed line. xs may
    be strings (categories): then no lines join the points."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels) + 0.6, 3.6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        series = panel.get("series", {})
        for i, (name, (xs, per_seed)) in enumerate(series.items()):
            ys = np.atleast_2d(np.asarray(per_seed, dtype=float))  # (n_seeds, len(xs))
            categorical = isinstance(xs[0], str)
            x = np.arange(len(xs)) + 0.12 * (i - (len(series) - 1) / 2) if categorical else np.asarray(xs, float)
            mean = ys.mean(0)
            std = ys.std(0, ddof=1) if len(ys) > 1 else np.zeros(len(mean))
            label = f"{name} ({len(ys)} seeds)" if len(ys) > 1 else name
            if categorical:
                color = ax.errorbar(x, mean, yerr=std, fmt="o", capsize=4, label=label).lines[0].get_color()
                ax.set_xticks(np.arange(len(xs)), xs, rotation=25, fontsize=7)
            else:
                color = ax.plot(x, mean, "-o", ms=4, label=label)[0].get_color()
                ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.2, lw=0)
            for row in (ys if len(ys) > 1 else ()):
                ax.scatter(x, row, s=6, color=color, alpha=0.5)
        for style, (label, (xs, ys)) in zip(("s--", "^:", "v-."), panel.get("paper", {}).items()):
            ax.plot(xs, ys, style[0] if isinstance(xs[0], str) else style, color="black", ms=6, label=label)
        if log_x:
            ax.set_xscale("log")
        ax.set(xlabel=panel.get("xlabel", xlabel), ylabel=panel["ylabel"], title=panel["title"])
        ax.title.set_fontsize(9)
        ax.legend(fontsize=7)
    fig.suptitle(caption, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    return save_figure(fig, path)

