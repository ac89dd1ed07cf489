"""Running a study's units: deadlines judged per experience, starts that resume, the unfinished cap, the pool."""

from __future__ import annotations

import argparse
import json
import time
import types

import pytest
from study_helpers import short_plan

from cl_streamkl.experiment.study import rates as study_rates
from cl_streamkl.experiment.study import units as study_units
from cl_streamkl.experiment.study.files import (
    open_archive,
    unpack_archive,
    write_archive,
)
from cl_streamkl.experiment.study.plan import experience_weights, tuning_units
from cl_streamkl.experiment.study.rates import rate_key, unit_kind
from cl_streamkl.experiment.study.units import (
    InProcess,
    Outcome,
    may_start,
    run_unit,
    run_units,
)


def _rates(monkeypatch, rates):
    """This worker's measured rates: one dict, read by the units and the rates modules alike."""
    monkeypatch.setattr(study_rates, "_seconds_per_weight", rates)
    monkeypatch.setattr(study_units, "_seconds_per_weight", rates)


def _clock(monkeypatch, readings=None):
    """time.time() in the units module: the next of ``readings`` (a list), or a settable clock."""
    if readings is not None:
        monkeypatch.setattr(study_units, "time", types.SimpleNamespace(
            time=lambda: readings.pop(0), perf_counter=time.perf_counter))
        return readings
    clock = {"now": 0.0}
    monkeypatch.setattr(study_units, "time", types.SimpleNamespace(time=lambda: clock["now"],
                                                                   perf_counter=lambda: clock["now"]))
    return clock


def _args(tmp_path, time_limit=10.0, last_start=False):
    return argparse.Namespace(out=tmp_path, device="cpu", execution={}, time_limit=time_limit, last_start=last_start,
                              reference={}, max_unfinished=None)


def test_the_deadline_judges_each_experience_by_its_weight(tmp_path, monkeypatch):
    """Experiences of weight 0.6, 0.2, 0.2 taking 30 s and 10 s: 50 s per weight; 45 s allow two, not three."""
    clock = _clock(monkeypatch)
    trained = []

    def run_experiment(config, out, after_experience, **_):
        for index, seconds in enumerate((30.0, 10.0, 10.0)):
            clock["now"] += seconds
            trained.append(seconds)
            after_experience(index + 1, 3)
        raise AssertionError("the deadline should have stopped the unit")

    monkeypatch.setattr(study_units, "load_data", lambda *_: None)
    monkeypatch.setattr("cl_streamkl.experiment.runner.run_experiment", run_experiment)
    _rates(monkeypatch, {})
    plan = short_plan()
    unit = tuning_units(plan, "task")[0]
    assert run_unit(unit, plan, "cpu", str(tmp_path), deadline=45.0) is None
    assert trained == [30.0, 10.0]
    # The next unit in this worker does not start when all of it (50 s) could not end by the deadline.
    clock["now"] = 11.0
    assert run_unit(tuning_units(plan, "task")[1], plan, "cpu", str(tmp_path), 60.0) is None
    assert trained == [30.0, 10.0]


def test_a_guessed_rate_gives_way_to_the_first_measured_experience(tmp_path, monkeypatch):
    """A rate key never measured starts on a guess; its first measured experience, not the guess,
    then judges the next one of that key."""
    clock = _clock(monkeypatch)
    trained = []

    def run_experiment(config, out, after_experience, **_):
        for index in range(4):
            clock["now"] += 2.5  # weights 0.25 each: 10 s per weight
            trained.append(index + 1)
            after_experience(index + 1, 4)
        raise AssertionError("the deadline should have stopped the unit")

    monkeypatch.setattr(study_units, "load_data", lambda *_: None)
    monkeypatch.setattr("cl_streamkl.experiment.runner.run_experiment", run_experiment)
    plan = short_plan()
    unit, *others = tuning_units(plan, "domain")
    seen = next(u for u in others if unit_kind(u) != unit_kind(unit))
    first, later = rate_key(unit, 0), unit_kind(unit)
    # The later experiences are guessed at the other kind's 14: the second ends at 5 s (by the guess 6,
    # within 8 s); measured at 10 s per weight it replaces the guess, so the third (7.5 s) starts too.
    _rates(monkeypatch, {first: 10.0, unit_kind(seen): 14.0})
    assert run_unit(unit, plan, "cpu", str(tmp_path), 8.0, start_seconds=8.0) is None
    assert trained == [1, 2, 3]
    assert study_units._seconds_per_weight[later] == pytest.approx(10.0)
    # Had the guess been a measurement, it would have stopped the unit after its second experience.
    _rates(monkeypatch, {first: 10.0, later: 14.0})
    same = next(u for u in others if unit_kind(u) == later)
    clock["now"], trained[:] = 0.0, []
    assert run_unit(same, plan, "cpu", str(tmp_path), 8.0, start_seconds=8.0) is None
    assert trained == [1, 2]


