"""Checks of a plan's shape and of the report its ``settings_from`` names, before any value is used.

A plan file is written by hand: a scenario's ``options`` written as a list, a grid entry as a
string or ``hypotheses`` as a mapping must be refused in one line naming the key, not end in a
traceback where the value is first used. And a plan whose settings were chosen by another
study (``settings_from``) must not test them on the seeds they were chosen on, as a single
plan's ``val_seeds`` and ``test_seeds`` may not overlap.
"""

from __future__ import annotations

from typing import Any


class PlanError(ValueError):
    """A plan file that cannot be run; the message is one line naming the file and the key."""


def _mapping(value: Any, key: str, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise PlanError(f"{key} must be a mapping of {what}, not {type(value).__name__}")
    return value


def _entries(value: Any, key: str, what: str) -> list[dict[str, Any]]:
    """A list of mappings (``comparisons``, ``hypotheses``, a grid)."""
    if not isinstance(value, list):
        raise PlanError(f"{key} must be a list of mappings ({what}), not {type(value).__name__}")
    stray = next((entry for entry in value if not isinstance(entry, dict)), None)
    if stray is not None:
        raise PlanError(f"{key} must be a list of mappings ({what}); it holds {stray!r}")
    return value


def _string_keys(value: Any, key: str) -> None:
    """Every mapping's keys are strings (YAML allows numbers and null; JSON and the fingerprint do not)."""
    if isinstance(value, dict):
        for name, item in value.items():
            if not isinstance(name, str):
                raise PlanError(f"{key or 'the plan'}: key {name!r} must be a string")
            _string_keys(item, f"{key}.{name}" if key else name)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _string_keys(item, f"{key}[{i}]")


# The plan keys of comparisons and hypotheses that hold one name each, and their metrics.
NAMED = ("scenario", "arm", "strategy", "baseline", "metric", "direction", "role", "id")


def _names(entries: list[dict[str, Any]], key: str) -> None:
    for i, entry in enumerate(entries):
        for name in NAMED:
            if name in entry and not isinstance(entry[name], str):
                raise PlanError(f"{key}[{i}].{name} must be a string, not {type(entry[name]).__name__}")
        metrics = entry.get("metrics", [])
        if not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics):
            raise PlanError(f"{key}[{i}].metrics must be a list of metric names")


def check_shapes(plan: dict[str, Any]) -> None:
    """Refuse a plan value of the wrong type, naming its key (the values themselves are checked later).

    Raises:
        PlanError: a mapping where a list belongs or the reverse, a name that is no string.
    """
    _string_keys(plan, "")
    for name, part in _mapping(plan.get("scenarios", {}), "scenarios", "scenario names to their parts").items():
        where = f"scenarios.{name}"
        _mapping(part, where, "options, tuning and test")
        _mapping(part.get("options", {}), f"{where}.options", "run settings")
        _mapping(part.get("test", {}), f"{where}.test", "replay arms to strategies")
        for family, spec in _mapping(part.get("tuning", {}), f"{where}.tuning", "method families").items():
            spec = _mapping(spec, f"{where}.tuning.{family}", "arm, grid and strategy")
            if not isinstance(spec.get("arm", ""), str):
                raise PlanError(f"{where}.tuning.{family}.arm must be an arm's name ('' for none)")
            _entries(spec.get("grid", []), f"{where}.tuning.{family}.grid", "settings")
    for key in ("comparisons", "hypotheses"):
        if plan.get(key) is not None:
            _names(_entries(plan[key], key, "each a paired comparison"), key)


def check_settings_source(plan: dict[str, Any], report: Any, source: str) -> None:
    """Refuse a ``settings_from`` report that is no finished study report, or whose settings were
    chosen on validation seeds that ``plan`` tests on.

    Args:
        plan: the plan file's data (``test_seeds`` not checked yet).
        report: the JSON read from ``source``.
        source: the report's path as the plan file gives it.

    Raises:
        PlanError: one line naming ``source`` and the key.
    """
    where = f"settings_from {source}"
    if not isinstance(report, dict) or "plan_fingerprint" not in report or not isinstance(
            report.get("scenarios"), dict):
        raise PlanError(f"{where} is not a study report")
    for name, part in report["scenarios"].items():
        if not isinstance(part, dict):
            raise PlanError(f"{where}: its scenarios.{name} is not a mapping")
        chosen = part.get("chosen")
        if chosen is not None and not (isinstance(chosen, dict) and all(isinstance(s, dict) for s in chosen.values())):
            raise PlanError(f"{where}: its scenarios.{name}.chosen is not a mapping of families to settings")
    if "plan" not in report:  # a report reduced to its choices: no seeds to compare
        return
    chosen_on = report["plan"].get("val_seeds") if isinstance(report["plan"], dict) else None
    if not isinstance(chosen_on, list):
        raise PlanError(f"{where}: its plan.val_seeds (the seeds its settings were chosen on) is not a list of seeds")
    tested = plan.get("test_seeds") if isinstance(plan.get("test_seeds"), list) else []
    overlap = sorted({seed for seed in tested if isinstance(seed, int)} & {s for s in chosen_on if isinstance(s, int)})
    if overlap:
        raise PlanError(f"test_seeds {overlap} are validation seeds of {where} (its plan.val_seeds): settings "
                             "chosen on a seed are not tested on it; choose other test_seeds")
