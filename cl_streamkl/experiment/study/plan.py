"""A study's plan: read from a plan file, checked, made into JSON and into units.

A plan file (YAML or TOML) says what a study compares: the run settings every unit shares
(any :class:`~cl_streamkl.experiment.config.ExperimentConfig` field: dataset, model, a local
pretrained file, epochs, ...), the scenarios with their options, the replay arms (a fixed
memory each), each method family's validation grid, the strategies tested per arm, the
validation and test seeds, and optionally the comparisons to test (the family for Holm),
the confirmatory hypotheses and a shared first experience. ``benchmarks/studies/`` holds
the project's own; docs/study.md describes every key.

The plan is plain JSON written before any run starts; its fingerprint (a hash of that JSON)
ties every later part of the study to it, so the grid and the seeds cannot change after a
test run. Every method family of a scenario gets the same number of validation settings
(equal effort), each tuned on its own strategy; a combination such as ``lwf+streamkl`` uses
each component's chosen setting.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cl_streamkl.experiment.data.names import DATASETS
from cl_streamkl.experiment.study.files import read_mapping
from cl_streamkl.experiment.study.plan_checks import PlanError, check_settings_source, check_shapes

SCENARIOS = ("class", "task", "domain")
PARTS = ("tune", "test")
SELECTION = ("per family and scenario, the setting with the highest mean over the validation seeds of "
             "mean_experience_accuracy on the validation split; ties: the first in grid order")
# The plan's keys: required, then optional with their defaults (an absent optional key leaves
# the plan, and so its fingerprint, as it was before the key existed).
REQUIRED = ("regime", "settings", "val_seeds", "test_seeds", "scenarios")
OPTIONAL: dict[str, Any] = {"pad_variant": "asymmetric", "arms": {"": {}}, "selection": SELECTION}
EXTRA = ("comparisons", "hypotheses", "first_experience", "power", "notes")
# Keys of a plan file that are resolved when it is read, not kept as they are.
FILE_ONLY = ("settings_from",)
SCENARIO_KEYS = ("options", "tuning", "test")
FIRST_EXPERIENCE = ("own", "shared")
# Settings a plan may not set: the command chooses them per unit.
PER_UNIT = ("scenario", "strategies", "seeds", "eval_split", "out", "device")


def tokens(settings: dict[str, Any]) -> int:
    """Tokens per image: (image / patch)² patches and the class token (the CLI's defaults where unset)."""
    from cl_streamkl.experiment.config import CLUTTERED, DEFAULT_CLUTTER, DEFAULT_IMAGE_SIZE, ExperimentConfig

    default = ExperimentConfig()
    image, patch = settings.get("image_size", default.image_size), settings.get("patch_size", default.patch_size)
    if image is None:  # the dataset's own size, as a run resolves it
        dataset = settings.get("dataset", default.dataset)
        image = (settings.get("canvas") or DEFAULT_CLUTTER.canvas if dataset == CLUTTERED
                 else DEFAULT_IMAGE_SIZE.get(dataset))
        if image is None:
            raise PlanError(f"settings: dataset {dataset!r} has no default image_size; set image_size")
    return (image // patch) ** 2 + 1


def _seeds(value: Any, key: str, least: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in value):
        raise PlanError(f"{key} must be a list of integer seeds")
    if len(set(value)) != len(value):
        raise PlanError(f"{key} repeats a seed: {sorted(s for s in set(value) if value.count(s) > 1)}")
    if any(s < 0 or s >= 2**32 for s in value):
        raise PlanError(f"{key}: seeds are integers from 0 to 2**32 - 1")
    if len(value) < least:
        raise PlanError(f"{key} needs at least {least} distinct seeds")
    return value


def _strategies(names: Any, key: str, scenario: str) -> list[str]:
    from cl_streamkl.experiment.config import strategy_components

    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise PlanError(f"{key} must be a non-empty list of strategy names")
    for name in names:
        try:
            strategy_components(name, scenario)
        except ValueError as err:
            raise PlanError(f"{key}: {err}") from None
    return names


def _check_settings(settings: dict[str, Any], key: str) -> None:
    """Refuse fields the configuration lacks or values it refuses (checked as a run would)."""
    from cl_streamkl.experiment.config import ExperimentConfig

    if not isinstance(settings, dict):
        raise PlanError(f"{key} must be a mapping of run settings")
    fixed = sorted(set(settings) & set(PER_UNIT))
    if fixed:
        raise PlanError(f"{key}: {', '.join(fixed)} is set per unit by the study, not in the plan")
    try:
        ExperimentConfig.from_dict(settings)
    except (TypeError, ValueError) as err:
        raise PlanError(f"{key}: {err}") from None


def _check_scenario(name: str, part: dict[str, Any], plan: dict[str, Any]) -> None:
    if name not in SCENARIOS:
        raise PlanError(f"scenarios: {name!r} is not a scenario ({', '.join(SCENARIOS)})")
    if not isinstance(part, dict) or sorted(set(part) - {"chosen_from"}) != sorted(SCENARIO_KEYS):
        raise PlanError(f"scenarios.{name} needs exactly the keys {', '.join(SCENARIO_KEYS)}")
    _check_settings({**plan["settings"], **part["options"]}, f"scenarios.{name}.options")
    test = part["test"]
    if not isinstance(test, dict):
        raise PlanError(f"scenarios.{name}.test must map replay arms to the strategies tested in them")
    if not test and not part["tuning"]:
        raise PlanError(f"scenarios.{name} runs nothing: its test and tuning are both empty")
    for arm, names in test.items():
        if arm not in plan["arms"]:
            raise PlanError(f"scenarios.{name}.test: arm {arm!r} is not in arms ({', '.join(map(repr, plan['arms']))})")
        _strategies(names, f"scenarios.{name}.test.{arm or '<no arm>'}", name)
    sizes = set()
    for family, spec in part["tuning"].items():
        where = f"scenarios.{name}.tuning.{family}"
        if not isinstance(spec, dict) or sorted(spec) != ["arm", "grid", "strategy"]:
            raise PlanError(f"{where} needs exactly the keys arm, grid, strategy")
        _strategies([spec["strategy"]], f"{where}.strategy", name)
        if spec["arm"] not in plan["arms"]:
            raise PlanError(f"{where}.arm {spec['arm']!r} is not in arms")
        if not isinstance(spec["grid"], list) or not spec["grid"]:
            raise PlanError(f"{where}.grid must be a non-empty list of settings")
        for setting in spec["grid"]:
            _check_settings({**plan["settings"], **part["options"], **setting}, f"{where}.grid")
        sizes.add(len(spec["grid"]))
    if len(sizes) > 1:
        raise PlanError(f"scenarios.{name}.tuning: every family needs the same number of settings (equal "
                        f"tuning effort); the grids have {sorted(sizes)}")


def check_plan(plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` with its defaults, checked; raises :class:`PlanError` naming the first bad key."""
    if not isinstance(plan, dict):
        raise PlanError("a plan is a mapping of keys (regime, settings, scenarios, seeds, ...)")
    unknown = sorted(set(plan) - set(REQUIRED) - set(OPTIONAL) - set(EXTRA) - {"tokens"})
    if unknown:
        raise PlanError(f"unknown key {unknown[0]!r}; a plan has {', '.join((*REQUIRED, *OPTIONAL, *EXTRA))}")
    missing = [key for key in REQUIRED if key not in plan]
    if missing:
        raise PlanError(f"missing key {missing[0]!r}")
    plan = {**copy.deepcopy(OPTIONAL), **plan}
    check_shapes(plan)
    if not isinstance(plan["regime"], str) or not plan["regime"]:
        raise PlanError("regime must be a name (reports and tables use it)")
    _check_settings(plan["settings"], "settings")
    if not isinstance(plan["arms"], dict) or not all(isinstance(a, dict) for a in plan["arms"].values()):
        raise PlanError("arms must map arm names to their settings (\"\": {} for no replay arm)")
    for arm, fields in plan["arms"].items():
        _check_settings({**plan["settings"], **fields}, f"arms.{arm or '<no arm>'}")
    _seeds(plan["val_seeds"], "val_seeds", 0 if _untuned(plan) else 2)
    tests = any(isinstance(part, dict) and part.get("test") for part in plan["scenarios"].values()) if isinstance(
        plan["scenarios"], dict) else True
    _seeds(plan["test_seeds"], "test_seeds", 2 if tests else 0)  # a plan that only tunes has no test seeds
    overlap = sorted(set(plan["val_seeds"]) & set(plan["test_seeds"]))
    if overlap:
        raise PlanError(f"test_seeds and val_seeds share {overlap}: settings chosen on a seed are not tested on it")
    if not isinstance(plan["scenarios"], dict) or not plan["scenarios"]:
        raise PlanError("scenarios must map at least one scenario to its options, tuning and test")
    for name, part in plan["scenarios"].items():
        _check_scenario(name, part, plan)
    if plan.get("first_experience", "own") not in FIRST_EXPERIENCE:
        raise PlanError(f"first_experience must be one of {', '.join(FIRST_EXPERIENCE)}")
    from cl_streamkl.experiment.study.comparisons import check_comparisons

    check_comparisons(plan)
    _check_units(plan)
    plan["tokens"] = tokens(plan["settings"])
    return plan


def _check_units(plan: dict[str, Any]) -> None:
    """Resolve every distinct unit's configuration as its run would (ranges, combinations, the
    model's name), so that a bad value fails here, not in a worker after hours of other units.
    Test units are checked with each family's first validation setting standing for its choice."""
    from cl_streamkl.experiment.config import ExperimentConfig

    for name, part in plan["scenarios"].items():
        chosen = part.get("chosen_from", {}).get("chosen") or {
            family: spec["grid"][0] for family, spec in part["tuning"].items()}
        units = tuning_units(plan, name) + test_units(plan, name, chosen)
        for unit in {(u.strategy, u.arm, u.overrides): u for u in units}.values():
            try:
                ExperimentConfig.from_dict({**unit.config_fields(plan), "device": "cpu"}).resolved()
            except (TypeError, ValueError) as err:
                raise PlanError(f"scenarios.{name}: {unit.label} ({unit.part}): {err}") from None


def _untuned(plan: dict[str, Any]) -> bool:
    return all(not part.get("tuning") for part in plan["scenarios"].values()) if isinstance(
        plan.get("scenarios"), dict) else False


def chosen_from_report(plan: dict[str, Any], report: dict[str, Any], source: str) -> dict[str, Any]:
    """``plan`` with every scenario's tuning replaced by the settings ``report`` chose for it.

    Raises:
        PlanError: the report is no study report, its settings were chosen on seeds ``plan``
            tests on, or its tuning of a scenario is unfinished.
    """
    check_settings_source(plan, report, source)
    plan = copy.deepcopy(plan)
    for name, part in plan.get("scenarios", {}).items():
        chosen = report["scenarios"].get(name, {}).get("chosen")
        if chosen is None:
            raise PlanError(f"settings_from {source}: the report's tuning of {name} is not finished")
        part["tuning"] = {}
        part["chosen_from"] = {"plan": report["plan_fingerprint"], "chosen": chosen}
    return plan


def chosen_from_reports(plan: dict[str, Any], reports: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """``plan`` with every scenario's tuning replaced by the settings several reports chose, in order.

    Per scenario, each report that has it gives its chosen settings; a later report's family
    replaces an earlier one's of the same name (a family tuned again, e.g. LwF on top of replay),
    and a family it does not tune keeps the earlier choice. ``chosen_from`` names every report's
    plan fingerprint, in order.

    Args:
        reports: (path as the plan names it, the report) pairs, earliest first.

    Raises:
        PlanError: a report is no study report, has a scenario's tuning unfinished, no report has
            a scenario of the plan, or two remaining families set the same field.
    """
    for source, report in reports:
        check_settings_source(plan, report, source)
    plan = copy.deepcopy(plan)
    for name, part in plan["scenarios"].items():
        chosen: dict[str, Any] = {}
        for source, report in reports:
            if name not in report["scenarios"]:
                continue
            if report["scenarios"][name].get("chosen") is None:
                raise PlanError(f"settings_from {source}: the report's tuning of {name} is not finished")
            chosen.update(report["scenarios"][name]["chosen"])
        if not chosen:
            raise PlanError(f"settings_from: no report has scenario {name}")
        fields: dict[str, str] = {}
        for family, setting in chosen.items():
            for field in setting:
                if field in fields:
                    raise PlanError(f"settings_from: families {fields[field]} and {family} of scenario {name} both "
                                    f"set {field}")
                fields[field] = family
        part["tuning"] = {}
        part["chosen_from"] = {"plan": [report["plan_fingerprint"] for _, report in reports], "chosen": chosen}
    return plan


def load_plan(path: str | Path) -> dict[str, Any]:
    """The checked plan of a plan file (YAML or TOML; ``settings_from`` read relative to the file).

    Raises:
        PlanError: the file is unreadable, not a plan, or a key's value is refused; one line.
    """
    path = Path(path)
    try:
        data = read_mapping(path)
    except ValueError as err:
        raise PlanError(str(err)) from None
    try:
        source = data.pop("settings_from", None) if isinstance(data, dict) else None
        if source is not None:
            sources = source if isinstance(source, list) else [source]
            if not sources or not all(isinstance(s, str) for s in sources):
                raise PlanError("settings_from must be the path of a study report, or a list of them")
            reports = [(s, _read_report(path.parent / s, s)) for s in sources]
            check_shapes(data)
            for part in data.get("scenarios", {}).values():
                part.setdefault("tuning", {})
            # One path keeps its original form, so the plans registered with it keep their fingerprints.
            data = (chosen_from_report(data, reports[0][1], source) if isinstance(source, str)
                    else chosen_from_reports(data, reports))
        return check_plan(data)
    except PlanError as err:
        raise PlanError(f"{path}: {err}") from None


def _read_report(path: Path, source: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise PlanError(f"settings_from {source}: cannot read a JSON report ({err})") from None


def fingerprint(plan: dict[str, Any]) -> str:
    """The first 16 hex digits of the SHA-256 of the plan's canonical JSON."""
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Unit:
    """One run: a strategy on one seed of one scenario, with its configuration overrides.

    ``overrides`` are (field, value) pairs, sorted, that the plan's settings and scenario
    options do not set: the setting being tuned, or every family's chosen setting, and the
    replay arm. Part ``first`` is a scenario's first experience on one seed, trained once
    and shared by every test unit of that seed (plans with ``first_experience: shared``).
    """

    part: str
    scenario: str
    arm: str
    strategy: str
    seed: int
    overrides: tuple[tuple[str, Any], ...]

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> Unit:
        """The unit a finished unit's record names (its ``"unit"``, read back from JSON)."""
        return cls(**{**data, "overrides": tuple(tuple(pair) for pair in data["overrides"])})

    @property
    def label(self) -> str:
        """The strategy as the tables name it: ``replay+streamkl (mem200)``."""
        return f"{self.strategy} ({self.arm})" if self.arm else self.strategy

    @property
    def name(self) -> str:
        """A file name, unique per unit: part, scenario, arm, strategy, seed and a hash of the overrides."""
        digest = hashlib.sha256(json.dumps(self.overrides).encode()).hexdigest()[:8]
        return f"{self.part}-{self.scenario}-{self.arm or 'base'}-{self.strategy}-seed{self.seed}-{digest}"

    def config_fields(self, plan: dict[str, Any]) -> dict[str, Any]:
        """Every ExperimentConfig field this unit sets (without device and folder)."""
        return {**plan["settings"], **plan["scenarios"][self.scenario]["options"], "scenario": self.scenario,
                "strategies": [self.strategy], "seeds": [self.seed], "pad_variant": plan["pad_variant"],
                "eval_split": "val" if self.part == "tune" else "test", **dict(self.overrides)}


def shares_first_experience(plan: dict[str, Any]) -> bool:
    """Whether the plan's test units start from one first experience per (scenario, seed)."""
    return plan.get("first_experience") == "shared"


def first_unit(unit: Unit) -> Unit:
    """The unit that trains ``unit``'s shared first experience: naive, no arm, no overrides."""
    return Unit("first", unit.scenario, "", "naive", unit.seed, ())


def experience_weights(unit: Unit, plan: dict[str, Any]) -> list[float]:
    """Each experience's expected training time as a fraction of one pass over all classes' data.

    Class and task scenarios: the first experience's classes over all classes, then the rest
    split evenly; domain: every experience the same. An experience that replays trains on the
    replayed images too (``mem_batch_size`` more per batch, from the second experience on). A
    ``first`` unit trains the first experience only.
    """
    from cl_streamkl.experiment.config import ExperimentConfig

    fields = {**dataclasses.asdict(ExperimentConfig()), **unit.config_fields(plan)}
    count = fields["experiences"]
    # Datasets whose classes are counted only once loaded (imagefolder): experiences count alike.
    classes, first = DATASETS[fields["dataset"]].num_classes, fields["first_experience_classes"]
    if fields["scenario"] == "domain" or classes is None or first is None:
        shares = [1.0 / count] * count
    else:
        shares = [first / classes] + [(classes - first) / classes / (count - 1)] * (count - 1)
    replayed = fields.get("mem_batch_size", 0) if "replay" in unit.strategy.split("+") else 0
    weights = [share * (1.0 if i == 0 else 1.0 + replayed / fields["batch_size"]) for i, share in enumerate(shares)]
    return weights[:1] if unit.part == "first" else weights


def _overrides(*parts: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    return tuple(sorted(merged.items()))


def tuning_units(plan: dict[str, Any], scenario: str) -> list[Unit]:
    """Every (family, setting, validation seed) of a scenario."""
    units = []
    if scenario not in plan["scenarios"]:
        return units
    for family in plan["scenarios"][scenario]["tuning"].values():
        for setting in family["grid"]:
            units += [Unit("tune", scenario, family["arm"], family["strategy"], seed,
                           _overrides(plan["arms"][family["arm"]], setting)) for seed in plan["val_seeds"]]
    return units


def test_units(plan: dict[str, Any], scenario: str, chosen: dict[str, dict[str, Any]]) -> list[Unit]:
    """Every (arm, strategy, test seed) of a scenario, with every family's chosen setting."""
    units = []
    for arm, strategies in plan["scenarios"][scenario]["test"].items():
        overrides = _overrides(*chosen.values(), plan["arms"][arm])
        units += [Unit("test", scenario, arm, strategy, seed, overrides)
                  for strategy in strategies for seed in plan["test_seeds"]]
    return units


def chosen_test_units(plan: dict[str, Any], scenario: str, scores: dict[Unit, float]) -> list[Unit] | None:
    """:func:`test_units` with the settings :func:`choose` picks from ``scores``; None while tuning is unfinished."""
    tables, complete = choose(plan, scenario, scores)
    return test_units(plan, scenario, {name: t["chosen"] for name, t in tables.items()}) if complete else None


def first_units(plan: dict[str, Any], units: Sequence[Unit]) -> list[Unit]:
    """The shared first experiences ``units`` start from (none unless the plan shares them)."""
    if not shares_first_experience(plan):
        return []
    return list(dict.fromkeys(first_unit(unit) for unit in units if unit.part == "test"))


def choose(plan: dict[str, Any], scenario: str, scores: dict[Unit, float]) -> tuple[dict[str, Any], bool]:
    """Per family: the validation table and its chosen setting (see :data:`SELECTION`).

    Args:
        scores: validation mean_experience_accuracy (percent) of the finished tuning units.

    Returns:
        ``({family: {"rows": [{"setting", "per_seed", "mean"}], "chosen": setting or None}}, complete)``;
        ``chosen`` is None until every unit of the family has finished. A scenario whose
        settings come from another report has the chosen settings only (``rows`` empty).
    """
    if "chosen_from" in plan["scenarios"][scenario]:
        chosen = plan["scenarios"][scenario]["chosen_from"]["chosen"]
        return {family: {"strategy": None, "rows": [], "chosen": setting} for family, setting in chosen.items()}, True
    by_key = {(u.strategy, u.arm, u.overrides, u.seed): score for u, score in scores.items()
              if u.part == "tune" and u.scenario == scenario}
    tables, complete = {}, True
    for name, family in plan["scenarios"][scenario]["tuning"].items():
        rows = []
        for setting in family["grid"]:
            overrides = _overrides(plan["arms"][family["arm"]], setting)
            per_seed = {seed: by_key.get((family["strategy"], family["arm"], overrides, seed))
                        for seed in plan["val_seeds"]}
            done = [v for v in per_seed.values() if v is not None]
            rows.append({"setting": setting, "per_seed": {str(k): v for k, v in per_seed.items()},
                         "mean": sum(done) / len(done) if len(done) == len(per_seed) else None})
        finished = all(row["mean"] is not None for row in rows)
        complete &= finished
        best = max(range(len(rows)), key=lambda i: (rows[i]["mean"], -i)) if finished else None
        tables[name] = {"strategy": family["strategy"], "rows": rows,
                        "chosen": None if best is None else rows[best]["setting"]}
    return tables, complete
