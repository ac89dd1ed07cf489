"""A study's report: from the plan and the finished units to the JSON a reader can redo.

The report holds the plan and its fingerprint, every tuning unit's validation score per
seed, every test run's accuracy matrices and metrics, mean ± std per strategy, the paired
differences with their per-seed values, raw 95 % t-intervals, paired t-test p-values and
Holm-adjusted p-values over the plan's family, and, for a confirmatory plan, a verdict per
hypothesis (:mod:`~cl_streamkl.experiment.study.comparisons`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from cl_streamkl.experiment.run_result import RunResult
from cl_streamkl.experiment.study.comparisons import in_family, listed, verdicts
from cl_streamkl.experiment.study.plan import (
    SCENARIOS, Unit, choose, fingerprint, first_units, test_units, tuning_units,
)

DEFINITIONS = {
    "mean_experience_accuracy": "after the last experience, the mean over the T experiences of the accuracy on each "
                                "(unweighted)",
    "stream_accuracy": "after the last experience, correct predictions over every evaluation sample of the stream "
                       "(Avalanche's Top1_Acc_Stream: each experience weighs by its number of samples)",
    "forgetting": "average forgetting (Chaudhry et al. 2018): the mean over experiences j < T of the best accuracy on "
                  "j before the last experience minus the accuracy on j after it; not clipped; lower is better",
    "learning_accuracy": "the mean over experiences of the accuracy on each right after learning it",
    "task_il_accuracy": "class scenario: mean_experience_accuracy with each prediction restricted to the evaluated "
                        "experience's classes",
    "records": "each finished unit's record as its worker wrote it, less the penalty after every training iteration "
               "(nine tenths of the bytes); mean_penalty is its mean over the run",
    "paired": "strategy minus baseline over the seeds both ran, in percentage points; ci95: Student-t interval, not "
              "adjusted; p_value: two-sided paired t-test; p_holm: Holm-adjusted over the plan's family (its "
              "comparisons; without them every paired entry of the report except learning_accuracy)",
    "earlier_final_accuracy": "after the last experience, the mean accuracy on the experiences before it",
    "hypotheses": "per hypothesis of a confirmatory plan: paired differences (pp), Student-t interval, two-sided "
                  "paired t-test, Holm over its role's family (primary or secondary); confirmed when p_holm < 0.05 "
                  "and the mean difference lies in the claimed direction, else not confirmed; incomplete until "
                  "every test seed has both runs. While another hypothesis of its family is incomplete, p_holm is "
                  "not final but lies between p_value and m times it (m: the family's size): confirmed when m * "
                  "p_value < 0.05 (direction as claimed), not confirmed when p_value >= 0.05 or the direction is "
                  "not the claimed one, else pending",
}


def _metrics(record: dict[str, Any]) -> dict[str, float | None]:
    """A run record's metrics under the report's names (fractions)."""
    from cl_streamkl.experiment.statistics import PAIRED_METRICS

    return {name: record.get(key) for name, key in PAIRED_METRICS.items()}


def _run_result(record: dict[str, Any]) -> RunResult:
    fields = {f.name for f in dataclasses.fields(RunResult)}
    return RunResult(**{k: v for k, v in record.items() if k in fields})


def _strategy_table(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per label: mean ± sample std (percent) of every metric all its seeds have, and the seeds."""
    from cl_streamkl.experiment.statistics import PAIRED_METRICS, mean_std

    table: dict[str, dict[str, Any]] = {}
    for label in dict.fromkeys(run["label"] for run in runs):
        mine = [run for run in runs if run["label"] == label]
        row: dict[str, Any] = {"seeds": [run["seed"] for run in mine]}
        for name in PAIRED_METRICS:
            values = [run[name] for run in mine]
            if None not in values:
                row[name] = [100 * v for v in mean_std(values)]
        table[label] = row
    return table


def _paired(plan: dict[str, Any], scenario: str, units: Sequence[Unit], records: dict[str, dict[str, Any]]
            ) -> list[dict[str, Any]]:
    """Paired differences within each replay arm (the plan's listed pairs), labelled like the strategy table."""
    from cl_streamkl.experiment.statistics import paired_comparisons

    entries = []
    for arm in dict.fromkeys(unit.arm for unit in units):
        results = [_run_result(records[u.name]) for u in units if u.arm == arm and u.name in records]
        for entry in paired_comparisons(results, scenario, scale=100.0):
            if not listed(plan, scenario, arm, entry["strategy"], entry["baseline"]):
                continue
            suffix = f" ({arm})" if arm else ""
            entries.append({**entry, "arm": arm, "strategy": entry["strategy"] + suffix,
                            "baseline": entry["baseline"] + suffix})
    return entries


