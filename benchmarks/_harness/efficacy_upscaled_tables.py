"""The tables of the earlier efficacy study, whose 1025 tokens were 28 px digits upscaled to 128 px.

Its reports (``benchmarks/results/efficacy-upscaled-short.json`` and ``-long.json``) hold
means, standard deviations and intervals only, in the format the study wrote then; these
functions render them, per scenario with both regimes side by side. Cells are percent;
paired differences are percentage points with a 95 % t-interval, bold where the interval
excludes zero, without correction for multiple comparisons.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_METRICS = (("final_avg_acc", "acc"), ("forgetting", "forgetting"), ("learning_acc", "learning acc"))


def chosen_settings(reports: Sequence[dict[str, Any]], scenario: str) -> str:
    """The StreamKL setting chosen on validation, per regime: ``17 tokens: alpha 1, T 1, layers all; ...``."""
    parts = [(report["settings"]["tokens"], report["scenarios"][scenario]) for report in reports]
    return "; ".join(f"{tokens} tokens: alpha {part['chosen']['alpha']:g}, T {part['chosen']['temperature']:g}, "
                     f"layers {part['chosen']['layers']}" for tokens, part in parts)


def strategy_table(reports: Sequence[dict[str, Any]], scenario: str) -> list[str]:
    """Mean ± std per strategy and regime (``–`` where a regime did not run the strategy)."""
    tokens = [report["settings"]["tokens"] for report in reports]
    parts = [report["scenarios"][scenario] for report in reports]
    keys = list(_METRICS) + ([("task_il_acc", "Task-IL acc")] if scenario == "class" else [])
    header = [f"{title}, {n} tok." for n in tokens for _, title in keys]
    lines = ["| strategy | " + " | ".join(header) + " |", "|---|" + "---:|" * len(header)]
    for strategy in dict.fromkeys(s for part in parts for s in part["table"]):
        cells = []
        for part in parts:
            row = part["table"].get(strategy)
            cells += [f"{row[key][0]:.1f} ± {row[key][1]:.1f}" if row else "–" for key, _ in keys]
        lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
    return lines


def _interval(entry: dict[str, Any]) -> str:
    low, high = entry["ci95"]
    if low is None:
        return f"{entry['mean_diff']:+.1f}"
    text = f"{entry['mean_diff']:+.1f} [{low:+.1f}, {high:+.1f}]"
    return f"**{text}**" if low > 0 or high < 0 else text


def paired_table(reports: Sequence[dict[str, Any]], scenario: str) -> list[str]:
    """Paired differences (with − without) per regime; ``–`` where a regime has no such pair."""
    tokens = [report["settings"]["tokens"] for report in reports]
    parts = [report["scenarios"][scenario] for report in reports]
    metrics = ["final_avg_acc", "forgetting"] + (["task_il_acc"] if scenario == "class" else [])
    header = [f"{metric}, {n} tok." for n in tokens for metric in metrics]
    lines = ["| paired difference (pp, 95 % CI) | " + " | ".join(header) + " |", "|---|" + "---:|" * len(header)]
    for strategy, baseline in dict.fromkeys((e["strategy"], e["baseline"]) for p in parts for e in p["paired"]):
        cells = []
        for part in parts:
            entries = {e["metric"]: e for e in part["paired"] if (e["strategy"], e["baseline"]) == (strategy, baseline)}
            cells += [_interval(entries[metric]) if metric in entries else "–" for metric in metrics]
        lines.append(f"| {strategy} − {baseline} | " + " | ".join(cells) + " |")
    return lines
