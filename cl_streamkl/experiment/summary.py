"""Aggregation over seeds and the aligned comparison table printed at the end of a run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cl_streamkl.experiment.metrics import mean_std
from cl_streamkl.experiment.runner import RunResult

# (key in the summary, table header, formatting scale): accuracies shown in percent.
TABLE_COLUMNS = (
    ("final_average_accuracy", "Final avg acc (%)", 100.0),
    ("average_forgetting", "Forgetting (%)", 100.0),
    ("backward_transfer", "BWT (%)", 100.0),
    ("final_task_aware_accuracy", "Task-aware acc (%)", 100.0),
    ("wall_time_s", "Time (s)", 1.0),
    ("peak_memory_mb", "Peak mem (MB)", 1.0),
)


def summarize(results: Sequence[RunResult]) -> dict[str, dict[str, Any]]:
    """Per strategy (in first-seen order): mean and std over seeds of every scalar metric.

    Returns:
        ``{strategy: {"seeds": [...], metric: {"mean": m, "std": s}, ...,
        "average_accuracy": {"mean": [T], "std": [T]},
        "accuracy_matrix": {"mean": (T, T) list, "std": (T, T) list}}}``; std uses ddof=1.
    """
    by_strategy: dict[str, list[RunResult]] = {}
    for result in results:
        by_strategy.setdefault(result.strategy, []).append(result)
    summary: dict[str, dict[str, Any]] = {}
    for strategy, runs in by_strategy.items():
        metrics = [r.metrics() for r in runs]
        entry: dict[str, Any] = {"seeds": [r.seed for r in runs]}
        for key in ("final_average_accuracy", "average_forgetting", "backward_transfer"):
            entry[key] = dict(zip(("mean", "std"), mean_std([m[key] for m in metrics])))
        task_aware = [m["final_task_aware_accuracy"] for m in metrics]
        entry["final_task_aware_accuracy"] = (
            None if None in task_aware else dict(zip(("mean", "std"), mean_std(task_aware))))
        for key in ("wall_time_s", "peak_memory_mb"):
            entry[key] = dict(zip(("mean", "std"), mean_std([getattr(r, key) for r in runs])))
        penalties = [m["mean_penalty"] for m in metrics if m["mean_penalty"] is not None]
        entry["mean_penalty"] = dict(zip(("mean", "std"), mean_std(penalties))) if penalties else None
        curves = np.asarray([m["average_accuracy"] for m in metrics])
        matrices = np.asarray([r.accuracy_matrix for r in runs])
        ddof = 1 if len(runs) > 1 else 0
        entry["average_accuracy"] = {"mean": curves.mean(0).tolist(), "std": curves.std(0, ddof=ddof).tolist()}
        entry["accuracy_matrix"] = {"mean": matrices.mean(0).tolist(),
                                    "std": matrices.std(0, ddof=ddof).tolist()}
        summary[strategy] = entry
    return summary


def _cell(stat: dict[str, float] | None, key: str, scale: float, with_std: bool) -> str:
    if stat is None:
        return "-"
    decimals = 0 if key == "peak_memory_mb" else 1
    mean = f"{stat['mean'] * scale:.{decimals}f}"
    return f"{mean} ± {stat['std'] * scale:.{decimals}f}" if with_std else mean


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    """An aligned text table: one row per strategy, ``mean ± std`` cells when there are seeds."""
    multi_seed = any(len(entry["seeds"]) > 1 for entry in summary.values())
    header = ["Strategy", *(title for _, title, _ in TABLE_COLUMNS)]
    rows = []
    for strategy, entry in summary.items():
        row = [strategy]
        for key, _, scale in TABLE_COLUMNS:
            row.append(_cell(entry[key], key, scale, with_std=multi_seed))
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def format_markdown_table(summary: dict[str, dict[str, Any]]) -> str:
    """The same numbers as :func:`format_table`, as a Markdown table (for README)."""
    header = ["Strategy", *(title for _, title, _ in TABLE_COLUMNS)]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * len(TABLE_COLUMNS)) + "|"]
    for strategy, entry in summary.items():
        cells = [strategy]
        for key, _, scale in TABLE_COLUMNS:
            cells.append(_cell(entry[key], key, scale, with_std=True))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
