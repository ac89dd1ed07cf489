"""What a run shows, in plain sentences: the first lines of its printed summary and of ``summary.md``.

One sentence per attention distillation compared with its absence (``streamkl`` against
``naive``, ``lwf+streamkl`` against ``lwf``, ...): how much each forgets, the paired
difference with its 95 % interval over the seeds, and whether the interval rules out no
effect. Then, where both ran, how the distillation alone compares with LwF alone, the
baseline that forgets least in the project's efficacy study.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _forgetting(summary: dict[str, dict[str, Any]], strategy: str) -> float | None:
    stat = summary.get(strategy, {}).get("average_forgetting")
    return None if stat is None else 100 * stat["mean"]


def _verdict(low: float | None, high: float | None, n: int) -> str:
    if low is None:
        return f"{n} seed: give --seeds 0 1 2 for an interval"
    if high < 0:
        return "the whole interval is below zero: less forgetting, beyond these seeds' noise"
    if low > 0:
        return "the whole interval is above zero: more forgetting, beyond these seeds' noise"
    return "the interval holds zero: these seeds cannot tell the two apart"


def findings(summary: dict[str, dict[str, Any]], paired: Sequence[dict[str, Any]]) -> list[str]:
    """Plain sentences on forgetting, one per compared pair, then the distillation against LwF.

    Args:
        summary: :func:`~cl_streamkl.experiment.summary.summarize` of the runs (fractions).
        paired: :func:`~cl_streamkl.experiment.statistics.paired_comparisons` of the runs (fractions).

    Returns:
        Lines of text, empty when no pair was compared.
    """
    lines = []
    for entry in paired:
        if entry["metric"] != "forgetting":
            continue
        strategy, baseline = entry["strategy"], entry["baseline"]
        mine, theirs = _forgetting(summary, strategy), _forgetting(summary, baseline)
        low, high = (None if bound is None else 100 * bound for bound in entry["ci95"])
        interval = "" if low is None else f", 95 % interval [{low:+.1f}, {high:+.1f}]"
        lines.append(f"{strategy} forgets {mine:.1f} % of what it had learned, {baseline} {theirs:.1f} %: "
                     f"{100 * entry['mean_diff']:+.1f} points over {entry['n']} seed{'s' * (entry['n'] > 1)}"
                     f"{interval} ({_verdict(low, high, entry['n'])}).")
    for distillation in ("streamkl", "pad"):
        alone, lwf = _forgetting(summary, distillation), _forgetting(summary, "lwf")
        if alone is not None and lwf is not None:
            better = "LwF forgets less" if lwf < alone else f"{distillation} forgets less"
            lines.append(f"{distillation} alone forgets {alone:.1f} %, lwf alone {lwf:.1f} %: {better} here.")
    return lines