def tuning_scores(plan: dict[str, Any], records: dict[str, dict[str, Any]]) -> dict[Unit, float]:
    """Validation mean_experience_accuracy (percent) of every finished tuning unit of the plan."""
    result = {}
    for scenario in SCENARIOS:
        for unit in tuning_units(plan, scenario):
            if unit.name in records:
                last = records[unit.name]["accuracy_matrix"][-1]
                result[unit] = 100 * sum(last) / len(last)
    return result


def add_holm(report: dict[str, Any]) -> None:
    """Set ``p_holm`` on every paired entry of the report (Holm over the plan's family, see
    :func:`~cl_streamkl.experiment.study.comparisons.in_family`)."""
    from cl_streamkl.experiment.statistics import holm_adjust

    plan = report["plan"]
    entries = [(scenario, entry) for scenario, part in report["scenarios"].items() for entry in part["paired"]]
    family = [entry for scenario, entry in entries if in_family(plan, scenario, {**entry, "pair": _pair(entry)})]
    entries = [entry for _, entry in entries]
    for entry, adjusted in zip(family, holm_adjust([entry["p_value"] for entry in family])):
        entry["p_holm"] = adjusted
    for entry in entries:
        entry.setdefault("p_holm", None)


def _pair(entry: dict[str, Any]) -> tuple[str, str]:
    """A paired entry's strategy and baseline without their arm suffix."""
    suffix = f" ({entry['arm']})" if entry["arm"] else ""
    return entry["strategy"].removesuffix(suffix), entry["baseline"].removesuffix(suffix)


def build_report(plan: dict[str, Any], records: dict[str, dict[str, Any]], environment: dict[str, str]
                 ) -> dict[str, Any]:
    """The report of every finished unit of ``plan`` (records by unit name); parts not run yet are empty."""
    scores = tuning_scores(plan, records)
    report: dict[str, Any] = {
        "regime": plan["regime"], "settings": {**plan["settings"], "tokens": plan["tokens"]},
        "plan_fingerprint": fingerprint(plan), "plan": plan, "environment": environment,
        "definitions": DEFINITIONS, "units": {}, "scenarios": {}}
    tune_done = tune_total = test_done = test_total = 0
    for scenario in plan["scenarios"]:
        tuning, complete = choose(plan, scenario, scores)
        tune = tuning_units(plan, scenario)
        tune_total += len(tune)
        tune_done += sum(unit.name in records for unit in tune)
        part: dict[str, Any] = {"options": plan["scenarios"][scenario]["options"], "tuning": tuning,
                                "chosen_from": plan["scenarios"][scenario].get("chosen_from", {}).get("plan"),
                                "chosen": {name: t["chosen"] for name, t in tuning.items()} if complete else None,
                                "runs": [], "table": {}, "paired": []}
        test_total += sum(len(names) for names in plan["scenarios"][scenario]["test"].values()) * len(
            plan["test_seeds"])
        worker_s = {"tune": sum(records[u.name]["process_s"] for u in tune if u.name in records), "test": 0.0}
        if complete:
            units = test_units(plan, scenario, part["chosen"])
            done = [unit for unit in units if unit.name in records]
            test_done += len(done)
            part["runs"] = [{"label": unit.label, "arm": unit.arm, "strategy": unit.strategy, "seed": unit.seed,
                             **{key: records[unit.name][key] for key in (
                                 "class_order", "accuracy_matrix", "task_il_matrix", "eval_sizes", "wall_time_s",
                                 "peak_memory_mb")},
                             **_metrics(records[unit.name])} for unit in done]
            part["table"] = _strategy_table(part["runs"])
            part["paired"] = _paired(plan, scenario, units, records)
            worker_s["test"] = sum(records[u.name]["process_s"] for u in done)
        part["worker_time_s"] = worker_s
        report["scenarios"][scenario] = part
    report["units"] = {"tune": [tune_done, tune_total], "test": [test_done, test_total]}
    if plan.get("first_experience") == "shared":
        firsts = first_units(plan, [u for name in plan["scenarios"] for u in test_units(plan, name, {})])
        report["units"] = {"first": [sum(u.name in records for u in firsts), len(firsts)], **report["units"]}
    if plan.get("hypotheses"):
        report["hypotheses"] = verdicts(plan, {name: part["runs"] for name, part in report["scenarios"].items()})
    # Every finished unit's record, so a committed report resumes the study on another machine
    # (cl-streamkl study --from-report); nothing reads the per-iteration penalties back.
    report["records"] = {name: {key: value for key, value in records[name].items() if key != "penalties"}
                         for name in sorted(records)}
    add_holm(report)
    return report
