"""Carried files are checked by their content: an archive must hold this plan's plan.json (whatever
its members' ``./`` prefixes), and every carried record must be a unit record before any is written.
Also a registration without its commit, and --tables reports lacking a key: one line, exit 2."""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile

import pytest
from study_helpers import files_under, one_line_error, tiny_plan, write_plan

from cl_streamkl.experiment.study.command import main
from cl_streamkl.experiment.study.plan import Unit, check_plan, fingerprint, tuning_units
from cl_streamkl.experiment.study.registration import file_sha256, registration_path

PLAN = check_plan(tiny_plan())
UNIT = tuning_units(PLAN, "class")[0]


def _record(unit: Unit = UNIT) -> dict:
    """A finished unit's record as a worker writes it (values made up)."""
    return {"unit": dataclasses.asdict(unit), "strategy": unit.strategy, "seed": unit.seed,
            "class_order": list(range(10)), "accuracy_matrix": [[0.9, 0.0, 0.0], [0.5, 0.8, 0.0], [0.4, 0.5, 0.7]],
            "task_il_matrix": [], "eval_sizes": [60, 20, 20], "penalties": [], "wall_time_s": 1.0,
            "peak_memory_mb": 1.0, "process_s": 1.5, "execution": {"commit": "abc"}}


def _tar(path, members: dict[str, bytes]):
    with tarfile.open(path, "w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def _plan_json(plan=PLAN) -> bytes:
    return json.dumps(plan).encode()


def _start(tmp_path, capsys, *extra):
    plan = write_plan(tmp_path / "plan.yaml", tiny_plan())
    out = tmp_path / "out"
    before = files_under(tmp_path)
    rc = main([str(plan), "--part", "plan", "--out", str(out), *extra])
    return rc, out, before


RECORD = f"units/{UNIT.name}.json"
BAD_RECORDS = {
    "truncated": (json.dumps(_record())[:40].encode(), "is not JSON"),
    "a string": (b'"units"', "is not a unit record (a JSON object)"),
    "unit not a mapping": (json.dumps({**_record(), "unit": "tune"}).encode(), "its unit is not a mapping of part"),
    "unit lacking a key": (json.dumps({**_record(), "unit": {"part": "tune"}}).encode(), "its unit is not a mapping"),
    "no accuracy matrix": (json.dumps({k: v for k, v in _record().items() if k != "accuracy_matrix"}).encode(),
                           "the record lacks accuracy_matrix"),
    "matrix of strings": (json.dumps({**_record(), "accuracy_matrix": ["0.5"]}).encode(),
                          "its accuracy_matrix is not rows of accuracies"),
}


@pytest.mark.parametrize("case", list(BAD_RECORDS))
def test_a_carried_record_is_checked_before_any_is_written(tmp_path, capsys, case):
    data, message = BAD_RECORDS[case]
    good = f"units/{tuning_units(PLAN, 'class')[1].name}.json"
    archive = _tar(tmp_path / "a.tar.gz", {"plan.json": _plan_json(), good: json.dumps(_record()).encode(),
                                           RECORD: data})
    rc, out, before = _start(tmp_path, capsys, "--from-archive", str(archive))
    assert rc == 2 and message in one_line_error(capsys)
    assert files_under(tmp_path) == before and not out.exists()
    # The same record in a report.
    if case != "truncated":
        report = tmp_path / "report.json"
        report.write_text(json.dumps({"plan_fingerprint": fingerprint(PLAN), "records": {
            UNIT.name: json.loads(data), "other": _record()}}))
        rc, out, before = _start(tmp_path, capsys, "--from-report", str(report))
        assert rc == 2 and message.removeprefix("is ") in one_line_error(capsys)
        assert files_under(tmp_path) == before and not out.exists()


def test_a_count_of_trained_experiences_that_is_no_number_is_refused(tmp_path, capsys):
    archive = _tar(tmp_path / "a.tar.gz", {"plan.json": _plan_json(), f"runs/{UNIT.name}.trained": b"two\n"})
    rc, out, before = _start(tmp_path, capsys, "--from-archive", str(archive))
    assert rc == 2 and f"runs/{UNIT.name}.trained does not count trained experiences" in one_line_error(capsys)
    assert files_under(tmp_path) == before and not out.exists()


def test_an_archive_without_a_plan_is_refused(tmp_path, capsys):
    archive = _tar(tmp_path / "a.tar.gz", {RECORD: json.dumps(_record()).encode()})
    rc, out, before = _start(tmp_path, capsys, "--from-archive", str(archive))
    assert rc == 2 and "holds no plan.json" in one_line_error(capsys)
    assert files_under(tmp_path) == before and not out.exists()


def test_members_named_dot_slash_are_checked_like_the_others(tmp_path, capsys):
    """``tar czf x.tgz -C folder ./plan.json ./units`` packs a folder so: another plan's is refused,
    this plan's is unpacked under the plain names."""
    theirs = check_plan(tiny_plan(val_seeds=[5, 6]))
    archive = _tar(tmp_path / "a.tar.gz", {"./": b"", "./plan.json": _plan_json(theirs),
                                           f"./{RECORD}": json.dumps(_record()).encode()})
    rc, out, before = _start(tmp_path, capsys, "--from-archive", str(archive))
    assert rc == 2 and f"holds plan {fingerprint(theirs)}" in one_line_error(capsys)
    assert files_under(tmp_path) == before and not out.exists()
    mine = _tar(tmp_path / "b.tar.gz", {"./plan.json": _plan_json(), f"./{RECORD}": json.dumps(_record()).encode()})
    rc, out, _ = _start(tmp_path, capsys, "--from-archive", str(mine))
    assert rc == 0
    assert json.loads((out / RECORD).read_text()) == json.loads(json.dumps(_record()))
    assert json.loads((out / "plan.json").read_text()) == PLAN


def test_a_registration_without_its_commit_is_one_line(tmp_path, capsys):
    hypothesis = {"id": "H1", "role": "primary", "scenario": "class", "arm": "", "strategy": "lwf+streamkl",
                  "baseline": "lwf", "metric": "forgetting", "direction": "lower"}
    path = write_plan(tmp_path / "confirm.yaml", tiny_plan(hypotheses=[hypothesis]))
    registration_path(path).write_text(json.dumps({
        "plan_file": path.name, "sha256": file_sha256(path.read_bytes()),
        "plan_fingerprint": fingerprint(check_plan(tiny_plan(hypotheses=[hypothesis])))}))
    before = files_under(tmp_path)
    assert main([str(path), "--part", "confirm", "--workers", "0", "--out", str(tmp_path / "out")]) == 2
    line = one_line_error(capsys)
    assert f"{registration_path(path)} is not a complete registration: its commit is missing" in line
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("damage", ["settings", "scenarios"])
def test_tables_of_a_report_lacking_a_key_are_one_line(tmp_path, capsys, damage):
    report = {"plan": PLAN, "plan_fingerprint": fingerprint(PLAN), "settings": {"tokens": 5},
              "units": {"tune": [0, 8], "test": [0, 10]}, "scenarios": {"class": {"chosen": None}}}
    if damage == "settings":
        report["settings"] = {}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert main(["--tables", str(path)]) == 2
    line = one_line_error(capsys)
    assert f"--tables {path} is not a complete study report (it lacks the key" in line
