"""How long a study's units take: seconds per unit of experience weight, per kind of unit.

A unit's experiences are judged by the rate of their :func:`rate_key` among the finished units
(and the experiences a worker measured itself), or by :func:`estimate`'s guess from the kinds
that share most of its components; :mod:`~cl_streamkl.experiment.study.units` starts an
experience only when it would end before a start's deadline.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cl_streamkl.experiment.study.plan import Unit, experience_weights

# The strategy part of the rate key of every unit's first experience.
FIRST = "first experience"
# Seconds per unit of experience weight (:func:`~cl_streamkl.experiment.study.plan.experience_weights`: one pass over all
# classes' data) this worker has measured at most per rate key (:func:`rate_key`: a unit's
# first experience, or its later ones, per kind of unit) in its own experiences; a unit starting
# also reads the finished units' rates from disk (:func:`known_rates`), so a worker knows what
# the others finished since the start began. A running unit stops after an experience when the
# next would pass the deadline, so a time-limited start ends between experiences, every one of
# them checkpointed. Per kind, because kinds differ two-fold (a domain StreamKL unit against a
# task LwF one): one rate for all would let a start's last minutes, which fit a cheap unit, go
# unused. First experiences apart, because they have no earlier model: no teacher, no penalty,
# no replayed images; at 1025 tokens an LwF unit's first experience took as long as naive's per
# image and its later ones seven times naive's later ones (medians; its teacher forwards run in
# float32). A key not measured yet is judged by a guess (:func:`estimate`) that its first
# measured experience replaces.
_seconds_per_weight: dict[tuple[str, str, str], float] = {}


def _progress_path(root: str, unit: Unit) -> Path:
    """How many experiences an unfinished unit has checkpointed, beside its run folder (archived with it)."""
    return Path(root) / "runs" / f"{unit.name}.trained"


def _trained(root: str, unit: Unit) -> int:
    """How many experiences ``unit`` has checkpointed under ``root`` (0: none, or its run folder is gone)."""
    progress = _progress_path(root, unit)
    return int(progress.read_text()) if (Path(root) / "runs" / unit.name).exists() and progress.is_file() else 0


def finished_records(root: Path) -> dict[str, dict[str, Any]]:
    """Every finished unit's record under ``root/units``, by unit name.

    Raises:
        StudyFileError: a record is not JSON (one line naming it).
    """
    from cl_streamkl.experiment.study.files import read_json

    return {path.stem: read_json(path, "--out's record") for path in sorted((root / "units").glob("*.json"))}


def unit_kind(unit: Unit) -> tuple[str, str, str]:
    """What a unit's cost depends on besides its data: (scenario, replay arm, strategy)."""
    return unit.scenario, unit.arm, unit.strategy


def rate_key(unit: Unit, index: int) -> tuple[str, str, str]:
    """What experience ``index`` (from 0) of ``unit`` costs like: its :func:`unit_kind` after the
    first; the first, with no earlier model, like every first experience of its scenario and arm."""
    return (unit.scenario, unit.arm, FIRST) if index == 0 else unit_kind(unit)


def seconds_per_weight_of(records: Iterable[dict[str, Any]], plan: dict[str, Any]) -> dict[tuple[str, str, str], float]:
    """Per :func:`rate_key`, the most seconds per unit of experience weight a finished unit of ``plan`` took.

    From each record's experience times (``experience_s``: those of the start that finished it,
    the first one compiling); a record without them counts its whole time at one rate for all
    its experiences.
    """
    rates: dict[tuple[str, str, str], float] = {}
    for record in records:
        unit = Unit.from_record(record["unit"])
        if unit.scenario not in plan["scenarios"]:
            continue
        weights = experience_weights(unit, plan)
        timed = record.get("experience_s") or [[number + 1, record["wall_time_s"] * weight / sum(weights)]
                                               for number, weight in enumerate(weights)]
        spent: dict[tuple[str, str, str], list[float]] = {}
        for number, seconds in timed:
            totals = spent.setdefault(rate_key(unit, number - 1), [0.0, 0.0])
            totals[0], totals[1] = totals[0] + seconds, totals[1] + weights[number - 1]
        for key, (seconds, weight) in spent.items():
            rates[key] = max(seconds / weight, rates.get(key, 0.0))
    return rates


