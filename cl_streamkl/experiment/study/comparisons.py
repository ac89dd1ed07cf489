"""What a study tests: the paired comparisons and their Holm family, and confirmatory hypotheses.

Without a ``comparisons`` key a plan compares every attention distillation with the same run
without it (and StreamKL with PAD in its place), on every metric, Holm over them all except
learning accuracy. With one, only the listed (scenario, arm, strategy, baseline, metrics) are
tested and they are Holm's family. ``hypotheses`` fix a confirmatory test in advance: each a
paired comparison, a metric and the direction claimed; the ``primary`` ones are one Holm family,
the ``secondary`` another, and a hypothesis is confirmed when its Holm-adjusted two-sided
paired-t p-value is below ``alpha`` and its mean difference lies in the claimed direction.
While a family has a hypothesis short of seeds, the Holm p of a complete one is not known yet,
only its bounds: a verdict is given only where they settle it (:func:`verdict`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cl_streamkl.experiment.study.plan_checks import PlanError

METRICS = ("mean_experience_accuracy", "stream_accuracy", "forgetting", "learning_accuracy", "task_il_accuracy")
DIRECTIONS = {"lower": -1.0, "higher": 1.0}
ROLES = ("primary", "secondary")
ALPHA = 0.05
# Reported beside every hypothesis, never tested: was the earlier work learned, and kept?
BESIDE = ("learning_accuracy", "earlier_final_accuracy")
COMPARISON_KEYS = {"scenario", "arm", "strategy", "baseline", "metrics"}
HYPOTHESIS_KEYS = {"id", "scenario", "arm", "strategy", "baseline", "metric", "direction", "role"}


class ComparisonError(PlanError):
    """A comparisons or hypotheses entry that names what the plan does not run."""


def _tested(plan: dict[str, Any], scenario: Any, arm: Any, names: Sequence[Any], where: str) -> None:
    part = plan["scenarios"].get(scenario)
    if part is None:
        raise ComparisonError(f"{where}: scenario {scenario!r} is not in the plan")
    if arm not in part["test"]:
        raise ComparisonError(f"{where}: arm {arm!r} is not tested in scenario {scenario}")
    for name in names:
        if name not in part["test"][arm]:
            raise ComparisonError(f"{where}: {name!r} is not tested in scenario {scenario}, arm {arm!r}")


def check_comparisons(plan: dict[str, Any]) -> None:
    """Raise :class:`ComparisonError` for a comparison or hypothesis the plan cannot answer (their
    shapes are :func:`~cl_streamkl.experiment.study.plan_checks.check_shapes`')."""
    for i, entry in enumerate(plan.get("comparisons") or ()):
        where = f"comparisons[{i}]"
        if not isinstance(entry, dict) or not {"scenario", "strategy", "baseline"} <= set(entry) <= COMPARISON_KEYS:
            raise ComparisonError(f"{where} needs scenario, strategy, baseline (arm, metrics optional)")
        _tested(plan, entry["scenario"], entry.get("arm", ""), (entry["strategy"], entry["baseline"]), where)
        bad = sorted(set(entry.get("metrics", METRICS)) - set(METRICS))
        if bad:
            raise ComparisonError(f"{where}: unknown metric {bad[0]!r} ({', '.join(METRICS)})")
    ids = []
    for i, entry in enumerate(plan.get("hypotheses") or ()):
        where = f"hypotheses[{i}]"
        if not isinstance(entry, dict) or set(entry) != HYPOTHESIS_KEYS:
            raise ComparisonError(f"{where} needs exactly {', '.join(sorted(HYPOTHESIS_KEYS))}")
        _tested(plan, entry["scenario"], entry["arm"], (entry["strategy"], entry["baseline"]), where)
        if entry["metric"] not in METRICS or entry["metric"] == "learning_accuracy":
            raise ComparisonError(f"{where}: metric {entry['metric']!r} cannot be a hypothesis")
        if entry["direction"] not in DIRECTIONS or entry["role"] not in ROLES:
            raise ComparisonError(f"{where}: direction is lower or higher, role primary or secondary")
        if entry["id"] in ids:
            raise ComparisonError(f"{where}: id {entry['id']!r} is given twice; every id must be distinct")
        ids.append(entry["id"])


def in_family(plan: dict[str, Any], scenario: str, entry: dict[str, Any]) -> bool:
    """Whether a paired entry (labels with their arm suffix stripped) is in the plan's Holm family."""
    if entry["metric"] == "learning_accuracy":
        return False
    if not plan.get("comparisons"):
        return True
    return any(c["scenario"] == scenario and c.get("arm", "") == entry["arm"]
               and (c["strategy"], c["baseline"]) == (entry["pair"][0], entry["pair"][1])
               and entry["metric"] in c.get("metrics", METRICS) for c in plan["comparisons"])


def listed(plan: dict[str, Any], scenario: str, arm: str, strategy: str, baseline: str) -> bool:
    """Whether a pair is reported: every default pair, or only the listed ones."""
    if not plan.get("comparisons"):
        return True
    return any(c["scenario"] == scenario and c.get("arm", "") == arm and (c["strategy"], c["baseline"]) ==
               (strategy, baseline) for c in plan["comparisons"])


def earlier_final_accuracy(matrix: Sequence[Sequence[float]]) -> float | None:
    """After the last experience, the mean accuracy on the experiences before it (None for one)."""
    last = matrix[-1]
    return sum(last[:-1]) / (len(last) - 1) if len(last) > 1 else None


def verdicts(plan: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every hypothesis with its per-seed differences, interval, p, Holm p and verdict.

    Args:
        runs: per scenario, the report's test runs (``label``, ``arm``, ``strategy``, ``seed``,
            the metrics as fractions, ``accuracy_matrix``).

    Returns:
        One entry per hypothesis, in plan order: the hypothesis, ``seeds``, ``differences``
        (percentage points, strategy − baseline), ``mean_diff``, ``ci95``, ``p_value``,
        ``p_holm`` (within its role's family, over the p-values known so far), ``verdict``
        (:func:`verdict`), and ``beside``: for :data:`BESIDE`, the per-seed values of strategy
        and baseline and their mean difference.
    """
    from cl_streamkl.experiment.statistics import holm_adjust, paired_t_test, t_interval

    entries = []
    for hypothesis in plan.get("hypotheses") or ():
        by = {(run["strategy"], run["seed"]): run for run in runs.get(hypothesis["scenario"], [])
              if run["arm"] == hypothesis["arm"]}
        seeds = [s for s in plan["test_seeds"] if (hypothesis["strategy"], s) in by and (hypothesis["baseline"], s) in by]
        values = {name: [_value(by[(hypothesis[name], s)], hypothesis["metric"]) for s in seeds]
                  for name in ("strategy", "baseline")}
        differences = [100 * (a - b) for a, b in zip(values["strategy"], values["baseline"])]
        mean, low, high = t_interval(differences) if differences else (None, None, None)
        beside = {}
        for metric in BESIDE:
            pairs = {name: [_value(by[(hypothesis[name], s)], metric) for s in seeds] for name in ("strategy", "baseline")}
            if seeds and None not in pairs["strategy"] + pairs["baseline"]:
                beside[metric] = {**{name: [100 * v for v in vs] for name, vs in pairs.items()},
                                  "mean_diff": 100 * sum(a - b for a, b in zip(*pairs.values())) / len(seeds)}
        entries.append({**hypothesis, "seeds": seeds, "differences": differences, "mean_diff": mean,
                        "ci95": [low, high], "p_value": paired_t_test(differences) if len(differences) > 1 else None,
                        "complete": len(seeds) == len(plan["test_seeds"]), "beside": beside})
    for role in ROLES:
        family = [e for e in entries if e["role"] == role]
        for entry, adjusted in zip(family, holm_adjust([e["p_value"] for e in family])):
            entry["p_holm"] = adjusted
        for entry in family:
            entry["verdict"] = verdict(entry, len(family), all(e["complete"] for e in family))
    return entries


def verdict(entry: dict[str, Any], family_size: int, family_complete: bool) -> str:
    """A hypothesis's verdict: ``confirmed``, ``not confirmed``, ``pending`` or ``incomplete``.

    ``incomplete`` until every test seed has both runs (or without a p-value). Once its whole
    family is complete: ``confirmed`` when Holm's p is below :data:`ALPHA` and the mean
    difference lies in the claimed direction, else ``not confirmed``. Before, whatever p-values
    the rest of the family turns out to have, its Holm p lies between its raw p and
    min(1, m·p) (m: the family's size): ``confirmed`` when m·p is below :data:`ALPHA` (and
    the direction is right), ``not confirmed`` when p is not (or the direction is wrong), else
    ``pending``.

    Args:
        entry: the hypothesis's entry (``complete``, ``direction``, ``mean_diff``, ``p_value``,
            ``p_holm``).
        family_size: how many hypotheses its role has.
        family_complete: whether each of them has every test seed.
    """
    if not entry["complete"] or entry["p_holm"] is None:
        return "incomplete"
    claimed = DIRECTIONS[entry["direction"]] * entry["mean_diff"] > 0
    if family_complete:
        return "confirmed" if entry["p_holm"] < ALPHA and claimed else "not confirmed"
    if not claimed or entry["p_value"] >= ALPHA:
        return "not confirmed"
    return "confirmed" if family_size * entry["p_value"] < ALPHA else "pending"


def _value(run: dict[str, Any], metric: str) -> float | None:
    if metric == "earlier_final_accuracy":
        return earlier_final_accuracy(run["accuracy_matrix"])
    return run.get(metric)
