"""PNG figures: average accuracy vs experiences (all strategies) and accuracy-matrix heatmaps.

Every figure says over how many seeds its values are averaged and that bands and ± terms
are one standard deviation over seeds. In the heatmaps the cells of experiences not yet
trained (above the diagonal) are greyed out, except for ``joint``, which trains on every
experience at once.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from cl_streamkl.experiment.config import JOINT  # noqa: E402
from cl_streamkl.experiment.files import write_atomically  # noqa: E402

SCENARIO_ACCURACY = {"class": "Class-IL", "task": "Task-IL", "domain": "Domain-IL"}
UNTRAINED_COLOR = "#d9d9d9"


def _safe_name(strategy: str) -> str:
    return strategy.replace("+", "_plus_")


def seeds_note(n_seeds: int) -> str:
    """``"mean of 3 seeds, ±1 std"`` (or ``"1 seed"``): how the values of a figure were aggregated."""
    return f"mean of {n_seeds} seeds, ±1 std" if n_seeds > 1 else "1 seed"


def average_accuracy_figure(summary: dict[str, dict[str, Any]], title: str, scenario: str = "class") -> Figure:
    """Line per strategy of mean average accuracy after each experience, ± 1 std band over seeds."""
    n_exp = max(len(entry["average_accuracy"]["mean"]) for entry in summary.values())
    n_seeds = max(len(entry["seeds"]) for entry in summary.values())
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    for strategy, entry in summary.items():
        mean = np.asarray(entry["average_accuracy"]["mean"]) * 100
        std = np.asarray(entry["average_accuracy"]["std"]) * 100
        steps = np.arange(1, len(mean) + 1)
        (line,) = ax.plot(steps, mean, marker="o", label=strategy, linestyle="--" if strategy == JOINT else "-")
        if len(entry["seeds"]) > 1:
            ax.fill_between(steps, mean - std, mean + std, alpha=0.15, color=line.get_color())
    handles, labels = ax.get_legend_handles_labels()
    if n_seeds > 1:
        handles.append(Patch(facecolor="grey", alpha=0.3, label="±1 std over seeds"))
    ax.set_xlabel("experiences trained")
    ax.set_ylabel(f"average {SCENARIO_ACCURACY.get(scenario, '')} accuracy\non seen experiences (%)")
    ax.set_ylim(0, 100)
    ax.set_xticks(np.arange(1, n_exp + 1))
    ax.grid(alpha=0.3)
    ax.set_title(f"{title}\n{seeds_note(n_seeds)}", fontsize=10)
    ax.legend(handles=handles, fontsize=8, title=f"strategy ({seeds_note(n_seeds)})", title_fontsize=8)
    fig.tight_layout()
    return fig


def _heatmap(fig: Figure, ax: Any, matrix: np.ndarray, std: np.ndarray | None, untrained_hidden: bool,
             title: str) -> None:
    n = len(matrix)
    rows, cols = np.indices(matrix.shape)
    untrained = (cols > rows) if untrained_hidden else np.zeros_like(matrix, dtype=bool)
    cmap = plt.get_cmap("viridis").with_extremes(bad=UNTRAINED_COLOR)
    image = ax.imshow(np.ma.masked_array(matrix, mask=untrained), vmin=0, vmax=100, cmap=cmap)
    fontsize = 9 if n <= 5 else 7 if n <= 10 else 5
    for i in range(n):
        for j in range(n):
            if untrained[i, j]:
                ax.text(j, i, "–", ha="center", va="center", fontsize=fontsize, color="grey")
                continue
            text = f"{matrix[i, j]:.0f}"
            if std is not None and n <= 6:
                text += f"\n±{std[i, j]:.0f}"
            ax.text(j, i, text, ha="center", va="center", fontsize=fontsize,
                    color="white" if matrix[i, j] < 60 else "black")
    ax.set_xticks(range(n), [str(j + 1) for j in range(n)])
    ax.set_yticks(range(n), [str(i + 1) for i in range(n)])
    ax.set_xlabel("evaluated on experience")
    ax.set_ylabel("after training experience")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)


def accuracy_matrix_figure(strategy: str, entry: dict[str, Any], scenario: str = "class") -> Figure:
    """Heatmaps of the seed-mean accuracy matrix (rows: after training i; columns: evaluated on j).

    The scenario's accuracy, and beside it in ``class`` the Task-IL accuracy of the shared
    head. Cells of experiences not trained yet are grey (not for ``joint``); with several
    seeds each cell also shows ±1 std.
    """
    panels = [(f"{SCENARIO_ACCURACY.get(scenario, '')} accuracy (%)", entry["accuracy_matrix"])]
    if entry.get("task_il_matrix"):
        panels.append(("Task-IL accuracy (%)", entry["task_il_matrix"]))
    n = len(entry["accuracy_matrix"]["mean"])
    n_seeds = len(entry["seeds"])
    side = max(3.2, 1.2 + 0.55 * n)
    fig, axes = plt.subplots(1, len(panels), figsize=(side * len(panels) + 0.6, side + 0.5), dpi=120, squeeze=False)
    for ax, (title, matrix) in zip(axes[0], panels):
        std = np.asarray(matrix["std"]) * 100 if n_seeds > 1 else None
        _heatmap(fig, ax, np.asarray(matrix["mean"]) * 100, std, untrained_hidden=strategy != JOINT, title=title)
    fig.suptitle(f"{strategy} ({seeds_note(n_seeds)})", fontsize=11)
    fig.tight_layout()
    return fig


def _save(fig: Figure, path: Path) -> Path:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return write_atomically(path, lambda handle: handle.write(buffer.getvalue()))


def write_plots(summary: dict[str, dict[str, Any]], out_dir: Path, title: str, scenario: str = "class") -> list[Path]:
    """All figures of a run; returns their paths."""
    out_dir = Path(out_dir)
    paths = [_save(average_accuracy_figure(summary, title, scenario), out_dir / "average_accuracy.png")]
    for strategy, entry in summary.items():
        paths.append(_save(accuracy_matrix_figure(strategy, entry, scenario),
                           out_dir / f"accuracy_matrix_{_safe_name(strategy)}.png"))
    return paths
