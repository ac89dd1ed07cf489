"""Aggregation over seeds and the comparison a run ends with: printed, and written to ``summary.md``.

Units: :func:`summarize` keeps the runs' fractions (accuracy 0.5, not 50); the table and
the paired differences are shown in percent and percentage points.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cl_streamkl.experiment.findings import findings
from cl_streamkl.experiment.run_result import RunResult
from cl_streamkl.experiment.statistics import format_paired, mean_std

SCALAR_METRICS = ("final_average_accuracy", "stream_accuracy", "average_forgetting", "backward_transfer",
                  "learning_accuracy", "final_task_il_accuracy")
# The scenario's own accuracy, as the field names it (van de Ven et al. 2022).
ACCURACY_TITLES = {"class": "Class-IL acc (%)", "task": "Task-IL acc (%)", "domain": "Domain-IL acc (%)"}
UNITS_NOTE = ("Accuracies, forgetting and backward transfer in percent; paired differences in percentage points "
              "(strategy - baseline, 95 % t-interval over seeds); time in seconds; peak memory in MiB.")
# (key in the summary, table header, formatting scale): accuracies shown in percent.
TABLE_COLUMNS = (
    ("final_average_accuracy", None, 100.0),
    ("average_forgetting", "Forgetting (%)", 100.0),
    ("backward_transfer", "BWT (%)", 100.0),
    ("learning_accuracy", "Learning acc (%)", 100.0),
    ("final_task_il_accuracy", "Task-IL acc (%)", 100.0),
    ("wall_time_s", "Time (s)", 1.0),
    ("peak_memory_mb", "Peak mem (MB)", 1.0),
)


def summarize(results: Sequence[RunResult]) -> dict[str, dict[str, Any]]:
    """Per strategy (in first-seen order): mean and std over seeds of every scalar metric.

    Returns:
        ``{strategy: {"seeds": [...], metric: {"mean": m, "std": s} or None, ...,
        "average_accuracy": {"mean": [T], "std": [T]},
        "accuracy_matrix": {"mean": (T, T) list, "std": (T, T) list},
        "task_il_matrix": the same or None}}``; std uses ddof=1.
    """
    by_strategy: dict[str, list[RunResult]] = {}
    for result in results:
        by_strategy.setdefault(result.strategy, []).append(result)
    summary: dict[str, dict[str, Any]] = {}
    for strategy, runs in by_strategy.items():
        metrics = [r.metrics() for r in runs]
        entry: dict[str, Any] = {"seeds": [r.seed for r in runs]}
        for key in SCALAR_METRICS:
            values = [m[key] for m in metrics]
            entry[key] = None if None in values else dict(zip(("mean", "std"), mean_std(values)))
        for key in ("wall_time_s", "peak_memory_mb"):
            entry[key] = dict(zip(("mean", "std"), mean_std([getattr(r, key) for r in runs])))
        penalties = [m["mean_penalty"] for m in metrics if m["mean_penalty"] is not None]
        entry["mean_penalty"] = dict(zip(("mean", "std"), mean_std(penalties))) if penalties else None
        ddof = 1 if len(runs) > 1 else 0
        curves = np.asarray([m["average_accuracy"] for m in metrics])
        entry["average_accuracy"] = {"mean": curves.mean(0).tolist(), "std": curves.std(0, ddof=ddof).tolist()}
        for key in ("accuracy_matrix", "task_il_matrix"):
            matrices = np.asarray([getattr(r, key) for r in runs])
            entry[key] = (None if matrices.size == 0 else
                          {"mean": matrices.mean(0).tolist(), "std": matrices.std(0, ddof=ddof).tolist()})
        summary[strategy] = entry
    return summary


def _cell(stat: dict[str, float] | None, key: str, scale: float, with_std: bool) -> str:
    if stat is None:
        return "-"
    decimals = 0 if key == "peak_memory_mb" else 1
    mean = f"{stat['mean'] * scale:.{decimals}f}"
    return f"{mean} ± {stat['std'] * scale:.{decimals}f}" if with_std else mean


def _columns(summary: dict[str, dict[str, Any]], scenario: str) -> list[tuple[str, str, float]]:
    """The table's columns: the scenario's accuracy first, columns without values left out."""
    columns = []
    for key, title, scale in TABLE_COLUMNS:
        if all(entry[key] is None for entry in summary.values()):
            continue
        columns.append((key, title or ACCURACY_TITLES[scenario], scale))
    return columns


def table_rows(summary: dict[str, dict[str, Any]], scenario: str = "class", with_std: bool = True
               ) -> tuple[list[str], list[list[str]]]:
    """Header and one row of formatted cells per strategy."""
    columns = _columns(summary, scenario)
    header = ["Strategy", *(title for _, title, _ in columns)]
    rows = [[strategy, *(_cell(entry[key], key, scale, with_std) for key, _, scale in columns)]
            for strategy, entry in summary.items()]
    return header, rows


def format_table(summary: dict[str, dict[str, Any]], scenario: str = "class") -> str:
    """An aligned text table: one row per strategy, ``mean ± std`` cells when there are seeds."""
    multi_seed = any(len(entry["seeds"]) > 1 for entry in summary.values())
    header, rows = table_rows(summary, scenario, with_std=multi_seed)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def format_markdown_table(summary: dict[str, dict[str, Any]], scenario: str = "class") -> str:
    """The same numbers as :func:`format_table`, as a Markdown table (for README)."""
    header, rows = table_rows(summary, scenario)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _heading(title: str, summary: dict[str, dict[str, Any]]) -> str:
    seeds = max(len(entry["seeds"]) for entry in summary.values())
    return f"{title}, {seeds} seed{'s' if seeds > 1 else ''}{' (mean ± std)' if seeds > 1 else ''}"


def summary_text(title: str, summary: dict[str, dict[str, Any]], paired: Sequence[dict[str, Any]],
                 scenario: str = "class") -> str:
    """What a run prints at its end: the heading, the table and the paired differences.

    Args:
        title: what was run (dataset, scenario, experiences, split).
        summary: :func:`summarize` of the runs.
        paired: :func:`~cl_streamkl.experiment.statistics.paired_comparisons` of the runs (fractions).
        scenario: the runs' scenario (names the accuracy column).
    """
    shown = findings(summary, paired)
    lines = [_heading(title, summary), *(["", "What this run shows:", *(f"- {line}" for line in shown)] if shown else []),
             "", format_table(summary, scenario)]
    if paired:
        lines += ["", "paired differences over seeds (strategy - baseline, percentage points):", format_paired(paired)]
    return "\n".join(lines)


def summary_markdown(title: str, summary: dict[str, dict[str, Any]], paired: Sequence[dict[str, Any]],
                     scenario: str = "class") -> str:
    """``summary.md``: :func:`summary_text`'s table and paired differences, with their units named."""
    shown = findings(summary, paired)
    lines = [f"# {_heading(title, summary)}", "", *(f"- {line}" for line in shown), *([""] if shown else []),
             UNITS_NOTE, "", "```text", format_table(summary, scenario), "```"]
    if paired:
        lines += ["", "## Paired differences over seeds", "", "```text", format_paired(paired), "```"]
    return "\n".join(lines) + "\n"
