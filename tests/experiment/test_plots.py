"""The figures: untrained cells greyed out, Task-IL beside Class-IL, seeds and ±1 std named, legible sizes."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pytest

from cl_streamkl.experiment.plots import accuracy_matrix_figure, average_accuracy_figure
from cl_streamkl.experiment.run_result import RunResult
from cl_streamkl.experiment.summary import summarize


def _summary(strategy: str, n_seeds: int, n_exp: int = 2) -> dict:
    rng = np.random.default_rng(0)
    runs = []
    for seed in range(n_seeds):
        matrix = np.tril(rng.uniform(0.2, 1.0, (n_exp, n_exp)))
        if strategy == "joint":
            matrix = np.repeat(matrix[-1:], n_exp, axis=0)
        runs.append(RunResult(strategy, seed, [], matrix.tolist(), np.maximum(matrix, 0.5).tolist()))
    return summarize(runs)


def _heatmaps(fig) -> list:
    return [ax for ax in fig.axes if ax.get_xlabel() == "evaluated on experience"]


@pytest.mark.parametrize("n_exp", [2, 3])
def test_accuracy_matrix_greys_out_untrained_cells_and_shows_task_il(n_exp):
    fig = accuracy_matrix_figure("naive", _summary("naive", 3, n_exp)["naive"], "class")
    panels = _heatmaps(fig)
    assert [ax.get_title() for ax in panels] == ["Class-IL accuracy (%)", "Task-IL accuracy (%)"]
    for ax in panels:
        mask = np.ma.getmaskarray(ax.images[0].get_array())
        assert mask.tolist() == np.triu(np.ones((n_exp, n_exp), dtype=bool), k=1).tolist()
        cells = [t.get_text() for t in ax.texts]
        assert cells.count("–") == n_exp * (n_exp - 1) // 2 and all("±" in c for c in cells if c != "–")
    assert fig._suptitle.get_text() == "naive (mean of 3 seeds, ±1 std)"
    width, height = fig.get_size_inches()
    assert width >= 6.5 and height >= 3.5  # room for titles and colour bars at 2-3 experiences
    plt.close(fig)


def test_joint_matrix_has_no_untrained_cells_and_one_seed_says_so():
    fig = accuracy_matrix_figure("joint", _summary("joint", 1)["joint"], "domain")
    (panel,) = _heatmaps(fig)[:1]
    assert panel.get_title() == "Domain-IL accuracy (%)"
    assert not np.ma.getmaskarray(panel.images[0].get_array()).any()
    assert fig._suptitle.get_text() == "joint (1 seed)"
    plt.close(fig)


def test_average_accuracy_names_the_seeds_and_the_band():
    summary = {**_summary("naive", 3), **_summary("streamkl", 3)}
    fig = average_accuracy_figure(summary, "digits, class-incremental", "class")
    (ax,) = fig.axes
    assert ax.get_title() == "digits, class-incremental\nmean of 3 seeds, ±1 std"
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["naive", "streamkl", "±1 std over seeds"]
    assert legend.get_title().get_text() == "strategy (mean of 3 seeds, ±1 std)"
    plt.close(fig)
