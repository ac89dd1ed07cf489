"""What a study start leaves in its folder: the report as JSON and Markdown, and a plot of the
paired differences with their intervals."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from cl_streamkl.experiment.files import write_text_atomically
from cl_streamkl.experiment.study.tables import TITLES, side_by_side

# The paired metrics the plot shows, one panel each.
PLOTTED = ("forgetting", "stream_accuracy")


def write_outputs(report: dict[str, Any], root: Path, json_path: Path | None = None) -> list[Path]:
    """``root/report.json``, ``root/report.md`` and ``root/paired.png`` (and ``json_path``); their paths."""
    stamped = {"date": time.strftime("%Y-%m-%d"), **{k: v for k, v in report.items() if v is not None}}
    text = json.dumps(stamped, indent=1) + "\n"
    paths = [write_text_atomically(root / "report.json", text)]
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        paths.append(write_text_atomically(json_path, text))
    title = f"# Study `{report['plan_fingerprint']}`: {report['regime']}, {report['settings']['tokens']} tokens\n\n"
    paths.append(write_text_atomically(root / "report.md", title + side_by_side([report]) + "\n"))
    plot = plot_paired(report, root / "paired.png")
    return paths + ([plot] if plot is not None else [])


def _rows(report: dict[str, Any]) -> list[tuple[str, str, float, float | None, float | None, bool]]:
    """(panel metric, label, mean, low, high, significant) per paired entry or hypothesis."""
    rows = []
    if report.get("hypotheses"):
        for e in report["hypotheses"]:
            if e["mean_diff"] is not None:
                arm = f" ({e['arm']})" if e["arm"] else ""
                rows.append((e["metric"], f"{e['id']} {e['scenario']}: {e['strategy']}{arm} − {e['baseline']}",
                             e["mean_diff"], *e["ci95"], e["verdict"] == "confirmed"))
        return rows
    for scenario, part in report["scenarios"].items():
        for e in part["paired"]:
            if e["metric"] in PLOTTED:
                rows.append((e["metric"], f"{scenario}: {e['strategy']} − {e['baseline']}", e["mean_diff"],
                             *e["ci95"], e["p_holm"] is not None and e["p_holm"] < 0.05))
    return rows


def plot_paired(report: dict[str, Any], path: Path) -> Path | None:
    """A forest plot: each paired difference (pp) with its raw 95 % interval, one panel per
    metric, filled where Holm's p is below 0.05 (a confirmed hypothesis); None with nothing to plot."""
    rows = _rows(report)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = list(dict.fromkeys(row[0] for row in rows))
    height = max(len([r for r in rows if r[0] == m]) for m in metrics)
    figure, axes = plt.subplots(1, len(metrics), figsize=(6.5 * len(metrics), 1.2 + 0.32 * height), squeeze=False)
    for axis, metric in zip(axes[0], metrics):
        mine = [row for row in rows if row[0] == metric]
        for y, (_, label, mean, low, high, significant) in enumerate(reversed(mine)):
            if low is not None:
                axis.plot([low, high], [y, y], color="black", linewidth=1)
            axis.plot([mean], [y], "o", color="black", markerfacecolor="black" if significant else "white")
        axis.set_yticks(range(len(mine)), [row[1] for row in reversed(mine)], fontsize=7)
        axis.axvline(0.0, color="grey", linewidth=0.8, linestyle="--")
        axis.set_xlabel(f"{TITLES.get(metric, metric)}: difference, pp (raw 95 % CI)")
    figure.suptitle(f"Paired differences, plan {report['plan_fingerprint']} (filled: Holm p < 0.05)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path

