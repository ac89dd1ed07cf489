"""How long a study's units take: rates per kind of unit, guesses for kinds not measured yet, seconds left."""

from __future__ import annotations

import dataclasses
import json

import pytest
from study_helpers import short_plan

from cl_streamkl.experiment.study import rates as study_rates
from cl_streamkl.experiment.study.plan import tuning_units
from cl_streamkl.experiment.study.rates import (
    FIRST,
    estimate,
    finished_records,
    known_rates,
    rate_key,
    reference_rates,
    seconds_left,
    seconds_per_weight_of,
    unit_kind,
)


def test_each_kind_of_unit_is_judged_by_its_own_rate():
    """A slow kind's rate does not keep a cheap kind from starting; a kind never seen is guessed
    by its scenario's slowest kind, or any scenario's when its own has none."""
    plan = short_plan()
    lwf, streamkl = (next(u for u in tuning_units(plan, "task") if u.strategy == name) for name in ("lwf", "streamkl"))
    domain = tuning_units(plan, "domain")
    records = [{"unit": dataclasses.asdict(unit), "wall_time_s": seconds}
               for unit, seconds in ((lwf, 300.0), (streamkl, 100.0), (domain[0], 800.0))]
    rates = seconds_per_weight_of(records, plan)
    key = unit_kind
    assert estimate(key(streamkl), rates) == pytest.approx(100.0)  # the task weights sum to 1
    assert estimate(key(lwf), rates) == pytest.approx(300.0)
    ewc = next(u for u in tuning_units(plan, "task") if u.strategy == "ewc")
    assert estimate(key(ewc), rates) == pytest.approx(300.0)  # not the domain kind's 800
    other_domain = next(u for u in domain if key(u) != key(domain[0]))
    assert estimate(key(other_domain), rates) == pytest.approx(800.0)
    class_unit = tuning_units(plan, "class")[0]
    assert estimate(key(class_unit), rates) == pytest.approx(800.0)
    assert estimate(key(ewc), {}) == 0.0
    # With another regime's rates, a guess keeps the kinds' ratio there: lwf took three times streamkl.
    only_streamkl = {key(streamkl): 50.0}
    reference = {key(lwf): 300.0, key(streamkl): 100.0}
    assert estimate(key(lwf), only_streamkl) == pytest.approx(50.0)
    assert estimate(key(lwf), only_streamkl, reference) == pytest.approx(150.0)
    assert estimate(key(ewc), only_streamkl, reference) == pytest.approx(50.0)  # not in it
    # A combination is guessed from the kinds it shares components with, scaled by the reference:
    # lwf+pad from lwf (1.2 times it there), not from naive, whose ratio carries LwF's old cost.
    lwf_pad, naive = (dataclasses.replace(lwf, strategy=name) for name in ("lwf+pad", "naive"))
    here = {key(naive): 100.0, key(lwf): 150.0}
    reference = {key(naive): 50.0, key(lwf): 400.0, key(lwf_pad): 480.0}
    assert estimate(key(lwf_pad), here, reference) == pytest.approx(180.0)
    assert estimate(key(lwf_pad), {key(naive): 100.0}, reference) == pytest.approx(960.0)


def test_first_experiences_are_timed_apart_from_the_later_ones():
    """A first experience has no earlier model (no teacher, no penalty): it is timed with every first
    experience of its scenario and arm, the later ones per kind; a kind's later experiences are
    guessed from later ones, first experiences from first ones."""
    plan = short_plan()
    lwf = next(u for u in tuning_units(plan, "task") if u.strategy == "lwf")
    naive = dataclasses.replace(lwf, strategy="naive")
    first = rate_key(naive, 0)
    assert first == rate_key(lwf, 0) == ("task", "", FIRST) and rate_key(lwf, 1) == unit_kind(lwf)
    # Weights 0.6, 0.2, 0.2: LwF's first experience 60 s (100 s a weight), the others 100 s each (500).
    records = [{"unit": dataclasses.asdict(lwf), "wall_time_s": 260.0,
                "experience_s": [[1, 60.0], [2, 100.0], [3, 100.0]]},
               {"unit": dataclasses.asdict(naive), "wall_time_s": 100.0}]  # no times: one rate, 100 s a weight
    rates = seconds_per_weight_of(records, plan)
    assert rates == pytest.approx({first: 100.0, unit_kind(lwf): 500.0, unit_kind(naive): 100.0})
    # Only naive measured here; at another length LwF's later experiences took five times naive's.
    reference = {first: 50.0, unit_kind(naive): 50.0, unit_kind(lwf): 250.0}
    here = {first: 200.0, unit_kind(naive): 200.0}
    assert estimate(rate_key(lwf, 1), here, reference) == pytest.approx(1000.0)
    # A first experience is guessed from first experiences (another arm's), not from a slower later kind.
    class_rates = {("class", "", FIRST): 30.0, ("class", "mem200", "replay"): 900.0}
    assert estimate(("class", "mem200", FIRST), class_rates) == pytest.approx(30.0)


