"""A confirmatory plan: hypotheses with settings from a finished report and a first experience shared by
every arm; pre-registration (--register) in a git checkout, then --part confirm and its verdicts."""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile

import pytest
from study_helpers import one_line_error, tiny_plan, write_plan

from cl_streamkl.experiment.study.command import main
from cl_streamkl.experiment.study.files import StudyFileError
from cl_streamkl.experiment.study.plan import fingerprint, load_plan
from cl_streamkl.experiment.study.rates import finished_records
from cl_streamkl.experiment.study.registration import (
    check_registration,
    registration_path,
)

HYPOTHESES = [
    {"id": "H1", "scenario": "task", "arm": "", "strategy": "lwf+streamkl", "baseline": "lwf",
     "metric": "forgetting", "direction": "lower", "role": "primary"},
    {"id": "H2", "scenario": "task", "arm": "", "strategy": "streamkl", "baseline": "naive",
     "metric": "stream_accuracy", "direction": "higher", "role": "secondary"},
]
TUNED = {"plan_fingerprint": "f" * 16, "scenarios": {"task": {"chosen": {"lwf": {"lwf_alpha": 1.0}}}}}


def _git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def _confirmatory(folder):
    """The plan file and the tuned report it takes its settings from, written into ``folder``."""
    (folder / "results").mkdir(parents=True)
    (folder / "results" / "tuned.json").write_text(json.dumps(TUNED))
    scenario = {"options": {"experiences": 3, "first_experience_classes": 6},
                "test": {"": ["naive", "streamkl", "lwf", "lwf+streamkl"], "mem20pc": ["replay"]}}
    plan = {**tiny_plan(val_seeds=[], first_experience="shared", hypotheses=HYPOTHESES, scenarios={"task": scenario}),
            "settings_from": "results/tuned.json"}
    return write_plan(folder / "plan.yaml", plan)


@pytest.fixture
def no_git_above(tmp_path, monkeypatch):
    """git looks for a checkout no higher than tmp_path."""
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))


@pytest.mark.usefixtures("no_git_above")
def test_registration_needs_a_committed_unmodified_plan(tmp_path, capsys):
    loose = _confirmatory(tmp_path / "loose")
    assert main([str(loose), "--register"]) == 2
    assert one_line_error(capsys).endswith("is not in a git checkout: registering needs the commit that added it")
    repo = tmp_path / "repo"
    path = _confirmatory(repo)
    _git(repo, "init", "-q")
    assert main([str(path), "--register"]) == 2
    assert "is not committed: commit the pre-registration before registering it" in one_line_error(capsys)
    for args in (("config", "user.email", "t@example.com"), ("config", "user.name", "T"), ("add", "."),
                 ("commit", "-q", "-m", "plan")):
        _git(repo, *args)
    text = path.read_text()
    path.write_text(text + "# changed after the commit\n")
    assert main([str(path), "--register"]) == 2
    assert "differs from the commit that added it" in one_line_error(capsys)
    path.write_text(text)
    assert not registration_path(path).exists()
    assert main([str(path), "--register"]) == 0
    record = json.loads(registration_path(path).read_text())
    assert record["plan_file"] == "plan.yaml" and len(record["commit"]) == 40 and len(record["sha256"]) == 64
    assert main([str(path), "--register"]) == 2
    assert "exists: a plan is registered once" in one_line_error(capsys)
    # A shallow clone (as CI checks out) shows its one commit adding every file: the registered bytes decide.
    plan = load_plan(path)
    for args in (("add", "."), ("commit", "-q", "-m", "registration")):
        _git(repo, *args)
    _git(tmp_path, "clone", "-q", "--depth", "1", f"file://{repo}", "shallow")
    assert check_registration(tmp_path / "shallow" / "plan.yaml", fingerprint(plan))["commit"] == record["commit"]
    with pytest.raises(StudyFileError, match="changed since it was registered"):
        check_registration(tmp_path / "shallow" / "plan.yaml", "0" * 16)
    # A plan without hypotheses is not registered.
    plain = write_plan(repo / "plain.yaml", tiny_plan())
    assert main([str(plain), "--register"]) == 2
    assert "has no hypotheses: only a confirmatory plan is registered" in one_line_error(capsys)


