"""Continual-learning metrics on hand-computed accuracy matrices, and the seed summary table."""

from __future__ import annotations

import pytest

from cl_streamkl.experiment.accuracy_matrix import (
    average_accuracy_per_experience, average_forgetting, backward_transfer, final_average_accuracy,
    learning_accuracy,
)
from cl_streamkl.experiment.run_result import RunResult
from cl_streamkl.experiment.statistics import mean_std
from cl_streamkl.experiment.summary import format_markdown_table, format_table, summarize

# rows: after training experience i; columns: evaluated on experience j
ACC = [[0.9, 0.0, 0.0],
       [0.5, 0.8, 0.0],
       [0.3, 0.6, 1.0]]


def test_metrics_by_hand():
    assert average_accuracy_per_experience(ACC) == pytest.approx([0.9, 0.65, 1.9 / 3])
    assert final_average_accuracy(ACC) == pytest.approx(1.9 / 3)
    # forgetting: exp 0 best 0.9 → 0.3 (0.6); exp 1 best 0.8 → 0.6 (0.2)
    assert average_forgetting(ACC) == pytest.approx(0.4)
    # BWT: (0.3 - 0.9 + 0.6 - 0.8) / 2
    assert backward_transfer(ACC) == pytest.approx(-0.4)
    assert learning_accuracy(ACC) == pytest.approx((0.9 + 0.8 + 1.0) / 3)
    # forgetting compares with the best earlier accuracy, BWT with the one right after learning
    peaked = [[0.5, 0.0, 0.0], [0.9, 0.8, 0.0], [0.4, 0.8, 1.0]]
    assert average_forgetting(peaked) == pytest.approx(0.25)
    assert backward_transfer(peaked) == pytest.approx(-0.05)
    # accuracy that rises later counts as negative forgetting (Chaudhry et al. do not clip)
    rising = [[0.5, 0.0], [0.7, 0.9]]
    assert average_forgetting(rising) == pytest.approx(-0.2)
    assert backward_transfer(rising) == pytest.approx(0.2)
    assert average_forgetting([[0.7]]) == 0.0 and backward_transfer([[0.7]]) == 0.0


def test_metrics_reject_non_square():
    with pytest.raises(ValueError, match="square"):
        final_average_accuracy([[0.1, 0.2]])
    with pytest.raises(ValueError, match="at least one"):
        mean_std([])


def test_summary_mean_std_and_table_alignment():
    runs = [
        RunResult("naive", 0, [0, 1, 2], ACC, wall_time_s=10.0, peak_memory_mb=100.0),
        RunResult("naive", 1, [2, 1, 0], [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]],
                  wall_time_s=12.0, peak_memory_mb=110.0),
        RunResult("lwf+streamkl", 0, [0, 1, 2], ACC, penalties=[0.0, 0.5, 1.0], wall_time_s=20.0),
        RunResult("lwf+streamkl", 1, [2, 1, 0], ACC, penalties=[0.0, 1.0], wall_time_s=22.0),
    ]
    summary = summarize(runs)
    assert list(summary) == ["naive", "lwf+streamkl"]
    naive = summary["naive"]
    assert naive["final_average_accuracy"]["mean"] == pytest.approx((1.9 / 3 + 1 / 3) / 2)
    assert naive["wall_time_s"] == pytest.approx({"mean": 11.0, "std": 2 ** 0.5})
    assert naive["mean_penalty"] is None
    assert summary["lwf+streamkl"]["mean_penalty"]["mean"] == pytest.approx(0.5)
    assert summary["lwf+streamkl"]["final_average_accuracy"]["std"] == 0.0
    assert naive["accuracy_matrix"]["mean"][2][0] == pytest.approx(0.15)

    lines = format_table(summary).splitlines()
    assert len(lines) == 4 and len({len(line) for line in lines}) == 1
    assert lines[0].split()[:3] == ["Strategy", "Class-IL", "acc"]
    assert lines[2].split()[:4] == ["naive", "48.3", "±", "21.2"]
    # no Task-IL matrix recorded: the column is left out
    assert summary["naive"]["final_task_il_accuracy"] is None and "Task-IL" not in lines[0]
    assert format_table(summary, "domain").split()[1:3] == ["Domain-IL", "acc"]
    markdown = format_markdown_table(summary).splitlines()
    assert markdown[0].startswith("| Strategy |") and markdown[3].startswith("| lwf+streamkl | 63.3 ± 0.0 |")
