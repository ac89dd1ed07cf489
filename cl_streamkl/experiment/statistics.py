"""Statistics over seeds: mean ± std, paired differences with t-intervals and tests, Holm's correction.

A seed fixes the class order (or domain order) and the initialisation, so two strategies
run with the same seed see the same stream from the same start. Their per-seed
difference removes that shared variation: the paired 95 % t-interval of the
differences says whether adding a component helps beyond the noise. A study makes many
such comparisons; :func:`holm_adjust` controls the chance of any false positive among
them (Holm 1979), and the raw intervals stay beside the adjusted p-values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats

from cl_streamkl.experiment.config import ATTENTION_DISTILLATIONS, strategy_components

# Names of the paired metrics (as results.json writes them) → RunResult.metrics() keys:
# the unweighted mean over experiences of the final accuracy, Avalanche's sample-weighted
# stream accuracy, Chaudhry et al.'s average forgetting, the accuracy right after learning
# each experience, and the class scenario's Task-IL accuracy of the shared head.
PAIRED_METRICS = {
    "mean_experience_accuracy": "final_average_accuracy",
    "stream_accuracy": "stream_accuracy",
    "forgetting": "average_forgetting",
    "learning_accuracy": "learning_accuracy",
    "task_il_accuracy": "final_task_il_accuracy",
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


def paired_t_test(differences: Sequence[float]) -> float | None:
    """Two-sided p-value of Student's paired t-test that the mean difference is zero.

    ``None`` for fewer than two differences; with identical differences the statistic
    is infinite (p = 0) unless they are all zero (p = 1).
    """
    values = np.asarray(differences, dtype=np.float64)
    if values.size < 2:
        return None
    if np.all(values == values[0]):
        return 1.0 if values[0] == 0 else 0.0
    return float(stats.ttest_1samp(values, 0.0).pvalue)


def holm_adjust(p_values: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values (family-wise error control), in the input's order.

    The i-th smallest of the m p-values becomes max over j <= i of min(1, (m − j + 1) · p₍ⱼ₎):
    rejecting where the adjusted value is below a level keeps the probability of any
    false rejection below it. ``None`` entries (no test) stay ``None`` and do not count in m.
    """
    tested = [(p, i) for i, p in enumerate(p_values) if p is not None]
    adjusted: list[float | None] = [None] * len(p_values)
    running = 0.0
    for rank, (p, index) in enumerate(sorted(tested)):
        running = max(running, min(1.0, (len(tested) - rank) * p))
        adjusted[index] = running
    return adjusted


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
        results: :class:`~cl_streamkl.experiment.run_result.RunResult` of every run.
        scenario: the runs' scenario (decides which names are valid strategies).
        scale: multiplies the differences: 1 keeps the metrics' fractions, 100 gives
            percentage points.

    Returns:
        One entry per (pair from :func:`comparison_pairs`, metric with values):
        ``{"strategy", "baseline", "metric", "mean_diff", "ci95": [low, high], "n",
        "p_value", "seeds", "differences"}``. ``metric`` is a key of
        :data:`PAIRED_METRICS`; for ``forgetting`` a negative difference means the
        strategy forgets less. ``ci95`` holds ``None`` bounds and ``p_value`` is ``None``
        for a single seed; ``p_value`` is :func:`paired_t_test`'s, not adjusted;
        ``differences`` are the per-seed values, in the order of ``seeds``.
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
            differences = [scale * (a - b) for a, b in values]
            mean, low, high = t_interval(differences)
            entries.append({"strategy": strategy, "baseline": baseline, "metric": metric,
                            "mean_diff": mean, "ci95": [low, high], "n": len(values),
                            "p_value": paired_t_test(differences), "seeds": seeds, "differences": differences})
    return entries


def format_paired(entries: Sequence[dict[str, Any]],
                  metrics: Sequence[str] = ("mean_experience_accuracy", "forgetting")) -> str:
    """Aligned text lines of :func:`paired_comparisons` (fractions) in percentage points, one per (pair, metric)."""
    lines = []
    for entry in entries:
        if entry["metric"] not in metrics:
            continue
        low, high = entry["ci95"]
        interval = "n/a" if low is None else f"[{100 * low:+.1f}, {100 * high:+.1f}]"
        lines.append(f"{entry['strategy']} - {entry['baseline']}  {entry['metric']:<24} "
                     f"{100 * entry['mean_diff']:+6.1f} pp  95% CI {interval}  (n={entry['n']})")
    return "\n".join(lines)