@pytest.mark.slow
@pytest.mark.usefixtures("no_git_above")
def test_a_registered_plan_confirms_from_one_shared_first_experience(tmp_path, capsys):
    repo, out = tmp_path / "repo", tmp_path / "out"
    path = _confirmatory(repo)
    confirm = [str(path), "--part", "confirm", "--workers", "0", "--commit", "abc1234", "--out", str(out)]
    assert main(confirm) == 2
    assert "is not registered: commit it, run cl-streamkl study" in one_line_error(capsys)
    assert main([str(path), "--workers", "0", "--out", str(out)]) == 2  # --part is confirm by default
    assert "is not registered" in one_line_error(capsys)
    assert main([str(path), "--part", "all", "--workers", "0", "--out", str(out)]) == 2
    assert one_line_error(capsys).endswith("is a confirmatory plan; its runs are --part confirm")
    assert not out.exists()
    _git(repo, "init", "-q")
    for args in (("config", "user.email", "t@example.com"), ("config", "user.name", "T"), ("add", "."),
                 ("commit", "-q", "-m", "plan")):
        _git(repo, *args)
    assert main([str(path), "--register"]) == 0
    capsys.readouterr()

    # A first start trains the shared first experiences only; they travel in the archive to the next machine.
    began, archive = tmp_path / "began", tmp_path / "began.tar.gz"
    assert main([*confirm[:-1], str(began), "--max-units", "2", "--archive", str(archive)]) == 0
    assert json.loads((began / "report.json").read_text())["units"] == {"first": [2, 2], "tune": [0, 0],
                                                                         "test": [0, 10]}
    assert main([*confirm, "--from-archive", str(archive)]) == 0
    assert "H1 | primary | task | lwf+streamkl − lwf" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["units"] == {"first": [2, 2], "tune": [0, 0], "test": [10, 10]}
    assert [h["id"] for h in report["hypotheses"]] == ["H1", "H2"]
    for hypothesis in report["hypotheses"]:
        assert hypothesis["verdict"] in ("confirmed", "not confirmed") and hypothesis["seeds"] == [0, 1]
        assert set(hypothesis["beside"]) == {"learning_accuracy", "earlier_final_accuracy"}
    assert (out / "paired.png").is_file() and (out / "first").is_dir()
    registration = json.loads(registration_path(path).read_text())
    records = finished_records(out)
    for seed in (0, 1):
        [first] = [r for r in records.values() if r["unit"]["part"] == "first" and r["seed"] == seed]
        tested = [r for r in records.values() if r["unit"]["part"] == "test" and r["seed"] == seed]
        assert len(tested) == 5 and {r["unit"]["arm"] for r in tested} == {"", "mem20pc"}
        # Every arm starts from the one first experience of its seed and trains experiences 2..T only.
        assert all(r["accuracy_matrix"][0] == first["accuracy_matrix"][0] for r in tested)
        assert all([number for number, _ in r["experience_s"]] == [2, 3] for r in tested)
        assert [number for number, _ in first["experience_s"]] == [1]
    assert all(r["execution"]["preregistration"] == {"sha256": registration["sha256"],
                                                     "commit": registration["commit"]} for r in records.values())
    # An archive carries the shared first experiences still needed and no finished unit's run folder
    # (here stale: as an older archive unpacked over finished records leaves it); a start from it
    # finishes the units left.
    partial, pruned = tmp_path / "partial", tmp_path / "pruned.tar.gz"
    shutil.copytree(out, partial)
    tested = {seed: [n for n, r in records.items() if r["unit"]["part"] == "test" and r["seed"] == seed]
              for seed in (0, 1)}
    for name in tested[1][:2]:
        (partial / "units" / f"{name}.json").unlink()
    (partial / "runs" / tested[0][0]).mkdir(parents=True)
    (partial / "runs" / f"{tested[0][0]}.begun").touch()
    assert main([str(path), "--part", "plan", "--out", str(partial), "--archive", str(pruned)]) == 0
    with tarfile.open(pruned) as opened:
        members = {member.name for member in opened.getmembers()}
    firsts = [n for n, r in records.items() if r["unit"]["part"] == "first"]
    assert {m for m in members if m.startswith("first/")} == {
        f"first/{n}.pt" for n in firsts if records[n]["seed"] == 1}
    assert {f"units/{n}.json" for n in firsts} <= members and not any(m.startswith("runs/test-") for m in members)
    assert main([*confirm[:-1], str(tmp_path / "resumed"), "--from-archive", str(pruned)]) == 0
    assert json.loads((tmp_path / "resumed" / "report.json").read_text())["units"]["test"] == [10, 10]
    capsys.readouterr()
    # Confirmatory units run on one commit and one worker layout.
    assert main([*confirm[:-4], "--workers", "1", "--commit", "abc1234", "--out", str(out)]) == 2
    assert "confirmatory units run on one commit and one worker layout: unit" in one_line_error(capsys)
    assert main([*confirm[:-2], "--commit", "def5678", "--out", str(out)]) == 2
    assert "commit 'abc1234'" in one_line_error(capsys)
    # A registered plan cannot change.
    before = (out / "report.json").read_bytes()
    path.write_text(path.read_text().replace("test_seeds:\n- 0\n- 1", "test_seeds:\n- 0\n- 2"))
    assert main(confirm) == 2
    assert "changed since it was registered" in one_line_error(capsys)
    assert (out / "report.json").read_bytes() == before
    # Copied out of its checkout, the registered bytes still confirm (nothing left to run).
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    _git(repo, "checkout", "--", "plan.yaml")
    shutil.copy(repo / "plan.yaml", copy / "plan.yaml")
    assert main([str(copy / "plan.yaml"), *confirm[1:]]) == 0