def test_a_shared_first_experience_counts_only_the_experiences_a_unit_trains():
    """A test unit that starts from a shared first experience records experiences 2..T only: they
    time its later experiences, and the first unit's one experience times the first ones."""
    plan = short_plan()
    lwf = next(u for u in tuning_units(plan, "task") if u.strategy == "lwf")
    tested = dataclasses.replace(lwf, part="test")
    first = dataclasses.replace(lwf, part="first", strategy="naive", overrides=())
    records = [{"unit": dataclasses.asdict(tested), "wall_time_s": 50.0, "experience_s": [[2, 20.0], [3, 30.0]]},
               {"unit": dataclasses.asdict(first), "wall_time_s": 30.0, "experience_s": [[1, 30.0]]}]
    assert seconds_per_weight_of(records, plan) == pytest.approx({("task", "", FIRST): 50.0,
                                                                  unit_kind(tested): 125.0})  # 50 s over 0.4


def test_rates_come_from_the_finished_records_and_this_workers_own(tmp_path, monkeypatch):
    plan = short_plan()
    unit, other = tuning_units(plan, "task")[:2]
    assert finished_records(tmp_path) == {} and known_rates(str(tmp_path), plan) == {}
    (tmp_path / "units").mkdir()
    (tmp_path / "units" / f"{unit.name}.json").write_text(json.dumps(
        {"unit": dataclasses.asdict(unit), "wall_time_s": 100.0}))
    # A unit of a scenario the plan leaves out does not count.
    foreign = {"unit": {**dataclasses.asdict(unit), "scenario": "domain", "seed": 5}, "wall_time_s": 1e6}
    cut = {**plan, "scenarios": {"task": plan["scenarios"]["task"]}}
    (tmp_path / "units" / "foreign.json").write_text(json.dumps(foreign))
    assert set(finished_records(tmp_path)) == {unit.name, "foreign"}
    assert max(seconds_per_weight_of(finished_records(tmp_path).values(), cut).values()) == pytest.approx(100.0)
    monkeypatch.setattr(study_rates, "_seconds_per_weight", {unit_kind(other): 400.0, rate_key(unit, 0): 1.0})
    rates = known_rates(str(tmp_path), cut)
    assert rates[unit_kind(other)] == 400.0 and rates[rate_key(unit, 0)] == pytest.approx(100.0)  # the larger


def test_reference_rates_read_another_regimes_test_units():
    plan = short_plan()
    tune, test = tuning_units(plan, "task")[0], dataclasses.replace(tuning_units(plan, "task")[0], part="test")
    report = {"plan": plan, "records": {
        "a": {"unit": dataclasses.asdict(tune), "wall_time_s": 900.0},
        "b": {"unit": dataclasses.asdict(test), "wall_time_s": 100.0}}}
    assert reference_rates(report) == pytest.approx({rate_key(test, 0): 100.0, unit_kind(test): 100.0})
    assert reference_rates(None) == {} and reference_rates({"records": {}}) == {}


def test_seconds_left_go_by_the_finished_units_rates_and_the_checkpoints(tmp_path):
    plan = short_plan()
    units = [u for u in tuning_units(plan, "task") if u.strategy in ("lwf", "streamkl")][:3]
    assert seconds_left(units, plan, tmp_path) == (3, None)  # nothing finished: no rate
    (tmp_path / "units").mkdir()
    (tmp_path / "units" / f"{units[0].name}.json").write_text(json.dumps(
        {"unit": dataclasses.asdict(units[0]), "wall_time_s": 100.0}))
    (tmp_path / "runs" / units[2].name).mkdir(parents=True)
    study_rates._progress_path(str(tmp_path), units[2]).write_text("1\n")  # 0.6 of its weights trained
    # 100 s per weight for every task kind (its own, or the scenario's slowest); task weights sum to 1.
    assert seconds_left(units, plan, tmp_path) == (2, pytest.approx(100.0 + 0.4 * 100.0))
