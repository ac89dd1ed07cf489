"""PNG figures: average accuracy vs experiences (all strategies) and accuracy-matrix heatmaps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _safe_name(strategy: str) -> str:
    return strategy.replace("+", "_plus_")


def plot_average_accuracy(summary: dict[str, dict[str, Any]], path: Path, title: str) -> Path:
    """Line per strategy of mean average accuracy after each experience, ± std band."""
    n_exp = max(len(entry["average_accuracy"]["mean"]) for entry in summary.values())
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for strategy, entry in summary.items():
        mean = np.asarray(entry["average_accuracy"]["mean"]) * 100
        std = np.asarray(entry["average_accuracy"]["std"]) * 100
        steps = np.arange(1, len(mean) + 1)
        ax.plot(steps, mean, marker="o", label=strategy)
        if len(entry["seeds"]) > 1:
            ax.fill_between(steps, mean - std, mean + std, alpha=0.15)
    ax.set_xlabel("experiences trained")
    ax.set_ylabel("average accuracy on seen experiences (%)")
    ax.set_ylim(0, 100)
    ax.set_xticks(np.arange(1, n_exp + 1))
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_accuracy_matrix(strategy: str, entry: dict[str, Any], path: Path) -> Path:
    """Heatmap of the seed-mean accuracy matrix (rows: after training i; columns: evaluated on j)."""
    matrix = np.asarray(entry["accuracy_matrix"]["mean"]) * 100
    n = len(matrix)
    fig, ax = plt.subplots(figsize=(1.0 + 0.7 * n, 0.8 + 0.6 * n), dpi=120)
    image = ax.imshow(matrix, vmin=0, vmax=100, cmap="viridis")
    for i in range(n):
        for j in range(n):
            ax.text(j, i, f"{matrix[i, j]:.0f}", ha="center", va="center", fontsize=8,
                    color="white" if matrix[i, j] < 60 else "black")
    ax.set_xticks(range(n), [str(j + 1) for j in range(n)])
    ax.set_yticks(range(n), [str(i + 1) for i in range(n)])
    ax.set_xlabel("evaluated on experience")
    ax.set_ylabel("after training experience")
    ax.set_title(f"{strategy} accuracy (%)")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_plots(summary: dict[str, dict[str, Any]], out_dir: Path, title: str) -> list[Path]:
    """All figures of a run; returns their paths."""
    out_dir = Path(out_dir)
    paths = [plot_average_accuracy(summary, out_dir / "average_accuracy.png", title)]
    for strategy, entry in summary.items():
        paths.append(plot_accuracy_matrix(strategy, entry, out_dir / f"accuracy_matrix_{_safe_name(strategy)}.png"))
    return paths