def test_a_unit_is_judged_by_what_other_workers_finished_since_the_start(tmp_path, monkeypatch):
    """A unit starting reads the finished records on disk, so a kind measured slow meanwhile does not
    start past the deadline."""
    import dataclasses

    _rates(monkeypatch, {})
    monkeypatch.setattr(study_units, "load_data", lambda *_: pytest.fail("the unit should not start"))
    plan = short_plan()
    unit, *others = tuning_units(plan, "task")
    finished = next(u for u in others if unit_kind(u) == unit_kind(unit))
    (tmp_path / "units").mkdir()
    (tmp_path / "units" / f"{finished.name}.json").write_text(json.dumps(
        {"unit": dataclasses.asdict(finished), "wall_time_s": 1000.0}))  # task weights sum to 1
    assert run_unit(unit, plan, "cpu", str(tmp_path), time.time() + 500.0, start_seconds=600.0) is None


def test_a_unit_longer_than_a_start_runs_over_several_starts(tmp_path, monkeypatch, capsys):
    """Units that cannot finish within one --time-limit start when their next experience fits and
    resume from their checkpoints, judged on what is left; an experience longer than a whole start
    is refused in one line. The clock is a list: each reading takes the next value."""
    plan = short_plan(tiny=True, per_method=1, val_seeds=[7, 8], test_seeds=[0, 1])
    unit = next(u for u in tuning_units(plan, "class") if u.strategy == "pad")
    assert experience_weights(unit, plan) == pytest.approx([0.6, 0.2, 0.2])
    readings = _clock(monkeypatch, [])
    first, later = rate_key(unit, 0), rate_key(unit, 1)
    _rates(monkeypatch, {first: 50.0, later: 50.0})
    root = str(tmp_path)

    # 50 s a pass, a 40 s start: the unit needs several. Its first 30 s experience fits before 45.
    readings[:] = [0.0, 30.0, 60.0]  # start; after the first experience; after the second
    assert run_unit(unit, plan, "cpu", root, 45.0, start_seconds=40.0) is None
    assert (tmp_path / "runs" / f"{unit.name}.trained").read_text() == "2\n" and not readings
    # Next start: what is left (10 s) fits, though the whole unit (50 s) would not.
    readings[:] = [100.0]
    record = run_unit(unit, plan, "cpu", root, 115.0)
    assert record is not None and [number for number, _ in record["experience_s"]] == [3]
    assert not (tmp_path / "runs" / f"{unit.name}.trained").exists() and not (tmp_path / "runs" / unit.name).exists()
    assert run_unit(unit, plan, "cpu", root, 0.0) == json.loads(json.dumps(record))  # read back, not trained again

    # A fresh unit whose first experience (60 s) is longer than a whole start never starts, and says so.
    other = next(u for u in tuning_units(plan, "class") if u.strategy == "lwf")
    _rates(monkeypatch, {first: 100.0})
    readings[:] = [0.0]
    assert run_unit(other, plan, "cpu", root, 40.0, start_seconds=40.0) is None
    assert "its next experience needs about 60 s, more than a whole start (40 s)" in capsys.readouterr().err
    # As if no first experience had run: 100 s is a guess, from the later experiences of its scenario.
    _rates(monkeypatch, {later: 100.0})
    readings[:] = [0.0]
    assert run_unit(other, plan, "cpu", root, 40.0, start_seconds=40.0) is None
    assert "about 60 s (guessed: no unit has measured it), more than" in capsys.readouterr().err
    # Without --time-limit's length a unit that does not fit waits for a start where all of it does.
    _rates(monkeypatch, {first: 100.0, later: 100.0})
    readings[:] = [0.0]
    assert run_unit(other, plan, "cpu", root, 90.0) is None
    assert not (tmp_path / "runs" / other.name).exists()


