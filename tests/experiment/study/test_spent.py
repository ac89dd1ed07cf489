"""What --archive leaves out: a finished unit's stale run folder and markers, and a shared first
experience once every test unit of its scenario and seed has its record (never before)."""

from __future__ import annotations

import dataclasses
import json
import tarfile

from study_helpers import tiny_plan, write_plan

from cl_streamkl.experiment.study.command import main
from cl_streamkl.experiment.study import plan as study_plan
from cl_streamkl.experiment.study.plan import check_plan, choose, first_units, tuning_units
from cl_streamkl.experiment.study.report import tuning_scores
from cl_streamkl.experiment.study.spent import spent_files

PLAN = check_plan(tiny_plan(first_experience="shared"))


def _record(unit) -> dict:
    """A finished unit's record as a worker writes it (values made up)."""
    return {"unit": dataclasses.asdict(unit), "strategy": unit.strategy, "seed": unit.seed,
            "class_order": list(range(10)), "accuracy_matrix": [[0.9, 0.0, 0.0], [0.5, 0.8, 0.0], [0.4, 0.5, 0.7]],
            "task_il_matrix": [], "eval_sizes": [60, 20, 20], "penalties": [], "wall_time_s": 1.0,
            "peak_memory_mb": 1.0, "process_s": 1.5, "execution": {"commit": "abc"}}


def _finish(out, *units):
    (out / "units").mkdir(parents=True, exist_ok=True)
    for unit in units:
        (out / "units" / f"{unit.name}.json").write_text(json.dumps(_record(unit)))


def _begin(out, unit):
    """A unit's run folder (a checkpoint) and markers, as a stopped unit leaves them."""
    (out / "runs" / unit.name).mkdir(parents=True)
    (out / "runs" / unit.name / "naive_seed0.pt").write_bytes(b"checkpoint")
    (out / "runs" / f"{unit.name}.begun").touch()
    (out / "runs" / f"{unit.name}.trained").write_text("1\n")


def _archived(tmp_path, plan_file, out):
    """The members of the archive a start that runs nothing writes from ``out``."""
    archive = tmp_path / "out.tar.gz"
    assert main([str(plan_file), "--part", "plan", "--out", str(out), "--archive", str(archive)]) == 0
    with tarfile.open(archive) as opened:
        return {member.name for member in opened.getmembers()}


def _tests(records):
    tables, complete = choose(PLAN, "class", tuning_scores(PLAN, records))
    assert complete
    return study_plan.test_units(PLAN, "class", {family: table["chosen"] for family, table in tables.items()})


def test_a_finished_units_run_folder_and_markers_stay_out_of_the_archive(tmp_path):
    plan_file, out = write_plan(tmp_path / "plan.yaml", tiny_plan()), tmp_path / "out"
    finished, stopped = tuning_units(PLAN, "class")[:2]
    assert main([str(plan_file), "--part", "plan", "--out", str(out)]) == 0
    _finish(out, finished)
    _begin(out, finished)  # stale: an older archive unpacked over the finished record
    _begin(out, stopped)
    members = _archived(tmp_path, plan_file, out)
    assert f"units/{finished.name}.json" in members and "plan.json" in members
    assert not [name for name in members if name.startswith(f"runs/{finished.name}")]
    assert {f"runs/{stopped.name}", f"runs/{stopped.name}/naive_seed0.pt", f"runs/{stopped.name}.begun",
            f"runs/{stopped.name}.trained"} <= members


def test_a_shared_first_experience_travels_until_every_test_unit_of_its_seed_has_finished(tmp_path):
    plan_file, out = write_plan(tmp_path / "plan.yaml", tiny_plan(first_experience="shared")), tmp_path / "out"
    assert main([str(plan_file), "--part", "plan", "--out", str(out)]) == 0
    (out / "first").mkdir()
    # Tuning unfinished: the test units are not known yet, so no first experience is left out.
    (out / "first" / "first-class-base-naive-seed0-0.pt").write_bytes(b"x")
    assert spent_files(out, PLAN, {}) == set()
    (out / "first" / "first-class-base-naive-seed0-0.pt").unlink()
    _finish(out, *tuning_units(PLAN, "class"))
    records = {unit.name: _record(unit) for unit in tuning_units(PLAN, "class")}
    tests = _tests(records)
    firsts = first_units(PLAN, tests)
    assert [first.seed for first in firsts] == [0, 1]
    _finish(out, *firsts)
    for first in firsts:
        (out / "first" / f"{first.name}.pt").write_bytes(b"first experience")
    seed0, seed1 = ([unit for unit in tests if unit.seed == seed] for seed in (0, 1))
    _finish(out, *seed0[:-1], *seed1[:-1])
    members = _archived(tmp_path, plan_file, out)  # one test unit of each seed has not finished
    assert {f"first/{first.name}.pt" for first in firsts} <= members
    _finish(out, seed0[-1])
    members = _archived(tmp_path, plan_file, out)
    assert f"first/{firsts[0].name}.pt" not in members and f"first/{firsts[1].name}.pt" in members
    assert {f"units/{first.name}.json" for first in firsts} <= members  # the first units' records stay
    _finish(out, seed1[-1])
    assert not {name for name in _archived(tmp_path, plan_file, out) if name.startswith("first/")} - {"first"}
