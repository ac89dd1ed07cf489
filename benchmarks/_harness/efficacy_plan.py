"""The efficacy study's plan: regimes, scenarios, tuning grids, seeds, and the units they make.

A plan is plain JSON written before any run starts; its fingerprint (a hash of that JSON)
ties every later part of the study to it, so the grid and the seeds cannot change after a
test run. Every method family gets the same number of validation settings
(:data:`SETTINGS_PER_METHOD`), each tuned on its own strategy; a combination such as
``lwf+streamkl`` uses each component's chosen setting.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

SCENARIOS = ("class", "task", "domain")
PARTS = ("tune", "test")
SETTINGS_PER_METHOD = 4
# The published comparator: asymmetric PAD (pooled along height), used with LwF.
PAD_VARIANT = "asymmetric"

# 17 tokens on a CPU; 1025 and 4097 information-bearing tokens (digits at native scale on a
# cluttered canvas, early convolutions) on a GPU with bf16 autocast. At 4097 tokens the canvas
# has four times the area and as many clutter pieces per pixel.
REGIMES: dict[str, dict[str, Any]] = {
    "short": {"dataset": "mnist5k", "image_size": 32, "patch_size": 8, "epochs": 10, "batch_size": 32,
              "amp": "none"},
    "long": {"dataset": "cluttered-mnist", "canvas": 128, "clutter": 4, "clutter_size": 8, "image_size": 128,
             "patch_size": 4, "stem": "conv", "epochs": 30, "lr_schedule": "cosine", "batch_size": 32,
             "amp": "bf16"},
    "long4097": {"dataset": "cluttered-mnist", "canvas": 256, "clutter": 16, "clutter_size": 8, "image_size": 256,
                 "patch_size": 4, "stem": "conv", "epochs": 30, "lr_schedule": "cosine", "batch_size": 32,
                 "amp": "bf16"},
}
# Class and task: 6 classes first (the teacher's attention has seen more than two), then 2 + 2.
# Domain: four rotations 45 degrees apart, every class in each.
SCENARIO_OPTIONS: dict[str, dict[str, Any]] = {
    "class": {"experiences": 3, "first_experience_classes": 6},
    "task": {"experiences": 3, "first_experience_classes": 6},
    "domain": {"experiences": 4, "domain_shift": "rotate", "rotation_step": 45.0},
}
# Replay at a fixed memory: 200 images in all, or 20 of every class seen (class scenario).
ARMS: dict[str, dict[str, Any]] = {
    "": {},
    "mem200": {"mem_size": 200, "mem_per_class": 0},
    "mem20pc": {"mem_per_class": 20},
}
# Per method family: the strategy it is tuned on, its replay arm, and its validation settings
# (configuration fields), all the same length.
GRIDS: dict[str, dict[str, Any]] = {
    "lwf": {"strategy": "lwf", "arm": "", "grid": [
        {"lwf_alpha": 1.0, "lwf_temperature": 2.0}, {"lwf_alpha": 4.0, "lwf_temperature": 2.0},
        {"lwf_alpha": 16.0, "lwf_temperature": 2.0}, {"lwf_alpha": 4.0, "lwf_temperature": 1.0}]},
    "ewc": {"strategy": "ewc", "arm": "", "grid": [
        {"ewc_lambda": 10.0}, {"ewc_lambda": 100.0}, {"ewc_lambda": 1000.0}, {"ewc_lambda": 10000.0}]},
    "pad": {"strategy": "pad", "arm": "", "grid": [
        {"pad_alpha": 0.1}, {"pad_alpha": 1.0}, {"pad_alpha": 10.0}, {"pad_alpha": 100.0}]},
    "streamkl": {"strategy": "streamkl", "arm": "", "grid": [
        {"alpha": 10.0, "temperature": 0.5, "layers": "all"}, {"alpha": 1.0, "temperature": 1.0, "layers": "all"},
        {"alpha": 100.0, "temperature": 1.0, "layers": "all"}, {"alpha": 10.0, "temperature": 1.0, "layers": 1}]},
    "replay": {"strategy": "replay", "arm": "mem200", "grid": [
        {"mem_batch_size": 8}, {"mem_batch_size": 16}, {"mem_batch_size": 32}, {"mem_batch_size": 64}]},
}
# Families tuned per scenario, and the strategies tested per replay arm.
_CORE = ("naive", "lwf", "streamkl", "pad", "lwf+streamkl", "lwf+pad", "ewc", "ewc+streamkl")
_REPLAY = ("replay", "replay+streamkl", "replay+pad")
TUNED: dict[str, tuple[str, ...]] = {
    "class": ("lwf", "ewc", "pad", "streamkl", "replay"),
    "task": ("lwf", "ewc", "pad", "streamkl"),
    "domain": ("lwf", "ewc", "pad", "streamkl"),
}
TESTED: dict[str, dict[str, tuple[str, ...]]] = {
    "class": {"": _CORE, "mem200": _REPLAY, "mem20pc": _REPLAY},
    "task": {"": _CORE},
    "domain": {"": _CORE},
}
SELECTION = ("per family and scenario, the setting with the highest mean over the validation seeds of "
             "mean_experience_accuracy on the validation split; ties: the first in grid order")
DEFAULT_SEEDS = {"short": ([100, 101], list(range(200, 208))), "long": ([100, 101], list(range(200, 208))),
                 "long4097": ([100, 101], list(range(200, 205)))}


# Every regime's dataset (mnist5k, cluttered MNIST, digits) has ten classes.
CLASSES = 10


def experience_weights(unit: Unit, plan: dict[str, Any]) -> list[float]:
    """Each experience's expected training time as a fraction of one pass over all classes' data.

    Class and task scenarios: the first experience's classes over all classes, then the rest
    split evenly; domain: every experience the same. An experience that replays trains on the
    replayed images too (``mem_batch_size`` more per batch, from the second experience on).
    """
    fields = unit.config_fields(plan)
    count = fields["experiences"]
    if fields["scenario"] == "domain":
        shares = [1.0 / count] * count
    else:
        first = fields["first_experience_classes"]
        shares = [first / CLASSES] + [(CLASSES - first) / CLASSES / (count - 1)] * (count - 1)
    replayed = fields.get("mem_batch_size", 0) if "replay" in unit.strategy.split("+") else 0
    return [share * (1.0 if i == 0 else 1.0 + replayed / fields["batch_size"]) for i, share in enumerate(shares)]


def tokens(settings: dict[str, Any]) -> int:
    """Tokens per image: (image / patch)² patches and the class token."""
    return (settings["image_size"] // settings["patch_size"]) ** 2 + 1


def make_plan(regime: str, val_seeds: list[int], test_seeds: list[int], epochs: int | None = None,
              settings_per_method: int = SETTINGS_PER_METHOD, strategies: list[str] | None = None,
              settings_from: dict[str, Any] | None = None,
              scenarios: Sequence[str] | None = None) -> dict[str, Any]:
    """The whole study as JSON: regime, seeds, every scenario's grids and tested strategies.

    Args:
        regime: a key of :data:`REGIMES`.
        val_seeds, test_seeds: the seeds of tuning and of the test runs.
        epochs: replaces the regime's epochs (a quick check).
        settings_per_method: the first this many settings of every grid (a quick check).
        strategies: test only these strategies (the decisive comparisons of a costly regime).
        settings_from: another regime's report; its chosen settings replace tuning in every
            scenario where it finished tuning (the others are left out of the plan).
        scenarios: only these scenarios (a costly regime runs the scenario where a cheaper one
            showed the effect); all of :data:`SCENARIOS` by default.

    Raises:
        ValueError: a scenario named in ``scenarios`` has no chosen settings in ``settings_from``.
    """
    settings = dict(REGIMES[regime])
    if epochs is not None:
        settings["epochs"] = epochs
    if settings_from is not None:
        unfinished = [name for name in scenarios or () if settings_from["scenarios"][name]["chosen"] is None]
        if unfinished:
            raise ValueError(f"the report's tuning of {', '.join(unfinished)} is not finished")
    parts = {}
    for scenario in SCENARIOS:
        if scenarios is not None and scenario not in scenarios:
            continue
        tested = {arm: [name for name in names if strategies is None or name in strategies]
                  for arm, names in TESTED[scenario].items()}
        part: dict[str, Any] = {"options": SCENARIO_OPTIONS[scenario],
                                "test": {arm: names for arm, names in tested.items() if names}}
        if settings_from is None:
            part["tuning"] = {family: {**copy.deepcopy(GRIDS[family]), "grid": copy.deepcopy(GRIDS[family]["grid"])
                                       [:settings_per_method]} for family in TUNED[scenario]}
        elif settings_from["scenarios"][scenario]["chosen"] is not None:
            part["tuning"] = {}
            part["chosen_from"] = {"plan": settings_from["plan_fingerprint"],
                                   "chosen": settings_from["scenarios"][scenario]["chosen"]}
        else:
            continue
        parts[scenario] = part
    return {"regime": regime, "settings": settings, "tokens": tokens(settings), "pad_variant": PAD_VARIANT,
            "arms": ARMS, "val_seeds": list(val_seeds), "test_seeds": list(test_seeds), "selection": SELECTION,
            "scenarios": parts}


def fingerprint(plan: dict[str, Any]) -> str:
    """The first 16 hex digits of the SHA-256 of the plan's canonical JSON."""
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Unit:
    """One run: a strategy on one seed of one scenario, with its configuration overrides.

    ``overrides`` are (field, value) pairs, sorted, that the plan's regime and scenario
    options do not set: the setting being tuned, or every family's chosen setting, and the
    replay arm.
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