def known_rates(root: str, plan: dict[str, Any]) -> dict[tuple[str, str, str], float]:
    """Per :func:`rate_key`, the most seconds per weight that a finished unit under ``root``
    took or that this worker measured in one experience."""
    rates = seconds_per_weight_of(finished_records(Path(root)).values(), plan)
    for key, rate in _seconds_per_weight.items():
        rates[key] = max(rate, rates.get(key, 0.0))
    return rates


def reference_rates(report: dict[str, Any] | None) -> dict[tuple[str, str, str], float]:
    """:func:`seconds_per_weight_of` the test part of another regime's report (how the costly
    regimes' units run); empty without one, or without records."""
    if report is None or "plan" not in report:
        return {}
    return seconds_per_weight_of([record for record in report.get("records", {}).values()
                                  if record["unit"]["part"] == "test"], report["plan"])


def estimate(key: tuple[str, str, str], rates: dict[tuple[str, str, str], float],
             reference: dict[tuple[str, str, str], float] | None = None) -> float:
    """Seconds per weight of experiences of :func:`rate_key` ``key``: its rate; else a guess from
    the keys of its scenario that have one, first experiences from first experiences if any
    (kinds differ less within a scenario than across: at 1025 tokens a domain EWC unit took
    twice a class one), else from any key (0 when nothing was measured).

    Of those keys, the ones whose strategies share the most components with ``key``'s
    (``lwf`` for ``lwf+pad``) serve, when any shares one. The guess scales each serving key's
    rate by how much slower ``key`` was than it in ``reference`` (another regime's rates,
    :func:`reference_rates`) and takes the largest; with no reference for the pair, the slowest
    serving key's rate. Why the scaling: at 4097 tokens only the naive units had finished when
    the teacher-bearing kinds began, and naive's rate guessed them at a fraction of what they
    take. Why the nearest kinds: a ratio to naive carries every cost a kind shares with its
    components, also one that changed between the regimes: LwF's penalty ran in float32 at 1025
    tokens and in bf16 at 4097, where ``lwf`` took 2.4 times naive's time a weight, yet
    ``lwf+pad`` was guessed from naive at 8 times (from ``lwf``, 1.03 times ``lwf``'s).
    """
    if key in rates:
        return rates[key]
    scenario = {other: rate for other, rate in rates.items() if other[0] == key[0]} or rates
    alike = {other: rate for other, rate in scenario.items() if (other[2] == FIRST) == (key[2] == FIRST)} or scenario
    shared = {other: len(_components(other) & _components(key)) for other in alike}
    nearest = {other: rate for other, rate in alike.items() if shared[other] == max(shared.values())}
    reference = reference or {}
    return max((rate * reference[key] / reference[other] if reference.get(key) and reference.get(other) else rate
                for other, rate in nearest.items()), default=0.0)


def _components(key: tuple[str, str, str]) -> set[str]:
    """The strategy components of a :func:`rate_key` (none for a first experience)."""
    return set() if key[2] == FIRST else set(key[2].split("+"))


def seconds_left(units: Iterable[Unit], plan: dict[str, Any], root: Path,
                 reference: dict[tuple[str, str, str], float] | None = None) -> tuple[int, float | None]:
    """How many of ``units`` are unfinished, and the seconds of one worker they still need at the
    slowest rates finished units took, keys not measured yet guessed (:func:`estimate` with
    ``reference``; checkpointed experiences count as done); None when no unit of ``plan`` has
    finished, so there is no rate to go by."""
    records = finished_records(root)
    rates = seconds_per_weight_of(records.values(), plan)
    left = [unit for unit in units if unit.name not in records]
    if not rates:
        return len(left), None
    total = 0.0
    for unit in left:
        weights = experience_weights(unit, plan)
        total += sum(estimate(rate_key(unit, index), rates, reference) * weights[index]
                     for index in range(_trained(str(root), unit), len(weights)))
    return len(left), total
