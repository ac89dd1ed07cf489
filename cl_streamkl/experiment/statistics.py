"""Statistics over seeds: mean ± std, and paired differences with t-intervals.

A seed fixes the class order (or domain order) and the initialisation, so two strategies
run with the same seed see the same stream from the same start. Their per-seed
difference removes that shared variation: the paired 95 % t-interval of the
differences says whether adding a component helps beyond the noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats

from cl_streamkl.experiment.config import ATTENTION_DISTILLATIONS, strategy_components

# Names of the paired metrics (as results.json writes them) → RunResult.metrics() keys.
PAIRED_METRICS = {
    "final_avg_acc": "final_average_accuracy",
    "forgetting": "average_forgetting",
    "learning_acc": "learning_accuracy",
    "task_il_acc": "final_task_il_accuracy",
}


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; 0.0 for a single value)."""
    array = np.asarray(values, dtype=np.float64)
    if array.size == 0:
        raise ValueError("mean_std needs at least one value")
    std = float(array.std(ddof=1)) if array.size > 1 else 0.0
    return float(array.mean()), std


def t_interval(differences: Sequence[float], confidence: float = 0.95) -> tuple[float, float | None, float | None]:
    """Mean of paired differences and its two-sided Student-t confidence interval.

    Returns:
        ``(mean, low, high)``; the bounds are ``None`` for fewer than two differences.
    """
    values = np.asarray(differences, dtype=np.float64)
    if values.size == 0:
        raise ValueError("t_interval needs at least one difference")
    mean = float(values.mean())
    if values.size < 2:
        return mean, None, None
    half_width = float(stats.t.ppf(0.5 + confidence / 2, df=values.size - 1)
                       * values.std(ddof=1) / np.sqrt(values.size))
    return mean, mean - half_width, mean + half_width


def comparison_pairs(strategies: Sequence[str], scenario: str = "class") -> list[tuple[str, str]]:
    """(strategy, baseline) pairs to compare: each attention distillation against its absence.

    For every strategy holding ``streamkl`` or ``pad``, the baseline is the strategy of
    the same run without it (``naive`` when nothing else is left); and every strategy
    holding ``streamkl`` is also compared with the same strategy holding ``pad`` instead
    (per-row KL against the published pooled distance). Pairs whose baseline was not run
    are left out.
    """
    by_components = {strategy_components(name, scenario): name for name in strategies}
    pairs = []
    for name in strategies:
        components = strategy_components(name, scenario)
        for distillation in ATTENTION_DISTILLATIONS:
            if distillation not in components:
                continue
            baseline = by_components.get(components - {distillation})
            if baseline is not None:
                pairs.append((name, baseline))
        if "streamkl" in components:
            published = by_components.get(components - {"streamkl"} | {"pad"})
            if published is not None:
                pairs.append((name, published))
    return pairs


def paired_comparisons(results: Sequence[Any], scenario: str = "class", scale: float = 1.0
                       ) -> list[dict[str, Any]]:
    """Paired differences (strategy − baseline) over the seeds both ran, as fractions (times ``scale``).

    Args:
        results: :class:`~cl_streamkl.experiment.runner.RunResult` of every run.
        scenario: the runs' scenario (decides which names are valid strategies).
        scale: multiplies the differences: 1 keeps the fractions of the metrics, 100
            gives percentage points.

    Returns:
        One entry per (pair from :func:`comparison_pairs`, metric with values):
        ``{"strategy", "baseline", "metric", "mean_diff", "ci95": [low, high], "n"}``.
        ``metric`` is a key of :data:`PAIRED_METRICS`; for ``forgetting`` a negative
        difference means the strategy forgets less. ``ci95`` holds ``None`` bounds for
        a single seed.
    """
    metrics: dict[str, dict[int, dict[str, Any]]] = {}
    for result in results:
        metrics.setdefault(result.strategy, {})[result.seed] = result.metrics()
    entries = []
    for strategy, baseline in comparison_pairs(list(metrics), scenario):
        seeds = [seed for seed in metrics[strategy] if seed in metrics[baseline]]
        for metric, key in PAIRED_METRICS.items():
            values = [(metrics[strategy][s][key], metrics[baseline][s][key]) for s in seeds]
            if not values or any(a is None or b is None for a, b in values):
                continue
            mean, low, high = t_interval([scale * (a - b) for a, b in values])
            entries.append({"strategy": strategy, "baseline": baseline, "metric": metric,
                            "mean_diff": mean, "ci95": [low, high], "n": len(values)})
    return entries


def format_paired(entries: Sequence[dict[str, Any]], metrics: Sequence[str] = ("final_avg_acc", "forgetting")
                  ) -> str:
    """Aligned text lines of :func:`paired_comparisons` (fractions), in percentage points, one per (pair, metric)."""
    lines = []
    for entry in entries:
        if entry["metric"] not in metrics:
            continue
        low, high = entry["ci95"]
        interval = "n/a" if low is None else f"[{100 * low:+.1f}, {100 * high:+.1f}]"
        lines.append(f"{entry['strategy']} - {entry['baseline']}  {entry['metric']:<13} "
                     f"{100 * entry['mean_diff']:+6.1f} pp  95% CI {interval}  (n={entry['n']})")
    return "\n".join(lines)