def test_a_stopped_unit_goes_on_from_the_archive_on_another_machine(tmp_path, monkeypatch):
    """A unit stopped between experiences travels in an archive (its checkpoint and progress) and a
    fresh folder unpacked from it trains only the experiences left, to the same result as a unit
    trained in one go: how a unit outlives the machine it began on."""
    plan = short_plan(tiny=True, per_method=1, val_seeds=[7, 8], test_seeds=[0, 1])
    unit = next(u for u in tuning_units(plan, "class") if u.strategy == "streamkl")
    readings = _clock(monkeypatch, [])
    _rates(monkeypatch, {unit_kind(unit): 50.0})
    first, second, whole = tmp_path / "first", tmp_path / "second", tmp_path / "whole"

    readings[:] = [0.0, 30.0]  # the first experience fits before 35 s; then the next would not
    assert run_unit(unit, plan, "cpu", str(first), 35.0, start_seconds=40.0) is None
    write_archive(first, tmp_path / "units.tar.gz")
    archive, held = open_archive(tmp_path / "units.tar.gz")
    assert held is None  # run_unit alone writes no plan.json
    unpack_archive(archive, second)
    assert (second / "runs" / f"{unit.name}.trained").read_text() == "1\n"
    readings[:] = [100.0]
    resumed = run_unit(unit, plan, "cpu", str(second), None)
    assert [number for number, _ in resumed["experience_s"]] == [2, 3]
    once = run_unit(unit, plan, "cpu", str(whole), None)
    assert [number for number, _ in once["experience_s"]] == [1, 2, 3]
    assert resumed["accuracy_matrix"] == once["accuracy_matrix"] and resumed["penalties"] == once["penalties"]


def test_the_last_start_begins_no_unit_it_cannot_finish(tmp_path, monkeypatch):
    plan = short_plan()
    units = tuning_units(plan, "task")[:1]
    starts = []
    monkeypatch.setattr(study_units, "run_unit", lambda unit, *args: starts.append(args[-3:-1]))
    for last in (False, True):
        assert run_units(units, InProcess(), plan, _args(tmp_path, last_start=last), 1e12) == (0, 1, 0, 0)
    # A whole start's seconds, or none: every unit must finish in this one.
    assert starts == [(600.0, {}), (None, {})]


def test_max_unfinished_bounds_the_units_begun_and_unfinished(tmp_path, monkeypatch):
    """--max-unfinished: a unit that would be left half done begins only while fewer are; one that
    finishes in the start begins anyway, and a unit begun keeps its place. The clock is a list."""
    plan = short_plan(tiny=True, per_method=1, val_seeds=[7, 8], test_seeds=[0, 1])
    units = tuning_units(plan, "class")[:3]
    readings = _clock(monkeypatch, [])
    _rates(monkeypatch, {rate_key(units[0], 0): 50.0, rate_key(units[0], 1): 50.0})
    root = str(tmp_path)
    # 30 s of first experience fits before 35, not all 50 s: the unit begins and stops half done.
    readings[:] = [0.0, 0.0, 30.0]  # may it start; would it finish; after its first experience
    assert run_unit(units[0], plan, "cpu", root, 35.0, start_seconds=40.0, max_unfinished=1) is None
    assert study_units._unfinished(root) == 1 and not readings
    # The next would be left half done too: over the cap it does not begin, and leaves nothing.
    readings[:] = [0.0, 0.0]
    assert run_unit(units[1], plan, "cpu", root, 35.0, start_seconds=40.0, max_unfinished=1) is None
    assert not (tmp_path / "runs" / units[1].name).exists() and study_units._unfinished(root) == 1
    # A unit begun goes on whatever the cap; one that finishes in the start begins over it.
    assert study_units._claim(root, units[0], 1, finishes=False)
    assert study_units._claim(root, units[1], 1, finishes=True) and study_units._unfinished(root) == 2
    assert not study_units._claim(root, units[2], 2, finishes=False)
    assert study_units._claim(root, units[2], 3, finishes=False) and study_units._unfinished(root) == 3
    (tmp_path / "units").mkdir()
    (tmp_path / "units" / f"{units[1].name}.json").write_text("{}")  # finished: its marker is stale
    assert study_units._unfinished(root) == 2


