"""Bad input to ``cl-streamkl study``: one line on stderr, exit status 2, and nothing written (names
from a handed file stay inside --out, an archive of another plan is refused before unpacking,
damaged archives and reports are refused before anything is written)."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
from study_helpers import files_under, one_line_error, tiny_plan, write_plan

from cl_streamkl.experiment.study.command import main
from cl_streamkl.experiment.study.plan import check_plan, fingerprint


def _tar(path, *members):
    """A .tar.gz of (TarInfo, bytes or None) members."""
    with tarfile.open(path, "w:gz") as archive:
        for info, data in members:
            archive.addfile(info, None if data is None else io.BytesIO(data))
    return path


def _member(name, data=b"{}", kind=tarfile.REGTYPE, target=""):
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, target, len(data) if kind == tarfile.REGTYPE else 0
    return info, data if kind == tarfile.REGTYPE else None


def _report(tmp_path, plan, **changes):
    path = tmp_path / "given.json"
    path.write_text(json.dumps({"plan_fingerprint": fingerprint(check_plan(plan)), "records": {}, **changes}))
    return path


def _file(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    return tmp_path / name


def _plan_text(tmp_path, text):
    return _file(tmp_path, "bad.yaml", text), ["--part", "plan"]


def _bad_plan(tmp_path, **changes):
    plan = tiny_plan(**changes)
    return write_plan(tmp_path / "bad.yaml", plan), ["--part", "plan"]


def _bad_grid(tmp_path):
    plan = tiny_plan()
    plan["scenarios"]["class"]["tuning"]["lwf"]["grid"].append({"lwf_alpha": 9.0})
    return write_plan(tmp_path / "bad.yaml", plan), []


# Each case: (tmp_path, the good plan file) -> argv after the plan; the message the one line holds.
CASES = {
    "escaping record name": (lambda t, p: ["--from-report", str(_report(t, tiny_plan(), records={
        "../../escaped": {"unit": {}}}))], "--from-report: '../../escaped' is not a unit name; nothing was written"),
    "record name with a folder": (lambda t, p: ["--from-report", str(_report(t, tiny_plan(), records={
        "units/x": {}}))], "is not a unit name"),
    "report of another plan": (lambda t, p: ["--from-report", str(_report(t, tiny_plan(val_seeds=[5, 6])))],
                               "--from-report holds plan"),
    "records not a mapping": (lambda t, p: ["--from-report", str(_report(t, tiny_plan(), records=[]))],
                              "--from-report: its records are not a mapping of unit names"),
    "records not a mapping, with an archive": (lambda t, p: [
        "--from-archive", str(_tar(t / "a.tar.gz", _member("plan.json", json.dumps(check_plan(tiny_plan())).encode()),
                                   _member("units/x.json"))),
        "--from-report", str(_report(t, tiny_plan(), records=[]))], "its records are not a mapping"),
    "escaping record name, with an archive": (lambda t, p: [
        "--from-archive", str(_tar(t / "a.tar.gz", _member("units/x.json"))),
        "--from-report", str(_report(t, tiny_plan(), records={"..": {}}))], "'..' is not a unit name"),
    "non-JSON report": (lambda t, p: ["--from-report", str(_file(t, "given.json", "{not json"))], "is not JSON"),
    "report not an object": (lambda t, p: ["--from-report", str(_file(t, "given.json", "[1]"))],
                             "does not hold a JSON object"),
    "missing report": (lambda t, p: ["--from-report", str(t / "missing.json")], "missing.json: no such file"),
    "missing archive": (lambda t, p: ["--from-archive", str(t / "missing.tar.gz")], "missing.tar.gz: no such file"),
    "non-gzip archive": (lambda t, p: ["--from-archive", str(_file(t, "units.tar.gz", "plain text"))],
                         "is not a complete .tar.gz"),
    "climbing member": (lambda t, p: ["--from-archive", str(_tar(t / "a.tar.gz", _member("../x")))],
                        "member '../x' lies outside a study folder"),
    "absolute member": (lambda t, p: ["--from-archive", str(_tar(t / "a.tar.gz", _member("/etc/x")))],
                        "lies outside a study folder"),
    "member outside the roots": (lambda t, p: ["--from-archive", str(_tar(t / "a.tar.gz", _member("bin/x")))],
                                 "member 'bin/x' lies outside a study folder"),
    "symlink member": (lambda t, p: ["--from-archive", str(_tar(t / "a.tar.gz", _member(
        "units/x.json", kind=tarfile.SYMTYPE, target="/etc/passwd")))], "member 'units/x.json' is a link or device"),
    "hard link member": (lambda t, p: ["--from-archive", str(_tar(t / "a.tar.gz", _member("units/a.json"), _member(
        "units/b.json", kind=tarfile.LNKTYPE, target="units/a.json")))], "is a link or device"),
    "damaged plan in the archive": (lambda t, p: ["--from-archive", str(_tar(t / "a.tar.gz", _member(
        "plan.json", b"{oops")))], "its plan.json is damaged"),
    "json of another plan": (lambda t, p: ["--json", str(_file(t, "report.json", json.dumps({
        "plan_fingerprint": "0" * 16})))], "reports a study with plan 0000000000000000"),
    "workers -1": (lambda t, p: ["--workers", "-1"], "--workers must be >= 0, --threads and --gpus >= 1"),
    "threads 0": (lambda t, p: ["--threads", "0"], "--workers must be >= 0, --threads and --gpus >= 1"),
    "time limit nan": (lambda t, p: ["--time-limit", "nan"], "--time-limit must be a number of minutes > 0"),
    "time limit 0": (lambda t, p: ["--time-limit", "0"], "--time-limit must be a number of minutes > 0"),
    "hard limit inf": (lambda t, p: ["--workers", "1", "--hard-limit", "inf"], "--hard-limit must be a number"),
    "hard limit in process": (lambda t, p: ["--workers", "0", "--hard-limit", "5"],
                              "--hard-limit needs worker processes (--workers >= 1)"),
    "hard limit first": (lambda t, p: ["--workers", "1", "--time-limit", "9", "--hard-limit", "8"],
                         "--hard-limit must not be below --time-limit"),
    "max unfinished 0": (lambda t, p: ["--max-unfinished", "0", "--time-limit", "5"], "--max-unfinished must be >= 1"),
    "max units 0": (lambda t, p: ["--max-units", "0"], "--max-units must be >= 1"),
    "max unfinished alone": (lambda t, p: ["--max-unfinished", "4"],
                             "--max-unfinished and --last-start need --time-limit"),
    "last start alone": (lambda t, p: ["--last-start"], "--max-unfinished and --last-start need --time-limit"),
    "scenario not planned": (lambda t, p: ["--scenarios", "domain"], "--scenarios: domain is not in the plan (class)"),
    "confirm without hypotheses": (lambda t, p: ["--part", "confirm"], "has no hypotheses"),
    "register without hypotheses": (lambda t, p: ["--register"], "has no hypotheses"),
    "out a file": (lambda t, p: ["--out", str(_file(t, "out", "x"))], "is not a folder"),
    "json a folder": (lambda t, p: ["--json", str(t)], "is a folder"),
    "archive a folder": (lambda t, p: ["--archive", str(t)], "is a folder"),
    "out under a file": (lambda t, p: ["--out", str(_file(t, "out", "x") / "run")], "is a file, not a folder"),
    "json under a file": (lambda t, p: ["--json", str(_file(t, "json", "x") / "r.json")], "is a file, not a folder"),
    "archive under a file": (lambda t, p: ["--archive", str(_file(t, "archive", "x") / "a.tar.gz")],
                             "is a file, not a folder"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys, case):
    make, message = CASES[case]
    plan = write_plan(tmp_path / "plan.yaml", tiny_plan())
    argv = [str(plan), "--workers", "0", *make(tmp_path, plan)]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    before = files_under(tmp_path)
    assert main(argv) == 2
    assert message in one_line_error(capsys)
    assert files_under(tmp_path) == before and not (tmp_path / "out").is_dir()
    assert not (tmp_path.parent / "escaped.json").exists()


PLAN_CASES = {
    "duplicate seeds": (lambda t: _bad_plan(t, test_seeds=[3, 3]), "test_seeds repeats a seed: [3]"),
    "negative seeds": (lambda t: _bad_plan(t, val_seeds=[-7, 8]), "val_seeds: seeds are integers from 0"),
    "key twice": (lambda t: _plan_text(t, "regime: a\nregime: b\n"), "key 'regime' is given twice (line 2)"),
    "aliases": (lambda t: _plan_text(t, "settings: &s {epochs: 1}\nother: *s\n"),
                "aliases (*s, line 2) are not read"),
    "not YAML": (lambda t: _plan_text(t, "regime: [\n"), "is not valid YAML"),
    "unknown key": (lambda t: _bad_plan(t, seeds=[1, 2]), "unknown key 'seeds'; a plan has regime, settings"),
    "unequal grids": (_bad_grid, ("every family needs the same number of settings (equal tuning effort); "
                                  "the grids have [2, 3]")),
    "missing plan": (lambda t: (t / "missing.yaml", []), "cannot read"),
}


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_a_bad_plan_file_is_refused_in_one_line_naming_it(tmp_path, capsys, case):
    make, message = PLAN_CASES[case]
    path, extra = make(tmp_path)
    before = files_under(tmp_path)
    assert main([str(path), "--workers", "0", "--out", str(tmp_path / "out"), *extra]) == 2
    line = one_line_error(capsys)
    assert message in line and str(path) in line
    assert files_under(tmp_path) == before


def test_an_archive_of_another_plan_leaves_the_folder_as_it_was(tmp_path, capsys):
    """The plan an archive holds is checked before a byte is unpacked: --out's plan.json stays."""
    mine, theirs = (write_plan(tmp_path / f"{n}.yaml", tiny_plan(val_seeds=s)) for n, s in (("a", [7, 8]), ("b", [5, 6])))
    out, archive = tmp_path / "out", tmp_path / "theirs.tar.gz"
    assert main([str(mine), "--part", "plan", "--out", str(out)]) == 0
    assert main([str(theirs), "--part", "plan", "--out", str(tmp_path / "b"), "--archive", str(archive)]) == 0
    capsys.readouterr()
    before = files_under(out)
    assert main([str(mine), "--workers", "0", "--out", str(out), "--from-archive", str(archive)]) == 2
    assert "holds plan" in one_line_error(capsys) and files_under(out) == before
    # A truncated archive (a part lost on the way) is refused alike.
    whole = archive.read_bytes()
    archive.write_bytes(whole[:len(whole) // 2])
    assert main([str(mine), "--workers", "0", "--out", str(out), "--from-archive", str(archive)]) == 2
    assert "is not a complete .tar.gz" in one_line_error(capsys) and files_under(out) == before
    # A damaged plan.json in --out is named.
    (out / "plan.json").write_text("{")
    assert main([str(mine), "--workers", "0", "--out", str(out)]) == 2
    assert "--out's plan.json" in one_line_error(capsys)


def test_tables_need_readable_reports(tmp_path, capsys):
    for path, message in ((tmp_path / "missing.json", "--tables"), (_file(tmp_path, "r.json", "nope"), "is not JSON"),
                          (_file(tmp_path, "results.json", '{"runs": []}'), "results.json is not a study report")):
        assert main(["--tables", str(path)]) == 2
        assert message in one_line_error(capsys)
    assert main([]) == 2
    assert "a plan file is required" in one_line_error(capsys)
    with pytest.raises(SystemExit) as exit_info:
        main(["plan.yaml", "--part", "everything"])
    assert exit_info.value.code == 2
    assert one_line_error(capsys).startswith("cl-streamkl study: error: argument --part: invalid choice")


@pytest.mark.parametrize("option, meant", [("--time-lim", "--time-limit"), ("--arch", "--archive"),
                                           ("--timelimit", "--time-limit")])
def test_an_abbreviated_or_misspelt_option_is_refused_naming_the_one_meant(capsys, option, meant):
    """A prefix would otherwise run as whichever option it begins (``--arch`` as ``--archive``)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["plan.yaml", option, "5"])
    assert exit_info.value.code == 2
    assert f"error: unrecognized arguments: {option} 5 (did you mean '{meant}'?)" in one_line_error(capsys)
