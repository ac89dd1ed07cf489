"""The project's study plans (benchmarks/studies/) and their committed reports (benchmarks/results/): the new
``cl-streamkl study`` reads the committed results unchanged, and the confirmatory plan stays registered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cl_streamkl.experiment.study.files import read_mapping
from cl_streamkl.experiment.study.plan import fingerprint, load_plan
from cl_streamkl.experiment.study.registration import check_registration
from cl_streamkl.experiment.study.report import build_report

ROOT = Path(__file__).resolve().parents[2]
STUDIES, RESULTS = ROOT / "benchmarks" / "studies", ROOT / "benchmarks" / "results"


@pytest.mark.parametrize("regime", ["short", "long", "long4097"])
def test_a_committed_report_is_its_plan_files_and_is_rebuilt_unchanged(regime):
    plan = load_plan(STUDIES / f"efficacy-{regime}.yaml")
    report = json.loads((RESULTS / f"efficacy-{regime}.json").read_text())
    assert fingerprint(plan) == report["plan_fingerprint"] and plan == report["plan"]
    rebuilt = json.loads(json.dumps(build_report(plan, report["records"], report["environment"])))
    assert rebuilt["units"] == report["units"] and list(rebuilt["scenarios"]) == list(report["scenarios"])
    for scenario, part in report["scenarios"].items():
        again = rebuilt["scenarios"][scenario]
        assert again["chosen"] == part["chosen"] and list(again["table"]) == list(part["table"])
        for label, row in part["table"].items():
            assert again["table"][label]["seeds"] == row["seeds"]
            assert all(again["table"][label][m] == pytest.approx(row[m]) for m in row if m != "seeds")
        assert len(again["paired"]) == len(part["paired"]) > 0
        for new, old in zip(again["paired"], part["paired"]):
            assert (new["strategy"], new["baseline"], new["metric"], new["n"]) == (
                old["strategy"], old["baseline"], old["metric"], old["n"])
            assert new["mean_diff"] == pytest.approx(old["mean_diff"], rel=1e-12, abs=1e-12)
            assert (new["p_holm"] is None) == (old["p_holm"] is None)
            if old["p_holm"] is not None:
                assert new["p_holm"] == pytest.approx(old["p_holm"], rel=1e-9)


def test_the_confirmatory_plan_is_registered_and_unchanged():
    path = STUDIES / "confirm-1025.yaml"
    plan = load_plan(path)
    assert plan["hypotheses"] and plan["first_experience"] == "shared"
    long = json.loads((RESULTS / "efficacy-long.json").read_text())
    assert all(part["chosen_from"] == {"plan": long["plan_fingerprint"], "chosen": long["scenarios"][name]["chosen"]}
               for name, part in plan["scenarios"].items())
    assert not set(plan["test_seeds"]) & {seed for p in (long["plan"],) for seed in p["test_seeds"] + p["val_seeds"]}
    registration = check_registration(path, fingerprint(plan))
    assert registration == {key: json.loads((STUDIES / "confirm-1025.yaml.registration.json").read_text())[key]
                            for key in ("sha256", "commit")}


def test_the_confirmatory_report_is_its_registered_plans_and_its_verdicts_are_rebuilt():
    plan = load_plan(STUDIES / "confirm-1025.yaml")
    report = json.loads((RESULTS / "confirm-1025.json").read_text())
    assert fingerprint(plan) == report["plan_fingerprint"] and plan == report["plan"]
    registered = json.loads((STUDIES / "confirm-1025.yaml.registration.json").read_text())
    assert all(record["execution"]["preregistration"] == {"sha256": registered["sha256"],
                                                          "commit": registered["commit"]}
               for record in report["records"].values())
    rebuilt = json.loads(json.dumps(build_report(plan, report["records"], report["environment"])))
    assert rebuilt["units"] == report["units"] and report["units"]["first"][0] == report["units"]["first"][1] > 0
    assert [(h["id"], h["verdict"], h["seeds"]) for h in rebuilt["hypotheses"]] == [
        (h["id"], h["verdict"], h["seeds"]) for h in report["hypotheses"]]
    for new, old in zip(rebuilt["hypotheses"], report["hypotheses"]):
        assert new["mean_diff"] == pytest.approx(old["mean_diff"]) and new["p_holm"] == pytest.approx(old["p_holm"])
    # Every arm of a seed started from that seed's one first experience.
    firsts = {(r["unit"]["scenario"], r["seed"]): r["accuracy_matrix"][0] for r in report["records"].values()
              if r["unit"]["part"] == "first"}
    tested = [r for r in report["records"].values() if r["unit"]["part"] == "test"]
    assert all(r["accuracy_matrix"][0] == firsts[(r["unit"]["scenario"], r["seed"])] for r in tested)
    # experience_s: those trained by the start that finished the unit (a resumed one: fewer); never the first.
    assert all(number >= 2 for r in tested for number, _ in r["experience_s"])


def _seeds_used_before(excluded: set[str]) -> set[int]:
    """Every seed a committed plan other than ``excluded`` names, or a report of such a plan (a
    report carries its plan file's name: ``confirm-pad-1025.json`` of ``confirm-pad-1025.yaml``)."""
    used = set()
    for path in STUDIES.glob("*.yaml"):
        if path.name not in excluded:
            raw = read_mapping(path)
            used |= set(raw.get("test_seeds", [])) | set(raw.get("val_seeds", []))
    own_reports = {Path(name).with_suffix(".json").name for name in excluded}
    for path in RESULTS.glob("*.json"):
        if path.name in own_reports:
            continue
        report = json.loads(path.read_text())
        if isinstance(report.get("plan"), dict) and "test_seeds" in report["plan"]:
            used |= set(report["plan"]["test_seeds"]) | set(report["plan"]["val_seeds"])
    return used


def test_the_replay_lwf_tuning_has_the_effort_of_every_exploratory_family():
    plan = load_plan(STUDIES / "tune-replay-lwf-1025.yaml")
    long = load_plan(STUDIES / "efficacy-long.yaml")
    chosen = json.loads((RESULTS / "efficacy-long.json").read_text())["scenarios"]["class"]["chosen"]
    family = plan["scenarios"]["class"]["tuning"]["lwf"]
    assert family["strategy"] == "replay+lwf" and family["grid"] == long["scenarios"]["class"]["tuning"]["lwf"]["grid"]
    assert plan["val_seeds"] == long["val_seeds"] and plan["test_seeds"] == [] and plan["settings"] == long["settings"]
    assert plan["arms"][family["arm"]] == {**long["arms"]["mem20pc"], **chosen["replay"]}


def test_the_new_confirmatory_plans_use_fresh_seeds_and_the_exploratory_choices(tmp_path, capsys):
    pad, long4097 = "confirm-pad-1025.yaml", "confirm-4097.yaml"
    used = _seeds_used_before({pad, long4097})
    seeds = {name: read_mapping(STUDIES / name)["test_seeds"] for name in (pad, long4097)}
    assert min(seeds[pad] + seeds[long4097]) >= 512 and not set(seeds[pad]) & set(seeds[long4097])
    assert not (set(seeds[pad]) | set(seeds[long4097])) & used
    long = json.loads((RESULTS / "efficacy-long.json").read_text())
    plan = load_plan(STUDIES / long4097)
    assert plan["tokens"] == 4097 and plan["first_experience"] == "shared" and len(plan["hypotheses"]) == 4
    assert plan["scenarios"]["task"]["chosen_from"]["chosen"] == long["scenarios"]["task"]["chosen"]
    # The PAD plan takes LwF's class setting from the replay+LwF tuning, which runs on a GPU: a stand-in here.
    (tmp_path / "studies").mkdir()
    (tmp_path / "studies" / pad).write_bytes((STUDIES / pad).read_bytes())
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "efficacy-long.json").write_text(json.dumps(long))
    tuned = {"lwf": {"lwf_alpha": 4.0, "lwf_temperature": 1.0}}
    (tmp_path / "results" / "tune-replay-lwf-1025.json").write_text(json.dumps(
        {"plan_fingerprint": "t" * 16, "scenarios": {"class": {"chosen": tuned}}}))
    plan = load_plan(tmp_path / "studies" / pad)
    assert plan["tokens"] == 1025 and plan["first_experience"] == "shared"
    assert plan["scenarios"]["class"]["chosen_from"]["chosen"] == {**long["scenarios"]["class"]["chosen"], **tuned}
    assert plan["scenarios"]["task"]["chosen_from"]["chosen"] == long["scenarios"]["task"]["chosen"]
    assert [(h["id"], h["role"], h["metric"]) for h in plan["hypotheses"]] == [
        (f"{kind}{i}", role, metric) for kind, role, metric in (("H", "primary", "forgetting"),
                                                                ("S", "secondary", "stream_accuracy"))
        for i in (1, 2, 3)]
    # The dry check a user runs: the plan written, nothing trained.
    from cl_streamkl.experiment.study.command import main

    for path in (tmp_path / "studies" / pad, STUDIES / long4097):
        out = tmp_path / f"dry-{path.stem}"
        assert main([str(path), "--part", "plan", "--out", str(out), "--workers", "0"]) == 0
        assert json.loads((out / "plan.json").read_text())["test_seeds"] == read_mapping(path)["test_seeds"]
        assert not (out / "units").exists() or not list((out / "units").iterdir())
    assert "first 0/" in capsys.readouterr().out