def test_units_with_checkpoints_start_first(tmp_path, monkeypatch):
    plan = short_plan()
    units = tuning_units(plan, "task")[:4]
    for unit in (units[3], units[1]):  # checkpointed: a run folder and its progress beside it
        (tmp_path / "runs" / unit.name).mkdir(parents=True)
        study_rates._progress_path(str(tmp_path), unit).write_text("1\n")
    study_rates._progress_path(str(tmp_path), units[2]).write_text("1\n")  # its folder gone: starts afresh
    order = []
    monkeypatch.setattr(study_units, "run_unit", lambda unit, *args: order.append(unit))
    run_units(units, InProcess(), plan, _args(tmp_path, last_start=True), 1e12)
    assert order == [units[1], units[3], units[0], units[2]]


def test_a_failed_unit_is_reported_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    plan = short_plan()
    units = tuning_units(plan, "task")[:3]

    def run_unit(unit, *_):
        if unit == units[1]:
            raise RuntimeError("CUDA error: out of memory")
        return {"accuracy_matrix": [[0.5, 0.5]], "process_s": 1.0}

    monkeypatch.setattr(study_units, "run_unit", run_unit)
    # The two finished units' experiences count as trained here; the broken one's do not.
    experiences = sum(len(experience_weights(unit, plan)) for unit in (units[0], units[2]))
    assert run_units(units, InProcess(), plan, _args(tmp_path, time_limit=None), None) == (2, 0, 1, experiences)
    err = capsys.readouterr().err
    assert f"unit {units[1].name} failed: RuntimeError: CUDA error: out of memory" in err
    # Out of GPU memory: what to do, in place of a traceback that says nothing a user can act on.
    assert "goes on from its last checkpoint" in err and "--workers" in err and "Traceback" not in err


def test_a_failed_unit_other_than_memory_shows_its_traceback(tmp_path, monkeypatch, capsys):
    plan = short_plan()
    units = tuning_units(plan, "task")[:1]

    def run_unit(unit, *_):
        raise ValueError("a broken transform")

    monkeypatch.setattr(study_units, "run_unit", run_unit)
    assert run_units(units, InProcess(), plan, _args(tmp_path, time_limit=None), None).failed == 1
    err = capsys.readouterr().err
    assert "failed: ValueError: a broken transform" in err and "Traceback" in err and "--workers" not in err


def test_a_start_counts_the_experiences_it_trained_and_kept(tmp_path, monkeypatch):
    """A start that finishes no unit may still have moved units on: the experiences it trained and
    checkpointed count, and so do a finished unit's, less those an earlier start had trained."""
    plan = short_plan()
    stopped, finished = tuning_units(plan, "task")[:2]

    def checkpoint(unit, trained):
        (tmp_path / "runs" / unit.name).mkdir(parents=True, exist_ok=True)
        study_rates._progress_path(str(tmp_path), unit).write_text(f"{trained}\n")

    checkpoint(stopped, 1)
    checkpoint(finished, 1)

    def run_unit(unit, *_):
        if unit == stopped:
            checkpoint(unit, 2)  # one more experience, then the deadline
            return None
        return {"accuracy_matrix": [[0.5, 0.5]], "process_s": 1.0}

    monkeypatch.setattr(study_units, "run_unit", run_unit)
    count = len(experience_weights(finished, plan))
    outcome = run_units([stopped, finished], InProcess(), plan, _args(tmp_path), 1e12)
    assert outcome == Outcome(finished=1, unfinished=1, failed=0, experiences=1 + count - 1)


def test_may_start():
    later = time.time() + 100
    assert may_start([50.0], later, False)  # 50 s of 100
    assert not may_start([60.0, 60.0], later, False)  # 120 s in the last start
    assert may_start([60.0, 60.0], later, True)  # a later start goes on from the checkpoint
    assert not may_start([110.0, 10.0], later, True)  # its next experience won't end
    assert not may_start([], later - 200, True)  # all trained, deadline passed
